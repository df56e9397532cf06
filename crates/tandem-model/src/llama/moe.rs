//! The mixture-of-experts MLP on CPU: the router picks each token's top-k experts, then every expert
//! the batch uses runs once over the rows routed to it (a grouped matmul over the used experts, not a
//! pass per token), and the shared expert, if any, runs over all rows.

use tandem_kernels::{matmul, softmax_inplace, MatmulScratch, ThreadPool};

use super::{dense_mlp_in, grown};
use crate::spec::{Activation, MoeSpec};
use crate::weights::MoeWeights;

/// Buffers of the MoE block, grown to the largest step seen and reused, and the routing counts.
#[derive(Default)]
pub(super) struct MoeScratch {
    /// Router probabilities, tokens × experts.
    probs: Vec<f32>,
    /// Each token's chosen experts and their weights, tokens × top-k.
    chosen: Vec<(usize, f32)>,
    /// Rows routed to the expert being run, as (token, weight).
    group: Vec<(usize, f32)>,
    /// The group's input rows, n × hidden.
    xin: Vec<f32>,
    /// Gate (then activated) and up projections, n × expert features.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// The expert's output rows, n × hidden.
    eout: Vec<f32>,
    /// The shared expert's gate values, one per token.
    shared_gate: Vec<f32>,
}

/// Token rows one mixture-of-experts layer routed to each of its experts since the model was built:
/// one layer's series of `tandem:moe_expert_tokens_total`, so that imbalance is visible.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerExpertTokens {
    /// The layer's index in the whole model (not in a pipeline stage's share of it).
    pub layer: usize,
    /// Rows routed to each expert, by expert index.
    pub tokens: Vec<u64>,
}

impl MoeScratch {
    /// Computes the MoE block for `t` normalised rows `xn` (t × h) into `out` (t × h), adding the
    /// routed rows to `counts` (this layer's row of experts).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &mut self,
        pool: &ThreadPool,
        w: &MoeWeights,
        spec: &MoeSpec,
        activation: Activation,
        xn: &[f32],
        t: usize,
        h: usize,
        out: &mut [f32],
        counts: &mut [u64],
        mm: &mut MatmulScratch,
    ) {
        let e = spec.num_experts;
        let probs = grown(&mut self.probs, t * e);
        matmul(pool, &w.router, xn, t, probs, mm);
        self.chosen.clear();
        for row in probs.chunks_exact_mut(e) {
            softmax_inplace(row);
            let start = self.chosen.len();
            // Top-k by probability; ties go to the lower expert index, as torch.topk's stable order does.
            for _ in 0..spec.top_k {
                let picked = row
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !self.chosen[start..].iter().any(|c| c.0 == *i))
                    .fold(None, |best: Option<(usize, f32)>, (i, &p)| match best {
                        Some((_, bp)) if bp >= p => best,
                        _ => Some((i, p)),
                    });
                if let Some(c) = picked {
                    self.chosen.push(c);
                }
            }
            if spec.norm_top_k {
                let sum: f32 = self.chosen[start..].iter().map(|c| c.1).sum();
                self.chosen[start..].iter_mut().for_each(|c| c.1 /= sum);
            }
        }
        out.fill(0.0);
        for (x, expert) in w.experts.iter().enumerate() {
            self.group.clear();
            self.group.extend(
                self.chosen
                    .chunks_exact(spec.top_k)
                    .enumerate()
                    .filter_map(|(tok, cs)| cs.iter().find(|c| c.0 == x).map(|c| (tok, c.1))),
            );
            let n = self.group.len();
            if n == 0 {
                continue;
            }
            counts[x] += n as u64;
            let xin = grown(&mut self.xin, n * h);
            for (dst, &(tok, _)) in xin.chunks_exact_mut(h).zip(&self.group) {
                dst.copy_from_slice(&xn[tok * h..(tok + 1) * h]);
            }
            let f = spec.expert_ffn;
            let gate = grown(&mut self.gate, n * f);
            let up = grown(&mut self.up, n * f);
            dense_mlp_in(pool, expert, activation, xin, n, gate, up, mm);
            let eout = grown(&mut self.eout, n * h);
            matmul(pool, &expert.down, gate, n, eout, mm);
            for (src, &(tok, weight)) in eout.chunks_exact(h).zip(&self.group) {
                for (o, &v) in out[tok * h..(tok + 1) * h].iter_mut().zip(src) {
                    *o += weight * v;
                }
            }
        }
        if let Some(shared) = &w.shared {
            let fs = shared.mlp.gate.rows();
            let gate = grown(&mut self.gate, t * fs);
            let up = grown(&mut self.up, t * fs);
            dense_mlp_in(pool, &shared.mlp, activation, xn, t, gate, up, mm);
            let eout = grown(&mut self.eout, t * h);
            matmul(pool, &shared.mlp.down, gate, t, eout, mm);
            let sg = grown(&mut self.shared_gate, t);
            for (g, row) in sg.iter_mut().zip(xn.chunks_exact(h)) {
                let logit: f32 = row.iter().zip(&shared.gate).map(|(a, b)| a * b).sum();
                *g = 1.0 / (1.0 + (-logit).exp());
            }
            for ((o, src), &g) in out
                .chunks_exact_mut(h)
                .zip(eout.chunks_exact(h))
                .zip(sg.iter())
            {
                for (o, &v) in o.iter_mut().zip(src) {
                    *o += g * v;
                }
            }
        }
    }
}
