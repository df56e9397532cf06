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

use serde::Serialize;

use crate::error::SimError;
use crate::profile::Profile;
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

/// One candidate deployment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// Its workers.
    pub topology: Topology,
    /// GPUs it occupies.
    pub gpus: usize,
    /// Requests/s it serves within the SLOs.
    pub goodput: f64,
    /// Goodput per GPU.
    pub goodput_per_gpu: f64,
}

/// The planner's answer for one fleet size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The calibrated capacities.
    pub capacity: Capacity,
    /// The best candidate.
    pub choice: Candidate,
    /// The best of the other kind (colocated vs disaggregated), or the next split.
    pub runner_up: Option<Candidate>,
    /// Why the choice beats the runner-up.
    pub why: String,
}

/// Short simulations of one unit at `rate`: whether it meets the SLOs, its TTFT p90 and ITL p90 (ms).
fn meets(
    profile: &Profile,
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
    let out = simulate(profile, &SimConfig::new(topology), reqs, None)?;
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

/// The highest rate (requests/s, to 2%) at which `topology` meets the SLOs, 0 if none does.
fn max_rate(
    profile: &Profile,
    topology: Topology,
    requests: &[SimRequest],
    slo: &PlanSlo,
    check_ttft: bool,
    check_itl: bool,
) -> Result<f64, SimError> {
    let test = |r: f64| {
        meets(profile, topology, requests, r, slo, check_ttft, check_itl).map(|(ok, ..)| ok)
    };
    let mut lo = 0.01;
    if !test(lo)? {
        return Ok(0.0);
    }
    let mut hi = lo * 2.0;
    while test(hi)? {
        lo = hi;
        hi *= 2.0;
        if hi > 1e6 {
            return Ok(lo);
        }
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

/// Calibrates the three unit capacities on `requests` (their prompts and lengths; send times are set
/// by the search).
pub fn calibrate(
    profile: &Profile,
    requests: &[SimRequest],
    slo: &PlanSlo,
) -> Result<Capacity, SimError> {
    slo.check()?;
    if requests.is_empty() {
        return Err(SimError::Config(
            "the planner needs a workload with requests".into(),
        ));
    }
    // "Ample" partners: enough that they never bind at the unit's own limit.
    const AMPLE: usize = 8;
    let floor = |topology| meets(profile, topology, requests, 0.01, slo, true, true);
    let (_, ct, ci) = floor(Topology::Colocated { replicas: 1 })?;
    let (_, dt, di) = floor(Topology::Disaggregated {
        prefill: AMPLE,
        decode: AMPLE,
    })?;
    Ok(Capacity {
        floor_ttft_p90_ms: ct.min(dt),
        floor_itl_p90_ms: ci.min(di),
        colocated: max_rate(
            profile,
            Topology::Colocated { replicas: 1 },
            requests,
            slo,
            true,
            true,
        )?,
        prefill: max_rate(
            profile,
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
            profile,
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

/// The best deployment of `gpus` GPUs for these capacities: colocated, or the best prefill:decode split.
pub fn plan(
    profile: &Profile,
    capacity: Capacity,
    slo: &PlanSlo,
    gpus: usize,
) -> Result<Plan, SimError> {
    let per = profile.hardware.devices_per_worker.max(1);
    let workers = gpus / per;
    if workers == 0 {
        return Err(SimError::Config(format!(
            "{gpus} GPUs hold no worker of {per} devices"
        )));
    }
    let candidate = |topology: Topology, goodput: f64| Candidate {
        topology,
        gpus: topology.workers() * per,
        goodput,
        goodput_per_gpu: goodput / (topology.workers() * per) as f64,
    };
    let colocated = candidate(
        Topology::Colocated { replicas: workers },
        workers as f64 * capacity.colocated,
    );
    // min(P·p, (W−P)·d) peaks where P·p = (W−P)·d; try the integers around it.
    let mut splits: Vec<Candidate> = Vec::new();
    if workers >= 2 {
        let ideal =
            workers as f64 * capacity.decode / (capacity.prefill + capacity.decode).max(1e-12);
        let mut tried = Vec::new();
        for p in [
            ideal.floor() as usize,
            ideal.ceil() as usize,
            1,
            workers - 1,
        ] {
            let p = p.clamp(1, workers - 1);
            if tried.contains(&p) {
                continue;
            }
            tried.push(p);
            let d = workers - p;
            let goodput = (p as f64 * capacity.prefill).min(d as f64 * capacity.decode);
            splits.push(candidate(
                Topology::Disaggregated {
                    prefill: p,
                    decode: d,
                },
                goodput,
            ));
        }
        splits.sort_by(|a, b| b.goodput.total_cmp(&a.goodput));
    }
    let best_split = splits.first().cloned();
    let (choice, runner_up) = match best_split {
        Some(s) if s.goodput > colocated.goodput => (s, Some(colocated)),
        Some(s) => (colocated, Some(s)),
        None => (colocated, None),
    };
    let why = if choice.goodput <= 0.0 {
        format!(
            "no configuration meets the SLOs (TTFT p90 {} ms, ITL p90 {} ms): even at the lowest load the closest any deployment comes is TTFT p90 {:.1} ms and ITL p90 {:.1} ms",
            slo.ttft_p90_ms, slo.itl_p90_ms, capacity.floor_ttft_p90_ms, capacity.floor_itl_p90_ms
        )
    } else {
        match &runner_up {
            Some(r) => format!(
                "{} serves {:.2} req/s within the SLOs ({:.4} per GPU) against {:.2} ({:.4} per GPU) for {}: one colocated worker sustains {:.3} req/s, one prefill worker {:.3} and one decode worker {:.3}",
                choice.topology.label(),
                choice.goodput,
                choice.goodput_per_gpu,
                r.goodput,
                r.goodput_per_gpu,
                r.topology.label(),
                capacity.colocated,
                capacity.prefill,
                capacity.decode
            ),
            None => format!("one worker: {} is the only deployment", choice.topology.label()),
        }
    };
    Ok(Plan {
        capacity,
        choice,
        runner_up,
        why,
    })
}

/// The deployment YAML (`tandem serve --config`) of a plan's choice.
pub fn deployment_yaml(model: &str, plan: &Plan) -> String {
    match plan.choice.topology {
        Topology::Colocated { replicas } => format!(
            "# tandem plan: {replicas} colocated replicas, each `tandem serve --config` of this file behind\n\
             # a load balancer; {:.2} req/s within the SLOs.\nmodel: {model}\ndeployment:\n  mode: colocated\n",
            plan.choice.goodput
        ),
        Topology::Disaggregated { prefill, decode } => format!(
            "# tandem plan: {prefill} prefill and {decode} decode workers; {:.2} req/s within the SLOs.\n\
             model: {model}\ndeployment:\n  mode: pd\n  prefill:\n    replicas: {prefill}\n  decode:\n    replicas: {decode}\n",
            plan.choice.goodput
        ),
    }
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
        let cap = calibrate(&p, &requests(32, 256, 32), &slo).unwrap();
        assert!(
            cap.colocated > 0.0 && cap.prefill > 0.0 && cap.decode > 0.0,
            "{cap:?}"
        );
        let small = plan(&p, cap, &slo, 8).unwrap();
        let big = plan(&p, cap, &slo, 10_000).unwrap();
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
        let cap = calibrate(&p, &requests(8, 64, 8), &impossible).unwrap();
        let none = plan(&p, cap, &impossible, 8).unwrap();
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
}
