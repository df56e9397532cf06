//! AVX2 + FMA + F16C kernels. Every function here is `unsafe` with `#[target_feature]`: callers must have
//! checked `dispatch::simd_enabled()` (or `cpu_has_avx2()`) first.

use std::arch::x86_64::*;

use crate::matmul::RangeKernel;
use crate::quant::DType;

pub(crate) mod attn512;
mod qmatmul;
mod qmatmul512;

/// Format tags of the 32-element block kernels (const generic parameters of the AVX2 and AVX-512 code).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Bytes of one block of a 32-element format tag.
const fn q32_block_bytes(fmt: u8) -> usize {
    match fmt {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

/// The AVX2 matmul kernel for `dt`, if one exists.
pub(crate) fn matmul_kernel(dt: DType) -> Option<RangeKernel> {
    qmatmul::kernel(dt)
}

/// The AVX-512 VNNI matmul kernel for `dt`, if one exists; callers must have checked `Isa::Avx512`.
pub(crate) fn matmul_kernel_avx512(dt: DType) -> Option<RangeKernel> {
    qmatmul512::kernel(dt)
}

#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline(always)]
unsafe fn hmax(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_max_ps(lo, hi);
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// e^x for 8 lanes (Cephes polynomial, ~1 ulp on the clamped range); lanes below -87.3 give exactly 0.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp256(x: __m256) -> __m256 {
    let lo_bound = _mm256_set1_ps(-87.3);
    let keep = _mm256_cmp_ps(x, lo_bound, _CMP_GT_OQ);
    let xc = _mm256_min_ps(_mm256_max_ps(x, lo_bound), _mm256_set1_ps(88.3));
    let n = _mm256_round_ps(
        _mm256_mul_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.398_199_9e-3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.333_452e-3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.166_579_6e-2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.666_666_5e-1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5));
    let r2 = _mm256_mul_ps(r, r);
    y = _mm256_fmadd_ps(y, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep)
}

/// RMS norm with FMA accumulation.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let a = _mm256_loadu_ps(x.as_ptr().add(i));
        let b = _mm256_loadu_ps(x.as_ptr().add(i + 8));
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
        i += 16;
    }
    let mut ss = hsum(_mm256_add_ps(acc0, acc1));
    for &v in &x[i..] {
        ss += v * v;
    }
    let inv = 1.0 / (ss / n as f32 + eps).sqrt();
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

/// f32 dot product (attention scores).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            _mm256_loadu_ps(pb.add(i + 8)),
            acc1,
        );
        i += 16;
    }
    if i + 8 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
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
        y[i] += a * x[i];
        i += 1;
    }
}

/// Q8_0-style activation quantization (same math as the portable one, vectorized).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_q8_0_acts(x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
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
        dx[b] = d;
        sx[b] = d * sum as f32;
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
        crate::matmul::quantize_q8_0_acts(&x, &mut q1, &mut d1, &mut s1);
        unsafe { quantize_q8_0_acts(&x, &mut q2, &mut d2, &mut s2) };
        assert_eq!(q1, q2);
        assert_eq!(d1, d2);
        assert_eq!(s1, s2);
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
