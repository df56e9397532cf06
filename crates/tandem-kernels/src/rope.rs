//! Rotary position embeddings with precomputed cos/sin tables.

/// Which element pairs a rotation acts on; GGUF llama weights need `Interleaved`, HF checkpoints `Neox`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum RopeStyle {
    /// Rotates adjacent pairs (x[2i], x[2i+1]) (llama.cpp "normal" rope on converter-permuted Q/K).
    Interleaved,
    /// Rotates (x[i], x[i + d/2]) (HF `rotate_half`).
    Neox,
}

/// Context-extension schemes that rescale the rotary frequencies.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(tag = "type", rename_all = "snake_case")
)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (equivalently every frequency).
    Linear {
        /// Position divisor.
        factor: f32,
    },
    /// Llama 3.x frequency-dependent scaling (HF `_compute_llama3_parameters`).
    Llama3 {
        /// Divisor for low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position / low_freq_factor` are fully scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// Training context of the base model.
        original_max_position: usize,
    },
    /// Per-pair frequency divisors, one per rotated pair: how GGUF files carry Llama 3.1+ scaling
    /// (`rope_freqs.weight`, llama.cpp's export of the same Llama 3 rule).
    FreqFactors {
        /// Pair `i`'s frequency is divided by `factors[i]`.
        factors: Vec<f32>,
    },
}

/// cos/sin tables precomputed up to max_positions.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    style: RopeStyle,
    /// `[pos][i]` for i in 0..head_dim/2.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Rotary inverse frequencies after scaling, one per rotated pair.
