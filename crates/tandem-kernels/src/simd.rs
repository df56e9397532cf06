//! AVX2 + FMA + F16C kernels. Every function here is `unsafe` with `#[target_feature]`: callers must have
//! checked `dispatch::simd_enabled()` (or `cpu_has_avx2()`) first.

use std::arch::x86_64::*;

use crate::matmul::RangeKernel;
use crate::quant::DType;

/// Where one tile of a 32-element-format kernel (AVX2 or AVX-512) reads and writes: weight rows from `w`
/// (stride `rb` bytes, `nb` blocks a row) × activation rows from `qx` (stride `cols`).
struct Q32Tile {
    w: *const u8,
    rb: usize,
    nb: usize,
    /// The first activation row's quants, and its scales and sums (row-major, `nb` a row).
    qx: *const i8,
    dx: *const f32,
    sx: *const f32,
    /// The first activation row's block-0 scale in the block-major scales (block stride `m`, the input's
    /// activation rows; `m` is 0 when they were not filled, see `matmul::uses_block_major_scales`).
    dxt: *const f32,
    m: usize,
    cols: usize,
    /// out[first activation row][first weight row].
    out: *mut f32,
    out_stride: usize,
}

impl Q32Tile {
    /// The tile of `job` whose first weight row is `i` and first activation row `j`.
    ///
    /// # Safety
    /// `i` and `j` must lie inside the job's weight and activation rows.
    #[inline(always)]
    unsafe fn at(job: &crate::matmul::Job, i: usize, j: usize) -> Self {
        let w = job.w;
        let (cols, rb, nb, a) = (w.cols(), w.row_bytes(), w.cols() / 32, &job.acts);
        Q32Tile {
            w: w.bytes().as_ptr().add(i * rb),
            rb,
            nb,
            qx: a.qx.as_ptr().add(j * cols),
            dx: a.dx.as_ptr().add(j * nb),
            sx: a.sx.as_ptr().add(j * nb),
            dxt: a.dxt.as_ptr().wrapping_add(j),
            m: a.dxt.len().saturating_sub(4) / nb,
            cols,
            out: job.out.0.add(j * w.rows() + i),
            out_stride: w.rows(),
        }
    }
}

pub(crate) mod attn256;
pub(crate) mod attn512;
pub(crate) mod chunk;
mod qmatmul;
mod qmatmul512;

/// Format tags of the 32-element block kernels (const generic parameters of the AVX2 and AVX-512 code).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 5;

/// Bytes of one block of a 32-element format tag.
const fn q32_block_bytes(fmt: u8) -> usize {
    match fmt {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        _ => 34,
    }
}

/// The AVX2 matmul kernel for `dt`, if one exists.
pub(crate) fn matmul_kernel(dt: DType) -> Option<RangeKernel> {
    qmatmul::kernel(dt)
}

/// The AVX2 Q4_1 kernel over the repacked layout of `Matrix::q4_1_pairs` (the job's `pairs`).
pub(crate) fn matmul_kernel_q4_1_pairs() -> RangeKernel {
    qmatmul::run_q4_1_pairs
}

/// The AVX-512 VNNI matmul kernel for `dt`, if one exists; callers must have checked `Isa::Avx512`.
pub(crate) fn matmul_kernel_avx512(dt: DType) -> Option<RangeKernel> {
    qmatmul512::kernel(dt)
}

