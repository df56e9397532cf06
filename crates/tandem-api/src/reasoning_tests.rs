//! The reasoning parser and `chat_template_kwargs` through the whole router against the fake backend:
//! chat answers and streams, tool calls after the reasoning, the Responses `reasoning` item and its
//! events, and the parser off leaving answers as they were.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::codec::{CodecError, StreamDecoder};
use crate::routes::router;
use crate::testing::{
    fake_reasoning_state, fake_reasoning_state_with, fake_state, ByteCodec, FakeBackend,
};
use crate::TextCodec;

/// A reply with a model-opened block; with the byte codec every byte is a token.
const THOUGHT: &str = "<think>\nPlan.\n</think>\n\nAnswer.";
/// Reasoning tokens of [`THOUGHT`]: the `>` completing `<think>` through the `>` completing `</think>`.
const THOUGHT_TOKENS: usize = 16;

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn thinking_app(reply: &str) -> (Router, Arc<FakeBackend>) {
    let backend = Arc::new(FakeBackend::new(reply));
    (router(fake_reasoning_state(backend.clone())), backend)
}

async fn post_raw(app: &Router, uri: &str, body: Value) -> (StatusCode, String) {
    let req = Request::builder()
        .method("POST")
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = to_bytes(response.into_body(), 1 << 24).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(app: &Router, uri: &str, body: Value) -> (StatusCode, Value) {
    let (status, text) = post_raw(app, uri, body).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, v)
}

/// The `data:` payloads of an SSE body, `[DONE]` left out.
async fn events(app: &Router, uri: &str, body: Value) -> Vec<Value> {
    let (status, text) = post_raw(app, uri, body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    text.split("\n\n")
        .filter_map(|block| block.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "fake", "messages": [{"role": "user", "content": "Hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn weather_tools(extra: Value) -> Value {
    let mut body = chat(json!({
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }}],
    }));
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The streamed chat deltas' `reasoning_content` and `content`, each joined.
fn joined(events: &[Value]) -> (String, String) {
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in events {
        if let Some(c) = e["choices"].get(0) {
            reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    (reasoning, content)
}

#[tokio::test]
async fn chat_answer_splits_the_block_into_reasoning_content() {
    let (app, _) = thinking_app(THOUGHT);
    let (status, v) = post(&app, "/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], "Answer.");
    assert_eq!(message["reasoning_content"], "Plan.");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        THOUGHT_TOKENS
    );
    assert_eq!(v["usage"]["completion_tokens"], THOUGHT.len() + 1, "+ EOS");

    // Without a block the answer is unchanged, and no reasoning is reported.
    let (app, _) = thinking_app("Just text.");
    let (_, v) = post(&app, "/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Just text.");
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        0
    );
}

#[tokio::test]
async fn parser_off_returns_the_text_as_generated() {
    let backend = Arc::new(FakeBackend::new(THOUGHT));
    let app = router(fake_state(backend, None));
    let (_, v) = post(&app, "/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(v["choices"][0]["message"]["content"], THOUGHT);
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert!(v["usage"].get("completion_tokens_details").is_none(), "{v}");
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let evs = events(&app, "/v1/chat/completions", body).await;
    assert_eq!(joined(&evs), (String::new(), THOUGHT.to_owned()));
    assert!(evs.last().unwrap()["usage"]
        .get("completion_tokens_details")
        .is_none());
}

#[tokio::test]
async fn chat_stream_sends_reasoning_deltas_never_mixed_into_content() {
    let (app, _) = thinking_app(THOUGHT);
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}, "n": 2}));
    let evs = events(&app, "/v1/chat/completions", body).await;
    for index in 0..2 {
        let choice: Vec<Value> = evs
            .iter()
            .filter(|e| e["choices"].get(0).is_some_and(|c| c["index"] == index))
            .cloned()
            .collect();
        assert_eq!(joined(&choice), ("Plan.".to_owned(), "Answer.".to_owned()));
        // Reasoning streams while it is generated, token by token, before any content.
        let reasoning_chunks = choice
            .iter()
            .filter(|e| e["choices"][0]["delta"]["reasoning_content"].is_string())
            .count();
        assert!(reasoning_chunks >= 3, "{reasoning_chunks}");
        let first_content = choice
            .iter()
            .position(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty())
            })
            .unwrap();
        let last_reasoning = choice
            .iter()
            .rposition(|e| e["choices"][0]["delta"]["reasoning_content"].is_string())
            .unwrap();
        assert!(last_reasoning < first_content);
    }
    let usage = &evs.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"],
        2 * THOUGHT_TOKENS
    );
}

