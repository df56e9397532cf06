//! Turns one row of logits into the next token under a request's [`SamplingParams`].
//!
//! Order (as in vLLM/HF): penalties → temperature → top-k → top-p → min-p → draw. Logprobs are
//! reported from the unmodified log-softmax. All scratch space lives in [`Sampler`] and is reused.

use crate::types::{SamplingParams, TokenLogprobs};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Below this temperature sampling is greedy (dividing by ~0 would overflow).
const GREEDY_EPS: f32 = 1e-5;

/// Per-request random state, seeded once from the request's seed.
///
/// The draws for output token `i` come from ChaCha stream `i`, so the tokens of a seeded request
/// do not depend on how many draws happened before: they survive preemption and a prefill/decode
/// split across two engines unchanged.
#[derive(Clone, Debug)]
pub struct SeqRng(ChaCha8Rng);

impl SeqRng {
    /// A generator seeded from the request's seed, or from OS entropy when it has none.
    pub fn new(seed: Option<u64>) -> Self {
        Self(ChaCha8Rng::seed_from_u64(seed.unwrap_or_else(rand::random)))
    }

    /// The seed of output token `index`'s draw for a backend's own sampler (from the same stream
    /// the host sampler would draw from, so a seeded request repeats on the same backend).
    pub fn draw_seed(&mut self, index: usize) -> u64 {
        self.for_token(index).random::<u64>()
    }

    fn for_token(&mut self, index: usize) -> &mut ChaCha8Rng {
        self.0.set_stream(index as u64);
        self.0.set_word_pos(0);
        &mut self.0
    }
}

/// Reusable scratch buffers for sampling; one per engine.
#[derive(Debug, Default)]
pub struct Sampler {
    work: Vec<f32>,
    idx: Vec<u32>,
    /// Per-token occurrence counts over the output (frequency/presence penalties); kept all-zero between calls.
    counts: Vec<u32>,
    /// Marks tokens already penalised in this call (repetition penalty); kept all-false between calls.
    seen: Vec<bool>,
}

/// What the sampler chose for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Its logprobs, if the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