/// Defines `$name`, the horizontal reduction of a `__m256`'s 8 lanes by the 128-bit operation `$op` and
/// its scalar form `$op_ss`: the one shuffle sequence of the sum and the max.
macro_rules! horizontal {
    ($vis:vis fn $name:ident = $op:ident, $op_ss:ident) => {
        #[inline(always)]
        $vis unsafe fn $name(v: __m256) -> f32 {
            let lo = _mm256_castps256_ps128(v);
            let hi = _mm256_extractf128_ps(v, 1);
            let s = $op(lo, hi);
            let s = $op(s, _mm_movehl_ps(s, s));
            let s = $op_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    };
}

/// How far past the weights a tile computes on [`Prefetch`] asks for lines (bytes): about a tile
/// of the narrow matrices ahead (8 rows of a 640-wide Q8_0 matrix are 5,440 bytes), so that a line
/// requested at one block arrives before its tile starts.
const PREFETCH_AHEAD: usize = 6144;

/// The prefetch of a matmul tile, which matters most in decode (one or a few activation rows: every
/// weight byte streamed once, bound by memory): the `span` bytes of weights lying [`PREFETCH_AHEAD`]
/// past the tile's own, asked for once each 64-byte line, in address order, a share at each of the
/// tile's blocks. Consecutive tiles of contiguous rows so ask for every line ahead once, as one linear
/// stream the memory system keeps up with; asking instead for each row's block rows ahead (8 streams
/// 680 bytes apart, every line twice) held Gemma 3's Q8_0 output head to 18.6 GB/s on two Zen 4 cores
/// that read 32 (26.5 this way; BENCHMARKS.md).
pub(crate) struct Prefetch {
    next: *const u8,
    end: *const u8,
    per_block: usize,
}

impl Prefetch {
    /// The prefetch for a tile whose weights are the `span` bytes at `w`, computed in `blocks` steps.
    #[inline(always)]
    pub(crate) fn new(w: *const u8, span: usize, blocks: usize) -> Prefetch {
        let next = w.wrapping_add(PREFETCH_AHEAD);
        Prefetch {
            next,
            end: next.wrapping_add(span),
            per_block: span.div_ceil(64).div_ceil(blocks.max(1)),
        }
    }

    /// Asks for the next block's share of lines (past the end of the matrix is harmless: a prefetch never
    /// faults, and `wrapping_add` keeps the address arithmetic defined).
    #[inline(always)]
    pub(crate) unsafe fn block(&mut self) {
        for _ in 0..self.per_block {
            if self.next >= self.end {
                return;
            }
            _mm_prefetch::<_MM_HINT_T0>(self.next.cast::<i8>());
            self.next = self.next.wrapping_add(64);
        }
    }
}

horizontal!(pub(crate) fn hsum = _mm_add_ps, _mm_add_ss);
horizontal!(fn hmax = _mm_max_ps, _mm_max_ss);

/// e^x per lane, llama.cpp's AVX2 `ggml_v_expf` operation for operation (its softmax and SiLU use it, so
/// the same inputs give the same bits); at most ~1.5 ulp off, 0 for -inf and below about -103.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp256(x: __m256) -> __m256 {
    let r = _mm256_set1_ps(f32::from_bits(0x4b40_0000)); // 0x1.8p23
    let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), r); // log2(e)
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(
        n,
        _mm256_set1_ps(f32::from_bits(0x35bf_be8e)), // ln2 low part 0x1.7f7d1cp-20
        _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x), // ln2 high 0x1.62e4p-1
    );
    let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    let k = _mm256_castsi256_ps(_mm256_add_epi32(
        e,
        _mm256_castps_si256(_mm256_set1_ps(1.0)),
    ));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let c = _mm256_castps_si256(_mm256_cmp_ps(abs_n, _mm256_set1_ps(126.0), _CMP_GT_OQ));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32::from_bits(0x3c07_2010)), // 0x1.0e4020p-7
                b,
                _mm256_set1_ps(f32::from_bits(0x3d2b_9f17)), // 0x1.573e2ep-5
            ),
            u,
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32::from_bits(0x3e2a_af33)), // 0x1.555e66p-3
                b,
                _mm256_set1_ps(f32::from_bits(0x3eff_fedb)), // 0x1.fffdb6p-2
            ),
        ),
        u,
        _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(0x3f7f_fff6)), b), // 0x1.ffffecp-1
    );
    if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    // Some lane's exponent is out of the normal range: scale in two steps (or saturate to 0 / inf).
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let d = _mm256_castsi256_ps(_mm256_castps_si256(_mm256_cmp_ps(
        abs_n,
        _mm256_set1_ps(192.0),
        _CMP_GT_OQ,
    )));
    let c = _mm256_castsi256_ps(c);
    _mm256_or_ps(
        _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            d,
            _mm256_or_ps(
                _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

/// RMS norm; the sum of squares is accumulated in f64 like llama.cpp's (see `ops::rms_norm`).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    // Squares are rounded to f32 first, then summed in f64 (four independent 4-lane chains: f64 sums of
    // a few thousand f32 squares round to the same f32 mean whatever the order, except at ties).
    let mut acc = [_mm256_setzero_pd(); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let v = _mm_loadu_ps(x.as_ptr().add(i + 4 * k));
            *a = _mm256_add_pd(*a, _mm256_cvtps_pd(_mm_mul_ps(v, v)));
        }
        i += 16;
    }
    let s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    let s2 = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    let mut ss = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
    for &v in &x[i..] {
        ss += (v * v) as f64;
    }
    let inv = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
    let vi = _mm256_set1_ps(inv);
    let mut i = 0;
    while i + 8 <= n {
        let a = _mm256_loadu_ps(x.as_ptr().add(i));
        let w = _mm256_loadu_ps(weight.as_ptr().add(i));
        _mm256_storeu_ps(
            out.as_mut_ptr().add(i),
            _mm256_mul_ps(_mm256_mul_ps(a, vi), w),
        );
        i += 8;
    }
    for j in i..n {
        out[j] = x[j] * inv * weight[j];
    }
}

