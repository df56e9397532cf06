//! Router-level tests: whole HTTP requests through `tower::ServiceExt::oneshot` against fakes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::routes::router;
use crate::testing::{fake_state, ByteCodec, FakeBackend, EOS};
use crate::TextCodec;

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// Parses an SSE body, checking the framing: `data: ` events separated by blank lines, `[DONE]` last.
    fn sse_events(&self) -> Vec<Value> {
        assert_eq!(self.headers[header::CONTENT_TYPE], "text/event-stream");
        assert!(
            self.body.ends_with("data: [DONE]\n\n"),
            "stream must end with [DONE]: {:?}",
            self.body
        );
        let blocks: Vec<&str> = self.body.split("\n\n").filter(|b| !b.is_empty()).collect();
        let (done, events) = blocks.split_last().unwrap();
        assert_eq!(*done, "data: [DONE]");
        events
            .iter()
            .map(|b| {
                let data = b
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("bad event {b:?}"));
                assert!(!data.contains('\n'), "one line per event");
                serde_json::from_str(data).unwrap()
            })
            .collect()
    }
}

async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Reply {
    let mut req = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = match body {
        Some(b) => req
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(b.to_owned())),
        None => req.body(Body::empty()),
    }
    .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = to_bytes(response.into_body(), 1 << 24).await.unwrap();
    Reply {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

async fn post(app: &Router, uri: &str, body: Value) -> Reply {
    send(app, "POST", uri, Some(&body.to_string()), &[]).await
}

fn app(reply: &str) -> (Router, Arc<FakeBackend>) {
    let backend = Arc::new(FakeBackend::new(reply));
    (router(fake_state(backend.clone(), None)), backend)
}

fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": "fake", "messages": [{"role": "user", "content": "Hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn assert_error(reply: &Reply, status: StatusCode, param: Option<&str>) {
    assert_eq!(reply.status, status, "{}", reply.body);
    let v = reply.json();
    let err = &v["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(err["type"].is_string(), "{v}");
    assert!(
        err.get("code").is_some() && err.get("param").is_some(),
        "{v}"
    );
    if let Some(p) = param {
        assert_eq!(err["param"], p, "{v}");
    }
}

#[tokio::test]
async fn chat_non_streaming_answer_and_usage() {
    let (app, backend) = app("Hello world");
    let r = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "fake");
    assert_eq!(v["system_fingerprint"], "fp_test");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let prompt = ByteCodec.encode("<user>Hi\n<assistant>", false).unwrap();
    assert_eq!(backend.submitted.lock()[0].prompt, prompt);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["usage"]["completion_tokens"], 12, "11 bytes + EOS");
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + 12);
    assert_eq!(backend.live.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn chat_stream_is_framed_and_reports_usage() {
    let (app, _) = app("Hi there");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.sse_events();
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events
        .iter()
        .filter_map(|e| {
            e["choices"]
                .get(0)
                .and_then(|c| c["delta"]["content"].as_str())
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "Hi there");
    let finishes: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"].get(0).map(|c| &c["finish_reason"]))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, vec![&json!("stop")]);
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 9);
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
        assert_eq!(e["id"], events[0]["id"]);
    }
}

#[tokio::test]
async fn stop_string_truncates_and_releases_the_request() {
    let (app, backend) = app("Hello world, bye");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"stop": ["wor", "zzz"]})),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"]["completion_tokens"], 9,
        "tokens up to the one completing the stop string"
    );
    assert_eq!(backend.live.load(Ordering::SeqCst), 0);

    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"stop": "o w", "stream": true})),
    )
    .await;
    let text: String = r
        .sse_events()
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "Hell");
}

#[tokio::test]
async fn max_tokens_ends_with_length() {
    let (app, backend) = app("Hello world");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"max_completion_tokens": 3})),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "Hel");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(backend.submitted.lock()[0].params.max_tokens, 3);
}

