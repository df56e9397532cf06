//! Hardware profiles: what one worker of one model costs on one machine, measured by `tandem profile`
//! or written by hand from datasheet figures, and read by the simulator.
//!
//! A step's time is modelled the way the engine runs it: one forward pass over a flat batch. Pure
//! decode steps follow [`StepCurve`] `decode` (seconds by batch size, piecewise linear); steps with any
//! prefill follow `prefill` (seconds by batched tokens of prompts that start at position 0, piecewise
//! linear). Both add a cost per unit of context already in the cache: each new token attends to every
//! earlier position, so a chunk of n tokens at position p adds n·p. Both are fitted from a grid of
//! measured points ([`fit_curve`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::SimError;
use crate::layout::{LayoutProfile, Parallelism, ScalingModel};

/// Where a profile's figures come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileSource {
    /// Measured by `tandem profile` on the hardware it names.
    Measured,
    /// Written from datasheet figures for hardware that was not measured.
    Datasheet,
}

/// The machine a profile describes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// A readable name (CPU model, GPU name).
    pub name: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// Compute threads of one worker (CPU), 0 where it does not apply.
    #[serde(default)]
    pub threads: usize,
    /// GPUs (or CPU sockets) one worker occupies: the unit the planner counts.
    #[serde(default = "one")]
    pub devices_per_worker: usize,
}

fn one() -> usize {
    1
}

/// The model a profile was made with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileModel {
    /// Its served name (file stem).
    pub name: String,
    /// Its `ModelIdentity` hash; a datasheet profile may leave it out (then only the name is checked).
    #[serde(default)]
    pub identity: Option<String>,
}

/// Step time along one axis (batch size or batched tokens), piecewise linear between measured points
/// and extrapolated along the last segment, plus a linear attention term.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCurve {
    /// `[x, seconds]` at no context, ascending in x.
    pub points: Vec<[f64; 2]>,
    /// Seconds per new token per position cached before its chunk.
    pub per_context_s: f64,
}

impl StepCurve {
    /// Seconds of a step at `x` over `context` (Σ n·p) of cached context.
    pub fn at(&self, x: f64, context: f64) -> f64 {
        interpolate(&self.points, x) + self.per_context_s * context
    }

    pub(crate) fn check(&self, field: &str) -> Result<(), SimError> {
        let bad = |why: &str| SimError::Profile {
            field: field.to_string(),
            message: why.to_string(),
        };
        if self.points.is_empty() {
            return Err(bad("needs at least one [x, seconds] point"));
        }
        if self
            .points
            .iter()
            .any(|[x, t]| !(x.is_finite() && t.is_finite() && *x >= 0.0 && *t >= 0.0))
        {
            return Err(bad("points must be finite and non-negative"));
        }
        if self.points.windows(2).any(|w| w[1][0] <= w[0][0]) {
            return Err(bad("points must be strictly ascending in x"));
        }
        if !(self.per_context_s.is_finite() && self.per_context_s >= 0.0) {
            return Err(bad("per_context_s must be finite and non-negative"));
        }
        Ok(())
    }
}

/// Linear interpolation over ascending `[x, y]` points, extrapolating along the end segments (never below 0).
fn interpolate(points: &[[f64; 2]], x: f64) -> f64 {
    match points {
        [] => 0.0,
        [p] => p[1],
        _ => {
            let i = points
                .windows(2)
                .position(|w| x <= w[1][0])
                .unwrap_or(points.len() - 2);
            let (a, b) = (points[i], points[i + 1]);
            let slope = (b[1] - a[1]) / (b[0] - a[0]);
            (a[1] + slope * (x - a[0])).max(0.0)
        }
    }
}

/// How fast KV moves between workers over one transport.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferRate {
    /// `tcp`, `shm`, `nixl`, `efa`...
    pub transport: String,
    /// Sustained bytes per second of one pull.
    pub bytes_per_s: f64,
    /// Fixed seconds per pull (connection, handshake).
    pub latency_s: f64,
}