/// gate = silu(gate) * up with the vector exp.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len();
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i + 8 <= n {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
        i += 8;
    }
    crate::ops::silu_mul_portable(&mut gate[i..], &up[i..]);
}

/// x[i] = e^(x[i] - max); returns the sum (softmax numerator).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    let n = x.len();
    let vm = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), vm));
        _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut sum = hsum(acc);
    for v in &mut x[i..] {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// f32 dot product (attention scores) in the order of llama.cpp's AVX2 `ggml_vec_dot_f32`: four 8-lane
/// FMA accumulators over steps of 32, combined (0+2, 1+3, then 0+1), the halves added and two `hadd`s;
/// a tail of fewer than 32 elements is added one fused multiply-add at a time.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut i = n / 32 * 32;
    let x = dot_f32_lanes(a.as_ptr(), b.as_ptr(), i);
    let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    let t1 = _mm_hadd_ps(t0, t0);
    let mut s = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    while i < n {
        s = a[i].mul_add(b[i], s);
        i += 1;
    }
    s
}

/// `dot_f32`'s 8 lanes before its last reductions, over the first `n` (a multiple of 32) elements:
/// partial sum `P_k` adds `a[32s + k] · b[32s + k]` over the steps `s` by fused multiply-adds from 0, and
/// lane l is `(P_l + P_16+l) + (P_8+l + P_24+l)`.
// Plain index loops (no closures) so that every intrinsic sits in the inlined body of a target-feature
// function.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(crate) unsafe fn dot_f32_lanes(a: *const f32, b: *const f32, n: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        for j in 0..4 {
            let o = i + 8 * j;
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), acc[j]);
        }
        i += 32;
    }
    _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]))
}

/// Softmax numerators over whole chunks of 8 (`x.len()` a multiple of 8; -inf entries give 0):
/// x[i] = e^(x[i] − max), returning their sum as llama.cpp's AVX2 `ggml_vec_soft_max_f32` forms it (each
/// chunk summed in f32 by `hsum`, the chunk sums in f64).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn softmax_numerators(x: &mut [f32], max: f32) -> f64 {
    debug_assert!(x.len().is_multiple_of(8));
    let vm = _mm256_set1_ps(max);
    let mut sum = 0f64;
    for c in x.chunks_exact_mut(8) {
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), vm));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        sum += hsum(e) as f64;
    }
    sum
}

/// out[i] = the llamafile `hsum` of the 8 lane accumulators `acc[r][i]`:
/// ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn reduce_lanes8(acc: &[[f32; 256]; 8], out: &mut [f32]) {
    let n = out.len();
    let ld = |r: usize, i: usize| _mm256_loadu_ps(acc[r].as_ptr().add(i));
    let mut i = 0;
    while i + 8 <= n {
        let t = [
            _mm256_add_ps(ld(4, i), ld(0, i)),
            _mm256_add_ps(ld(5, i), ld(1, i)),
            _mm256_add_ps(ld(6, i), ld(2, i)),
            _mm256_add_ps(ld(7, i), ld(3, i)),
        ];
        let u0 = _mm256_add_ps(t[0], t[2]);
        let u1 = _mm256_add_ps(t[1], t[3]);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_add_ps(u0, u1));
        i += 8;
    }
    for (j, o) in out.iter_mut().enumerate().skip(i) {
        *o = crate::attention::hsum8_at(acc, j);
    }
}

