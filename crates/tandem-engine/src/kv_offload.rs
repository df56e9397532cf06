//! The engine thread's side of the KV tiers (`kv_tiers`): blocks the pool evicts are copied down
//! before anything overwrites them, and when the scheduler admits a request whose prefix the pool
//! lost but a tier holds, those blocks are copied back up into the request's own block table
//! ([`TierRestore`], a [`PrefixSource`]), so no token a tier holds is computed again. A preempted
//! request re-admitted later restores the same way.
//!
//! Bytes move through the backend's bulk KV calls (`export_kv`, `import_kv`: the ones P/D transfer
//! uses), a whole batch of blocks per layer, so a GPU moves them in a few large DMAs through its
//! page-locked pool instead of one synchronous copy per (layer, block); every backend has them. A
//! restore runs on the engine thread inside the scheduling of the step that admits the request (only
//! for requests that step admits, only into blocks the scheduler could give them): copy threads
//! gather each layer's blocks into one host buffer while the engine thread hands finished layers to
//! the backend, whose copies (on a GPU) run asynchronously and are ordered before the next step by
//! `import_fence`. Disk reads start earlier: before each step the engine thread names the blocks that
//! the next few waiting requests would restore from disk, and the disk tier's reader thread reads them
//! while the step runs ([`Worker::read_ahead_waiting`]).

use std::time::Instant;

use crate::backend::{Backend, BackendError, LayerBlocks};
use crate::block_pool::{BlockPool, BlockTable};
use crate::kv_tiers::{KvTiers, Tier};
use crate::prefix_cache::{hash_block, ROOT_HASH};
use crate::scheduler::PrefixSource;
use crate::worker::Worker;

/// Waiting requests, from the head of the queue, whose disk blocks are read ahead of their admission.
const READ_AHEAD_REQUESTS: usize = 4;

impl<B: Backend> Worker<B> {
    /// Keeps the disk blocks read since the last step and names the next ones to read: those of the
    /// first [`READ_AHEAD_REQUESTS`] waiting requests' prefixes that only the disk tier holds (past
    /// what the pool holds, up to the first block no tier has).
    pub(crate) fn read_ahead_waiting(&mut self) {
        let Some(tiers) = self.tiers.as_mut().filter(|t| t.reads_ahead()) else {
            return;
        };
        tiers.collect_read_ahead();
        let bs = self.pool.block_size();
        let mut hashes = Vec::new();
        for seq in self.sched.waiting.iter().take(READ_AHEAD_REQUESTS) {
            let mut parent = ROOT_HASH;
            for chunk in seq.tokens.chunks_exact(bs) {
                parent = hash_block(parent, chunk);
                if self.pool.holds(parent) {
                    continue;
                }
                if !tiers.contains(parent) {
                    break;
                }
                hashes.push(parent);
            }
        }
        tiers.read_ahead(&hashes);
    }

    /// Copies every block the pool evicted since the last call down to the tiers (one that a tier
    /// already holds is only refreshed). Must run before a step or import writes the evicted blocks.
    pub(crate) fn offload_evicted(&mut self) {
        if let Some(tiers) = self.tiers.as_mut() {
            offload(&mut self.backend, tiers, self.pool.take_evicted());
        }
    }
}

/// Copies `evicted` blocks (block, name) down to `tiers` in one bulk export; a block a tier already
/// holds is only refreshed. If the export fails the blocks are dropped with a warning (their
/// prefixes are computed again when they return).
fn offload<B: Backend>(backend: &mut B, tiers: &mut KvTiers, evicted: Vec<(u32, u64)>) {
    let todo: Vec<(u32, u64)> = evicted
        .into_iter()
        .filter(|&(_, hash)| !tiers.refresh_if_held(hash))
        .collect();
    if todo.is_empty() {
        return;
    }
    let layout = backend.kv_layout();
    // A bulk export moves at most a request's worth of blocks (a GPU stages one layer of them).
    let most = backend
        .max_model_len()
        .div_ceil(layout.block_size.max(1))
        .min(layout.num_blocks)
        .max(1);
    for part in todo.chunks(most) {
        let ids: Vec<u32> = part.iter().map(|&(b, _)| b).collect();
        match export_layer_major(backend, &ids) {
            Ok(out) => {
                for (&(_, hash), bytes) in part.iter().zip(out) {
                    tiers.offload(hash, bytes);
                }
            }
            Err(e) => {
                tracing::warn!(blocks = part.len(), error = %e, "KV tier: could not copy evicted blocks down; they are dropped");
            }
        }
    }
}

