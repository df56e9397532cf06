//! Times one layer's kernels of a prefill on the default model's shapes (SmolLM2-135M: hidden 576, 9 query
//! and 3 KV heads of 64, ffn 1536; Q4_1 weights) by category — quantized matmuls (activation quantization
//! included), activation quantization alone, attention — so the share of each in a prefill can be read
//! without a profiler, and kernel changes can be A/B timed in isolation; also the Q8_0 output head for one row
//! (a decode step's largest matmul) and for 16 (a batched decode step's).
//!
//! `TANDEM_KERNELS=avx2 cargo run --release -p tandem-kernels --example prefill_ops -- [TOKENS] [REPS] [THREADS]
//! [DECODE_LAYERS] [DECODE_SEQS]` (defaults 512, 20, 2, 0, 0). Prints the minimum over the repetitions of each category (ms
//! per layer; with one thread, CPU time of the calling thread, steadier on a loaded machine) and a hash of all
//! outputs so that two builds can be checked for bit-identical results. DECODE_LAYERS > 0 adds a decode step's
//! matmuls over that many distinct layers and the head (one row, weights streamed from memory; the model has 30).
//! DECODE_SEQS > 0 adds a decode step's attention: that many sequences of TOKENS tokens, one query each, over
//! 30 layers' KV buffers (reported per layer).

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use tandem_kernels::{
    matmul, matmul_fused, paged_attention, quantize_row, write_kv, AttnParams, AttnSeq, DType,
    MatmulScratch, Matrix, ThreadPool, WeightBytes,
};

/// Deterministic values in [-1, 1) (an LCG: no dependency, the same in every build).
fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matrix(rows: usize, cols: usize, seed: u64) -> Matrix {
    matrix_of(DType::Q4_1, rows, cols, seed)
}

fn matrix_of(dt: DType, rows: usize, cols: usize, seed: u64) -> Matrix {
    let w = rand_vec(rows * cols, seed);
    let mut bytes = Vec::new();
    for r in w.chunks_exact(cols) {
        quantize_row(dt, r, &mut bytes);
    }
    Matrix::new(dt, rows, cols, WeightBytes::Owned(Arc::new(bytes))).expect("sizes")
}

/// `struct timespec` of 64-bit Linux.
#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
}

/// Nanoseconds of CPU time this thread has used (`CLOCK_THREAD_CPUTIME_ID`), on 64-bit Linux: on a machine
/// shared with other work, single-threaded CPU time is a steadier measure than wall time.
fn thread_cpu_ns() -> Option<u64> {
    if !cfg!(all(target_os = "linux", target_pointer_width = "64")) {
        return None;
    }
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid timespec; clock 3 is CLOCK_THREAD_CPUTIME_ID on Linux.
    (unsafe { clock_gettime(3, &mut t) } == 0).then(|| t.sec as u64 * 1_000_000_000 + t.nsec as u64)
}

