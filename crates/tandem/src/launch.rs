//! `tandem serve` with `deployment.mode: pd`: starts the prefill and decode workers as child processes
//! of this one, then serves the OpenAI API here as the ingress, routing through them.
//!
//! Children learn they are orphaned through their stdin (a pipe from this process): when it closes
//! they exit, so no worker outlives a killed launcher.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tandem_api::{ApiConfig, AppState, ModelCodec};
use tandem_cluster::{Ingress, Role};
use tandem_model::LoadOptions;
use tracing::info;

use crate::config::{DeploymentSection, EngineSection, FileConfig, RoleSection, ServeArgs};
use crate::cuda_settings::CudaSection;
use crate::worker::READY_PREFIX;

/// Worker processes that are killed when this value is dropped (normal exit, error or panic).
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (name, child) in &mut self.0 {
            if let Err(e) = child.kill() {
                tracing::debug!(worker = %name, error = %e, "worker already gone");
            }
            let _ = child.wait();
        }
    }
}

/// Appends the `tandem worker` flags for every engine knob set in `section`.
fn engine_flags(section: &EngineSection, out: &mut Vec<String>) {
    let mut flag = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            out.push(format!("--{name}"));
            out.push(v);
        }
    };
    flag("block-size", section.block_size.map(|v| v.to_string()));
    flag(
        "kv-cache-memory",
        section.kv_cache_memory.map(|v| v.0.to_string()),
    );
    flag("max-num-seqs", section.max_num_seqs.map(|v| v.to_string()));
    flag(
        "max-num-batched-tokens",
        section.max_num_batched_tokens.map(|v| v.to_string()),
    );
    flag(
        "max-model-len",
        section.max_model_len.map(|v| v.to_string()),
    );
    flag("max-waiting", section.max_waiting.map(|v| v.to_string()));
    flag("threads", section.threads.map(|v| v.to_string()));
    flag(
        "tensor-parallel-size",
        section.tensor_parallel_size.map(|v| v.to_string()),
    );
    flag(
        "pipeline-parallel-size",
        section.pipeline_parallel_size.map(|v| v.to_string()),
    );
    flag(
        "pipeline-micro-batches",
        section.pipeline_micro_batches.map(|v| v.to_string()),
    );
    flag(
        "pipeline-stages",
        section.pipeline_stages.as_ref().map(|v| v.join(",")),
    );
    flag("device", section.device.map(|v| v.to_string()));
    if section.enable_chunked_prefill == Some(false) {
        out.push("--no-chunked-prefill".into());
    }
    if section.enable_prefix_caching == Some(false) {
        out.push("--no-prefix-caching".into());
    }
}

/// Later sections win: the file's `engine:`, the role's `engine:`, then the command-line flags.
fn merge(layers: &[&EngineSection]) -> EngineSection {
    let mut m = EngineSection::default();
    for l in layers {
        macro_rules! take {
            ($($f:ident),*) => { $( if l.$f.is_some() { m.$f = l.$f; } )* };
        }
        take!(
            block_size,
            kv_cache_memory,
            max_num_seqs,
            max_num_batched_tokens,
            enable_chunked_prefill,
            enable_prefix_caching,
            max_model_len,
            max_waiting,
            threads,
            tensor_parallel_size,
            pipeline_parallel_size,
            pipeline_micro_batches,
            device
        );
        if l.pipeline_stages.is_some() {
            m.pipeline_stages = l.pipeline_stages.clone();
        }
    }
    m
}

/// The engine flags given on the `tandem serve` command line, which apply to every worker.
fn cli_engine(args: &ServeArgs) -> EngineSection {
    args.engine.as_section()
}

