//! The fixed pool of physical KV blocks: free list, reference counts and per-sequence block tables.
//!
//! Every block is always in exactly one of three states: on the free list (refcount 0, no content),
//! cached (refcount 0, indexed by the prefix cache, evictable) or referenced (refcount > 0, by live
//! sequences and/or pins). [`BlockPool::check_invariants`] verifies that.

use crate::prefix_cache::{hash_block, PrefixCache, ROOT_HASH};

/// Returned when the pool cannot supply the blocks a sequence needs; the scheduler preempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV cache out of blocks: need {needed} more, {available} available")]
pub struct OutOfBlocks {
    /// Blocks the request needed beyond what it holds.
    pub needed: usize,
    /// Blocks that were obtainable (free or evictable).
    pub available: usize,
}

/// One sequence's logical-to-physical block mapping, plus the hashes of its full blocks.
#[derive(Clone, Debug, Default)]
pub struct BlockTable {
    /// Physical block of each logical block, in order.
    pub blocks: Vec<u32>,
    /// Hash of each leading full block whose content has been named (registered or matched).
    hashes: Vec<u64>,
    /// Set when some layers' KV of some blocks was never written (an import that skipped the blocks
    /// behind a sliding window): such blocks must never answer another sequence's prefix lookup.
    unnamed: bool,
}

impl BlockTable {
    /// Keeps this table's blocks out of the prefix cache until it is released: some of their layers
    /// hold no KV.
    pub fn keep_unnamed(&mut self) {
        self.unnamed = true;
    }

    /// Tokens this table can hold.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Whether the table holds no blocks.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The name of the table's last named block (the root's for none): what the next full block's
    /// name chains from.
    pub fn last_hash(&self) -> u64 {
        self.hashes.last().copied().unwrap_or(ROOT_HASH)
    }

    /// Whether every block of the table is named (a prefix match leaves it so): only then can restored
    /// blocks be appended with [`BlockPool::finish_restore`].
    pub fn all_named(&self) -> bool {
        !self.unnamed && self.hashes.len() == self.blocks.len()
    }
}