/// Minimum time of `reps` runs of `f`, in ms: this thread's CPU time with one thread (the pool then runs
/// everything inline), else wall time.
fn best(reps: usize, cpu: bool, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let (t0, c0) = (Instant::now(), thread_cpu_ns());
            f();
            match (cpu, c0, thread_cpu_ns()) {
                (true, Some(a), Some(b)) => (b - a) as f64 / 1e6,
                _ => t0.elapsed().as_secs_f64() * 1e3,
            }
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    // The library reads no environment: this program gives it the cap, as the `tandem` binary does.
    if let Ok(cap) = std::env::var("TANDEM_KERNELS") {
        tandem_kernels::set_isa_cap(cap.parse().expect("TANDEM_KERNELS"));
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("number"))
        .collect();
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (m, reps, threads) = (arg(0, 512), arg(1, 20), arg(2, 2));
    let pool = ThreadPool::new(threads);
    let cpu = threads == 1;
    let (h, f, hd, nh, nkv) = (576, 1536, 64, 9, 3);
    let (wq, wk, wv, wo) = (
        matrix(nh * hd, h, 1),
        matrix(nkv * hd, h, 2),
        matrix(nkv * hd, h, 3),
        matrix(h, nh * hd, 4),
    );
    let (wg, wu, wd) = (matrix(f, h, 5), matrix(f, h, 6), matrix(h, f, 7));
    let x = rand_vec(m * h, 8);
    let xf = rand_vec(m * f, 9);
    let mut s = MatmulScratch::default();
    let (mut q, mut k, mut v) = (
        vec![0f32; m * nh * hd],
        vec![0f32; m * nkv * hd],
        vec![0f32; m * nkv * hd],
    );
    let (mut o, mut g, mut u) = (vec![0f32; m * h], vec![0f32; m * f], vec![0f32; m * f]);
    let qkv = best(reps, cpu, || {
        matmul_fused(
            &pool,
            [&wq, &wk, &wv],
            &x,
            m,
            [&mut q, &mut k, &mut v],
            &mut s,
        )
    });
    let proj = best(reps, cpu, || matmul(&pool, &wo, &x, m, &mut o, &mut s));
    let gate_up = best(reps, cpu, || {
        matmul_fused(&pool, [&wg, &wu], &x, m, [&mut g, &mut u], &mut s)
    });
    let down = best(reps, cpu, || matmul(&pool, &wd, &xf, m, &mut o, &mut s));
    // Activation quantization alone: a matmul with a single weight row is almost all quantization.
    let one = matrix(8, f, 10);
    let mut o1 = vec![0f32; m * 8];
    let quant = best(reps, cpu, || matmul(&pool, &one, &xf, m, &mut o1, &mut s));

    let p = AttnParams {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        block_size: 16,
        scale: 0.125,
        window: None,
    };
    let n_blocks = m.div_ceil(p.block_size);
    let mut kv = vec![0f32; n_blocks * 2 * nkv * p.block_size * hd];
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let kvw = rand_vec(m * 2 * nkv * hd, 11);
    for pos in 0..m {
        let r = &kvw[pos * 2 * nkv * hd..(pos + 1) * 2 * nkv * hd];
        write_kv(&p, &mut kv, &table, pos, &r[..nkv * hd], &r[nkv * hd..]);
    }
    let qa = rand_vec(m * nh * hd, 12);
    let mut att = vec![0f32; m * nh * hd];
    let seq = [AttnSeq {
        q_row: 0,
        n_q: m,
        ctx_len: m,
        blocks: &table,
    }];
    let attn = best(reps, cpu, || {
        paged_attention(&pool, &p, &qa, &kv, &seq, &mut att)
    });

    // The output head (Q8_0, tied to the 49152-token embedding) for one row: the logits of a prefill's
    // last token or of a decode step.
    let head_w = matrix_of(DType::Q8_0, 49152, h, 13);
    let mut logits = vec![0f32; 49152];
    let head = best(reps, cpu, || {
        matmul(&pool, &head_w, &x[..h], 1, &mut logits, &mut s)
    });
    // And for 16 rows: a batched decode step's logits (the first 16 rows of the input, or fewer).
    let hm = m.min(16);
    let mut logits16 = vec![0f32; 49152 * hm];
    let head16 = best(reps, cpu, || {
        matmul(&pool, &head_w, &x[..hm * h], hm, &mut logits16, &mut s)
    });

    // A whole decode step's matmuls with weights that do not stay in cache: `LAYERS` distinct layers (the
    // model has 30) then the head, one activation row, the way a single-stream decode streams its weights.
    let layers = arg(3, 0);
    let step = (layers > 0).then(|| {
        let ws: Vec<[Matrix; 7]> = (0..layers as u64)
            .map(|l| {
                let sd = 100 + 7 * l;
                [
                    matrix(nh * hd, h, sd),
                    matrix(nkv * hd, h, sd + 1),
                    matrix(nkv * hd, h, sd + 2),
                    matrix(h, nh * hd, sd + 3),
                    matrix(f, h, sd + 4),
                    matrix(f, h, sd + 5),
                    matrix(h, f, sd + 6),
                ]
            })
            .collect();
        best(reps, cpu, || {
            for [wq, wk, wv, wo, wg, wu, wd] in &ws {
                let (q, k, v) = (&mut q[..nh * hd], &mut k[..nkv * hd], &mut v[..nkv * hd]);
                matmul_fused(&pool, [wq, wk, wv], &x[..h], 1, [q, k, v], &mut s);
                matmul(&pool, wo, &x[..h], 1, &mut o[..h], &mut s);
                let (g, u) = (&mut g[..f], &mut u[..f]);
                matmul_fused(&pool, [wg, wu], &x[..h], 1, [g, u], &mut s);
                matmul(&pool, wd, &xf[..f], 1, &mut o[..h], &mut s);
            }
            matmul(&pool, &head_w, &x[..h], 1, &mut logits, &mut s);
        })
    });

    // Decode attention: `SEQS` sequences of m tokens each, one query row each, over 30 layers' distinct KV
    // buffers, the sequences' blocks interleaved: a decode step reads every layer's KV from memory.
    let seqs = arg(4, 0);
    let mut dec_att = vec![0f32; seqs * nh * hd];
    let decode_attn = (seqs > 0).then(|| {
        let per_seq = m.div_ceil(p.block_size);
        let block = 2 * nkv * p.block_size * hd;
        let layers: Vec<Vec<f32>> = (0..30)
            .map(|l| rand_vec(seqs * per_seq * block, 200 + l))
            .collect();
        let tables: Vec<Vec<u32>> = (0..seqs)
            .map(|s| (0..per_seq).map(|b| (b * seqs + s) as u32).collect())
            .collect();
        let batch: Vec<AttnSeq> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| AttnSeq {
                q_row: i,
                n_q: 1,
                ctx_len: m,
                blocks: t,
            })
            .collect();
        let qd = rand_vec(seqs * nh * hd, 13);
        best(reps, cpu, || {
            for kv in &layers {
                paged_attention(&pool, &p, &qd, kv, &batch, &mut dec_att);
            }
        }) / 30.0
    });

    let mut hash = std::collections::hash_map::DefaultHasher::new();
    for out in [
        &q, &k, &v, &o, &g, &u, &o1, &att, &logits, &logits16, &dec_att,
    ] {
        out.iter().for_each(|x| x.to_bits().hash(&mut hash));
    }
    let mm = qkv + proj + gate_up + down;
    println!(
        "kernels {:?}, m={m}, {threads} threads, {} ms per layer (min of {reps}): qkv {qkv:.3} wo {proj:.3} \
         gate/up {gate_up:.3} down {down:.3} = matmuls {mm:.3} (act. quantization of one 1536-wide \
         input ≈ {quant:.3}); attention {attn:.3}; head (1 row) {head:.3}, ({hm} rows) {head16:.3}; hash {:016x}",
        tandem_kernels::isa(),
        if cpu { "CPU" } else { "wall" },
        hash.finish()
    );
    if let Some(step) = step {
        println!("decode step, {layers} layers + head, weights not cached: {step:.3} ms");
    }
    if let Some(t) = decode_attn {
        println!(
            "decode attention, {seqs} sequences at context {m}, KV not cached: {t:.3} ms per layer"
        );
    }
}
