//! The host work the step timings miss, measured on a live server of the profiled worker (the same
//! model, device and engine settings, served in this process on a loopback port): the request path
//! (connection, HTTP, admission, streaming the first token back), as `tandem bench`'s client sees it
//! less the engine's own step time for that request, and the engine loop's work per step outside the
//! forward pass, from the engine's own counters (`EngineStats::host_seconds_per_step`) with one sequence
//! decoding and with a batch: a fixed part and a part per sequence.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use rand::{Rng, SeedableRng};
use tandem_bench::workload::{BenchRequest, Prompt, RequestClass};
use tandem_bench::{Client, Endpoint, RequestRecord};
use tandem_engine::{EngineConfig, EngineStats};

use super::ProfileArgs;
use crate::config::{EngineSettings, Settings};
use crate::serve::LocalServer;

/// The host overheads of one worker (see [`tandem_sim::profile::Overheads`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct HostOverheads {
    /// Median seconds of a request's time to first token beyond its engine step.
    pub request_s: f64,
    /// Seconds of the engine loop's work per step outside the forward pass, fixed part.
    pub step_s: f64,
    /// The same, per sequence the step runs.
    pub step_per_seq_s: f64,
}

/// Prompt tokens of the requests timed one at a time.
const PROMPT_LEN: usize = 64;

/// Serves the model as the profiled worker would be served and times its host work.
pub(super) fn measure(
    model: &Path,
    config: &EngineConfig,
    args: &ProfileArgs,
) -> Result<HostOverheads> {
    let settings = Settings {
        model: Some(model.to_path_buf()),
        engine: EngineSettings::of(config, args.device),
        cuda: args.cuda.clone(),
        ..Settings::default()
    };
    let server = LocalServer::start(settings).context("starting a server to time its host work")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the client's runtime")?;
    let client = runtime.block_on(Client::connect(
        Endpoint::parse(&server.url),
        None,
        None,
        Duration::from_secs(300),
        &[],
    ))?;
    let vocab = server.engine.vocab_size() as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    // Random ids, so no request finds another's prompt in the prefix cache.
    let mut request = |len: usize, max_tokens: usize| BenchRequest {
        prompt: Prompt::Tokens((0..len).map(|_| rng.random_range(256..vocab)).collect()),
        prompt_len: len,
        max_tokens,
        class: RequestClass::Main,
        at_s: None,
    };
    // A round trip through the engine thread: its counters after every step it has finished.
    let stats = || -> Result<EngineStats> {
        server
            .engine
            .checked_stats()
            .wait_blocking()
            .context("reading the engine's counters")
    };
    let send = |req: &BenchRequest| -> Result<RequestRecord> {
        let record = runtime.block_on(client.send(req, Instant::now()));
        ensure!(
            record.success,
            "a timing request failed: {}",
            record.error.as_deref().unwrap_or("no error given")
        );
        Ok(record)
    };
    let (singles, batch, output) = if args.quick { (5, 8, 16) } else { (10, 32, 32) };
    let prompt_len = PROMPT_LEN.min(config.max_num_batched_tokens);
    for _ in 0..2 {
        send(&request(prompt_len, 4))?;
    }
    // One request at a time, one token each: its time to first token is the request path plus the one
    // step that prefilled it and drew the token.
    let mut pairs = Vec::new();
    for _ in 0..singles {
        let req = request(prompt_len, 1);
        let before = stats()?;
        let record = send(&req)?;
        let after = stats()?;
        pairs.push((
            record.ttft_s,
            after.step_seconds_total - before.step_seconds_total,
        ));
    }
    // The loop's work per step with one sequence decoding, then with a batch decoding together: a
    // fixed part and a part per sequence.
    let mut points = Vec::new();
    for n in [1, batch.min(config.max_num_seqs)] {
        let reqs: Vec<BenchRequest> = (0..n).map(|_| request(32, output)).collect();
        let before = stats()?;
        let records = runtime.block_on(futures::future::join_all(
            reqs.iter().map(|r| client.send(r, Instant::now())),
        ));
        let after = stats()?;
        ensure!(
            records.iter().all(|r| r.success),
            "a timing request of the batch of {n} failed"
        );
        let host = after
            .host_seconds_per_step(&before)
            .context("the engine ran no step for a timing batch")?;
        // Sequences per step: each sampled one token.
        let seqs = (after.generation_tokens_total - before.generation_tokens_total) as f64
            / (after.steps_total - before.steps_total) as f64;
        points.push((seqs, host));
    }
    server.stop()?;
    let (step_s, step_per_seq_s) = step_overhead(points[0], points[1]);
    Ok(HostOverheads {
        request_s: request_overhead(&pairs),
        step_s,
        step_per_seq_s,
    })
}

/// The line through (sequences per step, host seconds per step) at a small and a large batch: its
/// intercept (the fixed part) and slope (per sequence), neither below zero; one point (batches alike)
/// gives its mean as the fixed part.
fn step_overhead(small: (f64, f64), large: (f64, f64)) -> (f64, f64) {
    if large.0 - small.0 < 0.5 {
        return ((small.1 + large.1) / 2.0, 0.0);
    }
    let slope = ((large.1 - small.1) / (large.0 - small.0)).max(0.0);
    let fixed = (small.1 - slope * small.0).max(0.0);
    (fixed, slope)
}

/// The median of (time to first token − the engine's step seconds) over requests timed alone, never
/// below zero.
fn request_overhead(pairs: &[(f64, f64)]) -> f64 {
    let mut extra: Vec<f64> = pairs.iter().map(|(ttft, engine)| ttft - engine).collect();
    extra.sort_by(f64::total_cmp);
    extra.get(extra.len() / 2).map_or(0.0, |&x| x.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request path is what the client waited beyond the engine's step, by median (one slow
    /// outlier does not move it), and never negative.
    #[test]
    fn the_request_overhead_is_the_median_wait_beyond_the_engine() {
        let pairs = [(0.010, 0.004), (0.011, 0.004), (0.5, 0.004)];
        assert!((request_overhead(&pairs) - 0.007).abs() < 1e-12);
        assert_eq!(request_overhead(&[(0.001, 0.002)]), 0.0);
        assert_eq!(request_overhead(&[]), 0.0);
    }

    /// The per-step overhead is a line through a single sequence's steps and a batch's: 1 ms fixed and
    /// 0.1 ms per sequence from (1, 1.1 ms) and (8, 1.8 ms); never negative; flat batches give a mean.
    #[test]
    fn the_step_overhead_splits_into_fixed_and_per_sequence() {
        let (fixed, per_seq) = step_overhead((1.0, 0.0011), (8.0, 0.0018));
        assert!((fixed - 0.001).abs() < 1e-12 && (per_seq - 0.0001).abs() < 1e-12);
        assert_eq!(step_overhead((1.0, 0.002), (8.0, 0.001)), (0.002, 0.0));
        let (fixed, per_seq) = step_overhead((1.0, 0.0001), (8.0, 0.008));
        assert_eq!(fixed, 0.0);
        assert!(per_seq > 0.0);
        assert_eq!(step_overhead((1.0, 0.001), (1.2, 0.003)), (0.002, 0.0));
    }
}