fn inv_freqs(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f64> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            let f = (theta as f64).powf(-(2.0 * i as f64) / head_dim as f64);
            match *scaling {
                RopeScaling::None => f,
                RopeScaling::Linear { factor } => f / factor as f64,
                RopeScaling::FreqFactors { ref factors } => f / factors[i] as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position,
                } => {
                    let (factor, lo, hi, old) = (
                        factor as f64,
                        low_freq_factor as f64,
                        high_freq_factor as f64,
                        original_max_position as f64,
                    );
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / hi {
                        f
                    } else if wavelen > old / lo {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

impl RopeTable {
    /// Precomputes cos/sin for positions `0..max_positions` the way llama.cpp's CPU rope does
    /// (`ggml_rope_cache_init`): the angle of pair `i` is `pos · s^i` with `s = base^(-2/head_dim)`, both
    /// computed in f32 (the power by repeated multiplication), then scaled and passed to f32 cos/sin.
    /// Llama 3 scaling given as parameters (HF checkpoints) keeps an f64 rule: llama.cpp only sees it as
    /// `FreqFactors`.
    pub fn new(
        head_dim: usize,
        theta: f32,
        scaling: &RopeScaling,
        max_positions: usize,
        style: RopeStyle,
    ) -> RopeTable {
        assert!(head_dim.is_multiple_of(2), "rope head_dim must be even");
        if let RopeScaling::FreqFactors { factors } = scaling {
            assert_eq!(
                factors.len(),
                head_dim / 2,
                "one rope frequency factor per pair"
            );
        }
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        if let RopeScaling::Llama3 { .. } = scaling {
            let freqs = inv_freqs(head_dim, theta, scaling);
            for p in 0..max_positions {
                for &f in &freqs {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        } else {
            let theta_scale = theta.powf(-2.0 / head_dim as f32);
            for p in 0..max_positions {
                let mut t = p as f32;
                for i in 0..half {
                    let a = match scaling {
                        RopeScaling::Linear { factor } => (1.0 / factor) * t,
                        RopeScaling::FreqFactors { factors } => t / factors[i],
                        _ => t,
                    };
                    cos.push(a.cos());
                    sin.push(a.sin());
                    t *= theta_scale;
                }
            }
        }
        RopeTable {
            head_dim,
            max_positions,
            style,
            cos,
            sin,
        }
    }

    /// Width of one head this table rotates.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Positions covered by the table.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Pair convention of this table.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// cos of every (position, pair) as `[pos][head_dim / 2]`, for backends that upload the table.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// sin of every (position, pair) as `[pos][head_dim / 2]`, for backends that upload the table.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// Rotates every head of one token's q or k vector (n_heads * head_dim floats) for position `pos`.
pub fn apply_rope(x: &mut [f32], n_heads: usize, pos: usize, table: &RopeTable) {
    let hd = table.head_dim;
    let half = hd / 2;
    assert_eq!(
        x.len(),
        n_heads * hd,
        "apply_rope: x must be n_heads * head_dim"
    );
    assert!(
        pos < table.max_positions,
        "apply_rope: position {pos} beyond table of {}",
        table.max_positions
    );
    let cos = &table.cos[pos * half..(pos + 1) * half];
    let sin = &table.sin[pos * half..(pos + 1) * half];
    #[cfg(target_arch = "x86_64")]
    if crate::dispatch::simd_enabled() {
        // SAFETY: simd_enabled implies FMA support.
        return unsafe { rotate_fma(x, hd, table.style, cos, sin) };
    }
    rotate(x, hd, table.style, cos, sin)
}

/// `rotate` compiled with hardware FMA (`mul_add` is otherwise a libm call); the same results.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rotate_fma(x: &mut [f32], hd: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    rotate(x, hd, style, cos, sin)
}

/// Rotates each pair `(a, b)` to `(a·cos − b·sin, a·sin + b·cos)`, each with one fused multiply-add
/// over the other product, as llama.cpp's compiled `rotate_pairs` does.
#[inline(always)]
fn rotate(x: &mut [f32], hd: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    for head in x.chunks_exact_mut(hd) {
        match style {
            RopeStyle::Interleaved => {
                for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a.mul_add(cos[i], -(b * sin[i]));
                    pair[1] = a.mul_add(sin[i], b * cos[i]);
                }
            }
            RopeStyle::Neox => {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a.mul_add(cos[i], -(b * sin[i]));
                    hi[i] = a.mul_add(sin[i], b * cos[i]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_norm_preserved() {
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let t = RopeTable::new(64, 10000.0, &RopeScaling::None, 100, style);
            let orig: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut x = orig.clone();
            apply_rope(&mut x, 2, 0, &t);
            assert_eq!(x, orig);
            apply_rope(&mut x, 2, 57, &t);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
            assert_ne!(x, orig);
        }
    }

    #[test]
    fn interleaved_and_neox_agree_under_permutation() {
        // Neox on (x0..x31 | x32..x63) equals interleaved on the pairs (x_i, x_{i+32}) laid adjacent.
        let hd = 64;
        let a = RopeTable::new(hd, 100000.0, &RopeScaling::None, 10, RopeStyle::Neox);
        let b = RopeTable::new(hd, 100000.0, &RopeScaling::None, 10, RopeStyle::Interleaved);
        let x: Vec<f32> = (0..hd).map(|i| i as f32 * 0.1 - 3.0).collect();
        let mut y: Vec<f32> = (0..hd)
            .map(|j| {
                if j % 2 == 0 {
                    x[j / 2]
                } else {
                    x[j / 2 + hd / 2]
                }
            })
            .collect();
        let mut xn = x.clone();
        apply_rope(&mut xn, 1, 7, &a);
        apply_rope(&mut y, 1, 7, &b);
        for i in 0..hd / 2 {
            assert!(
                (xn[i] - y[2 * i]).abs() < 1e-5 && (xn[i + hd / 2] - y[2 * i + 1]).abs() < 1e-5
            );
        }
    }

    #[test]
    fn rotation_angle_is_pos_times_freq() {
        let t = RopeTable::new(
            4,
            100.0,
            &RopeScaling::Linear { factor: 2.0 },
            8,
            RopeStyle::Interleaved,
        );
        let mut x = vec![1.0, 0.0, 1.0, 0.0];
        apply_rope(&mut x, 1, 3, &t);
        // pair 0: freq 1 / 2 -> angle 1.5; pair 1: freq 100^-0.5 / 2 = 0.05 -> angle 0.15.
        assert!((x[0] - 1.5f32.cos()).abs() < 1e-6 && (x[1] - 1.5f32.sin()).abs() < 1e-6);
        assert!((x[2] - 0.15f32.cos()).abs() < 1e-6 && (x[3] - 0.15f32.sin()).abs() < 1e-6);
    }

    /// Llama 3.1's published scaling (factor 8 over an 8k training context).
    fn llama3_8k() -> RopeScaling {
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }
    }

    #[test]
    fn llama3_scaling_matches_hf_bands() {
        let s = llama3_8k();
        let base = inv_freqs(128, 500000.0, &RopeScaling::None);
        let f = inv_freqs(128, 500000.0, &s);
        assert_eq!(f[0], base[0]); // highest frequency: wavelength 2π < 2048, kept
        assert!((f[63] - base[63] / 8.0).abs() < 1e-15); // lowest frequency: fully scaled
        let mid = (0..64).find(|&i| {
            let w = 2.0 * std::f64::consts::PI / base[i];
            w > 2048.0 && w < 8192.0
        });
        let i = mid.expect("a smoothed band exists");
        assert!(f[i] < base[i] && f[i] > base[i] / 8.0);
    }

    /// GGUF's per-pair factors (llama.cpp writes `1 / (llama3 scale of pair i)`) give the same frequencies
    /// as the Llama 3 rule they were exported from.
    #[test]
    fn freq_factors_reproduce_llama3() {
        let s = llama3_8k();
        let base = inv_freqs(128, 500000.0, &RopeScaling::None);
        let llama3 = inv_freqs(128, 500000.0, &s);
        let factors: Vec<f32> = base
            .iter()
            .zip(&llama3)
            .map(|(b, l)| (b / l) as f32)
            .collect();
        let f = inv_freqs(128, 500000.0, &RopeScaling::FreqFactors { factors });
        for (a, b) in f.iter().zip(&llama3) {
            assert!((a - b).abs() <= 1e-6 * b.abs());
        }
    }
}
