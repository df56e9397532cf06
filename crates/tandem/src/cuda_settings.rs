//! The CUDA backend's settings: the `cuda:` section of the YAML file and the `--cuda-*` flags.
//!
//! The section parses and validates in every binary (a config file is portable between CPU and CUDA
//! builds); only binaries built with the `cuda` feature turn it into `tandem_cuda::CudaOptions`. The
//! settings an operator sets (device ordinal, attention kernels, graphs, GEMV) are YAML keys and visible
//! flags; the GEMV tuning knobs that only the GPU scripts sweep (`scripts/gpu/run.sh`) are hidden flags
//! and not YAML keys.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer};

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

/// `cuda:` section (and, merged with the flags, the resolved settings): unset keys keep the backend's
/// defaults. The tuning fields are skipped by serde, so in a file they are unknown keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CudaSection {
    /// CUDA device ordinal.
    pub device: Option<usize>,
    /// Device ordinal of each pipeline stage a worker starts, stage 0 first (unset: all on `device`).
    pub pipeline_devices: Option<Vec<usize>>,
    /// Attention kernels.
    pub attention: Option<CudaAttention>,
    /// Capture CUDA graphs for decode-only steps.
    pub graphs: Option<bool>,
    /// Our GEMV kernels for steps of few rows (false: cuBLAS for every projection).
    pub gemv: Option<bool>,
    /// Most rows (tokens of a step) our GEMV kernels take, 0 to 8.
    #[serde(default, deserialize_with = "gemv_max_rows")]
    pub gemv_max_rows: Option<usize>,
    /// Programmatic dependent launch (hidden flag only).
    #[serde(skip)]
    pub pdl: Option<bool>,
    /// Keys per decode-attention partition of small batches, 1 to 64 (hidden flag only).
    #[serde(skip)]
    pub decode_partition_small: Option<usize>,
    /// Warps a small-batch GEMV launch aims for through split-K (hidden flag only).
    #[serde(skip)]
    pub gemv_target_warps: Option<usize>,
    /// 16-byte chunks per row a GEMV lane loads per step (`GV_U`; hidden flag only).
    #[serde(skip)]
    pub gemv_unroll: Option<usize>,
    /// Blocks per multiprocessor the GEMV kernels must fit (`GV_MINB`; hidden flag only).
    #[serde(skip)]
    pub gemv_min_blocks: Option<usize>,
    /// Persistent GEMV launches (hidden flag only).
    #[serde(skip)]
    pub gemv_persistent: Option<bool>,
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

fn parse_positive(key: &'static str) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| ranged(s, key, 1, usize::MAX)
}

/// The `--cuda-*` flags of every command that can run the CUDA backend; each overrides the same
/// `cuda:` key.
#[derive(Clone, Debug, Default, Args)]
pub struct CudaArgs {
    /// CUDA device ordinal (--device cuda).
    #[arg(long)]
    pub cuda_device: Option<usize>,
    /// CUDA device ordinal of each pipeline stage, stage 0 first, as 0,1,... (unset: all on --cuda-device).
    #[arg(long, value_delimiter = ',')]
    pub cuda_pipeline_devices: Option<Vec<usize>>,
    /// CUDA attention kernels: fast, or the simple reference kernel (on-device checks).
    #[arg(long, value_enum)]
    pub cuda_attention: Option<CudaAttention>,
    /// Run CUDA decode steps without captured graphs (one launch per kernel; profiling).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Run every CUDA projection on cuBLAS instead of our small-batch GEMV kernels.
    #[arg(long)]
    pub no_cuda_gemv: bool,
    /// Most rows (tokens of a step) the CUDA GEMV kernels take, 0 to 8 [default: 1].
    #[arg(long, value_parser = parse_gemv_max_rows)]
    pub cuda_gemv_max_rows: Option<usize>,
    /// Programmatic dependent launch of the kernels that support it (A/B timings).
    #[arg(long, hide = true)]
    pub cuda_pdl: bool,
    /// Keys per decode-attention partition of small batches, 1 to 64 (A/B timings).
    #[arg(long, hide = true, value_parser = parse_decode_partition)]
    pub cuda_decode_partition_small: Option<usize>,
    /// Warps a small-batch GEMV launch aims for through split-K (A/B timings).
    #[arg(long, hide = true, value_parser = parse_positive("gemv_target_warps"))]
    pub cuda_gemv_target_warps: Option<usize>,
    /// 16-byte chunks per row a GEMV lane loads per step, compiled in (A/B timings).
    #[arg(long, hide = true, value_parser = parse_positive("gemv_unroll"))]
    pub cuda_gemv_unroll: Option<usize>,
    /// Blocks per multiprocessor the GEMV kernels must fit, compiled in (A/B timings).
    #[arg(long, hide = true, value_parser = parse_positive("gemv_min_blocks"))]
    pub cuda_gemv_min_blocks: Option<usize>,
    /// Persistent GEMV launches: a grid of the blocks the GPU holds at once (A/B timings).
    #[arg(long, hide = true)]
    pub cuda_gemv_persistent: bool,
}

