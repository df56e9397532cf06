//! Routing policies, as pure functions over load snapshots so they are testable without processes.

use rand::Rng;
use serde::{Deserialize, Serialize};

/// Knobs of the routing policies (YAML `routing:`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Prompts whose part not already cached on the chosen decode worker is shorter than this many
    /// tokens are prefilled on that decode worker (a transfer would cost more than it saves).
    pub local_prefill_threshold: usize,
    /// A prefill worker is only preferred for its cached prefix while its in-flight requests exceed
    /// the least-loaded prefill worker's by at most this many (keeps one hot prefix from burying a worker).
    pub prefill_load_bound: usize,
    /// A prompt that continues what the chosen decode worker already caches (at least as many cached
    /// tokens as uncached ones: the next turn of a conversation it answered, a question on a document
    /// it holds) is prefilled there when its uncached part is shorter than this many tokens: a
    /// prefill worker would have to compute the answer tokens it never saw as well, and the KV would
    /// cross the transport, to save the decode worker one short chunk. 0 turns the rule off.
    pub local_continuation_threshold: usize,
    /// A decode worker caching more of a prompt than the load-based choice gets the request only
    /// when it caches at least this many more tokens: a few shared blocks (a chat template's system
    /// prompt, a repeated short question) are cheap to recompute, and following them would pile
    /// every request onto whichever worker served first. 0 follows any cached block.
    pub decode_affinity_min_tokens: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            local_prefill_threshold: 16,
            prefill_load_bound: 2,
            local_continuation_threshold: 512,
            decode_affinity_min_tokens: 256,
        }
    }
}

/// The local-prefill rule: whether a prompt with `uncached` tokens not already cached on the chosen
/// decode worker (and `cached` that are) goes to a prefill worker (`prefill_workers` of them
/// routable) rather than being prefilled on the decode worker itself. Shared by the ingress and the
/// simulator (`tandem-sim`).
pub fn wants_remote_prefill(
    uncached: usize,
    cached: usize,
    prefill_workers: usize,
    cfg: &RoutingConfig,
) -> bool {
    let continuation = cached >= uncached && uncached < cfg.local_continuation_threshold;
    uncached >= cfg.local_prefill_threshold && !continuation && prefill_workers > 0
}

/// How much worse (in [`DecodeLoad::score`]) than the load-based choice a decode worker may be and
/// still get a request for the longer prefix it caches: a quarter of its KV or batch slots.
pub const DECODE_AFFINITY_BOUND: f64 = 0.25;

/// The decode choice: [`pick_decode`] by load, unless another worker caches at least
/// [`RoutingConfig::decode_affinity_min_tokens`] more of the prompt's leading tokens
/// (`matched_tokens[i]` for `loads[i]`) and is loaded at most [`DECODE_AFFINITY_BOUND`] more, so a
/// conversation's next turn goes where its KV is. `None` if there are no candidates.
pub fn pick_decode_cached(
    loads: &[DecodeLoad],
    matched_tokens: &[usize],
    cfg: &RoutingConfig,
    rng: &mut impl Rng,
) -> Option<usize> {
    let matched = matched_tokens;
    let by_load = pick_decode(loads, rng)?;
    let best = (0..loads.len()).max_by(|&i, &j| {
        matched[i]
            .cmp(&matched[j])
            .then(loads[j].score().total_cmp(&loads[i].score()))
            .then(j.cmp(&i))
    })?;
    let near = loads[best].score() <= loads[by_load].score() + DECODE_AFFINITY_BOUND;
    let gain = matched[best].saturating_sub(matched[by_load]);
    Some(
        if gain > 0 && gain >= cfg.decode_affinity_min_tokens && near {
            best
        } else {
            by_load
        },
    )
}

/// What the decode policy weighs for one worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeLoad {
    /// KV blocks in use (sequences and pins) as last polled.
    pub kv_blocks_used: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// Running plus waiting sequences as last polled.
    pub seqs: usize,
    /// Requests the ingress has sent and not seen finish (fresher than the poll).
    pub in_flight: usize,
    /// The worker's batch size, which normalises the sequence count.
    pub max_num_seqs: usize,
}

