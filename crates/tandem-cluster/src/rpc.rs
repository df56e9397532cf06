//! The ingress's control calls to workers: HTTP with JSON bodies (typed errors for transport failures,
//! non-2xx answers and bad bodies), and the release of a remote prefill pin nobody pulled.

use std::time::Duration;

use serde::Serialize;

use crate::error::ClusterError;
use crate::protocol::{ErrorBody, ReleaseRequest, PATH_RELEASE};

/// `builder` speaking the cluster's mutual TLS when `tls` is given (presenting this process's certificate,
/// trusting only the cluster's CA, no system roots); unchanged otherwise.
pub fn with_cluster_tls(
    builder: reqwest::ClientBuilder,
    tls: Option<&tandem_kv::ClusterTls>,
) -> reqwest::ClientBuilder {
    match tls {
        Some(tls) => builder
            .use_preconfigured_tls((*tls.client_config()).clone())
            .https_only(true),
        None => builder,
    }
}

pub(crate) async fn get_json<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    timeout: Duration,
) -> Result<T, ClusterError> {
    let resp = http
        .get(format!("{url}{path}"))
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| rpc(url, e))?;
    read_json(url, resp).await
}

/// POSTs `body` as JSON; `request_id` (the client request it serves) goes as `X-Request-Id`, so the
/// worker's log lines about it carry the same id as the head's.
pub(crate) async fn post_json<B: Serialize, T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    body: &B,
    timeout: Duration,
    request_id: Option<&str>,
) -> Result<T, ClusterError> {
    let resp = with_request_id(http.post(format!("{url}{path}")), request_id)
        .json(body)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| rpc(url, e))?;
    read_json(url, resp).await
}

/// `builder` with the `X-Request-Id` header when there is an id to carry.
pub(crate) fn with_request_id(
    builder: reqwest::RequestBuilder,
    request_id: Option<&str>,
) -> reqwest::RequestBuilder {
    match request_id {
        Some(id) => builder.header(tandem_telemetry::X_REQUEST_ID.as_str(), id),
        None => builder,
    }
}

pub(crate) fn rpc(url: &str, source: reqwest::Error) -> ClusterError {
    ClusterError::Rpc {
        url: url.to_owned(),
        source,
    }
}

pub(crate) async fn check_status(
    url: &str,
    resp: reqwest::Response,
) -> Result<reqwest::Response, ClusterError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str::<ErrorBody>(&text)
        .map(|b| b.error)
        .unwrap_or(text);
    Err(ClusterError::Remote {
        url: url.to_owned(),
        status,
        message,
    })
}

async fn read_json<T: serde::de::DeserializeOwned>(
    url: &str,
    resp: reqwest::Response,
) -> Result<T, ClusterError> {
    let resp = check_status(url, resp).await?;
    resp.json().await.map_err(|e| rpc(url, e))
}

/// Unpins a prefill worker's transfer unless disarmed (the client went away between prefill and pull).
pub(crate) struct RemotePin {
    pub(crate) http: reqwest::Client,
    pub(crate) url: String,
    pub(crate) transfer_id: u64,
    pub(crate) armed: bool,
}

impl Drop for RemotePin {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (http, url, transfer_id) = (self.http.clone(), self.url.clone(), self.transfer_id);
        rt.spawn(async move {
            let req = ReleaseRequest { transfer_id };
            if let Err(e) = post_json::<_, bool>(&http, &url, PATH_RELEASE, &req, Duration::from_secs(5), None).await {
                tracing::warn!(%url, transfer_id, error = %e, "could not release a prefill pin (its timeout will)");
            }
        });
    }
}
