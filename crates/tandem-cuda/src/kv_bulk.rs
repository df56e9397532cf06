//! Bulk, asynchronous KV movement for P/D transfers.
//!
//! Export gathers a request's blocks of each layer into one contiguous device buffer (`kv_gather`,
//! one launch per layer) and copies it into page-locked host memory, all on a transfer stream of its
//! own (the blocks' writes are already complete: see [`KvMover::export`]); each layer gets an event, so a reader on another
//! thread takes layer 0 while later layers are still being copied, and the engine thread only
//! enqueues. Import is the mirror: a host layer buffer is copied up and scattered into its blocks
//! (`kv_scatter`) on the transfer stream, and [`KvMover::fence`] makes the compute stream wait for
//! every import so far before the next step reads the cache. Host buffers come from a
//! [`PinnedPool`], so copies run at bus speed and nothing is page-locked per request.
//!
//! For zero-copy transports (NIXL reading GPU memory) the same kernels gather into, and scatter from,
//! a slice of the device staging region ([`KvMover::staging`]) instead, and no byte crosses the bus.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as drv_result;
use cudarc::driver::sys as drv;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use tandem_engine::{
    BackendError, HostBuf, HostMem, HostPool, KvExport, KvStaging, StagedLayer, StagingKind,
    StagingMem, StagingSlice,
};
use tandem_model::KvLayout;

use crate::error::CudaError;
use crate::memory::DeviceBuf;

/// Pinned buffers are handed out in multiples of this, so buffers of nearby sizes are reused.
const PINNED_GRAIN: usize = 2 << 20;

/// Page-locked bytes a pool keeps cached for reuse; buffers returned beyond this are freed.
const PINNED_CACHE_LIMIT: usize = 8 << 30;

/// Threads per block of the gather/scatter kernels.
const COPY_THREADS: u32 = 256;

/// A pool of page-locked host buffers, reused across transfers (page-locking is slow: milliseconds
/// per hundred megabytes).
pub struct PinnedPool {
    ctx: Arc<CudaContext>,
    /// Free buffers by rounded size, and their total bytes: one lock, taken by transport threads
    /// (taking) and the engine thread (returning) alike.
    free: Mutex<FreeList>,
}

/// The pool's cached buffers.
#[derive(Default)]
struct FreeList {
    by_size: HashMap<usize, Vec<usize>>,
    bytes: usize,
}

impl PinnedPool {
    /// An empty pool of the context's page-locked memory.
    pub fn new(ctx: &Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Self {
            ctx: ctx.clone(),
            free: Mutex::new(FreeList::default()),
        })
    }

    fn alloc(&self, class: usize) -> Result<usize, CudaError> {
        {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ptr) = free.by_size.get_mut(&class).and_then(Vec::pop) {
                free.bytes -= class;
                return Ok(ptr);
            }
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: cuMemHostAlloc of a non-zero size; portable so any context may copy from it.
        let ptr = unsafe { drv_result::malloc_host(class, drv::CU_MEMHOSTALLOC_PORTABLE) }?;
        Ok(ptr as usize)
    }

    fn put(&self, ptr: usize, class: usize) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.bytes + class <= PINNED_CACHE_LIMIT {
            free.bytes += class;
            free.by_size.entry(class).or_default().push(ptr);
        } else {
            drop(free);
            free_pinned(&self.ctx, ptr);
        }
    }
}

