//! The engine's side of a worker's KV transfers: the [`KvSource`] a prefill worker's KV server reads
//! pinned prefills from, the [`KvSink`] a decode worker pulls into, and the staging memory both register
//! with NIXL once.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;
use tandem_engine::{
    EngineError, EngineHandle, ExportedKv, HostBuf, HostPool, KvStaging, Pending, StagedLayer,
    StagingKind, StagingSlice,
};
use tandem_kv::{
    KvError, KvSink, KvSource, MemKind, MemRegion, NixlAgent, Registration, WireLayout,
};

use crate::error::ClusterError;
/// Pinned prefills this worker serves to decode workers, by transfer id.
pub(crate) struct EngineSource {
    pub(crate) engine: EngineHandle,
    pub(crate) pins: Mutex<HashMap<u64, PinnedKv>>,
}

/// One pinned prefill: the engine request holding the pin and a copy of its KV.
pub(crate) struct PinnedKv {
    pub(crate) request: u64,
    pub(crate) kv: Arc<ExportedKv>,
}

impl EngineSource {
    pub(crate) fn pinned_blocks(&self) -> usize {
        self.pins.lock().values().map(|p| p.kv.num_blocks).sum()
    }
}

impl EngineSource {
    /// The pinned export of `transfer_id`, held past the lock so a wait on it blocks no other pull.
    fn export(&self, transfer_id: u64) -> Result<Arc<ExportedKv>, KvError> {
        self.pins
            .lock()
            .get(&transfer_id)
            .map(|p| Arc::clone(&p.kv))
            .ok_or(KvError::UnknownTransfer(transfer_id))
    }
}

impl KvSource for EngineSource {
    fn copy_blocks(
        &self,
        transfer_id: u64,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), KvError> {
        let kv = self.export(transfer_id)?;
        let n = kv.layout.block_bytes();
        if layer >= kv.layout.n_layers || out.len() != blocks.len() * n {
            return Err(KvError::Source(format!(
                "bad copy: layer {layer}, {} blocks into {} bytes",
                blocks.len(),
                out.len()
            )));
        }
        // Waits for the layer's asynchronous export to land (a GPU copy under way).
        let bytes = kv
            .layer(layer)
            .map_err(|e| KvError::Source(e.to_string()))?;
        for (dst, &b) in out.chunks_exact_mut(n).zip(blocks) {
            if b as usize >= kv.num_blocks {
                return Err(KvError::Source(format!(
                    "block {b} outside the transfer's {} blocks",
                    kv.num_blocks
                )));
            }
            let at = b as usize * n;
            dst.copy_from_slice(&bytes[at..at + n]);
        }
        Ok(())
    }

    fn staged(&self, transfer_id: u64) -> Result<Option<MemRegion>, KvError> {
        Ok(self
            .export(transfer_id)?
            .staged()
            .map(|s| staging_region(s.kind(), s.addr(), s.len())))
    }

    fn wait_staged(&self, transfer_id: u64, layer: usize) -> Result<(), KvError> {
        let kv = self.export(transfer_id)?;
        kv.wait_layer(layer)
            .map_err(|e| KvError::Source(e.to_string()))
    }

    fn release(&self, transfer_id: u64, _blocks: &[u32]) {
        if let Some(p) = self.pins.lock().remove(&transfer_id) {
            self.engine.release_pin(p.request);
        }
    }
}

/// Collects pulled blocks layer by layer in the engine's host buffers (page-locked on a GPU) and hands
/// each complete layer to the engine as one import; the engine applies them before `start_decoding`.
pub(crate) struct EngineSink {
    engine: EngineHandle,
    request: u64,
    block_bytes: usize,
    /// Per layer, the blocks pulled of it, as indices into the transfer's block list (those before were
    /// cached here or lie behind the layer's sliding window).
    wanted: Vec<Range<usize>>,
    /// One buffer per layer, taken when the layer's first bytes arrive and given to the engine
    /// when it is complete.
    layers: Vec<Mutex<Option<HostBuf>>>,
    pool: Arc<dyn HostPool>,
    /// The engine's staging memory, registered with the transport, which a zero-copy pull lands in.
    staging: Option<Arc<KvStaging>>,
    /// The slice of it this pull landed in; each imported layer holds it until copied out.
    landing: Mutex<Option<Arc<StagingSlice>>>,
    pending: Mutex<Vec<Pending<()>>>,
}

