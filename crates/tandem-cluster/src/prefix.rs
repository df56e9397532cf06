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

/// Where a worker keeps a cached block, fastest first: its device pool, then the KV tiers under it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLevel {
    /// The worker's KV pool on its accelerator.
    Device,
    /// The host-memory tier.
    Host,
    /// The disk tier.
    Disk,
}

/// What a block held in the device pool is worth to a prompt starting with it, in milli-blocks: the
/// unit of [`PrefixTracker::matched_score`] (a full hit, nothing to compute or copy).
pub const DEVICE_WEIGHT_MILLI: u64 = 1000;

/// What a block held in the host tier is worth, in milli-blocks. Restoring it is a copy from pinned
/// host memory over PCIe or NVLink-C2C (tens of GB/s, a small part of the time to recompute the
/// block's layers on a model of billions of parameters), so it saves most of a device hit, less the copy and its wait at
/// admission.
pub const HOST_WEIGHT_MILLI: u64 = 800;

/// What a block held in the disk tier is worth, in milli-blocks. A disk read (a few GB/s from NVMe,
/// with a checksum, then the same copy up as the host tier's) costs a large fraction of recomputing
/// the block, so it saves less than half a device hit: a longer prefix on disk beats a shorter one
/// on the device only when it is more than 2.5 times as long.
pub const DISK_WEIGHT_MILLI: u64 = 400;

impl KvLevel {
    /// The level of a KV tier as a worker's load report names it (`KvTierStats::tier`); a name this
    /// head does not know counts as disk, the least it can be worth.
    pub fn from_tier_name(name: &str) -> KvLevel {
        match name {
            "host" => KvLevel::Host,
            _ => KvLevel::Disk,
        }
    }

    /// What one block held at this level is worth, in milli-blocks.
    pub fn weight_milli(self) -> u64 {
        match self {
            KvLevel::Device => DEVICE_WEIGHT_MILLI,
            KvLevel::Host => HOST_WEIGHT_MILLI,
            KvLevel::Disk => DISK_WEIGHT_MILLI,
        }
    }
}

/// Block hashes believed cached on one worker, bounded to what its pool and KV tiers hold (oldest
/// forgotten first).
///
/// An LRU in O(1) amortized per block: `gen` maps each remembered hash to the generation (a counter
/// bumped per insert) of its newest insert, and `order` lists `(hash, generation)` oldest first. A
/// refresh pushes a new entry and leaves the old one stale (its generation no longer matches `gen`);
/// stale entries are skipped when they reach the front and dropped in bulk once they outnumber the
/// live ones, so a refresh never scans the queue (a long prompt into a large tracker runs under the
/// worker's lock on the request path).
///
/// The tracker also knows how many blocks each level of the worker holds (`levels`, device first)
/// and places a block by its recency rank, as the workers' LRU demotion does: the newest blocks are on
/// the device, the next ones in host memory, the oldest on disk.
#[derive(Debug)]
pub struct PrefixTracker {
    gen: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    next_gen: u64,
    capacity: usize,
    levels: Vec<(KvLevel, usize)>,
}

impl PrefixTracker {
    /// A tracker remembering at most `capacity` blocks, all on the device (a worker's KV pool size).
    pub fn new(capacity: usize) -> Self {
        let mut t = PrefixTracker {
            gen: HashMap::new(),
            order: VecDeque::new(),
            next_gen: 0,
            capacity: 1,
            levels: Vec::new(),
        };
        t.set_capacity(capacity);
        t
    }

    /// Leading blocks of `hashes` believed cached.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.gen.contains_key(h))
            .count()
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

    /// Leading blocks of `hashes` believed cached, each weighted by the level it is estimated to sit in
    /// ([`KvLevel::weight_milli`]), in milli-blocks: what ranks workers by the prefill their cache
    /// saves, where [`Self::matched_blocks`] counts the tokens they hold.
    ///
    /// A block's level comes from its recency rank, estimated without a scan as the generations
    /// issued since its own, scaled by the fraction of the queue's generation span still live (stale
    /// and compacted entries are assumed spread evenly over it). It is exact while nothing was
    /// refreshed, and only a routing estimate otherwise, like the rest of the tracker.
    pub fn matched_score(&self, hashes: &[u64]) -> u64 {
        let Some(&(_, oldest)) = self.order.front() else {
            return 0;
        };
        let newest = self.next_gen - 1;
        let live = self.gen.len() as u128;
        let span = (newest - oldest + 1) as u128;
        hashes
            .iter()
            .map_while(|h| self.gen.get(h))
            .map(|&g| {
                let rank = ((newest - g) as u128 * live / span) as usize;
                self.level_at(rank).weight_milli()
            })
            .sum()
    }

