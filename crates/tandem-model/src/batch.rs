//! The contract between a scheduler and a model backend: one flat, variable-length batch per step,
//! and the layout of the paged KV cache the backend reads and writes.

use std::ops::Range;

/// Which logits a sequence in the batch wants back from a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LogitsWanted {
    /// No logits: a prefill chunk that is not the prompt's last.
    None,
    /// One row, for the chunk's last token: the usual case for sampling.
    Last,
    /// One row per token of the chunk: teacher-forced evaluation and prompt logprobs.
    All,
}

/// One sequence's slice of a step: a run of new tokens appended after `pos` cached tokens.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SeqChunk {
    /// The chunk's tokens, as a range into [`ForwardBatch::tokens`].
    pub tokens: Range<usize>,
    /// How many tokens of this sequence are already in the KV cache (the position of the chunk's first token).
    pub pos: usize,
    /// The sequence's block table: physical block ids covering at least `pos + tokens.len()` tokens.
    pub blocks: Vec<u32>,
    /// Which logits to return for this chunk.
    pub logits: LogitsWanted,
}

/// A flat batch mixing prefill chunks and decode tokens of many sequences; no padding.
///
/// Kept by the caller across steps and cleared with [`ForwardBatch::clear`] so that its buffers are reused.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ForwardBatch {
    /// All new tokens of the step, sequence after sequence.
    pub tokens: Vec<u32>,
    /// The sequences of the step, in the order their tokens appear in `tokens`.
    pub seqs: Vec<SeqChunk>,
}

impl ForwardBatch {
    /// Empties the batch, keeping its allocations for the next step.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.seqs.clear();
    }

    /// Appends one sequence's chunk of tokens.
    pub fn push(&mut self, tokens: &[u32], pos: usize, blocks: Vec<u32>, logits: LogitsWanted) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.seqs.push(SeqChunk {
            tokens: start..self.tokens.len(),
            pos,
            blocks,
            logits,
        });
    }

    /// Number of logits rows a forward pass over this batch returns.
    pub fn logits_rows(&self) -> usize {
        self.seqs
            .iter()
            .map(|s| match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.tokens.len(),
            })
            .sum()
    }
}

/// The shape of a paged KV cache, as two workers must agree on it before moving blocks.
///
/// Per layer the cache is one buffer of `num_blocks` blocks; block `b` holds
/// `[K|V][kv_head][slot][head_dim]` contiguously, so one (layer, block) pair is one contiguous byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvLayout {
    /// Transformer layers, each with its own K and V.
    pub n_layers: usize,
    /// Key/value heads (GQA groups), not query heads.
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Element type of the cache.
    pub dtype: KvDtype,
}

/// Element type of KV cache entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvDtype {
    /// 32-bit float: the CPU backend's cache, exact against the reference implementations.
    F32,
    /// bfloat16: the GPU backend's cache.
    Bf16,
    /// FP8 E4M3 codes of value / a per-tensor scale (the GPU backend's `kv_cache_dtype: fp8`): half of
    /// bf16's bytes to hold, read each decode step and move from prefill to decode.
    Fp8E4m3,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
            KvDtype::Fp8E4m3 => 1,
        }
    }
}

impl KvLayout {
    /// Elements in one block of one layer (K and V together).
    pub fn block_elems(&self) -> usize {
        2 * self.n_kv_heads * self.block_size * self.head_dim
    }

    /// Bytes in one block of one layer: the unit of KV export, import and transfer.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Bytes of KV a single token occupies across all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.dtype.size()
    }

    /// The whole model's cache shape (all layers, all KV heads) with as many `block_size`-token blocks as
    /// `bytes` holds: what a backend reports and workers compare, however it splits the model inside.
    pub fn for_budget(
        config: &crate::config::ModelConfig,
        block_size: usize,
        bytes: usize,
        dtype: KvDtype,
    ) -> KvLayout {
        let mut layout = KvLayout {
            n_layers: config.num_layers,
            n_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            block_size,
            num_blocks: 0,
            dtype,
        };
        layout.num_blocks = bytes / (layout.n_layers * layout.block_bytes()).max(1);
        layout
    }
}
