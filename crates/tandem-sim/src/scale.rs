//! The planner live: how many prefill and decode workers a running deployment should have now.
//!
//! The capacity of one worker per role comes from the planner's own model ([`crate::plan::calibrate`]:
//! short simulations of one prefill and one decode worker within the SLOs, on a hardware profile),
//! turned from requests/s into tokens/s with the calibration workload's lengths, so that it applies to
//! whatever mix of prompt and output lengths the live traffic has. Each window the caller hands in what
//! the head measured ([`Signals`]); the [`Scaler`] turns demand into a replica count per role and acts on
//! it with hysteresis: up only after `up_windows` consecutive windows that need more, down only after
//! `down_windows` consecutive windows that fit in one replica fewer at a lower utilization, never within
//! `cooldown_secs` of the role's last change, always within `[min, max]`.
//!
//! Live pressure corrects the model where it is wrong about this machine: a role whose latency objective
//! is missed while requests queue for it gets one replica more than it has, whatever the model says.
//! Everything here is pure (time is passed in), so the decisions are unit-tested without a deployment.

use serde::{Deserialize, Serialize};

use crate::error::SimError;
use crate::plan::{calibrate, Capacity, PlanSlo};
use crate::profile::Profile;
use crate::sim::SimRequest;

/// The two roles the scaler sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRole {
    /// Prefill workers (prompt compute, TTFT).
    Prefill,
    /// Decode workers (token generation, ITL).
    Decode,
}

impl ScaleRole {
    /// Both roles, prefill first.
    pub const ALL: [ScaleRole; 2] = [ScaleRole::Prefill, ScaleRole::Decode];

    /// Its name in settings, metrics labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            ScaleRole::Prefill => "prefill",
            ScaleRole::Decode => "decode",
        }
    }
}

impl std::fmt::Display for ScaleRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Replica bounds of one role.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleBounds {
    /// Fewest replicas (at least 1: the head needs a worker of each role to route).
    pub min: usize,
    /// Most replicas.
    pub max: usize,
}

/// How eagerly the scaler acts: the hysteresis and the utilization targets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Prefill replica bounds.
    pub prefill: RoleBounds,
    /// Decode replica bounds.
    pub decode: RoleBounds,
    /// Fraction of a replica's modelled capacity it should run at: demand above
    /// `replicas · capacity · target_utilization` asks for more.
    #[serde(default = "default_target")]
    pub target_utilization: f64,
    /// A role shrinks only when its demand fits one replica fewer at this lower fraction: the gap to
    /// `target_utilization` keeps a load near a boundary from adding and removing a replica in turn.
    #[serde(default = "default_down")]
    pub scale_down_utilization: f64,
    /// Consecutive windows that need more before a role grows.
    #[serde(default = "default_up_windows")]
    pub up_windows: u32,
    /// Consecutive windows that fit in fewer before a role shrinks (longer than `up_windows`: adding
    /// late costs latency, removing early costs a drain and a restart).
    #[serde(default = "default_down_windows")]
    pub down_windows: u32,
    /// Seconds after a role's change during which it does not change again (new replicas load the
    /// model and join the head; drained ones finish their requests).
    #[serde(default = "default_cooldown")]
    pub cooldown_secs: f64,
    /// Decode KV use (0–1) at or above which decode is under pressure.
    #[serde(default = "default_kv_high")]
    pub kv_high: f64,
}

fn default_target() -> f64 {
    0.8
}
fn default_down() -> f64 {
    0.5
}
fn default_up_windows() -> u32 {
    2
}
fn default_down_windows() -> u32 {
    6
}
fn default_cooldown() -> f64 {
    30.0
}
fn default_kv_high() -> f64 {
    0.9
}

impl Policy {
    /// A policy with these bounds and the default hysteresis.
    pub fn new(prefill: RoleBounds, decode: RoleBounds) -> Policy {
        Policy {
            prefill,
            decode,
            target_utilization: default_target(),
            scale_down_utilization: default_down(),
            up_windows: default_up_windows(),
            down_windows: default_down_windows(),
            cooldown_secs: default_cooldown(),
            kv_high: default_kv_high(),
        }
    }