impl DecodeLoad {
    /// Lower is better: fraction of KV in use plus fraction of batch slots taken.
    pub fn score(&self) -> f64 {
        let kv = self.kv_blocks_used as f64 / self.kv_blocks_total.max(1) as f64;
        let seqs = self.seqs.max(self.in_flight) as f64 / self.max_num_seqs.max(1) as f64;
        kv + seqs
    }
}

/// Power of two choices: sample two distinct candidates, keep the less loaded; `None` if there are none.
///
/// Cheaper and less herd-prone than a global minimum over stale load reports.
pub fn pick_decode(loads: &[DecodeLoad], rng: &mut impl Rng) -> Option<usize> {
    match loads.len() {
        0 => None,
        1 => Some(0),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            Some(if loads[b].score() < loads[a].score() {
                b
            } else {
                a
            })
        }
    }
}

/// What the prefill policy weighs for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillCandidate {
    /// Leading prompt blocks believed cached on the worker, each weighted by the level (device pool,
    /// host or disk tier) it sits in, in milli-blocks (`PrefixTracker::matched_score`): a prefix held
    /// on the device beats the same one on disk, and a longer one on disk wins only when its weight does.
    pub matched_score: u64,
    /// Requests in flight on the worker (ingress count).
    pub in_flight: usize,
}

