//! Where each routed expert of a mixture-of-experts model lives: the expert-parallel placement that
//! tensor-parallel CPU ranks read today and GPUs will read when there is more than one.
//!
//! The map is part of the model description, not of a backend: a rank holds the full matrices of the
//! experts the map gives it (never a slice of an expert), so moving a hot expert to another rank is a
//! change of the map alone.

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::spec::MlpKind;

/// Why a placement was refused: each names the layer and expert at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExpertMapError {
    /// A map over no ranks places nothing.
    #[error("an expert map needs at least one rank")]
    NoRanks,
    /// A placement names a layer that has no experts (dense, or beyond the model).
    #[error("layer {layer} is not a mixture-of-experts layer of this model")]
    NotMoeLayer {
        /// The layer named.
        layer: usize,
    },
    /// A placement names an expert the layer does not have.
    #[error("layer {layer} has no expert {expert} (it has {experts})")]
    NoSuchExpert {
        /// The layer named.
        layer: usize,
        /// The expert named.
        expert: usize,
        /// Experts the layer has.
        experts: usize,
    },
    /// An expert is placed on a rank the group does not have.
    #[error("layer {layer} expert {expert} placed on rank {rank}, but there are {ranks} ranks")]
    RankOutOfRange {
        /// The layer of the expert.
        layer: usize,
        /// The expert.
        expert: usize,
        /// The rank it was placed on.
        rank: usize,
        /// Ranks in the group.
        ranks: usize,
    },
    /// An expert is placed more than once.
    #[error("layer {layer} expert {expert} placed twice (ranks {first} and {second})")]
    PlacedTwice {
        /// The layer of the expert.
        layer: usize,
        /// The expert.
        expert: usize,
        /// The rank of its first placement.
        first: usize,
        /// The rank of its second placement.
        second: usize,
    },
    /// An expert is placed on no rank, so tokens routed to it could not be computed.
    #[error("layer {layer} expert {expert} is placed on no rank")]
    Missing {
        /// The layer of the expert.
        layer: usize,
        /// The expert.
        expert: usize,
    },
    /// The map was built for another group size than the one it is used with.
    #[error("expert map over {map} ranks used with tensor_parallel_size {ranks}")]
    WrongRanks {
        /// Ranks the map places experts on.
        map: usize,
        /// Ranks of the group using it.
        ranks: usize,
    },
    /// The map was built for another model (its MoE layers or expert counts differ).
    #[error("expert map does not match the model: {0}")]
    WrongModel(String),
}

/// A rule that places every expert of every layer; what the settings name (`expert_placement`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertPlacement {
    /// Expert `e` of `E` on rank `e * ranks / E`: each rank a contiguous run of expert ids.
    #[default]
    Contiguous,
    /// Expert `e` on rank `e % ranks`: neighbouring ids, often similarly hot, spread over the ranks.
    RoundRobin,
}

impl ExpertPlacement {
    /// The rank of expert `e` of `experts` under this rule.
    fn rank(self, e: usize, experts: usize, ranks: usize) -> usize {
        match self {
            ExpertPlacement::Contiguous => e * ranks / experts,
            ExpertPlacement::RoundRobin => e % ranks,
        }
    }
}

/// For each mixture-of-experts layer, the rank that holds each routed expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertMap {
    ranks: usize,
    /// Indexed by whole-model layer: `None` for a dense layer, else the owner rank of each expert.
    owners: Vec<Option<Vec<usize>>>,
}

impl ExpertMap {
    /// Every expert of `config` placed over `ranks` ranks by `rule` (no MoE layers: an empty map).
    pub fn new(
        config: &ModelConfig,
        ranks: usize,
        rule: ExpertPlacement,
    ) -> Result<ExpertMap, ExpertMapError> {
        if ranks == 0 {
            return Err(ExpertMapError::NoRanks);
        }
        let experts = experts_per_layer(config);
        Ok(ExpertMap {
            ranks,
            owners: experts
                .iter()
                .map(|e| e.map(|n| (0..n).map(|x| rule.rank(x, n, ranks)).collect()))
                .collect(),
        })
    }