    /// The bounds of `role`.
    pub fn bounds(&self, role: ScaleRole) -> RoleBounds {
        match role {
            ScaleRole::Prefill => self.prefill,
            ScaleRole::Decode => self.decode,
        }
    }

    /// Refuses settings that cannot work, naming the field (`decode.min`, `target_utilization`...).
    pub fn check(&self) -> Result<(), SimError> {
        let bad = |field: &str, message: String| {
            Err(SimError::Setting {
                field: field.to_string(),
                message,
            })
        };
        for role in ScaleRole::ALL {
            let b = self.bounds(role);
            if b.min == 0 {
                return bad(
                    &format!("{role}.min"),
                    "must be at least 1: the head routes every request through a worker of each role"
                        .into(),
                );
            }
            if b.min > b.max {
                return bad(
                    &format!("{role}.min"),
                    format!("{} is above {role}.max ({})", b.min, b.max),
                );
            }
        }
        let fraction = |v: f64| v.is_finite() && v > 0.0 && v <= 1.0;
        if !fraction(self.target_utilization) {
            return bad(
                "target_utilization",
                format!("must be in (0, 1], not {}", self.target_utilization),
            );
        }
        if !fraction(self.scale_down_utilization)
            || self.scale_down_utilization >= self.target_utilization
        {
            return bad(
                "scale_down_utilization",
                format!(
                    "must be above 0 and below target_utilization ({}), not {}",
                    self.target_utilization, self.scale_down_utilization
                ),
            );
        }
        if self.up_windows == 0 {
            return bad("up_windows", "must be at least 1".into());
        }
        if self.down_windows < self.up_windows {
            return bad(
                "down_windows",
                format!(
                    "must be at least up_windows ({}), not {}: scaling down faster than up flaps",
                    self.up_windows, self.down_windows
                ),
            );
        }
        if !(self.cooldown_secs.is_finite() && self.cooldown_secs >= 0.0) {
            return bad(
                "cooldown_secs",
                format!("must be a non-negative number, not {}", self.cooldown_secs),
            );
        }
        if !fraction(self.kv_high) {
            return bad(
                "kv_high",
                format!("must be in (0, 1], not {}", self.kv_high),
            );
        }
        Ok(())
    }
}

/// Tokens/s one replica of each role sustains within the SLOs, by the planner's model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoleCapacity {
    /// Prompt tokens/s one prefill worker takes within the TTFT objective.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens/s one decode worker gives within the ITL objective.
    pub decode_tokens_per_s: f64,
}

impl RoleCapacity {
    /// The planner's capacities (requests/s of its calibration workload) in tokens/s of that workload.
    pub fn from_plan(
        capacity: &Capacity,
        mean_prompt_tokens: f64,
        mean_output_tokens: f64,
    ) -> Self {
        RoleCapacity {
            prefill_tokens_per_s: capacity.prefill * mean_prompt_tokens,
            decode_tokens_per_s: capacity.decode * mean_output_tokens,
        }
    }

    /// Calibrates with the planner ([`calibrate`]) on `n` requests of `prompt_tokens` in and
    /// `output_tokens` out; refuses a profile under which a role meets the SLOs at no load at all.
    pub fn calibrate(
        profile: &Profile,
        slo: &PlanSlo,
        prompt_tokens: usize,
        output_tokens: usize,
        n: usize,
    ) -> Result<(RoleCapacity, Capacity), SimError> {
        if prompt_tokens == 0 || output_tokens == 0 || n == 0 {
            return Err(SimError::Config(
                "the calibration workload needs positive prompt_tokens, output_tokens and requests"
                    .into(),
            ));
        }
        // Distinct prompts (no shared prefix): the capacity without prefix-cache help.
        let requests: Vec<SimRequest> = (0..n)
            .map(|i| SimRequest {
                prompt: (0..prompt_tokens as u32)
                    .map(|t| (i as u32).wrapping_mul(100_003).wrapping_add(t))
                    .collect(),
                max_tokens: output_tokens,
                class: tandem_bench::workload::RequestClass::Main,
                at_s: 0.0,
            })
            .collect();
        let cap = calibrate(profile, &requests, slo)?;
        for (role, v) in [("prefill", cap.prefill), ("decode", cap.decode)] {
            if v <= 0.0 {
                return Err(SimError::Config(format!(
                    "by the profile no {role} worker meets the SLOs (TTFT p90 {} ms, ITL p90 {} ms) even at the lowest load: the closest is TTFT p90 {:.1} ms, ITL p90 {:.1} ms",
                    slo.ttft_p90_ms, slo.itl_p90_ms, cap.floor_ttft_p90_ms, cap.floor_itl_p90_ms
                )));
            }
        }
        Ok((
            RoleCapacity::from_plan(&cap, prompt_tokens as f64, output_tokens as f64),
            cap,
        ))
    }

