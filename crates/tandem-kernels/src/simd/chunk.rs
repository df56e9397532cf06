//! What the AVX2 (`attn256`) and AVX-512 (`attn512`) chunk kernels share: the work item, whether it fits
//! them, and the geometry of its blocks and score rows, so both walk the cache the same way.

use crate::attention::AttnParams;

/// Tokens per KV block the chunk kernels take.
pub(crate) const BLOCK: usize = 16;
/// Largest chunk the kernels' stack buffers hold.
pub(crate) const MAX_QUERIES: usize = 16;
/// Largest head the kernels' stack buffers hold.
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// One work item: queries of one chunk of one head and where their outputs go (query `i` is at absolute
/// position `first_pos + i`, its `head_dim` values start at `q + i * stride`, its output at
/// `out + i * stride`), and the kv head `kvh` they read from the layer buffer `kv` through the sequence's
/// block table `blocks`.
pub(crate) struct QueryChunk<'a> {
    /// The first query's values.
    pub q: *const f32,
    /// The first query's output.
    pub out: *mut f32,
    /// Floats from one query (and output) to the next.
    pub stride: usize,
    /// Queries in the chunk.
    pub n: usize,
    /// Absolute position of the first query.
    pub first_pos: usize,
    /// The layer's KV buffer.
    pub kv: &'a [f32],
    /// The sequence's block table.
    pub blocks: &'a [u32],
    /// The kv head the chunk's head reads.
    pub kvh: usize,
}

/// Whether the chunk kernels apply: 16-token blocks, a head of whole 32-float steps (llama.cpp's dot
/// product has no scalar tail then), a chunk they can hold.
pub(crate) fn supports(p: &AttnParams, n_queries: usize) -> bool {
    p.block_size == BLOCK
        && p.head_dim.is_multiple_of(32)
        && p.head_dim <= MAX_HEAD_DIM
        && n_queries <= MAX_QUERIES
}

/// Which half of a cache block: its keys or its values.
#[derive(Clone, Copy)]
pub(crate) enum Half {
    /// The keys: the first half of a block.
    K = 0,
    /// The values: the second half.
    V = 1,
}

/// The blocks a chunk reads and the layout of its score rows: query `i`'s scores of positions `base..`
/// are row `i`, `row_len` long (through the last query's block).
pub(crate) struct Span {
    /// The head's dimension.
    pub hd: usize,
    nkv: usize,
    window: Option<usize>,
    first_pos: usize,
    first_block: usize,
    end_block: usize,
    /// First position of the first block: column 0 of every row.
    pub base: usize,
    /// Scores per row.
    pub row_len: usize,
}

impl Span {
    /// The span of chunk `c` under `p`: from the block of the first query's window start through the last
    /// query's block.
    #[inline(always)]
    pub fn new(p: &AttnParams, c: &QueryChunk) -> Self {
        let window = p.window;
        let first_block = window_start(window, c.first_pos) / BLOCK;
        let end_block = (c.first_pos + c.n - 1) / BLOCK + 1;
        let base = first_block * BLOCK;
        Span {
            hd: p.head_dim,
            nkv: p.n_kv_heads,
            window,
            first_pos: c.first_pos,
            first_block,
            end_block,
            base,
            row_len: end_block * BLOCK - base,
        }
    }

    /// The first position the query at `pos` sees (its window's start).
    #[inline(always)]
    pub fn window_start(&self, pos: usize) -> usize {
        window_start(self.window, pos)
    }

    /// The blocks of the span in position order: each block's first position and its id in `table`.
    #[inline(always)]
    pub fn blocks<'t>(&self, table: &'t [u32]) -> impl Iterator<Item = (usize, usize)> + 't {
        table
            .iter()
            .enumerate()
            .take(self.end_block)
            .skip(self.first_block)
            .map(|(bi, &b)| (bi * BLOCK, b as usize))
    }

    /// Query `i`'s position and its window's start, if it sees any position of the block at `bpos`.
    #[inline(always)]
    pub fn sees(&self, i: usize, bpos: usize) -> Option<(usize, usize)> {
        let pos = self.first_pos + i;
        let lo = self.window_start(pos);
        (bpos <= pos && bpos + BLOCK > lo).then_some((pos, lo))
    }

    /// Slot `slot` of the `half` of block `b` of the chunk's kv head.
    ///
    /// # Safety
    /// Block `b` must lie inside `c.kv`.
    #[inline(always)]
    pub unsafe fn at(&self, c: &QueryChunk, b: usize, half: Half, slot: usize) -> *const f32 {
        c.kv.as_ptr()
            .add(((b * 2 + half as usize) * self.nkv + c.kvh) * BLOCK * self.hd + slot * self.hd)
    }
}

/// The first position a query at `pos` sees under an optional sliding window.
#[inline(always)]
fn window_start(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}
