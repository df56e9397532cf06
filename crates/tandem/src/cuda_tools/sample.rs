//! `tandem cuda-sample-check`: the on-device sampler's draws against the host sampler's distribution.

use std::path::Path;

use anyhow::{anyhow, Result};
use serde::Serialize;
use tandem_cuda::{CudaLlama, CudaOptions, SampleRow, WeightSource};
use tandem_engine::sampler::argmax;

use super::bench::BenchArgs;
use super::io_err;

/// One case of the on-device sampler check: the filters, and what was found.
#[derive(Serialize)]
struct SampleCase {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    draws: usize,
    /// Tokens the filters keep (host computation).
    kept: usize,
    /// Draws of tokens the filters drop (must be 0).
    outside: usize,
    /// Largest |observed − expected| frequency over the 20 likeliest tokens and the rest, in
    /// standard errors of a binomial count.
    max_sigma: f64,
    /// The same seeds drew the same tokens again.
    repeatable: bool,
    pass: bool,
}

/// The host sampler's distribution after temperature, top-k, top-p, min-p (same order and rules):
/// probability per token, zero for dropped ones.
fn filtered_distribution(logits: &[f32], row: &SampleRow) -> Vec<f64> {
    let v = logits.len();
    let mut p = vec![0.0f64; v];
    if row.temperature <= 1e-5 || row.top_k == 1 {
        p[argmax(logits) as usize] = 1.0;
        return p;
    }
    let mut idx: Vec<usize> = (0..v).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let k = if row.top_k > 0 {
        (row.top_k as usize).min(v)
    } else {
        v
    };
    let cand = &idx[..k];
    let max = logits[cand[0]] as f64;
    let w: Vec<f64> = cand
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / row.temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = k;
    if row.top_p < 1.0 {
        let target = row.top_p.max(0.0) as f64 * total;
        let mut acc = 0.0;
        for (j, x) in w.iter().enumerate() {
            acc += x;
            if acc >= target {
                keep = j + 1;
                break;
            }
        }
    }
    let floor = if row.min_p > 0.0 {
        row.min_p as f64
    } else {
        0.0
    };
    let kept: Vec<(usize, f64)> = cand[..keep]
        .iter()
        .zip(&w)
        .filter(|(_, &x)| x >= floor)
        .map(|(&i, &x)| (i, x))
        .collect();
    let sum: f64 = kept.iter().map(|(_, x)| x).sum();
    for (i, x) in kept {
        p[i] = x / sum;
    }
    p
}

/// Checks the on-device sampler (`sample_rows`) against the host sampler's distribution: for each
/// filter setting, 256 rows × `rounds` draws with distinct seeds from one fixed logits row of
/// Llama 3's vocabulary width; no draw may fall outside the kept set, the 20 likeliest tokens and
/// the rest must each be within 5 standard errors of their expected counts, and the same seeds
/// must draw the same tokens. Writes JSON to `out`; fails when a case fails.
pub fn run(out: &Path, rounds: usize) -> Result<()> {
    let mut c = BenchArgs::llama3_8b_config();
    c.num_layers = 1;
    c.layers.truncate(1);
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    let rows = 256;
    let opts = CudaOptions {
        kv_cache_memory: 64 << 20,
        max_tokens: rows,
        max_seqs: rows,
        max_model_len: Some(1024),
        logits_chunk_rows: rows,
        ..CudaOptions::default()
    };
    let mut model = CudaLlama::new(c.clone(), WeightSource::Random { seed: 3 }, opts)?;
    let v = c.vocab_size;
    // A Zipf-like logits row: the token of rank r (scattered over the vocabulary) has logit
    // 8 - 2 ln(1 + r), all distinct in f32, so no filter threshold falls on a tie.
    let mut logits = vec![0.0f32; v];
    for r in 0..v {
        logits[(r * 7919) % v] = 8.0 - 2.0 * (1.0 + r as f32).ln();
    }
    let mut all = Vec::with_capacity(rows * v);
    for _ in 0..rows {
        all.extend_from_slice(&logits);
    }
    let settings = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.3, 0, 1.0, 0.1),
        (0.8, 100, 0.95, 0.02),
    ];
    let mut cases = Vec::new();
    let mut ok = true;
    let mut ids = Vec::new();
    for (temperature, top_k, top_p, min_p) in settings {
        let base = SampleRow {
            temperature,
            top_p,
            min_p,
            top_k,
            seed: 0,
        };
        let expected = filtered_distribution(&logits, &base);
        let mut counts = vec![0usize; v];
        let mut first_round = Vec::new();
        for round in 0..rounds {
            let batch: Vec<SampleRow> = (0..rows)
                .map(|r| SampleRow {
                    seed: 0x5eed_0000 + (round * rows + r) as u64,
                    ..base
                })
                .collect();
            model.sample_logits(&all, &batch, &mut ids)?;
            if round == 0 {
                first_round = ids.clone();
            }
            for &t in &ids {
                counts[t as usize] += 1;
            }
        }
        let seeds: Vec<SampleRow> = (0..rows)
            .map(|r| SampleRow {
                seed: 0x5eed_0000 + r as u64,
                ..base
            })
            .collect();
        model.sample_logits(&all, &seeds, &mut ids)?;
        let repeatable = ids == first_round;
        let n = (rounds * rows) as f64;
        let outside: usize = (0..v)
            .filter(|&i| expected[i] == 0.0)
            .map(|i| counts[i])
            .sum();
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| expected[b].total_cmp(&expected[a]));
        let sigma = |obs: usize, p: f64| {
            let sd = (n * p * (1.0 - p)).sqrt().max(1.0);
            (obs as f64 - n * p).abs() / sd
        };
        let mut max_sigma = 0.0f64;
        let (mut rest_obs, mut rest_p) = (counts.iter().sum::<usize>(), 1.0);
        for &i in order.iter().take(20) {
            max_sigma = max_sigma.max(sigma(counts[i], expected[i]));
            rest_obs -= counts[i];
            rest_p -= expected[i];
        }
        max_sigma = max_sigma.max(sigma(rest_obs, rest_p.max(0.0)));
        let pass = outside == 0 && max_sigma <= 5.0 && repeatable;
        ok &= pass;
        cases.push(SampleCase {
            temperature,
            top_k,
            top_p,
            min_p,
            draws: n as usize,
            kept: expected.iter().filter(|&&p| p > 0.0).count(),
            outside,
            max_sigma,
            repeatable,
            pass,
        });
    }
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "device": model.device_name(),
        "pass": ok,
        "cases": cases,
    }))
    .unwrap_or_default();
    println!("{text}");
    std::fs::write(out, text + "\n").map_err(io_err(out))?;
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the on-device sampler check failed"))
    }
}
