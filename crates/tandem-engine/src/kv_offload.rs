//! The engine thread's side of the KV tiers (`kv_tiers`): blocks the pool evicts are copied down
//! before anything overwrites them, and a waiting request's prefix that the pool lost is copied back
//! up from the tiers before the scheduler looks it up, so the lookup finds it cached.
//!
//! Bytes move through the backend's per-layer KV export/import (the calls P/D transfer uses), so this
//! works on every backend. Restores run on the engine thread, synchronously, before the step that
//! admits the request.

use std::time::Instant;

use crate::backend::{Backend, LayerBlocks};
use crate::prefix_cache::{hash_block, ROOT_HASH};
use crate::worker::Worker;

impl<B: Backend> Worker<B> {
    /// Copies every block the pool evicted since the last call down to the tiers (one that a tier
    /// already holds is only refreshed). Must run before a step or import writes the evicted blocks.
    pub(crate) fn offload_evicted(&mut self) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let evicted = self.pool.take_evicted();
        if evicted.is_empty() {
            return;
        }
        let layout = self.backend.kv_layout();
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
                        self.backend
                            .export_layer(LayerBlocks::new(layer, &[block]), out)
                    });
            match exported {
                Ok(()) => tiers.offload(hash, bytes),
                Err(e) => {
                    tracing::warn!(block, error = %e, "KV tier: could not copy an evicted block down; it is dropped");
                }
            }
        }
    }

    /// Restores, for the waiting requests the next step could admit, the leading blocks of their
    /// prompts that the pool no longer holds but a tier does, as cached blocks of the pool.
    ///
    /// Requests are taken in queue order (the order the scheduler admits them), and all restores of a
    /// step, with the cached prefix blocks they build on, take fewer blocks than were obtainable when it
    /// began (each request also keeps one for its first chunk); those prefix blocks and the restored
    /// ones are made the most recently freed, so the pool evicts only other content to make room and
    /// one request's restore never evicts another's (or its own prefix).
    pub(crate) fn restore_from_tiers(&mut self) {
        if self.tiers.is_none() || !self.pool.caching() {
            return;
        }
        let bs = self.pool.block_size();
        let admit = self
            .sched
            .config()
            .max_num_seqs
            .saturating_sub(self.sched.running.len());
        let mut room = self.pool.num_available();
        let mut wanted: Vec<Vec<u64>> = Vec::new();
        for seq in self.sched.waiting.iter().take(admit) {
            if !seq.table.is_empty() || seq.num_computed != 0 || seq.scoring_prompt() {
                continue;
            }
            if room <= 1 {
                break;
            }
            let tiers = self.tiers.as_ref().expect("checked above");
            let max_blocks = seq.tokens.len().saturating_sub(1) / bs;
            let mut parent = ROOT_HASH;
            let mut chain = Vec::new();
            let mut held = 0;
            for chunk in seq.tokens.chunks_exact(bs).take(max_blocks) {
                let h = hash_block(parent, chunk);
                if chain.len() + held + 1 >= room {
                    break;
                }
                match self.pool.holds(h) {
                    Some(evictable) => held += usize::from(evictable),
                    None => {
                        if !tiers.contains(h) {
                            break;
                        }
                        chain.push(h);
                    }
                }
                parent = h;
            }
            room -= chain.len() + held + 1;
            if !chain.is_empty() {
                wanted.push(chain);
            }
        }
        for chain in wanted {
            let started = Instant::now();
            let mut restored = 0usize;
            for hash in chain {
                if !self.restore_block(hash) {
                    break;
                }
                restored += 1;
            }
            if restored > 0 {
                if let Err(e) = self.backend.import_fence() {
                    self.backend_failed(e);
                    return;
                }
                if let Some(tiers) = self.tiers.as_mut() {
                    tiers
                        .restore_seconds
                        .observe(started.elapsed().as_secs_f64());
                }
                tracing::debug!(blocks = restored, "KV tier: restored a prefix");
            }
            if self.failure.is_some() {
                return;
            }
        }
    }

    /// Copies block `hash` up from the tiers into a pool block and names it; false when it could not
    /// (not there any more, a corrupt file, no free block, a backend failure).
    fn restore_block(&mut self, hash: u64) -> bool {
        let Some((bytes, _tier)) = self.tiers.as_mut().and_then(|t| t.fetch(hash)) else {
            return false;
        };
        let Some(block) = self.pool.take_for_restore() else {
            return false;
        };
        // The block may have just been evicted: its old content goes down before it is overwritten.
        self.offload_evicted();
        let bb = self.backend.kv_layout().block_bytes();
        let imported = bytes
            .chunks_exact(bb.max(1))
            .enumerate()
            .try_for_each(|(layer, data)| {
                self.backend
                    .import_layer(LayerBlocks::new(layer, &[block]), data)
            });
        match imported {
            Ok(()) => {
                self.pool.finish_restore(block, hash);
                true
            }
            Err(e) => {
                self.pool.abort_restore(block);
                tracing::warn!(error = %e, "KV tier: restoring a block failed; its prefix is recomputed");
                self.backend_failed(e);
                false
            }
        }
    }
}
