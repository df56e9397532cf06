//! Host memory that KV moves through between workers, and bulk exports in flight.
//!
//! A P/D transfer moves a request's KV as whole layers: the prefill side exports every block of the
//! request at once ([`crate::Backend::export_kv`]), the decode side imports one layer's blocks at a
//! time ([`crate::Backend::import_kv`]). The bytes live in [`HostBuf`]s handed out by the backend's
//! [`HostPool`], so a GPU backend can use page-locked memory (copies at bus speed, no bounce
//! through the driver's staging) and reuse it, while a CPU backend uses plain vectors.

use std::sync::Arc;

use crate::kv_staging::StagingSlice;
use crate::BackendError;

/// Memory behind a [`HostBuf`]: plain bytes for CPU backends, page-locked pooled memory for GPUs.
pub trait HostMem: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostMem for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A host buffer KV bytes move through; dropping a pooled one returns it to its pool.
pub struct HostBuf {
    mem: Box<dyn HostMem>,
}

impl HostBuf {
    /// Wraps backend-provided memory.
    pub fn new(mem: Box<dyn HostMem>) -> Self {
        Self { mem }
    }

    /// A zeroed buffer of `len` bytes on the ordinary heap.
    pub fn zeroed(len: usize) -> Self {
        Self::new(Box::new(vec![0u8; len]))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.bytes().len()
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.bytes()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.bytes_mut()
    }
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuf").field("len", &self.len()).finish()
    }
}

/// Hands out host buffers of a backend's preferred kind; shared with transport threads so that
/// received bytes are copied into import buffers off the engine thread.
pub trait HostPool: Send + Sync {
    /// A buffer of exactly `len` bytes (contents unspecified).
    fn take(&self, len: usize) -> Result<HostBuf, BackendError>;
}

/// The default pool: zeroed heap vectors (CPU backends copy at memory speed from any memory).
#[derive(Debug, Default)]
pub struct VecPool;

impl HostPool for VecPool {
    fn take(&self, len: usize) -> Result<HostBuf, BackendError> {
        Ok(HostBuf::zeroed(len))
    }
}

/// A bulk export of a request's KV under way: every layer's blocks back to back in the canonical
/// [`tandem_model::KvLayout`] block layout, readable layer by layer as each lands on the host.
pub trait KvExport: Send + Sync {
    /// Layers the export holds.
    fn num_layers(&self) -> usize;
    /// Waits until layer `layer` has landed, then returns its bytes (`blocks × block_bytes`); an error
    /// for an export held in device memory, which only a zero-copy transport reads.
    fn layer(&self, layer: usize) -> Result<&[u8], BackendError>;
    /// Waits until layer `layer` has landed (wherever the export lives).
    fn wait_layer(&self, layer: usize) -> Result<(), BackendError> {
        self.layer(layer).map(|_| ())
    }
    /// The staging slice holding the export (layer-major, whole layers back to back), when it was
    /// made into staging memory for a zero-copy transport.
    fn staged(&self) -> Option<&StagingSlice> {
        None
    }
}

/// An export that was complete when made (backends that copy synchronously).
#[derive(Debug)]
pub struct ReadyExport {
    buf: HostBuf,
    num_layers: usize,
}

impl ReadyExport {
    /// `buf` holds `num_layers` equal layer slices back to back.
    pub fn new(buf: HostBuf, num_layers: usize) -> Self {
        assert!(num_layers > 0 && buf.len().is_multiple_of(num_layers));
        Self { buf, num_layers }
    }
}

impl KvExport for ReadyExport {
    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn layer(&self, layer: usize) -> Result<&[u8], BackendError> {
        layer_of(self.buf.as_slice(), self.num_layers, layer)
    }
}

/// An export into host staging memory that was complete when made (backends that copy synchronously).
#[derive(Debug)]
pub struct StagedExport {
    slice: StagingSlice,
    num_layers: usize,
}

impl StagedExport {
    /// `slice` (host staging) holds `num_layers` equal layer slices back to back.
    pub fn new(slice: StagingSlice, num_layers: usize) -> Self {
        assert!(num_layers > 0 && slice.len().is_multiple_of(num_layers));
        Self { slice, num_layers }
    }
}

impl KvExport for StagedExport {
    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn layer(&self, layer: usize) -> Result<&[u8], BackendError> {
        let bytes = self.slice.host_bytes().ok_or_else(|| {
            BackendError::fatal("a staged export in device memory has no host bytes")
        })?;
        layer_of(bytes, self.num_layers, layer)
    }

    fn staged(&self) -> Option<&StagingSlice> {
        Some(&self.slice)
    }
}

/// Layer `layer` of `bytes`, which holds `num_layers` equal layers back to back.
fn layer_of(bytes: &[u8], num_layers: usize, layer: usize) -> Result<&[u8], BackendError> {
    if layer >= num_layers {
        return Err(BackendError::fatal(format!(
            "layer {layer} outside an export of {num_layers} layers"
        )));
    }
    let n = bytes.len() / num_layers;
    Ok(&bytes[layer * n..(layer + 1) * n])
}

/// The default pool as a shared handle (what [`crate::Backend::host_pool`] returns unless overridden).
pub fn vec_pool() -> Arc<dyn HostPool> {
    Arc::new(VecPool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_export_slices_layers() {
        let mut buf = VecPool.take(12).unwrap();
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = i as u8;
        }
        let e = ReadyExport::new(buf, 3);
        assert_eq!(e.num_layers(), 3);
        assert_eq!(e.layer(1).unwrap(), &[4, 5, 6, 7]);
        assert!(e.layer(3).is_err());
    }
}