/// The pool of blocks shared by all sequences of one engine.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    free: Vec<u32>,
    used: usize,
    cache: PrefixCache,
    caching: bool,
    /// Whether evicted cached blocks are recorded in `evicted` (KV tiers are on).
    record_evictions: bool,
    /// Cached blocks evicted since the last [`BlockPool::take_evicted`], with the name of the content
    /// they still hold until the next write: what the engine copies down to its KV tiers.
    evicted: Vec<(u32, u64)>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens; `caching` enables prefix reuse.
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            refcount: vec![0; num_blocks],
            // Reversed so that low block ids are handed out first (easier to read in logs).
            free: (0..num_blocks as u32).rev().collect(),
            used: 0,
            cache: PrefixCache::new(num_blocks),
            caching,
            record_evictions: false,
            evicted: Vec::new(),
        }
    }

    /// Makes the pool record each evicted cached block (see [`Self::take_evicted`]).
    pub fn record_evictions(&mut self) {
        self.record_evictions = true;
    }

    /// Whether prefix caching is on.
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// The cached blocks evicted since the last call, each with its content's name. Their KV is intact
    /// until the next step or import writes them, so the caller copies them down before that.
    pub fn take_evicted(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.evicted)
    }

    /// Whether the pool holds the block named `hash` (referenced or cached).
    pub fn holds(&self, hash: u64) -> bool {
        self.cache.lookup(hash).is_some()
    }

    /// A block for restoring content from a KV tier into `table` (referenced by it); None when none is
    /// obtainable. The caller copies evicted blocks down before writing it, then names it with
    /// [`Self::finish_restore`] or gives it back with [`Self::abort_restore`].
    pub fn take_for_restore(&mut self) -> Option<u32> {
        self.take_block()
    }

    /// Appends a restored block, now holding the content named `hash`, to `table`, whose named blocks
    /// must be exactly the prefix `hash` extends: the block is then the table's next full block, named
    /// like a computed one, so later lookups find it.
    pub fn finish_restore(&mut self, table: &mut BlockTable, block: u32, hash: u64) {
        debug_assert_eq!(table.hashes.len(), table.blocks.len());
        let named = self.cache.insert(block, hash);
        debug_assert!(named, "restored a block the pool already holds");
        table.blocks.push(block);
        table.hashes.push(hash);
    }

    /// Gives back a block whose restore failed: it holds nothing.
    pub fn abort_restore(&mut self, block: u32) {
        self.decref(block);
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// All blocks of the pool.
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks obtainable right now: plain free ones plus evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.cache.num_evictable()
    }

    /// Blocks referenced by a live sequence or pin.
    pub fn num_used(&self) -> usize {
        self.used
    }

    /// Unreferenced blocks that still hold a reusable prefix.
    pub fn num_cached(&self) -> usize {
        self.cache.num_evictable()
    }

    /// (queried, hit) prompt tokens of prefix lookups.
    pub fn prefix_counters(&self) -> (u64, u64) {
        self.cache.counters()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn take_block(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (b, hash) = self.cache.evict_named()?;
                if self.record_evictions {
                    self.evicted.push((b, hash));
                }
                b
            }
        };
        debug_assert_eq!(self.refcount[b as usize], 0);
        self.refcount[b as usize] = 1;
        self.used += 1;
        Some(b)
    }

    fn incref(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        if *rc == 0 {
            self.cache.on_reuse(b);
            self.used += 1;
        }
        *rc += 1;
    }

    fn decref(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        assert!(*rc > 0, "refcount underflow on block {b}");
        *rc -= 1;
        if *rc == 0 {
            self.used -= 1;
            if !self.cache.on_free(b) {
                self.free.push(b);
            }
        }
    }

    /// Grows `table` to hold `num_tokens` tokens; all-or-nothing.
    pub fn ensure_capacity(
        &mut self,
        table: &mut BlockTable,
        num_tokens: usize,
    ) -> Result<(), OutOfBlocks> {
        let want = self.blocks_for(num_tokens);
        let needed = want.saturating_sub(table.blocks.len());
        if needed == 0 {
            return Ok(());
        }
        let available = self.num_available();
        if needed > available {
            return Err(OutOfBlocks { needed, available });
        }
        for _ in 0..needed {
            let b = self.take_block().expect("availability checked above");
            table.blocks.push(b);
        }
        Ok(())
    }

    /// Drops the table's references (tail first, so a prefix's tail is evicted before its head).
    pub fn release(&mut self, table: &mut BlockTable) {
        while let Some(b) = table.blocks.pop() {
            self.decref(b);
        }
        table.hashes.clear();
        table.unnamed = false;
    }

    /// A second table referencing the same blocks (a pin keeps a finished prefill's KV alive).
    pub fn share(&mut self, table: &BlockTable) -> BlockTable {
        for &b in &table.blocks {
            self.incref(b);
        }
        table.clone()
    }

    /// Fills an empty `table` with the longest cached prefix of `tokens`, always leaving at least one
    /// token uncached so the model computes logits; returns the number of cached tokens.
    pub fn match_prefix(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        let hit = self.match_prefix_unrecorded(table, tokens);
        self.cache.record(tokens.len(), hit);
        hit
    }

    /// [`Self::match_prefix`] without counting the lookup in [`Self::prefix_counters`]: for a waiting
    /// request that may not be admitted this step (and would be looked up again next step); the
    /// scheduler counts it with [`Self::record_lookup`] once it is admitted.
    pub fn match_prefix_unrecorded(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        if !self.caching {
            return 0;
        }
        self.match_blocks_unrecorded(table, tokens, max_blocks)
    }

    /// Counts one prefix lookup of `queried` prompt tokens, `hit` of them found in the pool.
    pub fn record_lookup(&mut self, queried: usize, hit: usize) {
        if self.caching {
            self.cache.record(queried, hit);
        }
    }

    /// Like [`Self::match_prefix`] but may cover every full block of `tokens`: for a prompt whose KV is
    /// imported (its first token already sampled elsewhere), so nothing has to be left for the model.
    pub fn match_full_blocks(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        let max_blocks = tokens.len() / self.block_size;
        self.match_blocks(table, tokens, max_blocks)
    }

    fn match_blocks(&mut self, table: &mut BlockTable, tokens: &[u32], max_blocks: usize) -> usize {
        if !self.caching {
            return 0;
        }
        let hit = self.match_blocks_unrecorded(table, tokens, max_blocks);
        self.cache.record(tokens.len(), hit);
        hit
    }

    fn match_blocks_unrecorded(
        &mut self,
        table: &mut BlockTable,
        tokens: &[u32],
        max_blocks: usize,
    ) -> usize {
        debug_assert!(table.is_empty());
        if !self.caching || tokens.is_empty() {
            return 0;
        }
        let mut parent = ROOT_HASH;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let h = hash_block(parent, chunk);
            let Some(b) = self.cache.lookup(h) else { break };
            self.incref(b);
            table.blocks.push(b);
            table.hashes.push(h);
            parent = h;
        }
        table.blocks.len() * self.block_size
    }

    /// Names every full block among the first `num_computed` tokens (whose KV is now written) so that
    /// later requests can reuse it.
    pub fn register_computed(
        &mut self,
        table: &mut BlockTable,
        tokens: &[u32],
        num_computed: usize,
    ) {
        if !self.caching || table.unnamed {
            return;
        }
        let full = (num_computed / self.block_size).min(table.blocks.len());
        while table.hashes.len() < full {
            let i = table.hashes.len();
            let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
            let h = hash_block(
                parent,
                &tokens[i * self.block_size..(i + 1) * self.block_size],
            );
            // A false return means another sequence computed the same block first: ours stays unnamed
            // and returns to the free list when released.
            self.cache.insert(table.blocks[i], h);
            table.hashes.push(h);
        }
    }

    /// Checks that every block is exactly one of free, cached-evictable or referenced, and that
    /// `refs` (block ids held by all live tables and pins, with multiplicity) explains every refcount.
    pub fn check_invariants(&self, refs: &[u32]) -> Result<(), String> {
        let n = self.num_blocks();
        let mut expected = vec![0u32; n];
        for &b in refs {
            expected[b as usize] += 1;
        }
        if expected != self.refcount {
            return Err(format!(
                "refcounts {:?} differ from held references {:?}",
                self.refcount, expected
            ));
        }
        let mut on_free = vec![false; n];
        for &b in &self.free {
            if std::mem::replace(&mut on_free[b as usize], true) {
                return Err(format!("block {b} twice on the free list"));
            }
        }
        let mut used = 0;
        for (b, (&rc, &free)) in self.refcount.iter().zip(&on_free).enumerate() {
            let evictable = self.cache.is_evictable(b as u32);
            let states = usize::from(free) + usize::from(evictable) + usize::from(rc > 0);
            if states != 1 || (free && self.cache.is_cached(b as u32)) {
                return Err(format!(
                    "block {b}: free={free} evictable={evictable} rc={rc}"
                ));
            }
            used += usize::from(rc > 0);
        }
        if used != self.used {
            return Err(format!(
                "used counter {} but {used} referenced blocks",
                self.used
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut p = BlockPool::new(3, 4, false);
        let mut a = BlockTable::default();
        p.ensure_capacity(&mut a, 9).unwrap();
        assert_eq!(a.blocks.len(), 3);
        let mut b = BlockTable::default();
        assert_eq!(
            p.ensure_capacity(&mut b, 1),
            Err(OutOfBlocks {
                needed: 1,
                available: 0
            })
        );
        assert!(b.is_empty());
        p.release(&mut a);
        assert_eq!(p.num_available(), 3);
        p.check_invariants(&[]).unwrap();
    }

    #[test]
    fn prefix_is_reused_and_leaves_one_token() {
        let mut p = BlockPool::new(8, 4, true);
        let toks: Vec<u32> = (0..12).collect();
        let mut a = BlockTable::default();
        assert_eq!(p.match_prefix(&mut a, &toks), 0);
        p.ensure_capacity(&mut a, 12).unwrap();
        p.register_computed(&mut a, &toks, 12);
        let a_blocks = a.blocks.clone();
        p.release(&mut a);
        assert_eq!(p.num_cached(), 3);
        // Same 12 tokens: only 2 blocks may be reused, the last token must be computed.
        let mut b = BlockTable::default();
        assert_eq!(p.match_prefix(&mut b, &toks), 8);
        assert_eq!(b.blocks, a_blocks[..2]);
        // Diverging in the second block: only the first is reused.
        let mut other = toks.clone();
        other[5] = 99;
        let mut c = BlockTable::default();
        assert_eq!(p.match_prefix(&mut c, &other), 4);
        assert_eq!(p.prefix_counters(), (36, 12));
        // An imported prompt needs no token left over: all three full blocks match.
        let mut d = BlockTable::default();
        assert_eq!(p.match_full_blocks(&mut d, &toks), 12);
        assert_eq!(d.blocks, a_blocks);
        p.release(&mut d);
        p.check_invariants(&[a_blocks[0], a_blocks[1], a_blocks[0]])
            .unwrap();
        p.release(&mut b);
        p.release(&mut c);
        p.check_invariants(&[]).unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_when_free_list_is_dry() {
        let mut p = BlockPool::new(2, 2, true);
        let toks = [1, 2, 3, 4];
        let mut a = BlockTable::default();
        p.ensure_capacity(&mut a, 4).unwrap();
        p.register_computed(&mut a, &toks, 4);
        p.release(&mut a);
        assert_eq!((p.num_cached(), p.num_available()), (2, 2));
        let mut b = BlockTable::default();
        p.ensure_capacity(&mut b, 3).unwrap();
        assert_eq!(p.num_cached(), 0);
        let mut c = BlockTable::default();
        assert_eq!(
            p.match_prefix(&mut c, &toks),
            0,
            "evicted content must not be matched"
        );
        p.release(&mut b);
        p.check_invariants(&[]).unwrap();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Grow(usize, usize),
        Release(usize),
        Register(usize),
        Share(usize),
        Match(usize, u8),
        MatchFull(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..4usize, 1..20usize).prop_map(|(s, n)| Op::Grow(s, n)),
            (0..6usize).prop_map(Op::Release),
            (0..4usize).prop_map(Op::Register),
            (0..4usize).prop_map(Op::Share),
            (0..4usize, 0..3u8).prop_map(|(s, v)| Op::Match(s, v)),
            (0..4usize).prop_map(Op::MatchFull),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn invariants_hold_under_random_ops(ops in proptest::collection::vec(op(), 1..60), caching: bool) {
            let mut p = BlockPool::new(10, 3, caching);
            // Tables 0..4 are "sequences"; 4..6 are pins made by Share.
            let mut tables: Vec<BlockTable> = vec![BlockTable::default(); 6];
            let mut toks: Vec<Vec<u32>> = vec![Vec::new(); 6];
            for op in ops {
                match op {
                    Op::Grow(s, n) => {
                        let want = tables[s].capacity(3) + n;
                        if p.ensure_capacity(&mut tables[s], want).is_ok() {
                            while toks[s].len() < want { let v = (toks[s].len() % 5) as u32; toks[s].push(v); }
                        }
                    }
                    Op::Release(s) => { p.release(&mut tables[s]); toks[s].clear(); }
                    Op::Register(s) => { let n = toks[s].len(); p.register_computed(&mut tables[s], &toks[s], n); }
                    Op::Share(s) => {
                        let pin = 4 + s % 2;
                        p.release(&mut tables[pin]);
                        tables[pin] = p.share(&tables[s]);
                        toks[pin] = toks[s].clone();
                    }
                    Op::Match(s, v) => {
                        if tables[s].is_empty() {
                            let t: Vec<u32> = (0..10u32).map(|i| (i % 5 + v as u32 * (i / 6)) % 5).collect();
                            let hit = p.match_prefix(&mut tables[s], &t);
                            prop_assert!(hit < t.len());
                            toks[s] = t[..hit].to_vec();
                        }
                    }
                    Op::MatchFull(s) => {
                        if tables[s].is_empty() {
                            let t: Vec<u32> = (0..9u32).map(|i| i % 5).collect();
                            let hit = p.match_full_blocks(&mut tables[s], &t);
                            prop_assert!(hit <= t.len() && hit.is_multiple_of(3));
                            toks[s] = t[..hit].to_vec();
                        }
                    }
                }
                let refs: Vec<u32> = tables.iter().flat_map(|t| t.blocks.iter().copied()).collect();
                p.check_invariants(&refs).unwrap();
            }
            for t in &mut tables { p.release(t); }
            p.check_invariants(&[]).unwrap();
            prop_assert_eq!(p.num_available(), 10);
            prop_assert_eq!(p.num_used(), 0);
        }
    }
}
