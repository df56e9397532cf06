//! A safe wrapper over one NIXL agent with one backend: registration, metadata exchange and READs.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::ffi::{self, Api};
use super::pool::{MemKind, MemRegion, PoolLease, RegisteredPool};
use super::{plugin_dir, plugin_path, resolve_library, NixlConfig, NixlError};
use crate::KvError;

/// Turns a C API status into a result naming the call.
fn check(call: &'static str, status: ffi::Status) -> Result<(), KvError> {
    if status == 0 {
        Ok(())
    } else {
        Err(NixlError::Call { call, status }.into())
    }
}

fn mem_type(kind: MemKind) -> i32 {
    match kind {
        MemKind::Dram => ffi::MEM_DRAM,
        MemKind::Vram => ffi::MEM_VRAM,
    }
}

/// The agent and backend handles; destroyed when the last user (agent handle, registration, transfer) drops.
pub(crate) struct AgentCore {
    api: Api,
    agent: ffi::Agent,
    backend: ffi::Backend,
    /// Optional arguments naming our backend, for registration and transfers.
    opt: ffi::OptArgs,
    name: String,
    /// Bumped on every (de)registration: peers reload our metadata when it changed.
    md_gen: AtomicU64,
}

// SAFETY: the agent is created with THREAD_SYNC_STRICT, so NIXL serialises calls on it; the handles are
// plain pointers owned by this struct and freed once, in Drop.
unsafe impl Send for AgentCore {}
// SAFETY: as above.
unsafe impl Sync for AgentCore {}

impl AgentCore {
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Registers `region` with the backend until the returned guard drops.
    ///
    /// # Safety
    /// The memory must stay valid (mapped / allocated) until the guard is dropped.
    pub(crate) unsafe fn register(
        self: &Arc<Self>,
        region: MemRegion,
    ) -> Result<Registration, KvError> {
        self.reg_call(region, true)?;
        self.md_gen.fetch_add(1, Ordering::Relaxed);
        Ok(Registration {
            core: Arc::clone(self),
            region,
        })
    }

    fn reg_call(&self, region: MemRegion, register: bool) -> Result<(), KvError> {
        let a = &self.api;
        let mut list: ffi::RegDlist = std::ptr::null_mut();
        // SAFETY: calls follow the C API's contract; the list is destroyed on every path.
        unsafe {
            check(
                "nixl_capi_create_reg_dlist",
                (a.nixl_capi_create_reg_dlist)(mem_type(region.kind), &mut list),
            )?;
            let res = check(
                "nixl_capi_reg_dlist_add_desc",
                (a.nixl_capi_reg_dlist_add_desc)(
                    list,
                    region.addr as usize,
                    region.len as usize,
                    region.device,
                    std::ptr::null(),
                    0,
                ),
            )
            .and_then(|()| {
                if register {
                    check(
                        "nixl_capi_register_mem",
                        (a.nixl_capi_register_mem)(self.agent, list, self.opt),
                    )
                } else {
                    check(
                        "nixl_capi_deregister_mem",
                        (a.nixl_capi_deregister_mem)(self.agent, list, self.opt),
                    )
                }
            });
            (a.nixl_capi_destroy_reg_dlist)(list);
            res
        }
    }

    fn xfer_dlist(&self, regions: &[MemRegion]) -> Result<XferDlist<'_>, KvError> {
        let kind = regions.first().map_or(MemKind::Dram, |r| r.kind);
        if regions.iter().any(|r| r.kind != kind) {
            return Err(KvError::Protocol(
                "a NIXL descriptor list mixes host and device memory".into(),
            ));
        }
        let mut list = XferDlist {
            api: &self.api,
            list: std::ptr::null_mut(),
        };
        // SAFETY: as the C API documents; the wrapper destroys the list.
        unsafe {
            check(
                "nixl_capi_create_xfer_dlist",
                (self.api.nixl_capi_create_xfer_dlist)(mem_type(kind), &mut list.list),
            )?;
            for r in regions {
                check(
                    "nixl_capi_xfer_dlist_add_desc",
                    (self.api.nixl_capi_xfer_dlist_add_desc)(
                        list.list,
                        r.addr as usize,
                        r.len as usize,
                        r.device,
                    ),
                )?;
            }
        }
        Ok(list)
    }
}

