//! `tandem profile`: measures what one worker of a model costs on this machine and writes the profile
//! `tandem sim` reads: forward-step times over a grid of batch sizes, batched tokens and contexts (fitted
//! by `tandem_sim::profile::fit_curve`), KV bytes per token, KV transfer rates over loopback TCP and
//! shared memory, control round trips, start-up time, and the host work outside the forward pass (per
//! request and per step, on a live server of the same worker: `host`). `--device cuda` (binaries built
//! with the `cuda` feature) measures the same on the CUDA backend serving runs, built by
//! `crate::device::cuda_backend` under the same `--cuda-*` flags.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use tandem_engine::{Backend, DeviceSampling, EngineConfig, SampledStep};
use tandem_model::{ForwardBatch, KvLayout, LoadOptions, LogitsWanted};
use tandem_sim::profile::{
    fit_curve, Hardware, Measured, Overheads, ProfileModel, StepCurve, TransferRate,
};
use tandem_sim::{Profile, ProfileSource};

use crate::config::Device;
use crate::cuda_settings::CudaSettings;
use crate::process::resolve_model;

mod host;

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
    /// Backend profiled: cpu, or cuda in binaries built with the `cuda` feature (as `serve --device`).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// CUDA backend settings (--device cuda), as `tandem serve` takes them.
    #[command(flatten)]
    pub cuda: CudaSettings,
}

/// Measures and writes the profile.
pub fn run(args: ProfileArgs) -> Result<()> {
    crate::device::check_device_settings(args.device, &args.cuda)?;
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
        // What the CUDA backend sizes its step buffers for (the CPU backend does not read them).
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        ..EngineConfig::default()
    };
    // `export`: the device's KV export rate, on a GPU.
    let (hardware, steps, export) = match args.device {
        Device::Cpu => {
            let mut backend = crate::device::cpu_backend(loaded, &config)?;
            let startup_s = started.elapsed().as_secs_f64();
            let steps = measure_steps(&mut backend, args, startup_s)?;
            let hardware = Hardware {
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
            };
            (hardware, steps, None)
        }
        Device::Cuda => {
            let (hardware, steps, export) = cuda_measure(loaded, &config, args, started)?;
            (hardware, steps, Some(export))
        }
    };
    let rtt = loopback_round_trip()?;
    // After the step timings, whose backend is gone by now (a GPU holds one model at a time).
    let host = host::measure(&path, &config, args)
        .inspect(|h| {
            eprintln!(
                "host work: {:.3} ms per request; per step outside the forward pass, {:.3} ms and {:.4} ms per sequence",
                h.request_s * 1e3,
                h.step_s * 1e3,
                h.step_per_seq_s * 1e3
            )
        })
        // The step timings are still worth writing; the profile then has no host work but a round trip.
        .unwrap_or_else(|e| {
            tracing::warn!(error = %format!("{e:#}"), "host work not measured; the profile's overheads are a loopback round trip");
            host::HostOverheads {
                request_s: rtt,
                step_s: 0.0,
                step_per_seq_s: 0.0,
            }
        });
    let overheads = Overheads {
        request_s: host.request_s,
        rpc_s: rtt,
        step_s: host.step_s,
        step_per_seq_s: host.step_per_seq_s,
    };
    // A KV pull between two GPU workers leaves the GPU through host memory (device to host on the
    // prefill side, the wire, host to device on the decode side), one copy after the other for each
    // layer, so on a GPU each transport's rate is the host's (loopback TCP; a memory copy for shm) in
    // series with the device's KV export, counted twice (the import taken to run at the export's
    // rate). On one host the wire is the slower part; the device copies matter most for shm.
    let on_device = |wire: f64| match export {
        Some(export) => 1.0 / (1.0 / wire + 2.0 / export),
        None => wire,
    };
    let transfer = vec![
        TransferRate {
            transport: "tcp".into(),
            bytes_per_s: on_device(tcp_rate()?),
            latency_s: rtt,
        },
        TransferRate {
            transport: "shm".into(),
            bytes_per_s: on_device(memcpy_rate()),
            latency_s: rtt,
        },
    ];
    let Steps {
        layout,
        decode,
        prefill,
        startup_s,
    } = steps;
    let profile = Profile {
        source: ProfileSource::Measured,
        created_at: Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        hardware,
        model,
        block_size: layout.block_size,
        kv_blocks: layout.num_blocks,
        kv_bytes_per_token: layout.bytes_per_token() as f64,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        decode,
        prefill,
        transfer,
        overheads,
        startup_s,
        parallelism: None,
        layouts: Vec::new(),
        scaling: None,
    };
    profile.check()?;
    Ok(profile)
}

