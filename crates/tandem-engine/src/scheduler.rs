//! Continuous batching: decides which tokens of which sequences run in the next step.
//!
//! FCFS over a waiting queue and a running list (oldest first). Each step has a token budget;
//! decodes of running sequences are scheduled first, then unfinished prefills of running sequences,
//! then new arrivals (with chunked prefill a long prompt takes several steps). When a decode cannot
//! get a block, the NEWEST running sequence is preempted: its blocks are freed and it returns to the
//! front of the waiting queue, to recompute prompt and generated tokens later.

use crate::block_pool::{BlockPool, BlockTable};
use crate::types::RequestId;
use std::collections::VecDeque;
use tandem_model::{ForwardBatch, LogitsWanted};

/// Where a newly admitted request's cached prefix may continue beyond the blocks the pool holds: the
/// engine's KV tiers copy evicted blocks back up at admission, so that no token a tier holds is
/// recomputed (and a preempted request's KV comes back the same way).
pub trait PrefixSource {
    /// Appends to `table` (which holds exactly the pool's cached prefix of `tokens`, every block named)
    /// restored full blocks of `tokens` that follow it, taking each from `pool`, until `table` holds
    /// `max_blocks` blocks or the next block is not held; returns how many it appended.
    fn extend(
        &mut self,
        pool: &mut BlockPool,
        table: &mut BlockTable,
        tokens: &[u32],
        max_blocks: usize,
    ) -> usize;
}

/// No source beyond the pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolOnly;

impl PrefixSource for PoolOnly {
    fn extend(&mut self, _: &mut BlockPool, _: &mut BlockTable, _: &[u32], _: usize) -> usize {
        0
    }
}

/// Scheduling knobs taken from the engine config.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences that may run at once.
    pub max_num_seqs: usize,
    /// Tokens per step across all sequences.
    pub max_num_batched_tokens: usize,
    /// Whether a prompt may be split over several steps.
    pub chunked_prefill: bool,
}

/// One request's scheduling state; `ext` carries whatever the engine keeps per request.
#[derive(Debug)]
pub struct Sequence<E> {
    /// The request id.
    pub id: RequestId,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Length of the original prompt within `tokens`.
    pub prompt_len: usize,
    /// Leading tokens whose KV is in the cache.
    pub num_computed: usize,
    /// The sequence's blocks.
    pub table: BlockTable,
    /// The prompt is scored position by position (prompt logprobs): every prompt chunk returns all its
    /// logits rows, and the prefix cache is bypassed so that no prompt position goes uncomputed.
    pub score_prompt: bool,
    /// Engine-specific per-request data.
    pub ext: E,
}

impl<E> Sequence<E> {
    /// A new sequence with nothing computed.
    pub fn new(id: RequestId, prompt: Vec<u32>, ext: E) -> Self {
        let prompt_len = prompt.len();
        Self {
            id,
            tokens: prompt,
            prompt_len,
            num_computed: 0,
            table: BlockTable::default(),
            score_prompt: false,
            ext,
        }
    }

    /// Whether the next prompt chunk must return every logits row: scoring was asked for and the first
    /// token is not out yet (a sequence preempted after it recomputes without scoring).
    pub fn scoring_prompt(&self) -> bool {
        self.score_prompt && self.tokens.len() == self.prompt_len
    }

    /// Tokens still to be run through the model before the next token can be sampled.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Tokens generated so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// One sequence's part of a scheduled step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// Index into [`Scheduler::running`] (valid until the step's results are applied).
    pub index: usize,
    /// Tokens of this sequence in the step.
    pub len: usize,
    /// Whether the step yields a logits row for it (its chunk reaches the end of its tokens).
    pub sample: bool,
}

/// The waiting queue and running list, and the policy over them.
#[derive(Debug)]
pub struct Scheduler<E> {
    cfg: SchedulerConfig,
    /// Requests not yet running, in arrival order (preempted ones at the front).
    pub waiting: VecDeque<Sequence<E>>,
    /// Running requests, oldest first.
    pub running: Vec<Sequence<E>>,
    scheduled: Vec<Scheduled>,
    preempted: Vec<RequestId>,
    out_of_room: Vec<RequestId>,
}

