//! The CUDA backend's settings: one type, [`CudaSettings`], that is both the `cuda:` section of the YAML
//! file and the `--cuda-*` flags (each flag sets the same key), and the one conversion to
//! `tandem_cuda::CudaOptions` ([`CudaSettings::options`]).
//!
//! The section parses and validates in every binary (a config file is portable between CPU and CUDA
//! builds); only binaries built with the `cuda` feature turn it into options. The settings an operator
//! sets (device ordinal, attention kernels, graphs, GEMV) are YAML keys and visible flags; the GEMV tuning
//! knobs that only the GPU scripts sweep (`scripts/gpu/run.sh`) are hidden flags of each process
//! ([`CudaTuning`]), not YAML keys, and do not travel to the processes a launcher starts.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer, Serialize};

/// Most rows the small-batch GEMV kernels take (`tandem_cuda::kernels::GEMV_MAX_ROWS`).
const GEMV_MAX_ROWS: usize = 8;

/// Longest decode-attention partition of small batches (`tandem_cuda::kernels::DECODE_PARTITION_SMALL`).
const DECODE_PARTITION_SMALL: usize = 64;

#[cfg(feature = "cuda")]
const _: () = assert!(
    GEMV_MAX_ROWS == tandem_cuda::kernels::GEMV_MAX_ROWS
        && DECODE_PARTITION_SMALL == tandem_cuda::kernels::DECODE_PARTITION_SMALL
);

/// Which attention kernels the CUDA backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CudaAttention {
    /// Tensor-core flash attention for prefill, split-K flash decoding (the default).
    Fast,
    /// The one-warp-per-(token, head) reference kernel: the on-device check of the fast ones.
    Simple,
}

impl std::fmt::Display for CudaAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CudaAttention::Fast => "fast",
            CudaAttention::Simple => "simple",
        })
    }
}

/// How the CUDA backend stores the layers' projection weights instead of the checkpoint's own format
/// (unset: as stored — bf16, an FP8 checkpoint's FP8, a GGUF file's block formats packed for the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    /// FP8 E4M3 with one scale per row and 128 columns, quantized at load: half the bytes per decode
    /// step.
    Fp8,
    /// bf16: FP8 and GGUF block-quantized weights dequantized at load (twice to four times the bytes
    /// per decode step; the reference the other formats are compared with).
    Bf16,
}

impl std::fmt::Display for Quantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quantization::Fp8 => "fp8",
            Quantization::Bf16 => "bf16",
        })
    }
}

/// Element type of the CUDA backend's KV cache (`cuda.kv_cache_dtype`, `--kv-cache-dtype`, vLLM's name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// bf16 (the default).
    #[serde(alias = "auto")]
    #[value(alias = "auto")]
    Bf16,
    /// FP8 E4M3 codes with a per-tensor scale of 1: half the bytes per token to hold, to read each
    /// decode step and to move from prefill to decode.
    #[serde(alias = "fp8_e4m3")]
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8 => "fp8",
        })
    }
}