/// Fixed costs outside the forward pass: the server's host work, which the step curves do not time
/// and which is most of a step on a fast device (a small model's GPU step takes about 1 ms).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overheads {
    /// Seconds a request spends on the host on its way to its first token, besides the engine's steps
    /// (connection, HTTP, admission, tokenization, streaming the token back); `tandem profile` measures
    /// it as a live server's time to first token less the engine's own step time for that request.
    pub request_s: f64,
    /// Seconds of one control RPC hop between head and worker (P/D only).
    pub rpc_s: f64,
    /// Seconds the engine loop adds to every step outside the forward pass (scheduling, sampling,
    /// streaming, reaping), from the engine's own counters under load; absent (0) in profiles made
    /// before it was measured.
    #[serde(default)]
    pub step_s: f64,
    /// Seconds the engine loop adds to a step per sequence it runs (each one's sampling bookkeeping and
    /// streamed token), beside `step_s`: what makes a batch of 64 cost more host time than a batch of 1;
    /// absent (0) in older profiles.
    #[serde(default)]
    pub step_per_seq_s: f64,
}

/// Everything the simulator needs to know about one model on one kind of hardware.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Measured or datasheet.
    pub source: ProfileSource,
    /// When it was made (RFC 3339), for measured ones.
    #[serde(default)]
    pub created_at: Option<String>,
    /// The hardware.
    pub hardware: Hardware,
    /// The model.
    pub model: ProfileModel,
    /// Tokens per KV block of the engine measured.
    pub block_size: usize,
    /// KV blocks in one worker's pool.
    pub kv_blocks: usize,
    /// KV bytes one token occupies across all layers (what a transfer moves per token).
    pub kv_bytes_per_token: f64,
    /// Sequences one worker runs at once (`engine.max_num_seqs`).
    pub max_num_seqs: usize,
    /// Token budget per step (`engine.max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Steps that only decode, by batch size.
    pub decode: StepCurve,
    /// Steps with prefill tokens, by batched tokens.
    pub prefill: StepCurve,
    /// KV transfer rates by transport.
    pub transfer: Vec<TransferRate>,
    /// Fixed costs outside the forward pass.
    pub overheads: Overheads,
    /// Seconds from starting a worker to its first request (model load, KV allocation).
    pub startup_s: f64,
    /// The tensor × pipeline layout the curves above were measured with; absent, tensor parallel over
    /// `hardware.devices_per_worker` devices and one stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<Parallelism>,
    /// Step curves of other layouts of one worker, for the planner to search per role.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layouts: Vec<LayoutProfile>,
    /// A model that derives more layouts from the curves above and interconnect and memory figures
    /// (datasheet work, marked as such in every layout it derives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingModel>,
}

