//! The device-side tools the `tandem` binary exposes as hidden subcommands: `cuda-check` (logits of
//! given prompts as JSON, for comparison with HF transformers and the CPU backend) and `cuda-bench`
//! (decode and prefill speed on a model of given shape with random weights generated on the GPU).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tandem_model::{CpuLlama, ForwardBatch, KvCache, LoadOptions, LogitsWanted, ModelConfig};

use crate::error::CudaError;
use crate::model::{CudaLlama, CudaOptions, SampleRow, WeightSource};
use tandem_engine::sampler::argmax;

/// What `cuda-check` runs.
#[derive(Clone, Debug)]
pub struct CheckArgs {
    /// HF folder (or GGUF file) of the model.
    pub model: PathBuf,
    /// JSON file with a list of prompts, each a list of token ids or `{"prompt": [...], "force": [...]}`
    /// (decode step j then feeds `force[j]` instead of the greedy token: teacher forcing, so that
    /// every backend sees the same inputs).
    pub prompts: PathBuf,
    /// Greedy decode steps after the prompt.
    pub decode_steps: usize,
    /// Where the JSON result goes.
    pub out: PathBuf,
    /// Run the CPU backend instead of CUDA (same output format).
    pub cpu: bool,
}

/// One prompt's results.
#[derive(Serialize)]
struct PromptResult {
    prompt: Vec<u32>,
    /// Tokens fed by the decode steps.
    fed: Vec<u32>,
    /// One row per prompt token.
    prefill_logits: Vec<Vec<f32>>,
    /// Greedy (argmax) tokens: the first from the prefill, then one per decode step.
    generated: Vec<u32>,
    /// Row j: logits after feeding `fed[j]`.
    decode_logits: Vec<Vec<f32>>,
}

/// The whole `cuda-check` output.
#[derive(Serialize)]
struct CheckOutput {
    backend: String,
    device: String,
    prompts: Vec<PromptResult>,
    /// CUDA: the first prompt's first KV block, exported, imported into a spare block and exported
    /// again, came back byte for byte (and was not all zero).
    kv_roundtrip: Option<bool>,
}

/// A model step, CPU or CUDA, behind one call.
enum Runner {
    Cuda(Box<CudaLlama>),
    Cpu(Box<CpuLlama>, KvCache),
}

