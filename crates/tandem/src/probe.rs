//! `tandem probe [URL]`: one HTTP GET that exits 0 when the answer is 2xx and 1 otherwise (refused,
//! timed out, or another status), saying why on stderr. It is the container images' HEALTHCHECK: their
//! Debian base has no curl, and the binary is already there. With cluster TLS in its environment
//! (`TANDEM_CLUSTER_TLS_*`) an `https://` URL is probed with the cluster's certificate; with `--ca-cert`
//! it is checked against that CA alone and no certificate is presented (a head's HTTPS API).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

/// Flags of `tandem probe`.
#[derive(Clone, Debug, Args)]
pub struct ProbeArgs {
    /// URL to GET; a 2xx answer is healthy.
    #[arg(
        env = "TANDEM_PROBE_URL",
        default_value = "http://127.0.0.1:8000/health"
    )]
    pub url: String,
    /// Seconds to wait for the whole answer.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
    /// Sent as `Authorization: Bearer KEY`, for a server with `probes_need_key`.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// PEM CA certificate(s) to trust for an https URL instead of the cluster TLS of the environment;
    /// no client certificate is presented (a head's `server.tls` API signed by a private CA).
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<std::path::PathBuf>,
}

/// GETs `args.url` once; `Ok` when it answers 2xx in time, an error saying what happened otherwise.
pub fn run(args: &ProbeArgs) -> Result<()> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .with_context(|| {
            format!(
                "--timeout {} is not a positive number of seconds",
                args.timeout
            )
        })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(get(args, timeout))
}

async fn get(args: &ProbeArgs, timeout: Duration) -> Result<()> {
    let url = args.url.as_str();
    // An https URL under cluster TLS (TANDEM_CLUSTER_TLS_*, as in a worker's container) is probed as a
    // cluster member: the worker's port asks for a certificate from the cluster CA. `--ca-cert` instead
    // probes as an outsider trusting that CA.
    let cluster_tls = match url.starts_with("https://") && args.ca_cert.is_none() {
        true => crate::tls::cluster()?,
        false => None,
    };
    let builder =
        tandem_cluster::with_cluster_tls(reqwest::Client::builder(), cluster_tls.as_deref());
    let client = crate::tls::trusting(builder, args.ca_cert.as_deref())?
        .timeout(timeout)
        .build()
        .context("building the HTTP client")?;
    let mut request = client.get(url);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let resp = request.send().await.with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        let body: String = body.trim().chars().take(200).collect();
        bail!("GET {url}: {status} {body}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::routing::get as route_get;
    use axum::Router;

    /// A server on a free loopback port in its own thread: /ok answers 200, /down 503, /slow after 2 s,
    /// /keyed 200 only to `Bearer k1`.
    fn server() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = Router::new()
                    .route("/ok", route_get(|| async { "fine" }))
                    .route(
                        "/keyed",
                        route_get(|headers: axum::http::HeaderMap| async move {
                            match headers.get("authorization").map(|v| v.as_bytes()) {
                                Some(b"Bearer k1") => StatusCode::OK,
                                _ => StatusCode::UNAUTHORIZED,
                            }
                        }),
                    )
                    .route(
                        "/down",
                        route_get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "draining") }),
                    )
                    .route(
                        "/slow",
                        route_get(|| async {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            "late"
                        }),
                    );
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        format!("http://{addr}")
    }

    fn probe(url: String, timeout: f64) -> Result<()> {
        run(&ProbeArgs {
            url,
            timeout,
            api_key: None,
            ca_cert: None,
        })
    }

    #[test]
    fn the_api_key_opens_closed_probes() {
        let url = format!("{}/keyed", server());
        let e = format!("{:#}", probe(url.clone(), 5.0).unwrap_err());
        assert!(e.contains("401"), "{e}");
        let keyed = |key: &str| {
            run(&ProbeArgs {
                url: url.clone(),
                timeout: 5.0,
                api_key: Some(key.to_owned()),
                ca_cert: None,
            })
        };
        keyed("k1").unwrap();
        assert!(keyed("k2").is_err());
    }

    #[test]
    fn healthy_only_on_a_2xx_answer_in_time() {
        let base = server();
        probe(format!("{base}/ok"), 5.0).unwrap();

        let e = format!("{:#}", probe(format!("{base}/down"), 5.0).unwrap_err());
        assert!(e.contains("503") && e.contains("draining"), "{e}");
        let e = format!("{:#}", probe(format!("{base}/missing"), 5.0).unwrap_err());
        assert!(e.contains("404"), "{e}");
        let e = format!("{:#}", probe(format!("{base}/slow"), 0.3).unwrap_err());
        assert!(e.contains("/slow"), "{e}");
        assert!(probe(format!("{base}/ok"), 0.0).is_err(), "zero timeout");
        assert!(
            probe(format!("{base}/ok"), -1.0).is_err(),
            "negative timeout"
        );
    }

    #[test]
    fn a_closed_port_is_unhealthy() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let e = probe(format!("http://127.0.0.1:{port}/health"), 2.0).unwrap_err();
        assert!(format!("{e:#}").contains(&port.to_string()), "{e:#}");
    }

    #[test]
    fn the_url_defaults_to_the_servers_health_route() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            probe: ProbeArgs,
        }
        let parse = |args: &[&str]| {
            <Cli as clap::Parser>::try_parse_from(
                std::iter::once("probe").chain(args.iter().copied()),
            )
            .map(|c| c.probe)
        };
        // TANDEM_PROBE_URL would override the default; the test environment does not set it.
        if std::env::var_os("TANDEM_PROBE_URL").is_none() {
            assert_eq!(parse(&[]).unwrap().url, "http://127.0.0.1:8000/health");
        }
        let p = parse(&["http://10.0.0.2:8100/v1/worker/info", "--timeout", "2"]).unwrap();
        assert_eq!(p.url, "http://10.0.0.2:8100/v1/worker/info");
        assert_eq!(p.timeout, 2.0);
    }
}
