//! Pinned transfers on the serving side, and the one place that calls `KvSource::release`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::metrics::ReleaseReason;
use crate::{KvError, KvMetrics, KvSource};

struct Pin {
    blocks: Arc<[u32]>,
    deadline: Instant,
    readers: usize,
    /// Release was asked for while a reader was copying; the last reader performs it.
    pending: Option<ReleaseReason>,
}

/// Tracks pins so each is released exactly once, whichever of ack, abort, disconnect or timeout comes first,
/// and never while a connection is still copying its blocks out of the source.
pub(crate) struct PinRegistry {
    pins: Mutex<HashMap<u64, Pin>>,
    source: Arc<dyn KvSource>,
    metrics: Arc<KvMetrics>,
}

impl PinRegistry {
    pub(crate) fn new(source: Arc<dyn KvSource>, metrics: Arc<KvMetrics>) -> Self {
        PinRegistry {
            pins: Mutex::new(HashMap::new()),
            source,
            metrics,
        }
    }

    pub(crate) fn source(&self) -> &dyn KvSource {
        &*self.source
    }

    pub(crate) fn register(
        &self,
        transfer_id: u64,
        blocks: Arc<[u32]>,
        ttl: Duration,
    ) -> Result<(), KvError> {
        let mut pins = self.pins.lock();
        if pins.contains_key(&transfer_id) {
            return Err(KvError::DuplicateTransfer(transfer_id));
        }
        pins.insert(
            transfer_id,
            Pin {
                blocks,
                deadline: Instant::now() + ttl,
                readers: 0,
                pending: None,
            },
        );
        Ok(())
    }

    /// Starts copying out of a transfer; the pin cannot be released until the guard drops.
    pub(crate) fn begin_read(self: &Arc<Self>, transfer_id: u64) -> Result<ReadGuard, KvError> {
        let mut pins = self.pins.lock();
        match pins.get_mut(&transfer_id) {
            Some(p) if p.pending.is_none() => {
                p.readers += 1;
                Ok(ReadGuard {
                    registry: Arc::clone(self),
                    transfer_id,
                    blocks: Arc::clone(&p.blocks),
                })
            }
            _ => Err(KvError::UnknownTransfer(transfer_id)),
        }
    }

    /// Releases the pin now, or as soon as its last reader finishes; returns whether this call claimed it.
    pub(crate) fn finish(&self, transfer_id: u64, why: ReleaseReason) -> bool {
        let blocks = {
            let mut pins = self.pins.lock();
            let Some(p) = pins.get_mut(&transfer_id) else {
                return false;
            };
            if p.pending.is_some() {
                return false;
            }
            if p.readers > 0 {
                p.pending = Some(why);
                return true;
            }
            pins.remove(&transfer_id).expect("present").blocks
        };
        self.release(transfer_id, &blocks, why);
        true
    }

    /// Releases every pin whose deadline passed; returns how many it claimed.
    pub(crate) fn reap(&self, now: Instant) -> usize {
        let expired: Vec<u64> = self
            .pins
            .lock()
            .iter()
            .filter(|(_, p)| p.deadline <= now && p.pending.is_none())
            .map(|(t, _)| *t)
            .collect();
        expired
            .into_iter()
            .filter(|t| self.finish(*t, ReleaseReason::Timeout))
            .count()
    }

    pub(crate) fn len(&self) -> usize {
        self.pins.lock().len()
    }

    fn release(&self, transfer_id: u64, blocks: &[u32], why: ReleaseReason) {
        tracing::debug!(
            transfer_id,
            ?why,
            n_blocks = blocks.len(),
            "releasing KV pin"
        );
        self.metrics.released(why);
        self.source.release(transfer_id, blocks);
    }
}

/// Proof that a connection is copying a transfer's blocks; holds the block list.
pub(crate) struct ReadGuard {
    registry: Arc<PinRegistry>,
    transfer_id: u64,
    pub(crate) blocks: Arc<[u32]>,
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        let released = {
            let mut pins = self.registry.pins.lock();
            let p = pins
                .get_mut(&self.transfer_id)
                .expect("a read guard keeps its pin registered");
            p.readers -= 1;
            match p.pending {
                Some(why) if p.readers == 0 => {
                    Some((pins.remove(&self.transfer_id).expect("present").blocks, why))
                }
                _ => None,
            }
        };
        if let Some((blocks, why)) = released {
            self.registry.release(self.transfer_id, &blocks, why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemSource;
    use crate::peer::tests::smollm_info;

    fn registry() -> (Arc<MemSource>, Arc<PinRegistry>) {
        let src = Arc::new(MemSource::random(smollm_info().layout, 8, 1));
        let reg = Arc::new(PinRegistry::new(
            src.clone(),
            Arc::new(KvMetrics::default()),
        ));
        (src, reg)
    }

    #[test]
    fn release_waits_for_readers_and_happens_once() {
        let (src, reg) = registry();
        reg.register(1, Arc::from(vec![0u32, 1]), Duration::from_secs(60))
            .unwrap();
        let g = reg.begin_read(1).unwrap();
        assert!(reg.finish(1, ReleaseReason::Abort));
        assert_eq!(src.releases(1), 0, "must not release under a reader");
        assert!(!reg.finish(1, ReleaseReason::Ack));
        assert!(
            reg.begin_read(1).is_err(),
            "no new readers after release was requested"
        );
        drop(g);
        assert_eq!(src.releases(1), 1);
        assert!(!reg.finish(1, ReleaseReason::Ack));
        assert_eq!(reg.reap(Instant::now() + Duration::from_secs(3600)), 0);
        assert_eq!(src.releases(1), 1);
    }

    #[test]
    fn reaper_releases_expired_only() {
        let (src, reg) = registry();
        reg.register(1, Arc::from(vec![0u32]), Duration::from_millis(0))
            .unwrap();
        reg.register(2, Arc::from(vec![1u32]), Duration::from_secs(60))
            .unwrap();
        assert!(matches!(
            reg.register(2, Arc::from(vec![1u32]), Duration::from_secs(60)),
            Err(KvError::DuplicateTransfer(2))
        ));
        assert_eq!(reg.reap(Instant::now()), 1);
        assert_eq!((src.releases(1), src.releases(2)), (1, 0));
        assert_eq!(reg.len(), 1);
    }
}