/// y += a * x (attention value accumulation).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn axpy_f32(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let va = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let p = y.as_mut_ptr().add(i);
        _mm256_storeu_ps(
            p,
            _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)),
        );
        i += 8;
    }
    while i < n {
        y[i] = a.mul_add(x[i], y[i]);
        i += 1;
    }
}

/// Q8_0/Q8_1 activation quantization (same math as the portable one, vectorized).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0_acts(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    sx: &mut [f32],
    q8_1: bool,
) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..x.len() / 32 {
        let p = x.as_ptr().add(32 * b);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
        let m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
        let amax = hmax(_mm256_max_ps(m01, m23));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let r = |v: __m256| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v, id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        };
        let (i0, i1, i2, i3) = (r(v[0]), r(v[1]), r(v[2]), r(v[3]));
        let s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        let s128 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s128 = _mm_hadd_epi32(s128, s128);
        let sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s128, s128));
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256(
            qx.as_mut_ptr().add(32 * b) as *mut __m256i,
            _mm256_permutevar8x32_epi32(packed, perm),
        );
        // f32 → f16 → f32 with round-to-nearest-even, like ggml's F16C conversion.
        let f16r = |v: f32| {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
                _mm_set_ss(v),
            )))
        };
        dx[b] = f16r(d);
        sx[b] = if q8_1 {
            f16r(d * sum as f32)
        } else {
            dx[b] * sum as f32
        };
    }
}

