//! `tandem plan`: the deployment that maximises goodput per GPU for a profile, a workload and SLOs.
//!
//! Full simulations per candidate would be too slow at 10,000 GPUs, so the planner calibrates a
//! capacity model with short simulations and then scales it analytically. Three calibrations, each a
//! search over the request rate for the highest rate one unit sustains within the SLOs (TTFT p90 and
//! ITL p90, every request finished):
//! - a colocated worker alone: `colocated` requests/s per worker;
//! - a prefill worker feeding ample decode workers: `prefill` requests/s per prefill worker (TTFT);
//! - a decode worker fed by ample prefill workers: `decode` requests/s per decode worker (ITL).
//!
//! A fleet of W workers then serves W·colocated colocated, or min(P·prefill, D·decode) with P + D = W
//! disaggregated, assuming the head spreads load evenly (its routing is calibrated in the small sims,
//! not re-simulated at scale).
//!
//! Where the profile has several tensor/pipeline layouts ([`crate::layout`]) each is calibrated, and the
//! fleet search picks a layout per role: one for colocated workers, or a pair (prefill, decode) whose
//! workers may occupy different numbers of GPUs.
//!
//! A short run cannot show a rate the unit does not sustain: at a high enough rate its requests all
//! arrive at once, and a burst of a few requests fits the objectives however fast it came. So every
//! search is bounded by the unit's saturated throughput (all requests of a long stream at once,
//! finished per second), and runs on a stream of at least two full batches of requests.

use serde::Serialize;

use crate::error::SimError;
use crate::layout::{variants, Parallelism};
use crate::profile::{Profile, ProfileSource};
use crate::sim::{simulate, SimConfig, SimRequest, Topology};

/// Latency objectives the plan must meet, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlanSlo {
    /// 90th percentile time to first token.
    pub ttft_p90_ms: f64,
    /// 90th percentile inter-token latency.
    pub itl_p90_ms: f64,
}

impl PlanSlo {
    /// Refuses objectives that are not positive finite numbers, naming the field.
    pub fn check(&self) -> Result<(), SimError> {
        for (field, v) in [
            ("ttft_p90_ms", self.ttft_p90_ms),
            ("itl_p90_ms", self.itl_p90_ms),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(SimError::Config(format!(
                    "SLO {field} must be a positive number of milliseconds, not {v}"
                )));
            }
        }
        Ok(())
    }
}

/// Sustainable requests/s of one unit of each kind, within the SLOs (0 when even the lowest rate fails).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Capacity {
    /// One colocated worker.
    pub colocated: f64,
    /// One prefill worker (TTFT bound).
    pub prefill: f64,
    /// One decode worker (ITL bound).
    pub decode: f64,
    /// TTFT p90 (ms) of the best unit at the lowest load: the floor no deployment goes below.
    pub floor_ttft_p90_ms: f64,
    /// ITL p90 (ms) of the best unit at the lowest load.
    pub floor_itl_p90_ms: f64,
}

/// The calibrated capacities of one worker layout.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LayoutCapacity {
    /// Its tensor × pipeline split.
    pub parallelism: Parallelism,
    /// GPUs (devices) one worker of it occupies.
    pub devices: usize,
    /// Whether its curves were measured or written/derived from datasheet figures.
    pub source: ProfileSource,
    /// Its unit capacities.
    pub capacity: Capacity,
}

/// One candidate deployment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// Its workers.
    pub topology: Topology,
    /// The layout of its prefill workers (none when colocated).
    pub prefill_parallelism: Option<Parallelism>,
    /// The layout of its decode (or colocated) workers.
    pub decode_parallelism: Parallelism,
    /// GPUs it occupies.
    pub gpus: usize,
    /// Requests/s it serves within the SLOs.
    pub goodput: f64,
    /// Goodput per GPU.
    pub goodput_per_gpu: f64,
}

