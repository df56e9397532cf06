//! What a [`crate::CudaLlama`] is built with: buffer and KV cache sizes, which kernels run, and the
//! tuning of the GEMV kernels. Plain data: the caller (the `tandem` binary's `cuda:` settings) fills it.

use crate::kernels::{self, DECODE_PARTITION_SMALL};

/// Which attention kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMode {
    /// Tensor-core flash attention for prefill chunks, split-K flash decoding for single tokens.
    Fast,
    /// The one-warp-per-(token, head) reference kernel for everything: the on-device check.
    Simple,
}

/// Sizes of the preallocated buffers and of the KV cache.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of KV cache across all layers (the engine's `kv_cache_memory`).
    pub kv_cache_memory: usize,
    /// Most tokens in one step (the activation buffers are sized for it).
    pub max_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Longest context; `None` = the model's.
    pub max_model_len: Option<usize>,
    /// Rows of logits computed per output-head GEMM (more rows are done in chunks).
    pub logits_chunk_rows: usize,
    /// Attention kernels.
    pub attn: AttnMode,
    /// Capture CUDA graphs for decode-only steps.
    pub graphs: bool,
    /// Use our GEMV kernels instead of cuBLAS for projections of at most `gemv_max_rows` rows.
    pub gemv: bool,
    /// Most rows (tokens of a step) our GEMV kernels take (at most `GEMV_MAX_ROWS`); larger
    /// steps use cuBLAS, which is faster there ([`GEMV_ROWS_DEFAULT`]).
    pub gemv_max_rows: usize,
    /// `gemv_max_rows` of a model whose projections are packed GGUF blocks
    /// ([`PACKED_GEMV_ROWS_DEFAULT`]): their cuBLAS path first dequantizes every matrix to bf16.
    pub packed_gemv_max_rows: usize,
    /// Programmatic dependent launch for our kernels that support it (Hopper and later): the next
    /// kernel starts streaming its weights while the previous one finishes. Off by default: on the
    /// H200 it made a batch-1 decode step slower (4.96 against 4.84 ms, 2026-12-03).
    pub pdl: bool,
    /// Keys per decode-attention partition in steps of at most `SMALL_DECODE_BATCH` sequences (at
    /// most `DECODE_PARTITION_SMALL`): shorter partitions put more blocks to work on a short batch.
    pub decode_partition_small: usize,
    /// Warps a small-batch GEMV launch aims for through split-K ([`GEMV_TARGET_WARPS`] by default).
    pub gemv_target_warps: usize,
    /// Compile-time tuning of the GEMV kernels.
    pub gemv_tuning: kernels::GemvTuning,
    /// Persistent GEMV launches: a grid of the blocks the GPU holds at once, each streaming group
    /// after group of rows, instead of one block per group.
    pub gemv_persistent: bool,
    /// Most (token, expert) slots of a mixture-of-experts step that run on the expert GEMVs (each slot
    /// streams its expert's rows); larger steps run the grouped GEMMs ([`MOE_GEMV_SLOTS_DEFAULT`]).
    pub moe_gemv_max_slots: usize,
    /// Blocks a multiprocessor of the looping decode attention (`attn_decode`) in a captured graph
    /// ([`DECODE_GRAPH_BLOCKS_DEFAULT`]); fewer make each block take more partitions.
    pub decode_graph_blocks_per_sm: usize,
    /// Where compiled kernels are cached across restarts (`None`: compile every time).
    pub kernel_cache_dir: Option<std::path::PathBuf>,
    /// Global layers this instance computes (`None`: all of them): a pipeline stage's share. A stage
    /// without layer 0 takes hidden states instead of tokens; one without the last layer returns
    /// hidden states instead of logits.
    pub layers: Option<std::ops::Range<usize>>,
    /// Blocks of the KV pool (`None`: what `kv_cache_memory` holds for the whole model): a pipeline's
    /// stages all size their pools to the worker's block count.
    pub num_blocks: Option<usize>,
    /// Hold the layers' projection matrices as FP8 E4M3 with one scale per row and 128 columns
    /// (quantized at load; an FP8 checkpoint's dequantized weights are quantized again the same way,
    /// each row of its 128 × 128 blocks getting its own scale): half the bytes each decode step
    /// streams. Embeddings, the output head, norms and mixture-of-experts experts stay bf16.
    pub fp8_weights: bool,
    /// Run FP8 matrices in steps too large for the GEMVs as FP8 tensor-core GEMMs (cuBLASLt, VEC128
    /// scales on weights and activations; checked at load) instead of cuBLAS on bf16 tiles.
    pub fp8_gemm: bool,
    /// Keep a GGUF file's block-quantized projections and output head in their packed GPU layouts
    /// (`crate::packed`: codes and per-chunk scales, the values the CPU decodes), so decode streams
    /// a quarter to half of bf16's bytes; false dequantizes them to bf16 at upload. `fp8_weights`
    /// takes precedence. The embedding gather always reads a bf16 copy.
    pub gguf_packed: bool,
    /// Element type of the KV cache: bf16, or FP8 E4M3 (`kv_cache_dtype: fp8`: half the bytes per
    /// token to hold, to read each decode step and to move from prefill to decode). F32 is refused.
    pub kv_dtype: tandem_model::KvDtype,
}

