//! FP8 tensor-core GEMMs for FP8 weights in steps too large for the GEMVs (prefill chunks, large
//! decode batches): the activations quantized to E4M3 per token and 128-value group
//! (`quant_act_fp8`), the weight's own per-row 128-column scales, and cuBLASLt's block-scaled FP8
//! matmul with VEC128 scales on both operands (Hopper, cuBLAS 12.9 and later).
//!
//! cuBLASLt reads a VEC128 scale tensor outer-dimension-major (the rows, or tokens, of one
//! 128-value group next to each other) and a BLK128x128 one K-block-major with each row block's
//! K blocks padded to a multiple of four: the first reading is what the weights' `lt_scales` and
//! `quant_act_fp8`'s `row_major` give. Neither is assumed: a check at load runs a small problem
//! against a float64 host reference in both orders of each operand, and uses the first that
//! reproduces it; when none does (another GPU, another cuBLAS) FP8 matrices fall back to bf16 tiles
//! for cuBLAS, with a warning. The same check also runs the weights as 128 × 128 blocks (the
//! checkpoint layout) with unpadded and padded strides and logs the errors, which is what showed
//! why the first version of this module, which used those blocks unpadded, failed on an H100.
//! Off unless `CudaOptions::fp8_gemm`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{result as drv_result, CudaContext, CudaStream};

use crate::error::CudaError;
use crate::memory::DeviceBuf;

/// How a scale tensor of an operand of `rows` rows (weight rows or tokens) is ordered: the groups
/// along K of one row next to each other (`m * groups + g`), or the rows of one group next to each
/// other (`g * rows + m`, outer-dimension-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScaleOrder {
    KMajor,
    GroupMajor,
}

/// How cuBLASLt scales the weight operand.
type Mode = lt_sys::cublasLtMatmulMatrixScale_t;

/// The cuBLASLt handle, its workspace, the scale orders found at load and the chosen algorithm of
/// each GEMM shape.
pub(super) struct Fp8Gemm {
    handle: lt_sys::cublasLtHandle_t,
    workspace: DeviceBuf,
    /// Order of the weights' per-row scales, and of the activations' per-token group scales.
    pub(super) weight_order: ScaleOrder,
    pub(super) act_order: ScaleOrder,
    /// Whether steps of a token count that is not a multiple of 16 passed the check too (else such
    /// steps run on bf16 tiles).
    pub(super) any_rows: bool,
    algos: Mutex<HashMap<(usize, usize, usize, u32), lt_sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is used from the model's one stream, under the model's `&mut`/`&` discipline;
// cuBLASLt handles may be used from any thread.
unsafe impl Send for Fp8Gemm {}
// SAFETY: as above; the algorithm cache is behind a mutex.
unsafe impl Sync for Fp8Gemm {}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        if let Err(e) = unsafe { lt::destroy_handle(self.handle) } {
            tracing::warn!(error = ?e, "cublasLtDestroy failed");
        }
    }
}

/// Bytes of cuBLASLt workspace.
const WORKSPACE: usize = 32 << 20;

/// Whether FP8 GEMMs can run a projection of `n` rows over `k` columns: cuBLASLt's block scaling
/// needs whole 128-value blocks along K, and 16-byte aligned rows.
pub(super) fn fits(n: usize, k: usize) -> bool {
    k.is_multiple_of(128) && n.is_multiple_of(16)
}

const VEC128: Mode = Mode::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
const BLK128: Mode = Mode::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;

/// A relative error under which the check takes a product as right: E4M3 inputs are exact, so
/// only fp32 accumulation and the bf16 output (2^-9) separate a right product from the reference.
const CHECK_TOL: f64 = 2e-2;

