//! `/v1/responses` through the whole router against the fake backend: request mapping, refusals,
//! the response object and the streamed event sequence.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{header, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::routes::router;
use crate::testing::{fake_state, FakeBackend};

fn app(reply: &str) -> (Router, Arc<FakeBackend>) {
    let backend = Arc::new(FakeBackend::new(reply));
    (router(fake_state(backend.clone(), None)), backend)
}

async fn call(app: &Router, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, String) {
    let req = Request::builder().method(method).uri(uri);
    let req = match body {
        Some(b) => req
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(b.to_string())),
        None => req.body(Body::empty()),
    }
    .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = to_bytes(response.into_body(), 1 << 24).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// POSTs a Responses body (`model` filled in) and parses the JSON answer.
async fn create(app: &Router, mut body: Value) -> (StatusCode, Value) {
    body["model"] = json!("fake");
    let (status, text) = call(app, "POST", "/v1/responses", Some(body)).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, v)
}

/// POSTs a streaming body and parses the events, checking the framing: `event:` equals the data's
/// `type`, sequence numbers count up from 0, no `[DONE]`.
async fn stream(app: &Router, mut body: Value) -> Vec<Value> {
    body["model"] = json!("fake");
    body["stream"] = json!(true);
    let (status, text) = call(app, "POST", "/v1/responses", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|block| {
            let (event, data) = block
                .split_once('\n')
                .unwrap_or_else(|| panic!("bad event {block:?}"));
            let event = event.strip_prefix("event: ").expect("an event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], event);
            data
        })
        .collect();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    events
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

fn assert_400(status: StatusCode, v: &Value, param: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], param, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": true})
}

#[tokio::test]
async fn text_input_gets_a_completed_message_and_usage() {
    let (app, backend) = app("Hello world");
    let (status, v) = create(
        &app,
        json!({"input": "Hi", "instructions": "Be brief.", "temperature": 0.5, "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["model"], "fake");
    assert_eq!(v["store"], false);
    assert_eq!(v["instructions"], "Be brief.");
    assert_eq!(v["temperature"], 0.5);
    assert_eq!(v["tool_choice"], "auto");
    assert_eq!(v["text"]["format"]["type"], "text");
    assert_eq!(v["metadata"]["k"], "v");
    assert!(v["incomplete_details"].is_null() && v["error"].is_null());
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{v}");
    assert_eq!(output[0]["type"], "message");
    assert!(output[0]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["status"], "completed");
    assert_eq!(output[0]["content"][0]["type"], "output_text");
    assert_eq!(output[0]["content"][0]["text"], "Hello world");
    // The fake codec renders `<role>content` lines: instructions come first, as a system message.
    let prompt = "<system>Be brief.\n<user>Hi\n<assistant>";
    assert_eq!(v["usage"]["input_tokens"], prompt.len());
    assert_eq!(v["usage"]["output_tokens"], "Hello world".len() + 1);
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + 12);
    let sent = backend.submitted.lock()[0].clone();
    assert_eq!(
        sent.prompt,
        prompt.bytes().map(u32::from).collect::<Vec<_>>()
    );
    assert_eq!(sent.params.temperature, 0.5);
}

#[tokio::test]
async fn max_output_tokens_leaves_the_response_incomplete() {
    let (app, backend) = app("Hello world");
    let (status, v) = create(&app, json!({"input": "Hi", "max_output_tokens": 3})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["max_output_tokens"], 3);
    assert_eq!(v["output"][0]["status"], "incomplete");
    assert_eq!(v["output"][0]["content"][0]["text"], "Hel");
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert_eq!(backend.submitted.lock()[0].params.max_tokens, 3);
}

#[tokio::test]
async fn items_become_chat_turns_with_tool_calls_and_results() {
    let (app, backend) = app("It is sunny.");
    let input = json!([
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Anything else?", "annotations": []}]},
        {"role": "user", "content": "No."},
    ]);
    let (status, v) = create(&app, json!({"input": input, "tools": [weather_tool()]})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], "It is sunny.");
    assert_eq!(v["tools"][0]["name"], "get_weather", "tools echo as sent");
    let prompt = String::from_utf8(
        backend.submitted.lock()[0]
            .prompt
            .iter()
            .map(|&t| t as u8)
            .collect(),
    )
    .unwrap();
    assert_eq!(
        prompt,
        "<developer>Use tools.\n<user>Weather in Paris?\n<assistant>\n<tool>21C\n\
         <assistant>Anything else?\n<user>No.\n<assistant>"
    );
}

#[test]
fn calls_join_their_assistant_turn_and_outputs_name_their_function() {
    let input = json!([
        {"role": "user", "content": "Both cities"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "b", "output": "2"},
    ]);
    let messages = super::input_messages(None, Some(&input)).unwrap();
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "tool"]);
    let calls = &messages[1].extra["tool_calls"];
    assert_eq!(calls[0]["id"], "a");
    assert_eq!(calls[0]["function"]["name"], "f");
    assert_eq!(calls[0]["function"]["arguments"], "{\"x\": 1}");
    assert_eq!(calls[1]["id"], "b");
    assert_eq!(messages[2].extra["tool_call_id"], "a");
    assert_eq!(messages[2].extra["name"], "f");
    assert!(
        matches!(&messages[2].content, Some(crate::protocol::MessageContent::Text(t)) if t == "1")
    );
    // A call with no assistant turn before it opens one with no text.
    let alone = json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]);
    let messages = super::input_messages(Some("sys"), Some(&alone)).unwrap();
    assert_eq!(messages[0].role, "system");
    assert_eq!(messages[1].role, "assistant");
    assert!(messages[1].content.is_none());
}

