//! `tandem cuda-check`: logits of given prompts as JSON, from the CUDA backend (or the CPU backend), for
//! comparison with HF transformers (`scripts/gpu/check.py`).

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::Args;
use serde::Serialize;
use tandem_cuda::{CudaLlama, CudaOptions, WeightSource};
use tandem_engine::sampler::argmax;
use tandem_model::{CpuLlama, ForwardBatch, KvCache, LoadOptions, LoadedModel, LogitsWanted};

use super::io_err;
use crate::cuda_settings::{CudaSettings, Quantization};

/// Options of `tandem cuda-check`.
#[derive(Args, Debug)]
pub struct CudaCheckArgs {
    /// HF folder (or GGUF file).
    pub model: PathBuf,
    /// JSON file with a list of prompts, each a list of token ids, `{"prompt": [...], "force": [...]}`
    /// (decode step j then feeds `force[j]` instead of the greedy token: teacher forcing, so that
    /// every backend sees the same inputs), `{"text": "..."}` (its last `decode_steps` tokens forced)
    /// or `{"prompt_text": "..."}` (the text's tokens, then greedy).
    #[arg(long)]
    pub prompts: PathBuf,
    /// Greedy decode steps after the prompts.
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Output JSON file.
    #[arg(long)]
    pub out: PathBuf,
    /// Run the CPU backend instead (same output), for CPU/CUDA agreement.
    #[arg(long)]
    pub cpu: bool,
    /// Write, instead of logits, how this run's CUDA settings (e.g. `--quantization fp8`, or a GGUF
    /// file's packed blocks) agree with the bf16 run (`--quantization bf16`) of the same prompts:
    /// top-1 agreement and KL(bf16 ‖ this) per logits row.
    #[arg(long, conflicts_with = "cpu")]
    pub agreement: bool,
    /// Write, instead of logits, where this run's greedy tokens part from the CPU backend's on the same
    /// prompts (different arithmetic, so they may: each parting with both backends' logit margin there).
    #[arg(long, conflicts_with_all = ["cpu", "agreement"])]
    pub greedy_vs_cpu: bool,
    /// CUDA backend flags (e.g. the reference attention kernel).
    #[command(flatten)]
    pub cuda: CudaSettings,
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
    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<()> {
        match self {
            Runner::Cuda(m) => Ok(m.forward(batch, logits)?),
            Runner::Cpu(m, kv) => Ok(m.forward(batch, kv, logits)?),
        }
    }
}

/// Runs all prompts as one prefill step (every row's logits), then `decode_steps` greedy decode
/// steps of all sequences together, and writes the logits and tokens as JSON.
pub fn run(args: &CudaCheckArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.prompts).map_err(io_err(&args.prompts))?;
    let bad = |e: String| anyhow!("{}: {e}", args.prompts.display());
    let items: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let mut prompts: Vec<Vec<u32>> = Vec::with_capacity(items.len());
    let mut forced: Vec<Option<Vec<u32>>> = Vec::with_capacity(items.len());
    let loaded = tandem_model::load(&args.model, &LoadOptions::default())?;
    for item in items {
        let ids = |v: &serde_json::Value| -> Result<Vec<u32>> {
            serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))
        };
        if let Some(text) = item.get("text").and_then(|t| t.as_str()) {
            // Real text, teacher-forced: its last `decode_steps` tokens are fed one step at a time.
            let toks = loaded.tokenizer.encode(text, false)?;
            if toks.len() <= args.decode_steps {
                return Err(bad(format!(
                    "a text of {} tokens leaves no prompt before {} forced steps",
                    toks.len(),
                    args.decode_steps
                )));
            }
            let cut = toks.len() - args.decode_steps;
            prompts.push(toks[..cut].to_vec());
            forced.push(Some(toks[cut..].to_vec()));
        } else if let Some(text) = item.get("prompt_text").and_then(|t| t.as_str()) {
            prompts.push(loaded.tokenizer.encode(text, false)?);
            forced.push(None);
        } else if item.is_array() {
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
    let block_size = BLOCK_SIZE;
    let per_seq = prompts
        .iter()
        .map(|p| (p.len() + args.decode_steps + 1).div_ceil(block_size))
        .max()
        .unwrap_or(1);
    // One spare block past the prompts' tables: the KV round trip imports into it.
    let num_blocks = per_seq * prompts.len().max(1) + 1;
    let total_tokens: usize = prompts.iter().map(Vec::len).sum();
    let max_tokens = total_tokens.max(prompts.len().next_power_of_two()).max(1);
    let cuda_runner = |cuda: &CudaSettings, loaded: &LoadedModel| {
        cuda_runner(loaded, cuda, num_blocks, max_tokens, prompts.len())
    };
    let vocab = loaded.config.vocab_size;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    let steps = args.decode_steps;
    if args.agreement {
        let plain = CudaSettings {
            quantization: Some(Quantization::Bf16),
            ..args.cuda.clone()
        };
        let (mut base, device) = cuda_runner(&plain, &loaded)?;
        let want = run_prompts(&mut base, &prompts, &forced, &tables, steps, vocab)?;
        drop(base);
        let (mut runner, _) = cuda_runner(&args.cuda, &loaded)?;
        let got = run_prompts(&mut runner, &prompts, &forced, &tables, steps, vocab)?;
        let report = Agreement::of(&want, &got, device);
        std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
            .map_err(io_err(&args.out))?;
        tracing::info!(out = %args.out.display(), top1 = report.top1, kl = report.kl_mean, "agreement written");
        return Ok(());
    }
    let cpu_runner = |loaded: LoadedModel| {
        let model = CpuLlama::new(loaded.config, loaded.weights, 0);
        let kv = KvCache::new(model.kv_layout(block_size, num_blocks));
        Runner::Cpu(Box::new(model), kv)
    };
    if args.greedy_vs_cpu {
        let (mut cuda, device) = cuda_runner(&args.cuda, &loaded)?;
        let got = run_prompts(&mut cuda, &prompts, &forced, &tables, steps, vocab)?;
        drop(cuda);
        let want = run_prompts(
            &mut cpu_runner(loaded),
            &prompts,
            &forced,
            &tables,
            steps,
            vocab,
        )?;
        let report = GreedyReport::of(&want, &got, device);
        std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
            .map_err(io_err(&args.out))?;
        tracing::info!(out = %args.out.display(), share = report.share_equal, parted = report.parted.len(), "greedy comparison written");
        return Ok(());
    }
    let (mut runner, backend, device) = if args.cpu {
        (cpu_runner(loaded), "cpu", "cpu".to_string())
    } else {
        let (runner, device) = cuda_runner(&args.cuda, &loaded)?;
        (runner, "cuda", device)
    };
    let results = run_prompts(&mut runner, &prompts, &forced, &tables, steps, vocab)?;
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
    let json = serde_json::to_string(&out)?;
    std::fs::write(&args.out, json).map_err(io_err(&args.out))?;
    tracing::info!(out = %args.out.display(), backend, "check written");
    Ok(())
}

