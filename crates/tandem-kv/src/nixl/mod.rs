//! NIXL (NVIDIA Inference Xfer Library) as a KV data plane: one-sided READs between registered memory of
//! two agents, over UCX (shared memory / CUDA IPC on one host, RDMA across hosts) or LIBFABRIC (AWS EFA).
//!
//! NIXL's C API (`libnixl_capi.so`, from the `nixl-cu13` wheel) is loaded at run time ([`NixlAgent::new`]),
//! like cudarc loads CUDA: the crate builds and runs without it, and a missing library, symbol or backend
//! plugin is a [`NixlError`] naming the path tried. Only bytes move through NIXL; handshake, pin and ack stay
//! on our TCP control connection (see [`crate::transport`] and the `NixlPull` frames in [`crate::wire`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod agent;
mod ffi;
mod pool;
pub(crate) mod server;

pub(crate) use agent::Xfer;
pub use agent::{NixlAgent, Registration};
pub(crate) use pool::PoolLease;
pub use pool::{MemKind, MemRegion};

/// File name of NIXL's C API library.
pub const CAPI_LIBRARY: &str = "libnixl_capi.so";
/// Where the `nixl-cu13` wheel keeps its libraries, relative to the unpacked wheel (site-packages).
const WHEEL_LIB_DIR: &str = ".nixl_cu13.mesonpy.libs";

/// Why NIXL could not be used; every variant names what is missing so the operator can fix the setting.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    /// `dlopen` of the C API failed (not installed, wrong path, or a dependency missing).
    #[error("cannot load NIXL's C API from {path}: {reason} (set `nixl_library` to libnixl_capi.so, its directory or the unpacked nixl-cu13 wheel)")]
    Library {
        /// The file that was tried.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The library loaded but lacks a function this crate calls (an incompatible NIXL version).
    #[error("NIXL's C API at {path} has no symbol `{symbol}` ({reason}); nixl-cu13 1.5 is known to work")]
    Symbol {
        /// The library.
        path: PathBuf,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// The library is NIXL's stub build, which aborts on any real call.
    #[error("NIXL's C API at {0} is the stub build; install the real library")]
    Stub(PathBuf),
    /// The backend's plugin is not where NIXL will look for it.
    #[error("NIXL backend plugin {backend} not found: {path} does not exist")]
    Plugin {
        /// The backend asked for.
        backend: NixlBackend,
        /// The plugin file expected.
        path: PathBuf,
    },
    /// A C API call returned an error status.
    #[error("NIXL call {call} failed with status {status}")]
    Call {
        /// The C function.
        call: &'static str,
        /// Its `nixl_capi_status_t`.
        status: i32,
    },
}

/// Which NIXL backend plugin moves the bytes (YAML `nixl_backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NixlBackend {
    /// UCX: shared memory / CUDA IPC on one host, RDMA (InfiniBand, RoCE) or TCP across hosts.
    #[default]
    Ucx,
    /// libfabric: AWS EFA.
    Libfabric,
}

impl NixlBackend {
    /// The plugin name NIXL knows the backend by.
    pub fn plugin_name(self) -> &'static str {
        match self {
            NixlBackend::Ucx => "UCX",
            NixlBackend::Libfabric => "LIBFABRIC",
        }
    }
}

impl std::fmt::Display for NixlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.plugin_name())
    }
}

impl std::str::FromStr for NixlBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "ucx" => Ok(NixlBackend::Ucx),
            "libfabric" => Ok(NixlBackend::Libfabric),
            other => Err(format!(
                "unknown NIXL backend `{other}` (expected ucx or libfabric)"
            )),
        }
    }
}

