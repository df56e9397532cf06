//! The cluster token (`deployment.cluster_token`, `cluster_token_file` or `TANDEM_CLUSTER_TOKEN`): the
//! secret a deployment's head, workers and stages prove to each other (`tandem_kv::auth`,
//! `tandem_cluster::auth`). It is never logged or printed; a process that resolved it from its config
//! exports it as its own `TANDEM_CLUSTER_TOKEN`, so the workers and stages it starts inherit it through
//! their environment rather than their command line, which any user of the host can read.
//!
//! Secure by default: a P/D head that starts every worker itself and has no token configured makes one
//! ([`generate`]), and a worker or stage whose port is reachable beyond loopback refuses to start without
//! one ([`check_exposure`]) unless the user chose to run open (`allow_unauthenticated`).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use anyhow::{bail, Context, Result};
use tandem_cluster::ClusterKey;

/// The environment variable holding the cluster token.
pub const TOKEN_ENV: &str = "TANDEM_CLUSTER_TOKEN";

/// The token from the config's value or file (at most one of them), else from [`TOKEN_ENV`]; `None`
/// when none is set (the cluster ports are then open to anyone who reaches them).
pub fn resolve(token: Option<&str>, file: Option<&Path>) -> Result<Option<String>> {
    let token = match (token, file) {
        (Some(_), Some(_)) => {
            bail!("set deployment.cluster_token or deployment.cluster_token_file, not both")
        }
        (Some(token), None) => token.trim().to_owned(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("reading the cluster token file {}", file.display()))?
            .trim()
            .to_owned(),
        (None, None) => std::env::var(TOKEN_ENV)
            .unwrap_or_default()
            .trim()
            .to_owned(),
    };
    if token.is_empty() && file.is_some() {
        bail!("the cluster token file is empty");
    }
    if !token.chars().all(|c| c.is_ascii_graphic()) {
        // It travels in an HTTP header: anything else could not be sent, and every call would get 401.
        bail!("the cluster token must be printable ASCII without spaces");
    }
    Ok((!token.is_empty()).then_some(token))
}

/// Makes `token` this process's [`TOKEN_ENV`] for the children it starts. Call it before any thread
/// starts (the environment is process-wide).
pub fn export(token: Option<&str>) {
    if let Some(token) = token {
        std::env::set_var(TOKEN_ENV, token);
    }
}

/// This process's cluster key, from [`TOKEN_ENV`] (set by the operator, the launcher or [`export`]).
pub fn key() -> Option<ClusterKey> {
    ClusterKey::new(&std::env::var(TOKEN_ENV).unwrap_or_default())
}

/// Bytes of randomness in a [`generate`]d token (256 bits, as the HMAC-SHA256 key it becomes).
const GENERATED_BYTES: usize = 32;

