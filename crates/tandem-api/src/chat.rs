//! `POST /v1/chat/completions`: template rendering, generation, streamed and whole answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{Map, Value};
use tandem_engine::{Guidance, ReasoningGate};
use tandem_model::RESERVED_VARIABLES;

use crate::codec::CodecError;
use crate::error::ApiError;
use crate::generate::{chat_logprob, collect_split, submit_choices, AnswerHead};
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
use crate::reasoning::ReasoningParser;
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

/// A rendered chat prompt: its text (where the reasoning parser reads how generation starts) and ids.
#[derive(Debug, Clone)]
pub struct RenderedPrompt {
    /// The template's output.
    pub text: String,
    /// Its tokens.
    pub ids: Vec<u32>,
}

/// 400 when `chat_template_kwargs` names a variable the server sets itself: a client overriding
/// `messages` or `add_generation_prompt` that way would silently get a prompt other than the one the
/// rest of the request describes.
fn check_template_kwargs(kwargs: &Map<String, Value>) -> Result<(), ApiError> {
    match kwargs
        .keys()
        .find(|k| RESERVED_VARIABLES.contains(&k.as_str()))
    {
        Some(key) => Err(ApiError::invalid(
            format!(
                "chat_template_kwargs.{key} cannot be set: the server sets {} itself",
                RESERVED_VARIABLES.join(", ")
            ),
            Some("chat_template_kwargs"),
        )),
        None => Ok(()),
    }
}

/// Renders messages with the chat template (with the request's extra template variables) and
/// tokenizes the result without adding special tokens again (the template already wrote BOS and
/// friends).
pub fn render_and_encode(
    state: &AppState,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    tools: Option<&Value>,
    kwargs: Option<&Map<String, Value>>,
) -> Result<RenderedPrompt, ApiError> {
    let messages = normalize_messages(messages)?;
    let empty = Map::new();
    let kwargs = kwargs.unwrap_or(&empty);
    check_template_kwargs(kwargs)?;
    let prompt = state
        .codec
        .render_chat(&messages, add_generation_prompt, tools, kwargs)
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
    Ok(RenderedPrompt { text: prompt, ids })
}

/// The parser a choice of this prompt starts with, when the server runs one.
pub fn reasoning_parser(state: &AppState, prompt: &RenderedPrompt) -> Option<ReasoningParser> {
    state
        .config
        .reasoning_parser
        .then(|| ReasoningParser::for_prompt(&prompt.text))
}

/// Whether a constraint shapes the answer only — OpenAI's JSON formats and the forced tool calls built on
/// them — so a thinking model thinks freely first. tandem's `regex` and `grammar` formats spell the whole
/// output, a thinking block included.
pub fn answer_format(guidance: Option<&Guidance>) -> bool {
    matches!(
        guidance,
        Some(Guidance::JsonObject | Guidance::JsonSchema(_))
    )
}

