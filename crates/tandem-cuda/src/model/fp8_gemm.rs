//! FP8 tensor-core GEMMs for FP8 weights in steps too large for the GEMVs (prefill chunks, large
//! decode batches): the activations quantized to E4M3 per token and 128-value group
//! (`quant_act_fp8`), the weight's own 128 × 128 block scales, and cuBLASLt's block-scaled FP8
//! matmul (Hopper, cuBLAS 12.9 and later).
//!
//! Where cuBLASLt wants each scale tensor ordered (by blocks along K first, or along the rows) is
//! checked once at load on a small problem with a host reference, not assumed: the first ordering
//! that reproduces the reference is used, and when none does (another GPU, another cuBLAS) FP8
//! matrices fall back to bf16 tiles for cuBLAS, with a warning. Off unless `CudaOptions::fp8_gemm`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{result as drv_result, CudaContext, CudaStream};

use crate::error::CudaError;
use crate::memory::DeviceBuf;

/// How a scale tensor is ordered: the blocks along K of one row block (or token) next to each other,
/// or the row blocks (tokens) of one K block next to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScaleOrder {
    KMajor,
    RowMajor,
}

/// The cuBLASLt handle, its workspace, the scale orders found at load and the chosen algorithm of
/// each GEMM shape.
pub(super) struct Fp8Gemm {
    handle: lt_sys::cublasLtHandle_t,
    workspace: DeviceBuf,
    /// Order of the weights' 128 × 128 block scales, and of the activations' per-token group scales.
    pub(super) weight_order: ScaleOrder,
    pub(super) act_order: ScaleOrder,
    /// The activations are cuBLASLt's A operand (VEC128) and the weight its B (BLK128x128), which
    /// writes the product transposed (d holds n × t); else the weight is A and d holds t × n.
    pub(super) swapped: bool,
    algos: Mutex<HashMap<(usize, usize, usize, bool), lt_sys::cublasLtMatmulAlgo_t>>,
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
        let handle = lt::create_handle().map_err(lt_err)?;
        let mut gemm = Fp8Gemm {
            handle,
            workspace: DeviceBuf::new(ctx, WORKSPACE)?,
            weight_order: ScaleOrder::KMajor,
            act_order: ScaleOrder::KMajor,
            swapped: false,
            algos: Mutex::new(HashMap::new()),
        };
        let check = SelfCheck::new(ctx, stream)?;
        let mut found = None;
        for swapped in [false, true] {
            for w in [ScaleOrder::KMajor, ScaleOrder::RowMajor] {
                for a in [ScaleOrder::KMajor, ScaleOrder::RowMajor] {
                    (gemm.weight_order, gemm.act_order, gemm.swapped) = (w, a, swapped);
                    match check.run(&gemm, stream) {
                        Ok(err) => {
                            tracing::info!(weights = ?w, activations = ?a, swapped, rel_err = err, "FP8 GEMM check");
                            if err < 2e-2 && found.is_none() {
                                found = Some((w, a, swapped));
                            }
                        }
                        Err(e) => {
                            tracing::info!(weights = ?w, activations = ?a, swapped, error = %e, "FP8 GEMM check")
                        }
                    }
                }
            }
        }
        match found {
            // The product in the order the step's buffers hold it: only the unswapped roles serve.
            Some((w, a, false)) => {
                (gemm.weight_order, gemm.act_order, gemm.swapped) = (w, a, false);
                gemm.algos.lock().expect("algorithm cache").clear();
                Ok(Some(gemm))
            }
            Some(_) => {
                tracing::warn!("cuBLASLt's FP8 GEMM reproduced the reference only with the activations as A (a transposed product): FP8 matrices run on bf16 tiles");
                Ok(None)
            }
            None => {
                tracing::warn!("no scale order reproduced the FP8 reference GEMM: FP8 matrices run on bf16 tiles");
                Ok(None)
            }
        }
    }

    /// d[t × n] (bf16) = act[t × k] · w[n × k]ᵀ over E4M3 codes: `w`/`w_scales` the weight codes and
    /// block scales (in `weight_order`), `a`/`a_scales` the activation codes and group scales (in
    /// `act_order`).
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
        let blk = lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        let vec = lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        let fp8 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        let ((x, x_rows), (y, y_rows), desc) = if self.swapped {
            ((a, t), (w, n), Desc::new((a_scales, vec), (w_scales, blk))?)
        } else {
            ((w, n), (a, t), Desc::new((w_scales, blk), (a_scales, vec))?)
        };
        let a_layout = Layout::new(fp8, k, x_rows)?;
        let b_layout = Layout::new(fp8, k, y_rows)?;
        let d_layout = Layout::new(lt_sys::cudaDataType::CUDA_R_16BF, x_rows, y_rows)?;
        let (w, a) = (x, y);
        let algo = {
            let mut cache = self.algos.lock().expect("algorithm cache");
            match cache.get(&(n, k, t, self.swapped)) {
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
                    cache.insert((n, k, t, self.swapped), h.algo);
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

/// The load-time check: random codes and scales with distinct values per block, both scale orders
/// of each operand uploaded, and the float64 product on the host.
struct SelfCheck {
    w: DeviceBuf,
    a: DeviceBuf,
    /// Weight scales K-major and row-major; activation scales K-major and token-major.
    w_scales: [DeviceBuf; 2],
    a_scales: [DeviceBuf; 2],
    d: DeviceBuf,
    want: Vec<f64>,
}

/// The check's shape: 256 weight rows, 384 columns (three K blocks), 64 tokens.
const CHECK: (usize, usize, usize) = (256, 384, 64);

impl SelfCheck {
    fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<SelfCheck, CudaError> {
        use tandem_model::weights::fp8::e4m3_to_f32;
        let (n, k, t) = CHECK;
        let kb = k / 128;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // Codes of magnitude up to 2^4 (no NaN), signed; scales spread over a factor of 16.
        let mut code = || {
            let r = next();
            ((r & 0x80) as u8) | (r % 0x58) as u8
        };
        let w: Vec<u8> = (0..n * k).map(|_| code()).collect();
        let a: Vec<u8> = (0..t * k).map(|_| code()).collect();
        let mut scale = || 0.01 * (1 + next() % 16) as f32;
        let ws: Vec<f32> = (0..(n / 128) * kb).map(|_| scale()).collect();
        let as_: Vec<f32> = (0..t * kb).map(|_| scale()).collect();
        let ws_row: Vec<f32> = (0..(n / 128) * kb)
            .map(|i| ws[(i % (n / 128)) * kb + i / (n / 128)])
            .collect();
        let as_row: Vec<f32> = (0..t * kb).map(|i| as_[(i % t) * kb + i / t]).collect();
        let mut want = vec![0f64; t * n];
        for m in 0..t {
            for r in 0..n {
                let mut acc = 0f64;
                for c in 0..k {
                    let wv = e4m3_to_f32(w[r * k + c]) as f64 * ws[(r / 128) * kb + c / 128] as f64;
                    let av = e4m3_to_f32(a[m * k + c]) as f64 * as_[m * kb + c / 128] as f64;
                    acc += wv * av;
                }
                want[m * n + r] = acc;
            }
        }
        let up = |bytes: &[u8]| -> Result<DeviceBuf, CudaError> {
            let buf = DeviceBuf::new(ctx, bytes.len())?;
            // SAFETY: buf holds exactly these bytes; the stream is synchronised before they drop.
            unsafe { drv_result::memcpy_htod_async(buf.ptr, bytes, stream.cu_stream()) }?;
            stream.synchronize()?;
            Ok(buf)
        };
        let f = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
        Ok(SelfCheck {
            w: up(&w)?,
            a: up(&a)?,
            w_scales: [up(&f(&ws))?, up(&f(&ws_row))?],
            a_scales: [up(&f(&as_))?, up(&f(&as_row))?],
            d: DeviceBuf::new(ctx, t * n * 2)?,
            want,
        })
    }

    /// The relative L2 error of `gemm`'s product in its current scale orders.
    fn run(&self, gemm: &Fp8Gemm, stream: &Arc<CudaStream>) -> Result<f64, CudaError> {
        let (n, k, t) = CHECK;
        let pick = |o: ScaleOrder| usize::from(o == ScaleOrder::RowMajor);
        gemm.matmul(
            stream,
            self.w.ptr,
            self.w_scales[pick(gemm.weight_order)].ptr,
            self.a.ptr,
            self.a_scales[pick(gemm.act_order)].ptr,
            self.d.ptr,
            t,
            n,
            k,
        )?;
        let mut got = vec![0u16; t * n];
        // SAFETY: d holds t × n bf16 values; the copy is synchronous on the stream.
        unsafe { drv_result::memcpy_dtoh_async(&mut got, self.d.ptr, stream.cu_stream()) }?;
        stream.synchronize()?;
        let (mut num, mut den) = (0f64, 0f64);
        for (i, w) in self.want.iter().enumerate() {
            // want is t × n; a swapped product is n × t.
            let at = if gemm.swapped { (i % n) * t + i / n } else { i };
            let g = f32::from_bits(u32::from(got[at]) << 16) as f64;
            num += (g - w).powi(2);
            den += w.powi(2);
        }
        Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
    }
}
