//! The settings of `tandem serve`, `tandem chat --local` and `tandem worker`: one type per concern
//! ([`ServerSettings`], [`EngineSettings`], [`DeploymentSettings`], composed in [`Settings`]), each field
//! declared once. The same types are the YAML schema (unknown keys are errors that name the key), the
//! command-line flags (clap: each flag overrides the same key), and the document a launcher hands its
//! children (JSON). Layers merge with [`overlay`]: a later layer's set values win, section by section.
//!
//! A new section is one more type deriving `Deserialize` + `Serialize` (and `clap::Args` when it has
//! flags) and one more field of [`Settings`].
//!
//! `deployment.mode: colocated` (the default) runs one engine in this process ([`Settings::colocated`]);
//! `mode: pd` starts prefill and decode workers as child processes and is run by `crate::launch`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use tandem_engine::EngineConfig;

use crate::cuda_settings::CudaSection;

/// The model served when none is named.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// How logs are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
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

/// The largest binary unit that divides the count exactly ("1GiB", "1536MiB", "4096"), so it parses back
/// to the same count: clap shows defaults this way.
impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        match units
            .iter()
            .find(|(shift, _)| self.0 > 0 && self.0.is_multiple_of(1usize << shift))
        {
            Some((shift, unit)) => write!(f, "{}{unit}", self.0 >> shift),
            None => write!(f, "{}", self.0),
        }
    }
}

/// Written as the byte count, which reads back exactly.
impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u64(self.0 as u64)
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

/// `server:` section, and the flags of `tandem serve` that override it.
#[derive(Clone, Debug, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on /v1 routes, /tokenize and /detokenize.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body, e.g. 8MiB [default: 8MiB]; a larger one gets 413.
    #[arg(long)]
    pub max_body_bytes: Option<ByteSize>,
    /// Require the API key on /health and /metrics too, for servers whose state should not be public
    /// (needs `api_key`; probes then send it: `tandem probe --api-key`) [default: false].
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub probes_need_key: Option<bool>,
    /// Read timeouts and the connection limit of this listener (keys of `server:` itself).
    #[command(flatten)]
    #[serde(flatten)]
    pub listen: ListenSettings,
}

/// The limits of one HTTP listener against slow or numerous clients: keys of the `server:` section, and
/// of a worker's settings for its RPC listener (the launcher hands its workers the head's).
#[derive(Clone, Debug, Default, PartialEq, Args, Deserialize, Serialize)]
pub struct ListenSettings {
    /// Seconds a connection has to send a complete request header (also the keep-alive idle limit) [default: 10].
    #[arg(long)]
    pub header_read_timeout_secs: Option<f64>,
    /// Seconds a request has, after its header, to send its whole body; else 408 [default: 30].
    #[arg(long)]
    pub body_read_timeout_secs: Option<f64>,
    /// Connections open at once; one more is answered 503 and closed [default: 1024].
    #[arg(long)]
    pub max_connections: Option<usize>,
}

impl ServerSettings {
    /// Checks what parsing cannot: the listener's limits, and that closed probes have a key to open them.
    pub fn validate(&self) -> Result<()> {
        self.listen.validate()?;
        if self.probes_need_key == Some(true) && self.api_key.is_none() {
            return Err(bad_value(
                "server.probes_need_key",
                "needs server.api_key (the key /health and /metrics would ask for)",
            ));
        }
        Ok(())
    }
}

impl ListenSettings {
    /// The limits these settings give, defaults where unset.
    pub fn limits(&self) -> tandem_api::ServeLimits {
        let default = tandem_api::ServeLimits::default();
        let secs = |v: Option<f64>, d: std::time::Duration| {
            v.map_or(d, std::time::Duration::from_secs_f64)
        };
        tandem_api::ServeLimits {
            header_read_timeout: secs(self.header_read_timeout_secs, default.header_read_timeout),
            body_read_timeout: secs(self.body_read_timeout_secs, default.body_read_timeout),
            max_connections: self.max_connections.unwrap_or(default.max_connections),
        }
    }

    /// Checks the values parsing cannot (positive, finite), naming the key of a bad one.
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                    return Err(bad_value(
                        format!("server.{key}"),
                        format!("must be a number of seconds in (0, 86400], not {v}"),
                    ));
                }
            }
        }
        if self.max_connections == Some(0) {
            return Err(bad_value("server.max_connections", "must be at least 1"));
        }
        Ok(())
    }
}

