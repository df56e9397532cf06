//! `tandem sim`: what a deployment of tandem would do with a workload, without running it.
//!
//! A discrete-event simulation on a virtual clock ([`sim`]) of the head and its prefill, decode or
//! colocated workers, running tandem's own scheduling code — the engine's `Scheduler` and `BlockPool`,
//! the head's routing policies from `tandem-cluster` — with step and transfer times from a hardware
//! [`profile`] that `tandem profile` measures (or a datasheet fills in). Workloads are `tandem bench`'s
//! own ([`tandem_bench::WorkloadSpec`]) and the results are its [`RunResult`]s, so the same tables, JSON
//! and charts report a simulated run and a measured one.

pub mod error;
pub mod layout;
pub mod plan;
pub mod profile;
pub mod scale;
pub mod sim;

pub use error::SimError;
pub use profile::{Profile, ProfileSource};
pub use sim::{
    simulate, simulate_turns, FollowUp, SimConfig, SimOutcome, SimRequest, SimStats, Topology,
};

use tandem_bench::arrival::send_times;
use tandem_bench::metrics::summarize;
use tandem_bench::multiturn::{Conversation, MultiTurnSpec};
use tandem_bench::report::{RunConfig, RunResult};
use tandem_bench::workload::Prompt;
use tandem_bench::{PromptBuilder, PromptFormat, Slo, WorkloadSpec};

/// One simulated run: a workload at a rate (or concurrency) on a deployment.
#[derive(Clone, Debug)]
pub struct SimRun {
    /// The workload, as `tandem bench` defines it.
    pub workload: WorkloadSpec,
    /// Requests (for bursty: steady requests; bursts come on top).
    pub num_prompts: usize,
    /// Poisson rate in requests/s, infinite for all at once (bursty: the steady rate when finite).
    pub request_rate: f64,
    /// Requests in flight at most.
    pub max_concurrency: Option<usize>,
    /// Seed of prompts and arrivals, as `tandem bench --seed` (a sweep's first point).
    pub seed: u64,
    /// Goodput objectives.
    pub slo: Slo,
}

/// A simulated run and its counters.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// The run in `tandem bench`'s form (its endpoint is `sim <topology>`).
    pub run: RunResult,
    /// The simulator's counters.
    pub stats: SimStats,
}

/// Builds the run's requests exactly as `tandem bench` would (same seed, same prompts, same send
/// times) and simulates them.
pub fn run(
    profile: &Profile,
    cfg: &SimConfig,
    builder: &PromptBuilder,
    spec: &SimRun,
) -> Result<SimResult, SimError> {
    let mut workload = spec.workload.clone();
    if let WorkloadSpec::Bursty(b) = &mut workload {
        if spec.request_rate.is_finite() {
            b.steady_rate = spec.request_rate;
        }
    }
    let (requests, burst_times_s) = build_requests(
        builder,
        &workload,
        spec.num_prompts,
        spec.request_rate,
        spec.seed,
    )?;
    let outcome = simulate(profile, cfg, requests, spec.max_concurrency)?;
    let config = RunConfig {
        endpoint: format!("sim {}", cfg.topology.label()),
        base_url: format!("sim://{}", profile.hardware.name),
        model: profile.model.name.clone(),
        workload,
        num_prompts: spec.num_prompts,
        request_rate: spec.request_rate.is_finite().then_some(spec.request_rate),
        max_concurrency: spec.max_concurrency,
        warmup: 0,
        seed: spec.seed,
        prompt_format: PromptFormat::Tokens,
    };
    Ok(SimResult {
        run: RunResult {
            summary: summarize(&outcome.records, outcome.duration_s, &spec.slo),
            config,
            started_at: String::new(),
            load_avg_before: None,
            load_avg_after: None,
            burst_times_s,
            requests: outcome.records,
        },
        stats: outcome.stats,
    })
}

/// The requests `tandem bench` would send for `workload` (token ids, send times) and its burst times.
pub fn build_requests(
    builder: &PromptBuilder,
    workload: &WorkloadSpec,
    num_prompts: usize,
    request_rate: f64,
    seed: u64,
) -> Result<(Vec<SimRequest>, Vec<f64>), SimError> {
    let generated = workload
        .generate(builder, num_prompts, PromptFormat::Tokens, seed)
        .map_err(|e| SimError::Config(format!("building the workload: {e}")))?;
    let times = send_times(&generated.requests, request_rate, seed);
    let requests = generated
        .requests
        .iter()
        .zip(times)
        .map(|(r, at_s)| SimRequest {
            prompt: match &r.prompt {
                Prompt::Tokens(ids) => ids.clone(),
                Prompt::Text(_) => unreachable!("built with PromptFormat::Tokens"),
            },
            max_tokens: r.max_tokens,
            class: r.class,
            at_s,
        })
        .collect();
    Ok((requests, generated.burst_times_s))
}

