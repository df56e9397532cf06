//! The sections of the settings document (`server:`, `engine:`, `deployment:`) and the checks parsing
//! cannot make, each naming the key of a bad value.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_engine::EngineConfig;

use super::parse::bad_value;
use super::{overlay_onto, ByteSize, DeploymentMode, Device};

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
    /// `server.tls: {cert, key}`: serve the API (and console) over HTTPS.
    #[command(flatten)]
    #[serde(default, skip_serializing_if = "TlsSettings::is_empty")]
    pub tls: TlsSettings,
}

/// `server.tls`: the PEM certificate chain and key the public API presents (HTTPS); unset, it serves
/// plain HTTP.
#[derive(Clone, Debug, Default, PartialEq, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM certificate chain (leaf first) the API presents; with --tls-key, the API speaks HTTPS.
    #[arg(long = "tls-cert", id = "tls_cert", value_name = "PATH")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long = "tls-key", id = "tls_key", value_name = "PATH")]
    pub key: Option<PathBuf>,
}

impl TlsSettings {
    /// Whether neither file is set (plain HTTP).
    pub fn is_empty(&self) -> bool {
        self.cert.is_none() && self.key.is_none()
    }

    /// The rustls configuration of these files, `None` when unset; a missing, unreadable or mismatched
    /// file is an error naming `server.tls.cert` or `server.tls.key`.
    pub fn server_config(&self) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(tandem_kv::tls::server_config(
                &tandem_kv::tls::CertPaths {
                    cert: cert.clone(),
                    key: key.clone(),
                    cert_setting: "server.tls.cert",
                    key_setting: "server.tls.key",
                },
            )?)),
            (Some(_), None) => Err(bad_value(
                "server.tls.key",
                "is missing: set it with server.tls.cert",
            )),
            (None, Some(_)) => Err(bad_value(
                "server.tls.cert",
                "is missing: set it with server.tls.key",
            )),
        }
    }
}

/// `deployment.cluster_tls: {ca, cert, key}`: mutual TLS on every internal link (control calls, KV,
/// stage links). Every process presents `cert` and accepts only peers whose certificate `ca` signed.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTlsSettings {
    /// The cluster's CA certificate (PEM).
    pub ca: PathBuf,
    /// This process's certificate (PEM), signed by `ca`, with the SANs peers dial it by.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// A name every peer's certificate carries, checked instead of the dialled address (for peers found
    /// by IP, e.g. DNS discovery's pod addresses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
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
        self.tls.server_config()?;
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
    /// How a mixture of experts' routed experts are placed over the tensor-parallel ranks, each rank
    /// holding whole experts: contiguous (default) or round-robin.
    #[arg(long, value_enum)]
    pub expert_placement: Option<ExpertPlacementSetting>,
    /// CPU kernels sum as llama.cpp's do at each step size, for logits bit-identical to llama.cpp's
    /// (off: one order per kernel, so a token's bits do not depend on how it was batched).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub llamacpp_orders: Option<bool>,
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
    /// KV cache tiers that blocks evicted from the pool are copied down to
    /// (`kv_offload: {host: 64GiB, disk: {path: DIR, size: 500GiB}}`); off unless set.
    #[command(flatten)]
    #[serde(default, skip_serializing_if = "KvOffloadSettings::is_unset")]
    pub kv_offload: KvOffloadSettings,
}

/// `engine.kv_offload`: the KV tiers under the pool. Flat as flags (`--kv-offload-host`,
/// `--kv-offload-disk`, `--kv-offload-disk-size`), nested in YAML (`{host, disk: {path, size}}`).
#[derive(Clone, Debug, Default, PartialEq, Args, Deserialize, Serialize)]
#[serde(from = "KvOffloadDoc", into = "KvOffloadDoc")]
pub struct KvOffloadSettings {
    /// Host memory for KV blocks evicted from the pool, e.g. 64GiB (default: no host tier).
    #[arg(long = "kv-offload-host", id = "kv_offload_host", value_name = "SIZE")]
    pub host: Option<ByteSize>,
    /// Directory of the disk KV tier, kept across restarts (needs --kv-offload-disk-size).
    #[arg(long = "kv-offload-disk", id = "kv_offload_disk", value_name = "DIR")]
    pub disk_path: Option<PathBuf>,
    /// Bytes of block files the disk KV tier may hold, e.g. 500GiB.
    #[arg(
        long = "kv-offload-disk-size",
        id = "kv_offload_disk_size",
        value_name = "SIZE"
    )]
    pub disk_size: Option<ByteSize>,
}

/// The ids of every flag of [`EngineSettings`], which `--settings-json` of worker and stage conflicts
/// with. Named one by one because clap leaves the group of a struct with a flattened part
/// (`kv_offload`) empty; `tests::engine_flag_ids_are_every_engine_flag` keeps the list complete.
pub const ENGINE_FLAG_IDS: [&str; 19] = [
    "block_size",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "max_model_len",
    "max_waiting",
    "threads",
    "tensor_parallel_size",
    "expert_placement",
    "llamacpp_orders",
    "pipeline_parallel_size",
    "pipeline_micro_batches",
    "pipeline_stages",
    "device",
    "kv_offload_host",
    "kv_offload_disk",
    "kv_offload_disk_size",
];