/// What [`measure_steps`] finds: the backend's KV layout, its fitted step curves, and start-up time.
struct Steps {
    layout: KvLayout,
    decode: StepCurve,
    prefill: StepCurve,
    startup_s: f64,
}

/// The profile's hardware and steps on the CUDA backend serving runs (`crate::device::cuda_backend`,
/// on `cuda.device`), and the device's KV export rate in bytes per second (see `measure` for how the
/// transfer rates use it).
#[cfg(feature = "cuda")]
fn cuda_measure(
    loaded: tandem_model::LoadedModel,
    config: &EngineConfig,
    args: &ProfileArgs,
    started: Instant,
) -> Result<(Hardware, Steps, f64)> {
    let mut backend = crate::device::cuda_backend(loaded, config, &args.cuda)?;
    let name = backend.model_mut().device_name().to_string();
    let startup_s = started.elapsed().as_secs_f64();
    let steps = measure_steps(&mut backend, args, startup_s)?;
    // A failed export measurement leaves the host's rates alone (an infinite export rate) rather
    // than losing the step timings.
    let export = export_rate(&mut backend).unwrap_or_else(|e| {
        tracing::warn!(error = %format!("{e:#}"), "KV export not measured; transfer rates are the host's");
        f64::INFINITY
    });
    let hardware = Hardware {
        name,
        device: "cuda".into(),
        threads: 0,
        devices_per_worker: 1,
    };
    Ok((hardware, steps, export))
}

#[cfg(not(feature = "cuda"))]
fn cuda_measure(
    _loaded: tandem_model::LoadedModel,
    _config: &EngineConfig,
    _args: &ProfileArgs,
    _started: Instant,
) -> Result<(Hardware, Steps, f64)> {
    anyhow::bail!(crate::device::NO_CUDA)
}