/// Reads a child's stdout on a thread of its own: the text after `prefix` on its ready line goes to the
/// returned receiver (the address it serves on), every other line is echoed tagged with `name`.
pub(crate) fn watch_ready(
    stdout: std::process::ChildStdout,
    name: &str,
    prefix: &'static str,
) -> std::io::Result<mpsc::Receiver<String>> {
    let (tx, rx) = mpsc::channel();
    let tag = name.to_owned();
    std::thread::Builder::new()
        .name(format!("{name}-stdout"))
        .spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match line.strip_prefix(prefix) {
                    Some(addr) => {
                        let _ = tx.send(addr.trim().to_owned());
                    }
                    None => println!("[{tag}] {line}"),
                }
            }
        })?;
    Ok(rx)
}

/// Starts one worker and returns it with a receiver for its RPC URL (sent once it serves).
fn spawn_worker(
    exe: &Path,
    model: &Path,
    role: Role,
    index: usize,
    engine: &EngineSection,
    dep: &DeploymentSection,
    cuda: &CudaSection,
) -> Result<(String, Child, mpsc::Receiver<String>)> {
    let name = format!("{role}-{index}");
    let kv = dep.kv_transfer.clone().unwrap_or_default();
    let mut cmd_args: Vec<String> = vec![
        "worker".into(),
        "--role".into(),
        role.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--worker-id".into(),
        name.clone(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        "0".into(),
        "--transport".into(),
        match kv.transport {
            tandem_cluster::TransportKind::Tcp => "tcp".into(),
            tandem_cluster::TransportKind::Shm => "shm".into(),
        },
        "--kv-streams".into(),
        kv.streams.to_string(),
        "--pin-timeout".into(),
        kv.pin_timeout_secs.to_string(),
        "--exit-with-stdin".into(),
    ];
    engine_flags(engine, &mut cmd_args);
    cuda.push_flags(&mut cmd_args);
    let mut child = Command::new(exe)
        .args(&cmd_args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting worker {name}"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("worker {name} has no stdout"))?;
    let rx = watch_ready(stdout, &name, READY_PREFIX)?;
    info!(worker = %name, pid = child.id(), "worker started");
    Ok((name, child, rx))
}

/// Runs the disaggregated deployment described by `file` (whose `deployment.mode` is `pd`).
pub fn run(args: &ServeArgs, file: FileConfig) -> Result<()> {
    let dep = file.deployment.clone().unwrap_or_default();
    let model_path = crate::serve::resolve_model(args.model.as_deref().or(file.model.as_deref()))?;
    let model_path: PathBuf = std::fs::canonicalize(&model_path).unwrap_or(model_path);
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let cli = cli_engine(args);
    let cuda = file.cuda.merged(&args.cuda.as_section());

    let mut children = Children(Vec::new());
    let mut pending = Vec::new();
    for (role, section) in [(Role::Prefill, &dep.prefill), (Role::Decode, &dep.decode)] {
        let default = RoleSection::default();
        let section = section.as_ref().unwrap_or(&default);
        let replicas = section.replicas.unwrap_or(1);
        if role == Role::Decode && replicas == 0 {
            bail!("deployment.decode.replicas must be at least 1");
        }
        let engine = merge(&[
            &file.engine,
            section.engine.as_ref().unwrap_or(&EngineSection::default()),
            &cli,
        ]);
        for i in 0..replicas {
            let (name, child, rx) = spawn_worker(&exe, &model_path, role, i, &engine, &dep, &cuda)?;
            children.0.push((name.clone(), child));
            pending.push((name, rx));
        }
    }

    // Load the tokenizer and template here while the workers load their engines.
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let template = match args.chat_template.as_ref().or(file.chat_template.as_ref()) {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading chat template {}", path.display()))?,
        ),
        None => loaded.chat_template.clone(),
    };
    let codec =
        ModelCodec::new(loaded.tokenizer.clone(), template.as_deref()).context("chat template")?;
    let served_name = args
        .served_model_name
        .clone()
        .or(file.served_model_name.clone())
        .unwrap_or_else(|| loaded.name.clone());

    let timeouts = dep.timeouts.clone().unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs_f64(timeouts.worker_startup_secs.max(1.0));
    let mut urls = Vec::new();
    for (name, rx) in &pending {
        let wait = deadline.saturating_duration_since(Instant::now());
        let url = rx
            .recv_timeout(wait)
            .map_err(|_| anyhow!("worker {name} did not start (see its log above)"))?;
        info!(worker = %name, %url, "worker ready");
        urls.push(url);
    }

    let ingress = Ingress::new(
        dep.routing.clone().unwrap_or_default(),
        timeouts,
        Some(loaded.identity.0.clone()),
    )?;
    let config = ApiConfig {
        served_model_names: vec![served_name.clone()],
        model_root: loaded.name.clone(),
        api_key: args.api_key.clone().or(file.server.api_key.clone()),
        system_fingerprint: format!(
            "fp_{}",
            loaded.identity.0.chars().take(16).collect::<String>()
        ),
    };
    let state = Arc::new(AppState::new(
        Arc::new(ingress.clone()),
        Arc::new(codec),
        config,
    )?);
    let host = args
        .host
        .clone()
        .or(file.server.host.clone())
        .unwrap_or_else(|| "127.0.0.1".to_owned());
    let port = args.port.or(file.server.port).unwrap_or(8000);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("tandem-ingress")
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let result = runtime.block_on(async {
        for url in &urls {
            ingress.register_when_up(url).await.with_context(|| format!("registering worker {url}"))?;
        }
        ingress.poll_once().await;
        tokio::spawn(ingress.clone().poll_forever());
        let listener = tokio::net::TcpListener::bind((host.as_str(), port))
            .await
            .with_context(|| format!("binding {host}:{port}"))?;
        info!(address = %listener.local_addr()?, model = %served_name, workers = urls.len(), "serving the OpenAI API (prefill/decode disaggregated)");
        let app = tandem_api::router(state).merge(ingress.routes());
        axum::serve(listener, app).with_graceful_shutdown(crate::serve::shutdown_signal()).await.context("HTTP server")
    });
    drop(children);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;

    #[test]
    fn later_engine_sections_win_and_become_flags() {
        let file = EngineSection {
            block_size: Some(16),
            threads: Some(2),
            ..EngineSection::default()
        };
        let role = EngineSection {
            threads: Some(1),
            tensor_parallel_size: Some(2),
            enable_prefix_caching: Some(false),
            ..EngineSection::default()
        };
        let cli = EngineSection {
            kv_cache_memory: Some(ByteSize(64 << 20)),
            ..EngineSection::default()
        };
        let m = merge(&[&file, &role, &cli]);
        let mut flags = Vec::new();
        engine_flags(&m, &mut flags);
        assert_eq!(
            flags,
            [
                "--block-size",
                "16",
                "--kv-cache-memory",
                "67108864",
                "--threads",
                "1",
                "--tensor-parallel-size",
                "2",
                "--no-prefix-caching"
            ]
        );
    }

    #[test]
    fn pipeline_settings_travel_from_yaml_to_worker_flags() {
        let role: EngineSection = serde_yaml::from_str(
            "{pipeline_parallel_size: 3, pipeline_micro_batches: 4, pipeline_stages: ['10.0.0.2:7000', '10.0.0.3:7000']}",
        )
        .unwrap();
        let m = merge(&[&EngineSection::default(), &role]);
        let mut flags = vec!["worker".to_string()];
        engine_flags(&m, &mut flags);
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            engine: crate::config::EngineArgs,
        }
        let c = <Flags as clap::Parser>::try_parse_from(&flags)
            .unwrap()
            .engine
            .engine_config();
        assert_eq!(c.pipeline_parallel_size, 3);
        assert_eq!(c.pipeline_micro_batches, 4);
        assert_eq!(c.pipeline_stages, ["10.0.0.2:7000", "10.0.0.3:7000"]);
    }
}