    fn of(&self, role: ScaleRole) -> f64 {
        match role {
            ScaleRole::Prefill => self.prefill_tokens_per_s,
            ScaleRole::Decode => self.decode_tokens_per_s,
        }
    }
}

/// What the head measured for one role over the last window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoleSignals {
    /// Tokens/s the role worked through: prompt tokens for prefill, generated tokens for decode.
    pub tokens_per_s: f64,
    /// Requests waiting for the role (its workers' queues; for decode also those the head holds for
    /// KV room).
    pub queue_depth: usize,
    /// 90th percentile of the time a request spent with the role before its result, ms (`None`
    /// without requests in the window).
    pub wait_p90_ms: Option<f64>,
}

/// What the head measured over the last window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Signals {
    /// Prefill's signals.
    pub prefill: RoleSignals,
    /// Decode's signals.
    pub decode: RoleSignals,
    /// TTFT p90 of the window, ms.
    pub ttft_p90_ms: Option<f64>,
    /// ITL p90 of the window, ms.
    pub itl_p90_ms: Option<f64>,
    /// KV blocks used over blocks held, across decode workers (0–1).
    pub decode_kv_use: f64,
}

impl Signals {
    fn role(&self, role: ScaleRole) -> &RoleSignals {
        match role {
            ScaleRole::Prefill => &self.prefill,
            ScaleRole::Decode => &self.decode,
        }
    }

    /// Whether `role` misses its objective while requests wait for it (TTFT is charged to the role
    /// with the longer wait; ITL and a nearly full KV cache to decode).
    pub fn pressure(&self, role: ScaleRole, slo: &PlanSlo, kv_high: f64) -> bool {
        let over = |v: Option<f64>, bound: f64| v.is_some_and(|v| v > bound);
        let ttft_over = over(self.ttft_p90_ms, slo.ttft_p90_ms);
        let p = self.prefill.wait_p90_ms.unwrap_or(0.0);
        let d = self.decode.wait_p90_ms.unwrap_or(0.0);
        let queued = self.role(role).queue_depth > 0;
        match role {
            ScaleRole::Prefill => queued && ttft_over && p >= d,
            ScaleRole::Decode => {
                queued
                    && ((ttft_over && d > p)
                        || over(self.itl_p90_ms, slo.itl_p90_ms)
                        || self.decode_kv_use >= kv_high)
            }
        }
    }
}

/// One change the scaler asks for.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// The role.
    pub role: ScaleRole,
    /// Replicas now.
    pub from: usize,
    /// Replicas wanted.
    pub to: usize,
    /// Why, in words (the demand, the model's count, the pressure).
    pub reason: String,
}

/// What the model alone says a role needs, before hysteresis.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Need {
    /// Replicas the demand needs at the target utilization (within the bounds), one more than now
    /// under pressure.
    pub replicas: usize,
    /// Whether the demand fits in one replica fewer at the scale-down utilization (and no pressure).
    pub can_shrink: bool,
    /// Whether the role is under pressure.
    pub pressure: bool,
}

/// Per-role hysteresis state.
#[derive(Clone, Copy, Debug, Default)]
struct RoleState {
    up: u32,
    down: u32,
    last_change_s: Option<f64>,
}

/// The scaling loop's memory: counts windows and cooldowns, and decides.
#[derive(Clone, Debug)]
pub struct Scaler {
    policy: Policy,
    capacity: RoleCapacity,
    slo: PlanSlo,
    state: [RoleState; 2],
}