impl<E> Scheduler<E> {
    /// An empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0);
        Self {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            scheduled: Vec::new(),
            preempted: Vec::new(),
            out_of_room: Vec::new(),
        }
    }

    /// The knobs this scheduler runs with.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The chunks of the last scheduled step, in batch order.
    pub fn scheduled(&self) -> &[Scheduled] {
        &self.scheduled
    }

    /// Requests preempted while scheduling the last step.
    pub fn preempted(&self) -> &[RequestId] {
        &self.preempted
    }

    /// Running requests that could not grow even alone in the pool (they must finish with Length).
    pub fn out_of_room(&self) -> &[RequestId] {
        &self.out_of_room
    }

    /// Queues a new request behind the others.
    pub fn add(&mut self, seq: Sequence<E>) {
        self.waiting.push_back(seq);
    }

    /// Adds a sequence whose KV is already complete (imported), straight into the running list.
    pub fn add_running(&mut self, seq: Sequence<E>) {
        self.running.push(seq);
    }

    /// Removes a request wherever it is; the caller releases its blocks.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence<E>> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }

    /// Applies a chunk of the last plan once the model has run it: the sequence's KV now covers the
    /// chunk's tokens, whose full blocks become reusable prefix. Returns the chunk's first position.
    /// Shared by the engine thread and the simulator (`tandem-sim`), so both advance sequences alike.
    pub fn advance(&mut self, pool: &mut BlockPool, s: Scheduled) -> usize {
        let seq = &mut self.running[s.index];
        let start = seq.num_computed;
        seq.num_computed += s.len;
        pool.register_computed(&mut seq.table, &seq.tokens, seq.num_computed);
        start
    }

    fn preempt_newest(&mut self, pool: &mut BlockPool) {
        let mut seq = self.running.pop().expect("preempt with nothing running");
        pool.release(&mut seq.table);
        seq.num_computed = 0;
        self.preempted.push(seq.id);
        self.waiting.push_front(seq);
    }

    /// Plans the next step and writes it into `batch` (cleared first). The plan is then available from
    /// [`Self::scheduled`]; an empty plan means nothing can run until blocks are released.
    pub fn schedule(&mut self, pool: &mut BlockPool, batch: &mut ForwardBatch) {
        self.schedule_with(pool, batch, &mut PoolOnly);
    }

    /// [`Self::schedule`] where an admitted request's cached prefix continues in `source` (KV tiers).
    pub fn schedule_with(
        &mut self,
        pool: &mut BlockPool,
        batch: &mut ForwardBatch,
        source: &mut dyn PrefixSource,
    ) {
        self.scheduled.clear();
        self.preempted.clear();
        self.out_of_room.clear();
        loop {
            self.plan(pool, source);
            if !self.scheduled.is_empty() || self.running.len() <= 1 {
                break;
            }
            // Running prefills hold all blocks and none can progress: free the newest and retry.
            self.preempt_newest(pool);
        }
        self.fill_batch(pool.block_size(), batch);
    }

    fn plan(&mut self, pool: &mut BlockPool, source: &mut dyn PrefixSource) {
        let bs = pool.block_size();
        let mut budget = self.cfg.max_num_batched_tokens;

        // 1. Decodes, oldest first; a decode that cannot grow preempts the newest running sequence.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].remaining() != 1 {
                i += 1;
                continue;
            }
            let need = self.running[i].num_computed + 1;
            let mut scheduled = false;
            loop {
                let n_running = self.running.len();
                let seq = &mut self.running[i];
                if pool.ensure_capacity(&mut seq.table, need).is_ok() {
                    scheduled = true;
                    break;
                }
                if n_running == 1 && pool.num_used() == seq.table.blocks.len() {
                    // Alone, holding every referenced block, and still no room: no preemption helps.
                    self.out_of_room.push(seq.id);
                    break;
                }
                let newest_is_self = i + 1 == n_running;
                self.preempt_newest(pool);
                if newest_is_self {
                    break;
                }
            }
            if scheduled {
                self.scheduled.push(Scheduled {
                    index: i,
                    len: 1,
                    sample: true,
                });
                budget -= 1;
                i += 1;
            } else if !self.out_of_room.is_empty() {
                i += 1;
            } else {
                // `i` itself was preempted: nothing after it remains.
                break;
            }
        }

        // 2. Unfinished prefills of running sequences (chunks sized to budget and free blocks).
        for i in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let seq = &mut self.running[i];
            if seq.remaining() <= 1 {
                continue;
            }
            let Some(len) = chunk_len(&self.cfg, seq, budget, pool, bs, !self.scheduled.is_empty())
            else {
                break;
            };
            pool.ensure_capacity(&mut seq.table, seq.num_computed + len)
                .expect("chunk sized to fit");
            self.scheduled.push(Scheduled {
                index: i,
                len,
                sample: seq.num_computed + len == seq.tokens.len(),
            });
            budget = budget.saturating_sub(len);
        }

        // 3. New (or preempted) requests, FCFS; none are admitted in a step that had to preempt.
        while budget > 0 && self.preempted.is_empty() && self.running.len() < self.cfg.max_num_seqs
        {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            let mut looked_up = false;
            if seq.table.is_empty() && seq.num_computed == 0 && !seq.scoring_prompt() {
                pool.match_prefix_unrecorded(&mut seq.table, &seq.tokens);
                looked_up = true;
                // Blocks past the pool's prefix come back from the tiers, keeping one obtainable block
                // for the first chunk, and never past the prompt's last full block before its final
                // token (which the model must compute to sample).
                let max_blocks = (seq.tokens.len().saturating_sub(1) / bs)
                    .min(seq.table.blocks.len() + pool.num_available().saturating_sub(1));
                if pool.caching() && seq.table.blocks.len() < max_blocks {
                    source.extend(pool, &mut seq.table, &seq.tokens, max_blocks);
                }
                seq.num_computed = seq.table.blocks.len() * bs;
            }
            let Some(len) = chunk_len(&self.cfg, seq, budget, pool, bs, !self.scheduled.is_empty())
            else {
                // Give matched prefix blocks back so they stay evictable while this request waits
                // (restored ones stay cached in the pool: the next lookup finds them there).
                pool.release(&mut seq.table);
                seq.num_computed = 0;
                break;
            };
            if looked_up {
                // Counted once, when admitted, however many steps the request waited; restored
                // tokens count as hits (the tiers count theirs per tier too).
                pool.record_lookup(seq.tokens.len(), seq.num_computed);
            }
            pool.ensure_capacity(&mut seq.table, seq.num_computed + len)
                .expect("chunk sized to fit");
            let sample = seq.num_computed + len == seq.tokens.len();
            let seq = self.waiting.pop_front().expect("front exists");
            self.running.push(seq);
            self.scheduled.push(Scheduled {
                index: self.running.len() - 1,
                len,
                sample,
            });
            budget = budget.saturating_sub(len);
        }
    }

    fn fill_batch(&self, block_size: usize, batch: &mut ForwardBatch) {
        // Reuse each SeqChunk's block-table Vec from earlier steps instead of allocating new ones.
        batch.tokens.clear();
        let mut spare = std::mem::take(&mut batch.seqs);
        for (k, s) in self.scheduled.iter().enumerate() {
            let seq = &self.running[s.index];
            let toks = &seq.tokens[seq.num_computed..seq.num_computed + s.len];
            let nblocks = (seq.num_computed + s.len).div_ceil(block_size);
            let logits = if seq.scoring_prompt() {
                LogitsWanted::All
            } else if s.sample {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            let start = batch.tokens.len();
            batch.tokens.extend_from_slice(toks);
            if k < spare.len() {
                let c = &mut spare[k];
                c.tokens = start..batch.tokens.len();
                c.pos = seq.num_computed;
                c.blocks.clear();
                c.blocks.extend_from_slice(&seq.table.blocks[..nblocks]);
                c.logits = logits;
            } else {
                spare.push(tandem_model::SeqChunk {
                    tokens: start..batch.tokens.len(),
                    pos: seq.num_computed,
                    blocks: seq.table.blocks[..nblocks].to_vec(),
                    logits,
                });
            }
        }
        spare.truncate(self.scheduled.len());
        batch.seqs = spare;
    }
}