/// Conversations as the simulator runs them ([`simulate_turns`]).
#[derive(Clone, Debug)]
pub struct MultiTurnRequests {
    /// One request per turn (later turns hold only their own tokens until sent).
    pub requests: Vec<SimRequest>,
    /// Which earlier turn each waits for.
    pub follow_ups: Vec<Option<FollowUp>>,
    /// Each request's (conversation, turn from 1).
    pub turns: Vec<(usize, usize)>,
}

/// The turns of `tandem bench --workload multi-turn`'s conversations as simulator requests: every
/// conversation starts at once with the shared document and its first user turn; each later turn
/// follows the one before after `think_s`, its prompt the whole history.
pub fn multi_turn_requests(
    shared: &[u32],
    conversations: &[Conversation],
    think_s: f64,
) -> MultiTurnRequests {
    let (mut reqs, mut follows, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (c, conv) in conversations.iter().enumerate() {
        for (t, (user, answer)) in conv.turns.iter().enumerate() {
            let prompt = if t == 0 {
                [shared, user.as_slice()].concat()
            } else {
                user.clone()
            };
            follows.push((t > 0).then(|| FollowUp {
                after: reqs.len() - 1,
                think_s,
            }));
            reqs.push(SimRequest {
                prompt,
                max_tokens: (*answer).max(1),
                class: tandem_bench::workload::RequestClass::Main,
                at_s: 0.0,
            });
            ids.push((c, t + 1));
        }
    }
    MultiTurnRequests {
        requests: reqs,
        follow_ups: follows,
        turns: ids,
    }
}

/// [`multi_turn_requests`] of a synthetic [`MultiTurnSpec`], drawn as `tandem bench` draws it.
pub fn multi_turn_spec_requests(
    spec: &MultiTurnSpec,
    builder: &PromptBuilder,
    seed: u64,
) -> MultiTurnRequests {
    let (shared, convs) = spec.generate(builder, seed);
    multi_turn_requests(&shared, &convs, spec.think_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_bench::multiturn::Conversation;

    fn conversations(n: usize, turns: usize, user: usize, answer: usize) -> Vec<Conversation> {
        (0..n)
            .map(|c| Conversation {
                turns: (0..turns)
                    .map(|t| {
                        let seed = (c * 100 + t) as u32 * 10_000 + 500_000;
                        ((seed..seed + user as u32).collect(), answer)
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn later_turns_wait_for_the_answer_and_reuse_the_cached_history() {
        let p = profile::tests::profile();
        let shared: Vec<u32> = (0..256).collect();
        let convs = conversations(4, 3, 32, 16);
        let MultiTurnRequests {
            requests: reqs,
            follow_ups: follows,
            turns: ids,
        } = multi_turn_requests(&shared, &convs, 0.5);
        assert_eq!(reqs.len(), 12);
        assert_eq!(ids[4], (1, 2));
        assert_eq!(
            follows[4],
            Some(FollowUp {
                after: 3,
                think_s: 0.5
            })
        );
        let run = |caching: bool| {
            let mut cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
            cfg.prefix_caching = caching;
            simulate_turns(&p, &cfg, reqs.clone(), follows.clone(), None).unwrap()
        };
        let cached = run(true);
        assert!(cached.records.iter().all(|r| r.success));
        // Turn k's prompt is the shared document, k user turns and k − 1 answers.
        let by_len = |out: &SimOutcome, turn: usize| -> Vec<RequestRecordView> {
            let len = 256 + 32 * turn + 16 * (turn - 1);
            out.records
                .iter()
                .filter(|r| r.prompt_len == len)
                .map(|r| RequestRecordView {
                    start_s: r.start_s,
                    end_s: r.start_s + r.e2e_s,
                    ttft_s: r.ttft_s,
                })
                .collect()
        };
        for turn in 1..=3 {
            assert_eq!(by_len(&cached, turn).len(), 4, "turn {turn}");
        }
        // Each later turn starts at least the think time after some earlier turn's end.
        let first_end = by_len(&cached, 1)
            .iter()
            .map(|r| r.end_s)
            .fold(f64::INFINITY, f64::min);
        for r in by_len(&cached, 2) {
            assert!(
                r.start_s >= first_end + 0.5 - 1e-9,
                "{} {first_end}",
                r.start_s
            );
        }
        // The history is in the prefix cache: later turns' first tokens come sooner than without it.
        let mean =
            |v: Vec<RequestRecordView>| v.iter().map(|r| r.ttft_s).sum::<f64>() / v.len() as f64;
        let cold = run(false);
        assert!(
            mean(by_len(&cached, 3)) < 0.7 * mean(by_len(&cold, 3)),
            "{} vs {}",
            mean(by_len(&cached, 3)),
            mean(by_len(&cold, 3))
        );

        let mut bad = follows.clone();
        bad[1] = Some(FollowUp {
            after: 5,
            think_s: 0.0,
        });
        let cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
        let e = simulate_turns(&p, &cfg, reqs.clone(), bad, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("request 1 follows request 5"), "{e}");
    }

    /// What the test reads of a record.
    struct RequestRecordView {
        start_s: f64,
        end_s: f64,
        ttft_s: f64,
    }
}