impl Drop for AgentCore {
    fn drop(&mut self) {
        let a = &self.api;
        // SAFETY: every registration and transfer holds an Arc to this core, so none is left.
        unsafe {
            (a.nixl_capi_destroy_opt_args)(self.opt);
            (a.nixl_capi_destroy_agent)(self.agent);
            (a.nixl_capi_destroy_backend)(self.backend);
        }
    }
}

/// A descriptor list, destroyed on drop.
struct XferDlist<'a> {
    api: &'a Api,
    list: ffi::XferDlist,
}

impl Drop for XferDlist<'_> {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: created by nixl_capi_create_xfer_dlist, destroyed once.
            unsafe { (self.api.nixl_capi_destroy_xfer_dlist)(self.list) };
        }
    }
}

/// Memory registered with an agent; deregistered on drop.
pub struct Registration {
    core: Arc<AgentCore>,
    region: MemRegion,
}

impl Registration {
    /// The registered region.
    pub fn region(&self) -> MemRegion {
        self.region
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.core.reg_call(self.region, false) {
            tracing::warn!(error = %e, "NIXL deregistration failed");
        }
        self.core.md_gen.fetch_add(1, Ordering::Relaxed);
    }
}

/// A posted READ; released (cancelled if still running) on drop.
pub(crate) struct Xfer {
    core: Arc<AgentCore>,
    req: ffi::XferReq,
    done: bool,
    /// What owns the memory the READ writes into: leaked, never reused, if NIXL cannot cancel a running
    /// READ.
    dest: Option<Box<dyn Send>>,
}

// SAFETY: the request handle is only used through the (thread-safe) agent.
unsafe impl Send for Xfer {}

impl Xfer {
    /// Whether the transfer finished; an error when it failed.
    pub(crate) fn poll(&mut self) -> Result<bool, KvError> {
        if self.done {
            return Ok(true);
        }
        // SAFETY: a live request of this agent.
        let s = unsafe { (self.core.api.nixl_capi_get_xfer_status)(self.core.agent, self.req) };
        match s {
            0 => {
                self.done = true;
                Ok(true)
            }
            ffi::IN_PROG => Ok(false),
            status => Err(NixlError::Call {
                call: "nixl_capi_get_xfer_status",
                status,
            }
            .into()),
        }
    }

    /// Releases the request; `false` when NIXL refused (the transfer may still be writing its buffer).
    fn release(&mut self) -> bool {
        if self.req.is_null() {
            return true;
        }
        let a = &self.core.api;
        // SAFETY: a live request of this agent, released once.
        let ok = unsafe { (a.nixl_capi_release_xfer_req)(self.core.agent, self.req) } == 0;
        if ok {
            // SAFETY: released above, so destroy only frees the wrapper.
            unsafe { (a.nixl_capi_destroy_xfer_req)(self.req) };
            self.req = std::ptr::null_mut();
        }
        ok
    }
}

impl Drop for Xfer {
    fn drop(&mut self) {
        if !self.release() {
            tracing::error!(
                done = self.done,
                "NIXL refused to release a transfer request; leaking the memory it writes into"
            );
            if let Some(d) = self.dest.take() {
                std::mem::forget(d);
            }
        }
    }
}

/// One NIXL agent with one backend and a pool of registered host buffers; cheap to clone. A worker
/// creates one and shares it between its KV server (export buffers) and client (receive buffers).
#[derive(Clone)]
pub struct NixlAgent {
    core: Arc<AgentCore>,
    pool: Arc<RegisteredPool>,
    /// Remote agents whose metadata is loaded, with the generation loaded.
    remotes: Arc<Mutex<HashMap<String, u64>>>,
    warn_below_gbps: f64,
}

