//! The Docker Engine API over its unix socket, with hyper (already in the workspace through axum and
//! reqwest): only the calls the autoscaler makes — list a compose service's containers, clone one into
//! a new replica, stop (SIGTERM, which drains a tandem worker) and remove one.
//!
//! A new replica is made the way `docker compose up --scale` makes one: the newest replica's
//! configuration (image, command, environment, mounts, restart policy, labels) with the next
//! `com.docker.compose.container-number`, a fresh hostname, and the same networks with the service's
//! aliases, so the head's DNS discovery finds it under the service name and `docker compose down`
//! removes it with the rest of the project.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// The API version asked for: Docker 20.10's, which every later engine still serves.
const API: &str = "/v1.41";
/// Compose's labels.
pub const LABEL_PROJECT: &str = "com.docker.compose.project";
/// See [`LABEL_PROJECT`].
pub const LABEL_SERVICE: &str = "com.docker.compose.service";
const LABEL_NUMBER: &str = "com.docker.compose.container-number";

/// A Docker Engine reached through its unix socket.
#[derive(Clone, Debug)]
pub struct Docker {
    socket: PathBuf,
}

/// One running replica of a service.
#[derive(Clone, Debug, PartialEq)]
pub struct Replica {
    /// Full container id.
    pub id: String,
    /// Its name, without the leading slash.
    pub name: String,
    /// Its compose container number (0 when unlabelled).
    pub number: u64,
    /// Unix seconds it was created.
    pub created: i64,
}

impl Replica {
    /// The hostname Docker gives it when the configuration sets none: the id's first 12 characters,
    /// which the compose deployment's worker puts in its worker id (`decode-<hostname>`).
    pub fn short_id(&self) -> &str {
        &self.id[..self.id.len().min(12)]
    }
}

impl Docker {
    /// A client of the engine at `socket` (nothing is sent until the first call).
    pub fn new(socket: &Path) -> Docker {
        Docker {
            socket: socket.to_path_buf(),
        }
    }

