//! Read bandwidth of this machine as the matmul kernels see it: a buffer larger than the caches, split
//! into contiguous chunks over tandem's own thread pool (the way a decode step's output head is split),
//! each chunk summed in 64-bit words. It gives the ceiling a memory-bound decode step can reach, to set
//! a kernel's GB/s against.
//!
//! `cargo run --release -p tandem-kernels --example read_bandwidth -- [MIB] [THREADS] [REPS]` (defaults 512,
//! 2, 10). Prints the best and median GB/s over the repetitions (1 GB = 1e9 bytes).

use std::time::Instant;

use tandem_kernels::ThreadPool;

/// Sums the words of `chunk` in 8 independent chains, so the adds never limit the loads.
fn sum_words(chunk: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = chunk.chunks_exact(8);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(v);
        }
    }
    let tail: u64 = it.remainder().iter().fold(0, |a, &v| a.wrapping_add(v));
    acc.iter().fold(tail, |a, &v| a.wrapping_add(v))
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments are whole numbers"))
        .collect();
    let mib = args.first().copied().unwrap_or(512);
    let threads = args.get(1).copied().unwrap_or(2);
    let reps = args.get(2).copied().unwrap_or(10).max(1);
    let words = mib << 17;
    // Distinct values so no page is shared or zero-mapped.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let pool = ThreadPool::new(threads);
    // About 4 tasks a thread, as the matmul splits a decode step's rows.
    let n_tasks = threads * 4;
    let per = words.div_ceil(n_tasks);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..n_tasks)
        .map(|_| std::sync::atomic::AtomicU64::new(0))
        .collect();
    let mut rates = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        pool.run(n_tasks, &|t| {
            let chunk = &buf[(t * per).min(words)..((t + 1) * per).min(words)];
            sums[t].store(sum_words(chunk), std::sync::atomic::Ordering::Relaxed);
        });
        rates.push((words * 8) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    let check = sums.iter().fold(0u64, |a, s| {
        a.wrapping_add(s.load(std::sync::atomic::Ordering::Relaxed))
    });
    rates.sort_by(f64::total_cmp);
    println!(
        "read bandwidth, {mib} MiB over {threads} threads: best {:.1} GB/s, median {:.1} GB/s (checksum {check:x})",
        rates[reps - 1],
        rates[reps / 2]
    );
}