impl Runner {
    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), CudaError> {
        match self {
            Runner::Cuda(m) => m.forward(batch, logits),
            Runner::Cpu(m, kv) => Ok(m.forward(batch, kv, logits)?),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CudaError + '_ {
    move |source| CudaError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Runs all prompts as one prefill step (every row's logits), then `decode_steps` greedy decode
/// steps of all sequences together, and writes the logits and tokens as JSON.
pub fn run_check(args: &CheckArgs) -> Result<(), CudaError> {
    let text = std::fs::read_to_string(&args.prompts).map_err(io_err(&args.prompts))?;
    let bad = |e: String| CudaError::Batch(format!("{}: {e}", args.prompts.display()));
    let items: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let mut prompts: Vec<Vec<u32>> = Vec::with_capacity(items.len());
    let mut forced: Vec<Option<Vec<u32>>> = Vec::with_capacity(items.len());
    for item in items {
        let ids = |v: &serde_json::Value| -> Result<Vec<u32>, CudaError> {
            serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))
        };
        if item.is_array() {
            prompts.push(ids(&item)?);
            forced.push(None);
        } else {
            prompts.push(ids(&item["prompt"])?);
            let f = ids(&item["force"])?;
            if f.len() < args.decode_steps {
                return Err(bad(format!(
                    "force has {} tokens for {} steps",
                    f.len(),
                    args.decode_steps
                )));
            }
            forced.push(Some(f));
        }
    }
    let loaded = tandem_model::load(&args.model, &LoadOptions::default())?;
    let block_size = 16;
    let per_seq = prompts
        .iter()
        .map(|p| (p.len() + args.decode_steps + 1).div_ceil(block_size))
        .max()
        .unwrap_or(1);
    // One spare block past the prompts' tables: the KV round trip imports into it.
    let num_blocks = per_seq * prompts.len().max(1) + 1;
    let total_tokens: usize = prompts.iter().map(Vec::len).sum();
    let (mut runner, backend, device) = if args.cpu {
        let model = CpuLlama::new(loaded.config.clone(), loaded.weights, 0);
        let kv = KvCache::new(model.kv_layout(block_size, num_blocks));
        (Runner::Cpu(Box::new(model), kv), "cpu", "cpu".to_string())
    } else {
        let c = &loaded.config;
        let bytes = num_blocks * c.num_layers * 2 * c.num_kv_heads * block_size * c.head_dim * 2;
        let opts = CudaOptions {
            block_size,
            kv_cache_bytes: bytes,
            max_tokens: total_tokens.max(prompts.len().next_power_of_two()).max(1),
            // A power of two so that the decode steps also run through captured graphs.
            max_seqs: prompts.len().max(1).next_power_of_two(),
            logits_chunk_rows: 256,
            ..CudaOptions::default()
        }
        .with_env_overrides();
        let model = CudaLlama::new(
            loaded.config.clone(),
            WeightSource::Host(&loaded.weights),
            opts,
        )?;
        let device = model.device_name().to_string();
        (Runner::Cuda(Box::new(model)), "cuda", device)
    };
    let vocab = loaded.config.vocab_size;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    let mut results: Vec<PromptResult> = prompts
        .iter()
        .map(|p| PromptResult {
            prompt: p.clone(),
            fed: Vec::new(),
            prefill_logits: Vec::new(),
            generated: Vec::new(),
            decode_logits: Vec::new(),
        })
        .collect();
    let mut batch = ForwardBatch::default();
    let mut logits = Vec::new();
    for (p, t) in prompts.iter().zip(&tables) {
        batch.push(p, 0, t.clone(), LogitsWanted::All);
    }
    runner.forward(&batch, &mut logits)?;
    let mut rows = logits.chunks_exact(vocab);
    for r in results.iter_mut() {
        for _ in 0..r.prompt.len() {
            let row = rows.next().expect("one row per prompt token");
            r.prefill_logits.push(row.to_vec());
        }
        let last = r.prefill_logits.last().map(|l| argmax(l)).unwrap_or(0);
        r.generated.push(last);
    }
    for step in 0..args.decode_steps {
        batch.clear();
        for ((r, t), f) in results.iter_mut().zip(&tables).zip(&forced) {
            let pos = r.prompt.len() + step;
            let tok = f.as_ref().map_or(r.generated[step], |f| f[step]);
            r.fed.push(tok);
            batch.push(&[tok], pos, t.clone(), LogitsWanted::Last);
        }
        runner.forward(&batch, &mut logits)?;
        for (r, row) in results.iter_mut().zip(logits.chunks_exact(vocab)) {
            r.decode_logits.push(row.to_vec());
            r.generated.push(argmax(row));
        }
    }
    let kv_roundtrip = match &mut runner {
        Runner::Cuda(m) => {
            let layout = m.kv_layout();
            let spare = (layout.num_blocks - 1) as u32;
            let mut a = vec![0u8; layout.block_bytes()];
            let mut b = vec![0u8; layout.block_bytes()];
            m.export_block(layout.n_layers - 1, 0, &mut a)?;
            m.import_block(layout.n_layers - 1, spare, &a)?;
            m.export_block(layout.n_layers - 1, spare, &mut b)?;
            Some(a == b && a.iter().any(|&x| x != 0))
        }
        Runner::Cpu(..) => None,
    };
    let out = CheckOutput {
        backend: backend.into(),
        device,
        prompts: results,
        kv_roundtrip,
    };
    let json = serde_json::to_string(&out).map_err(|e| CudaError::Batch(e.to_string()))?;
    std::fs::write(&args.out, json).map_err(io_err(&args.out))?;
    tracing::info!(out = %args.out.display(), backend, "check written");
    Ok(())
}

/// What `cuda-bench` measures.
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// Model shape (weights are random, generated on the GPU).
    pub config: ModelConfig,
    /// Cached context per sequence during the decode measurements.
    pub context: usize,
    /// Decode batch sizes.
    pub batches: Vec<usize>,
    /// Timed decode steps per batch size.
    pub steps: usize,
    /// Prompt lengths of the prefill measurements (attention's share grows with the square).
    pub prefill: Vec<usize>,
    /// Copy bandwidth the MBU is computed against, bytes/s.
    pub peak_bandwidth: f64,
    /// Where the JSON lines go (also printed).
    pub out: Option<PathBuf>,
}

