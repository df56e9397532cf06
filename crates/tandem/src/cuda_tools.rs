//! Hidden subcommands of CUDA builds that run on the GPU machine: `cuda-check` writes logits of given
//! prompts for comparison with HF transformers, `cuda-bench` measures an 8B-shaped model with random
//! weights generated on the GPU, `cuda-sample-check` checks the on-device sampler's distribution.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use tandem_cuda::tools::{run_bench, run_check, run_sample_check, BenchArgs, CheckArgs};

/// Options of `tandem cuda-check`.
#[derive(Args, Debug)]
pub struct CudaCheckArgs {
    /// HF folder (or GGUF file).
    pub model: PathBuf,
    /// JSON list of prompts, each a list of token ids.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Greedy decode steps after the prompts.
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Output JSON file.
    #[arg(long)]
    pub out: PathBuf,
    /// Run the CPU backend instead (same output), for CPU/CUDA agreement.
    #[arg(long)]
    pub cpu: bool,
}

/// Options of `tandem cuda-bench`.
#[derive(Args, Debug)]
pub struct CudaBenchArgs {
    /// Cached tokens per sequence during decode.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Decode batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    pub batches: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Prompt lengths of the prefill measurements, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    pub prefill: Vec<usize>,
    /// Layers of the model (32 for the 8B shape; fewer for a quick run).
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// Copy bandwidth MBU is measured against, GB/s.
    #[arg(long, default_value_t = 4300.0)]
    pub peak_gbps: f64,
    /// JSON-lines output file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Runs `cuda-check`.
pub fn check(args: CudaCheckArgs) -> Result<()> {
    run_check(&CheckArgs {
        model: args.model,
        prompts: args.prompts,
        decode_steps: args.decode_steps,
        out: args.out,
        cpu: args.cpu,
    })?;
    Ok(())
}

/// Options of `tandem cuda-sample-check`.
#[derive(Args, Debug)]
pub struct CudaSampleCheckArgs {
    /// Rounds of 256 draws per filter setting.
    #[arg(long, default_value_t = 80)]
    pub rounds: usize,
    /// Output JSON file.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs `cuda-sample-check`.
pub fn sample_check(args: CudaSampleCheckArgs) -> Result<()> {
    run_sample_check(&args.out, args.rounds)?;
    Ok(())
}

/// Runs `cuda-bench`.
pub fn bench(args: CudaBenchArgs) -> Result<()> {
    let mut config = BenchArgs::llama3_8b_config();
    config.num_layers = args.layers;
    run_bench(&BenchArgs {
        config,
        context: args.context,
        batches: args.batches,
        steps: args.steps,
        prefill: args.prefill,
        peak_bandwidth: args.peak_gbps * 1e9,
        out: args.out,
    })?;
    Ok(())
}