impl Fp8Gemm {
    /// cuBLASLt on `stream`, with the scale orders that pass the load-time check; `None` (with a
    /// warning) when the library is missing or no order reproduces the reference.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
    ) -> Result<Option<Fp8Gemm>, CudaError> {
        // SAFETY: only probes for the shared library.
        if !unsafe { lt_sys::is_culib_present() } {
            tracing::warn!("libcublasLt could not be loaded: FP8 matrices run on bf16 tiles");
            return Ok(None);
        }
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { lt_sys::cublasLtGetVersion() };
        tracing::info!(cublaslt_version = version, "cuBLASLt loaded");
        let handle = lt::create_handle().map_err(lt_err)?;
        let mut gemm = Fp8Gemm {
            handle,
            workspace: DeviceBuf::new(ctx, WORKSPACE)?,
            weight_order: ScaleOrder::KMajor,
            act_order: ScaleOrder::KMajor,
            any_rows: false,
            algos: Mutex::new(HashMap::new()),
        };
        let check = SelfCheck::new(ctx, stream)?;
        let (_, _, t_full) = CHECK;
        let mut found = None;
        for w in [ScaleOrder::GroupMajor, ScaleOrder::KMajor] {
            for a in [ScaleOrder::GroupMajor, ScaleOrder::KMajor] {
                (gemm.weight_order, gemm.act_order) = (w, a);
                let ws = &check.w_scales[usize::from(w == ScaleOrder::KMajor)];
                match check.run(ctx, &gemm, stream, ws, VEC128, &check.want_rows, t_full) {
                    Ok(err) => {
                        tracing::info!(weights = ?w, activations = ?a, rel_err = err, "FP8 GEMM check (VEC128 x VEC128)");
                        if err < CHECK_TOL && found.is_none() {
                            found = Some((w, a));
                        }
                    }
                    Err(e) => {
                        tracing::info!(weights = ?w, activations = ?a, error = %e, "FP8 GEMM check (VEC128 x VEC128)")
                    }
                }
            }
        }
        // The checkpoint layout, for the record: 128 x 128 weight blocks as cuBLASLt's BLK128x128.
        let a = found.map_or(ScaleOrder::GroupMajor, |f| f.1);
        gemm.act_order = a;
        for (i, layout) in [
            "K-block-major, unpadded",
            "K-block-major, padded to 4",
            "row-block-major",
        ]
        .iter()
        .enumerate()
        {
            let got = check.run(
                ctx,
                &gemm,
                stream,
                &check.blk_scales[i],
                BLK128,
                &check.want_blk,
                t_full,
            );
            tracing::info!(weights = layout, activations = ?a, result = ?got.map_err(|e| e.to_string()), "FP8 GEMM check (BLK128x128 weights, VEC128 activations)");
        }
        let Some((w, a)) = found else {
            tracing::warn!(
                "no scale order reproduced the FP8 reference GEMM: FP8 matrices run on bf16 tiles"
            );
            return Ok(None);
        };
        (gemm.weight_order, gemm.act_order) = (w, a);
        let ws = &check.w_scales[usize::from(w == ScaleOrder::KMajor)];
        let odd = check.run(ctx, &gemm, stream, ws, VEC128, &check.want_rows, ODD_ROWS);
        tracing::info!(tokens = ODD_ROWS, result = ?odd.as_ref().map_err(|e| e.to_string()), "FP8 GEMM check");
        gemm.any_rows = odd.is_ok_and(|e| e < CHECK_TOL);
        gemm.algos.lock().expect("algorithm cache").clear();
        tracing::info!(weights = ?w, activations = ?a, any_rows = gemm.any_rows, "FP8 tensor-core GEMMs on");
        Ok(Some(gemm))
    }

    /// Whether a step of `t` tokens may run on the FP8 GEMMs.
    pub(super) fn takes_rows(&self, t: usize) -> bool {
        self.any_rows || t.is_multiple_of(16)
    }

    /// d[t × n] (bf16) = act[t × k] · w[n × k]ᵀ over E4M3 codes: `w`/`w_scales` the weight codes and
    /// per-row group scales (in `weight_order`), `a`/`a_scales` the activation codes and group
    /// scales (in `act_order`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul(
        &self,
        stream: &CudaStream,
        w: u64,
        w_scales: u64,
        a: u64,
        a_scales: u64,
        d: u64,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        self.matmul_mode(stream, (w, w_scales, VEC128), a, a_scales, d, (t, n, k))
    }

    /// `matmul` with the weight's scale mode given.
    fn matmul_mode(
        &self,
        stream: &CudaStream,
        (w, w_scales, w_mode): (u64, u64, Mode),
        a: u64,
        a_scales: u64,
        d: u64,
        (t, n, k): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let fp8 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        // The weight is A (transposed: k × n column-major is w's rows), the activations B; d is
        // n × t column-major, which is t × n row-major.
        let desc = Desc::new((w_scales, w_mode), (a_scales, VEC128))?;
        let a_layout = Layout::new(fp8, k, n)?;
        let b_layout = Layout::new(fp8, k, t)?;
        let d_layout = Layout::new(lt_sys::cudaDataType::CUDA_R_16BF, n, t)?;
        let algo = {
            let mut cache = self.algos.lock().expect("algorithm cache");
            let key = (n, k, t, w_mode as u32);
            match cache.get(&key) {
                Some(a) => *a,
                None => {
                    let pref = Pref::new()?;
                    // SAFETY: every descriptor is live for the call.
                    let h = unsafe {
                        lt::get_matmul_algo_heuristic(
                            self.handle,
                            desc.0,
                            a_layout.0,
                            b_layout.0,
                            d_layout.0,
                            d_layout.0,
                            pref.0,
                        )
                    }
                    .map_err(lt_err)?;
                    cache.insert(key, h.algo);
                    h.algo
                }
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the operands are live device buffers of the stated shapes on this stream's
        // context; the workspace is ours and the stream orders its reuse.
        unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                a_layout.0,
                a as *const c_void,
                b_layout.0,
                d as *const c_void,
                d_layout.0,
                d as *mut c_void,
                d_layout.0,
                &algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(lt_err)
    }
}

fn lt_err(e: lt::CublasError) -> CudaError {
    CudaError::Unsupported(format!("cuBLASLt: {e:?}"))
}

/// A matmul descriptor: A transposed, B not (FP8's only arrangement), each operand's scale tensor
/// and mode; fp32 accumulation.
struct Desc(lt_sys::cublasLtMatmulDesc_t);

/// A scale tensor's device pointer and how it scales its operand.
type Scales = (u64, lt_sys::cublasLtMatmulMatrixScale_t);

impl Desc {
    fn new(a: Scales, b: Scales) -> Result<Desc, CudaError> {
        let d = Desc(
            lt::create_matmul_desc(
                lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt_sys::cudaDataType::CUDA_R_32F,
            )
            .map_err(lt_err)?,
        );
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        let set = |attr: A, v: &[u8]| -> Result<(), CudaError> {
            // SAFETY: the descriptor is live; `v` holds the attribute's value.
            unsafe { lt::set_matmul_desc_attribute(d.0, attr, v.as_ptr().cast(), v.len()) }
                .map_err(lt_err)
        };
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32.to_ne_bytes())?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32.to_ne_bytes())?;
        set(
            A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            &(a.1 as u32).to_ne_bytes(),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            &(b.1 as u32).to_ne_bytes(),
        )?;
        set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a.0.to_ne_bytes())?;
        set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b.0.to_ne_bytes())?;
        Ok(d)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A column-major matrix layout of `rows` × `cols` with leading dimension `rows`.
