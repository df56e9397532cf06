//! The settings of `tandem serve`, `tandem chat --local` and `tandem worker`: one type per concern
//! ([`ServerSettings`], [`EngineSettings`], [`DeploymentSettings`], composed in [`Settings`]), each field
//! declared once. The same types are the YAML schema (unknown keys are errors that name the key), the
//! command-line flags (clap: each flag overrides the same key), and the document a launcher hands its
//! children (JSON). Layers merge with [`overlay`]: a later layer's set values win, section by section.
//!
//! A new section is one more type deriving `Deserialize` + `Serialize` (and `clap::Args` when it has
//! flags) and one more field of [`Settings`].
//!
//! Files by job: this one holds the whole document ([`Settings`]) and how layers merge; `sections` the
//! sections and their checks, `bytes` [`ByteSize`], `parse` the YAML parser that reports every problem
//! by its path, line and column.
//!
//! `deployment.mode: colocated` (the default) runs one engine in this process ([`Settings::colocated`]);
//! `mode: pd` starts prefill and decode workers as child processes and is run by `crate::launch`.

mod bytes;
mod parse;
mod sections;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use bytes::ByteSize;
pub use parse::parse_settings;
pub use sections::{
    ClusterTlsSettings, DeploymentSettings, EngineSettings, ListenSettings, RoleSettings,
    ServerSettings, ENGINE_FLAG_IDS,
};

use crate::cuda_settings::CudaSettings;

/// The model served when none is named.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// How logs are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Where the model math runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The CPU backend (always built).
    #[default]
    Cpu,
    /// The CUDA backend (binaries built with `--features cuda`).
    Cuda,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        })
    }
}

/// Whether the API splits `<think>…</think>` reasoning blocks off answers (`--reasoning-parser`,
/// YAML `reasoning_parser`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningParserMode {
    /// On when the chat template mentions `<think>` (Qwen3, DeepSeek-R1 and their kin).
    #[default]
    Auto,
    /// Always: blocks go to `reasoning_content` / `reasoning` items.
    On,
    /// Never: the output is returned as generated, tags included.
    Off,
}

impl ReasoningParserMode {
    /// Whether the parser runs for a model whose chat template is `template`.
    pub fn enabled(self, template: Option<&str>) -> bool {
        match self {
            ReasoningParserMode::On => true,
            ReasoningParserMode::Off => false,
            ReasoningParserMode::Auto => {
                template.is_some_and(tandem_api::reasoning::template_thinks)
            }
        }
    }
}

/// How the server is deployed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeploymentMode {
    /// Prefill and decode in one engine (the only mode implemented).
    #[default]
    Colocated,
    /// Disaggregated prefill and decode workers behind this process as the ingress.
    Pd,
}

/// The whole YAML document of `tandem serve --config`, and the flags of `tandem serve` that override it.
#[derive(Clone, Debug, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched if missing).
    pub model: Option<PathBuf>,
    /// HTTP settings.
    #[command(flatten)]
    #[serde(default)]
    pub server: ServerSettings,
    /// Name clients use in `model` [default: the model's file stem or folder name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Jinja chat template file overriding the model's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Split `<think>…</think>` off answers into `reasoning_content` (chat) and `reasoning` items
    /// (Responses): auto (when the chat template mentions `<think>`), on or off [default: auto].
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<ReasoningParserMode>,
    /// Log format (the global `--log-format` flag wins).
    #[arg(skip)]
    pub log_format: Option<LogFormat>,
    /// Engine knobs.
    #[command(flatten)]
    #[serde(default)]
    pub engine: EngineSettings,
    /// CUDA backend settings: YAML `cuda:`, and the `--cuda-*` flags.
    #[command(flatten)]
    #[serde(default)]
    pub cuda: CudaSettings,
    /// Deployment shape (YAML only).
    #[arg(skip)]
    pub deployment: Option<DeploymentSettings>,
}

impl Settings {
    /// Parses a YAML document; every unknown key and bad value is reported at once, by its full path
    /// (`parse_settings`).
    pub fn from_yaml(text: &str) -> Result<Self> {
        parse_settings(text)
    }

