//! Host-side planning of one step: the flat batch turned into the small index arrays the kernels read
//! (token ids, positions, KV slots, per-sequence ranges, prefill tiles, decode list, logits rows), and
//! the fixed-capacity layout those arrays have in one device buffer so that captured graphs stay valid.

use tandem_model::{ForwardBatch, LogitsWanted};

use crate::error::CudaError;

/// Query rows per prefill attention tile (`PF_ROWS` in the kernels).
pub const PREFILL_TILE_ROWS: usize = 128;

/// Everything the kernels need to know about one step, as `i32` arrays ready to upload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Token id of every new token.
    pub tokens: Vec<i32>,
    /// Absolute position of every new token (RoPE).
    pub positions: Vec<i32>,
    /// KV slot (`block * block_size + offset`) each new token's K/V is written to.
    pub slots: Vec<i32>,
    /// Per non-empty chunk: its first row in the batch.
    pub seq_qrow: Vec<i32>,
    /// Per non-empty chunk: its number of new tokens.
    pub seq_nq: Vec<i32>,
    /// Per non-empty chunk: tokens already cached before it.
    pub seq_pos: Vec<i32>,
    /// Per non-empty chunk: offset of its block table in `block_tables`.
    pub seq_bt: Vec<i32>,
    /// Per prefill attention tile: the chunk (index into the `seq_*` arrays) it belongs to.
    pub tile_seq: Vec<i32>,
    /// Per prefill attention tile: its first row within the chunk.
    pub tile_q0: Vec<i32>,
    /// Per single-token chunk (decode): its batch row.
    pub dec_row: Vec<i32>,
    /// Per single-token chunk: context length including the new token.
    pub dec_ctx: Vec<i32>,
    /// Per single-token chunk: offset of its block table in `block_tables`.
    pub dec_bt: Vec<i32>,
    /// Batch rows whose logits are returned, in output order.
    pub logit_rows: Vec<i32>,
    /// All chunks' block tables, concatenated.
    pub block_tables: Vec<i32>,
    /// Largest chunk length (grid size of the reference attention kernel).
    pub max_nq: usize,
    /// Longest context of any decode entry (how many partitions the decode kernel needs).
    pub max_dec_ctx: usize,
}

/// Limits a batch is checked against before any index reaches a kernel.
#[derive(Clone, Copy, Debug)]
pub struct PlanLimits {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool (ids must be below).
    pub num_blocks: usize,
    /// Vocabulary size (token ids must be below).
    pub vocab_size: usize,
    /// Positions the RoPE table covers.
    pub max_positions: usize,
}

