//! `tandem bench-engine`: the engine's own speed on one model, without HTTP in the way.
//!
//! Prints single-stream decode, 512-token prefill and 16-way aggregate decode throughput, the three figures
//! the engine issue sets targets for; `scripts/peers/bench-engine-vs-llamacpp.sh` runs llama.cpp beside it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_engine::bench::{run_engine_bench, BenchOptions};
use tandem_engine::{Engine, EngineConfig};
use tandem_model::LoadOptions;

use crate::process::resolve_model;

/// Options of `tandem bench-engine`.
#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    /// GGUF file or HF folder; absent means the default model.
    pub model: Option<PathBuf>,
    /// Worker threads of the kernels (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tensor-parallel ranks (threads of this process) the model is split over.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Tokens decoded by the single stream.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_len: usize,
    /// Concurrent sequences of the aggregate decode measurement.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Tokens each concurrent sequence decodes.
    #[arg(long, default_value_t = 64)]
    pub concurrent_tokens: usize,
    /// Print the report as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Loads the model, starts an engine and prints the measured figures.
pub fn run(args: BenchEngineArgs) -> Result<()> {
    let path = resolve_model(args.model.as_deref())?;
    let loaded = tandem_model::load(
        &path,
        &LoadOptions {
            progress: !args.json,
        },
    )
    .with_context(|| format!("loading {}", path.display()))?;
    let config = EngineConfig {
        threads: args.threads,
        tensor_parallel_size: args.tensor_parallel_size,
        max_num_batched_tokens: args.prefill_len.max(512),
        ..EngineConfig::default()
    };
    let backend = crate::device::cpu_backend(loaded, &config)?;
    let engine = Engine::start(backend, config).context("starting the engine")?;
    let options = BenchOptions {
        decode_tokens: args.decode_tokens,
        prefill_len: args.prefill_len,
        concurrency: args.concurrency,
        concurrent_tokens: args.concurrent_tokens,
        ..BenchOptions::default()
    };
    let report = run_engine_bench(&engine, &options).context("running the benchmark")?;
    engine.shutdown();
    // Which kernels ran: figures from an AVX2 and an AVX-512 machine are not comparable.
    let kernels = format!("{:?}", tandem_kernels::isa());
    if args.json {
        let mut json = serde_json::to_value(&report)?;
        json["kernels"] = kernels.into();
        println!("{json}");
    } else {
        println!("model                         {}", path.display());
        println!("kernels                       {kernels}");
        println!(
            "single-stream decode          {:8.1} tok/s",
            report.single_stream_decode_tok_s
        );
        println!(
            "prefill ({:4} tokens)         {:8.1} tok/s",
            options.prefill_len, report.prefill_tok_s
        );
        println!(
            "aggregate decode ({:2} seqs)    {:8.1} tok/s",
            options.concurrency, report.concurrent_decode_tok_s
        );
    }
    Ok(())
}