/// `engine:` section (and a role's `engine:`), and the engine flags shared by `tandem serve`, `tandem
/// chat --local` and `tandem worker`: all optional, unset ones keep engine defaults.
#[derive(Clone, Debug, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSettings {
    /// Tokens per KV block (default 16).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Memory for the KV cache, e.g. 1GiB, 512MiB or a byte count (default 1GiB).
    #[arg(long)]
    pub kv_cache_memory: Option<ByteSize>,
    /// Running sequences per step (default 64).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget per step (default 512).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Split long prompts over several steps (flag `--no-chunked-prefill` sets false).
    #[arg(
        long = "no-chunked-prefill",
        num_args = 0,
        default_missing_value = "false",
        help = "Prefill whole prompts in one step"
    )]
    pub enable_chunked_prefill: Option<bool>,
    /// Reuse KV of shared prompt prefixes (flag `--no-prefix-caching` sets false).
    #[arg(
        long = "no-prefix-caching",
        num_args = 0,
        default_missing_value = "false",
        help = "Do not reuse KV of shared prompt prefixes"
    )]
    pub enable_prefix_caching: Option<bool>,
    /// Context length cap (default: the model's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Waiting requests beyond which new ones get 503 (default 1024).
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

impl EngineSettings {
    /// Engine defaults with these settings applied.
    pub fn engine_config(&self) -> EngineConfig {
        let mut engine = EngineConfig::default();
        if let Some(v) = self.block_size {
            engine.block_size = v;
        }
        if let Some(v) = self.kv_cache_memory {
            engine.kv_cache_bytes = v.0;
        }
        if let Some(v) = self.max_num_seqs {
            engine.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            engine.max_num_batched_tokens = v;
        }
        if let Some(v) = self.enable_chunked_prefill {
            engine.enable_chunked_prefill = v;
        }
        if let Some(v) = self.enable_prefix_caching {
            engine.enable_prefix_caching = v;
        }
        if let Some(v) = self.max_model_len {
            engine.max_model_len = Some(v);
        }
        if let Some(v) = self.max_waiting {
            engine.max_waiting = v;
        }
        if let Some(v) = self.threads {
            engine.threads = v;
        }
        if let Some(v) = self.tensor_parallel_size {
            engine.tensor_parallel_size = v;
        }
        if let Some(v) = self.pipeline_parallel_size {
            engine.pipeline_parallel_size = v;
        }
        if let Some(v) = self.pipeline_micro_batches {
            engine.pipeline_micro_batches = v;
        }
        if let Some(v) = &self.pipeline_stages {
            engine.pipeline_stages = v.clone();
        }
        engine
    }
}

/// Where the model math runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeploymentMode {
    /// Prefill and decode in one engine (the only mode implemented).
    #[default]
    Colocated,
    /// Disaggregated prefill and decode workers behind this process as the ingress.
    Pd,
}

/// One worker role of a P/D deployment.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RoleSettings {
    /// Number of workers of this role.
    pub replicas: Option<usize>,
    /// Engine knobs of these workers.
    pub engine: Option<EngineSettings>,
    /// Percent of the GPU's SMs each of these workers may use when the GPU runs an NVIDIA MPS server
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in their environment; without MPS it has no effect): on a GPU
    /// that prefill and decode workers share, prefill held below 100 leaves decode SMs of its own.
    pub mps_thread_percentage: Option<u32>,
    /// The GPU ordinal of each of these workers, one per replica (`[1]`: decode on GPU 1 while prefill
    /// keeps GPU 0); unset, every worker of the role runs on `cuda.device`.
    pub cuda_devices: Option<Vec<usize>>,
}

/// `deployment:` section, shaped for the P/D work (YAML only).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentSettings {
    /// `colocated` or `pd`.
    #[serde(default)]
    pub mode: DeploymentMode,
    /// Prefill workers.
    pub prefill: Option<RoleSettings>,
    /// Decode workers.
    pub decode: Option<RoleSettings>,
    /// KV transfer settings.
    pub kv_transfer: Option<tandem_cluster::KvTransferConfig>,
    /// Routing policy knobs.
    pub routing: Option<tandem_cluster::RoutingConfig>,
    /// Ingress time limits.
    pub timeouts: Option<tandem_cluster::TimeoutConfig>,
    /// How workers started elsewhere are found: `static` (they register themselves) or `dns` (a name per role).
    pub discovery: Option<tandem_cluster::DiscoveryConfig>,
    /// The cluster secret workers, KV peers and stages must prove (else `TANDEM_CLUSTER_TOKEN`); unset
    /// everywhere, the worker, KV and stage ports answer anyone who reaches them.
    pub cluster_token: Option<String>,
    /// A file holding the cluster secret (a mounted secret), instead of `cluster_token`.
    pub cluster_token_file: Option<PathBuf>,
}

