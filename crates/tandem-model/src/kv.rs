//! The CPU paged KV cache storage.

use crate::batch::{KvDtype, KvLayout};

/// The CPU paged KV cache storage (one f32 buffer per layer, layout described by KvLayout).
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    layers: Vec<Vec<f32>>,
}

impl KvCache {
    /// Allocates a zeroed cache; the CPU backend stores f32, so `layout.dtype` must be [`KvDtype::F32`].
    pub fn new(layout: KvLayout) -> KvCache {
        assert_eq!(layout.dtype, KvDtype::F32, "the CPU KV cache stores f32");
        let per_layer = layout.num_blocks * layout.block_elems();
        KvCache {
            layout,
            layers: (0..layout.n_layers).map(|_| vec![0.0; per_layer]).collect(),
        }
    }

    /// The shape of the cache.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// One layer's blocks, read by attention.
    pub fn layer(&self, l: usize) -> &[f32] {
        &self.layers[l]
    }

    /// One layer's blocks, written by the forward pass.
    pub fn layer_mut(&mut self, l: usize) -> &mut [f32] {
        &mut self.layers[l]
    }

    fn block_range(&self, block: u32) -> std::ops::Range<usize> {
        let n = self.layout.block_elems();
        let b = block as usize;
        assert!(
            b < self.layout.num_blocks,
            "block {b} out of range ({} blocks)",
            self.layout.num_blocks
        );
        b * n..(b + 1) * n
    }

    /// Copies one (layer, block) out as little-endian bytes: the unit P/D transfers move.
    pub fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) {
        assert_eq!(
            out.len(),
            self.layout.block_bytes(),
            "export_block: buffer size"
        );
        let src = &self.layers[layer][self.block_range(block)];
        for (o, v) in out.chunks_exact_mut(4).zip(src) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Writes one (layer, block) from bytes produced by [`KvCache::export_block`].
    pub fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) {
        assert_eq!(
            data.len(),
            self.layout.block_bytes(),
            "import_block: buffer size"
        );
        let range = self.block_range(block);
        for (v, c) in self.layers[layer][range]
            .iter_mut()
            .zip(data.chunks_exact(4))
        {
            *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }

    /// Copies block `src` over block `dst` in every layer (copy-on-write of a shared prefix block).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let (s, d) = (self.block_range(src), self.block_range(dst));
        for layer in &mut self.layers {
            layer.copy_within(s.clone(), d.start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            block_size: 3,
            num_blocks: 5,
            dtype: KvDtype::F32,
        }
    }

    proptest! {
        #[test]
        fn export_import_round_trips(vals in proptest::collection::vec(-1e6f32..1e6, 48), layer in 0usize..2, block in 0u32..5) {
            let mut a = KvCache::new(layout());
            let r = a.block_range(block);
            a.layer_mut(layer)[r.clone()].copy_from_slice(&vals);
            let mut bytes = vec![0u8; layout().block_bytes()];
            a.export_block(layer, block, &mut bytes);
            let mut b = KvCache::new(layout());
            b.import_block(layer, block, &bytes);
            prop_assert_eq!(&b.layer(layer)[r], &vals[..]);
            prop_assert!(b.layer(1 - layer).iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn copy_block_copies_every_layer_and_nothing_else() {
        let mut kv = KvCache::new(layout());
        for l in 0..2 {
            for (i, v) in kv.layer_mut(l).iter_mut().enumerate() {
                *v = (l * 10_000 + i) as f32;
            }
        }
        let before: Vec<Vec<f32>> = (0..2).map(|l| kv.layer(l).to_vec()).collect();
        kv.copy_block(1, 3);
        let n = layout().block_elems();
        for (l, old) in before.iter().enumerate() {
            assert_eq!(&kv.layer(l)[3 * n..4 * n], &old[n..2 * n]);
            assert_eq!(&kv.layer(l)[..3 * n], &old[..3 * n]);
            assert_eq!(&kv.layer(l)[4 * n..], &old[4 * n..]);
        }
    }
}
