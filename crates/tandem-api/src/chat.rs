//! `POST /v1/chat/completions`: template rendering, generation, streamed and whole answers.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use crate::codec::CodecError;
use crate::error::ApiError;
use crate::generate::{chat_logprob, collect, submit_choices, AnswerHead};
use crate::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage, MessageContent, Usage,
};

/// The finish reason of a choice that ended in calls: `tool_calls` where the model stopped itself.
fn call_finish(calls: &[ToolCall], finish: Option<&'static str>) -> Option<&'static str> {
    match finish {
        Some("stop") if !calls.is_empty() => Some("tool_calls"),
        f => f,
    }
}
use crate::routes::ApiJson;
use crate::sse::{stream_choices, to_json};
use crate::state::AppState;
use crate::tools::{self, CallHold, ToolCall, ToolSpec};
use crate::validate::{logprobs_count, plan, resolve_max_tokens};

/// Roles a chat template can be expected to handle.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Turns OpenAI messages into the plain JSON objects templates expect: text content, known roles.
fn normalize_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    messages
        .iter()
        .map(|m| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!(
                        "unknown role `{}`; expected one of {}",
                        m.role,
                        ROLES.join(", ")
                    ),
                    Some("messages"),
                ));
            }
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!(
                                    "content part type `{kind}` is not supported by a text model"
                                ),
                                    Some("messages"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            let mut obj = m.extra.clone();
            tools::template_message(&mut obj);
            obj.insert("role".to_owned(), Value::from(m.role.clone()));
            obj.insert("content".to_owned(), Value::from(content));
            Ok(Value::Object(obj))
        })
        .collect()
}

/// Renders messages with the chat template and tokenizes the result without adding special tokens
/// again (the template already wrote BOS and friends).
pub fn render_and_encode(
    state: &AppState,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    tools: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let messages = normalize_messages(messages)?;
    let prompt = state
        .codec
        .render_chat(&messages, add_generation_prompt, tools)
        .map_err(|e| match e {
            CodecError::Tokenizer(_) => ApiError::internal(e.to_string()),
            CodecError::Template(_) | CodecError::NoChatTemplate => {
                ApiError::invalid(e.to_string(), Some("messages"))
            }
        })?;
    let ids = state
        .codec
        .encode(&prompt, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    if ids.is_empty() {
        return Err(ApiError::invalid(
            "the rendered prompt is empty",
            Some("messages"),
        ));
    }
    Ok(ids)
}

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    state.check_model(&req.model)?;
    let top = logprobs_count(req.top_logprobs, "top_logprobs")?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    if top.is_some_and(|k| k > 0) && !want_logprobs {
        return Err(ApiError::invalid(
            "top_logprobs requires logprobs=true",
            Some("top_logprobs"),
        ));
    }
    let logprobs = want_logprobs.then(|| top.unwrap_or(0));
    let (max_tokens, max_param) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let mut plan = plan(&req.sampling, max_tokens, max_param, logprobs)?;
    let spec = tools::chat_spec(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?
    .filter(ToolSpec::parses_calls);
    if let Some(spec) = &spec {
        spec.guide(&mut plan.params, "response_format")?;
    }
    let prompt = render_and_encode(
        &state,
        &req.messages,
        req.add_generation_prompt.unwrap_or(true),
        req.tools.as_ref(),
    )?;
    let max_tokens =
        resolve_max_tokens(plan.max_tokens, prompt.len(), state.backend.max_model_len())?;
    let runs = submit_choices(&state, &prompt, &plan, max_tokens, arrived)?;
    let head = AnswerHead::new(&state, "chatcmpl");
    let chunk = {
        let head = head.clone();
        move |choices: Vec<ChatChunkChoice>, usage: Option<Usage>| -> ChatCompletionChunk {
            head.answer("chat.completion.chunk", choices, usage)
        }
    };

    if plan.stream {
        let prelude = (0..plan.n)
            .map(|index| {
                to_json(&chunk(
                    vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                            tool_calls: None,
                        },
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                ))
            })
            .collect();
        let codec = state.codec.clone();
        let step_chunk = chunk.clone();
        let mut holds: std::collections::HashMap<usize, CallHold> = Default::default();
        let render = move |index: usize, step: crate::generate::Step| {
            let entry = chat_logprob(codec.as_ref(), &step.token);
            let (mut text, mut calls) = (step.text, Vec::new());
            if let Some(spec) = &spec {
                let hold = holds.entry(index).or_insert_with(|| CallHold::new(spec));
                text = hold.push(&text);
                if step.finish.is_some() {
                    let (rest, found) = hold.finish(spec);
                    text.extend(rest);
                    calls = found;
                }
            }
            let finish = call_finish(&calls, step.finish);
            let has_calls = !calls.is_empty();
            let delta = |content: Option<String>, tool_calls| ChatDelta {
                role: None,
                content,
                tool_calls,
            };
            let mut events = Vec::new();
            if !text.is_empty() || entry.is_some() || (finish.is_some() && !has_calls) {
                let logprobs = logprobs.map(|_| ChatLogprobs {
                    content: entry.into_iter().collect(),
                });
                let content = (!text.is_empty()).then_some(text);
                let finish_reason = if has_calls { None } else { finish };
                events.push(delta(content, None).choice(index, logprobs, finish_reason));
            }
            let call_deltas = calls.into_iter().enumerate().flat_map(|(i, c)| c.deltas(i));
            for d in call_deltas {
                events.push(delta(None, Some(vec![d])).choice(index, None, None));
            }
            if has_calls {
                events.push(ChatDelta::default().choice(index, None, finish));
            }
            events
                .into_iter()
                .map(|c| to_json(&step_chunk(vec![c], None)))
                .collect::<Vec<_>>()
        };
        let usage = plan.include_usage.then(|| {
            let renderer: crate::sse::UsageRenderer =
                Box::new(move |u| to_json(&chunk(Vec::new(), Some(u))));
            (prompt.len(), renderer)
        });
        return Ok(stream_choices(
            runs.into_iter().enumerate().collect(),
            prelude,
            render,
            usage,
        ));
    }

    let collected = futures::future::join_all(runs.into_iter().map(collect)).await;
    let mut choices = Vec::with_capacity(collected.len());
    let mut completion_tokens = 0;
    for (index, c) in collected.into_iter().enumerate() {
        let c = c?;
        completion_tokens += c.tokens.len();
        let logprobs = logprobs.map(|_| ChatLogprobs {
            content: c
                .tokens
                .iter()
                .filter_map(|t| chat_logprob(state.codec.as_ref(), t))
                .collect(),
        });
        let (content, calls) = match &spec {
            Some(spec) => spec.extract(&c.text),
            None => (Some(c.text), Vec::new()),
        };
        choices.push(ChatChoice {
            index,
            finish_reason: call_finish(&calls, c.finish),
            message: AssistantMessage {
                role: "assistant",
                content,
                tool_calls: (!calls.is_empty()).then_some(calls),
            },
            logprobs,
        });
    }
    let usage = Usage::new(prompt.len(), completion_tokens);
    let answer: ChatCompletionResponse = head.answer("chat.completion", choices, usage);
    Ok(Json(answer).into_response())
}