impl Candidate {
    /// `3P5D P:TP2 D:TP1`, `colocated×8 TP1`.
    pub fn label(&self) -> String {
        match self.prefill_parallelism {
            Some(p) => format!(
                "{} P:{} D:{}",
                self.topology.label(),
                p.label(),
                self.decode_parallelism.label()
            ),
            None => format!(
                "{} {}",
                self.topology.label(),
                self.decode_parallelism.label()
            ),
        }
    }
}

/// The planner's answer for one fleet size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The calibrated capacities of every layout.
    pub capacities: Vec<LayoutCapacity>,
    /// The best candidate.
    pub choice: Candidate,
    /// The best of the other kind (colocated vs disaggregated).
    pub runner_up: Option<Candidate>,
    /// Why the choice beats the runner-up.
    pub why: String,
}

/// One calibrated unit: a profile's layout on a topology, KV moving over `transport`.
#[derive(Clone, Copy)]
struct Unit<'a> {
    profile: &'a Profile,
    transport: &'a str,
}

impl Unit<'_> {
    fn config(&self, topology: Topology) -> SimConfig {
        let mut cfg = SimConfig::new(topology);
        cfg.transport = self.transport.to_string();
        cfg
    }
}

/// Short simulations of one unit at `rate`: whether it meets the SLOs, its TTFT p90 and ITL p90 (ms).
fn meets(
    unit: Unit,
    topology: Topology,
    requests: &[SimRequest],
    rate: f64,
    slo: &PlanSlo,
    check_ttft: bool,
    check_itl: bool,
) -> Result<(bool, f64, f64), SimError> {
    // The workload's prompts at evenly spaced sends of `rate`: a steady stream, so the calibration
    // measures capacity rather than one Poisson draw's luck.
    let reqs: Vec<SimRequest> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| SimRequest {
            at_s: i as f64 / rate,
            ..r.clone()
        })
        .collect();
    let out = simulate(unit.profile, &unit.config(topology), reqs, None)?;
    let ok = out.records.iter().all(|r| r.success);
    let p90 = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        tandem_bench::metrics::percentile(&v, 90.0) * 1e3
    };
    let ttft = p90(out.records.iter().map(|r| r.ttft_s).collect());
    let itl = p90(out
        .records
        .iter()
        .flat_map(|r| r.itl_s.iter().copied())
        .collect());
    let within =
        ok && (!check_ttft || ttft <= slo.ttft_p90_ms) && (!check_itl || itl <= slo.itl_p90_ms);
    Ok((within, ttft, itl))
}

/// Requests/s `topology` gets through with all of `requests` sent at once: for a prefill unit
/// (`first_tokens`) the rate of first tokens, else of finished requests. No steady rate above it is
/// sustainable.
fn saturated(
    unit: Unit,
    topology: Topology,
    requests: &[SimRequest],
    first_tokens: bool,
) -> Result<f64, SimError> {
    let reqs: Vec<SimRequest> = requests
        .iter()
        .map(|r| SimRequest {
            at_s: 0.0,
            ..r.clone()
        })
        .collect();
    let out = simulate(unit.profile, &unit.config(topology), reqs, None)?;
    let done = out.records.iter().filter(|r| r.success).count();
    let span = if first_tokens {
        out.records
            .iter()
            .filter(|r| r.success)
            .map(|r| r.start_s + r.ttft_s)
            .fold(0.0, f64::max)
    } else {
        out.duration_s
    };
    Ok(if done == 0 {
        0.0
    } else if span > 0.0 {
        done as f64 / span
    } else {
        f64::INFINITY
    })
}