impl Scaler {
    /// A scaler for a checked policy, the modelled capacities and the SLOs.
    pub fn new(policy: Policy, capacity: RoleCapacity, slo: PlanSlo) -> Result<Self, SimError> {
        policy.check()?;
        slo.check()?;
        for role in ScaleRole::ALL {
            let c = capacity.of(role);
            if !(c.is_finite() && c > 0.0) {
                return Err(SimError::Config(format!(
                    "the {role} capacity must be a positive number of tokens/s, not {c}"
                )));
            }
        }
        Ok(Scaler {
            policy,
            capacity,
            slo,
            state: [RoleState::default(); 2],
        })
    }

    /// The policy it runs.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// What the model and the pressure say `role` needs with `replicas` now.
    pub fn need(&self, role: ScaleRole, replicas: usize, signals: &Signals) -> Need {
        let b = self.policy.bounds(role);
        let demand = signals.role(role).tokens_per_s.max(0.0);
        let cap = self.capacity.of(role);
        let modelled = (demand / (cap * self.policy.target_utilization)).ceil() as usize;
        let pressure = signals.pressure(role, &self.slo, self.policy.kv_high);
        let wanted = if pressure {
            modelled.max(replicas + 1)
        } else {
            modelled
        };
        let fewer = replicas.saturating_sub(1);
        let can_shrink = !pressure
            && replicas > b.min
            && demand <= fewer as f64 * cap * self.policy.scale_down_utilization;
        Need {
            replicas: wanted.clamp(b.min, b.max),
            can_shrink,
            pressure,
        }
    }