fn free_pinned(ctx: &Arc<CudaContext>, ptr: usize) {
    if ctx.bind_to_thread().is_ok() {
        // SAFETY: allocated by cuMemHostAlloc and freed once (it left the pool).
        if let Err(e) = unsafe { drv_result::free_host(ptr as *mut std::ffi::c_void) } {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        let free = std::mem::take(&mut *self.free.lock().unwrap_or_else(|e| e.into_inner()));
        for ptr in free.by_size.into_values().flatten() {
            free_pinned(&self.ctx, ptr);
        }
    }
}

/// The pool behind an `Arc`, so buffers can return to it when dropped.
#[derive(Clone)]
pub struct SharedPinnedPool(pub Arc<PinnedPool>);

impl SharedPinnedPool {
    /// A page-locked buffer of exactly `len` bytes (contents unspecified).
    pub fn take_buf(&self, len: usize) -> Result<HostBuf, CudaError> {
        let class = len.max(1).div_ceil(PINNED_GRAIN) * PINNED_GRAIN;
        let ptr = self.0.alloc(class)?;
        Ok(HostBuf::new(Box::new(PinnedMem {
            pool: self.0.clone(),
            ptr,
            len,
            class,
        })))
    }
}

impl HostPool for SharedPinnedPool {
    fn take(&self, len: usize) -> Result<HostBuf, BackendError> {
        self.take_buf(len)
            .map_err(|e| e.into_transfer("page-locked host buffer"))
    }
}

/// One pooled page-locked buffer.
struct PinnedMem {
    pool: Arc<PinnedPool>,
    ptr: usize,
    len: usize,
    class: usize,
}

impl HostMem for PinnedMem {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `class >= len` bytes and lives until drop.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

impl Drop for PinnedMem {
    fn drop(&mut self) {
        self.pool.put(self.ptr, self.class);
    }
}

/// Where an export lands: a pooled page-locked host buffer, or a slice of device staging memory.
enum ExportDest {
    Host { buf: HostBuf, layer_bytes: usize },
    Staged(StagingSlice),
}

/// An export under way: its destination being filled layer by layer, an event per layer.
struct CudaExport {
    dest: ExportDest,
    events: Vec<CudaEvent>,
}

impl KvExport for CudaExport {
    fn num_layers(&self) -> usize {
        self.events.len()
    }

    fn layer(&self, layer: usize) -> Result<&[u8], BackendError> {
        self.wait_layer(layer)?;
        match &self.dest {
            ExportDest::Host { buf, layer_bytes } => {
                Ok(&buf.as_slice()[layer * layer_bytes..(layer + 1) * layer_bytes])
            }
            ExportDest::Staged(_) => Err(BackendError::fatal(
                "this KV export is in GPU memory: only a zero-copy transport (nixl) reads it",
            )),
        }
    }

    fn wait_layer(&self, layer: usize) -> Result<(), BackendError> {
        let ev = self.events.get(layer).ok_or_else(|| {
            BackendError::fatal(format!(
                "layer {layer} outside an export of {} layers",
                self.events.len()
            ))
        })?;
        ev.synchronize().map_err(|e| {
            CudaError::from(e).into_transfer(format_args!("KV export of layer {layer}"))
        })
    }

    fn staged(&self) -> Option<&StagingSlice> {
        match &self.dest {
            ExportDest::Staged(s) => Some(s),
            ExportDest::Host { .. } => None,
        }
    }
}

impl Drop for CudaExport {
    fn drop(&mut self) {
        // The copies write into the destination: it may be reused only once they are done.
        if let Some(last) = self.events.last() {
            if let Err(e) = last.synchronize() {
                tracing::warn!(error = %e, "KV export failed while being dropped");
            }
        }
    }
}

// SAFETY: the events are only synchronized/queried (thread-safe driver calls, each binding the
// context first) and the buffer is read only after its layer's event completed.
unsafe impl Send for CudaExport {}
unsafe impl Sync for CudaExport {}

/// Device memory for zero-copy transfers: one allocation, registered once by a transport.
struct DeviceStaging {
    buf: DeviceBuf,
    ordinal: u32,
}

impl StagingMem for DeviceStaging {
    fn addr(&self) -> u64 {
        self.buf.ptr
    }
    fn size(&self) -> usize {
        self.buf.bytes
    }
    fn kind(&self) -> StagingKind {
        StagingKind::Device(self.ordinal)
    }
}

/// Moves whole layers of a request's KV between the paged cache and host buffers, off the compute
/// stream.
pub struct KvMover {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather: CudaFunction,
    scatter: CudaFunction,
    pool: SharedPinnedPool,
    /// One layer of the largest request (the transfer stream copies one layer at a time).
    staging: DeviceBuf,
    staging_bytes: usize,
    /// Cache block ids of the current copy.
    ids: DeviceBuf,
    max_blocks: usize,
    /// What imports still read (host buffers, staging slices), with the event that ends the read,
    /// oldest first.
    in_flight: Vec<(CudaEvent, Box<dyn Send>)>,
}

// SAFETY: owned by the engine thread's backend; moved between threads, never shared.
unsafe impl Send for KvMover {}

impl KvMover {
    /// A mover for requests of up to `max_blocks` blocks of `layout`.
    pub fn new(
        ctx: &Arc<CudaContext>,
        module: &Arc<CudaModule>,
        layout: &KvLayout,
        max_blocks: usize,
    ) -> Result<Self, CudaError> {
        let staging_bytes = max_blocks * layout.block_bytes();
        Ok(Self {
            ctx: ctx.clone(),
            stream: ctx.new_stream()?,
            gather: module.load_function("kv_gather")?,
            scatter: module.load_function("kv_scatter")?,
            pool: SharedPinnedPool(PinnedPool::new(ctx)),
            staging: DeviceBuf::new(ctx, staging_bytes)?,
            staging_bytes,
            ids: DeviceBuf::new(ctx, max_blocks * 4)?,
            max_blocks,
            in_flight: Vec::new(),
        })
    }

    /// The pool transports fill import buffers from.
    pub fn pool(&self) -> Arc<dyn HostPool> {
        Arc::new(self.pool.clone())
    }

    fn upload_ids(&self, blocks: &[u32], num_blocks: usize) -> Result<(), CudaError> {
        if blocks.len() > self.max_blocks || blocks.iter().any(|&b| b as usize >= num_blocks) {
            return Err(CudaError::Batch(format!(
                "KV transfer of {} blocks (ids below {num_blocks}, at most {} blocks)",
                blocks.len(),
                self.max_blocks
            )));
        }
        // SAFETY: `ids` holds max_blocks ints. From pageable memory the driver stages the bytes
        // before returning, so `blocks` may go right after; the stream orders the copy before the
        // kernels that read it and after those that read the previous ids.
        unsafe {
            drv_result::memcpy_htod_async(self.ids.ptr, as_bytes(blocks), self.stream.cu_stream())
        }?;
        Ok(())
    }

    /// Launches `f` (kv_gather or kv_scatter) over `n` blocks between the cache layer at `cache_layer`
    /// and the contiguous buffer at `buf`.
    fn launch_copy(
        &self,
        f: &CudaFunction,
        cache_layer: u64,
        buf: u64,
        n: usize,
        block_vecs: u64,
    ) -> Result<(), CudaError> {
        let mut b = self.stream.launch_builder(f);
        let ids = self.ids.ptr;
        b.arg(&cache_layer);
        b.arg(&ids);
        b.arg(&buf);
        b.arg(&block_vecs);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (COPY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (cache, ids, buffer, block_vecs) is kv_gather's and kv_scatter's signature; ids
        // holds n valid block ids (checked on upload) and every caller's buffer holds n blocks.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `bytes` of device memory for zero-copy transfers, on this mover's GPU.
    pub fn staging(&self, bytes: usize) -> Result<Arc<KvStaging>, CudaError> {
        let buf = DeviceBuf::new(&self.ctx, bytes)?;
        Ok(KvStaging::new(Box::new(DeviceStaging {
            buf,
            ordinal: self.ctx.ordinal() as u32,
        })))
    }

    /// Whether `kind` is this mover's GPU.
    fn is_own(&self, kind: StagingKind) -> bool {
        kind == StagingKind::Device(self.ctx.ordinal() as u32)
    }

    /// Enqueues the export of `blocks` of every layer; `layer_base(l)` is layer l's cache address.
    /// Into `staged` when given (a slice of this mover's staging), else into a pooled pinned buffer.
    pub fn export(
        &mut self,
        layout: &KvLayout,
        layer_base: impl Fn(usize) -> u64,
        blocks: &[u32],
        staged: Option<StagingSlice>,
    ) -> Result<Box<dyn KvExport>, CudaError> {
        self.ctx.bind_to_thread()?;
        let bb = layout.block_bytes();
        let layer_bytes = blocks.len() * bb;
        let mut dest = match staged {
            Some(s) if self.is_own(s.kind()) && s.len() == layout.n_layers * layer_bytes => {
                ExportDest::Staged(s)
            }
            Some(s) => {
                return Err(CudaError::Batch(format!(
                    "staged export of {} bytes into {:?} staging of {} bytes",
                    layout.n_layers * layer_bytes,
                    s.kind(),
                    s.len()
                )))
            }
            None => ExportDest::Host {
                buf: self.pool.take_buf(layout.n_layers * layer_bytes)?,
                layer_bytes,
            },
        };
        // No wait for the compute stream: the steps that wrote these blocks have finished (the engine
        // read their sampled tokens back before it could pin the request), and pinned blocks are written
        // by no later step. Joining it would queue the gather behind whatever step was launched since —
        // a whole prefill batch, ~100 ms under load.
        self.upload_ids(blocks, layout.num_blocks)?;
        let mut events = Vec::with_capacity(layout.n_layers);
        let vecs = (bb / 16) as u64;
        for l in 0..layout.n_layers {
            if !blocks.is_empty() {
                match &mut dest {
                    ExportDest::Staged(s) => {
                        let at = s.addr() + (l * layer_bytes) as u64;
                        self.launch_copy(&self.gather, layer_base(l), at, blocks.len(), vecs)?;
                    }
                    ExportDest::Host { buf, .. } => {
                        let staging = self.staging.ptr;
                        self.launch_copy(&self.gather, layer_base(l), staging, blocks.len(), vecs)?;
                        // SAFETY: the pinned buffer outlives the copy (CudaExport waits in Drop), and
                        // staging holds layer_bytes <= staging_bytes.
                        unsafe {
                            drv_result::memcpy_dtoh_async(
                                &mut buf.as_mut_slice()[l * layer_bytes..(l + 1) * layer_bytes],
                                staging,
                                self.stream.cu_stream(),
                            )
                        }?;
                    }
                }
            }
            events.push(
                self.stream
                    .record_event(Some(drv::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?,
            );
        }
        Ok(Box::new(CudaExport { dest, events }))
    }

    /// Enqueues the import of `data` into `blocks` of the layer at `cache_layer`.
    pub fn import(
        &mut self,
        compute: &CudaStream,
        layout: &KvLayout,
        cache_layer: u64,
        blocks: &[u32],
        data: HostBuf,
    ) -> Result<(), CudaError> {
        if data.len() > self.staging_bytes {
            return Err(CudaError::Batch(format!(
                "KV import of {} bytes past the {}-byte staging buffer",
                data.len(),
                self.staging_bytes
            )));
        }
        self.begin_import(compute, layout, blocks, data.len())?;
        // SAFETY: `data` is kept in `in_flight` until the event after this copy has completed.
        unsafe {
            drv_result::memcpy_htod_async(
                self.staging.ptr,
                data.as_slice(),
                self.stream.cu_stream(),
            )
        }?;
        let staging = self.staging.ptr;
        self.end_import(layout, cache_layer, staging, blocks, Box::new(data))
    }

    /// Enqueues the import of a layer that landed in this mover's staging memory: one scatter, no
    /// host copy.
    pub fn import_staged(
        &mut self,
        compute: &CudaStream,
        layout: &KvLayout,
        cache_layer: u64,
        blocks: &[u32],
        src: StagedLayer,
    ) -> Result<(), CudaError> {
        if !self.is_own(src.slice.kind()) || src.offset + src.len > src.slice.len() {
            return Err(CudaError::Batch(format!(
                "staged KV import from {:?} memory ({} bytes at {}) on GPU {}",
                src.slice.kind(),
                src.len,
                src.offset,
                self.ctx.ordinal()
            )));
        }
        self.begin_import(compute, layout, blocks, src.len)?;
        let at = src.addr();
        self.end_import(layout, cache_layer, at, blocks, Box::new(src))
    }

    /// Checks an import's size and orders it after the compute stream, with its block ids uploaded.
    fn begin_import(
        &mut self,
        compute: &CudaStream,
        layout: &KvLayout,
        blocks: &[u32],
        len: usize,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        if len != blocks.len() * layout.block_bytes() {
            return Err(CudaError::Batch(format!(
                "KV import of {} blocks got {len} bytes",
                blocks.len()
            )));
        }
        self.reap()?;
        // The blocks may have been read by earlier steps of other sequences.
        self.stream.join(compute)?;
        self.upload_ids(blocks, layout.num_blocks)
    }

    /// Scatters the layer at device address `src` into its blocks and keeps `keep` until that is done.
    fn end_import(
        &mut self,
        layout: &KvLayout,
        cache_layer: u64,
        src: u64,
        blocks: &[u32],
        keep: Box<dyn Send>,
    ) -> Result<(), CudaError> {
        let vecs = (layout.block_bytes() / 16) as u64;
        self.launch_copy(&self.scatter, cache_layer, src, blocks.len(), vecs)?;
        let ev = self.stream.record_event(None)?;
        self.in_flight.push((ev, keep));
        Ok(())
    }

    /// Makes the compute stream wait for every import enqueued so far (no host wait).
    pub fn fence(&mut self, compute: &CudaStream) -> Result<(), CudaError> {
        // Imports run in order on one stream: the newest one still in flight ends after all the others
        // (none in flight: all are done).
        if let Some((ev, _)) = self.in_flight.last() {
            compute.wait(ev)?;
        }
        self.reap()
    }

    /// Returns the buffers of finished imports to the pool.
    fn reap(&mut self) -> Result<(), CudaError> {
        let mut err = None;
        self.in_flight.retain(|(ev, _)| match ev.try_is_complete() {
            Ok(done) => !done,
            Err(e) => {
                err = Some(e);
                true
            }
        });
        match err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

impl Drop for KvMover {
    fn drop(&mut self) {
        // Uploads read the in-flight buffers; they go back to the pool only once done.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(error = %e, "KV transfer stream failed at shutdown");
        }
    }
}

fn as_bytes(ids: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and any byte is a valid u8.
    unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u8, std::mem::size_of_val(ids)) }
}
