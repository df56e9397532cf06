//! `tandem cuda-bench`: decode and prefill speed of the CUDA backend on a model of given shape with
//! random weights generated on the GPU.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
use tandem_engine::Backend;
use tandem_model::{
    AttentionSpan, DenseShape, ForwardBatch, LayerRope, LayerSpec, LogitsWanted, MlpKind,
    ModelConfig, MoeSpec,
};

use super::io_err;
use crate::cuda_settings::CudaSettings;

/// Options of `tandem cuda-bench`.
#[derive(Args, Debug)]
pub struct CudaBenchArgs {
    /// Cached tokens per sequence during decode.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Decode batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    pub batches: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Prompt lengths of the prefill measurements, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    pub prefill: Vec<usize>,
    /// The model shape whose layers are timed.
    #[arg(long, value_enum, default_value_t = BenchShape::Llama3_8b)]
    pub shape: BenchShape,
    /// Time this model file or folder with its own weights (e.g. a GGUF file's packed blocks)
    /// instead of random weights of `--shape`.
    #[arg(long, conflicts_with_all = ["shape", "layers"])]
    pub model: Option<PathBuf>,
    /// Layers of the model (default: the shape's own; fewer for a quick run).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Context limit of the model (default: the shape's own): what the captured decode graphs size
    /// their attention for.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Copy bandwidth MBU is measured against, GB/s.
    #[arg(long, default_value_t = 4300.0)]
    pub peak_gbps: f64,
    /// Also time restoring this many tokens' KV from host memory through the KV tiers' restore path
    /// (0: skip): the blocks are exported as a tier holds them, imported into other blocks, checked.
    #[arg(long, default_value_t = 0)]
    pub kv_restore_tokens: usize,
    /// JSON-lines output file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// CUDA backend flags (A/B timings of the tuning knobs, graphs off for profiling).
    #[command(flatten)]
    pub cuda: CudaSettings,
}

/// The real models' shapes `cuda-bench` can time (random weights of that shape).
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum BenchShape {
    /// Llama-3.1-8B: 32 layers, 4096 hidden, 14336 FFN, 32/8 heads, 128256 vocab.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Qwen3-8B: 36 layers, 4096 hidden, 12288 FFN, 32/8 heads, 151936 vocab, per-head q/k norms.
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    /// Qwen3-30B-A3B: 48 layers, 2048 hidden, 32/4 heads, 128 experts of 768 features, top-8
    /// renormalised, per-head q/k norms, 151936 vocab.
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// Gemma-3-27B: 62 layers, 5376 hidden, 21504 FFN (GELU), 32/16 heads of 128, 262208 vocab
    /// (tied), sandwich and per-head norms, five 1024-token sliding-window layers (rope base 1e4)
    /// to one global layer (rope base 1e6, linear scaling 8), attention scale 1/sqrt(168).
    #[value(name = "gemma3-27b")]
    Gemma3_27b,
}

/// Runs `cuda-bench` on `args.model`, or on `args.shape` with `args.layers` layers.
pub fn run(args: CudaBenchArgs) -> Result<()> {
    let loaded = match &args.model {
        Some(path) => Some(tandem_model::load(
            path,
            &tandem_model::LoadOptions::default(),
        )?),
        None => None,
    };
    let mut config = match args.shape {
        BenchShape::Llama3_8b => BenchArgs::llama3_8b_config(),
        BenchShape::Qwen3_8b => BenchArgs::qwen3_8b_config(),
        BenchShape::Qwen3_30bA3b => BenchArgs::qwen3_30b_a3b_config(),
        BenchShape::Gemma3_27b => BenchArgs::gemma3_27b_config(),
    };
    if let Some(n) = args.layers {
        // The shape's layer pattern repeated (or cut) to n layers.
        config.layers = (0..n)
            .map(|l| config.layers[l % config.layers.len()].clone())
            .collect();
        config.num_layers = n;
    }
    if let Some(m) = &loaded {
        config = m.config.clone();
    }
    if let Some(n) = args.max_model_len {
        config.max_position_embeddings = n;
    }
    run_bench(
        &BenchArgs {
            config,
            loaded,
            context: args.context,
            batches: args.batches,
            steps: args.steps,
            prefill: args.prefill,
            peak_bandwidth: args.peak_gbps * 1e9,
            kv_restore_tokens: args.kv_restore_tokens,
            out: args.out,
        },
        &args.cuda,
    )
}

/// What `cuda-bench` measures.
pub(super) struct BenchArgs {
    /// Model shape.
    pub config: ModelConfig,
    /// The model's own weights (`None`: random weights of `config`, generated on the GPU).
    pub loaded: Option<tandem_model::LoadedModel>,
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
    /// Tokens of KV the host-to-device restore measurement moves (0: not measured).
    pub kv_restore_tokens: usize,
    /// Where the JSON lines go (also printed).
    pub out: Option<PathBuf>,
}

