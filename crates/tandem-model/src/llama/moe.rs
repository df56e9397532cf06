//! The mixture-of-experts MLP on CPU: the router picks each token's top-k experts, then every expert
//! the batch uses runs once over the rows routed to it (a grouped matmul over the used experts, not a
//! pass per token), and the shared expert, if any, runs over all rows.
//!
//! Under expert parallelism (tensor-parallel ranks of a MoE model) every rank routes every row (the
//! router is small and replicated, so all ranks agree on the routing), runs only the experts the
//! [`crate::ExpertMap`] gives it, and the ranks all-gather each row's per-slot expert outputs; every
//! rank then adds them in increasing expert id, exactly as a single rank does, so the output is bit for
//! bit the single rank's. The shared expert is split like a dense MLP (features by rank, the down
//! projection by hidden features) for the same reason: each of its output elements stays one full dot
//! product, where summing per-rank partial outputs would reorder the additions.

use std::ops::Range;

use tandem_kernels::{matmul, softmax_inplace, MatmulScratch, ThreadPool};

use super::{dense_mlp_in, gathered_matmul, grown};
use crate::collective::Collective;
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
    /// Expert parallelism: this rank's experts' outputs by (token, top-k slot), t × top-k × hidden.
    slots: Vec<f32>,
    /// Expert parallelism: every rank's `slots`, t × ranks × top-k × hidden.
    all_slots: Vec<f32>,
    /// Expert parallelism: a row's slots in increasing expert id.
    order: Vec<usize>,
    /// Expert parallelism: the shared expert's gathered input and local output (see `gathered_matmul`).
    gathered: Vec<f32>,
    part: Vec<f32>,
}

/// What a tensor-parallel rank of a MoE model needs to run its share of a MoE layer.
pub(super) struct ExpertParallel<'a> {
    /// The group's collective.
    pub cl: &'a mut dyn Collective,
    /// The rank holding each expert of this layer (from the model's `ExpertMap`).
    pub owners: &'a [usize],
    /// Hidden features this rank's shared-expert down rows produce.
    pub hidden: Range<usize>,
    /// Shared-expert features this rank computes.
    pub shared_ffn: Range<usize>,
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
    /// routed rows of the experts this partition holds to `counts` (this layer's row of experts), so
    /// that summing the ranks' counts counts each expert once. With `ep`, only this rank's experts run.
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
        mut ep: Option<ExpertParallel<'_>>,
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
        let k = spec.top_k;
        let slots_width = k * h;
        if ep.is_some() {
            grown(&mut self.slots, t * slots_width);
        }
        for (&x, expert) in w.expert_ids.iter().zip(&w.experts) {
            self.group.clear();
            // (token, weight) when the output is added at once; (token * k + slot, weight) under
            // expert parallelism, where it is parked in its slot until every rank's are gathered.
            self.group.extend(
                self.chosen
                    .chunks_exact(k)
                    .enumerate()
                    .filter_map(|(tok, cs)| {
                        let j = cs.iter().position(|c| c.0 == x)?;
                        Some((if ep.is_some() { tok * k + j } else { tok }, cs[j].1))
                    }),
            );
            let n = self.group.len();
            if n == 0 {
                continue;
            }
            counts[x] += n as u64;
            let row_of = |g: usize| if ep.is_some() { g / k } else { g };
            let xin = grown(&mut self.xin, n * h);
            for (dst, &(g, _)) in xin.chunks_exact_mut(h).zip(&self.group) {
                let tok = row_of(g);
                dst.copy_from_slice(&xn[tok * h..(tok + 1) * h]);
            }
            let f = spec.expert_ffn;
            let gate = grown(&mut self.gate, n * f);
            let up = grown(&mut self.up, n * f);
            dense_mlp_in(pool, expert, activation, xin, n, gate, up, mm);
            let eout = grown(&mut self.eout, n * h);
            matmul(pool, &expert.down, gate, n, eout, mm);
            for (src, &(g, weight)) in eout.chunks_exact(h).zip(&self.group) {
                if ep.is_some() {
                    self.slots[g * h..(g + 1) * h].copy_from_slice(src);
                    continue;
                }
                for (o, &v) in out[g * h..(g + 1) * h].iter_mut().zip(src) {
                    *o += weight * v;
                }
            }
        }
        if let Some(ep) = ep.as_mut() {
            let ranks = ep.cl.size();
            let me = ep.cl.rank() * slots_width..(ep.cl.rank() + 1) * slots_width;
            let all = grown(&mut self.all_slots, t * ranks * slots_width);
            ep.cl
                .all_gather_columns(&self.slots[..t * slots_width], me, ranks * slots_width, all);
            // Each row's experts in increasing id, the order in which a single rank adds them.
            for (tok, cs) in self.chosen.chunks_exact(k).enumerate() {
                self.order.clear();
                self.order.extend(0..cs.len());
                self.order.sort_unstable_by_key(|&j| cs[j].0);
                let row = &all[tok * ranks * slots_width..(tok + 1) * ranks * slots_width];
                for &j in &self.order {
                    let (x, weight) = cs[j];
                    let at = ep.owners[x] * slots_width + j * h;
                    for (o, &v) in out[tok * h..(tok + 1) * h].iter_mut().zip(&row[at..at + h]) {
                        *o += weight * v;
                    }
                }
            }
        }
        if let Some(shared) = &w.shared {
            let fs = shared.mlp.gate.rows();
            let gate = grown(&mut self.gate, t * fs);
            let up = grown(&mut self.up, t * fs);
            dense_mlp_in(pool, &shared.mlp, activation, xn, t, gate, up, mm);
            let eout = grown(&mut self.eout, t * h);
            match ep {
                None => matmul(pool, &shared.mlp.down, gate, t, eout, mm),
                Some(ep) => {
                    let io = (&mut self.gathered, &mut self.part);
                    gathered_matmul(
                        pool,
                        ep.cl,
                        &shared.mlp.down,
                        gate,
                        ep.shared_ffn,
                        t,
                        &ep.hidden,
                        eout,
                        io,
                        mm,
                    );
                }
            }
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