#[tokio::test]
async fn template_kwargs_reach_the_template_and_set_where_generation_starts() {
    // enable_thinking: true makes the fake template open the block, as Qwen3 thinking templates do.
    let (app, backend) = thinking_app("Plan.\n</think>\n\nAnswer.");
    let body = chat(json!({"chat_template_kwargs": {"enable_thinking": true}}));
    let (status, v) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let prompt = ByteCodec
        .encode("<user>Hi\n<assistant><think>\n", false)
        .unwrap();
    assert_eq!(backend.submitted.lock()[0].prompt, prompt);
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "Plan.");
    assert_eq!(v["choices"][0]["message"]["content"], "Answer.");
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());

    // A block closed in the prompt: what follows is all answer, tags and all.
    let (app, _) = thinking_app("<think>x</think>y");
    let body = chat(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let (_, v) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(v["choices"][0]["message"]["content"], "<think>x</think>y");
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());

    // /tokenize renders with them too.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                      "chat_template_kwargs": {"enable_thinking": true}});
    let (_, v) = post(&app, "/tokenize", body).await;
    assert_eq!(v["count"], prompt.len());
}

#[tokio::test]
async fn template_kwargs_cannot_replace_what_the_server_sets() {
    let (app, backend) = thinking_app("x");
    for key in tandem_model::RESERVED_VARIABLES {
        let body = chat(json!({"chat_template_kwargs": {*key: []}}));
        let (status, v) = post(&app, "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], "chat_template_kwargs", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(key), "{v}");
    }
    assert!(backend.submitted.lock().is_empty());
}

#[tokio::test]
async fn tool_calls_are_parsed_from_the_answer_after_the_reasoning() {
    let reply = format!("<think>\nI need the weather.\n</think>\n\n{CALL}");
    let (app, _) = thinking_app(&reply);
    let (_, v) = post(&app, "/v1/chat/completions", weather_tools(json!({}))).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(
        choice["message"]["reasoning_content"],
        "I need the weather."
    );
    assert!(choice["message"]["content"].is_null(), "{v}");
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );

    let evs = events(
        &app,
        "/v1/chat/completions",
        weather_tools(json!({"stream": true})),
    )
    .await;
    let (reasoning, content) = joined(&evs);
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("I need the weather.", "")
    );
    let names: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"][0]["function"]["name"].as_str())
        .collect();
    assert_eq!(names, "get_weather");
}

#[tokio::test]
async fn reasoning_cut_by_max_tokens_has_no_answer() {
    let (app, _) = thinking_app("<think>\nA long thought that goes on.");
    let (_, v) = post(
        &app,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 12})),
    )
    .await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["message"]["reasoning_content"], "A lo");
    assert!(choice["message"]["content"].is_null(), "{v}");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"], 6,
        "the `>` of <think> onwards"
    );
}

