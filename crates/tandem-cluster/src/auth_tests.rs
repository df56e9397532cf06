//! The cluster token in one process over loopback: strangers (no token, a wrong one) are refused by
//! every worker control route and by the head's registration, an ingress without the token cannot add
//! a worker that has one, and a deployment sharing it serves end to end with KV pulled over the
//! challenged connection.

use std::time::Duration;

use serde_json::json;
use tandem_testkit::greedy;

use crate::cluster_tests::{collect, engine, prompt, worker_keyed, BLOCK};
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
    Ingress::new(routing, TimeoutConfig::default(), Some("mock".into()), key).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_token_holders_serve_end_to_end() {
    let p = worker_keyed(Role::Prefill, engine(BLOCK), key("cluster-secret")).await;
    let d = worker_keyed(Role::Decode, engine(BLOCK), key("cluster-secret")).await;
    let http = reqwest::Client::new();
    let prefill = json!({"prompt": prompt(0), "params": greedy(4)});
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
    let want = collect(&colocated, prompt(3), greedy(6)).await;
    assert_eq!(collect(&member, prompt(3), greedy(6)).await, want);
    assert!(
        d.service.load().kv.bytes_received > 0,
        "KV moved over the challenged connection"
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
