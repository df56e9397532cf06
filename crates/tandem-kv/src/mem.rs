//! Plain-memory source and sink: the reference implementations for tests, benchmarks and engine tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use rand::{RngCore, SeedableRng};

use crate::{KvError, KvSink, KvSource, WireLayout};

/// A KV pool held in memory, laid out like the engine's cache: per layer, `num_blocks` blocks back to back.
pub struct MemSource {
    layers: Vec<Vec<u8>>,
    block_bytes: usize,
    releases: Mutex<HashMap<u64, usize>>,
}

impl MemSource {
    /// A pool of `num_blocks` blocks per layer filled with seeded random bytes, so round trips are checkable.
    pub fn random(layout: WireLayout, num_blocks: usize, seed: u64) -> Self {
        let block_bytes = layout.block_bytes();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let layers = (0..layout.n_layers)
            .map(|_| {
                let mut v = vec![0u8; num_blocks * block_bytes];
                rng.fill_bytes(&mut v);
                v
            })
            .collect();
        MemSource {
            layers,
            block_bytes,
            releases: Mutex::new(HashMap::new()),
        }
    }

    /// The bytes of one (layer, block), to compare against what a sink received.
    pub fn block(&self, layer: usize, block: u32) -> &[u8] {
        let off = block as usize * self.block_bytes;
        &self.layers[layer][off..off + self.block_bytes]
    }

    /// How many times `release` was called for `transfer_id` (must end at exactly 1).
    pub fn releases(&self, transfer_id: u64) -> usize {
        self.releases.lock().get(&transfer_id).copied().unwrap_or(0)
    }
}

impl KvSource for MemSource {
    fn copy_blocks(
        &self,
        _transfer_id: u64,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), KvError> {
        let bb = self.block_bytes;
        let src = self
            .layers
            .get(layer)
            .ok_or_else(|| KvError::Source(format!("no layer {layer}")))?;
        if out.len() != blocks.len() * bb {
            return Err(KvError::Source(format!(
                "buffer of {} bytes for {} blocks",
                out.len(),
                blocks.len()
            )));
        }
        for (dst, &b) in out.chunks_exact_mut(bb).zip(blocks) {
            let off = b as usize * bb;
            let s = src
                .get(off..off + bb)
                .ok_or_else(|| KvError::Source(format!("no block {b}")))?;
            dst.copy_from_slice(s);
        }
        Ok(())
    }

    fn release(&self, transfer_id: u64, _blocks: &[u32]) {
        *self.releases.lock().entry(transfer_id).or_default() += 1;
    }
}

/// A decode-side destination of `n_blocks` blocks per layer, one lock per layer so connections write in parallel.
pub struct MemSink {
    layers: Vec<Mutex<Vec<u8>>>,
    block_bytes: usize,
    layers_complete: AtomicUsize,
    completes: AtomicUsize,
    fail_at_layer: Option<usize>,
}

impl MemSink {
    /// A zeroed destination for a transfer of `n_blocks` blocks.
    pub fn new(layout: WireLayout, n_blocks: usize) -> Self {
        MemSink {
            layers: (0..layout.n_layers)
                .map(|_| Mutex::new(vec![0u8; n_blocks * layout.block_bytes()]))
                .collect(),
            block_bytes: layout.block_bytes(),
            layers_complete: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            fail_at_layer: None,
        }
    }

    /// A sink whose writes to `layer` fail, to exercise the abort path.
    pub fn failing_at(layout: WireLayout, n_blocks: usize, layer: usize) -> Self {
        MemSink {
            fail_at_layer: Some(layer),
            ..MemSink::new(layout, n_blocks)
        }
    }

    /// Copy of block index `i` (within the transfer) of `layer`.
    pub fn block(&self, layer: usize, i: usize) -> Vec<u8> {
        self.layers[layer].lock()[i * self.block_bytes..(i + 1) * self.block_bytes].to_vec()
    }

    /// How many `layer_complete` calls arrived.
    pub fn layers_complete(&self) -> usize {
        self.layers_complete.load(Ordering::Relaxed)
    }

    /// How many `complete` calls arrived (1 after a successful pull).
    pub fn completes(&self) -> usize {
        self.completes.load(Ordering::Relaxed)
    }
}

impl KvSink for MemSink {
    fn write(&self, layer: usize, first_block: usize, data: &[u8]) -> Result<(), KvError> {
        if self.fail_at_layer == Some(layer) {
            return Err(KvError::Sink(format!("injected failure at layer {layer}")));
        }
        let dst = self
            .layers
            .get(layer)
            .ok_or_else(|| KvError::Sink(format!("no layer {layer}")))?;
        let mut dst = dst.lock();
        let off = first_block * self.block_bytes;
        let slot = dst
            .get_mut(off..off + data.len())
            .ok_or_else(|| KvError::Sink(format!("blocks past the end at layer {layer}")))?;
        slot.copy_from_slice(data);
        Ok(())
    }

    fn layer_complete(&self, _layer: usize) -> Result<(), KvError> {
        self.layers_complete.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn complete(&self) -> Result<(), KvError> {
        self.completes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