fn responses(extra: Value) -> Value {
    let mut body = json!({"model": "fake", "input": "Hi"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn responses_return_a_reasoning_item_before_the_message() {
    let (app, _) = thinking_app(THOUGHT);
    let (status, v) = post(&app, "/v1/responses", responses(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{v}");
    assert_eq!(output[0]["type"], "reasoning");
    assert!(output[0]["id"].as_str().unwrap().starts_with("rs_"));
    assert_eq!(output[0]["summary"], json!([]));
    assert_eq!(
        output[0]["content"],
        json!([{"type": "reasoning_text", "text": "Plan."}])
    );
    assert_eq!(output[0]["status"], "completed");
    assert_eq!(output[1]["type"], "message");
    assert_eq!(output[1]["content"][0]["text"], "Answer.");
    assert_eq!(
        v["usage"]["output_tokens_details"]["reasoning_tokens"],
        THOUGHT_TOKENS
    );

    // Cut inside the block: the reasoning item alone, incomplete.
    let (_, v) = post(
        &app,
        "/v1/responses",
        responses(json!({"max_output_tokens": 12})),
    )
    .await;
    assert_eq!(v["status"], "incomplete");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{v}");
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[0]["status"], "incomplete");
    assert_eq!(output[0]["content"][0]["text"], "Plan");
}

#[tokio::test]
async fn responses_stream_reasoning_events_then_the_message() {
    let (app, _) = thinking_app(THOUGHT);
    let evs = events(&app, "/v1/responses", responses(json!({"stream": true}))).await;
    let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let mut compact: Vec<&str> = kinds.clone();
    compact.dedup();
    assert_eq!(
        compact,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let of = |kind: &'static str| evs.iter().filter(move |e| e["type"] == kind);
    let deltas: String = of("response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "Plan.");
    let done = of("response.reasoning_text.done").next().unwrap();
    assert_eq!(done["text"], "Plan.");
    assert_eq!(done["output_index"], 0);
    let part = of("response.content_part.added").next().unwrap();
    assert_eq!(part["part"], json!({"type": "reasoning_text", "text": ""}));
    let added: Vec<&Value> = of("response.output_item.added").collect();
    assert_eq!(added[0]["item"]["type"], "reasoning");
    assert_eq!(added[0]["item"]["status"], "in_progress");
    assert_eq!(added[1]["item"]["type"], "message");
    assert_eq!(added[1]["output_index"], 1);
    let text: String = of("response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Answer.");
    let last = evs.last().unwrap();
    let output = &last["response"]["output"];
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[0]["content"][0]["text"], "Plan.");
    assert_eq!(output[1]["content"][0]["text"], "Answer.");
    assert_eq!(
        last["response"]["usage"]["output_tokens_details"]["reasoning_tokens"],
        THOUGHT_TOKENS
    );
}

/// [`ByteCodec`] whose vocabulary also has `<think>` (300) and `</think>` (301) as single tokens, as
/// Qwen3's has: what a reasoning gate needs.
struct TagCodec;

impl TextCodec for TagCodec {
    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, CodecError> {
        match text {
            crate::reasoning::OPEN => Ok(vec![300]),
            crate::reasoning::CLOSE => Ok(vec![301]),
            _ => ByteCodec.encode(text, special),
        }
    }
    fn decode(&self, ids: &[u32], skip: bool) -> Result<String, CodecError> {
        ByteCodec.decode(ids, skip)
    }
    fn stream_decoder(&self) -> Box<dyn StreamDecoder> {
        ByteCodec.stream_decoder()
    }
    fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, CodecError> {
        ByteCodec.render_chat(messages, add_generation_prompt, tools, extra)
    }
    fn vocab_size(&self) -> usize {
        512
    }
}

/// The reasoning gate of the last request the backend got.
fn last_gate(backend: &FakeBackend) -> Option<tandem_engine::ReasoningGate> {
    backend
        .submitted
        .lock()
        .last()
        .unwrap()
        .params
        .reasoning_gate
}

/// A JSON format waits out the thinking block (opened by the prompt, or left to the model) and holds
/// from the first token once the prompt closed it; regex and grammar formats always spell the whole
/// output; a vocabulary without single-token tags gets no gate.
#[tokio::test]
async fn json_formats_wait_out_the_thinking_block() {
    let backend = Arc::new(FakeBackend::new("{}"));
    let app = router(fake_reasoning_state_with(
        backend.clone(),
        Arc::new(TagCodec),
    ));
    let schema =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    let gate = |open| tandem_engine::ReasoningGate { open, close: 301 };
    for (extra, want) in [
        (json!({"response_format": schema}), Some(gate(Some(300)))),
        (
            json!({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": true}}),
            Some(gate(None)),
        ),
        (
            json!({"response_format": schema, "chat_template_kwargs": {"enable_thinking": false}}),
            None,
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "a+"}}),
            None,
        ),
        (json!({}), None),
    ] {
        let (status, v) = post(&app, "/v1/chat/completions", chat(extra.clone())).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(last_gate(&backend), want, "{extra}");
    }
    let (status, v) = post(
        &app,
        "/v1/responses",
        json!({"model": "fake", "input": "Hi", "text": {"format": {"type": "json_object"}}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(last_gate(&backend), Some(gate(Some(300))));
    // Tags spelled over several tokens (the byte codec): the constraint holds from the first token.
    let (app, backend) = thinking_app("{}");
    let (status, _) = post(
        &app,
        "/v1/chat/completions",
        chat(json!({"response_format": schema})),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(last_gate(&backend), None);
}