impl DeploymentSettings {
    /// The cluster token this deployment's config gives (value, file, else the environment).
    pub fn cluster_token(&self) -> Result<Option<String>> {
        crate::token::resolve(
            self.cluster_token.as_deref(),
            self.cluster_token_file.as_deref(),
        )
    }

    /// Checks what parsing cannot (discovery names, intervals), naming the key of a bad value.
    pub fn validate(&self) -> Result<()> {
        if self.cluster_token.is_some() && self.cluster_token_file.is_some() {
            return Err(bad_value(
                "deployment.cluster_token_file",
                "and deployment.cluster_token are both set: set one",
            ));
        }
        if let Some(discovery) = &self.discovery {
            discovery.validate().map_err(|e| match e {
                tandem_cluster::ClusterError::BadConfig { key, message } => {
                    bad_value(format!("deployment.{key}"), format!("is wrong: {message}"))
                }
                other => anyhow::anyhow!("deployment.{other}"),
            })?;
        }
        for (role, section) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if let Some(p) = section.as_ref().and_then(|r| r.mps_thread_percentage) {
                if !(1..=100).contains(&p) {
                    return Err(bad_value(
                        format!("deployment.{role}.mps_thread_percentage"),
                        format!("is {p}: give a percent from 1 to 100"),
                    ));
                }
            }
            if let Some(role_settings) = section {
                if let Some(devices) = &role_settings.cuda_devices {
                    let replicas = role_settings.replicas.unwrap_or(1);
                    if devices.len() != replicas {
                        return Err(bad_value(
                            format!("deployment.{role}.cuda_devices"),
                            format!(
                                "lists {} GPUs for {replicas} replicas: give one ordinal per replica",
                                devices.len()
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Every section and replica count set, to its default where the file left it out.
    fn fill_defaults(&mut self) {
        for role in [&mut self.prefill, &mut self.decode] {
            role.get_or_insert_with(RoleSettings::default)
                .replicas
                .get_or_insert(1);
        }
        self.kv_transfer.get_or_insert_with(Default::default);
        self.routing.get_or_insert_with(Default::default);
        self.timeouts.get_or_insert_with(Default::default);
        self.discovery.get_or_insert_with(Default::default);
    }
}

/// The whole YAML document of `tandem serve --config`, and the flags of `tandem serve` that override it.
#[derive(Clone, Debug, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched if missing).
    pub model: Option<PathBuf>,
    /// HTTP settings.
    #[command(flatten)]
    #[serde(default)]
    pub server: ServerSettings,
    /// Name clients use in `model` [default: the model's file stem or folder name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Jinja chat template file overriding the model's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Log format (the global `--log-format` flag wins).
    #[arg(skip)]
    pub log_format: Option<LogFormat>,
    /// Engine knobs.
    #[command(flatten)]
    #[serde(default)]
    pub engine: EngineSettings,
    /// CUDA backend settings (YAML `cuda:`; the `--cuda-*` flags are merged over them by each command).
    #[arg(skip)]
    #[serde(default)]
    pub cuda: crate::cuda_settings::CudaSection,
    /// Deployment shape (YAML only).
    #[arg(skip)]
    pub deployment: Option<DeploymentSettings>,
}

impl Settings {
    /// Parses a YAML document; every unknown key and bad value is reported at once, by its full path
    /// (`parse_settings`).
    pub fn from_yaml(text: &str) -> Result<Self> {
        parse_settings(text)
    }

    /// Reads and parses a YAML file; one with no setting at all (empty, or only comments) is refused,
    /// since serving every default from a file named on purpose is almost always a wrong path.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if serde_yaml::from_str::<serde_yaml::Value>(&text).is_ok_and(|v| v.is_null()) {
            bail!(
                "config file {} holds no settings; name a config with settings, or leave --config out to serve the defaults",
                path.display()
            );
        }
        let settings = Self::from_yaml(&text)
            .and_then(|s| {
                // The checks `resolved` makes again after the flags, here so a bad value gets its line.
                s.server.validate()?;
                if let Some(d) = &s.deployment {
                    d.validate()?;
                }
                Ok(s)
            })
            .map_err(|e| with_line(&text, e))
            .with_context(|| format!("in config file {}", path.display()))?;
        Ok(settings)
    }

    /// The settings of one colocated engine: the file, then the flags over it (a `pd` deployment is the
    /// launcher's, and its sections are refused here).
    pub fn colocated(flags: &Settings, file: Settings) -> Result<Self> {
        if let Some(deployment) = &file.deployment {
            if deployment.mode != DeploymentMode::Colocated {
                bail!("deployment.mode `pd` is run by the P/D launcher, not as a single engine");
            }
            if deployment.prefill.is_some()
                || deployment.decode.is_some()
                || deployment.kv_transfer.is_some()
                || deployment.routing.is_some()
                || deployment.timeouts.is_some()
                || deployment.discovery.is_some()
            {
                bail!("deployment.prefill, decode, kv_transfer, routing, timeouts and discovery only apply to `mode: pd`");
            }
        }
        let settings: Settings = overlay(&[&file, flags])?;
        settings.server.validate()?;
        Ok(settings)
    }

    /// Listen address.
    pub fn host(&self) -> String {
        self.server
            .host
            .clone()
            .unwrap_or_else(|| "127.0.0.1".to_owned())
    }

    /// Listen port.
    pub fn port(&self) -> u16 {
        self.server.port.unwrap_or(8000)
    }

    /// Largest request body the API reads.
    pub fn max_body_bytes(&self) -> usize {
        self.server
            .max_body_bytes
            .map_or(tandem_api::DEFAULT_MAX_BODY_BYTES, |b| b.0)
    }

    /// Whether /health and /metrics ask for the API key.
    pub fn probes_need_key(&self) -> bool {
        self.server.probes_need_key.unwrap_or(false)
    }

    /// Backend the engine runs on.
    pub fn device(&self) -> Device {
        self.engine.device.unwrap_or_default()
    }
}

/// Most problems one parse reports; past them the file is likely not a tandem config at all.
const MAX_PROBLEMS: usize = 20;

/// Parses a YAML settings document, reporting every problem at once rather than the first: each unknown
/// key by its full path with the closest known key at that place (`server.prot: unknown key, did you
/// mean `port`?`), each bad value by its full path; each with its line and column in `text` (`line 2,
/// column 3: engine.blok_size: ...`). Syntax errors keep serde_yaml's line and column.
///
/// serde stops at the first error, so the document is parsed as a tree, deserialized with
/// `serde_path_to_error` (which knows the path), and each offending key is taken out of the tree before
/// the next try; the known keys come from serde's own `expected one of` list, so no second schema exists.
pub fn parse_settings<T: DeserializeOwned + Serialize + Default>(text: &str) -> Result<T> {
    // Every key of every section at its default (unset fields are written as null): the known keys
    // where serde's message lists none (a section with a flattened part, like `server:`).
    let schema = serde_json::to_value(T::default()).unwrap_or(Value::Null);
    let mut doc: Value = serde_yaml::from_str(text)?;
    if doc.is_null() {
        // An empty file, like `{}`: every setting at its default.
        doc = Value::Object(serde_json::Map::new());
    }
    let mut problems = Vec::new();
    loop {
        let err = match serde_path_to_error::deserialize::<_, T>(&doc) {
            Ok(settings) if problems.is_empty() => return Ok(settings),
            Ok(_) => break,
            Err(err) => err,
        };
        let path: Vec<String> = err
            .path()
            .iter()
            .filter_map(|segment| match segment {
                serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                _ => None,
            })
            .collect();
        let message = err.inner().to_string();
        let removed = match unknown_field(&message) {
            Some((key, expected)) => {
                // serde_path_to_error's path ends at the unknown key itself.
                let mut full = path.clone();
                if full.last() != Some(&key) {
                    full.push(key.clone());
                }
                let expected = if expected.is_empty() {
                    keys_at(&schema, &path)
                } else {
                    expected
                };
                let suggestion = closest(&key, &expected)
                    .map(|k| format!(", did you mean `{k}`?"))
                    .unwrap_or_default();
                let at = located(text, &full, Node::Key);
                problems.push(format!("{at}{}: unknown key{suggestion}", full.join(".")));
                remove_key(&mut doc, &full)
            }
            None => {
                let at = if path.is_empty() {
                    "(top level)".to_owned()
                } else {
                    format!("{}{}", located(text, &path, Node::Value), path.join("."))
                };
                problems.push(format!("{at}: {message}"));
                remove_key(&mut doc, &path)
            }
        };
        // An error the tree cannot be freed of (inside a flattened section, or at the top) ends the search.
        if !removed || problems.len() >= MAX_PROBLEMS {
            break;
        }
    }
    let count = problems.len();
    bail!(
        "{count} problem{} in the settings:\n  {}",
        if count == 1 { "" } else { "s" },
        problems.join("\n  ")
    )
}

/// A value parsing accepted and a check refused, by the full path of its key, so that a config file's
/// error can say where the key stands (`Settings::load`).
#[derive(Debug)]
pub struct BadValue {
    /// The full key path, e.g. `server.max_connections`.
    pub key: String,
    /// What is wrong, continuing the sentence after the key.
    pub message: String,
}

impl std::fmt::Display for BadValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.key, self.message)
    }
}

impl std::error::Error for BadValue {}

/// A [`BadValue`] error.
fn bad_value(key: impl Into<String>, message: impl Into<String>) -> anyhow::Error {
    BadValue {
        key: key.into(),
        message: message.into(),
    }
    .into()
}

/// `e` with the line and column of its key in `text` in front, when it is a [`BadValue`] found there.
fn with_line(text: &str, e: anyhow::Error) -> anyhow::Error {
    let Some(bad) = e.downcast_ref::<BadValue>() else {
        return e;
    };
    let path: Vec<String> = bad.key.split('.').map(str::to_owned).collect();
    match located(text, &path, Node::Value) {
        at if at.is_empty() => e,
        at => anyhow::anyhow!("{at}{bad}"),
    }
}

/// Which node of a key path [`locate`] finds: the last key itself, or the value it holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Node {
    Key,
    Value,
}

