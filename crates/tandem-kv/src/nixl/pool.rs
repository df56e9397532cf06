//! Memory NIXL can move: regions (host or device), and a pool of registered host buffers reused across
//! transfers, because registering memory (pinning pages, publishing keys to peers) costs far more than
//! moving a prompt's KV.

use std::sync::Arc;

use memmap2::MmapMut;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::agent::{AgentCore, Registration};
use crate::KvError;

/// Where a region lives; NIXL registers and moves each kind differently.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemKind {
    /// Host memory.
    #[default]
    Dram,
    /// GPU memory of device `MemRegion::device`.
    Vram,
}

/// A span of memory as NIXL names it: what a descriptor list entry carries, on the wire and in calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemRegion {
    /// Start address in the owning process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or device memory.
    pub kind: MemKind,
    /// Device ordinal for VRAM, 0 for DRAM.
    pub device: u64,
}

impl MemRegion {
    /// The sub-region `[off, off + len)`; panics when it does not fit, as that is a caller bug.
    pub fn slice(&self, off: u64, len: u64) -> MemRegion {
        assert!(off + len <= self.len, "sub-region past the end");
        MemRegion {
            addr: self.addr + off,
            len,
            ..*self
        }
    }

    /// The pieces at `(offset, bytes)`: one descriptor per layer of a packed transfer
    /// ([`crate::PullSelection::packed_layers`]).
    pub fn pieces(&self, packed: &[(usize, usize)]) -> Vec<MemRegion> {
        packed
            .iter()
            .map(|&(off, len)| self.slice(off as u64, len as u64))
            .collect()
    }
}

/// One registered host buffer.
struct Buffer {
    /// Declared first so it drops (deregisters) before the mapping is unmapped.
    _reg: Registration,
    map: MmapMut,
}

/// Registered host buffers, allocated in multiples of a granule and kept (up to a byte budget) for reuse.
pub(crate) struct RegisteredPool {
    core: Arc<AgentCore>,
    granule: usize,
    max_cached_bytes: usize,
    free: Mutex<Vec<Buffer>>,
}

impl RegisteredPool {
    pub(crate) fn new(core: Arc<AgentCore>, granule: usize, max_cached_bytes: usize) -> Self {
        RegisteredPool {
            core,
            granule: granule.max(1 << 20),
            max_cached_bytes,
            free: Mutex::new(Vec::new()),
        }
    }

    /// The smallest free buffer of at least `len` bytes, or a newly allocated and registered one.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> Result<PoolLease, KvError> {
        let cached = {
            let mut free = self.free.lock();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.map.len() >= len)
                .min_by_key(|(_, b)| b.map.len())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let buf = match cached {
            Some(b) => b,
            None => {
                let size = len.max(1).div_ceil(self.granule) * self.granule;
                let mut map = MmapMut::map_anon(size)
                    .map_err(KvError::io("allocating a NIXL transfer buffer"))?;
                // Fault the pages in now, so registration pins real memory and the first transfer is not slower.
                for page in map.chunks_mut(4096) {
                    page[0] = 0;
                }
                let core = &self.core;
                let region = MemRegion {
                    addr: map.as_ptr() as u64,
                    len: size as u64,
                    kind: MemKind::Dram,
                    device: 0,
                };
                // SAFETY: the mapping outlives the registration: both live in the Buffer, whose
                // registration field drops first.
                let reg = unsafe { core.register(region)? };
                tracing::debug!(
                    size,
                    agent = core.name(),
                    "registered a NIXL transfer buffer"
                );
                Buffer { _reg: reg, map }
            }
        };
        Ok(PoolLease {
            buf: Some(buf),
            pool: Arc::clone(self),
        })
    }

    fn put(&self, buf: Buffer) {
        let mut free = self.free.lock();
        free.push(buf);
        while free.iter().map(|b| b.map.len()).sum::<usize>() > self.max_cached_bytes {
            free.remove(0);
        }
    }
}

/// A registered buffer owned by one transfer; back to its pool on drop.
pub(crate) struct PoolLease {
    buf: Option<Buffer>,
    pool: Arc<RegisteredPool>,
}

impl PoolLease {
    /// The whole buffer as NIXL names it.
    pub(crate) fn region(&self) -> MemRegion {
        let map = &self.buf.as_ref().expect("leased").map;
        MemRegion {
            addr: map.as_ptr() as u64,
            len: map.len() as u64,
            kind: MemKind::Dram,
            device: 0,
        }
    }

    /// The buffer's bytes, for filling before a peer reads them.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf.as_mut().expect("leased").map[..]
    }
}

impl AsMut<[u8]> for PoolLease {
    fn as_mut(&mut self) -> &mut [u8] {
        self.bytes_mut()
    }
}

impl AsRef<[u8]> for PoolLease {
    fn as_ref(&self) -> &[u8] {
        &self.buf.as_ref().expect("leased").map[..]
    }
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_descriptors_tile_the_region() {
        let r = MemRegion {
            addr: 0x1000,
            len: 4 * 300,
            kind: MemKind::Vram,
            device: 3,
        };
        let p = r.pieces(&[(0, 300), (300, 300), (600, 300)]);
        assert_eq!(p.len(), 3);
        assert_eq!(
            p[2],
            MemRegion {
                addr: 0x1000 + 600,
                len: 300,
                kind: MemKind::Vram,
                device: 3
            }
        );
        assert!(p.windows(2).all(|w| w[0].addr + w[0].len == w[1].addr));
    }

    #[test]
    #[should_panic(expected = "past the end")]
    fn slices_past_the_end_panic() {
        let r = MemRegion {
            addr: 0,
            len: 10,
            kind: MemKind::Dram,
            device: 0,
        };
        r.slice(8, 4);
    }

    #[test]
    fn regions_round_trip_as_json() {
        let r = MemRegion {
            addr: u64::MAX - 5,
            len: 7,
            kind: MemKind::Vram,
            device: 1,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.contains("\"vram\""), "{s}");
        assert_eq!(serde_json::from_str::<MemRegion>(&s).unwrap(), r);
    }
}