/// The reasoning gate of a guided request to a thinking model: its constraint waits out the thinking
/// block that the prompt opened or leaves to the model, so only the answer is constrained. None when no
/// parser runs, the prompt closed the block already (`enable_thinking: false`), or the tags are not
/// single tokens of this vocabulary (the constraint then holds from the first token).
pub fn reasoning_gate(state: &AppState, parser: Option<&ReasoningParser>) -> Option<ReasoningGate> {
    let parser = parser.filter(|p| !p.in_answer())?;
    let single = |tag: &str| match state.codec.encode(tag, false).ok()?.as_slice() {
        [t] => Some(*t),
        _ => None,
    };
    let close = single(crate::reasoning::CLOSE)?;
    let open = if parser.in_block() {
        None
    } else {
        Some(single(crate::reasoning::OPEN)?)
    };
    Some(ReasoningGate { open, close })
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
    let rendered = render_and_encode(
        &state,
        &req.messages,
        req.add_generation_prompt.unwrap_or(true),
        req.tools.as_ref(),
        req.chat_template_kwargs.as_ref(),
    )?;
    let parser = reasoning_parser(&state, &rendered);
    if answer_format(plan.params.guidance.as_ref()) {
        plan.params.reasoning_gate = reasoning_gate(&state, parser.as_ref());
    }
    let prompt = rendered.ids;
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
                            ..ChatDelta::default()
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
        let mut holds: HashMap<usize, CallHold> = Default::default();
        let mut parsers: HashMap<usize, ReasoningParser> = Default::default();
        // Summed over the choices as each finishes; the usage chunk comes after all of them.
        let reasoning_tokens = Arc::new(AtomicUsize::new(0));
        let counted = reasoning_tokens.clone();
        let with_reasoning = parser.is_some();
        let render = move |index: usize, step: crate::generate::Step| {
            let entry = chat_logprob(codec.as_ref(), &step.token);
            let (mut text, mut reasoning, mut calls) = (step.text, String::new(), Vec::new());
            if let Some(first) = &parser {
                let p = parsers.entry(index).or_insert_with(|| first.clone());
                let mut split = p.push(&text);
                if step.finish.is_some() {
                    let rest = p.finish();
                    split.reasoning.push_str(&rest.reasoning);
                    split.content.push_str(&rest.content);
                    counted.fetch_add(p.reasoning_tokens(), Ordering::Relaxed);
                }
                (text, reasoning) = (split.content, split.reasoning);
            }
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
            let mut events = Vec::new();
            if !text.is_empty()
                || !reasoning.is_empty()
                || entry.is_some()
                || (finish.is_some() && !has_calls)
            {
                let logprobs = logprobs.map(|_| ChatLogprobs {
                    content: entry.into_iter().collect(),
                });
                let delta = ChatDelta {
                    content: (!text.is_empty()).then_some(text),
                    reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                    ..ChatDelta::default()
                };
                let finish_reason = if has_calls { None } else { finish };
                events.push(delta.choice(index, logprobs, finish_reason));
            }
            let call_deltas = calls.into_iter().enumerate().flat_map(|(i, c)| c.deltas(i));
            for d in call_deltas {
                let delta = ChatDelta {
                    tool_calls: Some(vec![d]),
                    ..ChatDelta::default()
                };
                events.push(delta.choice(index, None, None));
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
            let renderer: crate::sse::UsageRenderer = Box::new(move |u: Usage| {
                let u = if with_reasoning {
                    u.with_reasoning(reasoning_tokens.load(Ordering::Relaxed))
                } else {
                    u
                };
                to_json(&chunk(Vec::new(), Some(u)))
            });
            (prompt.len(), renderer)
        });
        return Ok(stream_choices(
            runs.into_iter().enumerate().collect(),
            prelude,
            render,
            usage,
        ));
    }

    let with_reasoning = parser.is_some();
    let collected = futures::future::join_all(
        runs.into_iter()
            .map(|run| collect_split(run, parser.clone())),
    )
    .await;
    let mut choices = Vec::with_capacity(collected.len());
    let (mut completion_tokens, mut reasoning_tokens) = (0, 0);
    for (index, c) in collected.into_iter().enumerate() {
        let c = c?;
        completion_tokens += c.tokens.len();
        reasoning_tokens += c.reasoning_tokens;
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
        // A block that took the whole output leaves no answer: null, as vLLM reports it.
        let content = content.filter(|t| c.reasoning.is_none() || !t.is_empty());
        choices.push(ChatChoice {
            index,
            finish_reason: call_finish(&calls, c.finish),
            message: AssistantMessage {
                role: "assistant",
                content,
                reasoning_content: c.reasoning,
                tool_calls: (!calls.is_empty()).then_some(calls),
            },
            logprobs,
        });
    }
    let mut usage = Usage::new(prompt.len(), completion_tokens);
    if with_reasoning {
        usage = usage.with_reasoning(reasoning_tokens);
    }
    let answer: ChatCompletionResponse = head.answer("chat.completion", choices, usage);
    Ok(Json(answer).into_response())
}