/// `cuda:` section, and the `--cuda-*` flags of every command that can run the CUDA backend: unset keys
/// keep the backend's defaults. Layers (the file, then the flags) merge with `crate::config::overlay`;
/// the tuning knobs come from this process's flags only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CudaSettings {
    /// CUDA device ordinal (--device cuda).
    #[arg(id = "cuda_device", long = "cuda-device")]
    pub device: Option<usize>,
    /// CUDA device ordinal of each pipeline stage, stage 0 first, as 0,1,... (unset: all on --cuda-device).
    #[arg(
        id = "cuda_pipeline_devices",
        long = "cuda-pipeline-devices",
        value_delimiter = ','
    )]
    pub pipeline_devices: Option<Vec<usize>>,
    /// CUDA attention kernels: fast, or the simple reference kernel (on-device checks).
    #[arg(id = "cuda_attention", long = "cuda-attention", value_enum)]
    pub attention: Option<CudaAttention>,
    /// Capture CUDA graphs for decode-only steps (flag `--no-cuda-graphs` sets false).
    #[arg(
        id = "cuda_graphs",
        long = "no-cuda-graphs",
        num_args = 0,
        default_missing_value = "false",
        help = "Run CUDA decode steps without captured graphs (one launch per kernel; profiling)"
    )]
    pub graphs: Option<bool>,
    /// Our GEMV kernels for steps of few rows (flag `--no-cuda-gemv` sets false: cuBLAS for every projection).
    #[arg(
        id = "cuda_gemv",
        long = "no-cuda-gemv",
        num_args = 0,
        default_missing_value = "false",
        help = "Run every CUDA projection on cuBLAS instead of our small-batch GEMV kernels"
    )]
    pub gemv: Option<bool>,
    /// Most rows (tokens of a step) the CUDA GEMV kernels take, 0 to 8 [default: 1; 8 over packed GGUF weights].
    #[arg(id = "cuda_gemv_max_rows", long = "cuda-gemv-max-rows", value_parser = parse_gemv_max_rows)]
    #[serde(default, deserialize_with = "gemv_max_rows")]
    pub gemv_max_rows: Option<usize>,
    /// Hold the projection weights as fp8 (quantized at load) or bf16 (FP8 and GGUF weights dequantized
    /// at load) instead of the checkpoint's own format.
    #[arg(id = "cuda_quantization", long = "quantization", value_enum)]
    pub quantization: Option<Quantization>,
    /// Element type of the KV cache: bf16 (or auto), or fp8 (E4M3; also fp8_e4m3). Prefill and decode
    /// workers must agree: the KV handshake refuses a mismatch, naming both.
    #[arg(id = "cuda_kv_cache_dtype", long = "kv-cache-dtype", value_enum)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// The A/B tuning knobs (hidden flags only).
    #[command(flatten)]
    #[serde(skip)]
    pub tuning: CudaTuning,
}

/// The CUDA knobs only A/B timings set: hidden flags of the process they are given to, never YAML keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args)]
pub struct CudaTuning {
    /// Programmatic dependent launch of the kernels that support it (A/B timings).
    #[arg(
        long = "cuda-pdl",
        hide = true,
        num_args = 0,
        default_missing_value = "true"
    )]
    pub pdl: Option<bool>,
    /// Keys per decode-attention partition of small batches, 1 to 64 (A/B timings).
    #[arg(long = "cuda-decode-partition-small", hide = true, value_parser = parse_decode_partition)]
    pub decode_partition_small: Option<usize>,
    /// Warps a small-batch GEMV launch aims for through split-K (A/B timings).
    #[arg(long = "cuda-gemv-target-warps", hide = true, value_parser = parse_positive("gemv_target_warps"))]
    pub gemv_target_warps: Option<usize>,
    /// 16-byte chunks per row a GEMV lane loads per step, compiled in (`GV_U`; A/B timings).
    #[arg(long = "cuda-gemv-unroll", hide = true, value_parser = parse_positive("gemv_unroll"))]
    pub gemv_unroll: Option<usize>,
    /// Blocks per multiprocessor the GEMV kernels must fit, compiled in (`GV_MINB`; A/B timings).
    #[arg(long = "cuda-gemv-min-blocks", hide = true, value_parser = parse_positive("gemv_min_blocks"))]
    pub gemv_min_blocks: Option<usize>,
    /// Packed GGUF GEMVs on the FP32 lanes (one row pair a warp) instead of the tensor cores,
    /// compiled in (`GV_MMA` 0; A/B timings).
    #[arg(
        long = "cuda-gemv-packed-simt",
        hide = true,
        num_args = 0,
        default_missing_value = "true"
    )]
    pub gemv_packed_simt: Option<bool>,
    /// Persistent GEMV launches: a grid of the blocks the GPU holds at once (A/B timings).
    #[arg(
        long = "cuda-gemv-persistent",
        hide = true,
        num_args = 0,
        default_missing_value = "true"
    )]
    pub gemv_persistent: Option<bool>,
    /// Most (token, expert) slots of a MoE step on the expert GEMVs; 0: grouped GEMMs always (A/B timings).
    #[arg(long = "cuda-moe-gemv-slots", hide = true, value_parser = parse_count("moe_gemv_slots"))]
    pub moe_gemv_slots: Option<usize>,
    /// FP8 matrices in large steps as FP8 tensor-core GEMMs (cuBLASLt, checked at load) instead of
    /// cuBLAS on bf16 tiles (A/B timings).
    #[arg(
        long = "cuda-fp8-gemm",
        hide = true,
        num_args = 0,
        default_missing_value = "true"
    )]
    pub fp8_gemm: Option<bool>,
    /// Blocks a multiprocessor of the looping decode attention in captured graphs (A/B timings, checks).
    #[arg(long = "cuda-decode-graph-blocks", hide = true, value_parser = parse_positive("decode_graph_blocks"))]
    pub decode_graph_blocks: Option<usize>,
}

