//! Tensor and pipeline parallel layouts of one worker: what each costs, for the planner to choose one
//! per role.
//!
//! A profile's own curves describe one layout ([`Profile::parallelism`]). More come from two places:
//! - `layouts`: step curves measured (or written) for another layout, each with its KV pool;
//! - `scaling`: a [`ScalingModel`] deriving layouts from the profile's curves, which must then be those
//!   of a whole model on one device (TP1, PP1), and from interconnect and memory figures. Derived
//!   layouts are marked [`ProfileSource::Datasheet`].
//!
//! The scaling model, for `t` tensor ranks and `p` pipeline stages at `x` batched tokens:
//! - compute and weight reads split over the `t` ranks: the step's time divides by `t`;
//! - each layer all-reduces its attention and MLP outputs (2 per layer) of x · hidden · activation bytes,
//!   a ring moving 2(t−1)/t of it at `allreduce_bytes_per_s`, plus `allreduce_latency_s` each;
//! - the `p` stages run one after another on a step; a step of 64 tokens or more is cut into `p`
//!   micro-batches that overlap across stages (as the engine's pipeline cuts them), taking
//!   (2p−1)/p² of the unsplit time, a smaller step is not cut (decode reads every weight either way);
//!   each of the p−1 hops carries x · hidden · activation bytes at `stage_bytes_per_s` plus
//!   `stage_latency_s`;
//! - the KV pool is what the layout's t·p devices hold beyond the weights:
//!   (t·p·device_memory_bytes − weight_bytes) / (block_size · kv_bytes_per_token) blocks; a layout
//!   where that is not positive does not fit and is left out.
//!
//! tandem does not combine tensor and pipeline parallelism in one worker (refused at start-up), so no
//! layout has both above 1.

use serde::{Deserialize, Serialize};

use crate::error::SimError;
use crate::profile::{Profile, ProfileSource, StepCurve};

/// A worker's split over devices: `tp` tensor-parallel ranks times `pp` pipeline stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallelism {
    /// Tensor-parallel ranks (`engine.tensor_parallel_size`).
    pub tp: usize,
    /// Pipeline stages (`engine.pipeline_parallel_size`).
    pub pp: usize,
}

impl Parallelism {
    /// One device, no split.
    pub const ONE: Parallelism = Parallelism { tp: 1, pp: 1 };

    /// Devices one worker of this layout occupies.
    pub fn devices(&self) -> usize {
        self.tp * self.pp
    }

    /// `TP2`, `PP4`, `TP1` (one device).
    pub fn label(&self) -> String {
        if self.pp > 1 {
            format!("PP{}", self.pp)
        } else {
            format!("TP{}", self.tp)
        }
    }

    fn check(&self, field: &str) -> Result<(), SimError> {
        let bad = |message: String| {
            Err(SimError::Profile {
                field: field.to_string(),
                message,
            })
        };
        if self.tp == 0 || self.pp == 0 {
            return bad(format!(
                "tp and pp must be at least 1, not tp {} pp {}",
                self.tp, self.pp
            ));
        }
        if self.tp > 1 && self.pp > 1 {
            return bad(format!(
                "tp {} with pp {}: tandem does not combine tensor and pipeline parallelism in one worker",
                self.tp, self.pp
            ));
        }
        Ok(())
    }
}

/// The costs of one more layout: its step curves and its KV pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutProfile {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Measured, or written from datasheet figures.
    pub source: ProfileSource,
    /// KV blocks one worker of this layout holds.
    pub kv_blocks: usize,
    /// Steps that only decode, by batch size.
    pub decode: StepCurve,
    /// Steps with prefill tokens, by batched tokens.
    pub prefill: StepCurve,
}

impl LayoutProfile {
    /// Its layout.
    pub fn parallelism(&self) -> Parallelism {
        Parallelism {
            tp: self.tp,
            pp: self.pp,
        }
    }
}

