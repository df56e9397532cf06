//! Worker discovery by DNS (YAML `deployment.discovery`): the orchestrator's endpoints are the membership.
//!
//! A compose service name resolves to every replica's address, a Kubernetes headless Service to every
//! ready pod's, so each role's `host:port` name is re-resolved every `interval_secs` and every address
//! it returns is one worker's RPC server. A new address gets traffic only after the registration
//! handshake (`/v1/worker/info`: role, model identity, KV layout) succeeds; a refusal is logged naming
//! the field and tried again next round. An address the name no longer returns is drained: no new
//! work, and it leaves the registry once its in-flight requests end. A failed lookup changes nothing, so
//! a DNS hiccup never empties the deployment (dead workers are still found by the load polls).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::error::ClusterError;
use crate::ingress::{secs, Ingress};
use crate::protocol::Role;
use crate::registry::Origin;

/// How the ingress learns its workers (YAML `discovery.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryMode {
    /// The workers this process starts plus those that register themselves (`POST /v1/cluster/workers`).
    #[default]
    Static,
    /// Also every address the role's DNS name resolves to, re-resolved every `interval_secs`.
    Dns,
}

/// YAML `deployment.discovery:`: where the ingress finds workers started elsewhere.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `static` (default) or `dns`.
    pub mode: DiscoveryMode,
    /// `host:port` of the prefill workers' RPC (`dns`); every address the host resolves to is one worker.
    pub prefill: Option<String>,
    /// `host:port` of the decode workers' RPC (`dns`).
    pub decode: Option<String>,
    /// Seconds between resolutions.
    pub interval_secs: f64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            mode: DiscoveryMode::Static,
            prefill: None,
            decode: None,
            interval_secs: 3.0,
        }
    }
}

