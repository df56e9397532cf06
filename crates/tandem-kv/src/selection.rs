//! Which blocks of a transfer a pull asks for.
//!
//! A decode worker whose own prefix cache already holds the first blocks of a prompt pulls only the rest;
//! a selection names those blocks as indices into the transfer's block list (the handle's `block_ids`).
//! A [`PullSelection`] narrows it per layer: a sliding-window layer's blocks that no later query can
//! see are not asked for at all.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::KvError;

/// A set of block indices into a transfer's block list, kept as sorted, disjoint, non-adjacent, non-empty
/// half-open runs, so "everything but a cached prefix" is one run on the wire however long the prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<[u32; 2]>", into = "Vec<[u32; 2]>")]
pub struct BlockSelection {
    runs: Vec<Range<u32>>,
}

impl BlockSelection {
    /// Every block of a transfer of `n_blocks` blocks.
    pub fn all(n_blocks: usize) -> Self {
        Self::range(0..n_blocks as u32)
    }

    /// The blocks `r.start..r.end`; empty when the range is.
    pub fn range(r: Range<u32>) -> Self {
        let runs = if r.is_empty() { Vec::new() } else { vec![r] };
        BlockSelection { runs }
    }

    /// The given indices, in any order and with repeats.
    pub fn from_indices(indices: impl IntoIterator<Item = u32>) -> Self {
        let mut v: Vec<u32> = indices.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        Self::from_runs(v.into_iter().map(|i| i..i + 1))
    }

    /// Normalizes arbitrary runs: sorts them, drops empty ones and merges overlapping or touching ones.
    fn from_runs(runs: impl IntoIterator<Item = Range<u32>>) -> Self {
        let mut v: Vec<Range<u32>> = runs.into_iter().filter(|r| !r.is_empty()).collect();
        v.sort_unstable_by_key(|r| r.start);
        let mut out: Vec<Range<u32>> = Vec::with_capacity(v.len());
        for r in v {
            match out.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        BlockSelection { runs: out }
    }

    /// The runs, ascending.
    pub fn runs(&self) -> &[Range<u32>] {
        &self.runs
    }

    /// Where each run lands when the selected blocks, `block_bytes` each, are packed back to back (one
    /// layer of a pull): (first block index, byte offset in the packed region, bytes), per run.
    pub fn packed_runs(&self, block_bytes: usize) -> Vec<(usize, usize, usize)> {
        let mut end = 0;
        self.runs
            .iter()
            .map(|run| {
                let len = (run.end - run.start) as usize * block_bytes;
                end += len;
                (run.start as usize, end - len, len)
            })
            .collect()
    }

    /// Number of selected blocks.
    pub fn len(&self) -> usize {
        self.runs.iter().map(|r| (r.end - r.start) as usize).sum()
    }

    /// Whether no block is selected (the pull then only acks).
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The selected indices, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.runs.iter().flat_map(|r| r.clone())
    }

    /// The selected indices from `start` on.
    pub fn from_index(&self, start: u32) -> Self {
        BlockSelection {
            runs: self
                .runs
                .iter()
                .filter(|r| r.end > start)
                .map(|r| r.start.max(start)..r.end)
                .collect(),
        }
    }

    /// Refuses a selection reaching past a transfer of `n_blocks` blocks.
    pub fn check(&self, n_blocks: usize) -> Result<(), KvError> {
        match self.runs.last() {
            Some(r) if r.end as usize > n_blocks => Err(KvError::Protocol(format!(
                "block selection reaches index {} of a {n_blocks}-block transfer",
                r.end - 1
            ))),
            _ => Ok(()),
        }
    }
}

/// What a pull asks for of each layer: the `blocks` every layer shares, less, for a layer that starts
/// later, the blocks before its start. A sliding-window layer starts at the block of the first position
/// the next query still sees, so the blocks behind its window never cross the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullSelection {
    /// The blocks asked for of every layer that starts at 0.
    pub blocks: BlockSelection,
    /// Per layer, the first block index the layer needs; empty when every layer needs all of `blocks`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_from: Vec<u32>,
}

impl PullSelection {
    /// The same `blocks` of every layer.
    pub fn uniform(blocks: BlockSelection) -> Self {
        PullSelection {
            blocks,
            layer_from: Vec::new(),
        }
    }

    /// `blocks`, each layer `l` from index `layer_from[l]` on (one entry per layer).
    pub fn with_layer_from(blocks: BlockSelection, layer_from: Vec<u32>) -> Self {
        if layer_from.iter().all(|&f| f == 0) {
            return Self::uniform(blocks);
        }
        PullSelection { blocks, layer_from }
    }

    /// The blocks asked for of `layer`.
    pub fn layer(&self, layer: usize) -> BlockSelection {
        match self.layer_from.get(layer) {
            Some(&from) if from > 0 => self.blocks.from_index(from),
            _ => self.blocks.clone(),
        }
    }

    /// Blocks asked for of each of `n_layers` layers.
    pub fn layer_lens(&self, n_layers: usize) -> Vec<usize> {
        (0..n_layers).map(|l| self.layer(l).len()).collect()
    }

