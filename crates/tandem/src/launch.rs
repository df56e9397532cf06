//! `tandem serve` with `deployment.mode: pd`: starts the prefill and decode workers as child processes
//! of this one, then serves the OpenAI API here as the ingress, routing through them.
//!
//! Each worker gets its resolved settings as one JSON document (`tandem worker --settings-json`); it
//! exits when this process goes (`crate::process`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tandem_api::{ApiConfig, AppState};
use tandem_cluster::{DiscoveryMode, DnsResolver, Ingress, Role};
use tandem_model::LoadOptions;
use tracing::{info, warn};

use crate::config::{
    overlay, DeploymentSettings, Device, EngineSettings, ListenSettings, RoleSettings, Settings,
};
use crate::cuda_settings::CudaSettings;
use crate::process::{resolve_model, shutdown_signal, Children, WORKER_READY_PREFIX};
use crate::worker::WorkerSettings;

/// The settings of worker `index` of `role`: its engine knobs are the file's `engine:`, then the role's
/// `engine:`, then the command-line flags (later ones win); KV transfer is the deployment's.
fn worker_settings(
    model: &Path,
    role: Role,
    index: usize,
    engine: EngineSettings,
    dep: &DeploymentSettings,
) -> WorkerSettings {
    WorkerSettings {
        role: Some(role),
        model: Some(model.to_path_buf()),
        worker_id: Some(format!("{role}-{index}")),
        host: "127.0.0.1".into(),
        port: 0,
        advertise_host: None,
        kv_port: 0,
        register: None,
        cluster_token_file: None,
        allow_unauthenticated: dep.allow_unauthenticated,
        drain_grace_secs: crate::worker::DEFAULT_DRAIN_GRACE_SECS,
        metrics_need_token: false,
        listen: ListenSettings::default(),
        kv_transfer: dep.kv_transfer.clone().unwrap_or_default(),
        engine,
        cuda: CudaSettings::default(),
    }
}

/// GPU ordinals for a role whose workers run on the CPU are a mistake to say, not to ignore.
fn check_placement(role: Role, section: &RoleSettings, engine: &EngineSettings) -> Result<()> {
    if section.cuda_devices.is_some() && engine.device != Some(Device::Cuda) {
        bail!(
            "deployment.{role}.cuda_devices is set but these workers run on the CPU: set engine.device: cuda"
        );
    }
    Ok(())
}

/// Worker `index`'s CUDA settings: the deployment's, on its role's `cuda_devices[index]` when listed.
fn replica_cuda(cuda: &CudaSettings, role: &RoleSettings, index: usize) -> CudaSettings {
    let mut own = cuda.clone();
    if let Some(&ordinal) = role.cuda_devices.as_ref().and_then(|d| d.get(index)) {
        own.device = Some(ordinal);
    }
    own
}

/// The command line of one worker: its settings whole as one JSON argument, and its role's share of
/// an MPS-run GPU in its environment.
fn worker_command(exe: &Path, settings: &WorkerSettings, role: &RoleSettings) -> Result<Command> {
    let doc = serde_json::to_string(settings).context("writing the worker's settings")?;
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .arg("--settings-json")
        .arg(doc)
        .arg("--exit-with-stdin");
    if let Some(p) = role.mps_thread_percentage {
        cmd.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", p.to_string());
    }
    Ok(cmd)
}

/// Starts one worker and returns its name with a receiver for its RPC URL (sent once it serves).
fn spawn_worker(
    children: &mut Children,
    exe: &Path,
    settings: &WorkerSettings,
    role: &RoleSettings,
) -> Result<(String, mpsc::Receiver<String>)> {
    let name = settings.worker_id.clone().unwrap_or_default();
    let (pid, rx) = children
        .spawn(
            &name,
            &mut worker_command(exe, settings, role)?,
            WORKER_READY_PREFIX,
        )
        .with_context(|| format!("starting worker {name}"))?;
    info!(worker = %name, pid, "worker started");
    Ok((name, rx))
}