    /// Takes one window's signals at `now_s` (seconds on any monotonic clock) with the replicas each
    /// role has now (`[prefill, decode]`), and returns the changes to make (at most one per role).
    pub fn observe(
        &mut self,
        now_s: f64,
        replicas: [usize; 2],
        signals: &Signals,
    ) -> Vec<Decision> {
        let mut out = Vec::new();
        for (i, role) in ScaleRole::ALL.into_iter().enumerate() {
            let have = replicas[i];
            let b = self.policy.bounds(role);
            let need = self.need(role, have, signals);
            let demand = signals.role(role).tokens_per_s;
            let cap = self.capacity.of(role);
            let cooled = self.state[i]
                .last_change_s
                .is_none_or(|t| now_s - t >= self.policy.cooldown_secs);
            let st = &mut self.state[i];
            // Out of bounds (settings changed, a replica died): back within them at once.
            let to = if have < b.min || have > b.max {
                st.up = 0;
                st.down = 0;
                Some((
                    have.clamp(b.min, b.max),
                    format!("{have} replicas are outside [{}, {}]", b.min, b.max),
                ))
            } else if need.replicas > have {
                st.down = 0;
                st.up += 1;
                (st.up >= self.policy.up_windows && cooled).then(|| {
                    (
                        need.replicas,
                        if need.pressure {
                            format!(
                                "{role} misses its objective with requests queued ({} waiting; TTFT p90 {}, ITL p90 {}) for {} windows",
                                signals.role(role).queue_depth,
                                ms(signals.ttft_p90_ms),
                                ms(signals.itl_p90_ms),
                                st.up
                            )
                        } else {
                            format!(
                                "{demand:.1} tokens/s needs {} replicas of {cap:.1} tokens/s at {:.0}% for {} windows",
                                need.replicas,
                                self.policy.target_utilization * 100.0,
                                st.up
                            )
                        },
                    )
                })
            } else if need.can_shrink {
                st.up = 0;
                st.down += 1;
                (st.down >= self.policy.down_windows && cooled).then(|| {
                    (
                        have - 1,
                        format!(
                            "{demand:.1} tokens/s fits {} replicas of {cap:.1} tokens/s at {:.0}% for {} windows",
                            have - 1,
                            self.policy.scale_down_utilization * 100.0,
                            st.down
                        ),
                    )
                })
            } else {
                st.up = 0;
                st.down = 0;
                None
            };
            if let Some((to, reason)) = to.filter(|(to, _)| *to != have) {
                st.up = 0;
                st.down = 0;
                st.last_change_s = Some(now_s);
                out.push(Decision {
                    role,
                    from: have,
                    to,
                    reason,
                });
            }
        }
        out
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0} ms"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slo() -> PlanSlo {
        PlanSlo {
            ttft_p90_ms: 1000.0,
            itl_p90_ms: 100.0,
        }
    }

    fn scaler(policy: Policy) -> Scaler {
        let cap = RoleCapacity {
            prefill_tokens_per_s: 1000.0,
            decode_tokens_per_s: 100.0,
        };
        Scaler::new(policy, cap, slo()).unwrap()
    }

    fn policy() -> Policy {
        Policy {
            cooldown_secs: 10.0,
            up_windows: 2,
            down_windows: 4,
            ..Policy::new(RoleBounds { min: 1, max: 4 }, RoleBounds { min: 1, max: 4 })
        }
    }

    fn decode_load(tokens_per_s: f64) -> Signals {
        Signals {
            decode: RoleSignals {
                tokens_per_s,
                ..RoleSignals::default()
            },
            ..Signals::default()
        }
    }

    #[test]
    fn the_model_sizes_each_role_from_its_demand() {
        let s = scaler(policy());
        // 250 tokens/s of decode at 100 per replica and 80%: ceil(250 / 80) = 4.
        assert_eq!(
            s.need(ScaleRole::Decode, 1, &decode_load(250.0)).replicas,
            4
        );
        // Capped at max.
        assert_eq!(
            s.need(ScaleRole::Decode, 1, &decode_load(900.0)).replicas,
            4
        );
        // Idle: the minimum.
        assert_eq!(s.need(ScaleRole::Decode, 3, &decode_load(0.0)).replicas, 1);
        let mut sig = decode_load(0.0);
        sig.prefill.tokens_per_s = 1500.0;
        assert_eq!(s.need(ScaleRole::Prefill, 1, &sig).replicas, 2);
    }

    #[test]
    fn scales_up_only_after_consecutive_windows_and_respects_cooldown() {
        let mut s = scaler(policy());
        let high = decode_load(150.0); // needs 2
        assert!(s.observe(0.0, [1, 1], &high).is_empty());
        // A quiet window in between resets the count.
        assert!(s.observe(1.0, [1, 1], &decode_load(10.0)).is_empty());
        assert!(s.observe(2.0, [1, 1], &high).is_empty());
        let d = s.observe(3.0, [1, 1], &high);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].role, d[0].from, d[0].to), (ScaleRole::Decode, 1, 2));
        assert!(d[0].reason.contains("tokens/s"), "{}", d[0].reason);
        // More load right after: the cooldown holds it.
        let higher = decode_load(290.0);
        assert!(s.observe(4.0, [1, 2], &higher).is_empty());
        assert!(s.observe(5.0, [1, 2], &higher).is_empty());
        let d = s.observe(13.0, [1, 2], &higher);
        assert_eq!(d[0].to, 4);
    }

    #[test]
    fn scales_down_one_at_a_time_after_the_longer_window() {
        let mut s = scaler(policy());
        let idle = decode_load(5.0);
        for t in 0..3 {
            assert!(s.observe(t as f64, [1, 3], &idle).is_empty(), "window {t}");
        }
        let d = s.observe(3.0, [1, 3], &idle);
        assert_eq!((d[0].from, d[0].to), (3, 2));
        // The next step waits for the cooldown (10 s after the change), though its windows are counted.
        for t in 4..13 {
            assert!(s.observe(t as f64, [1, 2], &idle).is_empty(), "window {t}");
        }
        assert_eq!(s.observe(13.0, [1, 2], &idle)[0].to, 1);
        // Never below min.
        for t in 17..60 {
            assert!(s.observe(t as f64, [1, 1], &idle).is_empty());
        }
    }

    #[test]
    fn a_steady_load_near_a_boundary_does_not_flap() {
        let mut s = scaler(policy());
        // 2 replicas hold 160 tokens/s at 80%; shrinking to 1 needs ≤ 50 (one replica at 50%). A load
        // wandering between 70 and 150 never leaves 2, however long it lasts.
        let mut replicas = 2;
        let mut changes = 0;
        for t in 0..500 {
            let load = 110.0 + 40.0 * ((t as f64) * 0.7).sin();
            for d in s.observe(t as f64, [1, replicas], &decode_load(load)) {
                replicas = d.to;
                changes += 1;
            }
        }
        assert_eq!((replicas, changes), (2, 0));
    }

    #[test]
    fn pressure_adds_a_replica_the_model_did_not_ask_for() {
        let mut s = scaler(policy());
        // Low token rate (the model says 1), but ITL over the objective with requests waiting.
        let sig = Signals {
            decode: RoleSignals {
                tokens_per_s: 20.0,
                queue_depth: 3,
                wait_p90_ms: Some(50.0),
            },
            itl_p90_ms: Some(250.0),
            ..Signals::default()
        };
        assert!(s.need(ScaleRole::Decode, 1, &sig).pressure);
        assert!(!s.need(ScaleRole::Prefill, 1, &sig).pressure);
        s.observe(0.0, [1, 1], &sig);
        let d = s.observe(1.0, [1, 1], &sig);
        assert_eq!((d[0].role, d[0].to), (ScaleRole::Decode, 2));
        assert!(
            d[0].reason.contains("misses its objective"),
            "{}",
            d[0].reason
        );
        // TTFT over with the longer wait at prefill: prefill's pressure, not decode's.
        let ttft = Signals {
            prefill: RoleSignals {
                tokens_per_s: 10.0,
                queue_depth: 2,
                wait_p90_ms: Some(900.0),
            },
            decode: RoleSignals {
                tokens_per_s: 10.0,
                queue_depth: 1,
                wait_p90_ms: Some(100.0),
            },
            ttft_p90_ms: Some(1500.0),
            ..Signals::default()
        };
        assert!(ttft.pressure(ScaleRole::Prefill, &slo(), 0.9));
        assert!(!ttft.pressure(ScaleRole::Decode, &slo(), 0.9));
        // Without a queue a slow window is not pressure.
        let mut unqueued = ttft;
        unqueued.prefill.queue_depth = 0;
        assert!(!unqueued.pressure(ScaleRole::Prefill, &slo(), 0.9));
    }

    #[test]
    fn out_of_bounds_counts_are_corrected_at_once() {
        let mut s = scaler(policy());
        let d = s.observe(0.0, [0, 6], &decode_load(0.0));
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].role, d[0].to), (ScaleRole::Prefill, 1));
        assert_eq!((d[1].role, d[1].to), (ScaleRole::Decode, 4));
    }

    #[test]
    fn bad_settings_name_the_field() {
        let err = |p: Policy| p.check().unwrap_err().to_string();
        let mut p = policy();
        p.decode = RoleBounds { min: 3, max: 2 };
        assert!(err(p).contains("decode.min"));
        let mut p = policy();
        p.prefill.min = 0;
        assert!(err(p).contains("prefill.min"));
        let mut p = policy();
        p.scale_down_utilization = 0.9;
        assert!(err(p).contains("scale_down_utilization"));
        let mut p = policy();
        p.target_utilization = 1.5;
        assert!(err(p).contains("target_utilization"));
        let mut p = policy();
        p.down_windows = 1;
        assert!(err(p).contains("down_windows"));
        let mut p = policy();
        p.cooldown_secs = f64::NAN;
        assert!(err(p).contains("cooldown_secs"));
        let zero = RoleCapacity {
            prefill_tokens_per_s: 0.0,
            decode_tokens_per_s: 1.0,
        };
        let e = Scaler::new(policy(), zero, slo()).unwrap_err().to_string();
        assert!(e.contains("prefill capacity"), "{e}");
    }

    #[test]
    fn capacity_comes_from_the_planners_calibration() {
        let p = crate::profile::tests::profile();
        let (cap, plan) = RoleCapacity::calibrate(&p, &slo(), 128, 16, 16).unwrap();
        // The planner's requests/s in tokens/s, which the planner itself keeps within what full
        // steps give (no cap here): 512 prompt tokens per 61.2 ms step, 64 sequences per 74 ms step,
        // where a decode worker makes 15 of a request's 16 tokens (the prefill worker samples the first).
        let prefill_bound = 512.0 / 0.0612;
        let decode_bound = 64.0 / 0.074 * 16.0 / 15.0;
        assert_eq!(cap.prefill_tokens_per_s, plan.prefill * 128.0);
        assert_eq!(cap.decode_tokens_per_s, plan.decode * 16.0);
        assert!(
            cap.prefill_tokens_per_s <= prefill_bound * 1.01,
            "{cap:?} {plan:?}"
        );
        assert!(cap.decode_tokens_per_s <= decode_bound * 1.01, "{cap:?}");
        assert!(cap.prefill_tokens_per_s > 0.0 && cap.decode_tokens_per_s > 0.0);
        let impossible = PlanSlo {
            ttft_p90_ms: 0.001,
            itl_p90_ms: 0.001,
        };
        let e = RoleCapacity::calibrate(&p, &impossible, 64, 8, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("meets the SLOs"), "{e}");
    }

    /// What the head would measure over a simulated run: tokens/s per role (prompt tokens for prefill,
    /// as the head counts them on decode workers; generated tokens for decode).
    fn measured(p: &Profile, topology: crate::sim::Topology, reqs: Vec<SimRequest>) -> Signals {
        let out =
            crate::sim::simulate(p, &crate::sim::SimConfig::new(topology), reqs, None).unwrap();
        assert!(out.records.iter().all(|r| r.success));
        let prompt: usize = out.records.iter().map(|r| r.prompt_len).sum();
        let generated: usize = out.records.iter().map(|r| r.output_len).sum();
        Signals {
            prefill: RoleSignals {
                tokens_per_s: prompt as f64 / out.duration_s,
                ..RoleSignals::default()
            },
            decode: RoleSignals {
                tokens_per_s: generated as f64 / out.duration_s,
                ..RoleSignals::default()
            },
            ..Signals::default()
        }
    }

    fn stream(n: usize, prompt: usize, output: usize, rate: f64) -> Vec<SimRequest> {
        (0..n)
            .map(|i| SimRequest {
                prompt: (0..prompt as u32)
                    .map(|t| (i as u32).wrapping_mul(100_003).wrapping_add(t))
                    .collect(),
                max_tokens: output,
                class: tandem_bench::workload::RequestClass::Main,
                at_s: i as f64 / rate,
            })
            .collect()
    }

    #[test]
    fn long_prompts_scale_prefill_and_not_decode_then_drain_it() {
        // The planner's capacities on the test profile, then a simulated 1P1D deployment under a
        // stream of long prompts with short answers: prefill is the role that runs out.
        let p = crate::profile::tests::profile();
        let (cap, _) = RoleCapacity::calibrate(&p, &slo(), 256, 16, 16).unwrap();
        let one_p_one_d = crate::sim::Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        };
        let prompt_rate = 1.5 * cap.prefill_tokens_per_s / 1024.0;
        let heavy = measured(&p, one_p_one_d, stream(60, 1024, 4, prompt_rate));
        let mut s = Scaler::new(policy(), cap, slo()).unwrap();
        let mut t = 0.0;
        let mut changes = Vec::new();
        for _ in 0..3 {
            t += 5.0;
            changes.extend(s.observe(t, [1, 1], &heavy));
        }
        assert_eq!(changes.len(), 1, "{changes:?} under {heavy:?} with {cap:?}");
        assert_eq!(
            (changes[0].role, changes[0].from, changes[0].to),
            (ScaleRole::Prefill, 1, 2),
            "{changes:?}"
        );
        // On 2P1D the same stream is served and decode still needs no second worker; a light load of
        // short prompts afterwards drains the second prefill worker after the down windows.
        let two_p = crate::sim::Topology::Disaggregated {
            prefill: 2,
            decode: 1,
        };
        let served = measured(&p, two_p, stream(60, 1024, 4, prompt_rate));
        assert!(served.prefill.tokens_per_s > heavy.prefill.tokens_per_s);
        assert!(s.need(ScaleRole::Decode, 1, &served).replicas == 1);
        let light = measured(&p, two_p, stream(20, 128, 4, 0.5));
        let mut down = Vec::new();
        for _ in 0..policy().down_windows + 2 {
            t += 5.0;
            down.extend(s.observe(t, [2, 1], &light));
        }
        assert_eq!(down.len(), 1, "{down:?}");
        assert_eq!(
            (down[0].role, down[0].from, down[0].to),
            (ScaleRole::Prefill, 2, 1)
        );
    }
}