impl CudaArgs {
    /// The flags as a `cuda:` section (unset flags stay unset), so they merge like the file's keys.
    pub fn as_section(&self) -> CudaSection {
        CudaSection {
            device: self.cuda_device,
            pipeline_devices: self.cuda_pipeline_devices.clone(),
            attention: self.cuda_attention,
            graphs: self.no_cuda_graphs.then_some(false),
            gemv: self.no_cuda_gemv.then_some(false),
            gemv_max_rows: self.cuda_gemv_max_rows,
            pdl: self.cuda_pdl.then_some(true),
            decode_partition_small: self.cuda_decode_partition_small,
            gemv_target_warps: self.cuda_gemv_target_warps,
            gemv_unroll: self.cuda_gemv_unroll,
            gemv_min_blocks: self.cuda_gemv_min_blocks,
            gemv_persistent: self.cuda_gemv_persistent.then_some(true),
        }
    }
}

impl CudaSection {
    /// These settings with every key `over` sets replacing ours (the file, then the flags).
    pub fn merged(&self, over: &CudaSection) -> CudaSection {
        let mut m = self.clone();
        if over.pipeline_devices.is_some() {
            m.pipeline_devices.clone_from(&over.pipeline_devices);
        }
        macro_rules! take {
            ($($f:ident),*) => { $( if over.$f.is_some() { m.$f = over.$f; } )* };
        }
        take!(
            device,
            attention,
            graphs,
            gemv,
            gemv_max_rows,
            pdl,
            decode_partition_small,
            gemv_target_warps,
            gemv_unroll,
            gemv_min_blocks,
            gemv_persistent
        );
        m
    }

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

    /// The flags that give a stage process these settings on GPU `device` (`tandem stage`).
    pub fn stage_flags(&self, device: usize) -> Vec<String> {
        let mut f = vec!["--cuda-device".to_string(), device.to_string()];
        if let Some(a) = self.attention {
            f.extend(["--cuda-attention".to_string(), a.to_string()]);
        }
        if self.graphs == Some(false) {
            f.push("--no-cuda-graphs".into());
        }
        if self.gemv == Some(false) {
            f.push("--no-cuda-gemv".into());
        }
        if let Some(n) = self.gemv_max_rows {
            f.extend(["--cuda-gemv-max-rows".to_string(), n.to_string()]);
        }
        f
    }

    /// `base` (the sizes the caller derived from the engine settings) with every key set here applied.
    #[cfg(feature = "cuda")]
    pub fn options(&self, base: tandem_cuda::CudaOptions) -> tandem_cuda::CudaOptions {
        let mut o = base;
        o.kernel_cache_dir = kernel_cache_dir();
        if let Some(v) = self.device {
            o.device = v;
        }
        if let Some(v) = self.attention {
            o.attn = match v {
                CudaAttention::Fast => tandem_cuda::AttnMode::Fast,
                CudaAttention::Simple => tandem_cuda::AttnMode::Simple,
            };
        }
        if let Some(v) = self.graphs {
            o.graphs = v;
        }
        if let Some(v) = self.gemv {
            o.gemv = v;
        }
        if let Some(v) = self.gemv_max_rows {
            o.gemv_max_rows = v;
        }
        if let Some(v) = self.pdl {
            o.pdl = v;
        }
        if let Some(v) = self.decode_partition_small {
            o.decode_partition_small = v;
        }
        if let Some(v) = self.gemv_target_warps {
            o.gemv_target_warps = v;
        }
        if let Some(v) = self.gemv_unroll {
            o.gemv_tuning.unroll = v;
        }
        if let Some(v) = self.gemv_min_blocks {
            o.gemv_tuning.min_blocks = v;
        }
        if let Some(v) = self.gemv_persistent {
            o.gemv_persistent = v;
        }
        o
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
    use crate::config::Settings as FileConfig;

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        cuda: CudaArgs,
    }

