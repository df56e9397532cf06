//! `tandem autoscale`: the planner live on a compose deployment.
//!
//! A loop beside the head (its own process, so the head that faces clients never holds the Docker
//! socket, which is root on the host): every `window_secs` it scrapes the head's `/metrics`, turns two
//! scrapes into the window's signals ([`signals`]), asks the [`Scaler`] (tandem-sim's, with the
//! capacity the planner's model gives one prefill and one decode worker on the profile) how many
//! replicas each role should have, and makes it so through the Docker Engine API ([`docker`]): a new
//! replica is a clone of the service's newest one, which the head's DNS discovery finds by the service
//! name; a replica taken away is the least loaded one, stopped with SIGTERM so that it drains (no new
//! work, its requests finish) and then removed.

mod docker;
mod signals;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_sim::plan::PlanSlo;
use tandem_sim::scale::{Decision, Policy, RoleCapacity, ScaleRole, Scaler};
use tandem_sim::Profile;
use tracing::{info, warn};

use docker::{Docker, Replica};
use signals::Scrape;

/// Options of `tandem autoscale`.
#[derive(Args, Debug)]
pub struct AutoscaleArgs {
    /// The settings file (YAML; see docs/deploy.md "Autoscaling").
    #[arg(long)]
    pub config: PathBuf,
    /// The head's base URL, instead of the file's `head`.
    #[arg(long)]
    pub head: Option<String>,
    /// The compose project, instead of the file's `docker.project`.
    #[arg(long)]
    pub project: Option<String>,
    /// Check the settings and print the modelled capacity per replica, then exit.
    #[arg(long)]
    pub check_config: bool,
}

/// The settings file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleSettings {
    /// The head's base URL (its `/metrics` is read).
    pub head: String,
    /// The hardware profile of the workers (`tandem profile`, or a datasheet one).
    pub profile: PathBuf,
    /// The objectives the planner sizes replicas for.
    pub slo: SloSettings,
    /// The request shape the capacity is calibrated on (live traffic is measured in tokens, so only
    /// the ratio of the phases' costs depends on it).
    #[serde(default)]
    pub calibration: Calibration,
    /// Seconds per measurement window.
    #[serde(default = "default_window")]
    pub window_secs: f64,
    /// Seconds a drained worker gets to finish its requests before Docker kills it.
    #[serde(default = "default_grace")]
    pub drain_grace_secs: u64,
    /// The compose deployment to drive.
    #[serde(default)]
    pub docker: DockerSettings,
    /// Bounds and hysteresis.
    pub scaling: Policy,
}

/// SLOs in milliseconds.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SloSettings {
    /// 90th percentile time to first token.
    pub ttft_p90_ms: f64,
    /// 90th percentile inter-token latency.
    pub itl_p90_ms: f64,
}

/// The calibration workload.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// Generated tokens per request.
    pub output_tokens: usize,
    /// Requests per calibration run.
    pub requests: usize,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            prompt_tokens: 256,
            output_tokens: 64,
            requests: 32,
        }
    }
}

/// Where the compose deployment is.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DockerSettings {
    /// The Docker Engine's unix socket.
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// The compose project; absent: the project of the container this runs in.
    #[serde(default)]
    pub project: Option<String>,
    /// The compose service of each role.
    #[serde(default)]
    pub services: Services,
}

impl Default for DockerSettings {
    fn default() -> Self {
        DockerSettings {
            socket: default_socket(),
            project: None,
            services: Services::default(),
        }
    }
}

/// Compose service names per role.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Services {
    /// The prefill workers' service.
    #[serde(default = "prefill_service")]
    pub prefill: String,
    /// The decode workers' service.
    #[serde(default = "decode_service")]
    pub decode: String,
}

impl Default for Services {
    fn default() -> Self {
        Services {
            prefill: prefill_service(),
            decode: decode_service(),
        }
    }
}

impl Services {
    fn of(&self, role: ScaleRole) -> &str {
        match role {
            ScaleRole::Prefill => &self.prefill,
            ScaleRole::Decode => &self.decode,
        }
    }
}

fn default_window() -> f64 {
    5.0
}
fn default_grace() -> u64 {
    60
}
fn default_socket() -> PathBuf {
    PathBuf::from("/var/run/docker.sock")
}
fn prefill_service() -> String {
    "prefill".into()
}
fn decode_service() -> String {
    "decode".into()
}