impl BenchArgs {
    /// Llama-3.1-8B's shape: 32 layers, 4096 hidden, 14336 FFN, 32/8 heads, 128256 vocab.
    pub(super) fn llama3_8b_config() -> ModelConfig {
        ModelConfig::dense(DenseShape {
            hidden: 4096,
            ffn: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128256,
            max_positions: 8192,
            rope: LayerRope {
                theta: 500000.0,
                scaling: tandem_kernels::RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position: 8192,
                },
            },
        })
    }

    /// Qwen3-8B's shape (see [`BenchShape::Qwen3_8b`]); rope base 1e6, no scaling.
    pub(super) fn qwen3_8b_config() -> ModelConfig {
        let mut c = ModelConfig::dense(DenseShape {
            hidden: 4096,
            ffn: 12288,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 151936,
            max_positions: 40960,
            rope: LayerRope {
                theta: 1_000_000.0,
                scaling: tandem_kernels::RopeScaling::None,
            },
        });
        c.architecture = "qwen3".into();
        c.qk_norm = true;
        c.rms_norm_eps = 1e-6;
        c
    }

    /// Qwen3-30B-A3B's shape (see [`BenchShape::Qwen3_30bA3b`]): Qwen3-8B's attention settings on
    /// a 2048-wide model whose every MLP is a mixture of experts.
    pub(super) fn qwen3_30b_a3b_config() -> ModelConfig {
        let mut c = Self::qwen3_8b_config();
        c.architecture = "qwen3moe".into();
        c.hidden_size = 2048;
        c.num_heads = 32;
        c.num_kv_heads = 4;
        c.num_layers = 48;
        c.intermediate_size = 6144;
        c.layers = LayerSpec::uniform(
            48,
            c.layers[0].attention,
            c.layers[0].rope.clone(),
            MlpKind::Moe,
        );
        c.moe = Some(MoeSpec {
            num_experts: 128,
            top_k: 8,
            norm_top_k: true,
            expert_ffn: 768,
            shared_ffn: None,
        });
        c
    }

    /// Gemma-3-27B's shape (see [`BenchShape::Gemma3_27b`]).
    pub(super) fn gemma3_27b_config() -> ModelConfig {
        let global = LayerRope {
            theta: 1_000_000.0,
            scaling: tandem_kernels::RopeScaling::Linear { factor: 8.0 },
        };
        let local = LayerRope {
            theta: 10_000.0,
            scaling: tandem_kernels::RopeScaling::None,
        };
        let mut c = ModelConfig::dense(DenseShape {
            hidden: 5376,
            ffn: 21504,
            layers: 62,
            heads: 32,
            kv_heads: 16,
            head_dim: 128,
            vocab: 262208,
            max_positions: 131072,
            rope: global.clone(),
        });
        c.architecture = "gemma3".into();
        c.layers = (0..62)
            .map(|l| {
                if l % 6 == 5 {
                    LayerSpec::uniform(1, AttentionSpan::Global, global.clone(), MlpKind::Dense)
                } else {
                    LayerSpec::uniform(
                        1,
                        AttentionSpan::Window(1024),
                        local.clone(),
                        MlpKind::Dense,
                    )
                }
                .remove(0)
            })
            .collect();
        c.tie_word_embeddings = true;
        c.qk_norm = true;
        c.sandwich_norms = true;
        c.activation = tandem_model::Activation::GeluTanh;
        c.embedding_scale = Some((5376f32).sqrt());
        c.attn_scale = 1.0 / 168f32.sqrt();
        c.rms_norm_eps = 1e-6;
        c
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
    /// How the layers' projections are stored: bf16, fp8 (`--quantization fp8`; with the FP8
    /// tensor-core GEMMs when `--cuda-fp8-gemm` was asked for and passed its load-time check), or a
    /// GGUF file's packed blocks (`gguf-q4`, `gguf-q8`, `gguf-q4+q8`).
    weights: &'static str,
    /// Element type of the KV cache (`--kv-cache-dtype`): bf16 or fp8.
    kv: &'static str,
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
fn run_bench(args: &BenchArgs, cuda: &CudaSettings) -> Result<()> {
    let c = args.config.clone();
    let bs = 16;
    let max_b = args.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (args.context + args.steps + 8).div_ceil(bs);
    let max_prefill = args.prefill.iter().copied().max().unwrap_or(0);
    let prefill_blocks = max_prefill.div_ceil(bs);
    let restore_blocks = args.kv_restore_tokens.div_ceil(bs);
    let num_blocks = (max_b * per_seq)
        .max(prefill_blocks)
        .max(2 * restore_blocks);
    let kv_elem = cuda.options(CudaOptions::default()).kv_dtype.size();
    let block_bytes = c.num_layers * 2 * c.num_kv_heads * bs * c.head_dim * kv_elem;
    let opts = cuda.options(CudaOptions {
        block_size: bs,
        kv_cache_memory: num_blocks * block_bytes,
        max_tokens: max_prefill.max(max_b),
        max_seqs: max_b,
        max_model_len: Some(c.max_position_embeddings),
        logits_chunk_rows: max_b.max(1),
        ..CudaOptions::default()
    });
    let t0 = Instant::now();
    let source = match &args.loaded {
        Some(m) => WeightSource::Host(&m.weights),
        None => WeightSource::Random { seed: 1 },
    };
    let mut model = CudaLlama::new(c.clone(), source, opts.clone())?;
    model.synchronize()?;
    let device = model.device_name().to_string();
    tracing::info!(secs = t0.elapsed().as_secs_f64(), "weights on the GPU");
    let kv_per_token = model.kv_layout().bytes_per_token() as f64;
    let kv_dtype = if model.kv_layout().dtype == tandem_model::KvDtype::Fp8E4m3 {
        "fp8"
    } else {
        "bf16"
    };
    let weights = match (model.weight_format(), model.fp8_tensor_cores()) {
        ("fp8", true) => "fp8, FP8 tensor-core GEMMs",
        (format, _) => format,
    };
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
        if b <= tandem_cuda::kernels::GEMV_MAX_ROWS {
            modes.push((true, false, false));
        }
        // --no-cuda-graphs (profiling: one kernel launch per kernel) drops the graph modes.
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
                bail!("non-finite logits in the decode bench");
            }
            let med = median(&mut times);
            let ctx_avg = args.context as f64 + (warmup + args.steps) as f64 / 2.0;
            // A windowed layer reads at most its window of each sequence's keys and values.
            let kv_read: f64 = (0..c.num_layers)
                .map(|l| {
                    let w = c.layer(l).attention.window().map_or(f64::MAX, |w| w as f64);
                    ctx_avg.min(w) * kv_per_token / c.num_layers as f64
                })
                .sum();
            let bytes = model.weight_bytes_per_step(b) as f64 + b as f64 * kv_read;
            emit(BenchRow {
                weights,
                kv: kv_dtype,
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
        // The MLP FLOPs a token costs: its k experts (and the shared one) in a mixture of experts.
        let mlp = |l: usize| match (c.layer(l).mlp, &c.moe) {
            (MlpKind::Moe, Some(m)) => {
                3 * (m.top_k * m.expert_ffn + m.shared_ffn.unwrap_or(0)) * h + m.num_experts * h
            }
            _ => 3 * f * h,
        };
        let per_token: usize = (0..c.num_layers)
            .map(|l| (q + 2 * kv) * h + q * h + mlp(l))
            .sum();
        let linear = 2.0 * n * per_token as f64 + 2.0 * (c.vocab_size * h) as f64;
        // Keys each query scores, summed: n(n+1)/2 on a global layer, fewer on a windowed one.
        let keys: f64 = (0..c.num_layers)
            .map(|l| match c.layer(l).attention.window() {
                Some(w) if w < len => (w * (w + 1) / 2 + (len - w) * w) as f64,
                _ => n * (n + 1.0) / 2.0,
            })
            .sum();
        let attn = 4.0 * (c.num_heads * c.head_dim) as f64 * keys;
        emit(BenchRow {
            weights,
            kv: kv_dtype,
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
    if restore_blocks > 0 {
        let row = kv_restore(CudaBackend::new(model), restore_blocks, &device)?;
        let line = serde_json::to_string(&row).unwrap_or_default();
        println!("{line}");
        rows.push(line);
    }
    if let Some(path) = &args.out {
        std::fs::write(path, rows.join("\n") + "\n").map_err(io_err(path))?;
    }
    Ok(())
}

/// One host-to-device KV restore measurement (`--kv-restore-tokens`).
#[derive(Serialize)]
struct KvRestoreRow {
    what: &'static str,
    tokens: usize,
    bytes: usize,
    median_ms: f64,
    gb_per_s: f64,
    device: String,
}

/// Times the KV tiers' restore path (`tandem_engine::restore_layer_major`, then a device sync) for
/// `n` blocks: blocks `0..n` are exported and held as a host tier holds them (each block's layers
/// back to back), then imported into blocks `n..2n`, which must then export the same bytes.
fn kv_restore(mut backend: CudaBackend, n: usize, device: &str) -> Result<KvRestoreRow> {
    let layout = backend.kv_layout();
    let src: Vec<u32> = (0..n as u32).collect();
    let dst: Vec<u32> = (n as u32..2 * n as u32).collect();
    let sources: Vec<std::sync::Arc<Vec<u8>>> =
        tandem_engine::export_layer_major(&mut backend, &src)?
            .into_iter()
            .map(std::sync::Arc::new)
            .collect();
    let mut times = Vec::new();
    for rep in 0..6 {
        let t = Instant::now();
        tandem_engine::restore_layer_major(&mut backend, &dst, &sources)?;
        backend.model_mut().synchronize()?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    if tandem_engine::export_layer_major(&mut backend, &dst)?
        .iter()
        .zip(&sources)
        .any(|(a, b)| a != &**b)
    {
        bail!("the restored KV blocks differ from the exported ones");
    }
    let med = median(&mut times);
    let bytes = n * layout.n_layers * layout.block_bytes();
    Ok(KvRestoreRow {
        what: "kv restore host->device (KV tier path)",
        tokens: n * layout.block_size,
        bytes,
        median_ms: med * 1e3,
        gb_per_s: bytes as f64 / med / 1e9,
        device: device.to_string(),
    })
}