/// Runs the disaggregated deployment described by `file` (whose `deployment.mode` is `pd`); `token` says
/// where the cluster token this process exported came from.
pub fn run(flags: &Settings, file: Settings, token: crate::token::Origin) -> Result<()> {
    let dep = file.deployment.clone().unwrap_or_default();
    dep.validate()?;
    let discovery = dep.discovery.clone().unwrap_or_default();
    let settings = Settings::layered(&file, flags)?;
    settings.server.validate()?;
    let cuda = &settings.cuda;
    // First, so a busy port fails before a model is fetched or a worker started.
    let listener = crate::process::bind_api(&settings.host(), settings.port())?;
    // The files are checked before any worker starts, so a bad one fails at once naming its setting.
    let api_tls = settings.server.tls.server_config()?;
    crate::tls::cluster()?;
    let model_path = resolve_model(settings.model.as_deref())?;
    let model_path: PathBuf = std::fs::canonicalize(&model_path).unwrap_or(model_path);
    let exe = std::env::current_exe().context("locating the tandem binary")?;

    let mut children = Children::default();
    let mut pending = Vec::new();
    for (role, section) in [(Role::Prefill, &dep.prefill), (Role::Decode, &dep.decode)] {
        let default = RoleSettings::default();
        let section = section.as_ref().unwrap_or(&default);
        let replicas = section.replicas.unwrap_or(1);
        if replicas == 0 {
            let by_dns = discovery.mode == DiscoveryMode::Dns
                && match role {
                    Role::Prefill => discovery.prefill.is_some(),
                    Role::Decode => discovery.decode.is_some(),
                };
            if !by_dns {
                info!(%role, "deployment.{role}.replicas is 0: waiting for {role} workers to register (POST /v1/cluster/workers)");
            }
        }
        let engine = overlay(&[
            &file.engine,
            section
                .engine
                .as_ref()
                .unwrap_or(&EngineSettings::default()),
            &flags.engine,
        ])?;
        check_placement(role, section, &engine)?;
        for i in 0..replicas {
            let mut worker = worker_settings(&model_path, role, i, engine.clone(), &dep);
            worker.cuda = replica_cuda(cuda, section, i);
            worker.listen = settings.server.listen.clone();
            worker.metrics_need_token = settings.probes_need_key();
            pending.push(spawn_worker(&mut children, &exe, &worker, section)?);
        }
    }

    // Load the tokenizer and template here while the workers load their engines.
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let crate::serve::ApiModel {
        codec,
        served_name,
        reasoning_parser,
    } = crate::serve::api_model(&settings, &loaded)?;

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

    let cluster_key = crate::token::key();
    match token {
        crate::token::Origin::Configured => {}
        crate::token::Origin::Generated => info!(
            "no cluster token configured: this head generated one for the workers it started (a worker on another host needs deployment.cluster_token, cluster_token_file or TANDEM_CLUSTER_TOKEN)"
        ),
        crate::token::Origin::Absent => {
            let note = "no cluster token (deployment.cluster_token, cluster_token_file or TANDEM_CLUSTER_TOKEN): worker, KV and stage ports answer anyone who reaches them";
            if dep.allow_unauthenticated {
                info!("{note} (allow_unauthenticated)");
            } else {
                warn!("{note}");
            }
        }
    }
    let ingress = Ingress::with_tls(
        dep.routing.clone().unwrap_or_default(),
        timeouts,
        Some(loaded.identity.0.clone()),
        cluster_key,
        settings.server.listen.limits().header_read_timeout,
        crate::tls::cluster()?,
    )?;
    ingress.assume_max_model_len(loaded.config.max_position_embeddings);
    match tandem_engine::GuideEnv::new(
        &loaded.tokenizer.token_pieces(),
        &loaded.config.eos_token_ids,
        loaded.config.vocab_size,
    ) {
        Ok(env) => ingress.check_guidance_with(env),
        Err(e) => warn!(error = %e, "guided requests are checked by the workers only"),
    }
    let config = ApiConfig {
        served_model_names: vec![served_name.clone()],
        model_root: loaded.name.clone(),
        api_key: settings.server.api_key.clone(),
        system_fingerprint: format!(
            "fp_{}",
            loaded.identity.0.chars().take(16).collect::<String>()
        ),
        max_body_bytes: settings.max_body_bytes(),
        probes_need_key: settings.probes_need_key(),
        reasoning_parser,
    };
    let state = Arc::new(AppState::new(
        Arc::new(ingress.clone()),
        Arc::new(codec),
        config,
    )?);
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
        if discovery.mode == DiscoveryMode::Dns {
            ingress.discover_once(&discovery, &DnsResolver).await;
            tokio::spawn(ingress.clone().discover_forever(discovery.clone(), Arc::new(DnsResolver)));
        }
        let listener = tokio::net::TcpListener::from_std(listener).context("the API's listener")?;
        let address = listener.local_addr()?;
        info!(%address, model = %served_name, workers = urls.len(), "serving the OpenAI API (prefill/decode disaggregated)");
        crate::process::print_serving(address, &served_name, settings.server.api_key.is_some(), api_tls.is_some());
        let app = tandem_api::router(state).merge(ingress.routes());
        tandem_api::serve_router_tls(listener, app, settings.server.listen.limits(), api_tls, shutdown_signal()).await.context("HTTP server")
    });
    drop(children);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;
    use crate::worker::WorkerArgs;

    /// What a worker started with `doc` resolves to, parsed as `tandem worker` parses its command line.
    fn as_worker_sees_it(doc: &WorkerSettings) -> WorkerSettings {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            worker: WorkerArgs,
        }
        let json = serde_json::to_string(doc).unwrap();
        <Cli as clap::Parser>::try_parse_from([
            "worker",
            "--settings-json",
            &json,
            "--exit-with-stdin",
        ])
        .unwrap()
        .worker
        .resolve()
        .unwrap()
    }

    #[test]
    fn a_roles_mps_share_reaches_only_its_workers_environment() {
        let dep = DeploymentSettings::default();
        let doc = worker_settings(
            Path::new("m.gguf"),
            Role::Prefill,
            0,
            EngineSettings::default(),
            &dep,
        );
        let env = |role: &RoleSettings| {
            let cmd = worker_command(Path::new("tandem"), &doc, role).unwrap();
            cmd.get_envs()
                .find(|(k, _)| *k == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                .and_then(|(_, v)| v.map(|v| v.to_string_lossy().into_owned()))
        };
        let held = RoleSettings {
            mps_thread_percentage: Some(40),
            ..RoleSettings::default()
        };
        assert_eq!(env(&held).as_deref(), Some("40"));
        assert_eq!(env(&RoleSettings::default()), None);
    }

    #[test]
    fn each_replica_reaches_its_listed_gpu_and_unlisted_roles_keep_the_deployments() {
        let dep = DeploymentSettings::default();
        let cuda = CudaSettings {
            device: Some(0),
            pipeline_devices: Some(vec![2, 3]),
            ..CudaSettings::default()
        };
        let decode = RoleSettings {
            replicas: Some(2),
            cuda_devices: Some(vec![1, 4]),
            ..RoleSettings::default()
        };
        let seen = |role: &RoleSettings, i: usize| {
            let mut doc = worker_settings(
                Path::new("m.gguf"),
                Role::Decode,
                i,
                EngineSettings::default(),
                &dep,
            );
            doc.cuda = replica_cuda(&cuda, role, i);
            as_worker_sees_it(&doc).cuda
        };
        assert_eq!(seen(&decode, 0).device, Some(1));
        assert_eq!(seen(&decode, 1).device, Some(4));
        assert_eq!(seen(&decode, 1).pipeline_devices, Some(vec![2, 3]));
        assert_eq!(seen(&RoleSettings::default(), 1).device, Some(0));

        let on = |device| EngineSettings {
            device,
            ..EngineSettings::default()
        };
        assert!(check_placement(Role::Decode, &decode, &on(Some(Device::Cuda))).is_ok());
        let err = check_placement(Role::Decode, &decode, &on(None)).unwrap_err();
        assert!(
            err.to_string().contains("deployment.decode.cuda_devices"),
            "{err}"
        );
        assert!(check_placement(Role::Decode, &RoleSettings::default(), &on(None)).is_ok());
    }

    #[test]
    fn later_engine_sections_win_and_reach_the_worker() {
        let file = EngineSettings {
            block_size: Some(16),
            threads: Some(2),
            ..EngineSettings::default()
        };
        let role = EngineSettings {
            threads: Some(1),
            tensor_parallel_size: Some(2),
            enable_prefix_caching: Some(false),
            ..EngineSettings::default()
        };
        let cli = EngineSettings {
            kv_cache_memory: Some(ByteSize(64 << 20)),
            ..EngineSettings::default()
        };
        let m = overlay(&[&file, &role, &cli]).unwrap();
        let dep = DeploymentSettings::default();
        let doc = worker_settings(Path::new("m.gguf"), Role::Prefill, 0, m, &dep);
        let got = as_worker_sees_it(&doc).engine;
        assert_eq!(
            (
                got.block_size,
                got.kv_cache_memory,
                got.threads,
                got.tensor_parallel_size,
                got.enable_prefix_caching
            ),
            (
                Some(16),
                Some(ByteSize(67108864)),
                Some(1),
                Some(2),
                Some(false)
            )
        );
        assert_eq!(
            (got.max_num_seqs, got.enable_chunked_prefill, got.device),
            (None, None, None),
            "unset knobs stay unset"
        );
    }

    #[test]
    fn pipeline_settings_travel_from_yaml_to_the_worker() {
        let role: EngineSettings = serde_yaml::from_str(
            "{pipeline_parallel_size: 3, pipeline_micro_batches: 4, pipeline_stages: ['10.0.0.2:7000', '10.0.0.3:7000']}",
        )
        .unwrap();
        let m = overlay(&[&EngineSettings::default(), &role]).unwrap();
        let dep = DeploymentSettings::default();
        let doc = worker_settings(Path::new("m.gguf"), Role::Decode, 1, m, &dep);
        let c = as_worker_sees_it(&doc).engine.engine_config();
        assert_eq!(c.pipeline_parallel_size, 3);
        assert_eq!(c.pipeline_micro_batches, 4);
        assert_eq!(c.pipeline_stages, ["10.0.0.2:7000", "10.0.0.3:7000"]);
    }

    #[test]
    fn the_whole_kv_transfer_section_and_odd_strings_reach_the_worker() {
        let file = Settings::from_yaml(
            "deployment: {mode: pd, kv_transfer: {transport: shm, streams: 2, pin_timeout_secs: 7, \
             io_timeout_secs: 3, checksum: true}}\n",
        )
        .unwrap();
        let dep = file.deployment.unwrap();
        let model = Path::new("/models/a dir/it's \"quoted\"\n--role decode.gguf");
        let doc = worker_settings(model, Role::Prefill, 3, EngineSettings::default(), &dep);
        let got = as_worker_sees_it(&doc);
        assert_eq!(got.role, Some(Role::Prefill));
        assert_eq!(got.model.as_deref(), Some(model));
        assert_eq!(got.worker_id.as_deref(), Some("prefill-3"));
        let kv = got.kv_transfer;
        assert_eq!(
            (
                kv.transport,
                kv.streams,
                kv.pin_timeout_secs,
                kv.io_timeout_secs,
                kv.checksum
            ),
            (tandem_cluster::TransportKind::Shm, 2, 7.0, 3.0, true)
        );
    }
}
