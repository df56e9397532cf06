//! Reusable shared-memory segments: creating, sizing and faulting in a fresh tmpfs file per transfer
//! costs more than the copy itself, so both ends keep their files mapped across transfers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use memmap2::{Mmap, MmapMut, MmapOptions};
use parking_lot::Mutex;

use crate::KvError;

/// Name prefix of transfer files; the client refuses to map anything else.
pub(crate) const FILE_PREFIX: &str = "tandem-kv-";
/// Segments are sized in multiples of this, so transfers of similar length share segments.
const SEGMENT_GRANULE: usize = 8 << 20;
/// Most copy threads one side of a shared-memory pull uses by default; beyond this a host's memory
/// bandwidth, not its cores, bounds the copy, and both sides plus the engines share that host.
const MAX_DEFAULT_COPY_THREADS: usize = 8;

/// Default copy threads per side of a shared-memory pull: half the host's cores (server and client copy at
/// the same time), at least 1, at most [`MAX_DEFAULT_COPY_THREADS`].
pub(crate) fn default_copy_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 2).clamp(1, MAX_DEFAULT_COPY_THREADS)
}

/// Tells the layer copies of one shared-memory pull (either side) to stop taking layers: raised on the first
/// failure, or when the side driving the transfer is gone, so an abandoned copy ends after at most one layer
/// per thread.
#[derive(Clone, Default)]
pub(crate) struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub(crate) fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub(crate) fn raised(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// One mapped file, owned by at most one transfer at a time; the file is unlinked when the segment drops.
pub(crate) struct ShmSegment {
    pub(crate) map: MmapMut,
    file: tempfile::NamedTempFile,
}

impl ShmSegment {
    /// Absolute path the client maps.
    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }
}

impl AsMut<[u8]> for ShmSegment {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.map[..]
    }
}

/// Server-side free list of segments, bounded in total bytes.
pub(crate) struct ShmPool {
    dir: PathBuf,
    max_cached_bytes: usize,
    free: Mutex<Vec<ShmSegment>>,
}

impl ShmPool {
    pub(crate) fn new(dir: PathBuf, max_cached_bytes: usize) -> Self {
        ShmPool {
            dir,
            max_cached_bytes,
            free: Mutex::new(Vec::new()),
        }
    }

    /// The smallest free segment of at least `len` bytes, or a new populated one.
    pub(crate) fn take(&self, len: usize) -> Result<ShmSegment, KvError> {
        {
            let mut free = self.free.lock();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, s)| s.map.len() >= len)
                .min_by_key(|(_, s)| s.map.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(free.swap_remove(i));
            }
        }
        let size = len.max(1).div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE;
        let file = tempfile::Builder::new()
            .prefix(FILE_PREFIX)
            .tempfile_in(&self.dir)
            .map_err(KvError::io("creating a shared-memory file"))?;
        file.as_file()
            .set_len(size as u64)
            .map_err(KvError::io("sizing a shared-memory file"))?;
        // SAFETY: we just created the file under a random name; only this segment writes it, and clients
        // read only regions announced after they were written.
        let map = unsafe {
            MmapOptions::new()
                .len(size)
                .populate()
                .map_mut(file.as_file())
        }
        .map_err(KvError::io("mapping a shared-memory file"))?;
        tracing::debug!(path = %file.path().display(), size, "created shared-memory segment");
        Ok(ShmSegment { map, file })
    }

    /// Returns a segment for reuse, dropping (unlinking) the oldest ones beyond the byte budget.
    pub(crate) fn put(&self, seg: ShmSegment) {
        let mut free = self.free.lock();
        free.push(seg);
        while free.iter().map(|s| s.map.len()).sum::<usize>() > self.max_cached_bytes {
            free.remove(0);
        }
    }

    #[cfg(test)]
    pub(crate) fn cached(&self) -> usize {
        self.free.lock().len()
    }
}

/// Client-side cache of read-only mappings, keyed by path and length.
pub(crate) struct MapCache {
    maps: Mutex<Vec<(PathBuf, usize, Arc<Mmap>)>>,
    capacity: usize,
}

impl MapCache {
    pub(crate) fn new(capacity: usize) -> Self {
        MapCache {
            maps: Mutex::new(Vec::new()),
            capacity,
        }
    }

    /// The mapping of `path` (exactly `len` bytes), mapping it on first use.
    pub(crate) fn get(&self, path: &Path, len: usize) -> Result<Arc<Mmap>, KvError> {
        if let Some((_, _, m)) = self
            .maps
            .lock()
            .iter()
            .find(|(p, l, _)| p == path && *l == len)
        {
            return Ok(Arc::clone(m));
        }
        let file =
            std::fs::File::open(path).map_err(KvError::io("opening a shared-memory file"))?;
        let file_len = file
            .metadata()
            .map_err(KvError::io("reading a shared-memory file's size"))?
            .len();
        if file_len != len as u64 {
            return Err(KvError::Protocol(format!(
                "shared-memory file is {file_len} bytes, server announced {len}"
            )));
        }
        // SAFETY: the server writes a region only before announcing it for a transfer and reuses the segment
        // only after that transfer's ack/abort; we read announced regions of our own transfer only.
        let map = Arc::new(
            unsafe { MmapOptions::new().len(len).populate().map(&file) }
                .map_err(KvError::io("mapping a shared-memory file"))?,
        );
        let mut maps = self.maps.lock();
        if maps.len() >= self.capacity {
            maps.remove(0);
        }
        maps.push((path.to_path_buf(), len, Arc::clone(&map)));
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_reuses_and_bounds_segments() {
        let dir = tempfile::tempdir_in(crate::default_shm_dir()).unwrap();
        let pool = ShmPool::new(dir.path().to_path_buf(), 2 * SEGMENT_GRANULE);
        let a = pool.take(100).unwrap();
        let a_path = a.path().to_path_buf();
        assert_eq!(a.map.len(), SEGMENT_GRANULE);
        pool.put(a);
        let b = pool.take(SEGMENT_GRANULE).unwrap();
        assert_eq!(b.path(), a_path, "a fitting free segment is reused");
        let c = pool.take(SEGMENT_GRANULE + 1).unwrap();
        assert_eq!(c.map.len(), 2 * SEGMENT_GRANULE);
        pool.put(b);
        pool.put(c);
        assert_eq!(
            pool.cached(),
            1,
            "over budget, the oldest segment is dropped"
        );
        assert!(!a_path.exists(), "a dropped segment's file is unlinked");
        drop(pool);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
