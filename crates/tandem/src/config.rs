//! `tandem serve` settings: the YAML file schema, the CLI flags, and how flags override the file.
//!
//! `deployment.mode: colocated` (the default) runs one engine in this process and is resolved into
//! [`ServeSettings`]; `mode: pd` starts prefill and decode workers as child processes and is run by
//! `crate::launch` straight from the parsed [`FileConfig`].

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer};
use tandem_engine::EngineConfig;

use crate::cuda_settings::{CudaArgs, CudaSection};

/// The model served when none is named.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// How logs are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// A byte count written either as an integer or with a unit ("1GiB", "512MiB", "2GB", "4096").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl std::str::FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("`{s}` is not a size like 1GiB, 512MiB or 4096"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "kib" | "ki" => 1 << 10,
            "m" | "mb" => 1_000_000,
            "mib" | "mi" => 1 << 20,
            "g" | "gb" => 1_000_000_000,
            "gib" | "gi" => 1 << 30,
            "t" | "tb" => 1_000_000_000_000,
            "tib" | "ti" => 1 << 40,
            other => return Err(format!("unknown size unit `{other}` in `{s}`")),
        };
        let bytes = value * scale as f64;
        if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
            return Err(format!("size `{s}` is out of range"));
        }
        Ok(ByteSize(bytes as usize))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n as usize)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `server:` section.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    /// Address to listen on.
    pub host: Option<String>,
    /// Port to listen on.
    pub port: Option<u16>,
    /// Bearer token required on /v1 routes.
    pub api_key: Option<String>,
}

/// `engine:` section: the engine knobs, all optional (unset ones keep engine defaults).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// Tokens per KV block.
    pub block_size: Option<usize>,
    /// Memory for the KV cache ("1GiB" or bytes).
    pub kv_cache_memory: Option<ByteSize>,
    /// Running sequences per step.
    pub max_num_seqs: Option<usize>,
    /// Token budget per step.
    pub max_num_batched_tokens: Option<usize>,
    /// Split long prompts over several steps.
    pub enable_chunked_prefill: Option<bool>,
    /// Reuse KV of shared prompt prefixes.
    pub enable_prefix_caching: Option<bool>,
    /// Context length cap (defaults to the model's).
    pub max_model_len: Option<usize>,
    /// Waiting requests beyond which new ones get 503.
    pub max_waiting: Option<usize>,
    /// Compute threads (0 = all cores).
    pub threads: Option<usize>,
    /// Tensor-parallel ranks splitting every layer's heads and MLP (CPU: threads of one process).
    pub tensor_parallel_size: Option<usize>,
    /// Pipeline stages splitting the layers (CPU: stage 0 in the worker, the others in `tandem stage` processes).
    pub pipeline_parallel_size: Option<usize>,
    /// Micro-batches per step of a pipelined worker (0 = one per stage).
    pub pipeline_micro_batches: Option<usize>,
    /// Addresses (host:port) of already running stage servers 1.. (other hosts); unset = started locally.
    pub pipeline_stages: Option<Vec<String>>,
    /// Which backend runs the model.
    pub device: Option<Device>,
}

/// Where the model math runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The CPU backend (always built).
    #[default]
    Cpu,
    /// The CUDA backend (binaries built with `--features cuda`).
    Cuda,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        })
    }
}

/// How the server is deployed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeploymentMode {
    /// Prefill and decode in one engine (the only mode implemented).
    #[default]
    Colocated,
    /// Disaggregated prefill and decode workers behind this process as the ingress.
    Pd,
}

/// One worker role of a P/D deployment.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleSection {
    /// Number of workers of this role.
    pub replicas: Option<usize>,
    /// Engine knobs of these workers.
    pub engine: Option<EngineSection>,
}

/// `deployment:` section, shaped for the P/D work.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentSection {
    /// `colocated` or `pd`.
    #[serde(default)]
    pub mode: DeploymentMode,
    /// Prefill workers.
    pub prefill: Option<RoleSection>,
    /// Decode workers.
    pub decode: Option<RoleSection>,
    /// KV transfer settings.
    pub kv_transfer: Option<tandem_cluster::KvTransferConfig>,
    /// Routing policy knobs.
    pub routing: Option<tandem_cluster::RoutingConfig>,
    /// Ingress time limits.
    pub timeouts: Option<tandem_cluster::TimeoutConfig>,
}

