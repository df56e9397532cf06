//! Element-wise and row helpers of the forward pass (norms, residual adds, activations, softmax).

use std::sync::OnceLock;

use half::f16;

use crate::dispatch::simd_enabled;

/// RMS normalization `out = x / sqrt(mean(x²) + eps) * weight`, the Llama pre-norm.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rms_norm: length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if simd_enabled() {
        // SAFETY: simd_enabled implies AVX2+FMA support.
        return unsafe { crate::simd::rms_norm(x, weight, eps, out) };
    }
    rms_norm_portable(x, weight, eps, out)
}

pub(crate) fn rms_norm_portable(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // llama.cpp's order: f32 squares summed in f64, the mean rounded to f32, then 1/sqrt in f32.
    let ss: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let inv = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// Residual connection `a += b`.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add_inplace: length mismatch");
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// SwiGLU gate: `gate[i] = silu(gate[i]) * up[i]` with silu(x) = x / (1 + e^-x).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if simd_enabled() {
        // SAFETY: simd_enabled implies AVX2+FMA support.
        return unsafe { crate::simd::silu_mul(gate, up) };
    }
    silu_mul_portable(gate, up)
}

pub(crate) fn silu_mul_portable(gate: &mut [f32], up: &[f32]) {
    // Whole groups of 8 with llama.cpp's vector exp, a tail with libm's, as llama.cpp's swiglu does.
    let whole = gate.len() / 8 * 8;
    for (i, (g, &u)) in gate.iter_mut().zip(up).enumerate() {
        let e = if i < whole {
            exp_ggml(-*g)
        } else {
            (-*g).exp()
        };
        *g = *g / (1.0 + e) * u;
    }
}

/// GeGLU gate (Gemma): `gate[i] = gelu(gate[i]) * up[i]` with GELU's tanh approximation, as llama.cpp's
/// CPU backend computes it (`GGML_GELU_FP16`): 0 at or below −10, `x·up` at or above 10, and in between
/// `x` rounded to f16, looked up in [`gelu_table`], widened back to f32 and multiplied by `up`. The same
/// scalar code runs at every kernel level.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gelu_tanh_mul: length mismatch");
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            f16::from_bits(table[f16::from_f32(x).to_bits() as usize]).to_f32() * u
        };
    }
}

/// `√(2/π)` as llama.cpp's `SQRT_2_OVER_PI` rounds it to f32, and the cubic coefficient `GELU_COEF_A`.
const GELU_SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF: f32 = 0.044_715;

/// GELU's tanh approximation in f32, `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`, llama.cpp's
/// `ggml_gelu_f32` operation for operation as GCC compiles it (libm `tanhf`; `1 + 0.044715·x·x`
/// contracted into one fused multiply-add).
pub fn gelu_tanh_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_SQRT_2_OVER_PI * x * (GELU_COEF * x).mul_add(x, 1.0)).tanh())
}

/// llama.cpp's `ggml_table_gelu_f16`: for every f16 bit pattern `h`, the f16 bits of
/// [`gelu_tanh_f32`] of `h` widened to f32, a NaN as ggml's canonical one of its sign (built once,
/// 128 KiB).
pub fn gelu_table() -> &'static [u16] {
    static TABLE: OnceLock<Vec<u16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| {
                let g = gelu_tanh_f32(f16::from_bits(h).to_f32());
                if g.is_nan() {
                    0x7e00 | ((g.to_bits() >> 16) & 0x8000) as u16
                } else {
                    f16::from_f32(g).to_bits()
                }
            })
            .collect()
    })
}

