//! Repeated cold prefills of one prompt through `CpuLlama::forward`, for profiling (`perf record`) and A/B
//! timing of the kernels without the engine around them.
//!
//! `cargo run --release -p tandem-model --example prefill -- [MODEL.gguf] [TOKENS] [REPS] [THREADS]`
//! (defaults: the default model, 512, 5, 2). Prints each run's time and tok/s, the median, and a hash of
//! the last row's logits so that two builds can be checked for bit-identical output.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::time::Instant;

use tandem_model::{CpuLlama, ForwardBatch, KvCache, LoadOptions, LogitsWanted};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = PathBuf::from(
        args.first()
            .map_or("models/SmolLM2-135M-Instruct.Q4_1.gguf", String::as_str),
    );
    let arg =
        |i: usize, default: usize| args.get(i).map_or(default, |s| s.parse().expect("number"));
    let (n, reps, threads) = (arg(1, 512), arg(2, 5), arg(3, 2));
    let loaded = tandem_model::load(&path, &LoadOptions { progress: false }).expect("load model");
    let vocab = loaded.config.vocab_size as u64;
    let mut model = CpuLlama::new(loaded.config, loaded.weights, threads);
    let block = 16;
    let mut kv = KvCache::new(model.kv_layout(block, n.div_ceil(block)));
    // A fixed pseudo-random prompt (LCG), the same in every build.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let tokens: Vec<u32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((s >> 33) % vocab) as u32
        })
        .collect();
    let mut batch = ForwardBatch::default();
    batch.push(
        &tokens,
        0,
        (0..n.div_ceil(block) as u32).collect(),
        LogitsWanted::Last,
    );
    let mut logits = Vec::new();
    let mut times = Vec::new();
    for r in 0..reps {
        let t0 = Instant::now();
        model
            .forward(&batch, &mut kv, &mut logits)
            .expect("forward");
        let dt = t0.elapsed().as_secs_f64();
        println!("run {r}: {:.1} ms, {:.1} tok/s", dt * 1e3, n as f64 / dt);
        times.push(dt);
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let mut h = std::collections::hash_map::DefaultHasher::new();
    logits.iter().for_each(|v| v.to_bits().hash(&mut h));
    println!(
        "kernels {:?}, {n} tokens, {threads} threads: median {:.1} ms = {:.1} tok/s; logits hash {:016x}",
        tandem_kernels::isa(),
        med * 1e3,
        n as f64 / med,
        h.finish()
    );
}