/// `engine.expert_placement` / `--expert-placement`: the rule placing routed experts over the
/// tensor-parallel ranks (`tandem_model::ExpertPlacement`, named here for the flag parser).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ExpertPlacementSetting {
    /// Expert `e` of `E` on rank `e * ranks / E`.
    Contiguous,
    /// Expert `e` on rank `e % ranks`: neighbouring ids, often similarly hot, on different ranks.
    #[serde(alias = "round-robin")]
    #[value(alias = "round_robin")]
    RoundRobin,
}

/// How `engine.kv_offload` is written in YAML.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct KvOffloadDoc {
    host: Option<ByteSize>,
    disk: Option<DiskOffloadDoc>,
}

/// How `engine.kv_offload.disk` is written in YAML.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct DiskOffloadDoc {
    path: Option<PathBuf>,
    size: Option<ByteSize>,
}

impl From<KvOffloadDoc> for KvOffloadSettings {
    fn from(d: KvOffloadDoc) -> Self {
        let disk = d.disk.unwrap_or_default();
        KvOffloadSettings {
            host: d.host,
            disk_path: disk.path,
            disk_size: disk.size,
        }
    }
}

impl From<KvOffloadSettings> for KvOffloadDoc {
    fn from(s: KvOffloadSettings) -> Self {
        let disk = (s.disk_path.is_some() || s.disk_size.is_some()).then_some(DiskOffloadDoc {
            path: s.disk_path,
            size: s.disk_size,
        });
        KvOffloadDoc { host: s.host, disk }
    }
}

impl KvOffloadSettings {
    /// Whether no tier is set.
    pub fn is_unset(&self) -> bool {
        *self == KvOffloadSettings::default()
    }

    /// Checks what parsing cannot: a disk tier needs both its directory and its size.
    pub fn validate(&self) -> Result<()> {
        match (&self.disk_path, self.disk_size) {
            (Some(_), None) => Err(bad_value(
                "engine.kv_offload.disk.size",
                "is needed with disk.path (--kv-offload-disk-size): the bytes the disk tier may hold",
            )),
            (None, Some(_)) => Err(bad_value(
                "engine.kv_offload.disk.path",
                "is needed with disk.size (--kv-offload-disk): the directory of the disk tier",
            )),
            (Some(p), _) if p.as_os_str().is_empty() => Err(bad_value(
                "engine.kv_offload.disk.path",
                "must name a directory",
            )),
            _ => Ok(()),
        }
    }
}

impl EngineSettings {
    /// Checks the values parsing cannot, naming the key of a bad one.
    pub fn validate(&self) -> Result<()> {
        self.kv_offload.validate()
    }

    /// Engine defaults with these settings applied. The keys of this section are `EngineConfig`'s
    /// fields (`device` aside, which picks the backend), so the mapping is serde's: the defaults as a
    /// document, this section's set keys over them (`tests::every_engine_key_reaches_the_engine` keeps
    /// the names in step).
    pub fn engine_config(&self) -> EngineConfig {
        overlay_onto(&EngineConfig::default(), self)
            .expect("every engine key is an EngineConfig field of the same type")
    }

    /// The settings that give `config` (every key set), on `device`: how a launcher hands the engine
    /// it resolved to a process it starts.
    pub fn of(config: &EngineConfig, device: Device) -> EngineSettings {
        let mut settings: EngineSettings = overlay_onto(&EngineSettings::default(), config)
            .expect("every EngineConfig field is an engine key of the same type");
        settings.device = Some(device);
        settings
    }
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
    /// The user's choice to run without a cluster token: a head that starts its workers generates none,
    /// and workers bound beyond loopback start open (`tandem worker --allow-unauthenticated`).
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Mutual TLS on the cluster's internal links; the head hands the paths to the workers it starts.
    pub cluster_tls: Option<ClusterTlsSettings>,
}

impl DeploymentSettings {
    /// The cluster token this deployment's config gives (value, file, else the environment).
    pub fn cluster_token(&self) -> Result<Option<String>> {
        crate::token::resolve(
            self.cluster_token.as_deref(),
            self.cluster_token_file.as_deref(),
        )
    }

    /// Whether a P/D head with this section starts every worker itself: each role has replicas here and
    /// none is found by DNS. Only such a head may make up a token when none is configured; workers on
    /// other hosts could not know it.
    pub fn starts_every_worker(&self) -> bool {
        let dns = self
            .discovery
            .as_ref()
            .is_some_and(|d| d.mode == tandem_cluster::DiscoveryMode::Dns);
        let local = |role: &Option<RoleSettings>| role.as_ref().and_then(|r| r.replicas) != Some(0);
        !dns && local(&self.prefill) && local(&self.decode)
    }

    /// Checks what parsing cannot (discovery names, intervals), naming the key of a bad value.
    pub fn validate(&self) -> Result<()> {
        if self.cluster_token.is_some() && self.cluster_token_file.is_some() {
            return Err(bad_value(
                "deployment.cluster_token_file",
                "and deployment.cluster_token are both set: set one",
            ));
        }
        if let Some(tls) = &self.cluster_tls {
            crate::tls::load(tls)?;
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
    pub(super) fn fill_defaults(&mut self) {
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