    /// One API call; returns the status and the JSON answer (`Null` when empty).
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value)> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .with_context(|| {
                format!("connecting to the Docker socket {}", self.socket.display())
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP handshake with the Docker engine")?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "Docker connection ended");
            }
        });
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = Request::builder()
            .method(method.clone())
            .uri(format!("{API}{path}"))
            .header(hyper::header::HOST, "docker")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))?;
        let resp = sender
            .send_request(req)
            .await
            .with_context(|| format!("Docker {method} {path}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        let value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
        };
        Ok((status, value))
    }

    /// A call that must succeed (2xx, or 304 "already so"); the engine's message otherwise.
    async fn ok(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let (status, value) = self.call(method.clone(), path, body).await?;
        if status.is_success() || status == StatusCode::NOT_MODIFIED {
            return Ok(value);
        }
        let message = value
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| value.to_string());
        bail!("Docker {method} {path}: {status}: {message}")
    }

    /// The engine's API version (a reachability check at start-up).
    pub async fn version(&self) -> Result<String> {
        let v = self.ok(Method::GET, "/version", None).await?;
        Ok(v.get("ApiVersion")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned())
    }

    /// The compose project of the container with this hostname (the autoscaler's own container).
    pub async fn project_of(&self, container: &str) -> Result<String> {
        let v = self
            .ok(
                Method::GET,
                &format!("/containers/{}/json", encode(container)),
                None,
            )
            .await?;
        v.pointer("/Config/Labels")
            .and_then(|l| l.get(LABEL_PROJECT))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("container {container} has no {LABEL_PROJECT} label"))
    }

    /// The running containers of `service` in compose project `project`, oldest first.
    pub async fn replicas(&self, project: &str, service: &str) -> Result<Vec<Replica>> {
        let filters = json!({
            "label": [format!("{LABEL_PROJECT}={project}"), format!("{LABEL_SERVICE}={service}")],
            "status": ["running"],
        });
        let v = self
            .ok(
                Method::GET,
                &format!("/containers/json?filters={}", encode(&filters.to_string())),
                None,
            )
            .await?;
        let mut out: Vec<Replica> = v
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| Replica {
                id: c["Id"].as_str().unwrap_or_default().to_owned(),
                name: c["Names"][0]
                    .as_str()
                    .unwrap_or_default()
                    .trim_start_matches('/')
                    .to_owned(),
                number: c["Labels"][LABEL_NUMBER]
                    .as_str()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0),
                created: c["Created"].as_i64().unwrap_or(0),
            })
            .collect();
        out.sort_by_key(|r| (r.created, r.number));
        Ok(out)
    }

    /// The highest container number any container of the service has, running or not (so a new
    /// replica never takes a stopped one's name).
    async fn last_number(&self, project: &str, service: &str) -> Result<u64> {
        let filters = json!({
            "label": [format!("{LABEL_PROJECT}={project}"), format!("{LABEL_SERVICE}={service}")],
        });
        let v = self
            .ok(
                Method::GET,
                &format!(
                    "/containers/json?all=true&filters={}",
                    encode(&filters.to_string())
                ),
                None,
            )
            .await?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["Labels"][LABEL_NUMBER].as_str()?.parse().ok())
            .max()
            .unwrap_or(0))
    }

    /// Starts one more replica of `template`'s service, configured as `template` is; returns its name.
    pub async fn clone_replica(
        &self,
        project: &str,
        service: &str,
        template: &Replica,
    ) -> Result<String> {
        let inspect = self
            .ok(
                Method::GET,
                &format!("/containers/{}/json", template.id),
                None,
            )
            .await?;
        let number = self.last_number(project, service).await? + 1;
        let name = replica_name(&template.name, project, service, number);
        let (create, networks) = create_body(&inspect, number)?;
        let created = self
            .ok(
                Method::POST,
                &format!("/containers/create?name={}", encode(&name)),
                Some(&create),
            )
            .await
            .with_context(|| format!("creating {name}"))?;
        let id = created["Id"]
            .as_str()
            .ok_or_else(|| anyhow!("Docker created {name} without an id: {created}"))?
            .to_owned();
        // The API of 20.10 attaches one network at creation; the others (if any) are connected here.
        for (network, aliases) in networks {
            self.ok(
                Method::POST,
                &format!("/networks/{}/connect", encode(&network)),
                Some(&json!({"Container": id, "EndpointConfig": {"Aliases": aliases}})),
            )
            .await?;
        }
        self.ok(Method::POST, &format!("/containers/{id}/start"), None)
            .await
            .with_context(|| format!("starting {name}"))?;
        Ok(name)
    }

    /// Stops a replica with SIGTERM, waiting up to `grace_secs` for it to exit (a tandem worker drains:
    /// no new work, in-flight requests finish), then removes it; returns its exit code (0: drained
    /// and ended on its own; 137: killed at the end of the grace period).
    pub async fn drain_and_remove(&self, id: &str, grace_secs: u64) -> Result<Option<i64>> {
        self.ok(
            Method::POST,
            &format!("/containers/{id}/stop?t={grace_secs}"),
            None,
        )
        .await?;
        let state = self
            .ok(Method::GET, &format!("/containers/{id}/json"), None)
            .await?;
        let code = state.pointer("/State/ExitCode").and_then(Value::as_i64);
        self.ok(Method::DELETE, &format!("/containers/{id}?v=true"), None)
            .await?;
        Ok(code)
    }
}

/// A network to attach a new replica to: its name and the replica's aliases there.
type Attachment = (String, Vec<String>);

/// The name of replica `number`: the template's name with its trailing number replaced (compose 1.x
/// `project_service_1`, 2.x `project-service-1`), else compose 2.x's form.
fn replica_name(template: &str, project: &str, service: &str, number: u64) -> String {
    if let Some(pos) = template.rfind(['_', '-']) {
        let (head, tail) = template.split_at(pos);
        if tail.len() > 1 && tail[1..].bytes().all(|b| b.is_ascii_digit()) {
            return format!("{head}{}{number}", &tail[..1]);
        }
    }
    format!("{project}-{service}-{number}")
}

