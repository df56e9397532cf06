//! The ingress's estimate of what each worker's prefix cache holds.
//!
//! The ingress records the block hash chain of every prompt it sends to a worker; a later prompt's
//! longest run of leading block hashes found there estimates the worker's cache hit. Estimates can be
//! stale (the worker evicts on its own), which costs only a worse routing choice, never a wrong answer:
//! the worker's own prefix cache decides what is really reused.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Hashes of a prompt's full blocks, each chained to its predecessor so equal hashes mean equal prefixes.
pub fn block_hashes(prompt: &[u32], block_size: usize) -> Vec<u64> {
    let mut prev = 0u64;
    prompt
        .chunks_exact(block_size.max(1))
        .map(|block| {
            // DefaultHasher::new() uses fixed keys, so hashes are stable within the process.
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

/// Block hashes believed cached on one worker, bounded to the worker's pool size (oldest forgotten first).
#[derive(Debug)]
pub struct PrefixTracker {
    set: HashSet<u64>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl PrefixTracker {
    /// A tracker remembering at most `capacity` blocks (the worker's KV pool size).
    pub fn new(capacity: usize) -> Self {
        PrefixTracker {
            set: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Leading blocks of `hashes` believed cached.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.set.contains(h)).count()
    }

    /// Records that the worker now holds these blocks; refreshes ones it already had.
    pub fn insert(&mut self, hashes: &[u64]) {
        for &h in hashes {
            if !self.set.insert(h) {
                if let Some(i) = self.order.iter().position(|&x| x == h) {
                    self.order.remove(i);
                }
            }
            self.order.push_back(h);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Changes how many blocks are remembered (a worker's KV tiers grow what it holds), forgetting the
    /// oldest past a smaller bound.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Blocks currently remembered.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn shared_prefixes_share_hashes_and_partial_blocks_are_ignored() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 2);
        let b = block_hashes(&[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content at another position hashes differently (the chain).
        assert_ne!(block_hashes(&[5, 6], 2)[0], a[2]);
    }

    #[test]
    fn capacity_follows_what_the_worker_holds() {
        let mut t = PrefixTracker::new(2);
        let a = block_hashes(&[1, 1, 2, 2, 3, 3, 4, 4], 2);
        t.insert(&a);
        assert_eq!(t.matched_blocks(&a), 0, "the head was forgotten");
        t.set_capacity(4);
        t.insert(&a);
        assert_eq!(t.matched_blocks(&a), 4, "tiers hold the whole prompt");
        t.set_capacity(1);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn tracker_matches_leading_blocks_and_evicts_oldest() {
        let mut t = PrefixTracker::new(3);
        let a = block_hashes(&[1, 1, 2, 2, 3, 3], 2);
        t.insert(&a);
        assert_eq!(t.matched_blocks(&a), 3);
        assert_eq!(t.matched_blocks(&block_hashes(&[1, 1, 2, 2, 4, 4], 2)), 2);
        let b = block_hashes(&[7, 7], 2);
        t.insert(&b);
        assert_eq!(t.len(), 3);
        assert_eq!(
            t.matched_blocks(&a),
            0,
            "the oldest block (a's first) was evicted"
        );
        assert_eq!(t.matched_blocks(&b), 1);
    }

    proptest! {
        #[test]
        fn tracker_never_exceeds_capacity_and_matches_what_it_just_inserted(
            prompts in proptest::collection::vec(proptest::collection::vec(0u32..4, 0..40), 1..20),
            cap in 1usize..16,
        ) {
            let mut t = PrefixTracker::new(cap);
            for p in &prompts {
                let h = block_hashes(p, 4);
                t.insert(&h);
                prop_assert!(t.len() <= cap);
                if h.len() <= cap {
                    prop_assert_eq!(t.matched_blocks(&h), h.len());
                }
            }
        }
    }
}