#[tokio::test]
async fn n_choices_get_derived_seeds() {
    let (app, backend) = app("ab");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"n": 3, "seed": 5, "temperature": 0.7})),
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "ab");
    }
    assert_eq!(v["usage"]["completion_tokens"], 9);
    let seeds: Vec<Option<u64>> = backend
        .submitted
        .lock()
        .iter()
        .map(|s| s.params.seed)
        .collect();
    assert_eq!(seeds, vec![Some(5), Some(6), Some(7)]);
    let mut ids: Vec<u64> = backend.submitted.lock().iter().map(|s| s.id).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3, "each choice is its own engine request");
    assert!(backend
        .submitted
        .lock()
        .iter()
        .all(|s| (s.params.temperature - 0.7).abs() < 1e-6));

    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"n": 2, "stream": true})),
    )
    .await;
    let events = r.sse_events();
    for index in 0..2 {
        let text: String = events
            .iter()
            .filter(|e| e["choices"][0]["index"] == index)
            .filter_map(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(text, "ab");
    }
}

#[tokio::test]
async fn chat_logprobs_have_openai_shape() {
    let (app, _) = app("ab");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"logprobs": true, "top_logprobs": 2})),
    )
    .await;
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["token"], "a");
    assert_eq!(content[0]["logprob"], -0.25);
    assert_eq!(content[0]["bytes"], json!([97]));
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(content[0]["top_logprobs"][1]["token"], "`");
    let r = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert!(r.json()["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn completions_accept_all_prompt_forms() {
    let (app, backend) = app("xyz");
    for prompt in [
        json!("ab"),
        json!(["ab", "cd"]),
        json!([97, 98]),
        json!([[97, 98], [99]]),
    ] {
        let r = post(
            &app,
            "/v1/completions",
            json!({"model": "alias", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{prompt}: {}", r.body);
        let v = r.json();
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(v["object"], "text_completion");
        let n_prompts = if prompt.is_string() || prompt[0].is_number() {
            1
        } else {
            2
        };
        assert_eq!(v["choices"].as_array().unwrap().len(), n_prompts);
        for c in v["choices"].as_array().unwrap() {
            assert_eq!(c["text"], "xy");
            assert_eq!(c["finish_reason"], "length");
        }
        assert_eq!(v["usage"]["completion_tokens"], 2 * n_prompts);
    }
    let prompts: Vec<Vec<u32>> = backend
        .submitted
        .lock()
        .iter()
        .map(|s| s.prompt.clone())
        .collect();
    assert_eq!(prompts[1..3], [vec![97, 98], vec![99, 100]]);
    assert_eq!(prompts[5], vec![99]);
}

#[tokio::test]
async fn completions_echo_and_logprobs() {
    let (app, _) = app("xy");
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 5}),
    )
    .await;
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["text"], "abxy");
    assert_eq!(c["finish_reason"], "stop");
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"], json!(["a", "b", "x", "y", "<eos>"]));
    assert_eq!(
        lp["token_logprobs"],
        json!([null, null, -0.25, -0.25, -0.25])
    );
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    assert_eq!(lp["top_logprobs"][2], json!({"x": -0.25}));
    assert!(lp["top_logprobs"][0].is_null());

    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": "ab", "echo": true, "stream": true, "max_tokens": 5}),
    )
    .await;
    let text: String = r
        .sse_events()
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "abxy");
}

#[tokio::test]
async fn validation_errors_are_openai_shaped_400s() {
    let (app, backend) = app("x");
    let r = send(&app, "POST", "/v1/chat/completions", Some("{not json"), &[]).await;
    assert_error(&r, StatusCode::BAD_REQUEST, None);
    let r = send(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body(json!({})).to_string()),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = post(
        &app,
        "/v1/chat/completions",
        chat_body(json!({"temperature": "hot"})),
    )
    .await;
    assert_error(&r, StatusCode::BAD_REQUEST, None);
    let r = post(&app, "/v1/chat/completions", json!({"model": "fake"})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, None);
    for (extra, param) in [
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"n": 0}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"max_tokens": 9000}), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages",
        ),
    ] {
        let r = post(&app, "/v1/chat/completions", chat_body(extra.clone())).await;
        assert_error(&r, StatusCode::BAD_REQUEST, Some(param));
    }
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": "a", "logprobs": 21}),
    )
    .await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("logprobs"));
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": [300]}),
    )
    .await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("prompt"));
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": ""}),
    )
    .await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("prompt"));
    assert_eq!(
        backend.submitted.lock().len(),
        1,
        "only the valid request reached the backend"
    );
}

