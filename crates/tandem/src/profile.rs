//! `tandem profile`: measures what one worker of a model costs on this machine and writes the profile
//! `tandem sim` reads: forward-step times over a grid of batch sizes, batched tokens and contexts (fitted
//! by `tandem_sim::profile::fit_curve`), KV bytes per token, KV transfer rates over loopback TCP and
//! shared memory, control round trips, and start-up time.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use tandem_engine::{Backend, EngineConfig};
use tandem_model::{ForwardBatch, LoadOptions, LogitsWanted};
use tandem_sim::profile::{
    fit_curve, Hardware, Measured, Overheads, ProfileModel, StepCurve, TransferRate,
};
use tandem_sim::{Profile, ProfileSource};

use crate::process::resolve_model;

/// Options of `tandem profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// GGUF file or HF folder; absent means the default model.
    pub model: Option<PathBuf>,
    /// Where to write the profile (.json, or .yaml/.yml for YAML).
    #[arg(long, short, default_value = "profile.json")]
    pub output: PathBuf,
    /// Compute threads of the worker profiled (0 = all cores), as the served workers' `engine.threads`.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tokens per KV block (`engine.block_size`).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache of one worker in MiB (`engine.kv_cache_memory`).
    #[arg(long, default_value_t = 1024)]
    pub kv_cache_mib: usize,
    /// `engine.max_num_seqs` of the workers simulated.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// `engine.max_num_batched_tokens` of the workers simulated.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Timed passes over the grid (each point's median counts), after one warm-up pass.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// A smaller grid (for tests and quick looks).
    #[arg(long)]
    pub quick: bool,
}

/// Measures and writes the profile.
pub fn run(args: ProfileArgs) -> Result<()> {
    let profile = measure(&args)?;
    profile.save(&args.output)?;
    eprintln!(
        "profile of {} on {} written to {}",
        profile.model.name,
        profile.hardware.name,
        args.output.display()
    );
    Ok(())
}

fn measure(args: &ProfileArgs) -> Result<Profile> {
    let path = resolve_model(args.model.as_deref())?;
    let started = Instant::now();
    let loaded = tandem_model::load(&path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", path.display()))?;
    let model = ProfileModel {
        name: loaded.name.clone(),
        identity: Some(loaded.identity.0.clone()),
    };
    let config = EngineConfig {
        threads: args.threads,
        block_size: args.block_size,
        kv_cache_memory: args.kv_cache_mib << 20,
        ..EngineConfig::default()
    };
    let mut backend = crate::device::cpu_backend(loaded, &config)?;
    let startup_s = started.elapsed().as_secs_f64();
    let layout = backend.kv_layout();
    let mut timer = StepTimer {
        backend: &mut backend,
        rng: rand_chacha::ChaCha8Rng::seed_from_u64(0),
        capacity: layout.num_blocks * layout.block_size,
        block_size: layout.block_size,
    };

    let mut grid: Vec<GridPoint> = Vec::new();
    let (batches, contexts): (&[usize], &[usize]) = if args.quick {
        (&[1, 4, 16], &[32, 256])
    } else {
        (&[1, 2, 4, 8, 16, 32, 64], &[32, 256, 512])
    };
    for &b in batches.iter().filter(|&&b| b <= args.max_num_seqs) {
        for &c in contexts {
            grid.push((true, b as f64, (b * c) as f64, vec![(1, c); b]));
        }
    }
    let (lens, positions): (&[usize], &[usize]) = if args.quick {
        (&[16, 64, 256], &[0, 512])
    } else {
        (&[16, 32, 64, 128, 256, 512], &[0, 512, 1024])
    };
    for &n in lens
        .iter()
        .filter(|&&n| n <= args.max_num_batched_tokens.max(16))
    {
        for &pos in positions {
            grid.push((false, n as f64, (n * pos) as f64, vec![(n, pos)]));
        }
    }
    grid.retain(|(.., chunks)| timer.fits(chunks));
    // Passes over the whole grid rather than repeats of one point: on a shared machine the load
    // changes over seconds, and every point should see the same mix of it.
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); grid.len()];
    for pass in 0..=args.repeats.max(1) {
        for (i, (.., chunks)) in grid.iter().enumerate() {
            let t = timer.time(chunks)?;
            // The first pass warms up (page faults, grow-only scratch) and is not counted.
            if pass > 0 {
                times[i].push(t);
            }
        }
    }
    let (mut decode, mut prefill) = (Vec::new(), Vec::new());
    for ((is_decode, x, context, _), mut t) in grid.into_iter().zip(times) {
        t.sort_by(f64::total_cmp);
        let m = Measured {
            x,
            context,
            seconds: t[t.len() / 2],
        };
        if is_decode {
            decode.push(m);
        } else {
            prefill.push(m);
        }
    }
    anyhow::ensure!(
        !decode.is_empty() && !prefill.is_empty(),
        "the KV cache ({} MiB) is too small for the profile's grid",
        args.kv_cache_mib
    );
    let curve = |samples: &[Measured]| -> StepCurve { fit_curve(samples) };
    let rtt = loopback_round_trip()?;
    let profile = Profile {
        source: ProfileSource::Measured,
        created_at: Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        hardware: Hardware {
            name: tandem_bench::report::Machine::current()
                .cpu_model
                .unwrap_or_else(|| "unknown CPU".into()),
            device: "cpu".into(),
            threads: if args.threads == 0 {
                std::thread::available_parallelism().map_or(1, |n| n.get())
            } else {
                args.threads
            },
            devices_per_worker: 1,
        },
        model,
        block_size: layout.block_size,
        kv_blocks: layout.num_blocks,
        kv_bytes_per_token: layout.bytes_per_token() as f64,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        decode: curve(&decode),
        prefill: curve(&prefill),
        transfer: vec![
            TransferRate {
                transport: "tcp".into(),
                bytes_per_s: tcp_rate()?,
                latency_s: rtt,
            },
            TransferRate {
                transport: "shm".into(),
                bytes_per_s: memcpy_rate(),
                latency_s: rtt,
            },
        ],
        overheads: Overheads {
            request_s: rtt,
            rpc_s: rtt,
        },
        startup_s,
        parallelism: None,
        layouts: Vec::new(),
        scaling: None,
    };
    profile.check()?;
    Ok(profile)
}