/// Settings of a [`NixlAgent`]; every input comes through here (the crate reads no environment of its own).
#[derive(Clone, Debug)]
pub struct NixlConfig {
    /// `libnixl_capi.so`, the directory holding it, or an unpacked `nixl-cu13` wheel (site-packages);
    /// `None` leaves the search to the system loader (`LD_LIBRARY_PATH`, ldconfig).
    pub library: Option<PathBuf>,
    /// Backend plugin to create.
    pub backend: NixlBackend,
    /// UCX worker count (`num_workers` backend parameter); `None` keeps NIXL's default.
    pub num_workers: Option<u32>,
    /// Registered buffers are allocated in multiples of this, so transfers of similar size share them and
    /// registration (expensive: pinning pages, exchanging keys) happens rarely.
    pub pool_granule: usize,
    /// Bytes of idle registered buffers kept for reuse; beyond it the oldest are deregistered and freed.
    pub pool_cache_bytes: usize,
    /// Ask for UCX's CUDA-IPC READs in the process environment ([`NixlEnv::ucx_cuda_ipc_get_zcopy`]).
    pub cuda_ipc_get_zcopy: bool,
    /// Pause of NIXL's progress thread between polls, in µs: 0 spins a core, which on a small, loaded host
    /// starves the copies themselves (1 GiB DRAM READ on 2 busy cores: 0.3 GB/s at 0, 1.9 GB/s at 100).
    pub progress_delay_us: u64,
    /// A pull of at least [`SLOW_CHECK_MIN_BYTES`] moving slower than this many GB/s logs a warning.
    pub warn_below_gbps: f64,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            library: None,
            backend: NixlBackend::Ucx,
            num_workers: None,
            pool_granule: 64 << 20,
            pool_cache_bytes: 2 << 30,
            cuda_ipc_get_zcopy: true,
            progress_delay_us: 100,
            warn_below_gbps: 1.0,
        }
    }
}

/// Transfers smaller than this are not judged by their rate: fixed costs dominate them.
pub const SLOW_CHECK_MIN_BYTES: u64 = 32 << 20;

/// The C API file to `dlopen` for a `nixl_library` setting: a file as given; in a directory,
/// `libnixl_capi.so` or the wheel's `.nixl_cu13.mesonpy.libs/libnixl_capi.so`, whichever exists
/// (the first when neither does, so the error names a concrete path); unset, the bare name.
pub fn resolve_library(setting: Option<&Path>) -> PathBuf {
    let Some(p) = setting else {
        return PathBuf::from(CAPI_LIBRARY);
    };
    if !p.is_dir() {
        return p.to_path_buf();
    }
    let direct = p.join(CAPI_LIBRARY);
    let wheel = p.join(WHEEL_LIB_DIR).join(CAPI_LIBRARY);
    if !direct.exists() && wheel.exists() {
        wheel
    } else {
        direct
    }
}

/// The plugin directory for a loaded C API: `plugins/` beside it, which is where NIXL itself looks
/// (relative to `libnixl.so`, its neighbour in both the wheel and a source install).
pub fn plugin_dir(capi: &Path) -> Option<PathBuf> {
    let parent = capi.parent().filter(|p| !p.as_os_str().is_empty())?;
    Some(parent.join("plugins"))
}

/// The plugin file of `backend` in `dir`.
pub fn plugin_path(dir: &Path, backend: NixlBackend) -> PathBuf {
    dir.join(format!("libplugin_{}.so", backend.plugin_name()))
}

/// The process environment NIXL and UCX read at agent and backend creation that a worker's settings
/// decide. The library changes no process state: the binary sets these in `main`, before any thread
/// starts (NIXL's plugin manager is a process-wide singleton that reads its directory once).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NixlEnv {
    /// `NIXL_PLUGIN_DIR`: the plugin directory beside the C API of the `nixl_library` setting.
    pub plugin_dir: Option<PathBuf>,
    /// Whether UCX's CUDA-IPC READs are wanted (`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`): without them UCX
    /// emulates CUDA-IPC READs over TCP on hosts without NVLink (~0.4 GB/s instead of ~1,700 on an H200).
    /// UCX warns about the variable where no CUDA transport loads, so the binary sets it on GPU hosts only,
    /// and never over a value the user set.
    pub ucx_cuda_ipc_get_zcopy: bool,
}

impl NixlEnv {
    /// The variable that turns UCX's CUDA-IPC READs on, and its value.
    pub const UCX_CUDA_IPC_GET_ZCOPY: (&'static str, &'static str) =
        ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y");
    /// The variable NIXL finds its backend plugins by.
    pub const PLUGIN_DIR: &'static str = "NIXL_PLUGIN_DIR";

    /// What an agent built with `config` needs of the process environment.
    pub fn for_config(config: &NixlConfig) -> NixlEnv {
        NixlEnv {
            plugin_dir: plugin_dir(&resolve_library(config.library.as_deref())),
            ucx_cuda_ipc_get_zcopy: config.cuda_ipc_get_zcopy,
        }
    }
}