/// Every layer of `ids` through the backend's bulk export, one vector per block holding its layers
/// back to back, as the KV tiers hold a block. The tiers' offload path; public so `cuda-bench`
/// measures with it.
pub fn export_layer_major<B: Backend>(
    backend: &mut B,
    ids: &[u32],
) -> Result<Vec<Vec<u8>>, BackendError> {
    let layout = backend.kv_layout();
    let (bb, layers) = (layout.block_bytes(), layout.n_layers);
    let export = backend.export_kv(ids)?;
    // Filled layer by layer without zeroing first: each byte of a block's (fresh, page-faulting)
    // memory is written once.
    let mut out: Vec<Vec<u8>> = (0..ids.len())
        .map(|_| Vec::with_capacity(layers * bb))
        .collect();
    for layer in 0..layers {
        let bytes = export.layer(layer)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(bb.max(1))) {
            o.extend_from_slice(b);
        }
    }
    if out.iter().any(|o| o.len() != layers * bb) {
        return Err(BackendError::fatal(format!(
            "KV export of {} blocks returned short layers",
            ids.len()
        )));
    }
    Ok(out)
}

/// Copy threads a restore gathers layers with: enough to outrun a host-to-device DMA, few enough
/// to leave the host's other work alone.
const GATHER_THREADS: usize = 4;

/// Copies `sources` (each every layer of one block, layer-major, as the KV tiers hold them) into
/// pool blocks `blocks` through the backend's bulk import, one layer at a time: copy threads gather
/// a layer's slices of every block into one buffer from the backend's host pool while the calling
/// thread imports the layers already gathered, then fences the imports before the next step. The
/// tiers' restore path; public so `cuda-bench` times exactly it.
pub fn restore_layer_major<B: Backend>(
    backend: &mut B,
    blocks: &[u32],
    sources: &[std::sync::Arc<Vec<u8>>],
) -> Result<(), BackendError> {
    let layout = backend.kv_layout();
    let (bb, layers) = (layout.block_bytes(), layout.n_layers);
    let pool = backend.host_pool();
    let threads = GATHER_THREADS.min(layers).max(1);
    let result = std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel(threads);
        for t in 0..threads {
            let (tx, pool) = (tx.clone(), &pool);
            scope.spawn(move || {
                for layer in (t..layers).step_by(threads) {
                    let gathered = pool.take(blocks.len() * bb).map(|mut buf| {
                        let dst = buf.as_mut_slice();
                        for (d, src) in dst.chunks_exact_mut(bb.max(1)).zip(sources) {
                            d.copy_from_slice(&src[layer * bb..(layer + 1) * bb]);
                        }
                        buf
                    });
                    let failed = gathered.is_err();
                    if tx.send((layer, gathered)).is_err() || failed {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut imported = 0;
        for (layer, gathered) in rx {
            backend.import_kv(LayerBlocks::new(layer, blocks), gathered?)?;
            imported += 1;
        }
        if imported == layers {
            Ok(())
        } else {
            Err(BackendError::fatal(format!(
                "KV tier restore gathered {imported} of {layers} layers"
            )))
        }
    });
    result?;
    backend.import_fence()
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
        // First every block this restore takes (name, bytes, tier, pool block), then one bulk import.
        let mut plan: Vec<(u64, Tier, u32)> = Vec::new();
        let mut sources = Vec::new();
        while table.blocks.len() + plan.len() < max_blocks {
            let i = table.blocks.len() + plan.len();
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
            plan.push((hash, tier, block));
            sources.push(bytes);
            parent = hash;
        }
        if plan.is_empty() {
            return 0;
        }
        // Blocks just evicted to make room go down before the import overwrites them.
        offload(self.backend, self.tiers, pool.take_evicted());
        let blocks: Vec<u32> = plan.iter().map(|&(_, _, b)| b).collect();
        if let Err(e) = restore_layer_major(self.backend, &blocks, &sources) {
            for &b in &blocks {
                pool.abort_restore(b);
            }
            tracing::warn!(error = %e, "KV tier: restoring a prefix failed; it is recomputed");
            self.failure = Some(e);
            return 0;
        }
        let mut from = [0usize; 2];
        for &(hash, tier, block) in &plan {
            pool.finish_restore(table, block, hash);
            from[usize::from(tier == Tier::Disk)] += 1;
        }
        let restored = from[0] + from[1];
        let seconds = started.elapsed().as_secs_f64();
        self.tiers.restore_seconds.observe(seconds);
        tracing::debug!(
            pool_blocks = table.blocks.len() - restored,
            host_blocks = from[0],
            disk_blocks = from[1],
            seconds,
            "KV tier: restored a prefix at admission"
        );
        restored
    }
}