/// `line L, column C: ` for the node at `path` in the YAML `text` (1-based), or nothing when it is not
/// found there (a key that only a flattened section or an alias produced).
fn located(text: &str, path: &[String], node: Node) -> String {
    locate(text, path, node)
        .map(|(line, column)| format!("line {line}, column {column}: "))
        .unwrap_or_default()
}

/// The error message [`Locate`] stops the walk with when it reaches its node.
const FOUND: &str = "tandem-config-node-found";

/// The line and column of the node at `path` in the YAML `text`. serde_yaml's trees keep no positions, but
/// an error raised while one of its nodes is visited is stamped with that node's, so a walk down the path
/// that fails on arrival reads the position off the error.
fn locate(text: &str, path: &[String], node: Node) -> Option<(usize, usize)> {
    use serde::de::DeserializeSeed;
    let err = Locate { path, node }
        .deserialize(serde_yaml::Deserializer::from_str(text))
        .err()?;
    if !err.to_string().contains(FOUND) {
        return None;
    }
    let at = err.location()?;
    Some((at.line(), at.column()))
}

/// One step of [`locate`]'s walk: the rest of the path below the node being visited.
struct Locate<'a> {
    path: &'a [String],
    node: Node,
}

impl Locate<'_> {
    /// What visiting a node gives: the stop when the path ends here, else nothing (not found below a scalar).
    fn arrive<E: serde::de::Error>(&self) -> std::result::Result<(), E> {
        if self.path.is_empty() {
            Err(E::custom(FOUND))
        } else {
            Ok(())
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Locate<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Locate<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        self.arrive()?;
        let (key, rest) = self.path.split_first().expect("arrive checked the path");
        let stop_at_key = rest.is_empty() && self.node == Node::Key;
        while let Some(hit) = map.next_key_seed(KeyIs {
            key,
            stop: stop_at_key,
        })? {
            if hit {
                return map.next_value_seed(Locate {
                    path: rest,
                    node: self.node,
                });
            }
            map.next_value::<serde::de::IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        self.arrive()?;
        let (index, rest) = self.path.split_first().expect("arrive checked the path");
        let Ok(index) = index.parse::<usize>() else {
            return Ok(());
        };
        for _ in 0..index {
            if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        seq.next_element_seed(Locate {
            path: rest,
            node: self.node,
        })?;
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_none<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        self.arrive()
    }
}

/// A mapping key compared with one key of [`locate`]'s path: whether it is that key, or the stop when the
/// walk ends at this key.
struct KeyIs<'a> {
    key: &'a str,
    stop: bool,
}

impl KeyIs<'_> {
    /// Compares a key's text with the wanted one.
    fn check<E: serde::de::Error>(&self, text: &str) -> std::result::Result<bool, E> {
        match (text == self.key, self.stop) {
            (true, true) => Err(E::custom(FOUND)),
            (hit, _) => Ok(hit),
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<bool, E> {
        self.check(v)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<bool, E> {
        self.check("null")
    }
}

/// The key and the allowed keys of serde's unknown-field error (`unknown field `x`, expected one of
/// `a`, `b``, `expected `a``, or `there are no fields`).
fn unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    Some((key.to_owned(), expected))
}

/// The known key `key` was most likely meant to be, when one is close enough to suggest.
fn closest<'a>(key: &str, known: &'a [String]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.as_str())
}