/// Interconnect and memory figures that derive layouts from a one-device profile (see the module doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalingModel {
    /// Tensor-parallel degrees to derive (each with one stage).
    #[serde(default)]
    pub tp: Vec<usize>,
    /// Pipeline degrees to derive (each with one tensor rank).
    #[serde(default)]
    pub pp: Vec<usize>,
    /// The model's hidden size (elements per token of the activations exchanged).
    pub hidden_size: usize,
    /// The model's layers.
    pub layers: usize,
    /// Bytes per activation element (2 for bf16/fp16).
    pub activation_bytes: f64,
    /// Bus bandwidth of one all-reduce among a worker's devices (NVLink, bytes/s).
    pub allreduce_bytes_per_s: f64,
    /// Fixed seconds of one all-reduce.
    pub allreduce_latency_s: f64,
    /// Bandwidth between consecutive pipeline stages (bytes/s).
    pub stage_bytes_per_s: f64,
    /// Fixed seconds of one stage hop.
    pub stage_latency_s: f64,
    /// Memory of one device available to the engine (bytes).
    pub device_memory_bytes: f64,
    /// The model's weights (bytes).
    pub weight_bytes: f64,
}

impl ScalingModel {
    fn check(&self) -> Result<(), SimError> {
        let bad = |field: &str, message: String| {
            Err(SimError::Profile {
                field: format!("scaling.{field}"),
                message,
            })
        };
        for (field, v) in [("hidden_size", self.hidden_size), ("layers", self.layers)] {
            if v == 0 {
                return bad(field, "must be positive".into());
            }
        }
        for (field, v) in [
            ("activation_bytes", self.activation_bytes),
            ("allreduce_bytes_per_s", self.allreduce_bytes_per_s),
            ("stage_bytes_per_s", self.stage_bytes_per_s),
            ("device_memory_bytes", self.device_memory_bytes),
            ("weight_bytes", self.weight_bytes),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, format!("must be a positive number, not {v}"));
            }
        }
        for (field, v) in [
            ("allreduce_latency_s", self.allreduce_latency_s),
            ("stage_latency_s", self.stage_latency_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, format!("must be a non-negative number, not {v}"));
            }
        }
        for (field, list) in [("tp", &self.tp), ("pp", &self.pp)] {
            if list.contains(&0) {
                return bad(field, "degrees must be at least 1".into());
            }
        }
        Ok(())
    }

    /// KV blocks a worker of `par` holds, 0 when the weights do not fit.
    fn kv_blocks(&self, par: Parallelism, block_size: usize, kv_bytes_per_token: f64) -> usize {
        let free = par.devices() as f64 * self.device_memory_bytes - self.weight_bytes;
        if free <= 0.0 {
            return 0;
        }
        (free / (block_size as f64 * kv_bytes_per_token)).floor() as usize
    }

    /// `curve` (one device, whole model) as a worker of `par` runs it.
    fn derive(&self, curve: &StepCurve, par: Parallelism) -> StepCurve {
        let (t, p) = (par.tp as f64, par.pp as f64);
        let bytes = |x: f64| x * self.hidden_size as f64 * self.activation_bytes;
        let points = curve
            .points
            .iter()
            .map(|&[x, s]| {
                let micro = if par.pp > 1 && x >= 64.0 { p } else { 1.0 };
                let pipelined = (micro + p - 1.0) / (micro * p);
                let mut secs = s / t * pipelined;
                if par.tp > 1 {
                    secs += self.layers as f64
                        * 2.0
                        * (self.allreduce_latency_s
                            + 2.0 * (t - 1.0) / t * bytes(x) / self.allreduce_bytes_per_s);
                }
                if par.pp > 1 {
                    secs += (p - 1.0) * (self.stage_latency_s + bytes(x) / self.stage_bytes_per_s);
                }
                [x, secs]
            })
            .collect();
        StepCurve {
            points,
            per_context_s: curve.per_context_s / t,
        }
    }
}