    /// The default placement: contiguous runs of experts (see [`ExpertPlacement::Contiguous`]).
    pub fn contiguous(config: &ModelConfig, ranks: usize) -> Result<ExpertMap, ExpertMapError> {
        ExpertMap::new(config, ranks, ExpertPlacement::Contiguous)
    }

    /// An explicit placement, as a load balancer would write it: one `(layer, expert, rank)` per routed
    /// expert of every MoE layer of `config`. Refuses an expert placed twice or not at all, a rank not
    /// below `ranks`, and a layer or expert the model does not have.
    pub fn from_assignments(
        config: &ModelConfig,
        ranks: usize,
        assignments: impl IntoIterator<Item = (usize, usize, usize)>,
    ) -> Result<ExpertMap, ExpertMapError> {
        if ranks == 0 {
            return Err(ExpertMapError::NoRanks);
        }
        let experts = experts_per_layer(config);
        let mut placed: Vec<Option<Vec<Option<usize>>>> =
            experts.iter().map(|e| e.map(|n| vec![None; n])).collect();
        for (layer, expert, rank) in assignments {
            let slots = placed
                .get_mut(layer)
                .and_then(Option::as_mut)
                .ok_or(ExpertMapError::NotMoeLayer { layer })?;
            let experts = slots.len();
            let slot = slots.get_mut(expert).ok_or(ExpertMapError::NoSuchExpert {
                layer,
                expert,
                experts,
            })?;
            if rank >= ranks {
                return Err(ExpertMapError::RankOutOfRange {
                    layer,
                    expert,
                    rank,
                    ranks,
                });
            }
            if let Some(first) = *slot {
                return Err(ExpertMapError::PlacedTwice {
                    layer,
                    expert,
                    first,
                    second: rank,
                });
            }
            *slot = Some(rank);
        }
        let owners = placed
            .into_iter()
            .enumerate()
            .map(|(layer, slots)| {
                slots
                    .map(|s| {
                        s.into_iter()
                            .enumerate()
                            .map(|(expert, r)| r.ok_or(ExpertMapError::Missing { layer, expert }))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExpertMap { ranks, owners })
    }

    /// Ranks the experts are placed over.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The rank holding each expert of whole-model layer `layer`; `None` for a dense layer.
    pub fn owners(&self, layer: usize) -> Option<&[usize]> {
        self.owners.get(layer).and_then(|o| o.as_deref())
    }

    /// The experts of `layer` that `rank` holds, in increasing id (none for a dense layer).
    pub fn experts_on(&self, layer: usize, rank: usize) -> Vec<usize> {
        self.owners(layer).map_or_else(Vec::new, |o| {
            (0..o.len()).filter(|&x| o[x] == rank).collect()
        })
    }

    /// Checks that this map places the experts of `config` over a group of `ranks`.
    pub fn check(&self, config: &ModelConfig, ranks: usize) -> Result<(), ExpertMapError> {
        if self.ranks != ranks {
            return Err(ExpertMapError::WrongRanks {
                map: self.ranks,
                ranks,
            });
        }
        let want = experts_per_layer(config);
        let have: Vec<Option<usize>> = self
            .owners
            .iter()
            .map(|o| o.as_ref().map(Vec::len))
            .collect();
        if want != have {
            return Err(ExpertMapError::WrongModel(format!(
                "experts per layer {have:?}, the model has {want:?}"
            )));
        }
        Ok(())
    }
}

/// Routed experts of each layer of `config` (`None` for a dense layer).
fn experts_per_layer(config: &ModelConfig) -> Vec<Option<usize>> {
    let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    (0..config.num_layers)
        .map(|l| (config.layer(l).mlp == MlpKind::Moe).then_some(experts))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DenseShape;
    use crate::spec::{LayerRope, MoeSpec};

    /// Three layers, the outer two a mixture of `experts` experts.
    fn moe_config(experts: usize) -> ModelConfig {
        let mut c = ModelConfig::dense(DenseShape {
            hidden: 8,
            ffn: 16,
            layers: 3,
            heads: 2,
            kv_heads: 2,
            head_dim: 4,
            vocab: 10,
            max_positions: 16,
            rope: LayerRope {
                theta: 10000.0,
                scaling: tandem_kernels::RopeScaling::None,
            },
        });
        c.moe = Some(MoeSpec {
            num_experts: experts,
            top_k: 2,
            norm_top_k: true,
            expert_ffn: 4,
            shared_ffn: None,
        });
        c.layers[0].mlp = MlpKind::Moe;
        c.layers[2].mlp = MlpKind::Moe;
        c
    }

    #[test]
    fn rules_place_every_expert_once() {
        let c = moe_config(8);
        let m = ExpertMap::contiguous(&c, 3).unwrap();
        assert_eq!(m.owners(0).unwrap(), [0, 0, 0, 1, 1, 1, 2, 2]);
        assert_eq!(m.owners(1), None, "layer 1 is dense");
        assert_eq!(m.experts_on(2, 1), [3, 4, 5]);
        assert_eq!(m.experts_on(1, 0), Vec::<usize>::new());
        let rr = ExpertMap::new(&c, 3, ExpertPlacement::RoundRobin).unwrap();
        assert_eq!(rr.owners(2).unwrap(), [0, 1, 2, 0, 1, 2, 0, 1]);
        // More ranks than experts: some ranks hold none, every expert is still placed.
        let wide = ExpertMap::contiguous(&moe_config(2), 4).unwrap();
        assert_eq!(wide.owners(0).unwrap(), [0, 2]);
        assert_eq!(ExpertMap::contiguous(&c, 0), Err(ExpertMapError::NoRanks));
        m.check(&c, 3).unwrap();
        assert_eq!(
            m.check(&c, 2),
            Err(ExpertMapError::WrongRanks { map: 3, ranks: 2 })
        );
        assert!(matches!(
            m.check(&moe_config(4), 3),
            Err(ExpertMapError::WrongModel(_))
        ));
    }

    #[test]
    fn explicit_placements_are_checked_by_layer_and_expert() {
        let c = moe_config(2);
        let full = [(0, 0, 1), (0, 1, 1), (2, 0, 0), (2, 1, 1)];
        let m = ExpertMap::from_assignments(&c, 2, full).unwrap();
        assert_eq!(m.owners(0).unwrap(), [1, 1]);
        assert_eq!(m.experts_on(0, 0), Vec::<usize>::new());
        let err = |a: &[(usize, usize, usize)]| {
            ExpertMap::from_assignments(&c, 2, a.iter().copied()).unwrap_err()
        };
        assert_eq!(
            err(&[(0, 0, 1), (0, 1, 1), (2, 0, 0), (2, 1, 1), (2, 1, 0)]),
            ExpertMapError::PlacedTwice {
                layer: 2,
                expert: 1,
                first: 1,
                second: 0
            }
        );
        assert_eq!(
            err(&full[..3]),
            ExpertMapError::Missing {
                layer: 2,
                expert: 1
            }
        );
        let e = err(&[(0, 0, 2)]);
        assert_eq!(
            e,
            ExpertMapError::RankOutOfRange {
                layer: 0,
                expert: 0,
                rank: 2,
                ranks: 2
            }
        );
        assert_eq!(
            e.to_string(),
            "layer 0 expert 0 placed on rank 2, but there are 2 ranks"
        );
        assert_eq!(err(&[(1, 0, 0)]), ExpertMapError::NotMoeLayer { layer: 1 });
        assert_eq!(err(&[(7, 0, 0)]), ExpertMapError::NotMoeLayer { layer: 7 });
        assert_eq!(
            err(&[(0, 2, 0)]),
            ExpertMapError::NoSuchExpert {
                layer: 0,
                expert: 2,
                experts: 2
            }
        );
    }
}
