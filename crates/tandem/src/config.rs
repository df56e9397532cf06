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
        let file = Settings::from_yaml(
            "model: m.gguf\nserved_model_name: smol\nserver: {host: 0.0.0.0, port: 9000, api_key: k}\n\
             engine: {block_size: 32, kv_cache_memory: 256MiB, max_num_seqs: 8, enable_prefix_caching: false}\n\
             deployment: {mode: colocated}\n",
        )
        .unwrap();
        let args = Settings {
            server: ServerSettings {
                port: Some(9100),
                ..ServerSettings::default()
            },
            engine: EngineSettings {
                max_num_seqs: Some(4),
                ..EngineSettings::default()
            },
            ..Settings::default()
        };
        let s = Settings::colocated(&args, file).unwrap();
        assert_eq!(s.model, Some(PathBuf::from("m.gguf")));
        assert_eq!(s.served_model_name.as_deref(), Some("smol"));
        assert_eq!(s.host(), "0.0.0.0");
        assert_eq!(s.port(), 9100);
        assert_eq!(s.server.api_key.as_deref(), Some("k"));
        let engine = s.engine.engine_config();
        assert_eq!(engine.block_size, 32);
        assert_eq!(engine.kv_cache_bytes, 256 << 20);
        assert_eq!(engine.max_num_seqs, 4);
        assert!(!engine.enable_prefix_caching);
    }

    #[test]
    fn defaults_without_file() {
        let s = Settings::colocated(&Settings::default(), Settings::default()).unwrap();
        assert_eq!(s.host(), "127.0.0.1");
        assert_eq!(s.port(), 8000);
        assert_eq!(s.model, None);
        let d = EngineConfig::default();
        assert_eq!(s.engine.engine_config().block_size, d.block_size);
        let args = Settings {
            engine: EngineSettings {
                enable_chunked_prefill: Some(false),
                ..EngineSettings::default()
            },
            ..Settings::default()
        };
        assert!(
            !Settings::colocated(&args, Settings::default())
                .unwrap()
                .engine
                .engine_config()
                .enable_chunked_prefill
        );
    }

    #[test]
    fn device_comes_from_the_file_and_the_flag_wins() {
        let file = Settings::from_yaml("engine: {device: cuda}\n").unwrap();
        let s = Settings::colocated(&Settings::default(), file.clone()).unwrap();
        assert_eq!(s.device(), Device::Cuda);
        let args = Settings {
            engine: EngineSettings {
                device: Some(Device::Cpu),
                ..EngineSettings::default()
            },
            ..Settings::default()
        };
        assert_eq!(
            Settings::colocated(&args, file).unwrap().device(),
            Device::Cpu
        );
        let default = Settings::colocated(&Settings::default(), Settings::default()).unwrap();
        assert_eq!(default.device(), Device::Cpu);
        assert!(Settings::from_yaml("engine: {device: tpu}\n").is_err());
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = Settings::from_yaml("server: {hots: x}\n").unwrap_err();
        assert!(format!("{err:#}").contains("hots"), "{err:#}");
        let err = Settings::from_yaml("engine: {blok_size: 3}\n").unwrap_err();
        assert!(format!("{err:#}").contains("blok_size"), "{err:#}");
        let err = Settings::from_yaml("modle: x\n").unwrap_err();
        assert!(format!("{err:#}").contains("modle"), "{err:#}");
    }

    #[test]
    fn every_problem_is_reported_at_once_by_its_path_with_suggestions() {
        let err = Settings::from_yaml(
            "modle: x\nengine: {blok_size: 3, max_num_seqs: lots, threads: 2}\nfrobnicate: 1\n\
             deployment: {mode: pd, kv_transfer: {transprt: tcp}, routing: {prefill_load_bound: -1}}\n",
        )
        .unwrap_err();
        let text = format!("{err:#}");
        for want in [
            "6 problems in the settings",
            "modle: unknown key, did you mean `model`?",
            "engine.blok_size: unknown key, did you mean `block_size`?",
            "engine.max_num_seqs: invalid type: string \"lots\"",
            "deployment.kv_transfer.transprt: unknown key, did you mean `transport`?",
            "deployment.routing.prefill_load_bound: invalid value",
        ] {
            assert!(text.contains(want), "{want:?} not in:\n{text}");
        }
        assert!(
            text.contains("frobnicate: unknown key\n") || text.ends_with("frobnicate: unknown key"),
            "no suggestion when nothing is close:\n{text}"
        );
        let one = Settings::from_yaml("engine: {block_size: 0x}\n").unwrap_err();
        assert!(
            format!("{one:#}").starts_with(
                "1 problem in the settings:\n  line 1, column 22: engine.block_size: "
            ),
            "{one:#}"
        );
        assert!(
            Settings::from_yaml("").is_ok(),
            "empty YAML is all defaults"
        );
        // A config file named on purpose that holds nothing (`--config /dev/null`) is refused.
        let empty = std::env::temp_dir().join(format!("tandem-empty-{}.yaml", std::process::id()));
        std::fs::write(&empty, "# only a comment\n").unwrap();
        let err = Settings::load(&empty).map_err(|e| format!("{e:#}"));
        std::fs::remove_file(&empty).unwrap();
        assert!(err.unwrap_err().contains("holds no settings"));
        // `server:` has a flattened part, whose unknown-key message lists no keys: the defaults do.
        let flat = Settings::from_yaml("server: {prot: 1, max_conections: 3}\n").unwrap_err();
        for want in [
            "server.prot: unknown key, did you mean `port`?",
            "server.max_conections: unknown key, did you mean `max_connections`?",
        ] {
            assert!(
                format!("{flat:#}").contains(want),
                "{want:?} not in {flat:#}"
            );
        }
        let syntax = Settings::from_yaml("engine: {block_size: 3\n").unwrap_err();
        assert!(format!("{syntax:#}").contains("line"), "{syntax:#}");
    }

    #[test]
    fn every_problem_names_its_line_and_column() {
        let text = "# a tandem config\n\
                    model: models/x.gguf\n\
                    engine:\n  \
                      block_size: 16\n  \
                      blok_size: 3\n  \
                      max_num_seqs: lots\n\
                    server: {port: 8000, prot: 1}\n\
                    deployment:\n  \
                      mode: pd\n  \
                      prefill:\n    \
                        engine: {threads: many}\n\
                    modle: y\n";
        let err = format!("{:#}", Settings::from_yaml(text).unwrap_err());
        for want in [
            "line 5, column 3: engine.blok_size: unknown key, did you mean `block_size`?",
            "line 6, column 17: engine.max_num_seqs: invalid type: string \"lots\"",
            "line 7, column 22: server.prot: unknown key, did you mean `port`?",
            "line 11, column 23: deployment.prefill.engine.threads: invalid type",
            "line 12, column 1: modle: unknown key, did you mean `model`?",
        ] {
            assert!(err.contains(want), "{want:?} not in:\n{err}");
        }
        assert_eq!(
            locate(text, &["engine".into(), "block_size".into()], Node::Key),
            Some((4, 3))
        );
        assert_eq!(
            locate(text, &["engine".into(), "absent".into()], Node::Key),
            None
        );
        assert_eq!(
            locate(
                "a: [x, {b: 1}]\n",
                &["a".into(), "1".into(), "b".into()],
                Node::Value
            ),
            Some((1, 12))
        );
    }

    #[test]
    fn pd_sections_parse_typed_and_stay_out_of_colocated() {
        let file = Settings::from_yaml(
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
        let err = Settings::colocated(&Settings::default(), file).unwrap_err();
        assert!(err.to_string().contains("P/D launcher"), "{err}");
        let err = Settings::from_yaml("deployment: {mode: pd, kv_transfer: {transprot: tcp}}\n")
            .unwrap_err();
        assert!(format!("{err:#}").contains("transprot"), "{err:#}");
        let colocated =
            Settings::from_yaml("deployment: {routing: {prefill_load_bound: 1}}\n").unwrap();
        assert!(Settings::colocated(&Settings::default(), colocated).is_err());
        assert!(Settings::from_yaml("deployment: {mode: sideways}\n").is_err());
    }

    #[test]
    fn discovery_parses_is_checked_naming_the_key_and_resolves() {
        let file = Settings::from_yaml(
            "deployment:\n  mode: pd\n  prefill: {replicas: 0}\n  decode: {replicas: 0}\n  discovery:\n    \
             mode: dns\n    prefill: \"prefill:8100\"\n    decode: \"decode:8100\"\n    interval_secs: 3\n",
        )
        .unwrap();
        let s = resolved(&Settings::default(), &CudaSection::default(), file).unwrap();
        let d = s.deployment.as_ref().unwrap();
        let discovery = d.discovery.clone().unwrap();
        assert_eq!(discovery.mode, tandem_cluster::DiscoveryMode::Dns);
        assert_eq!(discovery.decode.as_deref(), Some("decode:8100"));
        assert_eq!(discovery.interval_secs, 3.0);
        assert_eq!(d.decode.as_ref().unwrap().replicas, Some(0));
        assert_eq!(
            d.timeouts.as_ref().unwrap().poll_interval_secs,
            0.5,
            "defaults filled"
        );
        // What --check-config prints reads back to the same settings.
        let printed = serde_yaml::to_string(&s).unwrap();
        let again = resolved(
            &Settings::default(),
            &CudaSection::default(),
            Settings::from_yaml(&printed).unwrap(),
        )
        .unwrap();
        assert_eq!(serde_yaml::to_string(&again).unwrap(), printed);

        for (yaml, key) in [
            (
                "discovery: {mode: dns, decode: decode}",
                "deployment.discovery.decode",
            ),
            ("discovery: {mode: dns}", "deployment.discovery.decode"),
            (
                "discovery: {mode: static, prefill: \"p:1\"}",
                "deployment.discovery.prefill",
            ),
            (
                "discovery: {mode: dns, decode: \"d:1\", interval_secs: -1}",
                "deployment.discovery.interval_secs",
            ),
        ] {
            let file = Settings::from_yaml(&format!("deployment: {{mode: pd, {yaml}}}\n")).unwrap();
            let err = resolved(&Settings::default(), &CudaSection::default(), file).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{yaml}: {err:#}");
        }
        let err = Settings::from_yaml(
            "deployment: {mode: pd, discovery: {mode: dns, intervl_secs: 1}}\n",
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("intervl_secs"), "{err:#}");
        let err =
            Settings::from_yaml("deployment: {mode: pd, discovery: {mode: mdns}}\n").unwrap_err();
        assert!(format!("{err:#}").contains("mdns"), "{err:#}");
        let colocated = Settings::from_yaml("deployment: {discovery: {mode: dns}}\n").unwrap();
        assert!(Settings::colocated(&Settings::default(), colocated).is_err());
        let keyed = Settings::from_yaml("server: {api_key: secret}\n").unwrap();
        let s = resolved(&Settings::default(), &CudaSection::default(), keyed).unwrap();
        assert!(!serde_yaml::to_string(&s).unwrap().contains("secret"));
        let closed = Settings::from_yaml("server: {probes_need_key: true}\n").unwrap();
        let err = resolved(&Settings::default(), &CudaSection::default(), closed).unwrap_err();
        assert!(format!("{err:#}").contains("server.api_key"), "{err:#}");
        let closed = Settings::from_yaml("server: {probes_need_key: true, api_key: k}\n").unwrap();
        assert!(resolved(&Settings::default(), &CudaSection::default(), closed).is_ok());
        for yaml in [
            "deployment: {mode: pd, cluster_token: s3cret-token}\n",
            "deployment: {mode: colocated, cluster_token: s3cret-token}\n",
        ] {
            let s = resolved(
                &Settings::default(),
                &CudaSection::default(),
                Settings::from_yaml(yaml).unwrap(),
            )
            .unwrap();
            let printed = serde_yaml::to_string(&s).unwrap();
            assert!(!printed.contains("s3cret"), "{printed}");
            assert!(printed.contains("cluster_token: (set)"), "{printed}");
        }
        let both = Settings::from_yaml(
            "deployment: {mode: pd, cluster_token: a, cluster_token_file: /run/secrets/t}\n",
        )
        .unwrap();
        let err = resolved(&Settings::default(), &CudaSection::default(), both).unwrap_err();
        assert!(format!("{err:#}").contains("cluster_token_file"), "{err:#}");
    }

    #[test]
    fn a_value_a_check_refuses_names_its_line_in_the_file() {
        let dir = std::env::temp_dir().join(format!("tandem-config-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            (
                "server:\n  port: 9000\n  max_connections: 0\n",
                "line 3, column 20: server.max_connections must be at least 1",
            ),
            (
                "deployment:\n  mode: pd\n  decode:\n    replicas: 1\n    mps_thread_percentage: 250\n",
                "line 5, column 28: deployment.decode.mps_thread_percentage is 250",
            ),
            (
                "deployment:\n  mode: pd\n  discovery: {mode: dns, decode: \"d:1\", interval_secs: -1}\n",
                "line 3, column 56: deployment.discovery.interval_secs is wrong",
            ),
        ];
        for (i, (yaml, want)) in cases.into_iter().enumerate() {
            let path = dir.join(format!("c{i}.yaml"));
            std::fs::write(&path, yaml).unwrap();
            let err = format!("{:#}", Settings::load(&path).unwrap_err());
            assert!(err.contains(want), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_mps_share_outside_1_to_100_is_refused_naming_its_key() {
        for (p, ok) in [(0, false), (1, true), (100, true), (101, false)] {
            let yaml =
                format!("deployment: {{mode: pd, prefill: {{mps_thread_percentage: {p}}}}}\n");
            let r = resolved(
                &Settings::default(),
                &CudaSection::default(),
                Settings::from_yaml(&yaml).unwrap(),
            );
            match r {
                Ok(_) => assert!(ok, "{p} accepted"),
                Err(e) => {
                    assert!(!ok, "{p}: {e:#}");
                    let msg = format!("{e:#}");
                    assert!(
                        msg.contains("deployment.prefill.mps_thread_percentage"),
                        "{msg}"
                    );
                }
            }
        }
    }

    #[test]
    fn listener_limits_are_server_keys_and_flags_checked_and_resolved() {
        let file = Settings::from_yaml(
            "server: {port: 9000, header_read_timeout_secs: 2, max_connections: 64}\n",
        )
        .unwrap();
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let flags =
            <Cli as clap::Parser>::try_parse_from(["serve", "--body-read-timeout-secs", "5"])
                .unwrap()
                .serve
                .settings;
        let s = Settings::colocated(&flags, file).unwrap();
        let limits = s.server.listen.limits();
        assert_eq!(
            limits.header_read_timeout,
            std::time::Duration::from_secs(2)
        );
        assert_eq!(limits.body_read_timeout, std::time::Duration::from_secs(5));
        assert_eq!((limits.max_connections, s.port()), (64, 9000));
        let defaults = ListenSettings::default().limits();
        assert_eq!(defaults, tandem_api::ServeLimits::default());
        assert_eq!(defaults.header_read_timeout.as_secs(), 10);
        assert_eq!(defaults.body_read_timeout.as_secs(), 30);
        assert_eq!(defaults.max_connections, 1024);

        let err = Settings::from_yaml("server: {header_read_timeout: 2}\n").unwrap_err();
        assert!(
            format!("{err:#}").contains("header_read_timeout"),
            "{err:#}"
        );
        for (yaml, key) in [
            ("header_read_timeout_secs: 0", "header_read_timeout_secs"),
            ("body_read_timeout_secs: -1", "body_read_timeout_secs"),
            ("max_connections: 0", "max_connections"),
        ] {
            let file = Settings::from_yaml(&format!("server: {{{yaml}}}\n")).unwrap();
            let err = Settings::colocated(&Settings::default(), file.clone()).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{yaml}: {err:#}");
            assert!(resolved(&Settings::default(), &CudaSection::default(), file).is_err());
        }
        let printed = resolved(
            &Settings::default(),
            &CudaSection::default(),
            Settings::default(),
        )
        .unwrap();
        let text = serde_yaml::to_string(&printed).unwrap();
        for key in [
            "header_read_timeout_secs: 10",
            "body_read_timeout_secs: 30",
            "max_connections: 1024",
        ] {
            assert!(text.contains(key), "{key} missing from:\n{text}");
        }
    }

    #[test]
    fn every_shipped_example_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
            .collect();
        names.sort();
        for name in [
            "pd.yaml",
            "pd-2p1d.yaml",
            "colocated.yaml",
            "pd-parallel.yaml",
            "pd-dns.yaml",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
        }
        for name in &names {
            let file = Settings::load(&dir.join(name)).unwrap();
            resolved(&Settings::default(), &CudaSection::default(), file.clone())
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            let mode = file.deployment.as_ref().map(|d| d.mode).unwrap_or_default();
            assert_eq!(mode == DeploymentMode::Pd, name.starts_with("pd"), "{name}");
        }
    }

    #[test]
    fn flags_fill_the_same_fields_as_the_file_and_win() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let cli = <Cli as clap::Parser>::try_parse_from([
            "serve",
            "m.gguf",
            "--port",
            "9000",
            "--no-chunked-prefill",
            "--pipeline-stages",
            "a:1,b:2",
            "--kv-cache-memory",
            "1GiB",
        ])
        .unwrap()
        .serve
        .settings;
        let file = Settings::from_yaml(
            "model: other.gguf\nserver: {port: 1, host: h}\n\
             engine: {enable_chunked_prefill: true, enable_prefix_caching: false, threads: 3}\n",
        )
        .unwrap();
        let s = Settings::colocated(&cli, file).unwrap();
        assert_eq!(s.model, Some(PathBuf::from("m.gguf")));
        assert_eq!((s.host(), s.port()), ("h".to_owned(), 9000));
        let e = s.engine.engine_config();
        assert!(!e.enable_chunked_prefill && !e.enable_prefix_caching);
        assert_eq!((e.threads, e.kv_cache_bytes), (3, 1 << 30));
        assert_eq!(e.pipeline_stages, ["a:1", "b:2"]);
        // An absent flag leaves the file's value: `--no-prefix-caching` is no `enable_prefix_caching: true`.
        assert_eq!(cli.engine.enable_prefix_caching, None);
    }
}