/// Q8_K activation quantization (`matmul::quantize_q8_k_acts`' math, vectorized): the block's largest
/// magnitude by a vector max, the value carrying it (the first, or with `positive_wins` a positive one)
/// by a scan that stops at it, then `iscale·x` rounded half to even 8 lanes at a time. The portable
/// loop's per-element `round_ties_even` is a libm call (`rintf`) without SSE4.1, about 5% of a Gemma 3
/// prefill.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_q8_k_acts(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    bsums: &mut [i16],
    positive_wins: bool,
) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let top = _mm256_set1_epi32(127);
    for (((xb, qb), d), bs) in x
        .chunks_exact(256)
        .zip(qx.chunks_exact_mut(256))
        .zip(dx.iter_mut())
        .zip(bsums.chunks_exact_mut(16))
    {
        let p = xb.as_ptr();
        let mut m = _mm256_setzero_ps();
        for i in (0..256).step_by(8) {
            // NaN-safe as the scalar scan: a NaN operand makes `max_ps` return its second, the max so far.
            m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(i))), m);
        }
        let amax = hmax(m);
        if amax == 0.0 {
            qb.fill(0);
            bs.fill(0);
            *d = 0.0;
            continue;
        }
        let first = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let max = if positive_wins && first < 0.0 && xb.contains(&amax) {
            amax
        } else {
            first
        };
        let iscale = -127.0 / max;
        let vs = _mm256_set1_ps(iscale);
        let r = |i: usize| {
            _mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(vs, _mm256_loadu_ps(p.add(i))),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                )),
                top,
            )
        };
        for i in (0..256).step_by(32) {
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(r(i), r(i + 8)),
                _mm256_packs_epi32(r(i + 16), r(i + 24)),
            );
            _mm256_storeu_si256(
                qb.as_mut_ptr().add(i).cast(),
                _mm256_permutevar8x32_epi32(packed, perm),
            );
        }
        *d = 1.0 / iscale;
        for (s, g) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(g.as_ptr().cast()));
            let h = _mm_add_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            let h = _mm_hadd_epi16(h, h);
            let h = _mm_hadd_epi16(h, h);
            *s = _mm_extract_epi16(_mm_hadd_epi16(h, h), 0) as i16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::cpu_has_avx2;

    #[test]
    fn exp256_accuracy() {
        if !cpu_has_avx2() {
            return;
        }
        let xs: Vec<f32> = (0..800).map(|i| -87.0 + i as f32 * 0.219).collect();
        for c in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp256(_mm256_loadu_ps(c.as_ptr()))) };
            for (o, &x) in out.iter().zip(c) {
                let want = (x as f64).exp();
                assert!(
                    ((*o as f64) - want).abs() <= 2e-7 * want,
                    "exp({x}) = {o}, want {want}"
                );
            }
        }
        let mut out = [1f32; 8];
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp256(_mm256_set1_ps(f32::NEG_INFINITY))) };
        assert_eq!(out, [0.0; 8]);
    }

    /// The scalar port of llama.cpp's exponential gives the vector one's bits, in and out of range.
    #[test]
    fn exp_ggml_scalar_equals_exp256() {
        if !cpu_has_avx2() {
            return;
        }
        let mut xs: Vec<f32> = (0..4000).map(|i| -120.0 + i as f32 * 0.0613).collect();
        xs.extend([
            f32::NEG_INFINITY,
            f32::INFINITY,
            -0.0,
            0.0,
            88.7,
            89.0,
            -87.4,
            -103.9,
            -150.0,
        ]);
        xs.resize(xs.len().next_multiple_of(8), 1.0);
        for c in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp256(_mm256_loadu_ps(c.as_ptr()))) };
            for (o, &x) in out.iter().zip(c) {
                assert_eq!(o.to_bits(), crate::ops::exp_ggml(x).to_bits(), "exp({x})");
            }
        }
    }

    #[test]
    fn simd_act_quant_matches_portable() {
        if !cpu_has_avx2() {
            return;
        }
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0 + 0.0013)
            .collect();
        let (mut q1, mut d1, mut s1) = (vec![0i8; 256], vec![0f32; 8], vec![0f32; 8]);
        let (mut q2, mut d2, mut s2) = (vec![0i8; 256], vec![0f32; 8], vec![0f32; 8]);
        for q8_1 in [false, true] {
            crate::matmul::quantize_q8_0_acts(&x, &mut q1, &mut d1, &mut s1, q8_1);
            unsafe { quantize_q8_0_acts(&x, &mut q2, &mut d2, &mut s2, q8_1) };
            assert_eq!(q1, q2);
            assert_eq!(d1, d2);
            assert_eq!(s1, s2);
        }
    }

    #[test]
    fn simd_q8_k_quant_matches_portable() {
        if !cpu_has_avx2() {
            return;
        }
        // Block 0: ordinary values; 1: -amax before +amax (the tie `positive_wins` decides); 2: +amax
        // first; 3: all zero; 4: halves exactly between two quants (ties to even); 5: one huge value.
        let mut x: Vec<f32> = (0..6 * 256)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0 + 0.0013)
            .collect();
        x[256 + 3] = -2.5;
        x[256 + 200] = 2.5;
        x[512 + 5] = 2.5;
        x[512 + 9] = -2.5;
        x[768..1024].fill(0.0);
        for (i, v) in x[1024..1280].iter_mut().enumerate() {
            *v = (i as f32 - 127.5) * 0.5;
        }
        x[1280 + 77] = 1e6;
        let n = x.len();
        for positive_wins in [false, true] {
            let (mut q1, mut d1, mut s1) = (vec![0i8; n], vec![0f32; n / 256], vec![0i16; n / 16]);
            let (mut q2, mut d2, mut s2) = (vec![1i8; n], vec![1f32; n / 256], vec![1i16; n / 16]);
            crate::matmul::quantize_q8_k_acts(&x, &mut q1, &mut d1, &mut s1, positive_wins);
            unsafe { quantize_q8_k_acts(&x, &mut q2, &mut d2, &mut s2, positive_wins) };
            assert_eq!(q1, q2, "positive_wins {positive_wins}");
            assert_eq!(d1, d2, "positive_wins {positive_wins}");
            assert_eq!(s1, s2, "positive_wins {positive_wins}");
        }
    }

    #[test]
    fn simd_float_helpers_match_scalar() {
        if !cpu_has_avx2() {
            return;
        }
        let a: Vec<f32> = (0..77).map(|i| (i as f32 * 0.31).sin()).collect();
        let b: Vec<f32> = (0..77).map(|i| (i as f32 * 0.17).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((unsafe { dot_f32(&a, &b) } - want).abs() < 1e-4);
        let mut y = b.clone();
        unsafe { axpy_f32(&mut y, 0.5, &a) };
        for i in 0..77 {
            assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
        }
    }
}