/// Checks the layout fields of a profile, naming the offending one.
pub(crate) fn check(profile: &Profile) -> Result<(), SimError> {
    let own = profile.parallelism();
    own.check("parallelism")?;
    if own.devices() != profile.hardware.devices_per_worker {
        return Err(SimError::Profile {
            field: "parallelism".into(),
            message: format!(
                "tp {} × pp {} is {} devices, but hardware.devices_per_worker is {}",
                own.tp,
                own.pp,
                own.devices(),
                profile.hardware.devices_per_worker
            ),
        });
    }
    let mut seen = vec![own];
    for (i, l) in profile.layouts.iter().enumerate() {
        let field = format!("layouts[{i}]");
        l.parallelism().check(&field)?;
        if seen.contains(&l.parallelism()) {
            return Err(SimError::Profile {
                field,
                message: format!("tp {} pp {} is listed twice", l.tp, l.pp),
            });
        }
        seen.push(l.parallelism());
        if l.kv_blocks == 0 {
            return Err(SimError::Profile {
                field: format!("{field}.kv_blocks"),
                message: "must be positive".into(),
            });
        }
        l.decode.check(&format!("{field}.decode"))?;
        l.prefill.check(&format!("{field}.prefill"))?;
    }
    if let Some(s) = &profile.scaling {
        s.check()?;
        if own != Parallelism::ONE {
            return Err(SimError::Profile {
                field: "scaling".into(),
                message: format!(
                    "derives layouts from one device's curves, but the profile's are tp {} pp {}",
                    own.tp, own.pp
                ),
            });
        }
    }
    Ok(())
}

/// Every layout the profile describes, each as a profile of its own (curves, pool, devices per worker),
/// the profile's own first; layouts the scaling model finds too small for the weights are left out.
pub fn variants(profile: &Profile) -> Result<Vec<(Parallelism, Profile)>, SimError> {
    profile.check()?;
    let mut out = Vec::new();
    let with = |par: Parallelism, source, kv_blocks, decode, prefill| {
        let mut p = profile.clone();
        p.hardware.devices_per_worker = par.devices();
        p.parallelism = Some(par);
        p.source = source;
        p.kv_blocks = kv_blocks;
        p.decode = decode;
        p.prefill = prefill;
        p.layouts = Vec::new();
        p.scaling = None;
        p
    };
    let own = profile.parallelism();
    match &profile.scaling {
        // With a scaling model every pool, the one-device one too, is sized by its memory figures.
        Some(s) => {
            let blocks = s.kv_blocks(own, profile.block_size, profile.kv_bytes_per_token);
            if blocks > 0 {
                out.push((
                    own,
                    with(
                        own,
                        profile.source,
                        blocks,
                        profile.decode.clone(),
                        profile.prefill.clone(),
                    ),
                ));
            }
        }
        None => out.push((own, with_own(profile))),
    }
    for l in &profile.layouts {
        out.push((
            l.parallelism(),
            with(
                l.parallelism(),
                l.source,
                l.kv_blocks,
                l.decode.clone(),
                l.prefill.clone(),
            ),
        ));
    }
    if let Some(s) = &profile.scaling {
        let derived =
            s.tp.iter()
                .map(|&tp| Parallelism { tp, pp: 1 })
                .chain(s.pp.iter().map(|&pp| Parallelism { tp: 1, pp }));
        for par in derived {
            if out.iter().any(|(p, _)| *p == par) {
                continue;
            }
            let blocks = s.kv_blocks(par, profile.block_size, profile.kv_bytes_per_token);
            if blocks == 0 {
                continue;
            }
            out.push((
                par,
                with(
                    par,
                    ProfileSource::Datasheet,
                    blocks,
                    s.derive(&profile.decode, par),
                    s.derive(&profile.prefill, par),
                ),
            ));
        }
    }
    if out.is_empty() {
        return Err(SimError::Profile {
            field: "scaling".into(),
            message: "no layout holds the weights (weight_bytes) in its devices' memory (device_memory_bytes)".into(),
        });
    }
    Ok(out)
}