    /// The level holding the block of recency `rank` (0 the newest), filling each level in turn.
    fn level_at(&self, mut rank: usize) -> KvLevel {
        for &(level, blocks) in &self.levels {
            if rank < blocks {
                return level;
            }
            rank -= blocks;
        }
        self.levels.last().map_or(KvLevel::Device, |&(l, _)| l)
    }

    /// Changes how many blocks are remembered, all counted as on the device, forgetting the oldest past
    /// a smaller bound.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.set_levels(&[(KvLevel::Device, capacity)]);
    }

    /// Sets how many blocks each level of the worker holds, fastest first (its pool, then its KV tiers
    /// as its load report lists them): what is remembered is their sum, and the oldest past a smaller
    /// bound are forgotten.
    pub fn set_levels(&mut self, levels: &[(KvLevel, usize)]) {
        self.levels = levels.to_vec();
        self.capacity = levels.iter().map(|&(_, n)| n).sum::<usize>().max(1);
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

    #[test]
    fn tier_estimates_follow_recency() {
        let mut t = PrefixTracker::new(1);
        t.set_levels(&[(KvLevel::Device, 2), (KvLevel::Host, 2), (KvLevel::Disk, 2)]);
        for h in 1..=6u64 {
            t.insert(&[h]);
        }
        let score = |t: &PrefixTracker, h: u64| t.matched_score(&[h]);
        let want = [
            DISK_WEIGHT_MILLI,
            DISK_WEIGHT_MILLI,
            HOST_WEIGHT_MILLI,
            HOST_WEIGHT_MILLI,
        ];
        for (h, w) in (1..=4).zip(want) {
            assert_eq!(score(&t, h), w, "block {h}");
        }
        assert_eq!(score(&t, 5), DEVICE_WEIGHT_MILLI);
        assert_eq!(score(&t, 6), DEVICE_WEIGHT_MILLI);
        // A refresh brings a block back to the device and pushes the others down one.
        t.insert(&[1]);
        assert_eq!(score(&t, 1), DEVICE_WEIGHT_MILLI);
        assert_eq!(score(&t, 5), HOST_WEIGHT_MILLI);
        assert_eq!(score(&t, 3), DISK_WEIGHT_MILLI);
        assert_eq!(score(&t, 7), 0, "never inserted");
        assert_eq!(
            t.matched_score(&[1, 7, 6]),
            DEVICE_WEIGHT_MILLI,
            "only leading blocks count"
        );
    }

    #[test]
    fn a_device_held_prefix_outranks_an_equal_disk_held_one() {
        let levels = [(KvLevel::Device, 4), (KvLevel::Disk, 100)];
        let prompt = block_hashes(&[1, 1, 2, 2, 3, 3, 4, 4], 2);
        let mut hot = PrefixTracker::new(1);
        hot.set_levels(&levels);
        hot.insert(&prompt);
        let mut cold = PrefixTracker::new(1);
        cold.set_levels(&levels);
        cold.insert(&prompt);
        cold.insert(&block_hashes(&[9; 8], 2));
        assert_eq!(hot.matched_blocks(&prompt), cold.matched_blocks(&prompt));
        assert_eq!(hot.matched_score(&prompt), 4 * DEVICE_WEIGHT_MILLI);
        assert_eq!(cold.matched_score(&prompt), 4 * DISK_WEIGHT_MILLI);
    }

    #[test]
    fn rank_estimates_stay_in_bounds_after_many_refreshes() {
        let mut t = PrefixTracker::new(1);
        t.set_levels(&[(KvLevel::Device, 8), (KvLevel::Host, 8)]);
        for i in 0..5_000u64 {
            t.insert(&[i % 16, (i * 7) % 16]);
        }
        assert_eq!(t.len(), 16);
        let newest = (4_999 * 7) % 16;
        assert_eq!(t.matched_score(&[newest]), DEVICE_WEIGHT_MILLI);
        let all: u64 = (0..16).map(|h| t.matched_score(&[h])).sum();
        assert!(
            (16 * HOST_WEIGHT_MILLI..=16 * DEVICE_WEIGHT_MILLI).contains(&all),
            "{all}"
        );
    }

    #[test]
    fn tier_names_map_to_levels() {
        assert_eq!(KvLevel::from_tier_name("host"), KvLevel::Host);
        assert_eq!(KvLevel::from_tier_name("disk"), KvLevel::Disk);
        assert_eq!(KvLevel::from_tier_name("cxl"), KvLevel::Disk);
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