/// The keys of the object at `path` in `schema` (none when there is no object there).
fn keys_at(schema: &Value, path: &[String]) -> Vec<String> {
    path.iter()
        .try_fold(schema, |at, key| at.get(key))
        .and_then(Value::as_object)
        .map(|map| map.keys().cloned().collect())
        .unwrap_or_default()
}

/// Removes the value at `path` from `doc`; false when there is no such key (or the path is empty).
fn remove_key(doc: &mut Value, path: &[String]) -> bool {
    let Some((last, parents)) = path.split_last() else {
        return false;
    };
    let mut at = doc;
    for key in parents {
        at = match at {
            Value::Object(map) => match map.get_mut(key) {
                Some(next) => next,
                None => return false,
            },
            Value::Array(items) => match key.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                Some(next) => next,
                None => return false,
            },
            _ => return false,
        };
    }
    match at {
        Value::Object(map) => map.remove(last).is_some(),
        _ => false,
    }
}

/// What `tandem serve --check-config` prints: the settings serve would run with (the file, the flags over
/// it, a `pd` deployment's sections filled with their defaults), checked as serve checks them before it
/// loads the model (the model file is not opened). The API key is printed as `(set)`, never itself.
pub fn resolved(flags: &Settings, cuda_flags: &CudaSection, file: Settings) -> Result<Settings> {
    let pd = file
        .deployment
        .as_ref()
        .is_some_and(|d| d.mode == DeploymentMode::Pd);
    let mut s = if pd {
        overlay(&[&file, flags])?
    } else {
        Settings::colocated(flags, file)?
    };
    s.cuda = s.cuda.merged(cuda_flags);
    s.server.host = Some(s.host());
    s.server.port = Some(s.port());
    if s.server.api_key.is_some() {
        s.server.api_key = Some("(set)".into());
    }
    if let Some(deployment) = s.deployment.as_mut() {
        deployment.validate()?;
        if deployment.cluster_token.is_some() {
            deployment.cluster_token = Some("(set)".into());
        }
    }
    s.server.validate()?;
    let limits = s.server.listen.limits();
    s.server.listen = ListenSettings {
        header_read_timeout_secs: Some(limits.header_read_timeout.as_secs_f64()),
        body_read_timeout_secs: Some(limits.body_read_timeout.as_secs_f64()),
        max_connections: Some(limits.max_connections),
    };
    if pd {
        let deployment = s.deployment.get_or_insert_with(DeploymentSettings::default);
        deployment.validate()?;
        deployment.fill_defaults();
    }
    Ok(s)
}

