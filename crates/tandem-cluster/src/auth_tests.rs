//! The cluster token in one process over loopback: strangers (no token, a wrong one) are refused by
//! every worker control route and by the head's registration, an ingress without the token cannot add
//! a worker that has one, and a deployment sharing it serves end to end with KV pulled over the
//! challenged connection.

use std::time::Duration;

use serde_json::json;
use tandem_engine::SamplingParams;

use crate::cluster_tests::{collect, engine, prompt, worker_keyed, worker_with, BLOCK};
use crate::protocol::{
    Role, PATH_DECODE, PATH_INFO, PATH_LOAD, PATH_PREFILL, PATH_REGISTER, PATH_RELEASE,
};
use crate::{ClusterKey, Ingress, RoutingConfig, TimeoutConfig};

fn key(token: &str) -> Option<ClusterKey> {
    ClusterKey::new(token)
}

fn ingress(key: Option<ClusterKey>) -> Ingress {
    let routing = RoutingConfig {
        local_prefill_threshold: BLOCK,
        ..RoutingConfig::default()
    };
    Ingress::new(
        routing,
        TimeoutConfig::default(),
        Some("mock".into()),
        key,
        tandem_api::ServeLimits::default().header_read_timeout,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_token_holders_serve_end_to_end() {
    let p = worker_keyed(Role::Prefill, engine(BLOCK), key("cluster-secret")).await;
    let d = worker_keyed(Role::Decode, engine(BLOCK), key("cluster-secret")).await;
    let http = reqwest::Client::new();
    let prefill = json!({"prompt": prompt(0), "params": SamplingParams::greedy(4)});
    for token in [None, Some("Bearer guess"), Some("cluster-secret")] {
        for w in [&p, &d] {
            let with = |r: reqwest::RequestBuilder| match token {
                Some(t) => r.header("authorization", t),
                None => r,
            };
            for path in [PATH_INFO, PATH_LOAD] {
                let r = with(http.get(format!("{}{path}", w.url)))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 401, "{path} with {token:?}");
            }
            for path in [PATH_PREFILL, PATH_DECODE, PATH_RELEASE] {
                let r = with(http.post(format!("{}{path}", w.url)))
                    .json(&prefill)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 401, "{path} with {token:?}");
            }
            let health = http.get(format!("{}/health", w.url)).send().await.unwrap();
            assert_eq!(health.status(), 200, "/health stays open for probes");
            let metrics = http.get(format!("{}/metrics", w.url)).send().await.unwrap();
            assert_eq!(metrics.status(), 200, "/metrics is open by default");
        }
    }
    let load = p.service.load();
    assert_eq!(
        (load.pinned_transfers, load.engine.prefill_tokens_computed),
        (0, 0),
        "no work started"
    );

    let stranger = ingress(None);
    let err = stranger.register(&p.url).await.unwrap_err();
    assert!(err.to_string().contains("401"), "{err}");
    let wrong = ingress(key("guess"));
    assert!(wrong.register(&d.url).await.is_err());

    let member = ingress(key("cluster-secret"));
    member.register(&p.url).await.unwrap();
    member.register(&d.url).await.unwrap();
    let colocated = engine(BLOCK);
    let want = collect(&colocated, prompt(3), SamplingParams::greedy(6)).await;
    assert_eq!(
        collect(&member, prompt(3), SamplingParams::greedy(6)).await,
        want
    );
    assert!(
        d.service.load().kv.bytes_received > 0,
        "KV moved over the challenged connection"
    );
    // Each worker's /metrics: its engine's counters and the KV it moved, from its own side.
    let scrape = |url: String| {
        let http = http.clone();
        async move {
            let r = http.get(format!("{url}/metrics")).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.text().await.unwrap()
        }
    };
    let value = |text: &str, series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    };
    let (pt, dt) = (scrape(p.url.clone()).await, scrape(d.url.clone()).await);
    assert!(value(&pt, "tandem:prompt_tokens_total") > 0.0, "{pt}");
    assert!(value(&pt, "tandem:kv_transfer_bytes_total{role=\"prefill\"}") > 0.0);
    assert!(value(&dt, "tandem:kv_transfer_bytes_total{role=\"decode\"}") > 0.0);
    assert!(value(&dt, "tandem:generation_tokens_total") >= 5.0, "{dt}");
    assert_eq!(value(&dt, "tandem:worker_draining{role=\"decode\"}"), 0.0);
    assert!(value(&dt, "tandem:kv_blocks_total") > 0.0);
    assert!(
        !dt.contains("tandem:time_to_first_token_seconds"),
        "latency is the head's to observe:\n{dt}"
    );
    // Closed: /metrics asks for the token like the other control routes.
    let closed = worker_with(Role::Decode, engine(BLOCK), key("cluster-secret"), true).await;
    let url = format!("{}/metrics", closed.url);
    assert_eq!(http.get(&url).send().await.unwrap().status(), 401);
    let ok = http
        .get(&url)
        .bearer_auth("cluster-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(
        http.get(format!("{}/health", closed.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // The head's own registration and listing need the token as well.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let head = format!("http://{}", listener.local_addr().unwrap());
    let routes = member.routes();
    tokio::spawn(async move {
        let _ = axum::serve(listener, routes).await;
    });
    let url = format!("{head}{PATH_REGISTER}");
    let body = json!({"url": d.url});
    assert_eq!(http.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(
        http.post(&url).json(&body).send().await.unwrap().status(),
        401
    );
    let ok = http
        .post(&url)
        .bearer_auth("cluster-secret")
        .json(&body)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert!(ok.status().is_success(), "{}", ok.status());
}