/// The warning to log when a transfer ran far below `floor_gbps`, naming the likely cause; `None` when it
/// was fast enough or too small to judge.
pub fn slow_transfer_warning(
    bytes: u64,
    elapsed: Duration,
    kind: MemKind,
    floor_gbps: f64,
) -> Option<String> {
    if bytes < SLOW_CHECK_MIN_BYTES {
        return None;
    }
    let gbps = bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9;
    if gbps >= floor_gbps {
        return None;
    }
    let cause = match kind {
        MemKind::Vram => "UCX may be emulating CUDA-IPC reads over TCP (no NVLink detected): \
             set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, and run the GPU workers of one node in one PID namespace; \
             or the prefill GPU was busy (the span includes waiting for its per-layer exports)",
        MemKind::Dram => "UCX probably fell back to TCP: check UCX_TLS allows shared memory (sm, cma) on \
             one host, or RDMA across hosts",
    };
    Some(format!(
        "NIXL moved {bytes} bytes at {gbps:.2} GB/s, below the expected {floor_gbps} GB/s: {cause}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_setting_resolves_file_dir_and_wheel() {
        assert_eq!(resolve_library(None), PathBuf::from(CAPI_LIBRARY));
        let f = Path::new("/opt/x/libnixl_capi.so");
        assert_eq!(resolve_library(Some(f)), f);
        let wheel = tempfile::tempdir().unwrap();
        assert_eq!(
            resolve_library(Some(wheel.path())),
            wheel.path().join(CAPI_LIBRARY),
            "an empty directory names the direct path"
        );
        let libs = wheel.path().join(WHEEL_LIB_DIR);
        std::fs::create_dir(&libs).unwrap();
        std::fs::write(libs.join(CAPI_LIBRARY), b"").unwrap();
        assert_eq!(resolve_library(Some(wheel.path())), libs.join(CAPI_LIBRARY));
        assert_eq!(
            plugin_path(
                &plugin_dir(&libs.join(CAPI_LIBRARY)).unwrap(),
                NixlBackend::Libfabric
            ),
            libs.join("plugins/libplugin_LIBFABRIC.so")
        );
        assert_eq!(plugin_dir(Path::new(CAPI_LIBRARY)), None);
    }

    #[test]
    fn missing_library_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = NixlAgent::new(
            "t",
            &NixlConfig {
                library: Some(dir.path().to_path_buf()),
                ..NixlConfig::default()
            },
        )
        .err()
        .expect("no library there");
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.path().join(CAPI_LIBRARY).display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("nixl_library"), "{msg}");
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("ucx".parse::<NixlBackend>(), Ok(NixlBackend::Ucx));
        assert_eq!(
            "LIBFABRIC".parse::<NixlBackend>(),
            Ok(NixlBackend::Libfabric)
        );
        assert!("rdma".parse::<NixlBackend>().is_err());
        assert_eq!(NixlBackend::Libfabric.to_string(), "LIBFABRIC");
    }

    #[test]
    fn slow_transfers_warn_with_the_cause() {
        let s = Duration::from_secs(1);
        assert_eq!(slow_transfer_warning(1 << 20, s, MemKind::Vram, 10.0), None);
        assert_eq!(slow_transfer_warning(4 << 30, s, MemKind::Dram, 1.0), None);
        let w = slow_transfer_warning(512 << 20, s, MemKind::Vram, 100.0).unwrap();
        assert!(w.contains("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"), "{w}");
        let w = slow_transfer_warning(512 << 20, s, MemKind::Dram, 1.0).unwrap();
        assert!(w.contains("UCX_TLS"), "{w}");
    }

    #[test]
    fn the_environment_an_agent_needs_follows_its_settings() {
        let env = NixlEnv::for_config(&NixlConfig {
            library: Some("/opt/nixl/lib/libnixl_capi.so".into()),
            ..NixlConfig::default()
        });
        assert_eq!(env.plugin_dir, Some(PathBuf::from("/opt/nixl/lib/plugins")));
        assert!(env.ucx_cuda_ipc_get_zcopy);
        let env = NixlEnv::for_config(&NixlConfig {
            cuda_ipc_get_zcopy: false,
            ..NixlConfig::default()
        });
        assert_eq!(env, NixlEnv::default(), "the bare name has no folder");
    }
}
