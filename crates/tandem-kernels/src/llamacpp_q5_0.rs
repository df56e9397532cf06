//! Q5_0 against llama.cpp's own arithmetic: `tests/fixtures/q5_0_llamacpp.bin`, recorded by
//! `scripts/fixtures/gen-q5_0-fixture.sh` from llama.cpp's sources built generic, AVX2 and AVX-512
//! (layout in that script), holds fixed activations, Q5_0 weights quantized by llama.cpp, their
//! `dequantize_row_q5_0`, and per build the `quantize_row_q8_0` activation blocks and the
//! `ggml_vec_dot_q5_0_q8_0` results.
//!
//! Every level of this crate follows llama.cpp's x86 order (the portable kernel included, as for Q4_0,
//! Q4_1 and Q8_0), so each must give the AVX2 and AVX-512 builds' bits; llama.cpp's generic build sums
//! blocks in one scalar chain and rounds activation ties away from zero, so it is only close.

use std::sync::Arc;

use half::f16;

use crate::dispatch::{cpu_isa, with_isa, Isa};
use crate::matmul::{matmul, quantize_q8_0_acts, MatmulScratch};
use crate::quant::{dequantize, DType, Matrix, WeightBytes};
use crate::threads::ThreadPool;

const FIXTURE: &[u8] = include_bytes!("../tests/fixtures/q5_0_llamacpp.bin");

/// One llama.cpp build's records: its Q8_0 activation blocks and its dot products (`m × rows`).
struct Build {
    xq: Vec<u8>,
    out: Vec<f32>,
}