/// How many of `seq`'s remaining tokens fit this step, or None if none can run.
fn chunk_len<E>(
    cfg: &SchedulerConfig,
    seq: &Sequence<E>,
    budget: usize,
    pool: &BlockPool,
    bs: usize,
    others_scheduled: bool,
) -> Option<usize> {
    let remaining = seq.remaining();
    let fits_blocks = (seq.table.blocks.len() + pool.num_available()) * bs - seq.num_computed;
    let mut len = remaining.min(fits_blocks);
    if cfg.chunked_prefill {
        len = len.min(budget);
    } else if len < remaining || (remaining > budget && others_scheduled) {
        // Without chunking a prompt runs whole; an oversized one runs alone in its own step.
        return None;
    }
    (len > 0).then_some(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        chunked_prefill: bool,
    ) -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            chunked_prefill,
        }
    }

    /// The plan entry for running sequence `index`: `len` tokens this step, sampled or not.
    fn planned(index: usize, len: usize, sample: bool) -> Scheduled {
        Scheduled { index, len, sample }
    }

    /// Pretends the model ran: advances computed counts and appends a token to sampled sequences.
    fn apply(s: &mut Scheduler<()>, pool: &mut BlockPool) {
        let plan = s.scheduled().to_vec();
        for p in plan {
            s.advance(pool, p);
            if p.sample {
                s.running[p.index].tokens.push(7);
            }
        }
    }

    #[test]
    fn long_prompt_is_chunked_and_decodes_go_first() {
        let mut pool = BlockPool::new(64, 4, false);
        let mut s = Scheduler::new(cfg(8, 10, true));
        let mut b = ForwardBatch::default();
        s.add(Sequence::new(1, vec![1; 3], ()));
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled(), &[planned(0, 3, true)]);
        apply(&mut s, &mut pool);
        s.add(Sequence::new(2, vec![2; 25], ()));
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled(), &[planned(0, 1, true), planned(1, 9, false)]);
        assert_eq!(b.tokens.len(), 10);
        assert_eq!(b.seqs[1].pos, 0);
        assert_eq!(b.seqs[1].blocks.len(), 3);
        apply(&mut s, &mut pool);
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled()[1], planned(1, 9, false));
        assert_eq!(b.seqs[1].pos, 9);
        apply(&mut s, &mut pool);
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled()[1], planned(1, 7, true));
        assert_eq!(b.logits_rows(), 2);
    }

    #[test]
    fn newest_running_sequence_is_preempted_and_recomputed() {
        // 4 blocks of 2 tokens: two sequences of 3 tokens fill 2 blocks each.
        let mut pool = BlockPool::new(4, 2, false);
        let mut s = Scheduler::new(cfg(8, 64, true));
        let mut b = ForwardBatch::default();
        s.add(Sequence::new(1, vec![1; 3], ()));
        s.add(Sequence::new(2, vec![2; 3], ()));
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled().len(), 2);
        apply(&mut s, &mut pool);
        s.schedule(&mut pool, &mut b);
        assert_eq!(
            s.scheduled().len(),
            2,
            "position 3 still fits in two blocks"
        );
        apply(&mut s, &mut pool);
        // Both now hold 5 tokens and need a third block to decode; only the oldest gets it.
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.preempted(), &[2]);
        assert_eq!(s.scheduled(), &[planned(0, 1, true)]);
        assert_eq!(s.waiting.front().unwrap().num_computed, 0);
        assert!(s.waiting.front().unwrap().table.is_empty());
        assert_eq!(
            s.waiting.front().unwrap().tokens.len(),
            5,
            "generated tokens kept for recompute"
        );
        pool.check_invariants(&s.running[0].table.blocks).unwrap();
    }

    #[test]
    fn without_chunking_a_prompt_runs_whole() {
        let mut pool = BlockPool::new(64, 4, false);
        let mut s = Scheduler::new(cfg(8, 8, false));
        let mut b = ForwardBatch::default();
        s.add(Sequence::new(1, vec![1; 6], ()));
        s.add(Sequence::new(2, vec![1; 6], ()));
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled(), &[planned(0, 6, true)]);
        apply(&mut s, &mut pool);
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.scheduled().len(), 2);
        // An oversized prompt still runs, alone.
        let mut s2: Scheduler<()> = Scheduler::new(cfg(8, 8, false));
        s2.add(Sequence::new(3, vec![1; 20], ()));
        s2.schedule(&mut pool, &mut b);
        assert_eq!(s2.scheduled(), &[planned(0, 20, true)]);
    }

    /// A tier holding every block of one token sequence: restores them by name.
    struct Tier(Vec<u32>);

    impl PrefixSource for Tier {
        fn extend(
            &mut self,
            pool: &mut BlockPool,
            table: &mut BlockTable,
            tokens: &[u32],
            max_blocks: usize,
        ) -> usize {
            let bs = pool.block_size();
            let mut n = 0;
            while table.blocks.len() < max_blocks {
                let i = table.blocks.len();
                if tokens[..(i + 1) * bs] != self.0[..((i + 1) * bs).min(self.0.len())] {
                    break;
                }
                let h = crate::prefix_cache::hash_block(
                    table.last_hash(),
                    &tokens[i * bs..(i + 1) * bs],
                );
                let b = pool.take_for_restore().expect("room was checked");
                pool.finish_restore(table, b, h);
                n += 1;
            }
            n
        }
    }

    #[test]
    fn admission_restores_from_the_source_and_counts_lookups_once() {
        let toks: Vec<u32> = (0..13).collect();
        let mut pool = BlockPool::new(16, 4, true);
        let mut s: Scheduler<()> = Scheduler::new(cfg(8, 64, true));
        let mut b = ForwardBatch::default();
        let mut tier = Tier(toks.clone());
        s.add(Sequence::new(1, toks.clone(), ()));
        s.schedule_with(&mut pool, &mut b, &mut tier);
        // 12 of 13 tokens in three full blocks come from the source; the last token is computed.
        assert_eq!(s.scheduled(), &[planned(0, 1, true)]);
        assert_eq!(b.seqs[0].pos, 12);
        assert_eq!(b.seqs[0].blocks.len(), 4);
        assert_eq!(pool.prefix_counters(), (13, 12), "restored tokens are hits");
        apply(&mut s, &mut pool);
        let mut done = s.running.pop().unwrap();
        pool.release(&mut done.table);
        // The restored blocks are named: a second request finds them in the pool.
        s.add(Sequence::new(2, toks.clone(), ()));
        s.schedule(&mut pool, &mut b);
        assert_eq!(b.seqs[0].pos, 12);
        assert_eq!(pool.prefix_counters(), (26, 24));

        // A request that waits several steps (no room) is counted once, when admitted.
        let mut pool = BlockPool::new(4, 4, true);
        let mut s: Scheduler<()> = Scheduler::new(cfg(8, 64, false));
        s.add(Sequence::new(1, vec![9; 15], ()));
        s.schedule(&mut pool, &mut b);
        apply(&mut s, &mut pool);
        s.add(Sequence::new(2, vec![8; 6], ()));
        for _ in 0..3 {
            s.schedule(&mut pool, &mut b);
            assert_eq!(s.running.len(), 1, "no room for the second prompt yet");
            apply(&mut s, &mut pool);
        }
        assert_eq!(pool.prefix_counters(), (15, 0));
        let mut done = s.running.pop().unwrap();
        pool.release(&mut done.table);
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.running.len(), 1);
        assert_eq!(pool.prefix_counters(), (21, 0));
    }

    #[test]
    fn max_num_seqs_limits_admission() {
        let mut pool = BlockPool::new(64, 4, false);
        let mut s = Scheduler::new(cfg(2, 64, true));
        let mut b = ForwardBatch::default();
        for id in 0..3 {
            s.add(Sequence::new(id, vec![1; 2], ()));
        }
        s.schedule(&mut pool, &mut b);
        assert_eq!(s.running.len(), 2);
        assert_eq!(s.waiting.len(), 1);
    }
}