/// KV blocks of 16 tokens, as the CPU runner's.
const BLOCK_SIZE: usize = 16;

/// The CUDA model of `loaded` under `cuda`, sized for `seqs` sequences of `num_blocks` blocks in all
/// and `max_tokens` prompt tokens in one step; and the device's name.
fn cuda_runner(
    loaded: &LoadedModel,
    cuda: &CudaSettings,
    num_blocks: usize,
    max_tokens: usize,
    seqs: usize,
) -> Result<(Runner, String)> {
    let c = &loaded.config;
    let bytes = num_blocks * c.num_layers * 2 * c.num_kv_heads * BLOCK_SIZE * c.head_dim * 2;
    let opts = cuda.options(CudaOptions {
        block_size: BLOCK_SIZE,
        kv_cache_memory: bytes,
        max_tokens,
        // A power of two so that the decode steps also run through captured graphs.
        max_seqs: seqs.max(1).next_power_of_two(),
        logits_chunk_rows: 256,
        fp8_weights: loaded.fp8_checkpoint,
        ..CudaOptions::default()
    });
    let model = CudaLlama::new(
        loaded.config.clone(),
        WeightSource::Host(&loaded.weights),
        opts,
    )?;
    let device = model.device_name().to_string();
    Ok((Runner::Cuda(Box::new(model)), device))
}