/// The `POST /containers/create` body that makes another replica like the inspected one, and the
/// networks beyond the first to connect afterwards (name, aliases).
fn create_body(inspect: &Value, number: u64) -> Result<(Value, Vec<Attachment>)> {
    let mut config = inspect["Config"].clone();
    let obj = config
        .as_object_mut()
        .ok_or_else(|| anyhow!("the template container has no Config"))?;
    // Its own hostname would make every clone the same worker (`decode-<hostname>`): Docker gives
    // each container its id's prefix when none is set.
    obj.remove("Hostname");
    if let Some(labels) = obj.get_mut("Labels").and_then(Value::as_object_mut) {
        labels.insert(LABEL_NUMBER.into(), Value::String(number.to_string()));
    }
    let id = inspect["Id"].as_str().unwrap_or_default();
    let own = |a: &str| {
        !a.is_empty()
            && (id.starts_with(a) || a == inspect["Config"]["Hostname"].as_str().unwrap_or("\0"))
    };
    let mut networks: Vec<Attachment> = inspect["NetworkSettings"]["Networks"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, ep)| {
            let aliases = ep["Aliases"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .filter(|a| !own(a))
                .map(str::to_owned)
                .collect();
            (name.clone(), aliases)
        })
        .collect();
    networks.sort();
    let mut host = inspect["HostConfig"].clone();
    // The template's network is the one Docker attaches at creation: take it first.
    let mode = host["NetworkMode"].as_str().unwrap_or_default().to_owned();
    if let Some(i) = networks.iter().position(|(n, _)| *n == mode) {
        let first = networks.remove(i);
        networks.insert(0, first);
    }
    let mut endpoints = serde_json::Map::new();
    let rest = if networks.is_empty() {
        Vec::new()
    } else {
        let (first, aliases) = networks.remove(0);
        if let Some(h) = host.as_object_mut() {
            h.insert("NetworkMode".into(), Value::String(first.clone()));
        }
        endpoints.insert(first, json!({"Aliases": aliases}));
        networks
    };
    config["HostConfig"] = host;
    config["NetworkingConfig"] = json!({"EndpointsConfig": endpoints});
    Ok((config, rest))
}

/// Percent-encodes a query value or path segment.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_names_follow_the_projects_form() {
        assert_eq!(replica_name("p_decode_1", "p", "decode", 3), "p_decode_3");
        assert_eq!(replica_name("p-decode-2", "p", "decode", 4), "p-decode-4");
        assert_eq!(replica_name("custom", "p", "decode", 2), "p-decode-2");
    }

    #[test]
    fn a_clone_gets_a_fresh_hostname_the_next_number_and_the_service_aliases() {
        let inspect = json!({
            "Id": "abcdef1234567890",
            "Config": {
                "Hostname": "abcdef123456",
                "Image": "tandem:cpu",
                "Env": ["TANDEM_CLUSTER_TOKEN=x"],
                "Labels": {LABEL_PROJECT: "p", LABEL_SERVICE: "decode", LABEL_NUMBER: "1"}
            },
            "HostConfig": {"NetworkMode": "p_backend", "Binds": ["/m:/models:ro"]},
            "NetworkSettings": {"Networks": {
                "p_backend": {"Aliases": ["decode", "abcdef123456"]},
                "p_other": {"Aliases": ["decode"]}
            }}
        });
        let (body, rest) = create_body(&inspect, 2).unwrap();
        assert!(body.get("Hostname").is_none());
        assert_eq!(body["Labels"][LABEL_NUMBER], "2");
        assert_eq!(body["Image"], "tandem:cpu");
        assert_eq!(body["HostConfig"]["NetworkMode"], "p_backend");
        assert_eq!(body["HostConfig"]["Binds"][0], "/m:/models:ro");
        assert_eq!(
            body["NetworkingConfig"]["EndpointsConfig"]["p_backend"]["Aliases"],
            json!(["decode"])
        );
        assert_eq!(
            rest,
            vec![("p_other".to_string(), vec!["decode".to_string()])]
        );
    }

    #[test]
    fn encoding_keeps_json_filters_intact() {
        assert_eq!(
            encode("{\"a\":[\"b=c\"]}"),
            "%7B%22a%22%3A%5B%22b%3Dc%22%5D%7D"
        );
    }
}