/// The whole YAML document of `tandem serve --config`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// GGUF file or HF folder.
    pub model: Option<PathBuf>,
    /// Name clients use in `model`.
    pub served_model_name: Option<String>,
    /// Jinja chat template overriding the model's.
    pub chat_template: Option<PathBuf>,
    /// Log format.
    pub log_format: Option<LogFormat>,
    /// HTTP settings.
    #[serde(default)]
    pub server: ServerSection,
    /// Engine knobs.
    #[serde(default)]
    pub engine: EngineSection,
    /// Deployment shape.
    pub deployment: Option<DeploymentSection>,
    /// CUDA backend settings (`crate::cuda_settings`).
    #[serde(default)]
    pub cuda: CudaSection,
}

impl FileConfig {
    /// Parses a YAML document; unknown keys are errors that name the key.
    pub fn from_yaml(text: &str) -> Result<Self> {
        Ok(serde_yaml::from_str(text)?)
    }

    /// Reads and parses a YAML file.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_yaml(&text).with_context(|| format!("in config file {}", path.display()))
    }
}

/// The engine flags shared by `tandem serve` and `tandem worker`; each overrides the same `engine:` key.
#[derive(Clone, Debug, Default, Args)]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Memory for the KV cache, e.g. 1GiB, 512MiB or a byte count.
    #[arg(long)]
    pub kv_cache_memory: Option<ByteSize>,
    /// Running sequences per step.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget per step.
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Prefill whole prompts in one step.
    #[arg(long)]
    pub no_chunked_prefill: bool,
    /// Do not reuse KV of shared prompt prefixes.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Context length cap (default: the model's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Waiting requests beyond which new ones get 503.
    #[arg(long)]
    pub max_waiting: Option<usize>,
    /// Compute threads (0 = all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tensor-parallel ranks splitting every layer's heads and MLP columns (CPU: threads of one process).
    #[arg(long)]
    pub tensor_parallel_size: Option<usize>,
    /// Pipeline stages splitting the layers; stages 1.. run as `tandem stage` processes.
    #[arg(long)]
    pub pipeline_parallel_size: Option<usize>,
    /// Micro-batches per step of a pipelined engine (0 = one per stage).
    #[arg(long)]
    pub pipeline_micro_batches: Option<usize>,
    /// Running stage servers 1.. as host:port,host:port (multi-host); unset = start them on this host.
    #[arg(long, value_delimiter = ',')]
    pub pipeline_stages: Option<Vec<String>>,
    /// Backend: cpu, or cuda in binaries built with the `cuda` feature.
    #[arg(long, value_enum)]
    pub device: Option<Device>,
}

impl EngineArgs {
    /// The flags as an `engine:` section (unset flags stay unset), so they merge like the file's keys.
    pub fn as_section(&self) -> EngineSection {
        EngineSection {
            block_size: self.block_size,
            kv_cache_memory: self.kv_cache_memory,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_chunked_prefill: self.no_chunked_prefill.then_some(false),
            enable_prefix_caching: self.no_prefix_caching.then_some(false),
            max_model_len: self.max_model_len,
            max_waiting: self.max_waiting,
            threads: self.threads,
            tensor_parallel_size: self.tensor_parallel_size,
            pipeline_parallel_size: self.pipeline_parallel_size,
            pipeline_micro_batches: self.pipeline_micro_batches,
            pipeline_stages: self.pipeline_stages.clone(),
            device: self.device,
        }
    }

    /// Engine defaults with these flags applied.
    pub fn engine_config(&self) -> EngineConfig {
        let mut engine = EngineConfig::default();
        apply_engine(&self.as_section(), &mut engine);
        engine
    }
}

/// Flags of `tandem serve`; each one overrides the same setting of the config file.
#[derive(Clone, Debug, Default, Args)]
pub struct ServeArgs {
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched if missing).
    pub model: Option<PathBuf>,
    /// YAML file with the same settings; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// Name clients use in `model` [default: the model's file stem or folder name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Jinja chat template file overriding the model's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Engine knobs.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// CUDA backend flags.
    #[command(flatten)]
    pub cuda: CudaArgs,
}

/// The merged settings `tandem serve` runs with.
#[derive(Clone, Debug)]
pub struct ServeSettings {
    /// Model path; `None` means the default model.
    pub model: Option<PathBuf>,
    /// Name clients use in `model`, if overridden.
    pub served_model_name: Option<String>,
    /// Chat template override.
    pub chat_template: Option<PathBuf>,
    /// Listen address.
    pub host: String,
    /// Listen port.
    pub port: u16,
    /// Bearer token for /v1.
    pub api_key: Option<String>,
    /// Log format from the file (the CLI flag wins when given).
    pub log_format: Option<LogFormat>,
    /// Engine knobs.
    pub engine: EngineConfig,
    /// Backend the engine runs on.
    pub device: Device,
    /// CUDA backend settings: the file's `cuda:` section with the flags applied.
    pub cuda: CudaSection,
}