struct Fixture {
    rows: usize,
    cols: usize,
    m: usize,
    x: Vec<f32>,
    wq: Vec<u8>,
    wdq: Vec<f32>,
    generic: Build,
    avx2: Build,
    avx512: Build,
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn load() -> Fixture {
    let u32_at = |i: usize| u32::from_le_bytes(FIXTURE[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(u32_at(0), u32::from_le_bytes(*b"q5b0"), "fixture magic");
    let (rows, cols, m) = (u32_at(1) as usize, u32_at(2) as usize, u32_at(3) as usize);
    let mut at = 16;
    let mut take = |n: usize| {
        let s = &FIXTURE[at..at + n];
        at += n;
        s
    };
    let x = f32s(take(4 * m * cols));
    let wq = take(DType::Q5_0.row_bytes(cols) * rows).to_vec();
    let wdq = f32s(take(4 * rows * cols));
    let mut build = || Build {
        xq: take(DType::Q8_0.row_bytes(cols) * m).to_vec(),
        out: f32s(take(4 * m * rows)),
    };
    let (generic, avx2, avx512) = (build(), build(), build());
    assert_eq!(at, FIXTURE.len(), "fixture size");
    Fixture {
        rows,
        cols,
        m,
        x,
        wq,
        wdq,
        generic,
        avx2,
        avx512,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// `dequantize` gives `dequantize_row_q5_0`'s bits.
#[test]
fn dequantize_matches_llamacpp() {
    let f = load();
    let mut out = vec![f32::NAN; f.rows * f.cols];
    dequantize(DType::Q5_0, &f.wq, &mut out);
    assert_eq!(bits(&out), bits(&f.wdq));
}

/// The activation quantization of every level gives the x86 builds' `quantize_row_q8_0` blocks.
#[test]
fn activation_blocks_match_llamacpp_x86() {
    let f = load();
    assert_eq!(f.avx2.xq, f.avx512.xq, "llama.cpp's x86 builds agree");
    let nb = f.m * f.cols / 32;
    let (mut q, mut d, mut s) = (vec![0i8; f.m * f.cols], vec![0f32; nb], vec![0f32; nb]);
    let check = |q: &[i8], d: &[f32], level: &str| {
        for (b, blk) in f.avx2.xq.chunks_exact(34).enumerate() {
            let d16 = f16::from_f32(d[b]);
            assert_eq!(d16.to_f32(), d[b], "{level}: block {b} scale is an f16");
            assert_eq!(&d16.to_le_bytes(), &blk[..2], "{level}: block {b} scale");
            let want: Vec<i8> = blk[2..].iter().map(|&v| v as i8).collect();
            assert_eq!(
                &q[32 * b..32 * b + 32],
                &want[..],
                "{level}: block {b} quants"
            );
        }
    };
    quantize_q8_0_acts(&f.x, &mut q, &mut d, &mut s, false);
    check(&q, &d, "portable");
    #[cfg(target_arch = "x86_64")]
    if cpu_isa() >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2+FMA+F16C.
        unsafe { crate::simd::quantize_q8_0_acts(&f.x, &mut q, &mut d, &mut s, false) };
        check(&q, &d, "avx2");
    }
    // llama.cpp's generic build rounds ties away from zero (the fixture's activation row 5 has ties).
    assert_ne!(f.generic.xq, f.avx2.xq);
}

/// Every level this CPU supports reproduces `ggml_vec_dot_q5_0_q8_0` of llama.cpp's AVX2 and AVX-512
/// builds bit for bit, whole batch (tiles of several activation rows) and row by row (decode tiles).
#[test]
fn matmul_matches_llamacpp_x86_bitwise() {
    let f = load();
    assert_eq!(
        bits(&f.avx2.out),
        bits(&f.avx512.out),
        "llama.cpp's x86 builds agree"
    );
    let w = Matrix::new(
        DType::Q5_0,
        f.rows,
        f.cols,
        WeightBytes::Owned(Arc::new(f.wq.clone())),
    )
    .unwrap();
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    for level in Isa::ALL.into_iter().filter(|&l| l <= cpu_isa()) {
        let mut out = vec![f32::NAN; f.m * f.rows];
        with_isa(level, || {
            matmul(&pool, &w, &f.x, f.m, &mut out, &mut scratch)
        });
        assert_eq!(bits(&out), bits(&f.avx2.out), "{level:?}, m = {}", f.m);
        for t in 0..f.m {
            let mut row = vec![f32::NAN; f.rows];
            let x = &f.x[t * f.cols..(t + 1) * f.cols];
            with_isa(level, || matmul(&pool, &w, x, 1, &mut row, &mut scratch));
            assert_eq!(
                bits(&row),
                bits(&f.avx2.out[t * f.rows..(t + 1) * f.rows]),
                "{level:?}, activation row {t} alone"
            );
        }
    }
}

/// What llama.cpp's generic build computes, read back from its records: per row one scalar chain
/// `sumf += (d_w·d_x)·Σq` over its own (ties-away) activation blocks, unfused. The kernels' x86 order
/// (8 lanes per block, fused, summed at the end) differs from it in the last bits, as the fixture shows.
#[test]
fn llamacpp_generic_build_is_one_scalar_chain() {
    let f = load();
    let (nb, wrb, xrb) = (
        f.cols / 32,
        DType::Q5_0.row_bytes(f.cols),
        DType::Q8_0.row_bytes(f.cols),
    );
    let mut differ = 0;
    for t in 0..f.m {
        for r in 0..f.rows {
            let mut sumf = 0f32;
            for b in 0..nb {
                let wb = &f.wq[r * wrb + 22 * b..][..22];
                let xb = &f.generic.xq[t * xrb + 34 * b..][..34];
                let sumi: i32 = (0..32)
                    .map(|j| (crate::quant::q5_0_value(wb, j) - 16) * xb[2 + j] as i8 as i32)
                    .sum();
                let d = crate::quant::f16_at(wb) * crate::quant::f16_at(xb);
                sumf += d * sumi as f32;
            }
            let (i, x86) = (t * f.rows + r, f.avx2.out[t * f.rows + r]);
            assert_eq!(sumf.to_bits(), f.generic.out[i].to_bits(), "[{t}][{r}]");
            differ += usize::from(sumf.to_bits() != x86.to_bits());
        }
    }
    assert!(differ > 0, "the fixture should show the orders differ");
}
