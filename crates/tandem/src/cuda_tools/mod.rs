//! Hidden subcommands of CUDA builds that run on the GPU machine: `cuda-check` writes logits of given
//! prompts for comparison with HF transformers, `cuda-bench` measures an 8B-shaped model with random
//! weights generated on the GPU, `cuda-sample-check` checks the on-device sampler's distribution.

mod bench;
mod check;
mod sample;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;

pub use bench::CudaBenchArgs;
pub use check::CudaCheckArgs;

/// An I/O error with the path it happened on.
fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> anyhow::Error + '_ {
    move |source| anyhow::Error::new(source).context(path.display().to_string())
}

/// Runs `cuda-check`.
pub fn check(args: CudaCheckArgs) -> Result<()> {
    check::run(&args)
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
    sample::run(&args.out, args.rounds)
}

/// Runs `cuda-bench`.
pub fn bench(args: CudaBenchArgs) -> Result<()> {
    bench::run(args)
}