fn apply_engine(section: &EngineSection, engine: &mut EngineConfig) {
    if let Some(v) = section.block_size {
        engine.block_size = v;
    }
    if let Some(v) = section.kv_cache_memory {
        engine.kv_cache_bytes = v.0;
    }
    if let Some(v) = section.max_num_seqs {
        engine.max_num_seqs = v;
    }
    if let Some(v) = section.max_num_batched_tokens {
        engine.max_num_batched_tokens = v;
    }
    if let Some(v) = section.enable_chunked_prefill {
        engine.enable_chunked_prefill = v;
    }
    if let Some(v) = section.enable_prefix_caching {
        engine.enable_prefix_caching = v;
    }
    if let Some(v) = section.max_model_len {
        engine.max_model_len = Some(v);
    }
    if let Some(v) = section.max_waiting {
        engine.max_waiting = v;
    }
    if let Some(v) = section.threads {
        engine.threads = v;
    }
    if let Some(v) = section.tensor_parallel_size {
        engine.tensor_parallel_size = v;
    }
    if let Some(v) = section.pipeline_parallel_size {
        engine.pipeline_parallel_size = v;
    }
    if let Some(v) = section.pipeline_micro_batches {
        engine.pipeline_micro_batches = v;
    }
    if let Some(v) = &section.pipeline_stages {
        engine.pipeline_stages = v.clone();
    }
}