#[tokio::test]
async fn function_calls_come_back_as_output_items() {
    let (app, _) = app(CALL);
    let (status, v) = create(
        &app,
        json!({"input": "Weather?", "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "completed");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "a call-only answer has no message: {v}");
    let call = &output[0];
    assert_eq!(call["type"], "function_call");
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // tool_choice none: the call text is the answer.
    let (_, v) = create(
        &app,
        json!({"input": "Weather?", "tools": [weather_tool()], "tool_choice": "none"}),
    )
    .await;
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["text"], CALL);
}

#[tokio::test]
async fn max_tool_calls_caps_the_calls() {
    let two = format!("{CALL}{CALL}");
    let (app, _) = app(&two);
    let (_, v) = create(&app, json!({"input": "x", "tools": [weather_tool()]})).await;
    assert_eq!(v["output"].as_array().unwrap().len(), 2, "{v}");
    let (_, v) = create(
        &app,
        json!({"input": "x", "tools": [weather_tool()], "max_tool_calls": 1}),
    )
    .await;
    assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
}

#[tokio::test]
async fn text_format_reaches_the_engine_as_guidance() {
    let (app, backend) = app("{}");
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let (status, v) = create(
        &app,
        json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": true}}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["text"]["format"]["name"], "A");
    let (_, _) = create(
        &app,
        json!({"input": "x", "text": {"format": {"type": "json_object"}}}),
    )
    .await;
    let (_, _) = create(
        &app,
        json!({"input": "x", "text": {"format": {"type": "text"}}}),
    )
    .await;
    let sent = backend.submitted.lock();
    assert_eq!(
        sent[0].params.guidance,
        Some(tandem_engine::Guidance::JsonSchema(schema))
    );
    assert_eq!(
        sent[1].params.guidance,
        Some(tandem_engine::Guidance::JsonObject)
    );
    assert_eq!(sent[2].params.guidance, None);
}

#[tokio::test]
async fn unsupported_fields_are_400s_naming_the_field() {
    let (app, backend) = app("x");
    let cases = [
        (json!({"input": "x", "store": true}), "store"),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"input": "x", "conversation": "conv_1"}),
            "conversation",
        ),
        (json!({"input": "x", "background": true}), "background"),
        (
            json!({"input": "x", "include": ["file_search_call.results"]}),
            "include",
        ),
        (
            json!({"input": "x", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (json!({"input": "x", "truncation": "auto"}), "truncation"),
        (json!({"input": "x", "top_logprobs": 21}), "top_logprobs"),
        (json!({"input": "x", "frobnicate": 1}), "frobnicate"),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools",
        ),
        (
            json!({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}),
            "tools",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}),
            "tools",
        ),
        (
            json!({"input": "x", "tools": [weather_tool()], "tool_choice": {"type": "web_search_preview"}}),
            "tool_choice",
        ),
        (
            json!({"input": "x", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}),
            "text.format.name",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": [1]}}}),
            "text.format.schema",
        ),
        (json!({"input": "x", "temperature": 3}), "temperature"),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "x", "max_output_tokens": 100000}),
            "max_output_tokens",
        ),
        (json!({"input": "x", "max_tool_calls": 0}), "max_tool_calls"),
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": 3}), "input"),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": []}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                  {"type": "input_image", "image_url": "http://x/y.png"}]}]}),
            "input[0].content[1].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f"}]}),
            "input[0]",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}),
            "input[0]",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = create(&app, body.clone()).await;
        assert_400(status, &v, param);
    }
    assert!(
        backend.submitted.lock().is_empty(),
        "nothing refused was submitted"
    );
    let (status, v) = create(&app, json!({"input": "x", "store": false, "include": ["reasoning.encrypted_content"],
                                          "truncation": "disabled", "reasoning": null, "user": "u", "service_tier": "auto",
                                          "stream_options": null, "prompt_cache_key": "k", "tool_choice": "auto",
                                          "top_logprobs": 0, "parallel_tool_calls": false})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["user"], "u");
    assert_eq!(v["parallel_tool_calls"], false);
}