impl AutoscaleSettings {
    /// Reads and checks a settings file; every error names the field (`scaling.decode.min`).
    pub fn load(path: &Path) -> Result<AutoscaleSettings> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in autoscale settings {}", path.display()))
    }

    fn parse(text: &str) -> Result<AutoscaleSettings> {
        let de = serde_yaml::Deserializer::from_str(text);
        let s: AutoscaleSettings = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            anyhow::anyhow!("field `{path}`: {}", e.into_inner())
        })?;
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<()> {
        let field = |name: &str, why: String| Err(anyhow::anyhow!("field `{name}`: {why}"));
        if !(self.window_secs.is_finite() && self.window_secs >= 0.5) {
            return field(
                "window_secs",
                format!("must be at least 0.5 seconds, not {}", self.window_secs),
            );
        }
        if !(self.head.starts_with("http://") || self.head.starts_with("https://")) {
            return field(
                "head",
                format!("must be an http:// or https:// URL, not {:?}", self.head),
            );
        }
        self.slo()
            .check()
            .map_err(|e| anyhow::anyhow!("field `slo`: {e}"))?;
        self.scaling.check().map_err(|e| match e {
            tandem_sim::SimError::Setting { field, message } => {
                anyhow::anyhow!("field `scaling.{field}`: {message}")
            }
            e => e.into(),
        })?;
        let c = &self.calibration;
        for (name, v) in [
            ("calibration.prompt_tokens", c.prompt_tokens),
            ("calibration.output_tokens", c.output_tokens),
            ("calibration.requests", c.requests),
        ] {
            if v == 0 {
                return field(name, "must be positive".into());
            }
        }
        if self.docker.services.prefill == self.docker.services.decode {
            return field(
                "docker.services",
                format!(
                    "prefill and decode must be different services, not both {:?}",
                    self.docker.services.prefill
                ),
            );
        }
        Ok(())
    }

    fn slo(&self) -> PlanSlo {
        PlanSlo {
            ttft_p90_ms: self.slo.ttft_p90_ms,
            itl_p90_ms: self.slo.itl_p90_ms,
        }
    }
}

/// One line of the autoscaler's record (stdout, JSON per line): what it measured and what it did.
#[derive(Serialize)]
struct Record<'a> {
    /// Seconds since the loop started.
    t: f64,
    /// Replicas per role when the window ended, `[prefill, decode]`.
    replicas: [usize; 2],
    /// The window's signals.
    signals: &'a tandem_sim::scale::Signals,
    /// Changes made.
    decisions: &'a [Decision],
}

/// Runs `tandem autoscale`.
pub fn run(a: AutoscaleArgs) -> Result<()> {
    let mut settings = AutoscaleSettings::load(&a.config)?;
    if let Some(head) = a.head {
        settings.head = head;
    }
    if let Some(project) = a.project {
        settings.docker.project = Some(project);
    }
    settings.check()?;
    let profile = Profile::load(&settings.profile)?;
    let c = settings.calibration;
    let (capacity, planned) = RoleCapacity::calibrate(
        &profile,
        &settings.slo(),
        c.prompt_tokens,
        c.output_tokens,
        c.requests,
    )
    .context("calibrating the capacity per replica on the profile")?;
    info!(
        prefill_tokens_per_s = capacity.prefill_tokens_per_s,
        decode_tokens_per_s = capacity.decode_tokens_per_s,
        prefill_rps = planned.prefill,
        decode_rps = planned.decode,
        "capacity per replica (the planner's model)"
    );
    if a.check_config {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "capacity": capacity,
                "planner": planned,
                "settings": settings,
            }))?
        );
        return Ok(());
    }
    let scaler = Scaler::new(settings.scaling.clone(), capacity, settings.slo())?;
    let model = profile.model.name.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(Loop::start(settings, scaler, model)?.run())
}

/// The running loop's state.
struct Loop {
    settings: AutoscaleSettings,
    scaler: Scaler,
    docker: Docker,
    http: reqwest::Client,
    /// Containers being drained (stopped and removed in the background): not counted as replicas.
    draining: Arc<Mutex<HashSet<String>>>,
    /// The profile's model, which the head must serve.
    model: String,
}