impl ServeSettings {
    /// Merges defaults, then the config file, then the flags.
    pub fn resolve(args: &ServeArgs, file: FileConfig) -> Result<Self> {
        if let Some(deployment) = &file.deployment {
            if deployment.mode != DeploymentMode::Colocated {
                bail!("deployment.mode `pd` is run by the P/D launcher, not as a single engine");
            }
            if deployment.prefill.is_some()
                || deployment.decode.is_some()
                || deployment.kv_transfer.is_some()
                || deployment.routing.is_some()
                || deployment.timeouts.is_some()
            {
                bail!("deployment.prefill, decode, kv_transfer, routing and timeouts only apply to `mode: pd`");
            }
        }
        let mut engine = EngineConfig::default();
        apply_engine(&file.engine, &mut engine);
        apply_engine(&args.engine.as_section(), &mut engine);
        Ok(Self {
            model: args.model.clone().or(file.model),
            served_model_name: args.served_model_name.clone().or(file.served_model_name),
            chat_template: args.chat_template.clone().or(file.chat_template),
            host: args
                .host
                .clone()
                .or(file.server.host)
                .unwrap_or_else(|| "127.0.0.1".to_owned()),
            port: args.port.or(file.server.port).unwrap_or(8000),
            api_key: args.api_key.clone().or(file.server.api_key),
            log_format: file.log_format,
            device: args
                .engine
                .device
                .or(file.engine.device)
                .unwrap_or_default(),
            engine,
            cuda: file.cuda.merged(&args.cuda.as_section()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_units() {
        assert_eq!("1GiB".parse::<ByteSize>().unwrap().0, 1 << 30);
        assert_eq!("512MiB".parse::<ByteSize>().unwrap().0, 512 << 20);
        assert_eq!("2GB".parse::<ByteSize>().unwrap().0, 2_000_000_000);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert_eq!("1.5 KiB".parse::<ByteSize>().unwrap().0, 1536);
        assert!("lots".parse::<ByteSize>().is_err());
        assert!("1XB".parse::<ByteSize>().is_err());
        assert!("0".parse::<ByteSize>().is_err());
    }

    #[test]
    fn full_document_parses_and_flags_override() {
        let file = FileConfig::from_yaml(
            "model: m.gguf\nserved_model_name: smol\nserver: {host: 0.0.0.0, port: 9000, api_key: k}\n\
             engine: {block_size: 32, kv_cache_memory: 256MiB, max_num_seqs: 8, enable_prefix_caching: false}\n\
             deployment: {mode: colocated}\n",
        )
        .unwrap();
        let args = ServeArgs {
            port: Some(9100),
            engine: EngineArgs {
                max_num_seqs: Some(4),
                ..EngineArgs::default()
            },
            ..ServeArgs::default()
        };
        let s = ServeSettings::resolve(&args, file).unwrap();
        assert_eq!(s.model, Some(PathBuf::from("m.gguf")));
        assert_eq!(s.served_model_name.as_deref(), Some("smol"));
        assert_eq!(s.host, "0.0.0.0");
        assert_eq!(s.port, 9100);
        assert_eq!(s.api_key.as_deref(), Some("k"));
        assert_eq!(s.engine.block_size, 32);
        assert_eq!(s.engine.kv_cache_bytes, 256 << 20);
        assert_eq!(s.engine.max_num_seqs, 4);
        assert!(!s.engine.enable_prefix_caching);
    }

    #[test]
    fn defaults_without_file() {
        let s = ServeSettings::resolve(&ServeArgs::default(), FileConfig::default()).unwrap();
        assert_eq!(s.host, "127.0.0.1");
        assert_eq!(s.port, 8000);
        assert_eq!(s.model, None);
        let d = EngineConfig::default();
        assert_eq!(s.engine.block_size, d.block_size);
        let args = ServeArgs {
            engine: EngineArgs {
                no_chunked_prefill: true,
                ..EngineArgs::default()
            },
            ..ServeArgs::default()
        };
        assert!(
            !ServeSettings::resolve(&args, FileConfig::default())
                .unwrap()
                .engine
                .enable_chunked_prefill
        );
    }

    #[test]
    fn device_comes_from_the_file_and_the_flag_wins() {
        let file = FileConfig::from_yaml("engine: {device: cuda}\n").unwrap();
        let s = ServeSettings::resolve(&ServeArgs::default(), file.clone()).unwrap();
        assert_eq!(s.device, Device::Cuda);
        let args = ServeArgs {
            engine: EngineArgs {
                device: Some(Device::Cpu),
                ..EngineArgs::default()
            },
            ..ServeArgs::default()
        };
        assert_eq!(
            ServeSettings::resolve(&args, file).unwrap().device,
            Device::Cpu
        );
        let default = ServeSettings::resolve(&ServeArgs::default(), FileConfig::default()).unwrap();
        assert_eq!(default.device, Device::Cpu);
        assert!(FileConfig::from_yaml("engine: {device: tpu}\n").is_err());
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = FileConfig::from_yaml("server: {hots: x}\n").unwrap_err();
        assert!(format!("{err:#}").contains("hots"), "{err:#}");
        let err = FileConfig::from_yaml("engine: {blok_size: 3}\n").unwrap_err();
        assert!(format!("{err:#}").contains("blok_size"), "{err:#}");
        let err = FileConfig::from_yaml("modle: x\n").unwrap_err();
        assert!(format!("{err:#}").contains("modle"), "{err:#}");
    }

    #[test]
    fn pd_sections_parse_typed_and_stay_out_of_colocated() {
        let file = FileConfig::from_yaml(
            "deployment:\n  mode: pd\n  prefill: {replicas: 1}\n  decode: {replicas: 2, engine: {block_size: 16}}\n  \
             kv_transfer: {transport: shm, streams: 2}\n  routing: {local_prefill_threshold: 64}\n  \
             timeouts: {prefill_secs: 5}\n",
        )
        .unwrap();
        let d = file.deployment.clone().unwrap();
        assert_eq!(d.mode, DeploymentMode::Pd);
        assert_eq!(d.decode.unwrap().replicas, Some(2));
        let kv = d.kv_transfer.unwrap();
        assert_eq!(
            (kv.transport, kv.streams),
            (tandem_cluster::TransportKind::Shm, 2)
        );
        assert_eq!(d.routing.unwrap().local_prefill_threshold, 64);
        assert_eq!(d.timeouts.unwrap().prefill_secs, 5.0);
        let err = ServeSettings::resolve(&ServeArgs::default(), file).unwrap_err();
        assert!(err.to_string().contains("P/D launcher"), "{err}");
        let err = FileConfig::from_yaml("deployment: {mode: pd, kv_transfer: {transprot: tcp}}\n")
            .unwrap_err();
        assert!(format!("{err:#}").contains("transprot"), "{err:#}");
        let colocated =
            FileConfig::from_yaml("deployment: {routing: {prefill_load_bound: 1}}\n").unwrap();
        assert!(ServeSettings::resolve(&ServeArgs::default(), colocated).is_err());
        assert!(FileConfig::from_yaml("deployment: {mode: sideways}\n").is_err());
    }

    #[test]
    fn shipped_examples_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        for name in [
            "pd.yaml",
            "pd-2p1d.yaml",
            "colocated.yaml",
            "pd-parallel.yaml",
        ] {
            let file = FileConfig::load(&dir.join(name)).unwrap();
            let mode = file.deployment.as_ref().map(|d| d.mode).unwrap_or_default();
            assert_eq!(mode == DeploymentMode::Pd, name.starts_with("pd"), "{name}");
        }
    }
}
