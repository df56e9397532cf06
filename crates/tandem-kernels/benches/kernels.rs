//! Kernel benchmarks on the default model's shapes (SmolLM2-135M: hidden 576, ffn 1536, vocab 49152).
//!
//! Throughput is reported as bytes of weights read (m = 1, memory bound) or elements (m > 1, where one
//! element = one multiply-add; GFLOP/s = 2 × Gelem/s).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use std::time::Duration;
use tandem_kernels::{
    matmul, paged_attention, quantize_row, write_kv, AttnParams, AttnSeq, DType, MatmulScratch,
    Matrix, ThreadPool, WeightBytes,
};

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matrix(dt: DType, rows: usize, cols: usize) -> Matrix {
    let w = rand_vec(rows * cols, 1);
    let mut bytes = Vec::with_capacity(rows * dt.row_bytes(cols));
    for r in w.chunks_exact(cols) {
        quantize_row(dt, r, &mut bytes);
    }
    Matrix::new(dt, rows, cols, WeightBytes::Owned(Arc::new(bytes))).expect("sizes")
}

fn bench_matmul(c: &mut Criterion) {
    let pool = ThreadPool::new(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let mut g = c.benchmark_group("matmul");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    let shapes = [(DType::Q4_1, 1536, 576), (DType::Q4_1, 576, 1536)];
    for &(dt, rows, cols) in &shapes {
        let w = matrix(dt, rows, cols);
        for m in [1usize, 16, 512] {
            let x = rand_vec(m * cols, 2);
            let mut out = vec![0f32; m * rows];
            let mut scratch = MatmulScratch::default();
            if m == 1 {
                g.throughput(Throughput::Bytes(w.bytes().len() as u64));
            } else {
                g.throughput(Throughput::Elements((m * rows * cols) as u64));
            }
            g.bench_function(format!("{dt:?}_{rows}x{cols}_m{m}"), |b| {
                b.iter(|| matmul(&pool, &w, &x, m, &mut out, &mut scratch))
            });
        }
    }
    let head = matrix(DType::Q8_0, 49152, 576);
    let x = rand_vec(576, 3);
    let mut out = vec![0f32; 49152];
    let mut scratch = MatmulScratch::default();
    g.throughput(Throughput::Bytes(head.bytes().len() as u64));
    g.bench_function("Q8_0_49152x576_m1", |b| {
        b.iter(|| matmul(&pool, &head, &x, 1, &mut out, &mut scratch))
    });
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let pool = ThreadPool::new(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let p = AttnParams {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        scale: 0.125,
        window: None,
    };
    let ctx = 512;
    let n_blocks = ctx / p.block_size;
    let mut kv = vec![0f32; n_blocks * 2 * p.n_kv_heads * p.block_size * p.head_dim];
    let table: Vec<u32> = (0..n_blocks as u32).rev().collect();
    let kvw = rand_vec(2 * p.n_kv_heads * p.head_dim, 4);
    for pos in 0..ctx {
        write_kv(
            &p,
            &mut kv,
            &table,
            pos,
            &kvw[..p.n_kv_heads * p.head_dim],
            &kvw[p.n_kv_heads * p.head_dim..],
        );
    }
    let q = rand_vec(ctx * p.n_heads * p.head_dim, 5);
    let mut out = vec![0f32; q.len()];
    let mut g = c.benchmark_group("attention");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    let seq = [AttnSeq {
        q_row: 0,
        n_q: 1,
        ctx_len: ctx,
        blocks: &table,
    }];
    g.throughput(Throughput::Elements(
        (p.n_heads * ctx * p.head_dim * 2) as u64,
    ));
    g.bench_function("decode_ctx512", |b| {
        b.iter(|| {
            paged_attention(
                &pool,
                &p,
                &q[..p.n_heads * p.head_dim],
                &kv,
                &seq,
                &mut out[..p.n_heads * p.head_dim],
            )
        })
    });
    let seq = [AttnSeq {
        q_row: 0,
        n_q: ctx,
        ctx_len: ctx,
        blocks: &table,
    }];
    g.throughput(Throughput::Elements(
        (p.n_heads * ctx * ctx / 2 * p.head_dim * 2) as u64,
    ));
    g.bench_function("prefill_512", |b| {
        b.iter(|| paged_attention(&pool, &p, &q, &kv, &seq, &mut out))
    });
    g.finish();
}

fn bench_dispatch(c: &mut Criterion) {
    let pool = ThreadPool::new(2);
    let mut g = c.benchmark_group("threadpool");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.bench_function("run_8_empty_tasks", |b| {
        b.iter(|| {
            pool.run(8, &|i| {
                std::hint::black_box(i);
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench_matmul, bench_attention, bench_dispatch);
criterion_main!(benches);