/// The highest rate (requests/s, to 2%) at which `topology` meets the SLOs, 0 if none does; never
/// above its saturated throughput.
fn max_rate(
    unit: Unit,
    topology: Topology,
    requests: &[SimRequest],
    slo: &PlanSlo,
    check_ttft: bool,
    check_itl: bool,
) -> Result<f64, SimError> {
    // A profile of zero-time steps would leave it unbounded; a billion requests/s stands for that.
    let ceiling = saturated(unit, topology, requests, check_ttft && !check_itl)?.min(1e9);
    if ceiling.is_nan() || ceiling <= 0.0 {
        return Ok(0.0);
    }
    let test =
        |r: f64| meets(unit, topology, requests, r, slo, check_ttft, check_itl).map(|(ok, ..)| ok);
    let mut lo = 0.01f64.min(ceiling / 2.0);
    if !test(lo)? {
        return Ok(0.0);
    }
    let mut hi = ceiling;
    if test(hi)? {
        return Ok(hi);
    }
    while hi / lo > 1.02 {
        let mid = (lo * hi).sqrt();
        if test(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The calibration stream: `requests` repeated until there are at least `min`, each repeat's token ids
/// shifted so that it shares no prefix with another repeat (the workload's own sharing stays within
/// each repeat).
fn stream(requests: &[SimRequest], min: usize) -> Vec<SimRequest> {
    let repeats = min.div_ceil(requests.len()).max(1);
    (0..repeats)
        .flat_map(|k| {
            requests.iter().map(move |r| SimRequest {
                prompt: r
                    .prompt
                    .iter()
                    .map(|&t| t.wrapping_add((k as u32).wrapping_mul(0x9E37_79B9)))
                    .collect(),
                ..r.clone()
            })
        })
        .collect()
}

/// Calibrates the three unit capacities of the profile's own layout on `requests` (their prompts and
/// lengths; send times are set by the search), KV moving over TCP.
pub fn calibrate(
    profile: &Profile,
    requests: &[SimRequest],
    slo: &PlanSlo,
) -> Result<Capacity, SimError> {
    calibrate_over(profile, requests, slo, "tcp")
}

/// [`calibrate`] with KV moving over `transport` (a rate the profile lists).
pub fn calibrate_over(
    profile: &Profile,
    requests: &[SimRequest],
    slo: &PlanSlo,
    transport: &str,
) -> Result<Capacity, SimError> {
    slo.check()?;
    profile.transfer(transport)?;
    let unit = Unit { profile, transport };
    if requests.is_empty() {
        return Err(SimError::Config(
            "the planner needs a workload with requests".into(),
        ));
    }
    let requests = &stream(requests, 2 * profile.max_num_seqs);
    // "Ample" partners: enough that they never bind at the unit's own limit.
    const AMPLE: usize = 8;
    let floor = |topology| meets(unit, topology, requests, 0.01, slo, true, true);
    let (_, ct, ci) = floor(Topology::Colocated { replicas: 1 })?;
    let (_, dt, di) = floor(Topology::Disaggregated {
        prefill: AMPLE,
        decode: AMPLE,
    })?;
    Ok(Capacity {
        floor_ttft_p90_ms: ct.min(dt),
        floor_itl_p90_ms: ci.min(di),
        colocated: max_rate(
            unit,
            Topology::Colocated { replicas: 1 },
            requests,
            slo,
            true,
            true,
        )?,
        prefill: max_rate(
            unit,
            Topology::Disaggregated {
                prefill: 1,
                decode: AMPLE,
            },
            requests,
            slo,
            true,
            false,
        )?,
        decode: max_rate(
            unit,
            Topology::Disaggregated {
                prefill: AMPLE,
                decode: 1,
            },
            requests,
            slo,
            false,
            true,
        )?,
    })
}

/// Calibrates every layout the profile describes (its own, `layouts`, and those `scaling` derives),
/// KV moving over `transport`.
pub fn calibrate_layouts(
    profile: &Profile,
    requests: &[SimRequest],
    slo: &PlanSlo,
    transport: &str,
) -> Result<Vec<LayoutCapacity>, SimError> {
    variants(profile)?
        .into_iter()
        .map(|(parallelism, p)| {
            Ok(LayoutCapacity {
                parallelism,
                devices: parallelism.devices(),
                source: p.source,
                capacity: calibrate_over(&p, requests, slo, transport)?,
            })
        })
        .collect()
}

/// Orders candidates: more goodput, then fewer GPUs.
fn better(a: &Candidate, b: &Candidate) -> bool {
    a.goodput > b.goodput || (a.goodput == b.goodput && a.gpus < b.gpus)
}

fn candidate(
    topology: Topology,
    prefill: Option<&LayoutCapacity>,
    decode: &LayoutCapacity,
    goodput: f64,
) -> Candidate {
    let gpus = match topology {
        Topology::Colocated { replicas } => replicas * decode.devices,
        Topology::Disaggregated {
            prefill: p,
            decode: d,
        } => p * prefill.map_or(1, |l| l.devices) + d * decode.devices,
    };
    Candidate {
        topology,
        prefill_parallelism: prefill.map(|l| l.parallelism),
        decode_parallelism: decode.parallelism,
        gpus,
        goodput,
        goodput_per_gpu: if gpus > 0 { goodput / gpus as f64 } else { 0.0 },
    }
}

/// The best split of `gpus` between prefill workers of `lp` and decode workers of `ld`.
fn best_split(lp: &LayoutCapacity, ld: &LayoutCapacity, gpus: usize) -> Option<Candidate> {
    let (gp, gd) = (lp.devices, ld.devices);
    if gpus < gp + gd {
        return None;
    }
    let (cp, cd) = (lp.capacity.prefill, ld.capacity.decode);
    // min(P·cp, D·cd) under P·gp + D·gd ≤ G peaks where P·cp = D·cd; try the integers around it,
    // from both sides, and the extremes.
    let ideal_p = gpus as f64 * cd / (cp * gd as f64 + cd * gp as f64).max(1e-12);
    let max_p = (gpus - gd) / gp;
    let mut ps = vec![ideal_p.floor() as usize, ideal_p.ceil() as usize, 1, max_p];
    let ideal_d = (gpus as f64 - ideal_p * gp as f64) / gd as f64;
    for d in [ideal_d.floor() as usize, ideal_d.ceil() as usize] {
        let d = d.max(1);
        if d * gd + gp <= gpus {
            ps.push((gpus - d * gd) / gp);
        }
    }
    let mut best: Option<Candidate> = None;
    for p in ps {
        let p = p.clamp(1, max_p);
        let d = (gpus - p * gp) / gd;
        if d == 0 {
            continue;
        }
        let c = candidate(
            Topology::Disaggregated {
                prefill: p,
                decode: d,
            },
            Some(lp),
            ld,
            (p as f64 * cp).min(d as f64 * cd),
        );
        if best.as_ref().is_none_or(|b| better(&c, b)) {
            best = Some(c);
        }
    }
    best
}

/// The best deployment of `gpus` GPUs for these calibrated layouts: colocated, or the best
/// prefill:decode split, each role at its best layout.
pub fn plan(capacities: &[LayoutCapacity], slo: &PlanSlo, gpus: usize) -> Result<Plan, SimError> {
    let smallest = capacities.iter().map(|l| l.devices).min().ok_or_else(|| {
        SimError::Config("the planner needs at least one calibrated layout".into())
    })?;
    if gpus < smallest {
        return Err(SimError::Config(format!(
            "{gpus} GPUs hold no worker: the smallest layout takes {smallest} devices"
        )));
    }
    let mut colocated: Option<Candidate> = None;
    for l in capacities.iter().filter(|l| l.devices <= gpus) {
        let replicas = gpus / l.devices;
        let c = candidate(
            Topology::Colocated { replicas },
            None,
            l,
            replicas as f64 * l.capacity.colocated,
        );
        if colocated.as_ref().is_none_or(|b| better(&c, b)) {
            colocated = Some(c);
        }
    }
    let mut split: Option<Candidate> = None;
    for lp in capacities {
        for ld in capacities {
            if let Some(c) = best_split(lp, ld, gpus) {
                if split.as_ref().is_none_or(|b| better(&c, b)) {
                    split = Some(c);
                }
            }
        }
    }
    let colocated = colocated.expect("a layout fits: checked above");
    let (choice, runner_up) = match split {
        Some(s) if better(&s, &colocated) => (s, Some(colocated)),
        Some(s) => (colocated, Some(s)),
        None => (colocated, None),
    };
    let of = |p: Parallelism| {
        capacities
            .iter()
            .find(|l| l.parallelism == p)
            .expect("candidates use calibrated layouts")
            .capacity
    };
    let why = if choice.goodput <= 0.0 {
        let floor_ttft = capacities
            .iter()
            .map(|l| l.capacity.floor_ttft_p90_ms)
            .fold(f64::INFINITY, f64::min);
        let floor_itl = capacities
            .iter()
            .map(|l| l.capacity.floor_itl_p90_ms)
            .fold(f64::INFINITY, f64::min);
        format!(
            "no configuration meets the SLOs (TTFT p90 {} ms, ITL p90 {} ms): even at the lowest load the closest any deployment comes is TTFT p90 {floor_ttft:.1} ms and ITL p90 {floor_itl:.1} ms",
            slo.ttft_p90_ms, slo.itl_p90_ms
        )
    } else {
        let units = match choice.prefill_parallelism {
            Some(p) => format!(
                "one {} prefill worker sustains {:.3} req/s and one {} decode worker {:.3}",
                p.label(),
                of(p).prefill,
                choice.decode_parallelism.label(),
                of(choice.decode_parallelism).decode
            ),
            None => format!(
                "one {} colocated worker sustains {:.3} req/s",
                choice.decode_parallelism.label(),
                of(choice.decode_parallelism).colocated
            ),
        };
        match &runner_up {
            Some(r) => format!(
                "{} serves {:.2} req/s within the SLOs ({:.4} per GPU) against {:.2} ({:.4} per GPU) for {}: {units}",
                choice.label(),
                choice.goodput,
                choice.goodput_per_gpu,
                r.goodput,
                r.goodput_per_gpu,
                r.label(),
            ),
            None => format!("{} is the only deployment that fits: {units}", choice.label()),
        }
    };
    Ok(Plan {
        capacities: capacities.to_vec(),
        choice,
        runner_up,
        why,
    })
}

/// `engine: {tensor_parallel_size: T, pipeline_parallel_size: P}` for a layout, in flow style.
fn engine_yaml(p: Parallelism) -> String {
    format!(
        "{{tensor_parallel_size: {}, pipeline_parallel_size: {}}}",
        p.tp, p.pp
    )
}

/// The deployment YAML (`tandem serve --config`) of a plan's choice, each role's layout in its
/// `engine:` section.
pub fn deployment_yaml(model: &str, plan: &Plan) -> String {
    let c = &plan.choice;
    match (c.topology, c.prefill_parallelism) {
        (Topology::Disaggregated { prefill, decode }, Some(pp)) => format!(
            "# tandem plan: {prefill} prefill ({}) and {decode} decode ({}) workers on {} GPUs; {:.2} req/s within the SLOs.\n\
             model: {model}\ndeployment:\n  mode: pd\n  prefill:\n    replicas: {prefill}\n    engine: {}\n  decode:\n    replicas: {decode}\n    engine: {}\n",
            pp.label(),
            c.decode_parallelism.label(),
            c.gpus,
            c.goodput,
            engine_yaml(pp),
            engine_yaml(c.decode_parallelism),
        ),
        (topology, _) => format!(
            "# tandem plan: {} colocated replicas ({}), each `tandem serve --config` of this file behind\n\
             # a load balancer, on {} GPUs; {:.2} req/s within the SLOs.\nmodel: {model}\nengine: {}\ndeployment:\n  mode: colocated\n",
            topology.workers(),
            c.decode_parallelism.label(),
            c.gpus,
            c.goodput,
            engine_yaml(c.decode_parallelism),
        ),
    }
}

/// Helm values (`deploy/helm/tandem`) for a plan: pool sizes, GPUs per pod and the parallelism flags.
/// The chart deploys prefill/decode pools only, so a colocated choice writes its best disaggregated
/// runner-up, saying so; `None` when the plan has no disaggregated candidate.
pub fn helm_values(plan: &Plan) -> Option<String> {
    let (c, note) = if plan.choice.prefill_parallelism.is_some() {
        (&plan.choice, String::new())
    } else {
        let r = plan.runner_up.as_ref()?;
        (
            r,
            format!(
                "# The plan's choice is {} ({:.2} req/s); the chart runs prefill/decode pools, so these are\n\
                 # the best disaggregated deployment instead.\n",
                plan.choice.label(),
                plan.choice.goodput
            ),
        )
    };
    let Topology::Disaggregated { prefill, decode } = c.topology else {
        return None;
    };
    let role = |name: &str, replicas: usize, p: Parallelism| {
        format!(
            "{name}:\n  replicas: {replicas}\n  gpus: {}\n  extraArgs: [--tensor-parallel-size, \"{}\", --pipeline-parallel-size, \"{}\"]\n",
            p.devices(),
            p.tp,
            p.pp
        )
    };
    Some(format!(
        "# tandem plan: {} on {} GPUs, {:.2} req/s within the SLOs.\n{note}{}{}",
        c.label(),
        c.gpus,
        c.goodput,
        role("prefill", prefill, c.prefill_parallelism?),
        role("decode", decode, c.decode_parallelism),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::profile;
    use tandem_bench::workload::RequestClass;

    fn requests(n: usize, input: usize, output: usize) -> Vec<SimRequest> {
        (0..n)
            .map(|i| SimRequest {
                prompt: (0..input as u32).map(|t| i as u32 * 100_000 + t).collect(),
                max_tokens: output,
                class: RequestClass::Main,
                at_s: 0.0,
            })
            .collect()
    }

    #[test]
    fn plans_scale_and_impossible_slos_are_said() {
        let p = profile();
        let slo = PlanSlo {
            ttft_p90_ms: 200.0,
            itl_p90_ms: 60.0,
        };
        let caps = calibrate_layouts(&p, &requests(32, 256, 32), &slo, "tcp").unwrap();
        assert_eq!(caps.len(), 1);
        let cap = caps[0].capacity;
        assert!(
            cap.colocated > 0.0 && cap.prefill > 0.0 && cap.decode > 0.0,
            "{cap:?}"
        );
        let small = plan(&caps, &slo, 8).unwrap();
        let big = plan(&caps, &slo, 10_000).unwrap();
        assert!(small.runner_up.is_some());
        assert!(small.choice.goodput >= small.runner_up.as_ref().unwrap().goodput);
        assert!(big.choice.gpus <= 10_000);
        // Per-GPU goodput holds at scale (within rounding of the split).
        assert!(
            (big.choice.goodput_per_gpu - small.choice.goodput_per_gpu).abs()
                < 0.2 * small.choice.goodput_per_gpu
        );
        let yaml = deployment_yaml("m.gguf", &big);
        assert!(yaml.contains("mode:"), "{yaml}");

        let impossible = PlanSlo {
            ttft_p90_ms: 0.001,
            itl_p90_ms: 0.001,
        };
        let caps = calibrate_layouts(&p, &requests(8, 64, 8), &impossible, "tcp").unwrap();
        let none = plan(&caps, &impossible, 8).unwrap();
        assert_eq!(none.choice.goodput, 0.0);
        assert!(none.why.contains("no configuration meets"), "{}", none.why);
        assert!(PlanSlo {
            ttft_p90_ms: -1.0,
            itl_p90_ms: 1.0
        }
        .check()
        .unwrap_err()
        .to_string()
        .contains("ttft_p90_ms"));
    }

    /// The full-step throughput of a curve: `x` tokens (or sequences) per step time at `x`.
    fn full(curve: &crate::profile::StepCurve, x: usize) -> f64 {
        x as f64 / curve.at(x as f64, 0.0)
    }

    #[test]
    fn a_short_run_does_not_make_capacity_unbounded() {
        // Four requests and a lax TTFT objective: the whole burst is prefilled within it however fast
        // it comes, which used to let the search climb to 1e6 req/s.
        let p = profile();
        let slo = PlanSlo {
            ttft_p90_ms: 5_000.0,
            itl_p90_ms: 1_000.0,
        };
        let cap = calibrate(&p, &requests(4, 256, 8), &slo).unwrap();
        // No prefill worker takes more prompts than its full steps compute: 512 tokens per 61.2 ms
        // is 32.7 prompts of 256 per second.
        let prefill_bound = full(&p.prefill, p.max_num_batched_tokens) / 256.0;
        assert!(
            cap.prefill > 0.5 * prefill_bound && cap.prefill <= prefill_bound * 1.01,
            "{cap:?} against {prefill_bound}"
        );
        // Decode: 64 sequences per 74 ms step, 7 tokens each (the prefill worker samples the first).
        let decode_bound = full(&p.decode, p.max_num_seqs) / 7.0;
        assert!(
            cap.decode > 0.3 * decode_bound && cap.decode <= decode_bound * 1.01,
            "{cap:?} against {decode_bound}"
        );
        assert!(cap.colocated <= prefill_bound * 1.01, "{cap:?}");
    }

    #[test]
    fn the_search_picks_a_layout_per_role() {
        use crate::layout::{LayoutProfile, Parallelism};
        use crate::profile::{ProfileSource, StepCurve};
        // A TP2 layout whose prefill is 2.5× faster per step (so better per GPU than TP1) and whose
        // decode is only 1.2× faster (worse per GPU): prefill should take TP2 and decode TP1.
        let mut p = profile();
        let scale = |c: &StepCurve, f: f64| StepCurve {
            points: c.points.iter().map(|&[x, t]| [x, t / f]).collect(),
            per_context_s: c.per_context_s / f,
        };
        p.layouts.push(LayoutProfile {
            tp: 2,
            pp: 1,
            source: ProfileSource::Datasheet,
            kv_blocks: 2000,
            decode: scale(&p.decode, 1.2),
            prefill: scale(&p.prefill, 2.5),
        });
        let slo = PlanSlo {
            ttft_p90_ms: 2_000.0,
            itl_p90_ms: 200.0,
        };
        let caps = calibrate_layouts(&p, &requests(32, 512, 16), &slo, "tcp").unwrap();
        assert_eq!(caps.len(), 2);
        assert_eq!(caps[1].devices, 2);
        let best = plan(&caps, &slo, 1000).unwrap();
        let split = if best.choice.prefill_parallelism.is_some() {
            &best.choice
        } else {
            best.runner_up.as_ref().unwrap()
        };
        assert_eq!(
            split.prefill_parallelism,
            Some(Parallelism { tp: 2, pp: 1 }),
            "{split:?}"
        );
        assert_eq!(split.decode_parallelism, Parallelism::ONE, "{split:?}");
        assert!(split.gpus <= 1000);
        let yaml = deployment_yaml("m.gguf", &best);
        assert!(yaml.contains("tensor_parallel_size"), "{yaml}");
        let helm = helm_values(&best).unwrap();
        assert!(
            helm.contains("prefill:\n  replicas:") && helm.contains("gpus: 2"),
            "{helm}"
        );
        assert!(helm.contains("--tensor-parallel-size, \"2\""), "{helm}");
        // A fleet smaller than the smallest worker is refused.
        let tp2_only = [caps[1]];
        let e = plan(&tp2_only, &slo, 1).unwrap_err().to_string();
        assert!(e.contains("takes 2 devices"), "{e}");
    }
}