impl Profile {
    /// Reads a JSON or YAML profile (by extension; YAML is a superset, so anything else is read as YAML)
    /// and checks it; errors name the offending field.
    pub fn load(path: &Path) -> Result<Profile, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let parsed = if path.extension().is_some_and(|e| e == "json") {
            let de = &mut serde_json::Deserializer::from_str(&text);
            serde_path_to_error::deserialize(de).map_err(|e| (e.path().to_string(), e.to_string()))
        } else {
            let de = serde_yaml::Deserializer::from_str(&text);
            serde_path_to_error::deserialize(de).map_err(|e| (e.path().to_string(), e.to_string()))
        };
        let profile: Profile = parsed.map_err(|(field, message)| SimError::ProfileFile {
            path: path.to_path_buf(),
            field,
            message,
        })?;
        profile.check()?;
        Ok(profile)
    }

    /// Writes the profile as pretty JSON, or YAML when the file name ends in .yaml/.yml.
    pub fn save(&self, path: &Path) -> Result<(), SimError> {
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        let text = if yaml {
            serde_yaml::to_string(self).expect("profiles serialize")
        } else {
            serde_json::to_string_pretty(self).expect("profiles serialize")
        };
        std::fs::write(path, text).map_err(|source| SimError::Io {
            path: PathBuf::from(path),
            source,
        })
    }

    /// Checks the figures are usable: positive sizes, finite non-negative times, ascending curves.
    pub fn check(&self) -> Result<(), SimError> {
        let bad = |field: &str, message: &str| {
            Err(SimError::Profile {
                field: field.into(),
                message: message.into(),
            })
        };
        for (field, v) in [
            ("block_size", self.block_size),
            ("kv_blocks", self.kv_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            (
                "hardware.devices_per_worker",
                self.hardware.devices_per_worker,
            ),
        ] {
            if v == 0 {
                return bad(field, "must be positive");
            }
        }
        if !(self.kv_bytes_per_token.is_finite() && self.kv_bytes_per_token > 0.0) {
            return bad("kv_bytes_per_token", "must be a positive number of bytes");
        }
        self.decode.check("decode")?;
        self.prefill.check("prefill")?;
        for (i, t) in self.transfer.iter().enumerate() {
            if !(t.bytes_per_s.is_finite() && t.bytes_per_s > 0.0) {
                return bad(&format!("transfer[{i}].bytes_per_s"), "must be positive");
            }
            if !(t.latency_s.is_finite() && t.latency_s >= 0.0) {
                return bad(&format!("transfer[{i}].latency_s"), "must be non-negative");
            }
        }
        crate::layout::check(self)?;
        for (field, v) in [
            ("overheads.request_s", self.overheads.request_s),
            ("overheads.rpc_s", self.overheads.rpc_s),
            ("overheads.step_s", self.overheads.step_s),
            ("overheads.step_per_seq_s", self.overheads.step_per_seq_s),
            ("startup_s", self.startup_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, "must be a finite, non-negative number of seconds");
            }
        }
        Ok(())
    }

    /// Refuses a profile made with another model: by identity where both have one, else by name.
    pub fn check_model(&self, name: &str, identity: &str) -> Result<(), SimError> {
        let mismatch = match &self.model.identity {
            Some(id) => id != identity,
            None => self.model.name != name,
        };
        if mismatch {
            return Err(SimError::Profile {
                field: "model".into(),
                message: format!(
                    "the profile was made with {} ({}), not {name} ({identity})",
                    self.model.name,
                    self.model.identity.as_deref().unwrap_or("no identity")
                ),
            });
        }
        Ok(())
    }

    /// The transfer rate of `transport`.
    pub fn transfer(&self, transport: &str) -> Result<&TransferRate, SimError> {
        self.transfer
            .iter()
            .find(|t| t.transport == transport)
            .ok_or_else(|| SimError::Profile {
                field: "transfer".into(),
                message: format!(
                    "no rate for transport `{transport}` (the profile has: {})",
                    self.transfer
                        .iter()
                        .map(|t| t.transport.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    /// Seconds of one step's forward pass on the device, from the curves: `tokens` new tokens over
    /// `seqs` sequences, of which `prefill_tokens` are prompt tokens; `context` is Σ n·p over its
    /// chunks of n tokens at position p. The engine loop adds [`Profile::host_time`] to it.
    pub fn forward_time(
        &self,
        tokens: usize,
        seqs: usize,
        prefill_tokens: usize,
        context: f64,
    ) -> f64 {
        if prefill_tokens == 0 {
            self.decode.at(seqs as f64, context)
        } else {
            self.prefill.at(tokens as f64, context)
        }
    }

    /// Seconds of the engine loop's own work for a step of `seqs` sequences, outside the forward
    /// pass (`overheads.step_s`, and `overheads.step_per_seq_s` per sequence).
    pub fn host_time(&self, seqs: usize) -> f64 {
        self.overheads.step_s + self.overheads.step_per_seq_s * seqs as f64
    }

    /// The layout of the profile's own curves.
    pub fn parallelism(&self) -> Parallelism {
        self.parallelism.unwrap_or(Parallelism {
            tp: self.hardware.devices_per_worker,
            pp: 1,
        })
    }
}

/// One measured step: `x` (batch size or batched tokens), its attention work, its seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Batch size (decode) or batched tokens (prefill).
    pub x: f64,
    /// Cached context of the step (see [`Profile::forward_time`]).
    pub context: f64,
    /// Seconds it took.
    pub seconds: f64,
}

/// Fits a [`StepCurve`] to measured steps by least squares on `t = f(x) + c·context`, where `f` is
/// piecewise linear with one knot per distinct `x`: each x gets its own intercept and all share `c`.
/// With a single context per x, `c` cannot be separated and is 0.
pub fn fit_curve(samples: &[Measured]) -> StepCurve {
    let mut xs: Vec<f64> = samples.iter().map(|s| s.x).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let group_mean = |x: f64, f: &dyn Fn(&Measured) -> f64| {
        let g: Vec<f64> = samples.iter().filter(|s| s.x == x).map(f).collect();
        g.iter().sum::<f64>() / g.len() as f64
    };
    // Within-group least squares for the shared slope: sum over groups of centred products.
    let (mut num, mut den) = (0.0, 0.0);
    for &x in &xs {
        let (mc, mt) = (group_mean(x, &|s| s.context), group_mean(x, &|s| s.seconds));
        for s in samples.iter().filter(|s| s.x == x) {
            num += (s.context - mc) * (s.seconds - mt);
            den += (s.context - mc) * (s.context - mc);
        }
    }
    let per_context_s = if den > 0.0 { (num / den).max(0.0) } else { 0.0 };
    let points = xs
        .iter()
        .map(|&x| {
            let t = group_mean(x, &|s| s.seconds - per_context_s * s.context);
            [x, t.max(0.0)]
        })
        .collect();
    StepCurve {
        points,
        per_context_s,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small hand-written profile for tests: 10 ms decode steps growing 1 ms per sequence, prefill
    /// 0.1 ms per token over a 10 ms base.
    pub(crate) fn profile() -> Profile {
        Profile {
            source: ProfileSource::Datasheet,
            created_at: None,
            hardware: Hardware {
                name: "test".into(),
                device: "cpu".into(),
                threads: 1,
                devices_per_worker: 1,
            },
            model: ProfileModel {
                name: "m".into(),
                identity: Some("abc".into()),
            },
            block_size: 16,
            kv_blocks: 1000,
            kv_bytes_per_token: 1000.0,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            decode: StepCurve {
                points: vec![[1.0, 0.011], [64.0, 0.074]],
                per_context_s: 0.0,
            },
            prefill: StepCurve {
                points: vec![[1.0, 0.0101], [512.0, 0.0612]],
                per_context_s: 0.0,
            },
            transfer: vec![TransferRate {
                transport: "tcp".into(),
                bytes_per_s: 1e9,
                latency_s: 0.001,
            }],
            overheads: Overheads {
                request_s: 0.0,
                rpc_s: 0.0,
                step_s: 0.0,
                step_per_seq_s: 0.0,
            },
            startup_s: 1.0,
            parallelism: None,
            layouts: Vec::new(),
            scaling: None,
        }
    }

    #[test]
    fn curves_interpolate_and_extrapolate() {
        let c = StepCurve {
            points: vec![[1.0, 1.0], [3.0, 3.0], [5.0, 4.0]],
            per_context_s: 0.5,
        };
        assert_eq!(c.at(2.0, 0.0), 2.0);
        assert_eq!(c.at(4.0, 2.0), 4.5);
        assert_eq!(c.at(7.0, 0.0), 5.0, "last segment extended");
        assert_eq!(c.at(0.0, 0.0), 0.0, "first segment extended, floored at 0");
    }

    #[test]
    fn fit_recovers_the_context_slope_and_knots() {
        let truth = |x: f64, c: f64| 0.01 + 0.002 * x + 1e-6 * c;
        let mut samples = Vec::new();
        for x in [1.0, 4.0, 16.0] {
            for c in [0.0, 1000.0, 5000.0] {
                samples.push(Measured {
                    x,
                    context: c * x,
                    seconds: truth(x, c * x),
                });
            }
        }
        let fit = fit_curve(&samples);
        assert!((fit.per_context_s - 1e-6).abs() < 1e-12, "{fit:?}");
        assert_eq!(fit.points.len(), 3);
        assert!((fit.at(16.0, 0.0) - truth(16.0, 0.0)).abs() < 1e-9);
        assert!((fit.at(8.0, 100.0) - truth(8.0, 100.0)).abs() < 1e-9);
    }

    #[test]
    fn bad_profiles_name_the_field() {
        let mut p = profile();
        p.kv_blocks = 0;
        assert!(p.check().unwrap_err().to_string().contains("kv_blocks"));
        let mut p = profile();
        p.decode.points = vec![[4.0, 0.1], [2.0, 0.2]];
        assert!(p.check().unwrap_err().to_string().contains("decode"));
        let mut p = profile();
        p.transfer[0].bytes_per_s = 0.0;
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("transfer[0].bytes_per_s"), "{e}");
        let e = profile()
            .check_model("other", "def")
            .unwrap_err()
            .to_string();
        assert!(e.contains("model") && e.contains("other"), "{e}");
        profile().check_model("m", "abc").unwrap();
        assert!(profile()
            .transfer("shm")
            .unwrap_err()
            .to_string()
            .contains("tcp"));
    }

    #[test]
    fn files_round_trip_and_missing_fields_are_named() {
        let dir = std::env::temp_dir().join(format!("tandem-sim-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["p.json", "p.yaml"] {
            let path = dir.join(name);
            profile().save(&path).unwrap();
            assert_eq!(Profile::load(&path).unwrap(), profile());
        }
        let mut json = serde_json::to_value(profile()).unwrap();
        json.as_object_mut().unwrap().remove("kv_bytes_per_token");
        let path = dir.join("missing.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let e = Profile::load(&path).unwrap_err().to_string();
        assert!(e.contains("kv_bytes_per_token"), "{e}");
        json["kv_bytes_per_token"] = 1.0.into();
        json["decode"]["points"] = serde_json::json!("fast");
        std::fs::write(&path, json.to_string()).unwrap();
        let e = Profile::load(&path).unwrap_err().to_string();
        assert!(e.contains("decode.points"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A profile written before the host overheads were measured (no `overheads.step_s`) still loads,
    /// with no per-step overhead: the H100 profile of docs/bench, and the test profile with the field cut.
    #[test]
    fn profiles_without_the_step_overhead_load() {
        let old = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../docs/bench/h100-2026-12-07-kvfp8/sim/profile.json");
        let p = Profile::load(&old).unwrap();
        assert_eq!(p.overheads.step_s, 0.0);
        assert_eq!(p.overheads.step_per_seq_s, 0.0);
        assert!(p.overheads.request_s > 0.0);
        let mut json = serde_json::to_value(profile()).unwrap();
        let overheads = json["overheads"].as_object_mut().unwrap();
        overheads.remove("step_s");
        overheads.remove("step_per_seq_s");
        let back: Profile = serde_json::from_value(json).unwrap();
        assert_eq!(back, profile());
    }

    /// Every step costs the loop's overhead on top of its forward pass, decode and prefill alike, plus
    /// its per-sequence share; a bad overhead is refused by name.
    #[test]
    fn host_time_adds_the_per_step_overhead() {
        let mut p = profile();
        let step = |p: &Profile, tokens, seqs, prefill| {
            p.forward_time(tokens, seqs, prefill, 0.0) + p.host_time(seqs)
        };
        let (decode, prefill) = (step(&p, 4, 4, 0), step(&p, 100, 1, 100));
        p.overheads.step_s = 0.002;
        assert!((step(&p, 4, 4, 0) - decode - 0.002).abs() < 1e-12);
        assert!((step(&p, 100, 1, 100) - prefill - 0.002).abs() < 1e-12);
        p.overheads.step_per_seq_s = 0.0001;
        assert!((step(&p, 4, 4, 0) - decode - 0.0024).abs() < 1e-12);
        assert!((step(&p, 100, 1, 100) - prefill - 0.0021).abs() < 1e-12);
        p.overheads.step_s = -1.0;
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("overheads.step_s"), "{e}");
        p.overheads.step_s = 0.0;
        p.overheads.step_per_seq_s = f64::NAN;
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("overheads.step_per_seq_s"), "{e}");
    }
}