struct Layout(lt_sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(ty: lt_sys::cudaDataType, rows: usize, cols: usize) -> Result<Layout, CudaError> {
        Ok(Layout(
            lt::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64).map_err(lt_err)?,
        ))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// Heuristic preferences: at most our workspace.
struct Pref(lt_sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> Result<Pref, CudaError> {
        let p = Pref(lt::create_matmul_pref().map_err(lt_err)?);
        let bytes = (WORKSPACE as u64).to_ne_bytes();
        // SAFETY: the preference is live; the value is a u64 byte count.
        unsafe {
            lt::set_matmul_pref_attribute(
                p.0,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                bytes.as_ptr().cast(),
                bytes.len(),
            )
        }
        .map_err(lt_err)?;
        Ok(p)
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// The load-time check: random codes and scales with distinct values per row (and per block, for
/// the 128 × 128 layout), each scale order uploaded, and the float64 products on the host.
struct SelfCheck {
    w: DeviceBuf,
    a: DeviceBuf,
    /// Per-row weight scales group-major and K-major.
    w_scales: [DeviceBuf; 2],
    /// 128 × 128 block scales K-block-major unpadded, K-block-major with each row block's K blocks
    /// padded to a multiple of 4, and row-block-major.
    blk_scales: [DeviceBuf; 3],
    /// The activation scales, token-major (`t × groups`).
    act_scales: Vec<f32>,
    d: DeviceBuf,
    /// The products (t × n) with the per-row scales and with the block scales.
    want_rows: Vec<f64>,
    want_blk: Vec<f64>,
}

/// The check's shape: 256 weight rows, 384 columns (three K blocks: not a multiple of four), 64
/// tokens.
const CHECK: (usize, usize, usize) = (256, 384, 64);

/// Tokens of the second run of the check, not a multiple of 16 (a prefill chunk's odd length).
const ODD_ROWS: usize = 37;

impl SelfCheck {
    fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<SelfCheck, CudaError> {
        use tandem_model::weights::fp8::e4m3_to_f32;
        let (n, k, t) = CHECK;
        let (kb, rb) = (k / 128, n / 128);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // Codes of magnitude up to 2^4 (no NaN), signed; scales spread over a factor of 16.
        let code = |r: u64| ((r & 0x80) as u8) | (r % 0x58) as u8;
        let w: Vec<u8> = (0..n * k).map(|_| code(next())).collect();
        let a: Vec<u8> = (0..t * k).map(|_| code(next())).collect();
        let mut scale = || 0.01 * (1 + next() % 16) as f32;
        let ws: Vec<f32> = (0..n * kb).map(|_| scale()).collect();
        let wb: Vec<f32> = (0..rb * kb).map(|_| scale()).collect();
        let act_scales: Vec<f32> = (0..t * kb).map(|_| scale()).collect();
        let ws_groups: Vec<f32> = (0..n * kb).map(|i| ws[(i % n) * kb + i / n]).collect();
        let kb4 = kb.div_ceil(4) * 4;
        let wb_padded: Vec<f32> = (0..rb * kb4)
            .map(|i| {
                if i % kb4 < kb {
                    wb[(i / kb4) * kb + i % kb4]
                } else {
                    0.0
                }
            })
            .collect();
        let wb_rows: Vec<f32> = (0..rb * kb).map(|i| wb[(i % rb) * kb + i / rb]).collect();
        let product = |wscale: &dyn Fn(usize, usize) -> f32| -> Vec<f64> {
            let mut want = vec![0f64; t * n];
            for m in 0..t {
                for r in 0..n {
                    let mut acc = 0f64;
                    for c in 0..k {
                        let wv = f64::from(e4m3_to_f32(w[r * k + c])) * f64::from(wscale(r, c));
                        let av = f64::from(e4m3_to_f32(a[m * k + c]))
                            * f64::from(act_scales[m * kb + c / 128]);
                        acc += wv * av;
                    }
                    want[m * n + r] = acc;
                }
            }
            want
        };
        let want_rows = product(&|r, c| ws[r * kb + c / 128]);
        let want_blk = product(&|r, c| wb[(r / 128) * kb + c / 128]);
        let up = |bytes: &[u8]| upload(ctx, stream, bytes);
        Ok(SelfCheck {
            w: up(&w)?,
            a: up(&a)?,
            w_scales: [up(&f32_bytes(&ws_groups))?, up(&f32_bytes(&ws))?],
            blk_scales: [
                up(&f32_bytes(&wb))?,
                up(&f32_bytes(&wb_padded))?,
                up(&f32_bytes(&wb_rows))?,
            ],
            act_scales,
            d: DeviceBuf::new(ctx, t * n * 2)?,
            want_rows,
            want_blk,
        })
    }

    /// The relative L2 error of `gemm`'s product over the first `t` tokens, with the weight scales
    /// `w_scales` in mode `w_mode` against `want`, and the activation scales in `gemm.act_order`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        ctx: &Arc<CudaContext>,
        gemm: &Fp8Gemm,
        stream: &Arc<CudaStream>,
        w_scales: &DeviceBuf,
        w_mode: Mode,
        want: &[f64],
        t: usize,
    ) -> Result<f64, CudaError> {
        let (n, k, _) = CHECK;
        let kb = k / 128;
        let act: Vec<f32> = match gemm.act_order {
            ScaleOrder::KMajor => self.act_scales[..t * kb].to_vec(),
            ScaleOrder::GroupMajor => (0..t * kb)
                .map(|i| self.act_scales[(i % t) * kb + i / t])
                .collect(),
        };
        let a_scales = upload(ctx, stream, &f32_bytes(&act))?;
        gemm.matmul_mode(
            stream,
            (self.w.ptr, w_scales.ptr, w_mode),
            self.a.ptr,
            a_scales.ptr,
            self.d.ptr,
            (t, n, k),
        )?;
        let mut got = vec![0u16; t * n];
        // SAFETY: d holds at least t × n bf16 values; the copy is synchronous on the stream.
        unsafe { drv_result::memcpy_dtoh_async(&mut got, self.d.ptr, stream.cu_stream()) }?;
        stream.synchronize()?;
        let (mut num, mut den) = (0f64, 0f64);
        for (g, w) in got.iter().zip(&want[..t * n]) {
            let g = f64::from(f32::from_bits(u32::from(*g) << 16));
            num += (g - w).powi(2);
            den += w.powi(2);
        }
        Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
    }
}

/// f32 values as their native-endian bytes.
fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// `bytes` in a new device buffer, the copy complete on return.
fn upload(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    bytes: &[u8],
) -> Result<DeviceBuf, CudaError> {
    let buf = DeviceBuf::new(ctx, bytes.len())?;
    // SAFETY: buf holds exactly these bytes; the stream is synchronised before they drop.
    unsafe { drv_result::memcpy_htod_async(buf.ptr, bytes, stream.cu_stream()) }?;
    stream.synchronize()?;
    Ok(buf)
}