impl BenchArgs {
    /// Llama-3.1-8B's shape: 32 layers, 4096 hidden, 14336 FFN, 32/8 heads, 128256 vocab.
    pub fn llama3_8b_config() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            hidden_size: 4096,
            intermediate_size: 14336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 128256,
            max_position_embeddings: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: tandem_kernels::RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
            rope_style: tandem_kernels::RopeStyle::Neox,
            tie_word_embeddings: false,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![],
            sliding_window: None,
        }
    }
}

/// One measurement, as a JSON line.
#[derive(Serialize)]
struct BenchRow {
    what: String,
    batch: usize,
    context: usize,
    graphs: bool,
    logits_to_host: bool,
    /// Our GEMV kernel for projections of at most 8 rows (false: cuBLAS).
    gemv: bool,
    median_step_ms: f64,
    tokens_per_s: f64,
    /// Bytes of weights + KV read per step over the step time, against `peak_bandwidth`.
    mbu: Option<f64>,
    /// Dense FLOPs over the step time (prefill).
    tflops: Option<f64>,
    /// Median host time to queue the step's model body (prefill; eager launches).
    enqueue_ms: Option<f64>,
    device: String,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Measures decode at each batch size (graphs on, greedy on the GPU; plus logits to the host, and
/// graphs off) and prefill of one long prompt.
pub fn run_bench(args: &BenchArgs) -> Result<(), CudaError> {
    let c = args.config.clone();
    let bs = 16;
    let max_b = args.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (args.context + args.steps + 8).div_ceil(bs);
    let max_prefill = args.prefill.iter().copied().max().unwrap_or(0);
    let prefill_blocks = max_prefill.div_ceil(bs);
    let num_blocks = (max_b * per_seq).max(prefill_blocks);
    let block_bytes = c.num_layers * 2 * c.num_kv_heads * bs * c.head_dim * 2;
    let opts = CudaOptions {
        block_size: bs,
        kv_cache_bytes: num_blocks * block_bytes,
        max_tokens: max_prefill.max(max_b),
        max_seqs: max_b,
        max_model_len: Some(c.max_position_embeddings),
        logits_chunk_rows: max_b.max(1),
        ..CudaOptions::default()
    }
    .with_env_overrides();
    let t0 = Instant::now();
    let mut model = CudaLlama::new(c.clone(), WeightSource::Random { seed: 1 }, opts.clone())?;
    model.synchronize()?;
    let device = model.device_name().to_string();
    tracing::info!(
        secs = t0.elapsed().as_secs_f64(),
        "random weights generated on the GPU"
    );
    let weight_bytes = model.weight_bytes_per_step() as f64;
    let kv_per_token = model.kv_layout().bytes_per_token() as f64;
    let mut rows = Vec::new();
    let mut emit = |row: BenchRow| {
        let line = serde_json::to_string(&row).unwrap_or_default();
        println!("{line}");
        rows.push(line);
    };

    let mut batch = ForwardBatch::default();
    let mut ids = Vec::new();
    let mut logits = Vec::new();
    // A batch size of 0 skips decode (a prefill-only profile).
    for &b in args.batches.iter().filter(|&&b| b > 0) {
        let mut modes = vec![
            (true, false, true),
            (true, true, true),
            (false, false, true),
        ];
        if b <= crate::kernels::GEMV_MAX_ROWS {
            modes.push((true, false, false));
        }
        // TANDEM_CUDA_GRAPHS=0 (profiling: one kernel launch per kernel) drops the graph modes.
        modes.retain(|&(graphs, _, _)| opts.graphs || !graphs);
        for (graphs, to_host, gemv) in modes {
            model.set_graphs(graphs);
            model.set_gemv(gemv);
            let mut times = Vec::new();
            let warmup = 3;
            for step in 0..warmup + args.steps {
                batch.clear();
                let pos = args.context + step;
                for i in 0..b {
                    let table: Vec<u32> =
                        ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect();
                    let tok = ((i * 7919 + step * 104729) % c.vocab_size) as u32;
                    batch.push(&[tok], pos, table, LogitsWanted::Last);
                }
                let t = Instant::now();
                if to_host {
                    model.forward(&batch, &mut logits)?;
                } else {
                    model.forward_greedy(&batch, &mut ids)?;
                }
                if step >= warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            if to_host && !logits.iter().take(c.vocab_size).all(|x| x.is_finite()) {
                return Err(CudaError::Unsupported(
                    "non-finite logits in the decode bench".into(),
                ));
            }
            let med = median(&mut times);
            let ctx_avg = args.context as f64 + (warmup + args.steps) as f64 / 2.0;
            let bytes = weight_bytes + b as f64 * ctx_avg * kv_per_token;
            emit(BenchRow {
                what: "decode".into(),
                batch: b,
                context: args.context,
                graphs,
                logits_to_host: to_host,
                gemv,
                median_step_ms: med * 1e3,
                tokens_per_s: b as f64 / med,
                mbu: Some(bytes / med / args.peak_bandwidth),
                tflops: None,
                enqueue_ms: None,
                device: device.clone(),
            });
        }
    }

    model.set_graphs(false);
    model.set_gemv(true);
    for &len in args.prefill.iter().filter(|&&l| l > 0) {
        let table: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
        let prompt: Vec<u32> = (0..len)
            .map(|i| ((i * 7919) % c.vocab_size) as u32)
            .collect();
        let mut times = Vec::new();
        let mut enqueue = Vec::new();
        for rep in 0..6 {
            batch.clear();
            batch.push(&prompt, 0, table.clone(), LogitsWanted::Last);
            let t = Instant::now();
            model.forward_greedy(&batch, &mut ids)?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
                enqueue.push(model.last_enqueue_time().as_secs_f64());
            }
        }
        let med = median(&mut times);
        let n = len as f64;
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let linear = 2.0 * n * (c.num_layers * ((q + 2 * kv) * h + q * h + 3 * f * h)) as f64
            + 2.0 * (c.vocab_size * h) as f64;
        let attn = 4.0 * (c.num_heads * c.head_dim * c.num_layers) as f64 * n * (n + 1.0) / 2.0;
        emit(BenchRow {
            what: "prefill".into(),
            batch: 1,
            context: len,
            graphs: false,
            logits_to_host: false,
            gemv: true,
            median_step_ms: med * 1e3,
            tokens_per_s: n / med,
            mbu: None,
            tflops: Some((linear + attn) / med / 1e12),
            enqueue_ms: Some(median(&mut enqueue) * 1e3),
            device: device.clone(),
        });
    }
    if let Some(path) = &args.out {
        std::fs::write(path, rows.join("\n") + "\n").map_err(io_err(path))?;
    }
    Ok(())
}

/// One case of the on-device sampler check: the filters, and what was found.
#[derive(Serialize)]
struct SampleCase {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    draws: usize,
    /// Tokens the filters keep (host computation).
    kept: usize,
    /// Draws of tokens the filters drop (must be 0).
    outside: usize,
    /// Largest |observed − expected| frequency over the 20 likeliest tokens and the rest, in
    /// standard errors of a binomial count.
    max_sigma: f64,
    /// The same seeds drew the same tokens again.
    repeatable: bool,
    pass: bool,
}

/// The host sampler's distribution after temperature, top-k, top-p, min-p (same order and rules):
/// probability per token, zero for dropped ones.
fn filtered_distribution(logits: &[f32], row: &SampleRow) -> Vec<f64> {
    let v = logits.len();
    let mut p = vec![0.0f64; v];
    if row.temperature <= 1e-5 || row.top_k == 1 {
        p[argmax(logits) as usize] = 1.0;
        return p;
    }
    let mut idx: Vec<usize> = (0..v).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let k = if row.top_k > 0 {
        (row.top_k as usize).min(v)
    } else {
        v
    };
    let cand = &idx[..k];
    let max = logits[cand[0]] as f64;
    let w: Vec<f64> = cand
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / row.temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = k;
    if row.top_p < 1.0 {
        let target = row.top_p.max(0.0) as f64 * total;
        let mut acc = 0.0;
        for (j, x) in w.iter().enumerate() {
            acc += x;
            if acc >= target {
                keep = j + 1;
                break;
            }
        }
    }
    let floor = if row.min_p > 0.0 {
        row.min_p as f64
    } else {
        0.0
    };
    let kept: Vec<(usize, f64)> = cand[..keep]
        .iter()
        .zip(&w)
        .filter(|(_, &x)| x >= floor)
        .map(|(&i, &x)| (i, x))
        .collect();
    let sum: f64 = kept.iter().map(|(_, x)| x).sum();
    for (i, x) in kept {
        p[i] = x / sum;
    }
    p
}

/// Checks the on-device sampler (`sample_rows`) against the host sampler's distribution: for each
/// filter setting, 256 rows × `rounds` draws with distinct seeds from one fixed logits row of
/// Llama 3's vocabulary width; no draw may fall outside the kept set, the 20 likeliest tokens and
/// the rest must each be within 5 standard errors of their expected counts, and the same seeds
/// must draw the same tokens. Writes JSON to `out`; fails when a case fails.
pub fn run_sample_check(out: &Path, rounds: usize) -> Result<(), CudaError> {
    let mut c = BenchArgs::llama3_8b_config();
    c.num_layers = 1;
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    let rows = 256;
    let opts = CudaOptions {
        kv_cache_bytes: 64 << 20,
        max_tokens: rows,
        max_seqs: rows,
        max_model_len: Some(1024),
        logits_chunk_rows: rows,
        ..CudaOptions::default()
    };
    let mut model = CudaLlama::new(c.clone(), WeightSource::Random { seed: 3 }, opts)?;
    let v = c.vocab_size;
    // A Zipf-like logits row: the token of rank r (scattered over the vocabulary) has logit
    // 8 - 2 ln(1 + r), all distinct in f32, so no filter threshold falls on a tie.
    let mut logits = vec![0.0f32; v];
    for r in 0..v {
        logits[(r * 7919) % v] = 8.0 - 2.0 * (1.0 + r as f32).ln();
    }
    let mut all = Vec::with_capacity(rows * v);
    for _ in 0..rows {
        all.extend_from_slice(&logits);
    }
    let settings = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.3, 0, 1.0, 0.1),
        (0.8, 100, 0.95, 0.02),
    ];
    let mut cases = Vec::new();
    let mut ok = true;
    let mut ids = Vec::new();
    for (temperature, top_k, top_p, min_p) in settings {
        let base = SampleRow {
            temperature,
            top_p,
            min_p,
            top_k,
            seed: 0,
        };
        let expected = filtered_distribution(&logits, &base);
        let mut counts = vec![0usize; v];
        let mut first_round = Vec::new();
        for round in 0..rounds {
            let batch: Vec<SampleRow> = (0..rows)
                .map(|r| SampleRow {
                    seed: 0x5eed_0000 + (round * rows + r) as u64,
                    ..base
                })
                .collect();
            model.sample_logits(&all, &batch, &mut ids)?;
            if round == 0 {
                first_round = ids.clone();
            }
            for &t in &ids {
                counts[t as usize] += 1;
            }
        }
        let seeds: Vec<SampleRow> = (0..rows)
            .map(|r| SampleRow {
                seed: 0x5eed_0000 + r as u64,
                ..base
            })
            .collect();
        model.sample_logits(&all, &seeds, &mut ids)?;
        let repeatable = ids == first_round;
        let n = (rounds * rows) as f64;
        let outside: usize = (0..v)
            .filter(|&i| expected[i] == 0.0)
            .map(|i| counts[i])
            .sum();
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| expected[b].total_cmp(&expected[a]));
        let sigma = |obs: usize, p: f64| {
            let sd = (n * p * (1.0 - p)).sqrt().max(1.0);
            (obs as f64 - n * p).abs() / sd
        };
        let mut max_sigma = 0.0f64;
        let (mut rest_obs, mut rest_p) = (counts.iter().sum::<usize>(), 1.0);
        for &i in order.iter().take(20) {
            max_sigma = max_sigma.max(sigma(counts[i], expected[i]));
            rest_obs -= counts[i];
            rest_p -= expected[i];
        }
        max_sigma = max_sigma.max(sigma(rest_obs, rest_p.max(0.0)));
        let pass = outside == 0 && max_sigma <= 5.0 && repeatable;
        ok &= pass;
        cases.push(SampleCase {
            temperature,
            top_k,
            top_p,
            min_p,
            draws: n as usize,
            kept: expected.iter().filter(|&&p| p > 0.0).count(),
            outside,
            max_sigma,
            repeatable,
            pass,
        });
    }
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "device": model.device_name(),
        "pass": ok,
        "cases": cases,
    }))
    .unwrap_or_default();
    println!("{text}");
    std::fs::write(out, text + "\n").map_err(io_err(out))?;
    if ok {
        Ok(())
    } else {
        Err(CudaError::Batch(
            "the on-device sampler check failed".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Option<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/tiny-llama");
        dir.join("config.json").exists().then_some(dir)
    }

    fn check(model: &Path, prompts: serde_json::Value, steps: usize) -> serde_json::Value {
        let tmp = std::env::temp_dir().join(format!("tandem-cuda-check-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let pfile = tmp.join(format!("prompts-{steps}.json"));
        let out = tmp.join(format!("out-{steps}.json"));
        std::fs::write(&pfile, prompts.to_string()).unwrap();
        run_check(&CheckArgs {
            model: model.to_path_buf(),
            prompts: pfile,
            decode_steps: steps,
            out: out.clone(),
            cpu: true,
        })
        .unwrap();
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
    }

    /// The check tool's teacher-forced decode rows must equal the prefill rows of the longer prompt
    /// (CPU backend: exact up to f32 rounding), and plain prompts decode greedily.
    #[test]
    fn forced_decode_rows_match_prefill_of_the_longer_prompt() {
        let Some(model) = fixture() else {
            eprintln!("skipped: tests/fixtures/hf/tiny-llama is missing");
            return;
        };
        let a = check(
            &model,
            serde_json::json!([{"prompt": [1, 2, 3], "force": [4, 5]}, [6, 7]]),
            2,
        );
        let b = check(&model, serde_json::json!([[1, 2, 3, 4, 5]]), 0);
        let forced = &a["prompts"][0];
        assert_eq!(forced["fed"], serde_json::json!([4, 5]));
        assert_eq!(forced["prefill_logits"].as_array().unwrap().len(), 3);
        let long = b["prompts"][0]["prefill_logits"].as_array().unwrap();
        for j in 0..2 {
            let d: Vec<f64> = serde_json::from_value(forced["decode_logits"][j].clone()).unwrap();
            let p: Vec<f64> = serde_json::from_value(long[3 + j].clone()).unwrap();
            let max = d
                .iter()
                .zip(&p)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(max < 1e-3, "decode row {j} differs from prefill by {max}");
        }
        let plain = &a["prompts"][1];
        assert_eq!(plain["generated"].as_array().unwrap().len(), 3);
        assert_eq!(
            plain["fed"].as_array().unwrap()[..],
            plain["generated"].as_array().unwrap()[..2]
        );
    }
}