impl Loop {
    fn start(settings: AutoscaleSettings, scaler: Scaler, model: String) -> Result<Loop> {
        let docker = Docker::new(&settings.docker.socket);
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .default_headers(tandem_cluster::auth::token_headers(
                crate::token::key().as_ref(),
            ))
            .build()?;
        Ok(Loop {
            settings,
            scaler,
            docker,
            http,
            draining: Arc::default(),
            model,
        })
    }

    /// Refuses a head that serves another model than the profile's (its capacity would be another's);
    /// a head whose model list needs an API key this process lacks is taken on trust, with a warning.
    async fn check_model(&self) -> Result<()> {
        let url = format!("{}/v1/models", self.settings.head.trim_end_matches('/'));
        let resp = self
            .http
            .get(&url)
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        if !resp.status().is_success() {
            warn!(status = %resp.status(), "the head's model list is not readable; the profile's model is not checked");
            return Ok(());
        }
        let list: serde_json::Value = resp.json().await?;
        let ids: Vec<&str> = list["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["id"].as_str())
            .collect();
        if !ids.contains(&self.model.as_str()) {
            bail!(
                "field `profile`: the profile is of model {:?}, the head at {} serves {ids:?}",
                self.model,
                self.settings.head
            );
        }
        Ok(())
    }

    async fn scrape(&self) -> Result<Scrape> {
        let url = format!("{}/metrics", self.settings.head.trim_end_matches('/'));
        let resp = self
            .http
            .get(&url)
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        if !resp.status().is_success() {
            bail!("GET {url}: {}", resp.status());
        }
        Ok(Scrape::parse(&resp.text().await?))
    }

    /// The running replicas of each role that are not being drained.
    async fn replicas(&self, project: &str) -> Result<[Vec<Replica>; 2]> {
        let mut out: [Vec<Replica>; 2] = Default::default();
        for (i, role) in ScaleRole::ALL.into_iter().enumerate() {
            let service = self.settings.docker.services.of(role);
            let draining = self.draining.lock().expect("draining set").clone();
            out[i] = self
                .docker
                .replicas(project, service)
                .await?
                .into_iter()
                .filter(|r| !draining.contains(&r.id))
                .collect();
        }
        Ok(out)
    }

    async fn run(mut self) -> Result<()> {
        let version = self.docker.version().await?;
        let project = match &self.settings.docker.project {
            Some(p) => p.clone(),
            None => {
                let host = std::fs::read_to_string("/etc/hostname").context(
                    "docker.project is not set and this is not a container (/etc/hostname)",
                )?;
                self.docker.project_of(host.trim()).await.context(
                    "docker.project is not set: looking up this container's compose project",
                )?
            }
        };
        info!(%project, api = %version, head = %self.settings.head, "autoscaling");
        let started = Instant::now();
        let window = Duration::from_secs_f64(self.settings.window_secs);
        let mut last = loop {
            match self.scrape().await {
                Ok(s) => break (Instant::now(), s),
                Err(e) => {
                    warn!(error = %e, "the head's metrics are not readable yet");
                    tokio::time::sleep(window).await;
                }
            }
        };
        self.check_model().await?;
        let mut tick = tokio::time::interval(window);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let now = match self.scrape().await {
                Ok(s) => (Instant::now(), s),
                Err(e) => {
                    warn!(error = %e, "scrape failed; this window is skipped");
                    continue;
                }
            };
            let signals = signals::window(&last.1, &now.1, (now.0 - last.0).as_secs_f64());
            let replicas = match self.replicas(&project).await {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %e, "listing the replicas failed; this window is skipped");
                    continue;
                }
            };
            let counts = [replicas[0].len(), replicas[1].len()];
            let t = started.elapsed().as_secs_f64();
            let decisions = self.scaler.observe(t, counts, &signals);
            for d in &decisions {
                let i = ScaleRole::ALL
                    .iter()
                    .position(|r| *r == d.role)
                    .unwrap_or(0);
                if let Err(e) = self.apply(&project, d, &replicas[i], &now.1).await {
                    warn!(role = %d.role, error = %format!("{e:#}"), "scaling failed");
                }
            }
            let record = Record {
                t,
                replicas: counts,
                signals: &signals,
                decisions: &decisions,
            };
            println!("{}", serde_json::to_string(&record)?);
            last = now;
        }
    }

    /// Makes one decision so: clones replicas up to `to`, or drains replicas down to it.
    async fn apply(
        &self,
        project: &str,
        d: &Decision,
        have: &[Replica],
        scrape: &Scrape,
    ) -> Result<()> {
        let service = self.settings.docker.services.of(d.role);
        info!(role = %d.role, from = d.from, to = d.to, reason = %d.reason, "scaling");
        if d.to > d.from {
            let Some(template) = have.last() else {
                bail!("service {service} has no running replica to copy (start one with docker compose up)");
            };
            for _ in d.from..d.to {
                let name = self
                    .docker
                    .clone_replica(project, service, template)
                    .await?;
                info!(role = %d.role, %name, "replica started");
            }
            return Ok(());
        }
        // The least loaded first: fewest KV blocks in use, by the head's last scrape (workers are
        // named `<role>-<hostname>`, the hostname the container id's prefix), then the newest.
        let kv = scrape.per_worker("tandem:worker_kv_blocks_used", d.role.name());
        let mut order: Vec<&Replica> = have.iter().collect();
        order.sort_by(|a, b| {
            let load = |r: &Replica| {
                kv.get(&format!("{}-{}", d.role, r.short_id()))
                    .copied()
                    .unwrap_or(0.0)
            };
            load(a).total_cmp(&load(b)).then(b.created.cmp(&a.created))
        });
        for r in order.into_iter().take(d.from - d.to) {
            self.draining
                .lock()
                .expect("draining set")
                .insert(r.id.clone());
            info!(role = %d.role, name = %r.name, "draining replica");
            let (docker, draining, id, name) = (
                self.docker.clone(),
                Arc::clone(&self.draining),
                r.id.clone(),
                r.name.clone(),
            );
            let grace = self.settings.drain_grace_secs;
            tokio::spawn(async move {
                match docker.drain_and_remove(&id, grace).await {
                    Ok(code) => {
                        info!(%name, exit_code = code.unwrap_or(-1), "replica drained and removed")
                    }
                    Err(e) => {
                        warn!(%name, error = %format!("{e:#}"), "draining the replica failed")
                    }
                }
                draining.lock().expect("draining set").remove(&id);
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str =
        "head: http://head:8000\nprofile: p.yaml\nslo: {ttft_p90_ms: 2000, itl_p90_ms: 200}\n\
                        scaling:\n  prefill: {min: 1, max: 2}\n  decode: {min: 1, max: 3}\n";

    fn err(text: &str) -> String {
        format!("{:#}", AutoscaleSettings::parse(text).unwrap_err())
    }

    #[test]
    fn settings_parse_with_defaults() {
        let s = AutoscaleSettings::parse(GOOD).unwrap();
        assert_eq!(s.window_secs, 5.0);
        assert_eq!(s.docker.services.decode, "decode");
        assert_eq!(s.scaling.decode.max, 3);
        assert_eq!(s.scaling.down_windows, 6);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let e = err(&GOOD.replace("decode: {min: 1, max: 3}", "decode: {min: 4, max: 3}"));
        assert!(e.contains("scaling.decode.min"), "{e}");
        let e = err(&GOOD.replace("  prefill:", "  encode:"));
        assert!(e.contains("scaling") && e.contains("encode"), "{e}");
        let e = err(&GOOD.replace("itl_p90_ms: 200", "itl_p90_ms: -1"));
        assert!(e.contains("slo") && e.contains("itl_p90_ms"), "{e}");
        let e = err(&format!("{GOOD}window_secs: 0\n"));
        assert!(e.contains("window_secs"), "{e}");
        let e = err(&format!(
            "{GOOD}docker: {{services: {{prefill: w, decode: w}}}}\n"
        ));
        assert!(e.contains("docker.services"), "{e}");
        let e = err(&format!("{GOOD}docker: {{servics: {{}}}}\n"));
        assert!(e.contains("docker") && e.contains("servics"), "{e}");
        let e = err(&GOOD.replace("http://head:8000", "head:8000"));
        assert!(e.contains("field `head`"), "{e}");
        let e = err(&format!("{GOOD}  scale_down_utilization: 0.95\n"));
        assert!(e.contains("scaling.scale_down_utilization"), "{e}");
        let e = err(&format!(
            "{GOOD}calibration: {{prompt_tokens: 0, output_tokens: 1, requests: 1}}\n"
        ));
        assert!(e.contains("calibration.prompt_tokens"), "{e}");
    }
}
