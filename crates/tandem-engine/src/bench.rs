//! Throughput figures of a running engine (`tandem bench-engine`): single-stream decode, prefill of a
//! long prompt, and aggregate decode of many concurrent sequences.

use crate::engine::{EngineError, EngineHandle, RequestStream};
use crate::types::{EngineRequest, RequestId, SamplingParams};
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct BenchOptions {
    /// Tokens decoded by the single stream.
    pub decode_tokens: usize,
    /// Prompt length of the prefill measurement.
    pub prefill_len: usize,
    /// Concurrent sequences of the aggregate measurement.
    pub concurrency: usize,
    /// Tokens each concurrent sequence decodes.
    pub concurrent_tokens: usize,
    /// Prompt length of the decode measurements.
    pub prompt_len: usize,
    /// Seed of the random prompts (random so the prefix cache cannot help).
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            decode_tokens: 128,
            prefill_len: 512,
            concurrency: 16,
            concurrent_tokens: 64,
            prompt_len: 16,
            seed: 0,
        }
    }
}

/// The measured figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    /// Tokens per second of one sequence decoding alone (after its first token).
    pub single_stream_decode_tok_s: f64,
    /// Time to first token of a single short prompt.
    pub single_stream_ttft: Duration,
    /// Prompt tokens per second of prefilling `prefill_len` tokens (time to first token).
    pub prefill_tok_s: f64,
    /// Time to first token of the long prompt.
    pub prefill_ttft: Duration,
    /// Tokens per second across `concurrency` sequences decoding together.
    pub concurrent_decode_tok_s: f64,
    /// The options measured with.
    pub options: BenchOptions,
}

fn random_prompt(rng: &mut rand_chacha::ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    // Stay clear of the low ids, where tokenizers put their special tokens.
    let lo = (vocab / 16).min(256) as u32;
    (0..len)
        .map(|_| rng.random_range(lo..vocab as u32))
        .collect()
}

fn next(stream: &mut RequestStream) -> Result<crate::types::TokenOutput, EngineError> {
    stream
        .blocking_recv()
        .ok_or_else(|| stream.take_error().unwrap_or(EngineError::Stopped))
}

/// Runs the three measurements one after another on an otherwise idle engine (blocking; call it
/// from a plain thread, not an async task). Request ids start at `u64::MAX - 1000`.
pub fn run_engine_bench(
    engine: &EngineHandle,
    opts: &BenchOptions,
) -> Result<BenchReport, EngineError> {
    let vocab = engine.vocab_size();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed);
    let mut id: RequestId = u64::MAX - 1000;
    let mut next_id = || {
        id += 1;
        id
    };

    // Single stream.
    let t0 = Instant::now();
    let prompt = random_prompt(&mut rng, opts.prompt_len, vocab);
    let mut s = engine.submit(EngineRequest::new(
        next_id(),
        prompt,
        SamplingParams::greedy(opts.decode_tokens),
    ))?;
    next(&mut s)?;
    let single_stream_ttft = t0.elapsed();
    let t1 = Instant::now();
    let mut n = 0;
    while next(&mut s)?.finish.is_none() {
        n += 1;
    }
    let single_stream_decode_tok_s = (n + 1) as f64 / t1.elapsed().as_secs_f64();

    // Prefill of a long prompt.
    let prompt = random_prompt(&mut rng, opts.prefill_len, vocab);
    let t0 = Instant::now();
    let mut s = engine.submit(EngineRequest::new(
        next_id(),
        prompt,
        SamplingParams::greedy(1),
    ))?;
    next(&mut s)?;
    let prefill_ttft = t0.elapsed();
    let prefill_tok_s = opts.prefill_len as f64 / prefill_ttft.as_secs_f64();

    // Many sequences decoding together: timed from the moment all have their first token.
    let mut streams = Vec::with_capacity(opts.concurrency);
    for _ in 0..opts.concurrency {
        let prompt = random_prompt(&mut rng, opts.prompt_len, vocab);
        streams.push(engine.submit(EngineRequest::new(
            next_id(),
            prompt,
            SamplingParams::greedy(opts.concurrent_tokens),
        ))?);
    }
    let mut total = 0usize;
    let mut done = vec![false; streams.len()];
    for (s, d) in streams.iter_mut().zip(&mut done) {
        *d = next(s)?.finish.is_some();
    }
    let t1 = Instant::now();
    for (s, d) in streams.iter_mut().zip(&done) {
        if !*d {
            loop {
                total += 1;
                if next(s)?.finish.is_some() {
                    break;
                }
            }
        }
    }
    let concurrent_decode_tok_s = total as f64 / t1.elapsed().as_secs_f64();
    Ok(BenchReport {
        single_stream_decode_tok_s,
        single_stream_ttft,
        prefill_tok_s,
        prefill_ttft,
        concurrent_decode_tok_s,
        options: opts.clone(),
    })
}
