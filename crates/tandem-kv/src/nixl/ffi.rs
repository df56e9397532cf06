//! Hand-written bindings to the few functions of NIXL's C API (`libnixl_capi.so`) this crate calls,
//! resolved with `dlopen` at run time so the crate builds and runs where NIXL is not installed.
//!
//! Signatures follow `src/bindings/rust/wrapper.h` of NIXL 1.5 (ai-dynamo/nixl).

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};

use super::NixlError;

/// `nixl_capi_status_t`: 0 success, 1 in progress, negative an error.
pub(crate) type Status = c_int;
/// The transfer is still running (`NIXL_CAPI_IN_PROG`).
pub(crate) const IN_PROG: Status = 1;

/// Opaque handles of the C API.
pub(crate) type Agent = *mut c_void;
pub(crate) type Params = *mut c_void;
pub(crate) type MemList = *mut c_void;
pub(crate) type Backend = *mut c_void;
pub(crate) type OptArgs = *mut c_void;
pub(crate) type XferDlist = *mut c_void;
pub(crate) type RegDlist = *mut c_void;
pub(crate) type XferReq = *mut c_void;
pub(crate) type StringList = *mut c_void;

/// `nixl_capi_mem_type_t` values used here.
pub(crate) const MEM_DRAM: c_int = 0;
pub(crate) const MEM_VRAM: c_int = 1;
/// `NIXL_CAPI_XFER_OP_READ`.
pub(crate) const XFER_READ: c_int = 0;
/// `NIXL_CAPI_THREAD_SYNC_STRICT`: every agent call takes the agent's lock (pulls run concurrently).
pub(crate) const THREAD_SYNC_STRICT: c_int = 1;

/// `nixl_capi_agent_config_t` (C layout).
#[repr(C)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    pub num_workers: c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

macro_rules! api {
    ($($name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The resolved entry points; the library stays loaded as long as this lives.
        #[allow(non_snake_case)]
        pub(crate) struct Api {
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            /// libc's `free`, for the buffers the C API `malloc`s for us (metadata, agent names).
            pub(crate) free: unsafe extern "C" fn(*mut c_void),
            /// The file that was loaded, for messages.
            pub(crate) path: PathBuf,
            _lib: libloading::Library,
        }

        impl Api {
            /// Loads `path` and resolves every symbol, naming the first one missing.
            pub(crate) fn load(path: &Path) -> Result<Api, NixlError> {
                // SAFETY: loading runs the library's initialisers; NIXL's are plain C++ static constructors.
                let lib = unsafe { libloading::Library::new(path) }.map_err(|e| NixlError::Library {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })?;
                // SAFETY: each symbol is cast to the signature NIXL's C header declares for it.
                unsafe {
                    Ok(Api {
                        $($name: *lib.get(concat!(stringify!($name), "\0").as_bytes()).map_err(|e| NixlError::Symbol {
                            path: path.to_path_buf(),
                            symbol: stringify!($name),
                            reason: e.to_string(),
                        })?,)*
                        free: *lib.get(b"free\0").map_err(|e| NixlError::Symbol {
                            path: path.to_path_buf(),
                            symbol: "free",
                            reason: e.to_string(),
                        })?,
                        path: path.to_path_buf(),
                        _lib: lib,
                    })
                }
            }
        }
    };
}

api! {
    nixl_capi_is_stub: fn() -> bool;
    nixl_capi_create_configured_agent: fn(*const c_char, *const AgentConfig, *mut Agent) -> Status;
    nixl_capi_destroy_agent: fn(Agent) -> Status;
    nixl_capi_get_available_plugins: fn(Agent, *mut StringList) -> Status;
    nixl_capi_string_list_size: fn(StringList, *mut usize) -> Status;
    nixl_capi_string_list_get: fn(StringList, usize, *mut *const c_char) -> Status;
    nixl_capi_destroy_string_list: fn(StringList) -> Status;
    nixl_capi_get_plugin_params: fn(Agent, *const c_char, *mut MemList, *mut Params) -> Status;
    nixl_capi_params_add: fn(Params, *const c_char, *const c_char) -> Status;
    nixl_capi_destroy_params: fn(Params) -> Status;
    nixl_capi_destroy_mem_list: fn(MemList) -> Status;
    nixl_capi_create_backend: fn(Agent, *const c_char, Params, *mut Backend) -> Status;
    nixl_capi_destroy_backend: fn(Backend) -> Status;
    nixl_capi_create_opt_args: fn(*mut OptArgs) -> Status;
    nixl_capi_opt_args_add_backend: fn(OptArgs, Backend) -> Status;
    nixl_capi_destroy_opt_args: fn(OptArgs) -> Status;
    nixl_capi_create_reg_dlist: fn(c_int, *mut RegDlist) -> Status;
    nixl_capi_reg_dlist_add_desc: fn(RegDlist, usize, usize, u64, *const c_void, usize) -> Status;
    nixl_capi_destroy_reg_dlist: fn(RegDlist) -> Status;
    nixl_capi_register_mem: fn(Agent, RegDlist, OptArgs) -> Status;
    nixl_capi_deregister_mem: fn(Agent, RegDlist, OptArgs) -> Status;
    nixl_capi_get_local_md: fn(Agent, *mut *mut c_void, *mut usize) -> Status;
    nixl_capi_load_remote_md: fn(Agent, *const c_void, usize, *mut *mut c_char) -> Status;
    nixl_capi_invalidate_remote_md: fn(Agent, *const c_char) -> Status;
    nixl_capi_create_xfer_dlist: fn(c_int, *mut XferDlist) -> Status;
    nixl_capi_xfer_dlist_add_desc: fn(XferDlist, usize, usize, u64) -> Status;
    nixl_capi_destroy_xfer_dlist: fn(XferDlist) -> Status;
    nixl_capi_create_xfer_req: fn(Agent, c_int, XferDlist, XferDlist, *const c_char, *mut XferReq, OptArgs) -> Status;
    nixl_capi_post_xfer_req: fn(Agent, XferReq, OptArgs) -> Status;
    nixl_capi_get_xfer_status: fn(Agent, XferReq) -> Status;
    nixl_capi_release_xfer_req: fn(Agent, XferReq) -> Status;
    nixl_capi_destroy_xfer_req: fn(XferReq) -> Status;
}
