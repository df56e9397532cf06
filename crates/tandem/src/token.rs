//! The cluster token (`deployment.cluster_token`, `cluster_token_file` or `TANDEM_CLUSTER_TOKEN`): the
//! secret a deployment's head, workers and stages prove to each other (`tandem_kv::auth`,
//! `tandem_cluster::auth`). It is never logged or printed; a process that resolved it from its config
//! exports it as its own `TANDEM_CLUSTER_TOKEN`, so the workers and stages it starts inherit it through
//! their environment rather than their command line, which any user of the host can read.

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
}
