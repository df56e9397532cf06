//! The engine thread's side of the KV tiers (`kv_tiers`): blocks the pool evicts are copied down
//! before anything overwrites them, and when the scheduler admits a request whose prefix the pool
//! lost but a tier holds, those blocks are copied back up into the request's own block table
//! ([`TierRestore`], a [`PrefixSource`]), so no token a tier holds is computed again. A preempted
//! request re-admitted later restores the same way.
//!
//! Bytes move through the backend's per-layer KV export/import (the calls P/D transfer uses), so this
//! works on every backend. Restores run on the engine thread, synchronously, inside the scheduling of
//! the step that admits the request: only for requests that step actually admits, and only into
//! blocks the scheduler could give them.

use std::time::Instant;

use crate::backend::{Backend, BackendError, LayerBlocks};
use crate::block_pool::{BlockPool, BlockTable};
use crate::kv_tiers::{KvTiers, Tier};
use crate::prefix_cache::hash_block;
use crate::scheduler::PrefixSource;
use crate::worker::Worker;

impl<B: Backend> Worker<B> {
    /// Copies every block the pool evicted since the last call down to the tiers (one that a tier
    /// already holds is only refreshed). Must run before a step or import writes the evicted blocks.
    pub(crate) fn offload_evicted(&mut self) {
        if let Some(tiers) = self.tiers.as_mut() {
            offload(&self.backend, tiers, self.pool.take_evicted());
        }
    }
}

/// Copies `evicted` blocks (block, name) down to `tiers`; a block a tier already holds is only
/// refreshed, and one that cannot be exported is dropped with a warning.
fn offload<B: Backend>(backend: &B, tiers: &mut KvTiers, evicted: Vec<(u32, u64)>) {
    if evicted.is_empty() {
        return;
    }
    let layout = backend.kv_layout();
    let bb = layout.block_bytes();
    for (block, hash) in evicted {
        if tiers.refresh_if_held(hash) {
            continue;
        }
        let mut bytes = vec![0u8; layout.n_layers * bb];
        let exported =
            bytes
                .chunks_exact_mut(bb.max(1))
                .enumerate()
                .try_for_each(|(layer, out)| {
                    backend.export_layer(LayerBlocks::new(layer, &[block]), out)
                });
        match exported {
            Ok(()) => tiers.offload(hash, bytes),
            Err(e) => {
                tracing::warn!(block, error = %e, "KV tier: could not copy an evicted block down; it is dropped");
            }
        }
    }
}

/// Restores an admitted request's prefix from the KV tiers during scheduling (see the module docs).
pub(crate) struct TierRestore<'a, B: Backend> {
    backend: &'a mut B,
    tiers: &'a mut KvTiers,
    /// The backend error that stopped a restore, for the engine to handle after scheduling.
    pub(crate) failure: Option<BackendError>,
}

impl<'a, B: Backend> TierRestore<'a, B> {
    /// A restorer moving blocks from `tiers` into `backend`'s cache.
    pub(crate) fn new(backend: &'a mut B, tiers: &'a mut KvTiers) -> Self {
        Self {
            backend,
            tiers,
            failure: None,
        }
    }

    /// Copies `bytes` (every layer of one block) into pool block `block`.
    fn import(&mut self, block: u32, bytes: &[u8]) -> Result<(), BackendError> {
        let bb = self.backend.kv_layout().block_bytes();
        bytes
            .chunks_exact(bb.max(1))
            .enumerate()
            .try_for_each(|(layer, data)| {
                self.backend
                    .import_layer(LayerBlocks::new(layer, &[block]), data)
            })
    }
}

impl<B: Backend> PrefixSource for TierRestore<'_, B> {
    fn extend(
        &mut self,
        pool: &mut BlockPool,
        table: &mut BlockTable,
        tokens: &[u32],
        max_blocks: usize,
    ) -> usize {
        if self.failure.is_some() || !table.all_named() {
            return 0;
        }
        let bs = pool.block_size();
        let started = Instant::now();
        let mut parent = table.last_hash();
        let mut from = [0usize; 2];
        while table.blocks.len() < max_blocks {
            let i = table.blocks.len();
            let Some(chunk) = tokens.get(i * bs..(i + 1) * bs) else {
                break;
            };
            let hash = hash_block(parent, chunk);
            // A block the pool holds past the matched prefix is another sequence's (still being
            // computed): it is not copied in twice.
            if pool.holds(hash) || !self.tiers.contains(hash) {
                break;
            }
            let Some((bytes, tier)) = self.tiers.fetch(hash) else {
                break;
            };
            let Some(block) = pool.take_for_restore() else {
                break;
            };
            // The block may have just been evicted: its old content goes down before it is overwritten.
            offload(self.backend, self.tiers, pool.take_evicted());
            if let Err(e) = self.import(block, &bytes) {
                pool.abort_restore(block);
                tracing::warn!(error = %e, "KV tier: restoring a block failed; its prefix is recomputed");
                self.failure = Some(e);
                break;
            }
            pool.finish_restore(table, block, hash);
            from[usize::from(tier == Tier::Disk)] += 1;
            parent = hash;
        }
        let restored = from[0] + from[1];
        if restored > 0 {
            if let Err(e) = self.backend.import_fence() {
                self.failure = Some(e);
            }
            let seconds = started.elapsed().as_secs_f64();
            self.tiers.restore_seconds.observe(seconds);
            tracing::debug!(
                pool_blocks = table.blocks.len() - restored,
                host_blocks = from[0],
                disk_blocks = from[1],
                seconds,
                "KV tier: restored a prefix at admission"
            );
        }
        restored
    }
}
