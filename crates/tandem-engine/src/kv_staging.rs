//! Staging memory for zero-copy KV transfers: one region a backend allocates once (device memory on a
//! GPU, host memory on a CPU), which a transport registers once (NIXL) and then reads from and writes into
//! directly, handed out in slices, one per transfer.
//!
//! Registering memory with a transfer library pins pages and publishes keys to peers — far slower than
//! moving a prompt's KV — so it must not happen per request; and a transport can only move large
//! contiguous pieces fast (each NIXL descriptor costs ~11 µs). A prefill exports a request's blocks into a
//! slice (one gather per layer, layer-major), the decode side READs that slice into a slice of its own
//! staging, and imports each layer from there (one scatter per layer): three device operations, no host.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::BackendError;

/// Slices start on this boundary (the gather/scatter kernels move 16-byte vectors; 256 keeps DMA
/// engines on aligned lines).
const ALIGN: usize = 256;

/// Where staging memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagingKind {
    /// Host memory of this process.
    Host,
    /// Memory of the GPU with this ordinal.
    Device(u32),
}

/// Memory a backend provides for staging; freed when dropped (after every slice of it is gone, as the
/// arena holding it is reference counted by its slices).
pub trait StagingMem: Send + Sync {
    /// Start address in this process (a device pointer for device memory).
    fn addr(&self) -> u64;
    /// Size in bytes.
    fn size(&self) -> usize;
    /// Host or which device.
    fn kind(&self) -> StagingKind;
}

/// Host staging memory: a plain heap allocation (CPU backends, tests).
pub struct HostStaging {
    bytes: Box<[u8]>,
}

impl HostStaging {
    /// `len` zeroed bytes (untouched pages stay unbacked until written).
    pub fn new(len: usize) -> Self {
        Self {
            bytes: vec![0u8; len].into_boxed_slice(),
        }
    }
}

impl StagingMem for HostStaging {
    fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }
    fn size(&self) -> usize {
        self.bytes.len()
    }
    fn kind(&self) -> StagingKind {
        StagingKind::Host
    }
}

/// One staging region and its free ranges; slices are taken first-fit and merged back when returned.
pub struct KvStaging {
    mem: Box<dyn StagingMem>,
    /// Free `(offset, len)` ranges, sorted by offset, never adjacent (merged on return).
    free: Mutex<Vec<(usize, usize)>>,
}

impl KvStaging {
    /// An arena over `mem`, all of it free.
    pub fn new(mem: Box<dyn StagingMem>) -> Arc<Self> {
        let len = mem.size() / ALIGN * ALIGN;
        Arc::new(Self {
            mem,
            free: Mutex::new(if len > 0 { vec![(0, len)] } else { Vec::new() }),
        })
    }

    /// Start address of the whole region (what a transport registers).
    pub fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// Length of the region in bytes (what slices are carved from: the memory rounded down to the
    /// slices' alignment).
    pub fn len(&self) -> usize {
        self.mem.size() / ALIGN * ALIGN
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host or which device.
    pub fn kind(&self) -> StagingKind {
        self.mem.kind()
    }

    /// Bytes not handed out.
    pub fn free_bytes(&self) -> usize {
        self.free.lock().iter().map(|&(_, n)| n).sum()
    }

    /// A slice of exactly `len` bytes, or `None` while the arena has no free range that large (the caller
    /// falls back to host buffers rather than waiting).
    pub fn take(self: &Arc<Self>, len: usize) -> Option<StagingSlice> {
        let want = len.max(1).div_ceil(ALIGN) * ALIGN;
        let mut free = self.free.lock();
        let i = free.iter().position(|&(_, n)| n >= want)?;
        let (off, n) = free[i];
        if n == want {
            free.remove(i);
        } else {
            free[i] = (off + want, n - want);
        }
        Some(StagingSlice {
            arena: Arc::clone(self),
            off,
            reserved: want,
            len,
        })
    }

    fn put(&self, off: usize, len: usize) {
        let mut free = self.free.lock();
        let i = free.partition_point(|&(o, _)| o < off);
        free.insert(i, (off, len));
        // Merge with the next range, then with the previous one.
        if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
            free[i].1 += free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
            free[i - 1].1 += free[i].1;
            free.remove(i);
        }
    }
}

impl std::fmt::Debug for KvStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStaging")
            .field("kind", &self.kind())
            .field("len", &self.len())
            .field("free", &self.free_bytes())
            .finish()
    }
}

/// A slice of a [`KvStaging`] owned by one transfer; back to the arena when dropped.
pub struct StagingSlice {
    arena: Arc<KvStaging>,
    off: usize,
    reserved: usize,
    len: usize,
}