impl StepPlan {
    /// Rebuilds the plan for `batch` (reusing allocations), validating it the way the CPU model does.
    pub fn build(&mut self, batch: &ForwardBatch, lim: &PlanLimits) -> Result<(), CudaError> {
        for v in [
            &mut self.tokens,
            &mut self.positions,
            &mut self.slots,
            &mut self.seq_qrow,
            &mut self.seq_nq,
            &mut self.seq_pos,
            &mut self.seq_bt,
            &mut self.tile_seq,
            &mut self.tile_q0,
            &mut self.dec_row,
            &mut self.dec_ctx,
            &mut self.dec_bt,
            &mut self.logit_rows,
            &mut self.block_tables,
        ] {
            v.clear();
        }
        self.max_nq = 0;
        self.max_dec_ctx = 0;
        if lim.block_size == 0 {
            return Err(CudaError::Batch("KV block size is zero".into()));
        }
        let mut next = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.start != next
                || s.tokens.end < s.tokens.start
                || s.tokens.end > batch.tokens.len()
            {
                return Err(CudaError::Batch(format!(
                    "sequence {i}: token range {:?} does not continue at {next} within {} tokens",
                    s.tokens,
                    batch.tokens.len()
                )));
            }
            next = s.tokens.end;
            let n = s.tokens.len();
            let end = s.pos + n;
            if n == 0 {
                if s.logits != LogitsWanted::None {
                    return Err(CudaError::Batch(format!(
                        "sequence {i}: logits wanted for an empty chunk"
                    )));
                }
                continue;
            }
            if end > lim.max_positions {
                return Err(CudaError::Batch(format!(
                    "sequence {i}: position {end} beyond the model's {} positions",
                    lim.max_positions
                )));
            }
            let needed = end.div_ceil(lim.block_size);
            if s.blocks.len() < needed {
                return Err(CudaError::Batch(format!(
                    "sequence {i}: {} blocks of {} cannot hold {end} tokens",
                    s.blocks.len(),
                    lim.block_size
                )));
            }
            if let Some(b) = s.blocks[..needed]
                .iter()
                .find(|&&b| b as usize >= lim.num_blocks)
            {
                return Err(CudaError::Batch(format!(
                    "sequence {i}: block {b} beyond the pool of {}",
                    lim.num_blocks
                )));
            }
            let chunk = self.seq_qrow.len() as i32;
            let bt_off = self.block_tables.len() as i32;
            self.block_tables
                .extend(s.blocks[..needed].iter().map(|&b| b as i32));
            self.seq_qrow.push(s.tokens.start as i32);
            self.seq_nq.push(n as i32);
            self.seq_pos.push(s.pos as i32);
            self.seq_bt.push(bt_off);
            self.max_nq = self.max_nq.max(n);
            for pos in s.pos..end {
                self.positions.push(pos as i32);
                let block = s.blocks[pos / lim.block_size] as usize;
                self.slots
                    .push((block * lim.block_size + pos % lim.block_size) as i32);
            }
            if n == 1 {
                self.dec_row.push(s.tokens.start as i32);
                self.dec_ctx.push(end as i32);
                self.dec_bt.push(bt_off);
                self.max_dec_ctx = self.max_dec_ctx.max(end);
            } else {
                for q0 in (0..n).step_by(PREFILL_TILE_ROWS) {
                    self.tile_seq.push(chunk);
                    self.tile_q0.push(q0 as i32);
                }
            }
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => self.logit_rows.push(s.tokens.end as i32 - 1),
                LogitsWanted::All => self.logit_rows.extend(s.tokens.clone().map(|r| r as i32)),
            }
        }
        if next != batch.tokens.len() {
            return Err(CudaError::Batch(format!(
                "{} tokens but sequences cover {next}",
                batch.tokens.len()
            )));
        }
        for &t in &batch.tokens {
            if t as usize >= lim.vocab_size {
                return Err(CudaError::Batch(format!(
                    "token {t} beyond the vocabulary of {}",
                    lim.vocab_size
                )));
            }
            self.tokens.push(t as i32);
        }
        Ok(())
    }

    /// Number of new tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}

/// Which array of a [`StepPlan`] a region of the metadata buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// [`StepPlan::tokens`].
    Tokens,
    /// [`StepPlan::positions`].
    Positions,
    /// [`StepPlan::slots`].
    Slots,
    /// [`StepPlan::seq_qrow`].
    SeqQrow,
    /// [`StepPlan::seq_nq`].
    SeqNq,
    /// [`StepPlan::seq_pos`].
    SeqPos,
    /// [`StepPlan::seq_bt`].
    SeqBt,
    /// [`StepPlan::tile_seq`].
    TileSeq,
    /// [`StepPlan::tile_q0`].
    TileQ0,
    /// [`StepPlan::dec_row`].
    DecRow,
    /// [`StepPlan::dec_ctx`].
    DecCtx,
    /// [`StepPlan::dec_bt`].
    DecBt,
    /// [`StepPlan::logit_rows`].
    LogitRows,
    /// [`StepPlan::block_tables`].
    BlockTables,
}

/// Every region, in buffer order.
pub const REGIONS: [Region; 14] = [
    Region::Tokens,
    Region::Positions,
    Region::Slots,
    Region::SeqQrow,
    Region::SeqNq,
    Region::SeqPos,
    Region::SeqBt,
    Region::TileSeq,
    Region::TileQ0,
    Region::DecRow,
    Region::DecCtx,
    Region::DecBt,
    Region::LogitRows,
    Region::BlockTables,
];