/// Bytes per second of the backend's KV export (`Backend::export_kv` until every layer has landed)
/// of up to 64 MiB of blocks the step timings wrote: device to host on a GPU. The median of three.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn export_rate<B: Backend>(backend: &mut B) -> Result<f64> {
    let layout = backend.kv_layout();
    let block_bytes = layout.block_bytes() * layout.n_layers;
    let n = ((64usize << 20) / block_bytes.max(1)).clamp(1, layout.num_blocks);
    let blocks: Vec<u32> = (0..n as u32).collect();
    let mut rates = Vec::new();
    for pass in 0..4 {
        let t = Instant::now();
        let export = backend.export_kv(&blocks)?;
        for layer in 0..export.num_layers() {
            export.wait_layer(layer)?;
        }
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        if pass > 0 {
            rates.push((n * block_bytes) as f64 / secs);
        }
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// Times the grid of steps on `backend` and fits its curves.
fn measure_steps<B: Backend>(backend: &mut B, args: &ProfileArgs, startup_s: f64) -> Result<Steps> {
    let layout = backend.kv_layout();
    let mut timer = StepTimer {
        backend,
        rng: rand_chacha::ChaCha8Rng::seed_from_u64(0),
        capacity: layout.num_blocks * layout.block_size,
        block_size: layout.block_size,
        rows: Vec::new(),
        tokens: Vec::new(),
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
    // Points past the model's context (a short-context model) are left out, as the cache would be.
    let max_len = timer.backend.info().max_len;
    grid.retain(|(.., chunks)| {
        timer.fits(chunks) && chunks.iter().all(|&(n, pos)| pos + n <= max_len)
    });
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
    Ok(Steps {
        layout,
        decode: fit_curve(&decode),
        prefill: fit_curve(&prefill),
        startup_s,
    })
}

/// One step of the grid: whether it decodes, its x, its context, its chunks of (tokens, position).
type GridPoint = (bool, f64, f64, Vec<(usize, usize)>);

/// Times forward steps of made-up batches on the backend's own KV cache.
struct StepTimer<'a, B: Backend> {
    backend: &'a mut B,
    rng: rand_chacha::ChaCha8Rng,
    capacity: usize,
    block_size: usize,
    /// Greedy draws, one per sequence, for backends that sample where the logits are.
    rows: Vec<DeviceSampling>,
    /// The drawn tokens.
    tokens: Vec<u32>,
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
        // A step as the engine runs it: drawn where the logits are when the backend can (the CUDA
        // backend's sampler, and its graphs for decode steps), else `forward` with the logits on the
        // host (the CPU backend declines before doing anything).
        self.rows.clear();
        self.rows.resize(
            chunks.len(),
            DeviceSampling {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            },
        );
        let t = Instant::now();
        let sampled = self.backend.forward_sampled(SampledStep {
            batch: &batch,
            rows: &self.rows,
            masks: None,
            out: &mut self.tokens,
        })?;
        if !sampled {
            let mut logits = Vec::new();
            self.backend.forward(&batch, &mut logits)?;
        }
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(extra: &[&str]) -> ProfileArgs {
        let args = ["tandem", "profile", "m.gguf"].iter().chain(extra);
        match crate::Cli::try_parse_from(args).expect("parses").command {
            crate::Command::Profile(args) => args,
            other => panic!("expected profile, got {other:?}"),
        }
    }

    /// `--device` defaults to the CPU; `--device cuda` takes the `--cuda-*` flags `tandem serve` takes.
    #[test]
    fn profile_takes_the_device_and_the_cuda_flags() {
        let cpu = parse(&[]);
        assert_eq!(cpu.device, Device::Cpu);
        assert_eq!(cpu.cuda, CudaSettings::default());
        let gpu = parse(&[
            "--device",
            "cuda",
            "--cuda-device",
            "1",
            "--quantization",
            "fp8",
            "--no-cuda-graphs",
            "--kv-cache-mib",
            "4096",
        ]);
        assert_eq!(gpu.device, Device::Cuda);
        assert_eq!(gpu.cuda.device, Some(1));
        assert_eq!(
            gpu.cuda.quantization,
            Some(crate::cuda_settings::Quantization::Fp8)
        );
        assert_eq!(gpu.cuda.graphs, Some(false));
        assert_eq!(gpu.kv_cache_mib, 4096);
        assert!(crate::Cli::try_parse_from(["tandem", "profile", "--device", "tpu"]).is_err());
    }

    /// A CPU profile refuses the GPU-only `--quantization` and `--kv-cache-dtype` before loading anything.
    #[test]
    fn cpu_profile_refuses_gpu_quantization() {
        let e = run(parse(&["--quantization", "fp8"])).expect_err("refused");
        assert!(e.to_string().contains("--quantization"), "{e}");
        let e = run(parse(&["--kv-cache-dtype", "fp8"])).expect_err("refused");
        assert!(e.to_string().contains("--kv-cache-dtype"), "{e}");
    }

    /// A binary without the `cuda` feature refuses `--device cuda` before loading the model (m.gguf
    /// does not exist: the refusal is what fails).
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn profile_without_the_cuda_feature_refuses_cuda() {
        let e = run(parse(&["--device", "cuda"])).expect_err("refused");
        assert_eq!(e.to_string(), crate::device::NO_CUDA);
    }

    /// A binary with the `cuda` feature gets past the device check with `--device cuda` (to the model,
    /// which does not exist here).
    #[cfg(feature = "cuda")]
    #[test]
    fn profile_with_the_cuda_feature_takes_cuda() {
        let e = run(parse(&["--device", "cuda"])).expect_err("no such model");
        assert_ne!(e.to_string(), crate::device::NO_CUDA);
        assert!(format!("{e:#}").contains("m.gguf"), "{e:#}");
    }
}