/// `n` if it lies in `min..=max`, else an error naming `key`.
fn in_range(key: &str, n: usize, min: usize, max: usize) -> Result<usize, String> {
    if n < min || n > max {
        return Err(format!("{key}: expected {min} to {max}, got {n}"));
    }
    Ok(n)
}

/// `cuda.gemv_max_rows` from YAML, range-checked (serde_yaml puts the section, `cuda: `, in front).
fn gemv_max_rows<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    Option::<usize>::deserialize(d)?
        .map(|n| in_range("gemv_max_rows", n, 0, GEMV_MAX_ROWS))
        .transpose()
        .map_err(serde::de::Error::custom)
}

/// A flag's whole number for `cuda.{key}`, checked against `min..=max`.
fn ranged(s: &str, key: &str, min: usize, max: usize) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("cuda.{key}: expected a whole number, got `{s}`"))?;
    in_range(&format!("cuda.{key}"), n, min, max)
}

fn parse_gemv_max_rows(s: &str) -> Result<usize, String> {
    ranged(s, "gemv_max_rows", 0, GEMV_MAX_ROWS)
}

fn parse_decode_partition(s: &str) -> Result<usize, String> {
    ranged(s, "decode_partition_small", 1, DECODE_PARTITION_SMALL)
}

fn parse_count(key: &'static str) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| ranged(s, key, 0, usize::MAX)
}

fn parse_positive(key: &'static str) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| ranged(s, key, 1, usize::MAX)
}

impl CudaSettings {
    /// The clap ids of the visible `--cuda-*` flags: a command that takes its settings as one document
    /// (`--settings-json`) refuses them beside it. The hidden tuning flags are not among them: they are
    /// the process's own and may come with the document.
    pub const FLAG_IDS: [&'static str; 8] = [
        "cuda_device",
        "cuda_pipeline_devices",
        "cuda_attention",
        "cuda_graphs",
        "cuda_gemv",
        "cuda_gemv_max_rows",
        "cuda_quantization",
        "cuda_kv_cache_dtype",
    ];

    /// The device ordinal of each of `stages` pipeline stages: `pipeline_devices`, else `device` (0)
    /// for all.
    pub fn stage_devices(&self, stages: usize) -> Result<Vec<usize>, String> {
        match &self.pipeline_devices {
            Some(d) if d.len() == stages => Ok(d.clone()),
            Some(d) => Err(format!(
                "cuda.pipeline_devices names {} devices for {stages} pipeline stages",
                d.len()
            )),
            None => Ok(vec![self.device.unwrap_or(0); stages]),
        }
    }