#[tokio::test]
async fn wrong_model_is_404_and_stored_responses_are_not_found() {
    let (app, _) = app("x");
    let (status, text) = call(
        &app,
        "POST",
        "/v1/responses",
        Some(json!({"model": "nope", "input": "x"})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
    for method in ["GET", "DELETE"] {
        let (status, text) = call(&app, method, "/v1/responses/resp_123", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(text.contains("does not store"), "{text}");
    }
}

#[tokio::test]
async fn the_key_guards_responses_like_every_v1_route() {
    let backend = Arc::new(FakeBackend::new("x"));
    let app = router(fake_state(backend, Some("sekret")));
    let (status, _) = call(
        &app,
        "POST",
        "/v1/responses",
        Some(json!({"model": "fake", "input": "x"})),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn stream_sends_the_event_sequence_and_deltas_add_up() {
    let (app, _) = app("Hello world");
    let events = stream(&app, json!({"input": "Hi"})).await;
    let k = kinds(&events);
    let deltas = k
        .iter()
        .filter(|t| **t == "response.output_text.delta")
        .count();
    assert_eq!(deltas, "Hello world".len());
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(k, expected);
    assert_eq!(events[0]["response"]["status"], "in_progress");
    assert!(events[0]["response"]["usage"].is_null());
    let id = &events[0]["response"]["id"];
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world");
    let item_id = &events[2]["item"]["id"];
    for e in &events[2..events.len() - 1] {
        let id = e.get("item_id").unwrap_or(&e["item"]["id"]);
        assert_eq!(id, item_id, "{e}");
        assert_eq!(e["output_index"], 0);
    }
    let done = &events[events.len() - 4];
    assert_eq!(done["text"], "Hello world");
    let last = &events[events.len() - 1]["response"];
    assert_eq!(&last["id"], id);
    assert_eq!(last["status"], "completed");
    assert_eq!(last["output"][0]["content"][0]["text"], "Hello world");
    assert_eq!(last["usage"]["output_tokens"], 12);
}

#[tokio::test]
async fn streamed_cut_ends_with_response_incomplete() {
    let (app, _) = app("Hello world");
    let events = stream(&app, json!({"input": "Hi", "max_output_tokens": 4})).await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(
        last["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );
    assert_eq!(last["response"]["output"][0]["status"], "incomplete");
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hell");
}

#[tokio::test]
async fn streamed_function_calls_have_argument_events() {
    let (app, _) = app(CALL);
    let events = stream(
        &app,
        json!({"input": "Weather?", "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(
        kinds(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let added = &events[2]["item"];
    assert_eq!(added["type"], "function_call");
    assert_eq!(added["status"], "in_progress");
    assert_eq!(added["arguments"], "");
    assert_eq!(events[3]["item_id"], added["id"]);
    let args = events[3]["delta"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(args).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(events[4]["arguments"], args);
    assert_eq!(events[4]["name"], "get_weather");
    let done = &events[5]["item"];
    assert_eq!(done["call_id"], added["call_id"]);
    assert_eq!(done["status"], "completed");
    assert_eq!(
        events[6]["response"]["output"][0]["call_id"],
        added["call_id"]
    );
}

#[tokio::test]
async fn an_empty_answer_still_has_a_message() {
    let (app, _) = app("");
    let (_, v) = create(&app, json!({"input": "Hi"})).await;
    assert_eq!(v["output"][0]["content"][0]["text"], "");
    let events = stream(&app, json!({"input": "Hi"})).await;
    assert!(kinds(&events).contains(&"response.output_text.done"));
    assert_eq!(
        events.last().unwrap()["response"]["output"][0]["type"],
        "message"
    );
}

#[tokio::test]
async fn a_failure_mid_stream_is_a_response_failed_event() {
    let (app, backend) = app("Hello");
    backend
        .fail_after
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let events = stream(&app, json!({"input": "Hi"})).await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{events:?}");
    assert_eq!(last["response"]["status"], "failed");
    assert_eq!(last["response"]["error"]["code"], "server_error");
    assert!(last["response"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("boom"));
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hel");
    assert_eq!(last["response"]["output"][0]["status"], "incomplete");
}

#[tokio::test]
async fn a_client_hanging_up_aborts_the_generation() {
    let mut backend = FakeBackend::new("A long answer that keeps going");
    backend.token_delay = std::time::Duration::from_millis(20);
    let backend = Arc::new(backend);
    let app = router(fake_state(backend.clone(), None));
    let req = Request::builder()
        .method("POST")
        .uri("/v1/responses")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            json!({"model": "fake", "input": "x", "stream": true}).to_string(),
        ))
        .unwrap();
    let response = app.oneshot(req).await.unwrap();
    let mut body = response.into_body().into_data_stream();
    use futures::StreamExt;
    body.next().await.unwrap().unwrap();
    assert_eq!(backend.live.load(std::sync::atomic::Ordering::SeqCst), 1);
    drop(body);
    assert_eq!(backend.live.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn logprobs_come_with_the_text_when_included() {
    let (app, backend) = app("Hi!");
    let include = json!(["message.output_text.logprobs"]);
    let (status, v) = create(
        &app,
        json!({"input": "x", "include": include, "top_logprobs": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["top_logprobs"], 2);
    let lp = v["output"][0]["content"][0]["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 4, "three bytes and the end token: {v}");
    assert_eq!(lp[0]["token"], "H");
    assert_eq!(lp[0]["logprob"], -0.25);
    assert_eq!(lp[0]["bytes"], json!([72]));
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let (_, v) = create(&app, json!({"input": "x", "include": include})).await;
    let lp = v["output"][0]["content"][0]["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 4);
    assert!(lp[0]["top_logprobs"].as_array().unwrap().is_empty());
    let (_, v) = create(&app, json!({"input": "x"})).await;
    assert!(v["output"][0]["content"][0]["logprobs"]
        .as_array()
        .unwrap()
        .is_empty());
    {
        let sent = backend.submitted.lock();
        let asked: Vec<_> = sent.iter().map(|s| s.params.logprobs).collect();
        assert_eq!(asked, [Some(2), Some(0), None]);
    }

    let events = stream(
        &app,
        json!({"input": "x", "include": include, "top_logprobs": 1}),
    )
    .await;
    for e in events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
    {
        assert_eq!(e["logprobs"].as_array().unwrap().len(), 1, "{e}");
        assert_eq!(e["logprobs"][0]["token"], e["delta"]);
    }
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap();
    assert_eq!(done["logprobs"].as_array().unwrap().len(), 4, "{done}");
    let last = &events.last().unwrap()["response"];
    assert_eq!(
        last["output"][0]["content"][0]["logprobs"],
        done["logprobs"]
    );
}

#[tokio::test]
async fn a_forced_tool_choice_is_guided_to_the_call() {
    let (app, backend) = app(r#"{"name": "get_weather", "arguments": {"city": "Rome"}}"#);
    let named = json!({"type": "function", "name": "get_weather"});
    let (status, v) = create(
        &app,
        json!({"input": "x", "tools": [weather_tool()], "tool_choice": named}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["output"][0]["type"], "function_call", "{v}");
    assert_eq!(v["output"][0]["name"], "get_weather", "{v}");
    assert!(
        matches!(
            backend.submitted.lock()[0].params.guidance,
            Some(tandem_engine::Guidance::JsonSchema(_))
        ),
        "a forced call went out unguided"
    );
    let (status, v) = create(
        &app,
        json!({"input": "x", "tools": [weather_tool()], "tool_choice": "required",
               "text": {"format": {"type": "json_object"}}}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "text.format", "{v}");
}