    /// Reads and parses a YAML file; one with no setting at all (empty, or only comments) is refused,
    /// since serving every default from a file named on purpose is almost always a wrong path.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if serde_yaml::from_str::<serde_yaml::Value>(&text).is_ok_and(|v| v.is_null()) {
            bail!(
                "config file {} holds no settings; name a config with settings, or leave --config out to serve the defaults",
                path.display()
            );
        }
        let settings = Self::from_yaml(&text)
            .and_then(|s| {
                // The checks `resolved` makes again after the flags, here so a bad value gets its line.
                s.server.validate()?;
                s.engine.validate()?;
                if let Some(d) = &s.deployment {
                    d.validate()?;
                }
                Ok(s)
            })
            .map_err(|e| parse::with_line(&text, e))
            .with_context(|| format!("in config file {}", path.display()))?;
        Ok(settings)
    }

    /// The settings of one colocated engine: the file, then the flags over it (a `pd` deployment is the
    /// launcher's, and its sections are refused here).
    pub fn colocated(flags: &Settings, file: Settings) -> Result<Self> {
        if let Some(deployment) = &file.deployment {
            if deployment.mode != DeploymentMode::Colocated {
                bail!("deployment.mode `pd` is run by the P/D launcher, not as a single engine");
            }
            if deployment.prefill.is_some()
                || deployment.decode.is_some()
                || deployment.kv_transfer.is_some()
                || deployment.routing.is_some()
                || deployment.timeouts.is_some()
                || deployment.discovery.is_some()
            {
                bail!("deployment.prefill, decode, kv_transfer, routing, timeouts and discovery only apply to `mode: pd`");
            }
        }
        let settings = Settings::layered(&file, flags)?;
        settings.server.validate()?;
        settings.engine.validate()?;
        Ok(settings)
    }

    /// The file's settings with the flags over them ([`overlay`]); the CUDA tuning knobs, which no file
    /// holds, are the flags'.
    pub fn layered(file: &Settings, flags: &Settings) -> Result<Settings> {
        let mut settings: Settings = overlay(&[file, flags])?;
        settings.cuda.tuning = flags.cuda.tuning.clone();
        Ok(settings)
    }

    /// Listen address.
    pub fn host(&self) -> String {
        self.server
            .host
            .clone()
            .unwrap_or_else(|| "127.0.0.1".to_owned())
    }

    /// Listen port.
    pub fn port(&self) -> u16 {
        self.server.port.unwrap_or(8000)
    }

    /// Largest request body the API reads.
    pub fn max_body_bytes(&self) -> usize {
        self.server
            .max_body_bytes
            .map_or(tandem_api::DEFAULT_MAX_BODY_BYTES, |b| b.0)
    }

    /// Whether /health and /metrics ask for the API key.
    pub fn probes_need_key(&self) -> bool {
        self.server.probes_need_key.unwrap_or(false)
    }

    /// Backend the engine runs on.
    pub fn device(&self) -> Device {
        self.engine.device.unwrap_or_default()
    }
}

/// What `tandem serve --check-config` prints: the settings serve would run with (the file, the flags over
/// it, a `pd` deployment's sections filled with their defaults), checked as serve checks them before it
/// loads the model (the model file is not opened). The API key is printed as `(set)`, never itself.
pub fn resolved(flags: &Settings, file: Settings) -> Result<Settings> {
    let pd = file
        .deployment
        .as_ref()
        .is_some_and(|d| d.mode == DeploymentMode::Pd);
    let mut s = if pd {
        Settings::layered(&file, flags)?
    } else {
        Settings::colocated(flags, file)?
    };
    s.server.host = Some(s.host());
    s.server.port = Some(s.port());
    if s.server.api_key.is_some() {
        s.server.api_key = Some("(set)".into());
    }
    if let Some(deployment) = s.deployment.as_mut() {
        deployment.validate()?;
        if deployment.cluster_token.is_some() {
            deployment.cluster_token = Some("(set)".into());
        }
    }
    s.server.validate()?;
    let limits = s.server.listen.limits();
    s.server.listen = ListenSettings {
        header_read_timeout_secs: Some(limits.header_read_timeout.as_secs_f64()),
        body_read_timeout_secs: Some(limits.body_read_timeout.as_secs_f64()),
        max_connections: Some(limits.max_connections),
    };
    if pd {
        let deployment = s.deployment.get_or_insert_with(DeploymentSettings::default);
        deployment.validate()?;
        deployment.fill_defaults();
    }
    Ok(s)
}

/// Flags of `tandem serve`; each one overrides the same setting of the config file.
#[derive(Clone, Debug, Default, Args)]
pub struct ServeArgs {
    /// YAML file with the same settings; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Check this YAML file as `--config` would read it, print the resolved settings (YAML) and exit:
    /// 0 when it is valid, non-zero with an error naming the bad key (the model is not loaded).
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// The settings given as flags.
    #[command(flatten)]
    pub settings: Settings,
}

/// Merges `layers` of one settings type, later ones winning: every value a layer sets replaces the one
/// before, sections merge key by key, and unset (`None`) values leave the earlier layer's in place.
pub fn overlay<T: Serialize + DeserializeOwned>(layers: &[&T]) -> Result<T> {
    let mut merged = Value::Null;
    for layer in layers {
        merge(
            &mut merged,
            serde_json::to_value(layer).context("writing settings")?,
        );
    }
    serde_json::from_value(merged).context("merging settings")
}

/// Merges the document `from` into `into`: objects key by key, nulls (unset values) leaving `into`'s.
fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (_, Value::Null) => {}
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v,
    }
}

/// `over`'s set keys over `base`'s, read as a `T`: [`overlay`] across two types that share key names.
pub fn overlay_onto<T: DeserializeOwned>(
    base: &impl Serialize,
    over: &impl Serialize,
) -> Result<T> {
    let mut merged = serde_json::to_value(base).context("writing settings")?;
    merge(
        &mut merged,
        serde_json::to_value(over).context("writing settings")?,
    );
    serde_json::from_value(merged).context("merging settings")
}

#[cfg(test)]
mod tests;