    /// `base` (the sizes the caller derived from the engine settings) with every key set here applied.
    #[cfg(feature = "cuda")]
    pub fn options(&self, base: tandem_cuda::CudaOptions) -> tandem_cuda::CudaOptions {
        let t = &self.tuning;
        tandem_cuda::CudaOptions {
            kernel_cache_dir: kernel_cache_dir(),
            device: self.device.unwrap_or(base.device),
            attn: match self.attention {
                Some(CudaAttention::Fast) => tandem_cuda::AttnMode::Fast,
                Some(CudaAttention::Simple) => tandem_cuda::AttnMode::Simple,
                None => base.attn,
            },
            graphs: self.graphs.unwrap_or(base.graphs),
            gemv: self.gemv.unwrap_or(base.gemv),
            gemv_max_rows: self.gemv_max_rows.unwrap_or(base.gemv_max_rows),
            // An explicit row limit holds for every weight format (A/B timings).
            packed_gemv_max_rows: self.gemv_max_rows.unwrap_or(base.packed_gemv_max_rows),
            pdl: t.pdl.unwrap_or(base.pdl),
            decode_partition_small: t
                .decode_partition_small
                .unwrap_or(base.decode_partition_small),
            gemv_target_warps: t.gemv_target_warps.unwrap_or(base.gemv_target_warps),
            gemv_tuning: tandem_cuda::kernels::GemvTuning {
                unroll: t.gemv_unroll.unwrap_or(base.gemv_tuning.unroll),
                min_blocks: t.gemv_min_blocks.unwrap_or(base.gemv_tuning.min_blocks),
                packed_mma: t
                    .gemv_packed_simt
                    .map_or(base.gemv_tuning.packed_mma, |simt| !simt),
            },
            gemv_persistent: t.gemv_persistent.unwrap_or(base.gemv_persistent),
            moe_gemv_max_slots: t.moe_gemv_slots.unwrap_or(base.moe_gemv_max_slots),
            decode_graph_blocks_per_sm: t
                .decode_graph_blocks
                .unwrap_or(base.decode_graph_blocks_per_sm),
            fp8_weights: match self.quantization {
                Some(Quantization::Fp8) => true,
                Some(Quantization::Bf16) => false,
                None => base.fp8_weights,
            },
            gguf_packed: base.gguf_packed && self.quantization.is_none(),
            fp8_gemm: t.fp8_gemm.unwrap_or(base.fp8_gemm),
            kv_dtype: match self.kv_cache_dtype {
                Some(KvCacheDtype::Bf16) => tandem_model::KvDtype::Bf16,
                Some(KvCacheDtype::Fp8) => tandem_model::KvDtype::Fp8E4m3,
                None => base.kv_dtype,
            },
            ..base
        }
    }
}

