//! A worker's settings: which KV transport it pulls with and how ([`KvTransferConfig`], the YAML
//! `kv_transfer:` section every worker of a deployment shares), its own ([`WorkerConfig`]), and the
//! handshake record its engine's KV shape gives ([`peer_info`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tandem_engine::{EngineHandle, KvDtype};
use tandem_kv::{KvError, NixlAgent, NixlBackend, NixlConfig, PeerInfo, WireDtype, WireLayout};

use crate::protocol::Role;

/// How decode workers pull KV (YAML `kv_transfer.transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// NIXL on GPU workers where the library loads (device-to-device READs), TCP otherwise — decided
    /// by each worker at start-up and logged; a NIXL decode worker pulls over TCP from a prefill
    /// worker without NIXL (`TransferHandle::nixl`), so workers deciding differently still agree.
    #[default]
    Auto,
    /// TCP, several connections per pull: works across hosts.
    Tcp,
    /// Shared-memory file plus a TCP control connection: same host only, fewer copies through the kernel.
    Shm,
    /// NIXL (loaded at run time) moves the bytes by one-sided READs from the prefill worker's registered
    /// memory; handshake, pins and acks stay on a TCP control connection. Every worker of the deployment
    /// needs the library (`nixl_library`); a worker that cannot load it fails at start-up naming why.
    Nixl,
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "nixl" => Ok(TransportKind::Nixl),
            other => Err(format!(
                "unknown KV transport `{other}` (expected auto, tcp, shm or nixl)"
            )),
        }
    }
}

/// KV transfer settings shared by every worker of a deployment (YAML `kv_transfer:`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTransferConfig {
    /// Data plane used by decode workers.
    pub transport: TransportKind,
    /// Parallel TCP connections per pull.
    pub streams: usize,
    /// Seconds a prefill worker keeps KV pinned without an ack.
    pub pin_timeout_secs: f64,
    /// Seconds bound on every KV socket read or write.
    pub io_timeout_secs: f64,
    /// CRC32 every data frame.
    pub checksum: bool,
    /// NIXL backend plugin (`transport: nixl`): ucx, or libfabric (AWS EFA).
    pub nixl_backend: NixlBackend,
    /// `libnixl_capi.so`, its directory, or an unpacked `nixl-cu13` wheel (`transport: nixl`); unset: the
    /// system loader's search path.
    pub nixl_library: Option<std::path::PathBuf>,
    /// MiB of staging memory (`transport: nixl`), allocated where the KV lives (GPU memory on CUDA workers)
    /// and registered once: prefill exports into it and decode READs into it, so KV moves GPU to GPU with
    /// no host copy. A transfer that finds it full goes through registered host buffers instead. 0: none.
    pub staging_mib: usize,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        KvTransferConfig {
            transport: TransportKind::Auto,
            streams: 4,
            pin_timeout_secs: 30.0,
            io_timeout_secs: 10.0,
            checksum: false,
            nixl_backend: NixlBackend::Ucx,
            nixl_library: None,
            staging_mib: 1024,
        }
    }
}

impl KvTransferConfig {
    pub(super) fn pin_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.pin_timeout_secs.max(0.001))
    }

    /// The NIXL agent of a worker of a `transport: nixl` deployment (both roles have one).
    /// This worker's NIXL agent: required with `transport: nixl` (a load failure is an error naming
    /// what is missing), tried on GPU workers with `auto` (a failure logs why and means TCP).
    pub(super) fn nixl_agent(
        &self,
        worker_id: &str,
        gpu: bool,
    ) -> Result<Option<NixlAgent>, KvError> {
        let config = NixlConfig {
            library: self.nixl_library.clone(),
            backend: self.nixl_backend,
            ..NixlConfig::default()
        };
        match self.transport {
            TransportKind::Nixl => NixlAgent::new(worker_id, &config).map(Some),
            TransportKind::Auto if gpu => match NixlAgent::new(worker_id, &config) {
                Ok(agent) => {
                    tracing::info!("KV transfer: NIXL (transport: auto on a GPU worker)");
                    Ok(Some(agent))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV transfer: TCP (transport: auto could not load NIXL; set nixl_library)");
                    Ok(None)
                }
            },
            _ => Ok(None),
        }
    }

    pub(super) fn io_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.io_timeout_secs.max(0.001))
    }
}

/// Settings of one worker process.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Unique name in the deployment.
    pub worker_id: String,
    /// Prefill or decode.
    pub role: Role,
    /// Address the KV server binds (prefill workers), e.g. `127.0.0.1:0`.
    pub kv_listen: String,
    /// Host decode workers should dial for KV when `kv_listen` binds a wildcard (e.g. `0.0.0.0`).
    pub kv_advertise_host: Option<String>,
    /// KV transfer settings.
    pub kv: KvTransferConfig,
    /// The engine's batch size, reported to the router.
    pub max_num_seqs: usize,
    /// The engine runs on a GPU: `transport: auto` then tries NIXL.
    pub gpu: bool,
    /// The cluster secret callers and KV peers must prove (`crate::auth`); `None` leaves the ports open.
    pub cluster_key: Option<tandem_kv::ClusterKey>,
    /// Mutual TLS on the KV port and the KV client (`deployment.cluster_tls`); `None` speaks plain TCP.
    pub tls: Option<std::sync::Arc<tandem_kv::ClusterTls>>,
    /// `/metrics` asks for the cluster token too (with one set); by default it is open, like `/health`.
    pub metrics_need_token: bool,
}

/// Builds the handshake record of an engine: the model identity plus its KV shape.
///
/// The query head count is not part of the engine's layout, so the caller passes it from the model config.
pub fn peer_info(engine: &EngineHandle, model_id: String, n_heads: usize) -> PeerInfo {
    let l = engine.kv_layout();
    let dtype = match l.dtype {
        KvDtype::F32 => WireDtype::F32,
        KvDtype::Bf16 => WireDtype::Bf16,
        KvDtype::Fp8E4m3 => WireDtype::Fp8E4m3,
    };
    PeerInfo {
        model_id,
        layout: WireLayout {
            n_layers: l.n_layers,
            n_heads,
            n_kv_heads: l.n_kv_heads,
            head_dim: l.head_dim,
            block_size: l.block_size,
            dtype,
        },
    }
}