/// One step of the grid: whether it decodes, its x, its context, its chunks of (tokens, position).
type GridPoint = (bool, f64, f64, Vec<(usize, usize)>);

/// Times forward steps of made-up batches on the backend's own KV cache.
struct StepTimer<'a, B: Backend> {
    backend: &'a mut B,
    rng: rand_chacha::ChaCha8Rng,
    capacity: usize,
    block_size: usize,
}

impl<B: Backend> StepTimer<'_, B> {
    /// Whether the cache holds a batch of `(tokens, position)` per sequence.
    fn fits(&self, chunks: &[(usize, usize)]) -> bool {
        let blocks: usize = chunks
            .iter()
            .map(|&(n, pos)| (pos + n).div_ceil(self.block_size))
            .sum();
        blocks * self.block_size <= self.capacity
    }

    /// Seconds of one step running `(tokens, position)` per sequence (which must fit).
    fn time(&mut self, chunks: &[(usize, usize)]) -> Result<f64> {
        let vocab = self.backend.vocab_size() as u32;
        let mut batch = ForwardBatch::default();
        let mut next_block = 0u32;
        for &(n, pos) in chunks {
            let blocks = (pos + n).div_ceil(self.block_size) as u32;
            let tokens: Vec<u32> = (0..n).map(|_| self.rng.random_range(256..vocab)).collect();
            batch.push(
                &tokens,
                pos,
                (next_block..next_block + blocks).collect(),
                LogitsWanted::Last,
            );
            next_block += blocks;
        }
        let mut logits = Vec::new();
        let t = Instant::now();
        self.backend.forward(&batch, &mut logits)?;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Mean seconds of a one-byte round trip over loopback TCP (a connection's fixed cost per message).
fn loopback_round_trip() -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    const TRIPS: usize = 200;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        for _ in 0..TRIPS {
            s.read_exact(&mut b)?;
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut b = [7u8; 1];
    let start = Instant::now();
    for _ in 0..TRIPS {
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
    }
    let rtt = start.elapsed().as_secs_f64() / TRIPS as f64;
    echo.join().expect("the echo thread does not panic")?;
    Ok(rtt)
}

/// Bytes per second of one stream over loopback TCP.
fn tcp_rate() -> Result<f64> {
    const TOTAL: usize = 64 << 20;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let sink = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = TOTAL;
        while left > 0 {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        s.write_all(&[1])?;
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    let chunk = vec![3u8; 1 << 20];
    let start = Instant::now();
    for _ in 0..TOTAL / chunk.len() {
        s.write_all(&chunk)?;
    }
    let mut done = [0u8; 1];
    s.read_exact(&mut done)?;
    let secs = start.elapsed().as_secs_f64();
    sink.join().expect("the sink thread does not panic")?;
    Ok(TOTAL as f64 / secs)
}

/// Bytes per second of copying within memory (what a shared-memory pull costs at best).
fn memcpy_rate() -> f64 {
    const TOTAL: usize = 64 << 20;
    let src = vec![5u8; TOTAL];
    let mut dst = vec![0u8; TOTAL];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    dst.copy_from_slice(&src);
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    std::hint::black_box(&dst);
    TOTAL as f64 / secs
}