#[tokio::test]
async fn unknown_model_is_404_and_queue_full_is_503() {
    let (app, backend) = app("x");
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_error(&r, StatusCode::NOT_FOUND, Some("model"));
    let r = send(&app, "GET", "/v1/models/nope", None, &[]).await;
    assert_error(&r, StatusCode::NOT_FOUND, Some("model"));
    backend.queue_full.store(true, Ordering::SeqCst);
    let r = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, None);
    assert!(r.headers.contains_key(header::RETRY_AFTER));
    let r = send(&app, "GET", "/v1/nothing-here", None, &[]).await;
    assert_error(&r, StatusCode::NOT_FOUND, None);
    assert_eq!(
        send(&app, "GET", "/health", None, &[]).await.status,
        StatusCode::OK
    );
    backend.stopped.store(true, Ordering::SeqCst);
    // Not ready: the /health body's own shape, saying why.
    let r = send(&app, "GET", "/health", None, &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    let v = r.json();
    assert_eq!(v["status"], "unavailable", "{v}");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
}

#[tokio::test]
async fn api_key_guards_v1_and_request_id_is_echoed() {
    let backend = Arc::new(FakeBackend::new("x"));
    let app = router(fake_state(backend, Some("sekret")));
    let r = send(&app, "GET", "/v1/models", None, &[]).await;
    assert_error(&r, StatusCode::UNAUTHORIZED, None);
    let r = send(
        &app,
        "GET",
        "/v1/models",
        None,
        &[("authorization", "Bearer wrong")],
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        &app,
        "GET",
        "/v1/models",
        None,
        &[
            ("authorization", "Bearer sekret"),
            ("x-request-id", "abc-1"),
        ],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["x-request-id"], "abc-1");
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "fake");
    assert_eq!(v["data"][1]["id"], "alias");
    assert_eq!(v["data"][0]["max_model_len"], 8192);
    let r = send(&app, "GET", "/health", None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(!r.headers["x-request-id"].is_empty());
}