fn with_own(profile: &Profile) -> Profile {
    let mut p = profile.clone();
    p.layouts = Vec::new();
    p.scaling = None;
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::profile;

    fn scaling() -> ScalingModel {
        ScalingModel {
            tp: vec![2, 4],
            pp: vec![2],
            hidden_size: 1000,
            layers: 10,
            activation_bytes: 2.0,
            allreduce_bytes_per_s: 1e11,
            allreduce_latency_s: 1e-5,
            stage_bytes_per_s: 1e10,
            stage_latency_s: 1e-4,
            device_memory_bytes: 1e9,
            weight_bytes: 1.5e9,
        }
    }

    #[test]
    fn the_scaling_model_derives_layouts_that_fit() {
        let mut p = profile();
        p.scaling = Some(scaling());
        let v = variants(&p).unwrap();
        let pars: Vec<Parallelism> = v.iter().map(|(par, _)| *par).collect();
        // One device cannot hold 1.5 GB of weights in 1 GB: TP1 is left out.
        assert_eq!(
            pars,
            [
                Parallelism { tp: 2, pp: 1 },
                Parallelism { tp: 4, pp: 1 },
                Parallelism { tp: 1, pp: 2 }
            ]
        );
        let (_, tp2) = &v[0];
        assert_eq!(tp2.hardware.devices_per_worker, 2);
        assert_eq!(tp2.source, ProfileSource::Datasheet);
        // (2 GB − 1.5 GB) / (16 tokens × 1000 B).
        assert_eq!(tp2.kv_blocks, 31_250);
        // Decode batch 1: 11 ms / 2 plus 20 all-reduces of 1000 × 2 B (1 of 2 ring halves) at 1e11 B/s.
        let comm = 20.0 * (1e-5 + 2000.0 / 1e11);
        assert!((tp2.decode.at(1.0, 0.0) - (0.0055 + comm)).abs() < 1e-12);
        // Four ranks compute faster, but not four times: the all-reduces grow.
        let tp4 = &v[1].1;
        assert!(tp4.prefill.at(512.0, 0.0) < tp2.prefill.at(512.0, 0.0));
        assert!(tp4.prefill.at(512.0, 0.0) > tp2.prefill.at(512.0, 0.0) / 2.0);
        // PP2: a decode step of 1 is not cut (the whole step plus one hop); a 512-token prefill is, 3/4 of it.
        let pp2 = &v[2].1;
        assert!((pp2.decode.at(1.0, 0.0) - (0.011 + 1e-4 + 2000.0 / 1e10)).abs() < 1e-12);
        assert!(
            (pp2.prefill.at(512.0, 0.0) - (0.0612 * 0.75 + 1e-4 + 512.0 * 2000.0 / 1e10)).abs()
                < 1e-12
        );
    }

    #[test]
    fn bad_layouts_name_the_field() {
        let mut p = profile();
        p.layouts.push(LayoutProfile {
            tp: 2,
            pp: 2,
            source: ProfileSource::Measured,
            kv_blocks: 10,
            decode: p.decode.clone(),
            prefill: p.prefill.clone(),
        });
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("layouts[0]") && e.contains("combine"), "{e}");
        p.layouts[0].pp = 1;
        p.layouts[0].kv_blocks = 0;
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("layouts[0].kv_blocks"), "{e}");
        p.layouts[0].kv_blocks = 10;
        p.check().unwrap();
        assert_eq!(variants(&p).unwrap().len(), 2);

        let mut p = profile();
        p.parallelism = Some(Parallelism { tp: 2, pp: 1 });
        let e = p.check().unwrap_err().to_string();
        assert!(
            e.contains("parallelism") && e.contains("devices_per_worker"),
            "{e}"
        );
        p.hardware.devices_per_worker = 2;
        p.scaling = Some(scaling());
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("scaling") && e.contains("one device"), "{e}");

        let mut p = profile();
        let mut s = scaling();
        s.weight_bytes = 1e12;
        p.scaling = Some(s);
        let e = variants(&p).unwrap_err().to_string();
        assert!(e.contains("weight_bytes"), "{e}");
        let mut s = scaling();
        s.allreduce_bytes_per_s = 0.0;
        p.scaling = Some(s);
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("scaling.allreduce_bytes_per_s"), "{e}");
    }
}
