//! The ingress's estimate of what each worker's prefix cache holds.
//!
//! The ingress records the block hash chain of every prompt it sends to a worker; a later prompt's
//! longest run of leading block hashes found there estimates the worker's cache hit. Estimates can be
//! stale (the worker evicts on its own), which costs only a worse routing choice, never a wrong answer:
//! the worker's own prefix cache decides what is really reused.

use std::collections::{HashMap, VecDeque};
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
///
/// An LRU in O(1) amortized per block: `gen` maps each remembered hash to the generation (a counter
/// bumped per insert) of its newest insert, and `order` lists `(hash, generation)` oldest first. A
/// refresh pushes a new entry and leaves the old one stale (its generation no longer matches `gen`);
/// stale entries are skipped when they reach the front and dropped in bulk once they outnumber the
/// live ones, so a refresh never scans the queue (a long prompt into a large tracker runs under the
/// worker's lock on the request path).
#[derive(Debug)]
pub struct PrefixTracker {
    gen: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    next_gen: u64,
    capacity: usize,
}

impl PrefixTracker {
    /// A tracker remembering at most `capacity` blocks (the worker's KV pool size).
    pub fn new(capacity: usize) -> Self {
        PrefixTracker {
            gen: HashMap::new(),
            order: VecDeque::new(),
            next_gen: 0,
            capacity: capacity.max(1),
        }
    }

    /// Leading blocks of `hashes` believed cached.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.gen.contains_key(h)).count()
    }

    /// Records that the worker now holds these blocks; refreshes ones it already had.
    pub fn insert(&mut self, hashes: &[u64]) {
        for &h in hashes {
            let g = self.next_gen;
            self.next_gen += 1;
            self.gen.insert(h, g);
            self.order.push_back((h, g));
        }
        self.evict();
        // Each compaction drops at least half the queue, so its cost is paid by the pushes that
        // made those entries stale.
        if self.order.len() > 2 * self.gen.len() + 64 {
            let gen = &self.gen;
            self.order.retain(|(h, g)| gen.get(h) == Some(g));
        }
    }

    /// Changes how many blocks are remembered (a worker's KV tiers grow what it holds), forgetting the
    /// oldest past a smaller bound.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        self.evict();
    }

    /// Forgets the oldest blocks past the capacity and leaves a live entry (or none) at the front.
    fn evict(&mut self) {
        while let Some(&(h, g)) = self.order.front() {
            let live = self.gen.get(&h) == Some(&g);
            if live && self.gen.len() <= self.capacity {
                break;
            }
            self.order.pop_front();
            if live {
                self.gen.remove(&h);
            }
        }
    }

    /// Blocks currently remembered.
    pub fn len(&self) -> usize {
        self.gen.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.gen.is_empty()
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

    #[test]
    fn a_refresh_moves_a_block_to_the_newest_position() {
        let mut t = PrefixTracker::new(3);
        let [a, b, c, d] = [[1u64], [2], [3], [4]];
        t.insert(&a);
        t.insert(&b);
        t.insert(&c);
        t.insert(&a);
        t.insert(&d);
        assert_eq!(t.matched_blocks(&a), 1, "refreshed, so b went first");
        assert_eq!(t.matched_blocks(&b), 0);
        assert_eq!(t.matched_blocks(&c), 1);
        t.insert(&[5]);
        assert_eq!(t.matched_blocks(&c), 0, "then c, the oldest left");
        assert_eq!(t.matched_blocks(&a), 1);
    }

    #[test]
    fn many_refreshes_keep_the_queue_bounded() {
        let mut t = PrefixTracker::new(4);
        for i in 0..10_000u64 {
            t.insert(&[i % 3]);
        }
        assert_eq!(t.len(), 3);
        assert!(t.order.len() <= 2 * t.len() + 65, "{}", t.order.len());
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

        #[test]
        fn tracker_forgets_what_a_plain_lru_forgets(
            ops in proptest::collection::vec(proptest::collection::vec(0u64..24, 0..12), 1..60),
            cap in 1usize..16,
        ) {
            // The scan-and-remove LRU this tracker replaced, as the reference.
            let mut model: VecDeque<u64> = VecDeque::new();
            let mut t = PrefixTracker::new(cap);
            for hashes in &ops {
                t.insert(hashes);
                for &h in hashes {
                    model.retain(|&x| x != h);
                    model.push_back(h);
                }
                while model.len() > cap {
                    model.pop_front();
                }
                prop_assert_eq!(t.len(), model.len());
                for h in 0..24u64 {
                    prop_assert_eq!(t.matched_blocks(&[h]) == 1, model.contains(&h));
                }
            }
        }
    }
}