impl NixlAgent {
    /// Loads the C API per `config`, creates an agent named `name` plus a unique suffix (two agents of a
    /// process, or of two restarts, never share a name), and its backend. Fails naming the library path,
    /// the missing symbol or the missing plugin. The process environment should hold what
    /// [`super::NixlEnv::for_config`] asks for (the binary sets it before any thread starts).
    pub fn new(name: &str, config: &NixlConfig) -> Result<NixlAgent, KvError> {
        let path = resolve_library(config.library.as_deref());
        let plugins = plugin_dir(&path);
        if let Some(dir) = &plugins {
            let plugin = plugin_path(dir, config.backend);
            if path.exists() && !plugin.exists() {
                return Err(NixlError::Plugin {
                    backend: config.backend,
                    path: plugin,
                }
                .into());
            }
        }
        let api = Api::load(&path)?;
        // SAFETY: no arguments; reports whether the library is NIXL's stub build.
        if unsafe { (api.nixl_capi_is_stub)() } {
            return Err(NixlError::Stub(path).into());
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let full_name = format!(
            "{name}-{}-{:x}-{}",
            std::process::id(),
            nonce & 0xffff_ffff,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let core = create(api, full_name, config)?;
        tracing::info!(agent = core.name, backend = %config.backend, library = %core.api.path.display(), "NIXL agent ready");
        let core = Arc::new(core);
        Ok(NixlAgent {
            pool: Arc::new(RegisteredPool::new(
                Arc::clone(&core),
                config.pool_granule,
                config.pool_cache_bytes,
            )),
            core,
            remotes: Arc::new(Mutex::new(HashMap::new())),
            warn_below_gbps: config.warn_below_gbps,
        })
    }

    /// This agent's name, as peers address it.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// Registers memory this agent does not own (e.g. a GPU backend's device buffers) until the guard drops.
    ///
    /// # Safety
    /// The memory must stay valid until the returned guard is dropped.
    pub unsafe fn register(&self, region: MemRegion) -> Result<Registration, KvError> {
        self.core.register(region)
    }

    /// The metadata generation: changes whenever this agent's registrations change.
    pub(crate) fn md_generation(&self) -> u64 {
        self.core.md_gen.load(Ordering::Relaxed)
    }

    /// This agent's metadata blob (connection info and registrations), for a peer's `load_remote`.
    pub(crate) fn local_md(&self) -> Result<Vec<u8>, KvError> {
        let a = &self.core.api;
        let mut data: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: on success the C API mallocs `len` bytes at `data`, which we copy and free.
        unsafe {
            check(
                "nixl_capi_get_local_md",
                (a.nixl_capi_get_local_md)(self.core.agent, &mut data, &mut len),
            )?;
            let v = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            (a.free)(data);
            Ok(v)
        }
    }

    /// Which generation of `remote`'s metadata is loaded, if any.
    pub(crate) fn remote_generation(&self, remote: &str) -> Option<u64> {
        self.remotes.lock().get(remote).copied()
    }

    /// Loads a peer's metadata blob of generation `gen` (loading again merges new registrations);
    /// checks it belongs to `expect_name`.
    pub(crate) fn load_remote(
        &self,
        expect_name: &str,
        gen: u64,
        md: &[u8],
    ) -> Result<(), KvError> {
        let a = &self.core.api;
        let mut name: *mut c_char = std::ptr::null_mut();
        let mut remotes = self.remotes.lock();
        // SAFETY: `md` is a valid buffer; on success the C API strdups the agent name, which we free.
        let loaded = unsafe {
            check(
                "nixl_capi_load_remote_md",
                (a.nixl_capi_load_remote_md)(
                    self.core.agent,
                    md.as_ptr() as *const c_void,
                    md.len(),
                    &mut name,
                ),
            )?;
            let s = CStr::from_ptr(name).to_string_lossy().into_owned();
            (a.free)(name as *mut c_void);
            s
        };
        if loaded != expect_name {
            return Err(KvError::Protocol(format!(
                "NIXL metadata of agent {loaded}, expected {expect_name}"
            )));
        }
        let e = remotes.entry(loaded).or_insert(gen);
        *e = (*e).max(gen);
        Ok(())
    }

    /// Forgets a peer's metadata (its process went away or restarted).
    pub(crate) fn forget_remote(&self, remote: &str) {
        if self.remotes.lock().remove(remote).is_some() {
            if let Ok(c) = CString::new(remote) {
                // SAFETY: a valid agent and C string.
                unsafe {
                    (self.core.api.nixl_capi_invalidate_remote_md)(self.core.agent, c.as_ptr())
                };
            }
        }
    }

    /// Posts a READ of `remote` (in agent `remote_agent`'s registered memory) into `local` (ours, inside
    /// `dest`), descriptor by descriptor; both lists must pair up in length.
    pub(crate) fn read(
        &self,
        local: &[MemRegion],
        remote: &[MemRegion],
        remote_agent: &str,
        dest: Box<dyn Send>,
    ) -> Result<Xfer, KvError> {
        if local.len() != remote.len() || local.iter().zip(remote).any(|(l, r)| l.len != r.len) {
            return Err(KvError::Protocol(
                "NIXL READ descriptors do not pair up".into(),
            ));
        }
        let a = &self.core.api;
        let l = self.core.xfer_dlist(local)?;
        let r = self.core.xfer_dlist(remote)?;
        let remote_c = CString::new(remote_agent)
            .map_err(|_| KvError::Protocol("NIXL agent name with a NUL byte".into()))?;
        let mut req: ffi::XferReq = std::ptr::null_mut();
        // SAFETY: valid lists and agent; the request is owned by the returned Xfer.
        unsafe {
            check(
                "nixl_capi_create_xfer_req",
                (a.nixl_capi_create_xfer_req)(
                    self.core.agent,
                    ffi::XFER_READ,
                    l.list,
                    r.list,
                    remote_c.as_ptr(),
                    &mut req,
                    self.core.opt,
                ),
            )?;
        }
        let mut x = Xfer {
            core: Arc::clone(&self.core),
            req,
            done: false,
            dest: Some(dest),
        };
        // SAFETY: a fresh request of this agent.
        let s =
            unsafe { (a.nixl_capi_post_xfer_req)(self.core.agent, x.req, std::ptr::null_mut()) };
        match s {
            0 => x.done = true,
            ffi::IN_PROG => {}
            status => {
                return Err(NixlError::Call {
                    call: "nixl_capi_post_xfer_req",
                    status,
                }
                .into())
            }
        }
        Ok(x)
    }

    /// A registered host buffer of at least `len` bytes from this agent's pool.
    pub(crate) fn lease(&self, len: usize) -> Result<PoolLease, KvError> {
        self.pool.take(len)
    }

    /// Rate below which a large transfer logs a warning.
    pub(crate) fn warn_below_gbps(&self) -> f64 {
        self.warn_below_gbps
    }
}

/// Creates the agent and its backend, cleaning up on every failure.
fn create(api: Api, name: String, config: &NixlConfig) -> Result<AgentCore, KvError> {
    let cname = CString::new(name.clone())
        .map_err(|_| KvError::Protocol("NIXL agent name with a NUL byte".into()))?;
    let cfg = ffi::AgentConfig {
        enable_prog_thread: true,
        enable_listen_thread: false,
        listen_port: 0,
        thread_sync: ffi::THREAD_SYNC_STRICT,
        num_workers: 0,
        pthr_delay_us: config.progress_delay_us,
        lthr_delay_us: 0,
        capture_telemetry: false,
    };
    let mut agent: ffi::Agent = std::ptr::null_mut();
    // SAFETY: valid name and config; on failure nothing was created.
    unsafe {
        check(
            "nixl_capi_create_configured_agent",
            (api.nixl_capi_create_configured_agent)(cname.as_ptr(), &cfg, &mut agent),
        )?;
    }
    let res = (|| {
        let plugin = config.backend.plugin_name();
        if !available_plugins(&api, agent)?.iter().any(|p| p == plugin) {
            return Err(NixlError::Plugin {
                backend: config.backend,
                path: plugin_dir(&api.path)
                    .map(|d| plugin_path(&d, config.backend))
                    .unwrap_or_else(|| format!("libplugin_{plugin}.so").into()),
            }
            .into());
        }
        let cplugin = CString::new(plugin).expect("static name");
        let mut mems: ffi::MemList = std::ptr::null_mut();
        let mut params: ffi::Params = std::ptr::null_mut();
        let mut backend: ffi::Backend = std::ptr::null_mut();
        let mut opt: ffi::OptArgs = std::ptr::null_mut();
        // SAFETY: as the C API documents; params and mem list are destroyed here, backend and opt args
        // by the core.
        unsafe {
            check(
                "nixl_capi_get_plugin_params",
                (api.nixl_capi_get_plugin_params)(agent, cplugin.as_ptr(), &mut mems, &mut params),
            )?;
            let mut res = Ok(());
            if let Some(n) = config.num_workers {
                let k = CString::new("num_workers").expect("static");
                let v = CString::new(n.to_string()).expect("digits");
                res = check(
                    "nixl_capi_params_add",
                    (api.nixl_capi_params_add)(params, k.as_ptr(), v.as_ptr()),
                );
            }
            if res.is_ok() {
                res = check(
                    "nixl_capi_create_backend",
                    (api.nixl_capi_create_backend)(agent, cplugin.as_ptr(), params, &mut backend),
                );
            }
            (api.nixl_capi_destroy_params)(params);
            (api.nixl_capi_destroy_mem_list)(mems);
            res?;
            let res = check(
                "nixl_capi_create_opt_args",
                (api.nixl_capi_create_opt_args)(&mut opt),
            )
            .and_then(|()| {
                check(
                    "nixl_capi_opt_args_add_backend",
                    (api.nixl_capi_opt_args_add_backend)(opt, backend),
                )
            });
            if let Err(e) = res {
                if !opt.is_null() {
                    (api.nixl_capi_destroy_opt_args)(opt);
                }
                (api.nixl_capi_destroy_backend)(backend);
                return Err(e);
            }
        }
        Ok((backend, opt))
    })();
    match res {
        Ok((backend, opt)) => Ok(AgentCore {
            api,
            agent,
            backend,
            opt,
            name,
            md_gen: AtomicU64::new(0),
        }),
        Err(e) => {
            // SAFETY: the agent was created above and nothing else refers to it.
            unsafe { (api.nixl_capi_destroy_agent)(agent) };
            Err(e)
        }
    }
}

/// The backend plugins NIXL found.
fn available_plugins(api: &Api, agent: ffi::Agent) -> Result<Vec<String>, KvError> {
    let mut list: ffi::StringList = std::ptr::null_mut();
    // SAFETY: as the C API documents; the list is destroyed before returning.
    unsafe {
        check(
            "nixl_capi_get_available_plugins",
            (api.nixl_capi_get_available_plugins)(agent, &mut list),
        )?;
        let mut n = 0usize;
        let mut out = Vec::new();
        let res = check(
            "nixl_capi_string_list_size",
            (api.nixl_capi_string_list_size)(list, &mut n),
        );
        if res.is_ok() {
            for i in 0..n {
                let mut s: *const c_char = std::ptr::null();
                if (api.nixl_capi_string_list_get)(list, i, &mut s) == 0 && !s.is_null() {
                    out.push(CStr::from_ptr(s).to_string_lossy().into_owned());
                }
            }
        }
        (api.nixl_capi_destroy_string_list)(list);
        res.map(|()| out)
    }
}