impl DiscoveryConfig {
    /// Checks the section; the error names the key (`discovery.decode`, ...).
    pub fn validate(&self) -> Result<(), ClusterError> {
        let bad = |key, message: String| Err(ClusterError::BadConfig { key, message });
        if !(self.interval_secs.is_finite() && self.interval_secs > 0.0) {
            return bad(
                "discovery.interval_secs",
                format!(
                    "must be a positive number of seconds, not {}",
                    self.interval_secs
                ),
            );
        }
        let names = [
            ("discovery.prefill", &self.prefill),
            ("discovery.decode", &self.decode),
        ];
        match self.mode {
            DiscoveryMode::Static => {
                for (key, name) in names {
                    if name.is_some() {
                        return bad(key, "only applies to `mode: dns`".into());
                    }
                }
            }
            DiscoveryMode::Dns => {
                if self.prefill.is_none() && self.decode.is_none() {
                    return bad(
                        "discovery.decode",
                        "`mode: dns` needs a name for prefill or decode (or both)".into(),
                    );
                }
                for (key, name) in names {
                    if let Some(name) = name {
                        if let Err(message) = check_host_port(name) {
                            return bad(key, message);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The names to resolve, per role (none in `static` mode).
    fn names(&self) -> Vec<(Role, &str)> {
        if self.mode != DiscoveryMode::Dns {
            return Vec::new();
        }
        [(Role::Prefill, &self.prefill), (Role::Decode, &self.decode)]
            .into_iter()
            .filter_map(|(role, name)| name.as_deref().map(|n| (role, n)))
            .collect()
    }
}

/// `host:port` with a host and a numeric port.
fn check_host_port(name: &str) -> Result<(), String> {
    let (host, port) = name
        .rsplit_once(':')
        .ok_or_else(|| format!("`{name}` is not host:port (e.g. decode:8100)"))?;
    if host.trim_matches(['[', ']']).is_empty() {
        return Err(format!("`{name}` has no host"));
    }
    port.parse::<u16>()
        .map_err(|_| format!("`{name}` has no valid port after the last `:`"))?;
    Ok(())
}

/// Turns a `host:port` name into the addresses it stands for now; a trait so tests can script changes.
pub trait Resolver: Send + Sync {
    /// Every address `name` resolves to now.
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (`getaddrinfo` through tokio): what compose and Kubernetes DNS answer.
pub struct DnsResolver;

impl Resolver for DnsResolver {
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let name = name.to_owned();
        Box::pin(async move {
            let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host(name).await?.collect();
            addrs.sort();
            addrs.dedup();
            Ok(addrs)
        })
    }
}

impl Ingress {
    /// One discovery round: resolves each role's name, drains workers whose address left it, registers
    /// the new addresses (handshake first), then removes drained workers with nothing in flight.
    pub async fn discover_once(&self, config: &DiscoveryConfig, resolver: &dyn Resolver) {
        for (role, name) in config.names() {
            let scheme = if self.inner.tls.is_some() {
                "https"
            } else {
                "http"
            };
            match resolver.resolve(name).await {
                Ok(addrs) => {
                    let urls: HashSet<String> =
                        addrs.iter().map(|a| format!("{scheme}://{a}")).collect();
                    self.follow(role, name, &urls).await;
                }
                Err(e) => {
                    tracing::warn!(%name, %role, error = %e, "cannot resolve the workers' name; keeping the workers known")
                }
            }
        }
        self.prune();
    }

    /// Runs [`Self::discover_once`] every `interval_secs`, forever (spawn it).
    pub async fn discover_forever(self, config: DiscoveryConfig, resolver: Arc<dyn Resolver>) {
        let mut tick = tokio::time::interval(secs(config.interval_secs));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.discover_once(&config, resolver.as_ref()).await;
        }
    }

    /// Makes the registry's DNS-found workers of `role` follow `urls`, the addresses `name` has now.
    async fn follow(&self, role: Role, name: &str, urls: &HashSet<String>) {
        let known: Vec<_> = self.inner.workers.read().clone();
        for w in known
            .iter()
            .filter(|w| w.origin == Origin::Dns && w.info.role == role)
        {
            let listed = urls.contains(&w.url);
            if w.vanished.swap(!listed, Ordering::Relaxed) == listed {
                if listed {
                    tracing::info!(url = %w.url, %name, "worker is listed again; routing to it");
                } else {
                    tracing::info!(url = %w.url, %name, "worker left DNS; draining it");
                }
            }
        }
        // New addresses, and DNS-found ones that stopped answering: a new process may have taken the
        // address over, and it must pass the handshake itself (the same process keeps its entry).
        let new: Vec<&String> = urls
            .iter()
            .filter(|u| {
                !known
                    .iter()
                    .any(|w| &&w.url == u && (w.origin == Origin::Static || w.healthy()))
            })
            .collect();
        let joins = new.into_iter().map(|url| async move {
            match self.register_as(url, Some(role), Origin::Dns).await {
                Ok(info) => {
                    tracing::info!(%url, worker = %info.worker_id, %role, %name, "worker discovered")
                }
                Err(e @ ClusterError::Refused { .. }) => {
                    tracing::warn!(error = %e, %name, "discovered worker refused; trying again next round")
                }
                Err(e) => {
                    tracing::info!(%url, error = %e, "discovered worker not answering yet; trying again next round")
                }
            }
        });
        futures::future::join_all(joins).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster_tests::{engine, ingress, worker, worker_on, TestWorker, BLOCK};
    use parking_lot::Mutex;
    use tandem_api::GenerateBackend;

    /// A resolver answering whatever the test set last (an error when unset).
    #[derive(Default)]
    struct Scripted(Mutex<Option<Vec<SocketAddr>>>);

    impl Scripted {
        fn set(&self, workers: &[&TestWorker]) {
            *self.0.lock() = Some(workers.iter().map(|w| addr(w)).collect());
        }
    }

    impl Resolver for Scripted {
        fn resolve(&self, _name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
            let answer = self.0.lock().clone();
            Box::pin(
                async move { answer.ok_or_else(|| std::io::Error::other("NXDOMAIN (scripted)")) },
            )
        }
    }

    fn addr(w: &TestWorker) -> SocketAddr {
        w.url.trim_start_matches("http://").parse().unwrap()
    }

    fn dns(prefill: Option<&str>, decode: Option<&str>) -> DiscoveryConfig {
        DiscoveryConfig {
            mode: DiscoveryMode::Dns,
            prefill: prefill.map(str::to_owned),
            decode: decode.map(str::to_owned),
            interval_secs: 0.1,
        }
    }

    /// The URLs of the workers the ingress would route `role` to, sorted.
    fn routable(ingress: &Ingress, role: Role) -> Vec<String> {
        let mut urls: Vec<String> = ingress
            .routable(role)
            .iter()
            .map(|w| w.url.clone())
            .collect();
        urls.sort();
        urls
    }

    fn sorted(workers: &[&TestWorker]) -> Vec<String> {
        let mut urls: Vec<String> = workers.iter().map(|w| w.url.clone()).collect();
        urls.sort();
        urls
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn workers_follow_the_name_and_a_vanished_one_leaves_after_its_requests() {
        let (a, b) = (
            worker(Role::Decode, BLOCK).await,
            worker(Role::Decode, BLOCK).await,
        );
        let ingress = ingress(BLOCK);
        let resolver = Scripted::default();
        let config = dns(None, Some("decode:8100"));
        resolver.set(&[&a]);
        ingress.discover_once(&config, &resolver).await;
        assert_eq!(routable(&ingress, Role::Decode), sorted(&[&a]));
        assert!(ingress.health().await.is_ok());

        resolver.set(&[&a, &b]);
        ingress.discover_once(&config, &resolver).await;
        assert_eq!(routable(&ingress, Role::Decode), sorted(&[&a, &b]));

        // A lookup failure changes nothing.
        *resolver.0.lock() = None;
        ingress.discover_once(&config, &resolver).await;
        assert_eq!(routable(&ingress, Role::Decode), sorted(&[&a, &b]));

        // `a` leaves the name while a request of this ingress is still on it: drained, not removed.
        let entry_a = ingress
            .routable(Role::Decode)
            .into_iter()
            .find(|w| w.url == a.url)
            .unwrap();
        let busy = entry_a.track();
        resolver.set(&[&b]);
        ingress.discover_once(&config, &resolver).await;
        assert_eq!(routable(&ingress, Role::Decode), sorted(&[&b]));
        let listed = ingress.workers();
        assert_eq!(listed.len(), 2);
        assert!(listed.iter().any(|w| w.url == a.url && w.draining));
        drop(busy);
        ingress.discover_once(&config, &resolver).await;
        let listed: Vec<String> = ingress.workers().into_iter().map(|w| w.url).collect();
        assert_eq!(listed, [b.url.as_str()], "drained and idle: removed");

        // Back in the name: handshake again, routable again.
        resolver.set(&[&a, &b]);
        ingress.discover_once(&config, &resolver).await;
        assert_eq!(routable(&ingress, Role::Decode), sorted(&[&a, &b]));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mismatched_or_misplaced_worker_is_refused_every_round_until_fixed() {
        let good = worker(Role::Decode, BLOCK).await;
        let other_block = worker_on(Role::Decode, engine(BLOCK * 2)).await;
        let prefill = worker(Role::Prefill, BLOCK).await;
        let ingress = ingress(BLOCK);
        let resolver = Scripted::default();
        let config = dns(None, Some("decode:8100"));
        resolver.set(&[&good]);
        ingress.discover_once(&config, &resolver).await;
        // A worker with another block size, and a prefill worker under the decode name.
        resolver.set(&[&good, &other_block, &prefill]);
        for _ in 0..2 {
            ingress.discover_once(&config, &resolver).await;
            assert_eq!(routable(&ingress, Role::Decode), sorted(&[&good]));
            assert!(ingress.routable(Role::Prefill).is_empty());
        }
        let err = ingress
            .register_as(&other_block.url, Some(Role::Decode), Origin::Dns)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        let err = ingress
            .register_as(&prefill.url, Some(Role::Decode), Origin::Dns)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("role"), "{err}");
        // Listed under its own role it is admitted.
        let config = dns(Some("prefill:8100"), Some("decode:8100"));
        let both = Both {
            prefill: vec![addr(&prefill)],
            decode: vec![addr(&good)],
        };
        ingress.discover_once(&config, &both).await;
        assert_eq!(routable(&ingress, Role::Prefill), sorted(&[&prefill]));
    }

    /// Answers each role's name with its own addresses.
    struct Both {
        prefill: Vec<SocketAddr>,
        decode: Vec<SocketAddr>,
    }

    impl Resolver for Both {
        fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
            let answer = if name.starts_with("prefill") {
                self.prefill.clone()
            } else {
                self.decode.clone()
            };
            Box::pin(async move { Ok(answer) })
        }
    }

    #[test]
    fn the_section_is_checked_naming_the_key() {
        let ok = dns(Some("prefill:8100"), Some("decode:8100"));
        ok.validate().unwrap();
        DiscoveryConfig::default().validate().unwrap();
        let cases = [
            (dns(None, None), "discovery.decode"),
            (dns(Some("prefill"), None), "discovery.prefill"),
            (dns(None, Some("decode:http")), "discovery.decode"),
            (dns(None, Some(":8100")), "discovery.decode"),
            (
                DiscoveryConfig {
                    interval_secs: 0.0,
                    ..ok.clone()
                },
                "discovery.interval_secs",
            ),
            (
                DiscoveryConfig {
                    mode: DiscoveryMode::Static,
                    ..ok.clone()
                },
                "discovery.prefill",
            ),
        ];
        for (config, key) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.starts_with(key), "{config:?}: {err}");
        }
    }

    #[tokio::test]
    async fn the_system_resolver_lists_loopback() {
        let addrs = DnsResolver.resolve("localhost:8100").await.unwrap();
        assert!(addrs
            .iter()
            .all(|a| a.port() == 8100 && a.ip().is_loopback()));
        assert!(!addrs.is_empty());
    }
}