/// A fresh random token from the operating system's CSPRNG, as lowercase hex (printable ASCII without
/// spaces, so it travels in a header): the secret of a head that starts its workers itself and was
/// given none.
pub fn generate() -> Result<String> {
    let mut bytes = [0u8; GENERATED_BYTES];
    getrandom::fill(&mut bytes)
        .map_err(|e| anyhow::anyhow!("no randomness for the cluster token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where a P/D head's cluster token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The config, its file or the environment gave it.
    Configured,
    /// None was given and the head starts every worker itself: it made one up ([`generate`]).
    Generated,
    /// None was given and none could be made (workers from other hosts), or the user chose to run open.
    Absent,
}

/// The token of a head running `deployment` (`mode: pd`): the configured one, else a generated one when
/// it starts every worker itself and `allow_unauthenticated` is off, else none.
pub fn for_head(
    deployment: &crate::config::DeploymentSettings,
) -> Result<(Option<String>, Origin)> {
    if let Some(token) = deployment.cluster_token()? {
        return Ok((Some(token), Origin::Configured));
    }
    if deployment.starts_every_worker() && !deployment.allow_unauthenticated {
        return Ok((Some(generate()?), Origin::Generated));
    }
    Ok((None, Origin::Absent))
}

/// Whether a listener bound to `ip` is reachable only from this host (IPv4-mapped loopback included).
pub fn loopback_only(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// The settings that give a worker or stage its token, named by the refusal of an open port.
const TOKEN_SETTINGS: &str = "deployment.cluster_token, deployment.cluster_token_file or \
     TANDEM_CLUSTER_TOKEN (a worker by hand: --cluster-token-file or TANDEM_CLUSTER_TOKEN)";

/// The rule for every port a worker or stage opens: bound beyond loopback it needs the cluster token
/// (`has_token`), unless `allow_unauthenticated` says the user chose to run it open. `what` names the
/// port in the refusal (e.g. "the worker's RPC port").
pub fn exposure(
    what: &str,
    addr: SocketAddr,
    has_token: bool,
    allow_unauthenticated: bool,
) -> Result<()> {
    if has_token || allow_unauthenticated || loopback_only(addr.ip()) {
        return Ok(());
    }
    bail!(
        "{what} listens on {addr}, reachable beyond this host, and no cluster token is set: anyone \
         who reaches it could start work or read KV. Set {TOKEN_SETTINGS}, or, to run it open on \
         purpose, pass --allow-unauthenticated (allow_unauthenticated: true in the deployment section)"
    )
}

/// [`exposure`] for this process's own token ([`key`]); logs a warning when the user allowed an open
/// port beyond loopback.
pub fn check_exposure(what: &str, addr: SocketAddr, allow_unauthenticated: bool) -> Result<()> {
    let has_token = key().is_some();
    exposure(what, addr, has_token, allow_unauthenticated)?;
    if !has_token && !loopback_only(addr.ip()) {
        tracing::warn!(%addr, "{what} is open beyond loopback without a cluster token (allow_unauthenticated)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_value_or_file_is_read_trimmed_and_both_at_once_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        assert_eq!(
            resolve(None, Some(&file)).unwrap().as_deref(),
            Some("from-file")
        );
        assert_eq!(
            resolve(Some(" yaml "), None).unwrap().as_deref(),
            Some("yaml")
        );
        assert!(resolve(Some("yaml"), Some(&file)).is_err());
        assert!(resolve(Some("two words"), None).is_err());
        assert!(resolve(Some("caf\u{e9}"), None).is_err());
        std::fs::write(&file, "\n").unwrap();
        assert!(
            resolve(None, Some(&file)).is_err(),
            "an empty file is an error"
        );
        let missing = dir.join("absent");
        let err = resolve(None, Some(&missing)).unwrap_err();
        assert!(format!("{err:#}").contains("absent"), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_generated_token_is_fresh_printable_and_accepted() {
        let (a, b) = (generate().unwrap(), generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 2 * GENERATED_BYTES);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_eq!(
            resolve(Some(&a), None).unwrap().as_deref(),
            Some(a.as_str())
        );
    }

    #[test]
    fn a_head_generates_a_token_only_when_it_starts_every_worker_and_may() {
        let head = |yaml: &str| {
            let file = crate::config::Settings::from_yaml(yaml).unwrap();
            let (token, origin) = for_head(file.deployment.as_ref().unwrap()).unwrap();
            assert_eq!(token.is_some(), origin != Origin::Absent, "{yaml}");
            origin
        };
        assert_eq!(
            head("deployment: {mode: pd, cluster_token: given}\n"),
            Origin::Configured
        );
        if std::env::var_os(TOKEN_ENV).is_some() {
            return;
        }
        for starts_all in [
            "deployment: {mode: pd}\n",
            "deployment: {mode: pd, prefill: {replicas: 2}, decode: {replicas: 1}}\n",
            "deployment: {mode: pd, discovery: {mode: static}}\n",
        ] {
            assert_eq!(head(starts_all), Origin::Generated, "{starts_all}");
        }
        for remote in [
            "deployment: {mode: pd, prefill: {replicas: 0}}\n",
            "deployment: {mode: pd, decode: {replicas: 0}}\n",
            "deployment: {mode: pd, discovery: {mode: dns, prefill: 'p:8100', decode: 'd:8100'}}\n",
            "deployment: {mode: pd, allow_unauthenticated: true}\n",
        ] {
            assert_eq!(head(remote), Origin::Absent, "{remote}");
        }
    }

    #[test]
    fn only_loopback_binds_may_run_without_a_token() {
        let at = |ip: &str| SocketAddr::new(ip.parse().unwrap(), 8100);
        for ip in ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"] {
            assert!(loopback_only(at(ip).ip()), "{ip}");
            assert!(exposure("the port", at(ip), false, false).is_ok(), "{ip}");
        }
        for ip in [
            "0.0.0.0",
            "::",
            "10.0.0.5",
            "192.168.1.20",
            "fe80::1",
            "::ffff:10.0.0.5",
        ] {
            assert!(!loopback_only(at(ip).ip()), "{ip}");
            let err = exposure("the worker's RPC port", at(ip), false, false).unwrap_err();
            let msg = err.to_string();
            for named in [
                "the worker's RPC port",
                "deployment.cluster_token",
                "cluster_token_file",
                "TANDEM_CLUSTER_TOKEN",
                "--allow-unauthenticated",
                "allow_unauthenticated: true",
            ] {
                assert!(msg.contains(named), "{ip}: {named} missing from: {msg}");
            }
            assert!(
                exposure("p", at(ip), true, false).is_ok(),
                "{ip} with a token"
            );
            assert!(
                exposure("p", at(ip), false, true).is_ok(),
                "{ip} allowed open"
            );
        }
    }
}