/// Where compiled CUDA kernels are cached: `$XDG_CACHE_HOME/tandem/kernels`, else
/// `$HOME/.cache/tandem/kernels` (none without either: every start compiles).
#[cfg(feature = "cuda")]
fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    Some(base.join("tandem").join("kernels"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{overlay, Settings as FileConfig};

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        cuda: CudaSettings,
    }

    fn flags(args: &[&str]) -> Result<CudaSettings, clap::Error> {
        let argv = std::iter::once("tandem").chain(args.iter().copied());
        Ok(<Flags as clap::Parser>::try_parse_from(argv)?.cuda)
    }

    #[test]
    fn the_cuda_section_parses_typed_from_the_file_and_the_flags_alike() {
        let file = FileConfig::from_yaml(
            "cuda: {device: 1, attention: simple, graphs: false, gemv: false, gemv_max_rows: 8}\n",
        )
        .unwrap();
        let want = CudaSettings {
            device: Some(1),
            attention: Some(CudaAttention::Simple),
            graphs: Some(false),
            gemv: Some(false),
            gemv_max_rows: Some(8),
            ..CudaSettings::default()
        };
        assert_eq!(file.cuda, want);
        let cli = flags(&[
            "--cuda-device",
            "1",
            "--cuda-attention",
            "simple",
            "--no-cuda-graphs",
            "--no-cuda-gemv",
            "--cuda-gemv-max-rows",
            "8",
        ])
        .unwrap();
        assert_eq!(cli, want);
        assert_eq!(FileConfig::default().cuda, CudaSettings::default());
        assert_eq!(flags(&[]).unwrap(), CudaSettings::default());
    }

    #[test]
    fn bad_values_name_the_key() {
        for (yaml, key) in [
            (
                "cuda: {gemv_max_rows: 9}\n",
                "gemv_max_rows: expected 0 to 8",
            ),
            ("cuda: {gemv_max_rows: lots}\n", "gemv_max_rows"),
            ("cuda: {graphs: maybe}\n", "graphs"),
            ("cuda: {attention: slow}\n", "attention"),
            ("cuda: {device: -1}\n", "device"),
            ("cuda: {quantization: int4}\n", "quantization"),
            ("cuda: {kv_cache_dtype: fp16}\n", "kv_cache_dtype"),
        ] {
            let err = FileConfig::from_yaml(yaml).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{yaml}: {err:#}");
        }
        let err = flags(&["--cuda-gemv-max-rows", "9"]).unwrap_err();
        assert!(err.to_string().contains("cuda.gemv_max_rows"), "{err}");
        let err = flags(&["--cuda-decode-partition-small", "0"]).unwrap_err();
        assert!(
            err.to_string().contains("cuda.decode_partition_small"),
            "{err}"
        );
        let err = flags(&["--cuda-gemv-unroll", "x"]).unwrap_err();
        assert!(err.to_string().contains("cuda.gemv_unroll"), "{err}");
    }

    #[test]
    fn unknown_and_tuning_keys_are_errors_in_the_file() {
        for key in ["gemv_rows", "pdl", "gemv_persistent", "tuning"] {
            let err = FileConfig::from_yaml(&format!("cuda: {{{key}: 1}}\n")).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{err:#}");
        }
    }

    #[test]
    fn flags_override_the_file_and_the_section_travels_without_the_tuning() {
        let file = FileConfig::from_yaml("cuda: {device: 1, gemv_max_rows: 2}\n").unwrap();
        let cli = flags(&[
            "--cuda-gemv-max-rows",
            "4",
            "--no-cuda-graphs",
            "--cuda-pdl",
        ])
        .unwrap();
        let merged: CudaSettings = overlay(&[&file.cuda, &cli]).unwrap();
        assert_eq!(merged.device, Some(1));
        assert_eq!(merged.gemv_max_rows, Some(4));
        assert_eq!(merged.graphs, Some(false));
        assert_eq!(cli.tuning.pdl, Some(true));
        // Children get the section in their JSON settings document: every file key travels; the
        // hidden tuning flags are per process (given to a process's own command line).
        let doc = serde_json::to_string(&cli).unwrap();
        let travelled: CudaSettings = serde_json::from_str(&doc).unwrap();
        assert_eq!(
            travelled,
            CudaSettings {
                tuning: CudaTuning::default(),
                ..cli
            }
        );
    }

    #[test]
    fn fp8_quantization_is_a_key_and_a_flag() {
        let file = FileConfig::from_yaml("cuda: {quantization: fp8}\n").unwrap();
        assert_eq!(file.cuda.quantization, Some(Quantization::Fp8));
        let cli = flags(&["--quantization", "fp8"]).unwrap();
        assert_eq!(cli.quantization, Some(Quantization::Fp8));
        let err = flags(&["--quantization", "gptq"]).unwrap_err();
        assert!(err.to_string().contains("fp8"), "{err}");
        #[cfg(feature = "cuda")]
        {
            let base = tandem_cuda::CudaOptions::default();
            assert!(!CudaSettings::default().options(base.clone()).fp8_weights);
            assert!(CudaSettings::default().options(base.clone()).gguf_packed);
            assert!(cli.options(base).fp8_weights);
        }
    }

    /// vLLM's spellings are accepted; the option reaches the backend as the KV layout's dtype.
    #[test]
    fn kv_cache_dtype_is_a_key_and_a_flag() {
        for (yaml, want) in [
            ("fp8", KvCacheDtype::Fp8),
            ("fp8_e4m3", KvCacheDtype::Fp8),
            ("bf16", KvCacheDtype::Bf16),
            ("auto", KvCacheDtype::Bf16),
        ] {
            let file =
                FileConfig::from_yaml(&format!("cuda: {{kv_cache_dtype: {yaml}}}\n")).unwrap();
            assert_eq!(file.cuda.kv_cache_dtype, Some(want), "{yaml}");
            let cli = flags(&["--kv-cache-dtype", yaml]).unwrap();
            assert_eq!(cli.kv_cache_dtype, Some(want), "{yaml}");
        }
        let err = flags(&["--kv-cache-dtype", "fp8_e5m2"]).unwrap_err();
        assert!(err.to_string().contains("fp8"), "{err}");
        #[cfg(feature = "cuda")]
        {
            let base = tandem_cuda::CudaOptions::default();
            let fp8 = flags(&["--kv-cache-dtype", "fp8"]).unwrap();
            assert_eq!(
                fp8.options(base.clone()).kv_dtype,
                tandem_model::KvDtype::Fp8E4m3
            );
            assert_eq!(
                CudaSettings::default().options(base).kv_dtype,
                tandem_model::KvDtype::Bf16
            );
        }
    }

    /// `bf16` holds every format as bf16: an FP8 checkpoint dequantized, GGUF blocks not packed.
    #[test]
    fn bf16_quantization_turns_the_stored_formats_off() {
        let file = FileConfig::from_yaml("cuda: {quantization: bf16}\n").unwrap();
        assert_eq!(file.cuda.quantization, Some(Quantization::Bf16));
        let cli = flags(&["--quantization", "bf16"]).unwrap();
        assert_eq!(cli.quantization, Some(Quantization::Bf16));
        #[cfg(feature = "cuda")]
        {
            let fp8_checkpoint = tandem_cuda::CudaOptions {
                fp8_weights: true,
                ..tandem_cuda::CudaOptions::default()
            };
            let o = cli.options(fp8_checkpoint);
            assert!(!o.fp8_weights);
            assert!(!o.gguf_packed);
        }
    }

    #[test]
    fn each_pipeline_stage_gets_its_device() {
        let file =
            FileConfig::from_yaml("cuda: {device: 1, pipeline_devices: [0, 1, 1]}\n").unwrap();
        assert_eq!(file.cuda.stage_devices(3).unwrap(), [0, 1, 1]);
        let err = file.cuda.stage_devices(2).unwrap_err();
        assert!(err.contains("3 devices for 2"), "{err}");
        assert_eq!(
            flags(&["--cuda-device", "2"])
                .unwrap()
                .stage_devices(2)
                .unwrap(),
            [2, 2]
        );
        let cli = flags(&["--cuda-pipeline-devices", "3,4"]).unwrap();
        assert_eq!(cli.stage_devices(2).unwrap(), [3, 4]);
        let merged: CudaSettings = overlay(&[&file.cuda, &cli]).unwrap();
        assert_eq!(merged.stage_devices(2).unwrap(), [3, 4]);
    }

    /// With nothing set, the backend runs with its defaults: what it ran with when no `TANDEM_CUDA_*`
    /// variable was set.
    #[cfg(feature = "cuda")]
    #[test]
    fn defaults_equal_the_old_environment_defaults() {
        let o = CudaSettings::default().options(tandem_cuda::CudaOptions::default());
        assert_eq!(o.attn, tandem_cuda::AttnMode::Fast);
        assert!(o.graphs && o.gemv && !o.pdl && !o.gemv_persistent);
        assert_eq!(o.device, 0);
        assert_eq!(o.gemv_max_rows, 1);
        assert_eq!(o.decode_partition_small, 64);
        assert_eq!(o.gemv_target_warps, 2048);
        assert_eq!((o.gemv_tuning.unroll, o.gemv_tuning.min_blocks), (2, 2));
        assert!(o.gemv_tuning.packed_mma);
        let engine = tandem_engine::EngineConfig::default();
        assert_eq!(
            (o.block_size, o.kv_cache_memory),
            (engine.block_size, engine.kv_cache_memory),
            "the KV defaults are the engine's, not a second set"
        );
        let all = flags(&[
            "--cuda-attention",
            "simple",
            "--no-cuda-gemv",
            "--cuda-gemv-unroll",
            "4",
            "--cuda-gemv-persistent",
            "--cuda-gemv-packed-simt",
        ])
        .unwrap()
        .options(tandem_cuda::CudaOptions::default());
        assert_eq!(all.attn, tandem_cuda::AttnMode::Simple);
        assert!(!all.gemv && all.gemv_persistent);
        assert_eq!(all.gemv_tuning.unroll, 4);
        assert!(!all.gemv_tuning.packed_mma);
    }
}
