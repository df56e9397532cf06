//! The forward pass: the model body (embedding, layers, final norm) queued on the stream, the output
//! head, and logits copied to the host.

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{result as drv_result, LaunchConfig, PushKernelArg};
use tandem_model::ForwardBatch;

use super::gemv::{fused_smem_bytes, GemvFamily, GEMV_WARPS};
use super::launch::{KernelArg, SeqAttnArgs};
use super::{fp8_gemm, CudaLlama, FfnBufs, WFormat, Weight};
use crate::error::CudaError;
use crate::kernels::{self, DECODE_PARTITION_SMALL};
use crate::memory::{BF16, STAGING_CHUNK};
use crate::options::AttnMode;
use crate::packed::PackedFormat;
use crate::plan::Region;

/// 16-byte chunks of a row each thread of `add_rmsnorm` holds (`NORM_CHUNKS` in llama.cu).
pub(super) const NORM_CHUNKS: usize = 2;

impl CudaLlama {
    /// y[t × n] = x[t × k] · w[n × k]ᵀ in bf16 with fp32 accumulation; `f32_out` writes fp32 y.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        if self.gemv_rows(t) && k.is_multiple_of(8) {
            self.enqueue_gemv(x, (w, 0, 0, WFormat::Bf16), y, t, n, k, f32_out)?;
            return Ok(());
        }
        self.blas_gemm(x, w, y, t, n, k, f32_out)
    }

    /// y[t × n] = x[t × k] · wᵀ for a layer's projection `w` into bf16 y: see [`Self::project_into`].
    pub(super) fn project(&self, x: u64, w: &Weight, y: u64, t: usize) -> Result<(), CudaError> {
        self.project_into(x, w, y, t, false)
    }

    /// y[t × n] = x[t × k] · wᵀ for a projection `w` in any format (bf16, fp32 with `f32_out`): a
    /// GEMV over the stored format for few rows, else cuBLAS (over a bf16 copy of an FP8 or packed
    /// matrix, made on the stream just before) or the FP8 tensor-core GEMMs.
    pub(super) fn project_into(
        &self,
        x: u64,
        w: &Weight,
        y: u64,
        t: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let (n, k) = (w.rows, w.cols);
        if self.gemv_rows(t) {
            return self.enqueue_gemv(x, gemv_weight(w), y, t, n, k, f32_out);
        }
        if w.format == WFormat::Bf16 {
            return self.blas_gemm(x, w.buf.ptr, y, t, n, k, f32_out);
        }
        if let Some(p) = w.format.packed() {
            let func = match p {
                PackedFormat::Q4 => &self.funcs.dequant_q4,
                PackedFormat::Q8 => &self.funcs.dequant_q8,
            };
            let chunks = n * k / p.chunk_values();
            launch!(
                self.stream,
                func,
                (chunks.div_ceil(256).min(65535) as u32, 1, 1),
                (256, 1, 1),
                w.buf.ptr,
                w.scale_ptr(),
                self.acts.wtile.ptr,
                chunks as u64
            );
            return self.blas_gemm(x, self.acts.wtile.ptr, y, t, n, k, f32_out);
        }
        if let Some(g) = self
            .fp8_gemm
            .as_ref()
            .filter(|g| fp8_gemm::fits(n, k) && g.takes_rows(t))
        {
            let a = &self.acts;
            let warps = t * k.div_ceil(128);
            launch!(
                self.stream,
                self.funcs.quant_act_fp8,
                (warps.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                x,
                a.aq.ptr,
                a.aq_scales.ptr,
                t as i32,
                k as i32,
                i32::from(g.act_order == fp8_gemm::ScaleOrder::GroupMajor)
            );
            return g.matmul(
                &self.stream,
                w.buf.ptr,
                w.lt_scale_ptr(),
                a.aq.ptr,
                a.aq_scales.ptr,
                y,
                t,
                n,
                k,
            );
        }
        let chunks = n * k / 16;
        launch!(
            self.stream,
            self.funcs.dequant_fp8,
            (chunks.div_ceil(256).min(65535) as u32, 1, 1),
            (256, 1, 1),
            w.buf.ptr,
            w.scale_ptr(),
            self.acts.wtile.ptr,
            n as i32,
            k as i32
        );
        self.blas_gemm(x, self.acts.wtile.ptr, y, t, n, k, f32_out)
    }

    /// The plain GEMV y[t × n] = x · wᵀ over `w` = (pointer, scales, scale values per row, format).
    #[allow(clippy::too_many_arguments)]
    fn enqueue_gemv(
        &self,
        x: u64,
        w: (u64, u64, i32, WFormat),
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let (grid, ks, groups) = self.gemv_shape(GemvFamily::Plain, w.3, t, n.div_ceil(2), k);
        launch_pdl!(
            self,
            self.funcs.gemv_family(GemvFamily::Plain as usize, w.3)[t - 1],
            (grid, 1, 1),
            (32 * GEMV_WARPS as u32, 1, 1),
            0,
            x,
            w.0,
            w.1,
            w.2,
            y,
            n as i32,
            k as i32,
            f32_out as i32,
            ks,
            groups
        );
        Ok(())
    }

    /// cuBLAS y[t × n] = x[t × k] · w[n × k]ᵀ over bf16 w.
    #[allow(clippy::too_many_arguments)]
    fn blas_gemm(
        &self,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let c_type = if f32_out {
            blas_sys::cudaDataType::CUDA_R_32F
        } else {
            blas_sys::cudaDataType::CUDA_R_16BF
        };
        // Column-major view: Yᵀ (n × t) = W (k × n)ᵀ · Xᵀ (k × t).
        // SAFETY: pointers are live device buffers of the stated shapes.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                c_type,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }

    /// Queues the whole forward pass over the uploaded plan up to the final norm (into `xn`).
    /// `graph`: launch the decode attention so that it covers every partition the context limit
    /// allows (`attn_decode`'s blocks loop; `attn_decode_small` gets a block for each), so that the
    /// captured launch fits any later step of the same size.
    pub(super) fn enqueue_body(&self, t: usize, graph: bool) -> Result<(), CudaError> {
        let c = &self.config;
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let (nh, nkv) = (c.num_heads as i32, c.num_kv_heads as i32);
        let a = &self.acts;
        let s = &self.stream;
        let tt = t as u32;
        let eps = c.rms_norm_eps;
        let qkv_w = (q + 2 * kv) as i32;
        let neox = matches!(c.rope_style, tandem_kernels::RopeStyle::Neox) as i32;
        let scale = c.attn_scale;
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let layer_elems = (self.layout.num_blocks + 1) * self.layout.block_elems();
        let p = &self.plan;
        let part_len = kernels::decode_partition(p.dec_row.len(), self.opts.decode_partition_small);
        let stride = self.max_model_len.div_ceil(part_len);
        let decode_parts = if !graph {
            p.max_dec_ctx.div_ceil(part_len)
        } else if part_len > DECODE_PARTITION_SMALL {
            // `attn_decode` loops over partitions: a fixed grid of about
            // `decode_graph_blocks_per_sm` blocks a multiprocessor, whatever the limit.
            let pairs = p.dec_row.len() * c.num_kv_heads;
            (self.sms * self.opts.decode_graph_blocks_per_sm.max(1))
                .div_ceil(pairs.max(1))
                .clamp(1, stride)
        } else {
            stride
        };
        if p.dec_row.len() * c.num_heads * stride > self.part_slots {
            return Err(CudaError::Batch(format!(
                "{} decode sequences exceed the partial-result buffers",
                p.dec_row.len()
            )));
        }

        // A later pipeline stage finds the previous stage's residual stream in x (`load_hidden`).
        if let (true, Some(embed)) = (self.is_first(), &self.embed) {
            launch!(
                s,
                self.funcs.embed_gather,
                (tt, 1, 1),
                (256, 1, 1),
                embed.ptr,
                self.meta(Region::Tokens),
                a.x.ptr,
                h as i32,
                c.embedding_scale.unwrap_or(1.0)
            );
        }
        let fused = self.fused_step(t);
        let smem = fused_smem_bytes(t, h) as u32;
        let block = (32 * GEMV_WARPS as u32, 1, 1);
        // The previous layer's last delta, not yet added into x (0: x is complete), and the norm it
        // takes first (0: none; Gemma's post-MLP norm).
        let mut pending = (0u64, 0u64);
        for (l, lw) in self.layers.iter().enumerate() {
            let cache = self.kv.at(l * layer_elems, self.layout.dtype.size());
            let (rope_cos, rope_sin) = &self.ropes[self.layer_rope[l]];
            let window = c
                .layer(self.first_layer + l)
                .attention
                .window()
                .map_or(0, |w| w as i32);
            let post = |n: &Option<crate::memory::DeviceBuf>| n.as_ref().map_or(0u64, |b| b.ptr);
            let bias = lw.bqkv.as_ref().map_or(0u64, |b| b.ptr);
            if fused && lw.qk_norm.is_none() {
                // RMSNorm + QKV + bias + RoPE + K/V write; the residual is complete in x.
                let w = &lw.wqkv;
                let (grid, ks, groups) =
                    self.gemv_shape(GemvFamily::Qkv, w.format, t, (q + 2 * kv) / 2, h);
                launch_pdl!(
                    self,
                    self.funcs.gemv_family(GemvFamily::Qkv as usize, w.format)[t - 1],
                    (grid, 1, 1),
                    block,
                    smem,
                    a.x.ptr,
                    lw.attn_norm.ptr,
                    eps,
                    w.buf.ptr,
                    w.scale_ptr(),
                    w.kb(),
                    bias,
                    self.meta(Region::Positions),
                    self.meta(Region::Slots),
                    rope_cos.ptr,
                    rope_sin.ptr,
                    cache,
                    a.qkv.ptr,
                    nh,
                    nkv,
                    neox,
                    h as i32,
                    ks,
                    groups
                );
            } else {
                self.enqueue_add_rmsnorm(t, pending, lw.attn_norm.ptr)?;
                self.project(a.xn.ptr, &lw.wqkv, a.qkv.ptr, t)?;
                if let Some((qn, kn)) = &lw.qk_norm {
                    // Four heads (warps) a block.
                    launch!(
                        s,
                        self.funcs.qk_norm,
                        (tt, (c.num_heads + c.num_kv_heads).div_ceil(4) as u32, 1),
                        (128, 1, 1),
                        a.qkv.ptr,
                        qn.ptr,
                        kn.ptr,
                        nh,
                        nkv,
                        eps
                    );
                }
                launch!(
                    s,
                    self.funcs.rope_kv_write,
                    (tt, 1, 1),
                    (256, 1, 1),
                    a.qkv.ptr,
                    bias,
                    self.meta(Region::Positions),
                    self.meta(Region::Slots),
                    rope_cos.ptr,
                    rope_sin.ptr,
                    cache,
                    nh,
                    nkv,
                    neox
                );
            }
            let seq = SeqAttnArgs {
                seq_qrow: self.meta(Region::SeqQrow),
                seq_nq: self.meta(Region::SeqNq),
                seq_pos: self.meta(Region::SeqPos),
                seq_bt: self.meta(Region::SeqBt),
                block_tables: self.meta(Region::BlockTables),
                cache,
                out: a.attn.ptr,
                nh,
                nkv,
            };
            // Heads wider than the tensor-core prefill takes: a step with prompt rows runs the
            // reference kernel for all its rows; decode-only steps keep the decode kernels.
            let simple = self.opts.attn == AttnMode::Simple
                || (!p.tile_seq.is_empty() && !self.shape.tensor_core_prefill());
            if simple {
                let n_seq = p.seq_qrow.len() as u32;
                launch!(
                    s,
                    self.funcs.attn_simple,
                    (p.max_nq as u32, n_seq, (nh as u32).div_ceil(4)),
                    (32, 4, 1),
                    a.qkv.ptr,
                    qkv_w,
                    @seq &seq,
                    scale,
                    window
                );
            } else {
                if !p.tile_seq.is_empty() {
                    launch_smem!(
                        s,
                        self.funcs.attn_prefill,
                        (p.tile_seq.len() as u32, nh as u32, 1),
                        (128, 1, 1),
                        kernels::prefill_smem_bytes(c.head_dim) as u32,
                        a.qkv.ptr,
                        qkv_w,
                        self.meta(Region::TileSeq),
                        self.meta(Region::TileQ0),
                        @seq &seq,
                        scale_log2,
                        window
                    );
                }
                if !p.dec_row.is_empty() {
                    let nd = p.dec_row.len() as u32;
                    let kernel = if part_len <= DECODE_PARTITION_SMALL {
                        &self.funcs.attn_decode_small
                    } else {
                        &self.funcs.attn_decode
                    };
                    launch_pdl!(
                        self,
                        kernel,
                        (nd, nkv as u32, decode_parts as u32),
                        (128, 1, 1),
                        0,
                        a.qkv.ptr,
                        qkv_w,
                        self.meta(Region::DecRow),
                        self.meta(Region::DecCtx),
                        self.meta(Region::DecBt),
                        self.meta(Region::BlockTables),
                        cache,
                        a.part_m.ptr,
                        a.part_l.ptr,
                        a.part_o.ptr,
                        a.dec_done.ptr,
                        a.attn.ptr,
                        nh,
                        nkv,
                        stride as i32,
                        part_len as i32,
                        scale_log2,
                        window
                    );
                }
            }
            let (gate_up, down) = match &lw.ffn {
                FfnBufs::Dense { gate_up, down } => (gate_up, down),
                FfnBufs::Moe(moe) => {
                    if fused {
                        self.enqueue_gemv_add(t, a.attn.ptr, &lw.wo, a.x.ptr)?;
                        self.enqueue_add_rmsnorm(t, (0, 0), lw.ffn_norm.ptr)?;
                    } else {
                        self.project(a.attn.ptr, &lw.wo, a.delta.ptr, t)?;
                        self.enqueue_add_rmsnorm(
                            t,
                            (a.delta.ptr, post(&lw.post_attn_norm)),
                            lw.ffn_norm.ptr,
                        )?;
                    }
                    // The experts' output goes straight into x.
                    self.enqueue_moe(l, moe, t)?;
                    pending = (0, 0);
                    continue;
                }
            };
            if fused {
                // Output projection added into the residual; RMSNorm + gate/up + SiLU·mul; down
                // projection added into the residual.
                self.enqueue_gemv_add(t, a.attn.ptr, &lw.wo, a.x.ptr)?;
                let (grid, ks, groups) = self.gemv_shape(GemvFamily::Silu, gate_up.format, t, f, h);
                launch_pdl!(
                    self,
                    self.funcs
                        .gemv_family(GemvFamily::Silu as usize, gate_up.format)[t - 1],
                    (grid, 1, 1),
                    block,
                    smem,
                    a.x.ptr,
                    lw.ffn_norm.ptr,
                    eps,
                    gate_up.buf.ptr,
                    gate_up.scale_ptr(),
                    gate_up.kb(),
                    a.act.ptr,
                    f as i32,
                    h as i32,
                    ks,
                    groups
                );
                self.enqueue_gemv_add(t, a.act.ptr, down, a.x.ptr)?;
                pending = (0, 0);
                continue;
            }
            self.project(a.attn.ptr, &lw.wo, a.delta.ptr, t)?;
            self.enqueue_add_rmsnorm(t, (a.delta.ptr, post(&lw.post_attn_norm)), lw.ffn_norm.ptr)?;
            self.project(a.xn.ptr, gate_up, a.gu.ptr, t)?;
            self.enqueue_silu_mul(a.gu.ptr, a.act.ptr, t, f)?;
            self.project(a.act.ptr, down, a.delta.ptr, t)?;
            pending = (a.delta.ptr, post(&lw.post_ffn_norm));
        }
        self.enqueue_add_rmsnorm(t, pending, self.norm.ptr)
    }

    /// Queues `res[t × n] += x[t × k] · w[n × k]ᵀ` through the residual-add GEMV (`n` = hidden size).
    pub(super) fn enqueue_gemv_add(
        &self,
        t: usize,
        x: u64,
        w: &Weight,
        res: u64,
    ) -> Result<(), CudaError> {
        let (n, k) = (w.rows, w.cols);
        let (grid, ks, groups) = self.gemv_shape(GemvFamily::Add, w.format, t, n.div_ceil(2), k);
        launch_pdl!(
            self,
            self.funcs.gemv_family(GemvFamily::Add as usize, w.format)[t - 1],
            (grid, 1, 1),
            (32 * GEMV_WARPS as u32, 1, 1),
            0,
            x,
            w.buf.ptr,
            w.scale_ptr(),
            w.kb(),
            res,
            n as i32,
            k as i32,
            ks,
            groups
        );
        Ok(())
    }

    /// Queues `x += delta` (delta 0: none) and `xn = RMSNorm(x) · weight` over `t` rows; `delta`
    /// is `(delta, post)`, and a non-zero `post` norm weight normalises the delta before the add.
    pub(super) fn enqueue_add_rmsnorm(
        &self,
        t: usize,
        (delta, post): (u64, u64),
        weight: u64,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden_size;
        // One 16-byte chunk of the row per thread (up to NORM_CHUNKS per thread past 1024).
        let threads = ((h / 8).div_ceil(32) * 32).clamp(32, 1024) as u32;
        launch_pdl!(
            self,
            self.funcs.add_rmsnorm,
            (t as u32, 1, 1),
            (threads, 1, 1),
            0,
            self.acts.x.ptr,
            delta,
            weight,
            self.acts.xn.ptr,
            h as i32,
            self.config.rms_norm_eps,
            post
        );
        Ok(())
    }

    /// Queues the output head for logits rows `start..start + n` of the plan into `acts.logits`.
    pub(super) fn enqueue_head(&self, start: usize, n: usize) -> Result<(), CudaError> {
        let c = &self.config;
        let h = c.hidden_size;
        let a = &self.acts;
        // Rows start..start + n of the step (every decode step, and graphs only run those) need no
        // gather: the head reads them from xn in place.
        let lr = &self.plan.logit_rows;
        let in_place = lr.len() >= start + n
            && lr[start..start + n]
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == start + i);
        let head_in = if in_place {
            a.xn.at(start * h, BF16)
        } else {
            let rows = self.meta(Region::LogitRows) + (start * 4) as u64;
            launch_pdl!(
                self,
                self.funcs.gather_rows,
                (n as u32, 1, 1),
                (256, 1, 1),
                0,
                a.xn.ptr,
                rows,
                a.head_in.ptr,
                h as i32
            );
            a.head_in.ptr
        };
        match (&self.lm_head, &self.embed) {
            _ if !self.is_last() => {
                return Err(CudaError::Batch(format!(
                    "layers {:?} end before the output head",
                    self.layers()
                )))
            }
            (Some(head), _) => self.project_into(head_in, head, a.logits.ptr, n, true)?,
            (None, Some(embed)) => {
                self.gemm(head_in, embed.ptr, a.logits.ptr, n, c.vocab_size, h, true)?
            }
            (None, None) => {
                return Err(CudaError::Batch(
                    "the last layers hold no output head".into(),
                ))
            }
        }
        if let Some(cap) = c.final_logit_softcap {
            let len = n * c.vocab_size;
            launch_pdl!(
                self,
                self.funcs.softcap,
                (len.div_ceil(256).min(4096) as u32, 1, 1),
                (256, 1, 1),
                0,
                a.logits.ptr,
                len as u64,
                cap
            );
        }
        Ok(())
    }

    /// Runs one step and returns `batch.logits_rows()` rows of fp32 logits on the host.
    pub fn forward(
        &mut self,
        batch: &ForwardBatch,
        logits: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        logits.clear();
        let graph = self.prepare(batch)?;
        self.load_hidden(None, batch.tokens.len())?;
        self.logits_of(graph, batch, logits)
    }

    /// The device work of a step after planning (through graph `graph` when non-zero): the body,
    /// then the head, its logits rows copied into `logits`.
    pub(super) fn logits_of(
        &mut self,
        graph: usize,
        batch: &ForwardBatch,
        logits: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        let rows = batch.logits_rows();
        let v = self.config.vocab_size;
        logits.resize(rows * v, 0.0);
        if graph > 0 {
            self.run_graph(graph)?;
            self.copy_logits(&mut logits[..], rows)?;
        } else {
            let t = self.plan.num_tokens();
            if t == 0 {
                return Ok(());
            }
            self.enqueue_body(t, false)?;
            let chunk = self.opts.logits_chunk_rows.max(1);
            let mut start = 0;
            while start < rows {
                let n = chunk.min(rows - start);
                self.enqueue_head(start, n)?;
                self.copy_logits(&mut logits[start * v..(start + n) * v], n)?;
                start += n;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Copies `rows` rows of logits to `dst` through the pinned staging buffer, two slots deep: the
    /// CPU copies one slot out while the GPU fills the other.
    pub(super) fn copy_logits(&mut self, dst: &mut [f32], rows: usize) -> Result<(), CudaError> {
        let n = rows * self.config.vocab_size;
        let src = self.acts.logits.ptr;
        let stream = self.stream.clone();
        let mut pending: std::collections::VecDeque<(
            cudarc::driver::CudaEvent,
            usize,
            usize,
            usize,
        )> = std::collections::VecDeque::with_capacity(2);
        let mut off = 0;
        let mut chunk_no = 0;
        while off < n || !pending.is_empty() {
            if pending.len() == 2 || off >= n {
                let (event, slot, at, len) = pending.pop_front().expect("a pending chunk");
                event.synchronize()?;
                dst[at..at + len].copy_from_slice(self.staging.slice(slot * STAGING_CHUNK, len));
                continue;
            }
            let len = STAGING_CHUNK.min(n - off);
            let slot = chunk_no % 2;
            // SAFETY: the slot is not in use (its previous chunk was consumed above); the source
            // range lies inside acts.logits.
            unsafe {
                drv_result::memcpy_dtoh_async(
                    self.staging.slice_mut(slot * STAGING_CHUNK, len),
                    src + (off * 4) as u64,
                    stream.cu_stream(),
                )
            }?;
            pending.push_back((stream.record_event(None)?, slot, off, len));
            off += len;
            chunk_no += 1;
        }
        Ok(())
    }
}

/// A projection's GEMV operands: pointer, scales, scale values per row, format.
fn gemv_weight(w: &Weight) -> (u64, u64, i32, WFormat) {
    (w.buf.ptr, w.scale_ptr(), w.kb(), w.format)
}