    /// Where each layer's blocks sit when every layer's selected blocks, `block_bytes` each, are packed
    /// back to back, layer after layer: (byte offset, bytes), per layer.
    pub fn packed_layers(&self, n_layers: usize, block_bytes: usize) -> Vec<(usize, usize)> {
        let mut end = 0;
        self.layer_lens(n_layers)
            .into_iter()
            .map(|n| {
                end += n * block_bytes;
                (end - n * block_bytes, n * block_bytes)
            })
            .collect()
    }

    /// Bytes the pull moves: every layer's selected blocks.
    pub fn bytes(&self, n_layers: usize, block_bytes: usize) -> u64 {
        self.layer_lens(n_layers).iter().sum::<usize>() as u64 * block_bytes as u64
    }

    /// Whether no layer asks for a block (the pull then only acks).
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
            || (!self.layer_from.is_empty()
                && self
                    .layer_from
                    .iter()
                    .all(|&f| self.blocks.runs().last().is_some_and(|r| r.end <= f)))
    }

    /// Refuses a selection reaching past a transfer of `n_blocks` blocks or naming other than `n_layers`
    /// layer starts.
    pub fn check(&self, n_blocks: usize, n_layers: usize) -> Result<(), KvError> {
        self.blocks.check(n_blocks)?;
        if !self.layer_from.is_empty() && self.layer_from.len() != n_layers {
            return Err(KvError::Protocol(format!(
                "a pull names the starts of {} layers of a {n_layers}-layer model",
                self.layer_from.len()
            )));
        }
        Ok(())
    }
}

impl TryFrom<Vec<[u32; 2]>> for BlockSelection {
    type Error = String;

    fn try_from(raw: Vec<[u32; 2]>) -> Result<Self, Self::Error> {
        if let Some([s, e]) = raw.iter().find(|[s, e]| s > e) {
            return Err(format!("block run {s}..{e} is reversed"));
        }
        Ok(Self::from_runs(raw.into_iter().map(|[s, e]| s..e)))
    }
}

impl From<BlockSelection> for Vec<[u32; 2]> {
    fn from(s: BlockSelection) -> Self {
        s.runs.into_iter().map(|r| [r.start, r.end]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn runs_are_normalized_and_checked() {
        let s = BlockSelection::from_indices([7, 2, 3, 3, 4, 9]);
        assert_eq!(s.runs(), &[2..5, 7..8, 9..10]);
        assert_eq!(s.len(), 5);
        assert!(s.check(10).is_ok());
        assert!(matches!(s.check(9), Err(KvError::Protocol(_))));
        assert!(BlockSelection::range(4..4).is_empty());
        assert_eq!(BlockSelection::all(3).iter().collect::<Vec<_>>(), [0, 1, 2]);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, "[[2,5],[7,8],[9,10]]");
        assert_eq!(serde_json::from_str::<BlockSelection>(&json).unwrap(), s);
        let merged: BlockSelection = serde_json::from_str("[[5,8],[0,2],[1,3],[8,8]]").unwrap();
        assert_eq!(merged.runs(), &[0..3, 5..8]);
        assert!(serde_json::from_str::<BlockSelection>("[[3,1]]").is_err());
    }

    #[test]
    fn packed_runs_lay_selected_blocks_back_to_back() {
        let sel = BlockSelection::from_indices([0, 1, 5]);
        assert_eq!(sel.packed_runs(10), vec![(0, 0, 20), (5, 20, 10)]);
        assert!(BlockSelection::range(2..2).packed_runs(10).is_empty());
    }

    #[test]
    fn layers_that_start_later_skip_the_blocks_before() {
        let sel = PullSelection::with_layer_from(BlockSelection::range(2..10), vec![0, 6, 12]);
        assert_eq!(sel.layer(0).runs().to_vec(), vec![2..10]);
        assert_eq!(sel.layer(1).runs().to_vec(), vec![6..10]);
        assert!(sel.layer(2).is_empty());
        assert_eq!(sel.layer_lens(3), [8, 4, 0]);
        assert_eq!(sel.packed_layers(3, 10), [(0, 80), (80, 40), (120, 0)]);
        assert_eq!(sel.bytes(3, 10), 120);
        assert!(!sel.is_empty());
        assert!(sel.check(10, 3).is_ok());
        assert!(matches!(sel.check(10, 4), Err(KvError::Protocol(_))));
        let gaps = BlockSelection::from_indices([1, 2, 5, 8]);
        assert_eq!(gaps.from_index(2).runs(), &[2..3, 5..6, 8..9]);
        assert!(PullSelection::with_layer_from(BlockSelection::range(0..4), vec![4, 9]).is_empty());
        let json = serde_json::to_string(&sel).unwrap();
        assert_eq!(json, r#"{"blocks":[[2,10]],"layer_from":[0,6,12]}"#);
        assert_eq!(serde_json::from_str::<PullSelection>(&json).unwrap(), sel);
        let plain = PullSelection::with_layer_from(BlockSelection::all(3), vec![0, 0]);
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"blocks":[[0,3]]}"#
        );
    }

    proptest! {
        #[test]
        fn iter_yields_exactly_the_indices(v in proptest::collection::vec(0u32..50, 0..40)) {
            let s = BlockSelection::from_indices(v.iter().copied());
            let mut want = v.clone();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(s.iter().collect::<Vec<_>>(), want.clone());
            prop_assert_eq!(s.len(), want.len());
            prop_assert!(s.runs().windows(2).all(|w| w[0].end < w[1].start));
        }
    }
}