/// Tokenizing reveals the served model's vocabulary and costs the server work: with `api_key` set,
/// /tokenize and /detokenize need it like /v1 (they were open before).
#[tokio::test]
async fn tokenize_and_detokenize_need_the_api_key() {
    let app = router(fake_state(Arc::new(FakeBackend::new("x")), Some("sekret")));
    for (path, body) in [
        ("/tokenize", r#"{"prompt": "hi"}"#),
        ("/detokenize", r#"{"tokens": [104, 105]}"#),
    ] {
        assert_error(
            &send(&app, "POST", path, Some(body), &[]).await,
            StatusCode::UNAUTHORIZED,
            None,
        );
        let wrong = [("authorization", "Bearer sekreT")];
        assert_error(
            &send(&app, "POST", path, Some(body), &wrong).await,
            StatusCode::UNAUTHORIZED,
            None,
        );
        let right = [("authorization", "Bearer sekret")];
        let r = send(&app, "POST", path, Some(body), &right).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
    }
    let r = send(
        &app,
        "POST",
        "/detokenize",
        Some(r#"{"tokens": [104, 105]}"#),
        &[("authorization", "Bearer sekret")],
    )
    .await;
    assert_eq!(r.json()["prompt"], "hi");
}

#[tokio::test]
async fn probes_need_the_key_only_when_closed() {
    let open = router(fake_state(Arc::new(FakeBackend::new("x")), Some("sekret")));
    for path in ["/health", "/metrics"] {
        assert_eq!(
            send(&open, "GET", path, None, &[]).await.status,
            StatusCode::OK
        );
    }
    let mut state = fake_state(Arc::new(FakeBackend::new("x")), Some("sekret"));
    Arc::get_mut(&mut state)
        .expect("sole owner")
        .config
        .probes_need_key = true;
    let closed = router(state);
    for path in ["/health", "/metrics"] {
        assert_error(
            &send(&closed, "GET", path, None, &[]).await,
            StatusCode::UNAUTHORIZED,
            None,
        );
        let wrong = [("authorization", "Bearer sekreT")];
        assert_eq!(
            send(&closed, "GET", path, None, &wrong).await.status,
            StatusCode::UNAUTHORIZED
        );
        let right = [("authorization", "Bearer sekret")];
        assert_eq!(
            send(&closed, "GET", path, None, &right).await.status,
            StatusCode::OK
        );
    }
}

#[tokio::test]
async fn tokenize_round_trip_and_metrics() {
    let (app, _) = app("ok");
    let r = post(&app, "/tokenize", json!({"prompt": "héllo"})).await;
    let v = r.json();
    assert_eq!(v["count"], 6);
    assert_eq!(v["max_model_len"], 8192);
    let r = post(&app, "/detokenize", json!({"tokens": v["tokens"]})).await;
    assert_eq!(r.json()["prompt"], "héllo");
    let r = post(
        &app,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(
        r.json()["count"],
        ByteCodec
            .encode("<user>Hi\n<assistant>", false)
            .unwrap()
            .len()
    );
    let r = post(&app, "/tokenize", json!({})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, None);
    let r = post(&app, "/detokenize", json!({"tokens": [EOS + 1]})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("tokens"));

    post(
        &app,
        "/v1/completions",
        json!({"model": "fake", "prompt": "a", "max_tokens": 1}),
    )
    .await;
    let r = send(&app, "GET", "/metrics", None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    for name in [
        "tandem:num_requests_running 0",
        "tandem:num_requests_waiting 0",
        "tandem:kv_blocks_total 64",
        "tandem:time_to_first_token_seconds_count 1",
        "tandem:e2e_request_latency_seconds_count 1",
        "tandem:request_success_total{finished_reason=\"length\"} 1",
        "tandem:prefix_cache_hits_total",
    ] {
        assert!(r.body.contains(name), "missing {name} in\n{}", r.body);
    }
}

#[tokio::test]
async fn client_disconnect_mid_stream_drops_the_request() {
    let mut fake = FakeBackend::new("a long answer that takes a while");
    fake.token_delay = Duration::from_millis(20);
    let backend = Arc::new(fake);
    let app = router(fake_state(backend.clone(), None));
    let req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            chat_body(json!({"stream": true, "n": 2})).to_string(),
        ))
        .unwrap();
    let response = app.oneshot(req).await.unwrap();
    let mut body = response.into_body().into_data_stream();
    use futures::StreamExt;
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(backend.live.load(Ordering::SeqCst), 2);
    drop(body);
    assert_eq!(
        backend.live.load(Ordering::SeqCst),
        0,
        "dropping the body must drop the engine streams"
    );
}

/// A body over the limit is refused with 413 in OpenAI's error shape, before any of it is parsed; one
/// under it is read as usual.
#[tokio::test]
async fn a_body_over_the_limit_gets_413_in_the_openai_shape() {
    let (app, _) = app("hi");
    let big = format!(
        r#"{{"model":"fake","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2 << 20)
    );
    let r = send(&app, "POST", "/v1/chat/completions", Some(&big), &[]).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "request_too_large");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_body_bytes"));
    let small = r#"{"model":"fake","messages":[{"role":"user","content":"hello"}]}"#;
    let r = send(&app, "POST", "/v1/chat/completions", Some(small), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

#[tokio::test]
async fn cluster_lists_a_colocated_server_as_one_worker_behind_the_api_key() {
    let backend = Arc::new(FakeBackend::new("x"));
    let app = router(fake_state(backend, Some("sekret")));
    let r = send(&app, "GET", "/v1/cluster", None, &[]).await;
    assert_error(&r, StatusCode::UNAUTHORIZED, None);
    let r = send(
        &app,
        "GET",
        "/v1/cluster",
        None,
        &[("authorization", "Bearer sekret")],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(v["model"], "fake");
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["workers"][0]["role"], "colocated");
    assert_eq!(v["workers"][0]["kv_blocks_total"], 64);
    assert_eq!(v["workers"][0]["healthy"], true);
    assert_eq!(v["routing"]["remote"], 0);
    assert_eq!(v["kv_bytes_moved"], 0);
}

#[tokio::test]
async fn cluster_carries_the_api_latency_histograms() {
    let backend = Arc::new(FakeBackend::new("hello"));
    let app = router(fake_state(backend, None));
    let r = post(&app, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = send(&app, "GET", "/v1/cluster", None, &[]).await.json();
    let latency = &v["latency"];
    assert_eq!(latency["ttft"]["count"], 1, "{v}");
    assert_eq!(latency["e2e"]["count"], 1, "{v}");
    assert!(latency["itl"]["count"].as_u64().unwrap() >= 1, "{v}");
    let buckets = latency["ttft"]["buckets"].as_array().unwrap();
    assert!(buckets.len() > 5);
    assert_eq!(
        buckets.last().unwrap()[1],
        1,
        "every observation is below the last bound"
    );
    // The backend's fields stay at the top level beside it.
    assert_eq!(v["workers"][0]["role"], "colocated");
}

#[tokio::test]
async fn console_is_served_without_the_key_while_its_data_keeps_it() {
    let backend = Arc::new(FakeBackend::new("x"));
    let app = router(fake_state(backend, Some("sekret")));
    let page = send(&app, "GET", "/", None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.headers[header::CONTENT_TYPE],
        "text/html; charset=utf-8"
    );
    assert!(page.headers[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .contains("connect-src 'self'"));
    assert!(page.body.contains("<title>tandem console</title>"));
    for (path, kind) in [
        (
            crate::console::SCRIPT_PATH,
            "text/javascript; charset=utf-8",
        ),
        (crate::console::STYLE_PATH, "text/css; charset=utf-8"),
    ] {
        let r = send(&app, "GET", path, None, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        assert_eq!(r.headers[header::CONTENT_TYPE], kind);
        assert!(!r.body.is_empty());
    }
    let r = send(&app, "GET", "/v1/cluster", None, &[]).await;
    assert_error(&r, StatusCode::UNAUTHORIZED, None);
    let r = send(&app, "GET", "/console/missing.js", None, &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

fn weather_tools(choice: Value) -> Value {
    chat_body(json!({
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }}],
        "tool_choice": choice,
    }))
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

#[tokio::test]
async fn tool_calls_come_back_with_ids_and_finish_reason() {
    let (app, _) = app(CALL);
    let r = post(&app, "/v1/chat/completions", weather_tools(json!("auto"))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    let r = post(&app, "/v1/chat/completions", weather_tools(json!("none"))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["content"], CALL);
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
}

#[tokio::test]
async fn streamed_tool_calls_reassemble_to_the_whole_answer() {
    let (app, _) = app(CALL);
    let mut body = weather_tools(json!("auto"));
    body["stream"] = json!(true);
    let events = post(&app, "/v1/chat/completions", body).await.sse_events();
    let (mut id, mut name, mut args, mut finish) = (None, String::new(), String::new(), None);
    for e in &events {
        let c = &e["choices"][0];
        assert!(
            c["delta"]["content"].as_str().is_none_or(str::is_empty),
            "{e}"
        );
        if let Some(calls) = c["delta"]["tool_calls"].as_array() {
            assert_eq!(calls[0]["index"], 0);
            if let Some(i) = calls[0]["id"].as_str() {
                assert!(id.replace(i.to_owned()).is_none(), "one id per call");
            }
            name.push_str(calls[0]["function"]["name"].as_str().unwrap_or(""));
            args.push_str(calls[0]["function"]["arguments"].as_str().unwrap_or(""));
        }
        if !c["finish_reason"].is_null() {
            finish = Some(c["finish_reason"].clone());
        }
    }
    assert!(id.unwrap().starts_with("call_"));
    assert_eq!(name, "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(finish, Some(json!("tool_calls")));
}

#[tokio::test]
async fn streamed_text_passes_through_when_tools_are_offered() {
    let (app, _) = app("Sunny, 21C.");
    let mut body = weather_tools(json!("auto"));
    body["stream"] = json!(true);
    let events = post(&app, "/v1/chat/completions", body).await.sse_events();
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Sunny, 21C.");
    // Text that cannot open a call streams token by token, not held to the end.
    assert!(events.len() > 5, "{}", events.len());
}

#[tokio::test]
async fn bad_tools_are_openai_shaped_400s() {
    let (app, _) = app("x");
    for (body, param) in [
        (
            weather_tools(json!({"type": "function", "function": {"name": "nope"}})),
            "tool_choice",
        ),
        (weather_tools(json!("sometimes")), "tool_choice"),
        (
            chat_body(json!({"tools": [{"type": "web_search"}]})),
            "tools",
        ),
        (chat_body(json!({"tool_choice": "auto"})), "tool_choice"),
    ] {
        let r = post(&app, "/v1/chat/completions", body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, Some(param));
    }
}

#[tokio::test]
async fn forced_tool_choices_guide_the_output_and_return_calls() {
    let answer = r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#;
    let (app, backend) = app(answer);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, reply) in [
        (named, answer.to_owned()),
        (json!("required"), format!("[{answer}]")),
    ] {
        *backend.reply.lock() = reply;
        for stream in [false, true] {
            let mut body = weather_tools(choice.clone());
            body["stream"] = json!(stream);
            let r = post(&app, "/v1/chat/completions", body).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            let guidance = backend
                .submitted
                .lock()
                .last()
                .unwrap()
                .params
                .guidance
                .clone();
            let Some(tandem_engine::Guidance::JsonSchema(schema)) = guidance else {
                panic!("{choice}: not guided: {guidance:?}");
            };
            assert!(schema.to_string().contains("get_weather"), "{schema}");
            let (name, args, finish) = if stream {
                let (mut name, mut args, mut finish) = (String::new(), String::new(), None);
                for e in r.sse_events() {
                    let c = &e["choices"][0];
                    assert!(
                        c["delta"]["content"].as_str().is_none_or(str::is_empty),
                        "{e}"
                    );
                    if let Some(calls) = c["delta"]["tool_calls"].as_array() {
                        name.push_str(calls[0]["function"]["name"].as_str().unwrap_or(""));
                        args.push_str(calls[0]["function"]["arguments"].as_str().unwrap_or(""));
                    }
                    if !c["finish_reason"].is_null() {
                        finish = Some(c["finish_reason"].clone());
                    }
                }
                (name, args, finish.unwrap())
            } else {
                let v = r.json();
                let c = &v["choices"][0];
                assert!(c["message"]["content"].is_null(), "{v}");
                let call = &c["message"]["tool_calls"][0]["function"];
                (
                    call["name"].as_str().unwrap().to_owned(),
                    call["arguments"].as_str().unwrap().to_owned(),
                    c["finish_reason"].clone(),
                )
            };
            assert_eq!(name, "get_weather", "{choice} stream={stream}");
            assert_eq!(
                serde_json::from_str::<Value>(&args).unwrap(),
                json!({"city": "Paris"})
            );
            assert_eq!(finish, json!("tool_calls"));
        }
    }
    // The answer is the calls, so a response format besides them is refused.
    let mut body = weather_tools(json!("required"));
    body["response_format"] = json!({"type": "json_object"});
    let r = post(&app, "/v1/chat/completions", body).await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("response_format"));
}