impl Sampler {
    /// A sampler with empty scratch space (grown on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Picks the next token from `logits` (one row, vocab long) for a sequence whose prompt is
    /// `prompt` and whose generated tokens so far are `output`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        prompt: &[u32],
        output: &[u32],
        rng: &mut SeqRng,
    ) -> Sampled {
        let vocab = logits.len();
        if self.counts.len() < vocab {
            self.counts.resize(vocab, 0);
            self.seen.resize(vocab, false);
        }
        self.work.clear();
        self.work.extend_from_slice(logits);
        self.apply_penalties(params, prompt, output);

        let token = if params.temperature < GREEDY_EPS || params.top_k == 1 {
            argmax(&self.work)
        } else {
            self.draw(params, rng.for_token(output.len()))
        };
        let logprobs = params.logprobs.map(|n| logprobs_of(logits, token, n));
        Sampled { token, logprobs }
    }

    fn apply_penalties(&mut self, params: &SamplingParams, prompt: &[u32], output: &[u32]) {
        let vocab = self.work.len();
        let rep = params.repetition_penalty;
        if rep != 1.0 && rep > 0.0 {
            for &t in prompt.iter().chain(output) {
                let t = t as usize;
                if t < vocab && !self.seen[t] {
                    self.seen[t] = true;
                    let l = &mut self.work[t];
                    *l = if *l > 0.0 { *l / rep } else { *l * rep };
                }
            }
            for &t in prompt.iter().chain(output) {
                if (t as usize) < vocab {
                    self.seen[t as usize] = false;
                }
            }
        }
        let (freq, pres) = (params.frequency_penalty, params.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            for &t in output {
                if (t as usize) < vocab {
                    self.counts[t as usize] += 1;
                }
            }
            for &t in output {
                let t = t as usize;
                if t < vocab && self.counts[t] > 0 {
                    self.work[t] -= freq * self.counts[t] as f32 + pres;
                    self.counts[t] = 0;
                }
            }
        }
    }

    fn draw(&mut self, params: &SamplingParams, rng: &mut ChaCha8Rng) -> u32 {
        let inv_t = 1.0 / params.temperature;
        let vocab = self.work.len();
        self.idx.clear();
        self.idx.extend(0..vocab as u32);
        let work = &self.work;
        let by_logit_desc = |a: &u32, b: &u32| work[*b as usize].total_cmp(&work[*a as usize]);
        let mut n = vocab;
        if params.top_k > 0 && params.top_k < vocab {
            self.idx
                .select_nth_unstable_by(params.top_k - 1, by_logit_desc);
            n = params.top_k;
        }
        let cand = &mut self.idx[..n];
        let needs_order = params.top_p < 1.0;
        if needs_order {
            cand.sort_unstable_by(by_logit_desc);
        }
        let max = cand
            .iter()
            .map(|&i| work[i as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        // Probabilities (unnormalised) reuse the `work` slots of the candidates.
        let work = &mut self.work;
        let mut total = 0.0f32;
        let mut probs_max = 0.0f32;
        for &i in cand.iter() {
            let p = ((work[i as usize] - max) * inv_t).exp();
            work[i as usize] = p;
            total += p;
            probs_max = probs_max.max(p);
        }
        if needs_order {
            let target = params.top_p.max(0.0) * total;
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (j, &i) in cand.iter().enumerate() {
                acc += work[i as usize];
                if acc >= target {
                    keep = j + 1;
                    break;
                }
            }
            n = keep;
        }
        let cand = &self.idx[..n];
        let floor = if params.min_p > 0.0 {
            params.min_p * probs_max
        } else {
            0.0
        };
        let kept_total: f32 = cand
            .iter()
            .map(|&i| work[i as usize])
            .filter(|&p| p >= floor)
            .sum();
        let mut r = rng.random::<f32>() * kept_total;
        let mut last = cand[0];
        for &i in cand {
            let p = work[i as usize];
            if p < floor {
                continue;
            }
            last = i;
            if r < p {
                return i;
            }
            r -= p;
        }
        last
    }
}

/// Index of the largest value (the first on ties), as greedy decoding defines it.
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in xs.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// Log-softmax of the raw logits at `token`, plus the `top_n` most likely tokens (most likely first);
/// public so tests outside the crate can score logits exactly as the engine reports them.
pub fn logprobs_of(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    // A small insertion-sorted list: top_n is tiny (OpenAI caps it at 20), the vocab is not.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(top_n + 1);
    if top_n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() == top_n && l <= top[top_n - 1].1 {
                continue;
            }
            let pos = top.partition_point(|&(_, v)| v >= l);
            top.insert(pos, (i as u32, l));
            top.truncate(top_n);
        }
    }
    for e in &mut top {
        e.1 -= lse;
    }
    TokenLogprobs {
        logprob: logits[token as usize] - lse,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_argmax_and_reports_logprobs() {
        let mut s = Sampler::new();
        let logits = [0.0, 3.0, 1.0, 3.0];
        let p = SamplingParams {
            temperature: 0.0,
            logprobs: Some(2),
            ..Default::default()
        };
        let out = s.sample(&logits, &p, &[], &[], &mut SeqRng::new(Some(1)));
        assert_eq!(out.token, 1);
        let lp = out.logprobs.unwrap();
        let lse = (1.0f32 + 3f32.exp() * 2.0 + 1f32.exp()).ln();
        assert!((lp.logprob - (3.0 - lse)).abs() < 1e-5);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0].0, 1);
        assert_eq!(lp.top[1].0, 3);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varies_with_seed() {
        let mut s = Sampler::new();
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |s: &mut Sampler, seed| {
            let mut rng = SeqRng::new(Some(seed));
            let mut out = Vec::new();
            for _ in 0..40 {
                let t = s.sample(&logits, &params(), &[], &out, &mut rng).token;
                out.push(t);
            }
            out
        };
        assert_eq!(run(&mut s, 7), run(&mut s, 7));
        assert_ne!(run(&mut s, 7), run(&mut s, 8));
    }

    #[test]
    fn draws_depend_on_token_index_not_history() {
        let mut s = Sampler::new();
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let out = [1, 2, 3];
        let mut a = SeqRng::new(Some(9));
        for _ in 0..5 {
            s.sample(&logits, &params(), &[], &out[..1], &mut a);
        }
        let x = s.sample(&logits, &params(), &[], &out, &mut a).token;
        let y = s
            .sample(&logits, &params(), &[], &out, &mut SeqRng::new(Some(9)))
            .token;
        assert_eq!(x, y);
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_support() {
        let mut s = Sampler::new();
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let mut rng = SeqRng::new(Some(3));
        let k = SamplingParams {
            top_k: 2,
            ..params()
        };
        let p = SamplingParams {
            top_p: 0.5,
            ..params()
        };
        let m = SamplingParams {
            min_p: 0.5,
            ..params()
        };
        let mut out = Vec::new();
        let mut seen = [false; 5];
        for _ in 0..200 {
            let a = s.sample(&logits, &k, &[], &out, &mut rng).token;
            let b = s.sample(&logits, &p, &[], &out, &mut rng).token;
            let c = s.sample(&logits, &m, &[], &out, &mut rng).token;
            assert!([0, 1].contains(&a) && [0, 1].contains(&b) && [0, 1, 4].contains(&c));
            seen[c as usize] = true;
            out.push(0);
        }
        assert_eq!(
            seen,
            [true, true, false, false, true],
            "the kept tokens are all drawn"
        );
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut s = Sampler::new();
        let logits = [0.0, 2f32.ln()]; // probabilities 1/3, 2/3
        let mut rng = SeqRng::new(Some(11));
        let mut out = Vec::new();
        for _ in 0..3000 {
            let t = s.sample(&logits, &params(), &[], &out, &mut rng).token;
            out.push(t);
        }
        let ones = out.iter().filter(|&&t| t == 1).count();
        assert!((1850..2150).contains(&ones), "{ones}");
    }

    #[test]
    fn penalties_follow_hf_and_openai_semantics() {
        let mut s = Sampler::new();
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        // Repetition penalty divides positive logits and multiplies negative ones, once per token.
        let rep = SamplingParams {
            repetition_penalty: 2.0,
            ..greedy.clone()
        };
        assert_eq!(
            s.sample(
                &[3.0, 2.0, -1.0],
                &rep,
                &[0, 0],
                &[],
                &mut SeqRng::new(None)
            )
            .token,
            1
        );
        assert_eq!(
            s.sample(&[1.0, 0.6, -0.9], &rep, &[0], &[2], &mut SeqRng::new(None))
                .token,
            1
        );
        // Frequency scales with the count in the output; presence is flat; the prompt does not count.
        let freq = SamplingParams {
            frequency_penalty: 1.0,
            ..greedy.clone()
        };
        assert_eq!(
            s.sample(
                &[3.0, 1.5],
                &freq,
                &[1, 1, 1],
                &[0, 0],
                &mut SeqRng::new(None)
            )
            .token,
            1
        );
        assert_eq!(
            s.sample(&[3.0, 1.5], &freq, &[], &[0], &mut SeqRng::new(None))
                .token,
            0
        );
        let pres = SamplingParams {
            presence_penalty: 2.0,
            ..greedy
        };
        assert_eq!(
            s.sample(&[3.0, 1.5], &pres, &[], &[0], &mut SeqRng::new(None))
                .token,
            1
        );
        // Scratch state is left clean: no penalty leaks into a call without history.
        assert_eq!(
            s.sample(&[3.0, 1.5], &pres, &[], &[], &mut SeqRng::new(None))
                .token,
            0
        );
    }
}