impl StagingSlice {
    /// Start address in this process.
    pub fn addr(&self) -> u64 {
        self.arena.addr() + self.off as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or which device.
    pub fn kind(&self) -> StagingKind {
        self.arena.kind()
    }

    /// The bytes of a host slice (`None` for device memory).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        // SAFETY: host memory owned by the arena, which this slice keeps alive; the range was handed
        // out to this slice alone.
        (self.kind() == StagingKind::Host)
            .then(|| unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len) })
    }

    /// The bytes of a host slice, writable (`None` for device memory).
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        // SAFETY: as in `host_bytes`; `&mut self` makes the borrow unique.
        (self.kind() == StagingKind::Host)
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len) })
    }
}

impl Drop for StagingSlice {
    fn drop(&mut self) {
        self.arena.put(self.off, self.reserved);
    }
}

impl std::fmt::Debug for StagingSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingSlice")
            .field("kind", &self.kind())
            .field("off", &self.off)
            .field("len", &self.len)
            .finish()
    }
}

/// One layer of an import that landed in staging memory: `len` bytes at `offset` of `slice` (the
/// layer's blocks back to back); the backend keeps the slice until its copy out is done.
#[derive(Clone, Debug)]
pub struct StagedLayer {
    /// The transfer's landing slice.
    pub slice: Arc<StagingSlice>,
    /// Where this layer starts in it.
    pub offset: usize,
    /// The layer's bytes.
    pub len: usize,
}

impl StagedLayer {
    /// Start address of the layer's bytes.
    pub fn addr(&self) -> u64 {
        self.slice.addr() + self.offset as u64
    }

    /// The layer's bytes, for host staging; an error for device memory (a backend without device
    /// staging of its own cannot read it).
    pub fn host_bytes(&self) -> Result<&[u8], BackendError> {
        self.slice
            .host_bytes()
            .and_then(|b| b.get(self.offset..self.offset + self.len))
            .ok_or_else(|| {
                BackendError::fatal(format!(
                    "staged KV layer ({:?}, {} bytes at {}) is not readable from the host",
                    self.slice.kind(),
                    self.len,
                    self.offset
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_aligned_disjoint_and_merge_back() {
        let a = KvStaging::new(Box::new(HostStaging::new(4096)));
        let s1 = a.take(100).unwrap();
        let s2 = a.take(300).unwrap();
        assert_eq!(s1.len(), 100);
        assert_eq!((s1.addr() - a.addr()) % ALIGN as u64, 0);
        assert_eq!(s2.addr() - s1.addr(), ALIGN as u64, "rounded up to ALIGN");
        assert_eq!(a.free_bytes(), 4096 - 256 - 512);
        assert!(a.take(4096).is_none(), "no range that large is free");
        drop(s1);
        let s3 = a.take(200).unwrap();
        assert_eq!(s3.addr(), a.addr(), "first fit reuses the freed hole");
        drop((s2, s3));
        assert_eq!(a.free_bytes(), 4096);
        assert_eq!(*a.free.lock(), vec![(0, 4096)], "ranges merged into one");
        assert!(a.take(4096).is_some());
    }

    #[test]
    fn host_slices_are_readable_device_slices_are_not() {
        let a = KvStaging::new(Box::new(HostStaging::new(1024)));
        let mut s = a.take(8).unwrap();
        s.host_bytes_mut()
            .unwrap()
            .copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let layer = StagedLayer {
            slice: Arc::new(s),
            offset: 4,
            len: 4,
        };
        assert_eq!(layer.host_bytes().unwrap(), &[5, 6, 7, 8]);

        struct Fake;
        impl StagingMem for Fake {
            fn addr(&self) -> u64 {
                0x7000_0000
            }
            fn size(&self) -> usize {
                1 << 20
            }
            fn kind(&self) -> StagingKind {
                StagingKind::Device(0)
            }
        }
        let d = KvStaging::new(Box::new(Fake));
        let s = d.take(64).unwrap();
        assert!(s.host_bytes().is_none());
        let layer = StagedLayer {
            slice: Arc::new(s),
            offset: 0,
            len: 64,
        };
        let e = layer.host_bytes().unwrap_err().to_string();
        assert!(e.contains("not readable from the host"), "{e}");
    }

    #[test]
    fn slices_keep_the_arena_alive() {
        let a = KvStaging::new(Box::new(HostStaging::new(1024)));
        let s = a.take(10).unwrap();
        drop(a);
        assert_eq!(s.host_bytes().unwrap().len(), 10);
    }
}