/// Logit soft-capping: `x = cap · tanh(x / cap)`, which bounds every value to (-cap, cap).
pub fn softcap_inplace(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// Multiplies every element by `s`.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// e^x as one lane of llama.cpp's `ggml_v_expf` (bit-identical to `simd::exp256`): its softmax and SiLU
/// exponential, at most ~1.5 ulp off.
pub(crate) fn exp_ggml(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // ln2 low part
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // ln2 high part
    );
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)),
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 || n.is_nan() {
        return j.mul_add(k, k);
    }
    // Exponent out of the normal range: scale in two steps, or saturate to 0 / inf.
    let g = if n <= 0.0 { 0x8200_0000u32 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// Numerically stable softmax in place (sampling, logprobs); an all `-inf` row stays `NaN`-free as uniform.
pub fn softmax_inplace(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        let u = 1.0 / x.len() as f32;
        x.iter_mut().for_each(|v| *v = u);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd_enabled() {
        // SAFETY: simd_enabled implies AVX2+FMA support.
        let sum = unsafe { crate::simd::exp_sub_sum(x, max) };
        let inv = 1.0 / sum;
        x.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rms_norm_unit() {
        let x = [3.0f32, 4.0];
        let mut out = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one_and_handles_neg_inf() {
        let mut x = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
        assert!(x[2] > x[1] && x[1] > x[0]);
        let mut y = [f32::NEG_INFINITY; 4];
        softmax_inplace(&mut y);
        assert_eq!(y, [0.25; 4]);
    }

    proptest! {
        #[test]
        fn prop_ops_match_scalar_definitions(v in proptest::collection::vec(-20.0f32..20.0, 1..300)) {
            let w: Vec<f32> = v.iter().map(|a| a * 0.5 + 1.0).collect();
            let mut a = vec![0f32; v.len()];
            let mut b = vec![0f32; v.len()];
            rms_norm(&v, &w, 1e-5, &mut a);
            rms_norm_portable(&v, &w, 1e-5, &mut b);
            for (x, y) in a.iter().zip(&b) { prop_assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs())); }

            let mut g = v.clone();
            silu_mul(&mut g, &w);
            for ((x, &gi), &u) in g.iter().zip(&v).zip(&w) {
                let want = gi / (1.0 + (-gi).exp()) * u;
                prop_assert!((x - want).abs() <= 1e-4 * (1.0 + want.abs()), "{} vs {}", x, want);
            }

            let mut s = v.clone();
            softmax_inplace(&mut s);
            let max = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let denom: f64 = v.iter().map(|&t| ((t - max) as f64).exp()).sum();
            for (x, &t) in s.iter().zip(&v) {
                let want = (((t - max) as f64).exp() / denom) as f32;
                prop_assert!((x - want).abs() <= 1e-5 + 1e-4 * want);
            }

            let mut c = v.clone();
            add_inplace(&mut c, &w);
            for ((x, &p), &q) in c.iter().zip(&v).zip(&w) { prop_assert_eq!(*x, p + q); }
        }
    }

    #[test]
    fn gelu_tanh_mul_looks_up_the_f16_table_and_softcap_bounds() {
        let mut g = vec![
            -12.0f32, -10.0, -3.0, -0.5, 0.0, 0.5, 3.0, 10.0, 11.5, 0.1234,
        ];
        let up = vec![2.0f32; g.len()];
        gelu_tanh_mul(&mut g, &up);
        // Below −10: 0; from 10 up: x·up; in between f16(gelu(f16(x)))·up.
        assert_eq!(&g[..2], &[0.0, 0.0]);
        assert_eq!(&g[7..9], &[20.0, 23.0]);
        assert_eq!(g[4], 0.0);
        for (&x, &y) in [-3.0f32, -0.5, 0.5, 3.0, 0.1234]
            .iter()
            .zip([&g[2], &g[3], &g[5], &g[6], &g[9]])
        {
            let want = f16::from_f32(gelu_tanh_f32(f16::from_f32(x).to_f32())).to_f32() * 2.0;
            assert_eq!(y.to_bits(), want.to_bits(), "gelu({x})");
        }
        // gelu(3) ≈ 2.99636, gelu(−3) ≈ −0.00364 (tanh form), to f16 precision.
        assert!((g[6] - 2.0 * 2.996_363).abs() < 4e-3, "{}", g[6]);
        assert!((g[2] + 2.0 * 0.003_637).abs() < 1e-5, "{}", g[2]);
        let mut l = vec![-50.0f32, 0.0, 5.0, 50.0];
        softcap_inplace(&mut l, 30.0);
        assert!(l[0] > -30.0 && l[3] < 30.0 && l[1] == 0.0);
        assert!((l[2] - 30.0 * (5.0f32 / 30.0).tanh()).abs() < 1e-6);
        let mut s = vec![1.0f32, -2.0];
        scale_inplace(&mut s, 0.5);
        assert_eq!(s, vec![0.5, -1.0]);
    }

    /// The table against the exact GELU on all 65,536 f16 inputs: every finite entry is the f16 nearest to
    /// the f64 tanh-form GELU of its input, or within one f16 step of it plus the f32 evaluation's
    /// cancellation for negative inputs; NaN inputs stay NaN; infinities go where the f32 formula takes them.
    #[test]
    fn gelu_table_is_the_f16_tanh_gelu_of_every_f16() {
        let table = gelu_table();
        assert_eq!(table.len(), 1 << 16);
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h).to_f32();
            let got = f16::from_bits(table[h as usize]);
            if x.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
                continue;
            }
            let xd = x as f64;
            let exact = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * xd * (1.0 + 0.044715 * xd * xd))
                        .tanh());
            let near = f16::from_f64(exact);
            if x.is_infinite() {
                assert_eq!(
                    got.to_f32().to_bits(),
                    gelu_tanh_f32(x).to_bits(),
                    "{h:#06x}"
                );
                continue;
            }
            // One f16 step at the result, plus f32's cancellation in `1 + tanh(u)` for negative x.
            let step =
                (f16::from_bits(near.to_bits().saturating_add(1)).to_f32() - near.to_f32()).abs();
            let err = (got.to_f64() - exact).abs();
            assert!(
                got == near || err <= (step as f64).max(6e-8) + 1.2e-7 * xd.abs(),
                "gelu({x}): table {got} vs exact {near}"
            );
        }
    }

    /// The table is llama.cpp's own: the FNV-1a 64 hash of its 65,536 little-endian entries equals that
    /// of `ggml_table_gelu_f16` read from llama-cpp-python 0.3.36's `libggml-cpu.so` (AVX2 build, glibc
    /// `tanhf`) after `ggml_cpu_init`. Another libm's `tanhf` may round a few entries differently.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn gelu_table_is_llamacpps() {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in gelu_table().iter().flat_map(|v| v.to_le_bytes()) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        assert_eq!(h, 0xab04_4edb_a0ed_200c);
    }
}