impl StepPlan {
    /// The array a region holds.
    pub fn region(&self, r: Region) -> &[i32] {
        match r {
            Region::Tokens => &self.tokens,
            Region::Positions => &self.positions,
            Region::Slots => &self.slots,
            Region::SeqQrow => &self.seq_qrow,
            Region::SeqNq => &self.seq_nq,
            Region::SeqPos => &self.seq_pos,
            Region::SeqBt => &self.seq_bt,
            Region::TileSeq => &self.tile_seq,
            Region::TileQ0 => &self.tile_q0,
            Region::DecRow => &self.dec_row,
            Region::DecCtx => &self.dec_ctx,
            Region::DecBt => &self.dec_bt,
            Region::LogitRows => &self.logit_rows,
            Region::BlockTables => &self.block_tables,
        }
    }
}

/// Fixed offsets of every region in one `i32` device buffer, sized for the largest step: kernel
/// arguments point at fixed addresses, so a graph captured once replays with new contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaLayout {
    offsets: [usize; 14],
    caps: [usize; 14],
    total: usize,
}

impl MetaLayout {
    /// Capacities for steps of at most `max_tokens` tokens in `max_seqs` chunks, each chunk's block
    /// table at most `max_blocks_per_seq` long.
    pub fn new(max_tokens: usize, max_seqs: usize, max_blocks_per_seq: usize) -> MetaLayout {
        let max_seqs = max_seqs.min(max_tokens).max(1);
        let tiles = max_tokens / PREFILL_TILE_ROWS + max_seqs;
        let mut offsets = [0; 14];
        let mut caps = [0; 14];
        let mut total: usize = 0;
        for (i, r) in REGIONS.iter().enumerate() {
            let cap = match r {
                Region::Tokens | Region::Positions | Region::Slots | Region::LogitRows => {
                    max_tokens
                }
                Region::SeqQrow
                | Region::SeqNq
                | Region::SeqPos
                | Region::SeqBt
                | Region::DecRow
                | Region::DecCtx
                | Region::DecBt => max_seqs,
                Region::TileSeq | Region::TileQ0 => tiles,
                Region::BlockTables => max_seqs * max_blocks_per_seq,
            };
            // Keep every region 16-byte aligned.
            total = total.next_multiple_of(4);
            offsets[i] = total;
            caps[i] = cap;
            total += cap;
        }
        MetaLayout {
            offsets,
            caps,
            total,
        }
    }

    /// Offset (in `i32` elements) of a region.
    pub fn offset(&self, r: Region) -> usize {
        self.offsets[REGIONS
            .iter()
            .position(|x| *x == r)
            .expect("every region is listed")]
    }

    /// Capacity (in `i32` elements) of a region.
    pub fn capacity(&self, r: Region) -> usize {
        self.caps[REGIONS
            .iter()
            .position(|x| *x == r)
            .expect("every region is listed")]
    }