    fn flags(args: &[&str]) -> Result<CudaSection, clap::Error> {
        let argv = std::iter::once("tandem").chain(args.iter().copied());
        Ok(<Flags as clap::Parser>::try_parse_from(argv)?
            .cuda
            .as_section())
    }

    #[test]
    fn the_cuda_section_parses_typed() {
        let file = FileConfig::from_yaml(
            "cuda: {device: 1, attention: simple, graphs: false, gemv: false, gemv_max_rows: 8}\n",
        )
        .unwrap();
        assert_eq!(
            file.cuda,
            CudaSection {
                device: Some(1),
                attention: Some(CudaAttention::Simple),
                graphs: Some(false),
                gemv: Some(false),
                gemv_max_rows: Some(8),
                ..CudaSection::default()
            }
        );
        assert_eq!(FileConfig::default().cuda, CudaSection::default());
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
        for key in ["gemv_rows", "pdl", "gemv_persistent"] {
            let err = FileConfig::from_yaml(&format!("cuda: {{{key}: 1}}\n")).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{err:#}");
        }
    }

    #[test]
    fn flags_override_the_file_and_travel_to_workers() {
        let file = FileConfig::from_yaml("cuda: {device: 1, gemv_max_rows: 2}\n").unwrap();
        let cli = flags(&[
            "--cuda-gemv-max-rows",
            "4",
            "--no-cuda-graphs",
            "--cuda-pdl",
        ])
        .unwrap();
        let merged = file.cuda.merged(&cli);
        assert_eq!(merged.device, Some(1));
        assert_eq!(merged.gemv_max_rows, Some(4));
        assert_eq!(merged.graphs, Some(false));
        assert_eq!(merged.pdl, Some(true));
        // Workers get the section in their JSON settings document: every file key travels; the
        // hidden tuning flags are per process (given to the worker's own command line).
        let doc = serde_json::to_string(&merged).unwrap();
        let travelled: CudaSection = serde_json::from_str(&doc).unwrap();
        assert_eq!(
            travelled,
            CudaSection {
                pdl: None,
                ..merged
            }
        );
        assert_eq!(flags(&[]).unwrap(), CudaSection::default());
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
        assert_eq!(file.cuda.merged(&cli).stage_devices(2).unwrap(), [3, 4]);
        // A stage process's flags give it the worker's settings on its own device.
        let worker = flags(&[
            "--cuda-attention",
            "simple",
            "--no-cuda-graphs",
            "--cuda-gemv-max-rows",
            "2",
        ])
        .unwrap();
        let f = worker.stage_flags(5);
        let refs: Vec<&str> = f.iter().map(String::as_str).collect();
        assert_eq!(
            flags(&refs).unwrap(),
            CudaSection {
                device: Some(5),
                ..worker
            }
        );
    }

    /// With nothing set, the backend runs with its defaults: what it ran with when no `TANDEM_CUDA_*`
    /// variable was set.
    #[cfg(feature = "cuda")]
    #[test]
    fn defaults_equal_the_old_environment_defaults() {
        let o = CudaSection::default().options(tandem_cuda::CudaOptions::default());
        assert_eq!(o.attn, tandem_cuda::AttnMode::Fast);
        assert!(o.graphs && o.gemv && !o.pdl && !o.gemv_persistent);
        assert_eq!(o.device, 0);
        assert_eq!(o.gemv_max_rows, 1);
        assert_eq!(o.decode_partition_small, 64);
        assert_eq!(o.gemv_target_warps, 2048);
        assert_eq!((o.gemv_tuning.unroll, o.gemv_tuning.min_blocks), (2, 2));
        let all = flags(&[
            "--cuda-attention",
            "simple",
            "--no-cuda-gemv",
            "--cuda-gemv-unroll",
            "4",
            "--cuda-gemv-persistent",
        ])
        .unwrap()
        .options(tandem_cuda::CudaOptions::default());
        assert_eq!(all.attn, tandem_cuda::AttnMode::Simple);
        assert!(!all.gemv && all.gemv_persistent);
        assert_eq!(all.gemv_tuning.unroll, 4);
    }
}