/// Flags of `tandem serve`; each one overrides the same setting of the config file.
#[derive(Clone, Debug, Default, Args)]
pub struct ServeArgs {
    /// YAML file with the same settings; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Check this YAML file as `--config` would read it, print the resolved settings (YAML) and exit:
    /// 0 when it is valid, non-zero with an error naming the bad key (the model is not loaded).
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// The settings given as flags.
    #[command(flatten)]
    pub settings: Settings,
    /// CUDA backend flags, merged over the file's `cuda:` section.
    #[command(flatten)]
    pub cuda: crate::cuda_settings::CudaArgs,
}

/// Merges `layers` of one settings type, later ones winning: every value a layer sets replaces the one
/// before, sections merge key by key, and unset (`None`) values leave the earlier layer's in place.
pub fn overlay<T: Serialize + DeserializeOwned>(layers: &[&T]) -> Result<T> {
    fn merge(into: &mut Value, from: Value) {
        match (into, from) {
            (_, Value::Null) => {}
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (slot, v) => *slot = v,
        }
    }
    let mut merged = Value::Null;
    for layer in layers {
        merge(
            &mut merged,
            serde_json::to_value(layer).context("writing settings")?,
        );
    }
    serde_json::from_value(merged).context("merging settings")
}

#[cfg(test)]
mod tests;