/// The kernel settings at their defaults; the block size and KV budget are the engine's defaults
/// (`tandem_engine::EngineConfig`), which the caller replaces with its engine's.
impl Default for CudaOptions {
    fn default() -> Self {
        let engine = tandem_engine::EngineConfig::default();
        Self {
            device: 0,
            block_size: engine.block_size,
            kv_cache_memory: engine.kv_cache_memory,
            max_tokens: 2048,
            max_seqs: 256,
            max_model_len: None,
            logits_chunk_rows: 256,
            attn: AttnMode::Fast,
            graphs: true,
            gemv: true,
            gemv_max_rows: GEMV_ROWS_DEFAULT,
            packed_gemv_max_rows: PACKED_GEMV_ROWS_DEFAULT,
            pdl: false,
            decode_partition_small: DECODE_PARTITION_SMALL,
            gemv_target_warps: GEMV_TARGET_WARPS,
            gemv_tuning: kernels::GemvTuning::default(),
            gemv_persistent: false,
            moe_gemv_max_slots: MOE_GEMV_SLOTS_DEFAULT,
            decode_graph_blocks_per_sm: DECODE_GRAPH_BLOCKS_DEFAULT,
            kernel_cache_dir: None,
            layers: None,
            num_blocks: None,
            fp8_weights: false,
            fp8_gemm: false,
            gguf_packed: true,
            kv_dtype: tandem_model::KvDtype::Bf16,
        }
    }
}

/// Steps of up to this many tokens use our GEMV kernels by default. Measured on the H200
/// (2026-12-03 14:43, 8B shape, graphs, step ms GEMV / cuBLAS): 1 row 4.37 / 4.88, 2 rows 5.05 /
/// 4.96, 4 rows 6.18 / 5.12, 8 rows 8.98 / 5.31 — past one row the kernels' per-row work outweighs
/// streaming the weights once.
pub const GEMV_ROWS_DEFAULT: usize = 1;

/// Steps of up to this many tokens use our GEMV kernels on packed GGUF weights: there cuBLAS needs
/// each matrix dequantized to a bf16 tile first (reading 0.75 bytes a weight, writing 2, reading 2
/// again), which cost 19.5 ms a step on an 8B-shaped Q4_1 model on an H100 (2026-12-07) against
/// 3.2 for one row through the packed GEMV.
pub const PACKED_GEMV_ROWS_DEFAULT: usize = 8;

/// Warps a GEMV launch aims for through split-K: about the warps an H200 holds at once (16 per
/// multiprocessor at the GEMV's register use). Measured on the H200 (2026-12-03, batch-1 decode of
/// the 8B shape): 2,048 (no split for any of its projections) 4.53 ms per step, 8,192 4.68 ms,
/// 16,384 5.33 ms — more, shorter warps lose to the ramp of each wave.
pub const GEMV_TARGET_WARPS: usize = 2048;

/// Blocks a multiprocessor the looping decode attention of a captured graph is launched with: two
/// waves of `attn_decode` at eight resident blocks, so a short context leaves few blocks idle and a
/// long one still fills the GPU.
pub const DECODE_GRAPH_BLOCKS_DEFAULT: usize = 16;

/// Mixture-of-experts steps of up to this many (token, expert) slots run on the expert GEMVs by
/// default: a decode batch of 4 tokens at top-8. Measured on an H100 (2026-12-06, Qwen3-30B-A3B
/// shape, graphs, tok/s expert GEMVs / grouped GEMMs): batch 1 240.7 / 201.5, batch 8 570.7 / 586.6 —
/// at 64 slots experts chosen twice are streamed twice and the GEMMs win.
pub const MOE_GEMV_SLOTS_DEFAULT: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults are what the backend ran with before these options came from the binary's settings,
    /// when no tuning environment variable was set.
    #[test]
    fn defaults_are_the_old_unset_environment() {
        let o = CudaOptions::default();
        assert_eq!(o.device, 0);
        assert_eq!(o.attn, AttnMode::Fast);
        assert!(o.graphs);
        assert!(o.gemv);
        assert_eq!(o.gemv_max_rows, 1);
        assert!(!o.pdl);
        assert_eq!(o.decode_partition_small, 64);
        assert_eq!(o.gemv_target_warps, 2048);
        assert_eq!(o.gemv_tuning.unroll, 2);
        assert_eq!(o.gemv_tuning.min_blocks, 2);
        assert!(!o.gemv_persistent);
    }
}
