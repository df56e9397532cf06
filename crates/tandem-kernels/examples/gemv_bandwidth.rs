//! The bandwidth of one decode matmul: one activation row times a `ROWS` × `COLS` matrix of random
//! weights in `DTYPE` (q8_0, q5_0, q4_1, q4_k, q6_k), streamed from memory (make it larger than the
//! last-level cache), e.g. Gemma 3 270M's Q8_0 output head:
//!
//! `cargo run --release -p tandem-kernels --example gemv_bandwidth -- q8_0 262144 640 [THREADS] [REPS]`
//!
//! Prints the best and median time and the weight bytes read per second, and a checksum of the output
//! so that two builds can be checked for identical results. Compare with `read_bandwidth`, the machine's
//! plain read rate.

use std::sync::Arc;
use std::time::Instant;

use tandem_kernels::{matmul, quantize_row, DType, MatmulScratch, Matrix, ThreadPool, WeightBytes};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: gemv_bandwidth DTYPE ROWS COLS [THREADS] [REPS]";
    let dtype = match args.first().map(String::as_str) {
        Some("q8_0") => DType::Q8_0,
        Some("q5_0") => DType::Q5_0,
        Some("q4_1") => DType::Q4_1,
        Some("q4_0") => DType::Q4_0,
        Some("q4_k") => DType::Q4K,
        Some("q6_k") => DType::Q6K,
        _ => panic!("{usage}"),
    };
    let num = |i: usize, default: usize| -> usize {
        args.get(i)
            .map_or(default, |a| a.parse().expect("whole numbers"))
    };
    let (rows, cols) = (num(1, 262_144), num(2, 640));
    let (threads, reps) = (num(3, 2), num(4, 20).max(1));
    // Deterministic weights in [-1, 1) (an LCG), quantized a row at a time.
    let mut state = 1u64;
    let mut row = vec![0f32; cols];
    let mut bytes = Vec::new();
    for _ in 0..rows {
        for v in row.iter_mut() {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            *v = (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        }
        quantize_row(dtype, &row, &mut bytes);
    }
    let n_bytes = bytes.len();
    let w = Matrix::new(dtype, rows, cols, WeightBytes::Owned(Arc::new(bytes))).expect(usage);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let pool = ThreadPool::new(threads);
    let (mut out, mut scratch) = (vec![0f32; rows], MatmulScratch::default());
    let mut secs: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            matmul(&pool, &w, &x, 1, &mut out, &mut scratch);
            start.elapsed().as_secs_f64()
        })
        .collect();
    secs.sort_by(f64::total_cmp);
    let checksum: f64 = out.iter().map(|&v| f64::from(v)).sum();
    let rate = |s: f64| n_bytes as f64 / s / 1e9;
    println!(
        "{dtype:?} {rows} x {cols}, one row, {threads} threads: {:.1} MB, best {:.3} ms ({:.1} GB/s), \
         median {:.3} ms ({:.1} GB/s) (checksum {checksum})",
        n_bytes as f64 / 1e6,
        secs[0] * 1e3,
        rate(secs[0]),
        secs[reps / 2] * 1e3,
        rate(secs[reps / 2]),
    );
}