/// Prefix-aware with a load bound: among workers within `load_bound` of the least loaded, the highest
/// weighted cached prefix wins, then the lower load; `None` if there are no candidates.
pub fn pick_prefill(cands: &[PrefillCandidate], load_bound: usize) -> Option<usize> {
    let min_load = cands.iter().map(|c| c.in_flight).min()?;
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| c.in_flight <= min_load + load_bound)
        .max_by(|(i, a), (j, b)| {
            a.matched_score
                .cmp(&b.matched_score)
                .then(b.in_flight.cmp(&a.in_flight))
                // Prefer the lower index on a full tie so the choice is deterministic.
                .then(j.cmp(i))
        })
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn load(used: usize, seqs: usize) -> DecodeLoad {
        DecodeLoad {
            kv_blocks_used: used,
            kv_blocks_total: 100,
            seqs,
            in_flight: 0,
            max_num_seqs: 10,
        }
    }

    #[test]
    fn two_choices_picks_the_less_loaded_of_two() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let loads = [load(90, 9), load(0, 0)];
        for _ in 0..20 {
            assert_eq!(pick_decode(&loads, &mut rng), Some(1));
        }
        assert_eq!(pick_decode(&[], &mut rng), None);
        assert_eq!(pick_decode(&loads[..1], &mut rng), Some(0));
    }

    #[test]
    fn short_uncached_prompts_stay_on_the_decode_worker() {
        let cfg = RoutingConfig::default();
        let t = cfg.local_prefill_threshold;
        assert!(!wants_remote_prefill(t - 1, 0, 2, &cfg));
        assert!(wants_remote_prefill(t, 0, 2, &cfg));
        assert!(!wants_remote_prefill(1000, 0, 0, &cfg), "no prefill worker");
        // A continuation of what the decode worker holds: its suffix stays there while short.
        let c = cfg.local_continuation_threshold;
        assert!(!wants_remote_prefill(c - 1, 2000, 2, &cfg));
        assert!(wants_remote_prefill(c, 2000, 2, &cfg), "a long suffix");
        assert!(
            wants_remote_prefill(200, 100, 2, &cfg),
            "more uncached than cached: not a continuation"
        );
        let off = RoutingConfig {
            local_continuation_threshold: 0,
            ..cfg
        };
        assert!(wants_remote_prefill(100, 2000, 2, &off));
    }

    #[test]
    fn decode_choice_follows_the_cached_prefix_within_the_bound() {
        let cfg = RoutingConfig::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let loads = [load(10, 1), load(20, 1), load(10, 1)];
        for _ in 0..20 {
            assert_eq!(
                pick_decode_cached(&loads, &[0, 1024, 0], &cfg, &mut rng),
                Some(1)
            );
        }
        let loads = [load(0, 0), load(90, 9)];
        for _ in 0..20 {
            assert_eq!(
                pick_decode_cached(&loads, &[0, 1024], &cfg, &mut rng),
                Some(0),
                "too loaded for its prefix"
            );
        }
        assert_eq!(pick_decode_cached(&[], &[], &cfg, &mut rng), None);
    }

    #[test]
    fn a_short_shared_prefix_does_not_pull_every_request_to_one_worker() {
        // Two idle workers, one caching a chat template's system prompt: requests spread by load
        // (the power of two choices picks each about half the time) instead of all following it.
        let cfg = RoutingConfig::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let loads = [load(0, 0), load(0, 0)];
        let short = cfg.decode_affinity_min_tokens - 1;
        let to_cached = (0..200)
            .filter(|_| pick_decode_cached(&loads, &[short, 0], &cfg, &mut rng) == Some(0))
            .count();
        assert!((50..150).contains(&to_cached), "{to_cached} of 200");
        let any = RoutingConfig {
            decode_affinity_min_tokens: 0,
            ..cfg
        };
        for _ in 0..20 {
            assert_eq!(
                pick_decode_cached(&loads, &[short, 0], &any, &mut rng),
                Some(0)
            );
        }
    }

    #[test]
    fn in_flight_counts_when_fresher_than_the_poll() {
        let busy = DecodeLoad {
            in_flight: 8,
            ..load(0, 0)
        };
        assert!(busy.score() > load(0, 1).score());
    }

    #[test]
    fn prefill_prefers_cached_prefix_within_the_load_bound() {
        let c = |m, l| PrefillCandidate {
            matched_score: m,
            in_flight: l,
        };
        assert_eq!(pick_prefill(&[c(0, 0), c(5, 1)], 2), Some(1));
        assert_eq!(
            pick_prefill(&[c(0, 0), c(5, 3)], 2),
            Some(0),
            "hot worker over the bound is skipped"
        );
        assert_eq!(
            pick_prefill(&[c(2, 1), c(2, 0)], 2),
            Some(1),
            "tie on prefix goes to lower load"
        );
        assert_eq!(pick_prefill(&[], 2), None);
    }

    #[test]
    fn prefill_weighs_where_the_prefix_is_held() {
        use crate::prefix::{block_hashes, KvLevel, PrefixTracker};
        let levels = [(KvLevel::Device, 8), (KvLevel::Disk, 1000)];
        let tracker = |prompts: &[&[u32]]| {
            let mut t = PrefixTracker::new(1);
            t.set_levels(&levels);
            for p in prompts {
                t.insert(&block_hashes(p, 1));
            }
            t
        };
        let filler: Vec<u32> = (100..120).collect();
        let prompt: Vec<u32> = (0..8).collect();
        let hashes = block_hashes(&prompt, 1);
        let cand = |t: &PrefixTracker| PrefillCandidate {
            matched_score: t.matched_score(&hashes),
            in_flight: 0,
        };
        let on_disk = tracker(&[&prompt, &filler]);
        let on_device = tracker(&[&prompt]);
        assert_eq!(
            pick_prefill(&[cand(&on_disk), cand(&on_device)], 2),
            Some(1),
            "same blocks: the device wins"
        );
        // Eight blocks on disk (3.2 device blocks' worth) against three, then four, on the device.
        let three = tracker(&[&prompt[..3]]);
        let four = tracker(&[&prompt[..4]]);
        assert_eq!(pick_prefill(&[cand(&three), cand(&on_disk)], 2), Some(1));
        assert_eq!(pick_prefill(&[cand(&four), cand(&on_disk)], 2), Some(0));
    }

    proptest! {
        #[test]
        fn pick_prefill_respects_the_bound(
            cands in proptest::collection::vec((0u64..10_000, 0usize..10), 1..8),
            bound in 0usize..4,
        ) {
            let cands: Vec<_> = cands.into_iter().map(|(m, l)| PrefillCandidate { matched_score: m, in_flight: l }).collect();
            let i = pick_prefill(&cands, bound).unwrap();
            let min = cands.iter().map(|c| c.in_flight).min().unwrap();
            prop_assert!(cands[i].in_flight <= min + bound);
            for c in &cands {
                if c.in_flight <= min + bound {
                    prop_assert!(c.matched_score <= cands[i].matched_score);
                }
            }
        }

        #[test]
        fn pick_decode_never_returns_the_worse_of_two(used in proptest::collection::vec(0usize..100, 2..3), seed in 0u64..1000) {
            let loads: Vec<_> = used.iter().map(|&u| load(u, 0)).collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let i = pick_decode(&loads, &mut rng).unwrap();
            prop_assert!(loads[i].score() <= loads[1 - i].score());
        }
    }
}
