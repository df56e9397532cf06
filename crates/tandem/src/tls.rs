//! Cluster TLS in the binary (`deployment.cluster_tls`): like the cluster token, the head resolves the
//! files from its settings and exports them as `TANDEM_CLUSTER_TLS_{CA,CERT,KEY}` (paths made absolute),
//! so every worker and stage it starts reads the same files from its environment; a worker started by
//! hand sets the same variables. Loading checks the files once and names the setting of a bad one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context, Result};
use tandem_kv::{ClusterTls, ClusterTlsPaths};

use crate::config::ClusterTlsSettings;

/// The environment variable naming the cluster's CA certificate.
pub const CA_ENV: &str = "TANDEM_CLUSTER_TLS_CA";
/// The environment variable naming this process's certificate.
pub const CERT_ENV: &str = "TANDEM_CLUSTER_TLS_CERT";
/// The environment variable naming its key.
pub const KEY_ENV: &str = "TANDEM_CLUSTER_TLS_KEY";
/// The environment variable naming the fixed server name peers check (`cluster_tls.server_name`).
pub const SERVER_NAME_ENV: &str = "TANDEM_CLUSTER_TLS_SERVER_NAME";

fn paths(s: &ClusterTlsSettings) -> ClusterTlsPaths {
    ClusterTlsPaths {
        ca: s.ca.clone(),
        cert: s.cert.clone(),
        key: s.key.clone(),
        server_name: s.server_name.clone(),
    }
}

/// Loads `settings`' files: a missing, unreadable or mismatched one is an error naming its setting.
pub fn load(settings: &ClusterTlsSettings) -> Result<ClusterTls> {
    Ok(ClusterTls::load(&paths(settings))?)
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_owned())
}

/// Makes `settings` this process's cluster TLS environment, for the workers and stages it starts. Call
/// it before any thread starts (the environment is process-wide).
pub fn export(settings: Option<&ClusterTlsSettings>) {
    if let Some(s) = settings {
        std::env::set_var(CA_ENV, absolute(&s.ca));
        std::env::set_var(CERT_ENV, absolute(&s.cert));
        std::env::set_var(KEY_ENV, absolute(&s.key));
        if let Some(name) = &s.server_name {
            std::env::set_var(SERVER_NAME_ENV, name);
        }
    }
}

/// The cluster TLS settings in this process's environment: `None` when none of the variables is set,
/// an error when only some are.
pub fn from_env() -> Result<Option<ClusterTlsSettings>> {
    let var = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    match (var(CA_ENV), var(CERT_ENV), var(KEY_ENV)) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => Ok(Some(ClusterTlsSettings {
            ca,
            cert,
            key,
            server_name: std::env::var(SERVER_NAME_ENV).ok().filter(|n| !n.is_empty()),
        })),
        _ => bail!("cluster TLS needs all of {CA_ENV}, {CERT_ENV} and {KEY_ENV} (deployment.cluster_tls: ca, cert, key)"),
    }
}

/// This process's cluster TLS, from its environment ([`export`] or the operator), loaded once.
pub fn cluster() -> Result<Option<Arc<ClusterTls>>> {
    static LOADED: OnceLock<Option<Arc<ClusterTls>>> = OnceLock::new();
    if let Some(loaded) = LOADED.get() {
        return Ok(loaded.clone());
    }
    let loaded = match from_env()? {
        None => None,
        Some(s) => Some(Arc::new(load(&s)?)),
    };
    Ok(LOADED.get_or_init(|| loaded).clone())
}

/// `http` or `https`: the scheme of the cluster's internal HTTP links.
pub fn scheme(tls: Option<&ClusterTls>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// The CA certificates in the PEM file `path` (`--ca-cert` of `tandem chat`, `bench` and `probe`): the
/// roots those clients trust, so they can reach an HTTPS server whose certificate a private CA signed
/// (the binary carries no public roots).
pub fn ca_certs(path: &Path) -> Result<Vec<reqwest::Certificate>> {
    let pem = std::fs::read(path)
        .with_context(|| format!("--ca-cert: cannot read {}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .with_context(|| format!("--ca-cert: {} is not PEM", path.display()))?;
    if certs.is_empty() {
        bail!("--ca-cert: {} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// `builder` trusting the CA certificates in `path` when given (`--ca-cert`), else unchanged.
pub fn trusting(
    builder: reqwest::ClientBuilder,
    path: Option<&Path>,
) -> Result<reqwest::ClientBuilder> {
    let Some(path) = path else {
        return Ok(builder);
    };
    Ok(ca_certs(path)?
        .into_iter()
        .fold(builder, |b, cert| b.add_root_certificate(cert)))
}