    /// Elements in the whole buffer.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Checks that a plan fits, naming the first region that does not.
    pub fn check(&self, plan: &StepPlan) -> Result<(), CudaError> {
        for r in REGIONS {
            let n = plan.region(r).len();
            if n > self.capacity(r) {
                return Err(CudaError::Batch(format!(
                    "step needs {n} entries of {r:?}, the buffers hold {} (raise max_num_batched_tokens / max_num_seqs)",
                    self.capacity(r)
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim() -> PlanLimits {
        PlanLimits {
            block_size: 4,
            num_blocks: 16,
            vocab_size: 100,
            max_positions: 64,
        }
    }

    #[test]
    fn mixed_batch_splits_into_decodes_tiles_and_logit_rows() {
        let mut b = ForwardBatch::default();
        // A decode at position 5 (blocks 3, 7), a 70-token prefill chunk after 2 cached tokens, an
        // all-logits chunk of 2.
        b.push(&[9], 5, vec![3, 7], LogitsWanted::Last);
        let long: Vec<u32> = (0..70).collect();
        b.push(&long, 2, (0..18).collect(), LogitsWanted::None);
        b.push(&[1, 2], 0, vec![15], LogitsWanted::All);
        let mut p = StepPlan::default();
        p.build(
            &b,
            &PlanLimits {
                num_blocks: 32,
                max_positions: 128,
                ..lim()
            },
        )
        .unwrap();
        assert_eq!(p.num_tokens(), 73);
        // Decode token: position 5 lives in block 7 (second of its table), offset 1.
        assert_eq!(p.positions[0], 5);
        assert_eq!(p.slots[0], 7 * 4 + 1);
        assert_eq!(p.dec_row, vec![0]);
        assert_eq!(p.dec_ctx, vec![6]);
        assert_eq!(p.max_dec_ctx, 6);
        // The 70-token chunk is one tile of 128 rows, the 2-token chunk is one tile.
        assert_eq!(PREFILL_TILE_ROWS, 128);
        assert_eq!(p.tile_seq, vec![1, 2]);
        assert_eq!(p.tile_q0, vec![0, 0]);
        assert_eq!(p.seq_qrow, vec![0, 1, 71]);
        assert_eq!(p.seq_nq, vec![1, 70, 2]);
        assert_eq!(p.seq_pos, vec![5, 2, 0]);
        // Block tables are trimmed to what the context needs: 2, 18 (72 tokens) and 1 blocks.
        assert_eq!(p.seq_bt, vec![0, 2, 20]);
        assert_eq!(p.block_tables.len(), 21);
        assert_eq!(p.positions[1], 2);
        assert_eq!(p.slots[1], 2, "position 2 of block 0");
        assert_eq!(
            p.slots[70],
            17 * 4 + 3,
            "position 71 is entry 17 of the table"
        );
        assert_eq!(p.logit_rows, vec![0, 71, 72]);
        assert_eq!(p.max_nq, 70);
    }

    #[test]
    fn rejects_what_would_index_out_of_bounds() {
        let mut p = StepPlan::default();
        let mut b = ForwardBatch::default();
        b.push(&[1, 2, 3, 4, 5], 0, vec![0], LogitsWanted::Last);
        let err = p.build(&b, &lim()).unwrap_err().to_string();
        assert!(err.contains("cannot hold 5 tokens"), "{err}");

        b.clear();
        b.push(&[1], 0, vec![16], LogitsWanted::Last);
        assert!(p
            .build(&b, &lim())
            .unwrap_err()
            .to_string()
            .contains("beyond the pool"));

        b.clear();
        b.push(&[100], 0, vec![0], LogitsWanted::Last);
        assert!(p
            .build(&b, &lim())
            .unwrap_err()
            .to_string()
            .contains("vocabulary"));

        b.clear();
        b.push(&[1], 64, vec![0; 17], LogitsWanted::Last);
        assert!(p
            .build(&b, &lim())
            .unwrap_err()
            .to_string()
            .contains("positions"));

        b.clear();
        b.push(&[], 0, vec![], LogitsWanted::Last);
        assert!(p
            .build(&b, &lim())
            .unwrap_err()
            .to_string()
            .contains("empty chunk"));
    }

    #[test]
    fn layout_regions_are_disjoint_aligned_and_checked() {
        let l = MetaLayout::new(512, 64, 32);
        let mut spans: Vec<(usize, usize)> = REGIONS
            .iter()
            .map(|&r| (l.offset(r), l.offset(r) + l.capacity(r)))
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "regions overlap: {w:?}");
        }
        assert!(REGIONS.iter().all(|&r| l.offset(r).is_multiple_of(4)));
        assert_eq!(l.capacity(Region::BlockTables), 64 * 32);
        assert_eq!(l.capacity(Region::TileSeq), 512 / PREFILL_TILE_ROWS + 64);
        assert!(spans.last().unwrap().1 <= l.total());

        let mut p = StepPlan::default();
        let mut b = ForwardBatch::default();
        for s in 0..3 {
            b.push(&[1], 0, vec![s], LogitsWanted::Last);
        }
        p.build(&b, &lim()).unwrap();
        assert!(MetaLayout::new(512, 3, 1).check(&p).is_ok());
        let err = MetaLayout::new(512, 2, 1)
            .check(&p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("SeqQrow"), "{err}");
    }
}