impl EngineSink {
    pub(crate) fn new(
        engine: &EngineHandle,
        request: u64,
        layout: &WireLayout,
        wanted: Vec<Range<usize>>,
        staging: Option<Arc<KvStaging>>,
    ) -> Self {
        let block_bytes = layout.block_bytes();
        EngineSink {
            engine: engine.clone(),
            request,
            block_bytes,
            layers: (0..layout.n_layers).map(|_| Mutex::new(None)).collect(),
            wanted,
            pool: engine.host_pool(),
            staging,
            landing: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
        }
    }

    /// Bytes pulled of `layer`.
    fn layer_bytes(&self, layer: usize) -> usize {
        self.wanted
            .get(layer)
            .map_or(0, |w| w.len() * self.block_bytes)
    }

    /// Waits until the engine has taken every layer handed over so far.
    pub(crate) async fn settle(&self) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut *self.pending.lock());
        for p in pending {
            p.wait().await?;
        }
        Ok(())
    }
}

impl KvSink for EngineSink {
    fn write(&self, layer: usize, first_block: usize, data: &[u8]) -> Result<(), KvError> {
        let slot = self
            .layers
            .get(layer)
            .ok_or_else(|| KvError::Sink(format!("layer {layer} out of range")))?;
        let layer_bytes = self.layer_bytes(layer);
        let at = first_block
            .checked_sub(self.wanted[layer].start)
            .map(|i| i * self.block_bytes)
            .filter(|&at| {
                at + data.len() <= layer_bytes && data.len().is_multiple_of(self.block_bytes)
            })
            .ok_or_else(|| {
                KvError::Sink(format!(
                    "{} bytes at block {first_block} do not fit the pulled blocks",
                    data.len()
                ))
            })?;
        let mut slot = slot.lock();
        if slot.is_none() {
            *slot = Some(
                self.pool
                    .take(layer_bytes)
                    .map_err(|e| KvError::Sink(e.to_string()))?,
            );
        }
        let buf = slot.as_mut().expect("taken above");
        buf.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn layer_complete(&self, layer: usize) -> Result<(), KvError> {
        if self.layer_bytes(layer) == 0 {
            return Ok(());
        }
        let buf = self
            .layers
            .get(layer)
            .and_then(|s| s.lock().take())
            .ok_or_else(|| KvError::Sink(format!("layer {layer} completed without data")))?;
        let p = self.engine.import_layer(self.request, layer, buf);
        self.pending.lock().push(p);
        Ok(())
    }

    fn landing(&self, len: usize) -> Result<Option<MemRegion>, KvError> {
        let Some(slice) = self.staging.as_ref().and_then(|s| s.take(len)) else {
            return Ok(None);
        };
        let region = staging_region(slice.kind(), slice.addr(), slice.len());
        *self.landing.lock() = Some(Arc::new(slice));
        Ok(Some(region))
    }

    fn landed(&self, layer: usize, offset: usize, len: usize) -> Result<(), KvError> {
        let slice = self
            .landing
            .lock()
            .clone()
            .ok_or_else(|| KvError::Sink(format!("layer {layer} landed before a landing")))?;
        if layer >= self.layers.len() || len != self.layer_bytes(layer) {
            return Err(KvError::Sink(format!(
                "landed layer {layer} of {len} bytes (expected {} of {} layers)",
                self.layer_bytes(layer),
                self.layers.len(),
            )));
        }
        if len == 0 {
            return Ok(());
        }
        let staged = StagedLayer { slice, offset, len };
        let p = self.engine.import_staged(self.request, layer, staged);
        self.pending.lock().push(p);
        Ok(())
    }
}

/// Allocates the engine's staging memory and registers it with `agent` once (`mib` 0: none).
pub(crate) async fn register_staging(
    engine: &EngineHandle,
    agent: &NixlAgent,
    mib: usize,
) -> Result<Option<(Registration, Arc<KvStaging>)>, ClusterError> {
    if mib == 0 {
        return Ok(None);
    }
    let staging = engine.enable_kv_staging(mib << 20).wait().await?;
    let region = staging_region(staging.kind(), staging.addr(), staging.len());
    // SAFETY: the memory lives as long as the arena; the caller keeps a reference to it beside the
    // registration, in a tuple that drops the registration first.
    let reg = unsafe { agent.register(region) }?;
    tracing::info!(
        mib,
        kind = ?staging.kind(),
        "KV staging registered with NIXL: transfers move without host copies"
    );
    Ok(Some((reg, staging)))
}

/// Staging memory as NIXL names it.
fn staging_region(kind: StagingKind, addr: u64, len: usize) -> MemRegion {
    let (kind, device) = match kind {
        StagingKind::Host => (MemKind::Dram, 0),
        StagingKind::Device(d) => (MemKind::Vram, u64::from(d)),
    };
    MemRegion {
        addr,
        len: len as u64,
        kind,
        device,
    }
}