/// Runs all prompts as one prefill step (every row's logits), then `steps` decode steps of all
/// sequences together (greedy, or the forced tokens).
fn run_prompts(
    runner: &mut Runner,
    prompts: &[Vec<u32>],
    forced: &[Option<Vec<u32>>],
    tables: &[Vec<u32>],
    steps: usize,
    vocab: usize,
) -> Result<Vec<PromptResult>> {
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
    for (p, t) in prompts.iter().zip(tables) {
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
    for step in 0..steps {
        batch.clear();
        for ((r, t), f) in results.iter_mut().zip(tables).zip(forced) {
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
    Ok(results)
}

/// How a run's logits agree with a baseline run's over the same (teacher-forced) inputs.
#[derive(Serialize)]
struct Agreement {
    device: String,
    /// Logits rows compared: every prompt row (the prefill step) and every decode row.
    positions: usize,
    /// Share of rows whose argmax equals the baseline's, all rows / prefill rows / decode rows.
    top1: f64,
    top1_prefill: f64,
    top1_decode: f64,
    /// KL(baseline ‖ run) of the softmax distributions in nats: mean and largest over the rows.
    kl_mean: f64,
    kl_max: f64,
}

impl Agreement {
    fn of(want: &[PromptResult], got: &[PromptResult], device: String) -> Agreement {
        let mut n = [0usize; 2];
        let mut same = [0usize; 2];
        let (mut kl_sum, mut kl_max) = (0.0f64, 0.0f64);
        for (w, g) in want.iter().zip(got) {
            let pairs = w
                .prefill_logits
                .iter()
                .zip(&g.prefill_logits)
                .map(|p| (0, p))
                .chain(w.decode_logits.iter().zip(&g.decode_logits).map(|p| (1, p)));
            for (kind, (a, b)) in pairs {
                n[kind] += 1;
                same[kind] += usize::from(argmax(a) == argmax(b));
                let kl = kl_divergence(a, b);
                kl_sum += kl;
                kl_max = kl_max.max(kl);
            }
        }
        let share = |s: usize, n: usize| if n == 0 { 1.0 } else { s as f64 / n as f64 };
        let total = n[0] + n[1];
        Agreement {
            device,
            positions: total,
            top1: share(same[0] + same[1], total),
            top1_prefill: share(same[0], n[0]),
            top1_decode: share(same[1], n[1]),
            kl_mean: if total == 0 {
                0.0
            } else {
                kl_sum / total as f64
            },
            kl_max,
        }
    }
}

/// Where a run's greedy tokens part from the CPU backend's (`--greedy-vs-cpu`).
#[derive(Serialize)]
struct GreedyReport {
    device: String,
    /// Greedy tokens per prompt (the prefill's, then one per decode step).
    tokens_per_prompt: usize,
    /// Tokens equal to the CPU's before each prompt's first parting, summed, over all tokens.
    tokens_equal: usize,
    tokens_total: usize,
    share_equal: f64,
    /// Each prompt whose tokens part: where, and how close each backend was to the other's choice.
    parted: Vec<Parting>,
}

/// The first greedy token a prompt's run chose unlike the CPU.
#[derive(Serialize, Debug, PartialEq)]
struct Parting {
    prompt: usize,
    /// Index into the greedy tokens (0: the prefill's).
    at: usize,
    cpu_token: u32,
    token: u32,
    /// The CPU's logit of its token minus its logit of this run's token (≥ 0), and the same on this
    /// run's logits: two small margins mean a near tie that different arithmetic tips either way.
    cpu_margin: f32,
    margin: f32,
}

impl GreedyReport {
    fn of(cpu: &[PromptResult], got: &[PromptResult], device: String) -> GreedyReport {
        let mut equal = 0;
        let mut total = 0;
        let mut parted = Vec::new();
        for (i, (w, g)) in cpu.iter().zip(got).enumerate() {
            total += w.generated.len();
            let same = w
                .generated
                .iter()
                .zip(&g.generated)
                .take_while(|(a, b)| a == b)
                .count();
            equal += same;
            if same < w.generated.len() {
                // Token j was chosen from the last prompt row (j = 0) or decode row j - 1.
                let row = |r: &PromptResult| -> Vec<f32> {
                    match same {
                        0 => r.prefill_logits.last().cloned().unwrap_or_default(),
                        j => r.decode_logits[j - 1].clone(),
                    }
                };
                let (wr, gr) = (row(w), row(g));
                let (a, b) = (w.generated[same], g.generated[same]);
                parted.push(Parting {
                    prompt: i,
                    at: same,
                    cpu_token: a,
                    token: b,
                    cpu_margin: wr[a as usize] - wr[b as usize],
                    margin: gr[b as usize] - gr[a as usize],
                });
            }
        }
        GreedyReport {
            device,
            tokens_per_prompt: cpu.first().map_or(0, |r| r.generated.len()),
            tokens_equal: equal,
            tokens_total: total,
            share_equal: if total == 0 {
                1.0
            } else {
                equal as f64 / total as f64
            },
            parted,
        }
    }
}

/// KL(softmax(p) ‖ softmax(q)) in nats, in f64.
fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
        x.iter().map(|&v| v as f64 - lse).collect()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

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
        run(&CudaCheckArgs {
            model: model.to_path_buf(),
            prompts: pfile,
            decode_steps: steps,
            out: out.clone(),
            cpu: true,
            agreement: false,
            greedy_vs_cpu: false,
            cuda: CudaSettings::default(),
        })
        .unwrap();
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
    }

    fn result(generated: &[u32], rows: &[[f32; 3]]) -> PromptResult {
        PromptResult {
            prompt: vec![0],
            fed: Vec::new(),
            prefill_logits: vec![rows[0].to_vec()],
            generated: generated.to_vec(),
            decode_logits: rows[1..].iter().map(|r| r.to_vec()).collect(),
        }
    }

    /// A prompt counts its tokens up to the first parting; the parting reports both backends'
    /// margins on the row the parted token was chosen from.
    #[test]
    fn greedy_report_counts_tokens_until_the_first_parting() {
        let rows = [[0.0, 2.0, 1.0], [3.0, 0.0, 2.5], [0.0, 0.0, 1.0]];
        let cpu = [result(&[1, 0, 2], &rows), result(&[1, 0, 2], &rows)];
        let mut other = rows;
        other[1] = [2.0, 0.0, 2.25];
        let got = [result(&[1, 0, 2], &rows), result(&[1, 2, 2], &other)];
        let r = GreedyReport::of(&cpu, &got, "gpu".into());
        assert_eq!((r.tokens_equal, r.tokens_total), (4, 6));
        assert!((r.share_equal - 4.0 / 6.0).abs() < 1e-12);
        assert_eq!(
            r.parted,
            [Parting {
                prompt: 1,
                at: 1,
                cpu_token: 0,
                token: 2,
                cpu_margin: 0.5,
                margin: 0.25,
            }]
        );
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
