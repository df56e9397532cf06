//! Any bytes as the body of the API's POST routes, through the real router: parsing, validation,
//! chat-template rendering, tokenization and the answer (streamed or not). A 500 is a finding: client
//! input must get a 4xx or an answer.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use libfuzzer_sys::fuzz_target;
use tandem_api::{ApiConfig, AppState};
use tower::ServiceExt;

const ROUTES: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
];

fn app() -> axum::Router {
    static APP: OnceLock<axum::Router> = OnceLock::new();
    APP.get_or_init(|| {
        let config = ApiConfig {
            served_model_names: vec!["m".to_owned()],
            model_root: "m".to_owned(),
            api_key: None,
            system_fingerprint: "fp_fuzz".to_owned(),
            max_body_bytes: tandem_api::DEFAULT_MAX_BODY_BYTES,
            probes_need_key: false,
            // The reasoning parser on, so its split of the echoed text is fuzzed too.
            reasoning_parser: true,
        };
        let state =
            AppState::new(Arc::new(common::EchoBackend), common::codec(), config).expect("metrics");
        tandem_api::router(Arc::new(state))
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let Some((&route, body)) = data.split_first() else {
        return;
    };
    let path = ROUTES[route as usize % ROUTES.len()];
    common::runtime().block_on(async {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("request");
        let response = app().oneshot(request).await.expect("infallible");
        let status = response.status();
        let text = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        assert_ne!(
            status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{path} answered 500: {}",
            String::from_utf8_lossy(&text)
        );
    });
});
