//! `POST /v1/responses`: OpenAI's Responses API, stateless (nothing is stored), over the chat path.
//!
//! The input items become chat messages (function calls as assistant `tool_calls`, their outputs as
//! `tool` messages), rendered with the model's chat template and generated through the same
//! [`GenerateBackend`](crate::GenerateBackend) as chat completions, so colocated and P/D serve it
//! alike; tool calls are parsed by `tools.rs` and `text.format` becomes the engine's `Guidance` through
//! `guidance.rs`. What needs state (`previous_response_id`, `conversation`, `store: true`,
//! `background`), built-in tools and non-text input are refused with a 400 naming the field.
//!
//! Modules by job: `input` (the request checked and turned into chat messages, tools and guidance),
//! `stream` (the streamed event sequence), `wire` (the wire types); this file prepares a request and
//! answers it whole.

mod input;
mod stream;
#[cfg(test)]
mod tests;
mod wire;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::chat::{answer_format, reasoning_gate, reasoning_parser, render_and_encode};
use crate::error::ApiError;
use crate::generate::{chat_logprob, collect_split, submit_choices};
use crate::protocol::{ChatMessage, SamplingFields};
use crate::routes::ApiJson;
use crate::state::AppState;
use crate::tools::{self, ToolCall, ToolSpec};
use crate::validate::{logprobs_count, plan, resolve_max_tokens, GenPlan};

use input::{
    chat_tools, format_guidance, input_messages, invalid, refuse_unsupported, rename_param,
    INCLUDE_LOGPROBS,
};
use stream::stream_response;
pub use wire::*;

/// What a response repeats of its request, fixed when it starts.
#[derive(Debug, Clone)]
struct Echo {
    id: String,
    created_at: i64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    max_tool_calls: Option<i64>,
    top_logprobs: Option<i64>,
    parallel_tool_calls: bool,
    temperature: f64,
    top_p: f64,
    format: Value,
    tool_choice: Value,
    tools: Vec<Value>,
    user: Option<String>,
    safety_identifier: Option<String>,
    metadata: Map<String, Value>,
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Completed,
    Incomplete,
    Failed,
}

impl Ending {
    /// From the generation's finish reason: a length cut is OpenAI's `max_output_tokens`.
    fn of(finish: Option<&str>) -> Self {
        match finish {
            Some("stop") => Ending::Completed,
            Some("length") => Ending::Incomplete,
            _ => Ending::Failed,
        }
    }

    /// The response's `status`.
    fn status(self) -> &'static str {
        match self {
            Ending::Completed => "completed",
            Ending::Incomplete => "incomplete",
            Ending::Failed => "failed",
        }
    }

    /// The streamed event that ends a response this way.
    fn event(self) -> &'static str {
        match self {
            Ending::Completed => "response.completed",
            Ending::Incomplete => "response.incomplete",
            Ending::Failed => "response.failed",
        }
    }

    /// The status of output items cut by this ending.
    fn item_status(self) -> &'static str {
        match self {
            Ending::Completed => "completed",
            _ => "incomplete",
        }
    }
}

impl Echo {
    /// The response object as it stands: `ending` `None` while in progress.
    fn response(
        &self,
        ending: Option<Ending>,
        output: Vec<OutputItem>,
        usage: Option<ResponseUsage>,
        error: Option<String>,
    ) -> ResponseObject {
        ResponseObject {
            id: self.id.clone(),
            object: "response",
            created_at: self.created_at,
            status: ending.map_or("in_progress", Ending::status),
            completed_at: (ending == Some(Ending::Completed))
                .then(|| chrono::Utc::now().timestamp()),
            error: match ending {
                Some(Ending::Failed) => Some(ResponseError {
                    code: "server_error",
                    message: error.unwrap_or_else(|| "generation was aborted".to_owned()),
                }),
                _ => None,
            },
            incomplete_details: (ending == Some(Ending::Incomplete)).then_some(IncompleteDetails {
                reason: "max_output_tokens",
            }),
            instructions: self.instructions.clone(),
            max_output_tokens: self.max_output_tokens,
            max_tool_calls: self.max_tool_calls,
            top_logprobs: self.top_logprobs,
            model: self.model.clone(),
            output,
            parallel_tool_calls: self.parallel_tool_calls,
            previous_response_id: None,
            reasoning: None,
            store: false,
            background: false,
            temperature: self.temperature,
            top_p: self.top_p,
            text: TextEcho {
                format: self.format.clone(),
            },
            tool_choice: self.tool_choice.clone(),
            tools: self.tools.clone(),
            truncation: "disabled",
            service_tier: "default",
            usage,
            user: self.user.clone(),
            safety_identifier: self.safety_identifier.clone(),
            metadata: self.metadata.clone(),
        }
    }
}

/// A validated request, ready to render and submit.
struct Prepared {
    messages: Vec<ChatMessage>,
    chat_tools: Option<Value>,
    spec: Option<ToolSpec>,
    plan: GenPlan,
    echo: Echo,
}

/// Validates a request: every refusal happens here, before anything is submitted.
fn prepare(state: &AppState, req: ResponsesRequest) -> Result<Prepared, ApiError> {
    state.check_model(&req.model)?;
    refuse_unsupported(&req)?;
    let messages = input_messages(req.instructions.as_deref(), req.input.as_ref())?;
    let chat_tools = chat_tools(req.tools.as_ref())?;
    // Without tools, the Responses default `auto` (and `none`) mean the same as no tool_choice.
    let choice = req
        .tool_choice
        .as_ref()
        .filter(|c| chat_tools.is_some() || !matches!(c.as_str(), Some("auto" | "none")));
    let spec = tools::chat_spec(chat_tools.as_ref(), choice, req.parallel_tool_calls)?
        .filter(ToolSpec::parses_calls);
    if req.max_tool_calls.is_some_and(|m| m < 1) {
        return Err(invalid(
            "max_tool_calls must be at least 1",
            "max_tool_calls",
        ));
    }
    let format = req.text.as_ref().and_then(|t| t.format.as_ref());
    let guidance = format_guidance(format)?;
    let fields = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        stream: req.stream,
        user: req.user.clone(),
        ..SamplingFields::default()
    };
    let top = logprobs_count(req.top_logprobs, "top_logprobs")?;
    let include_logprobs = req.include.iter().flatten().any(|i| i == INCLUDE_LOGPROBS);
    // Either asks for token logprobs: the include item, or alternatives per token.
    let logprobs = (include_logprobs || top.is_some_and(|k| k > 0)).then(|| top.unwrap_or(0));
    let mut plan = plan(
        &fields,
        req.max_output_tokens,
        "max_output_tokens",
        logprobs,
    )?;
    plan.params.guidance = guidance;
    if let Some(spec) = &spec {
        spec.guide(&mut plan.params, "text.format")?;
    }
    let echo = Echo {
        id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
        created_at: chrono::Utc::now().timestamp(),
        model: state.primary_model_name().to_owned(),
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens,
        max_tool_calls: req.max_tool_calls,
        top_logprobs: req.top_logprobs,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        format: format
            .filter(|f| !f.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "text"})),
        tool_choice: req.tool_choice.unwrap_or_else(|| json!("auto")),
        tools: match req.tools {
            Some(Value::Array(tools)) => tools,
            _ => Vec::new(),
        },
        user: req.user,
        safety_identifier: req.safety_identifier,
        metadata: req.metadata.unwrap_or_default(),
    };
    Ok(Prepared {
        messages,
        chat_tools,
        spec,
        plan,
        echo,
    })
}

/// An assistant `message` output item with at most one text part.
fn message_item(id: String, status: &'static str, part: Option<OutputText>) -> OutputItem {
    OutputItem::Message {
        id,
        role: "assistant",
        status,
        content: part.into_iter().collect(),
    }
}

/// A `reasoning` output item with at most one text part.
fn reasoning_item(id: String, status: &'static str, part: Option<ReasoningText>) -> OutputItem {
    OutputItem::Reasoning {
        id,
        summary: Vec::new(),
        content: part.into_iter().collect(),
        status,
    }
}

/// A `function_call` output item for a parsed call (`arguments` empty while a stream opens it).
fn call_item(id: String, call: &ToolCall, status: &'static str, arguments: String) -> OutputItem {
    OutputItem::FunctionCall {
        id,
        call_id: call.id.clone(),
        name: call.function.name.clone(),
        arguments,
        status,
    }
}

/// A fresh output item id (`rs_...`, `msg_...`, `fc_...`).
fn item_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// The calls a response returns: at most `max_tool_calls`.
fn capped(mut calls: Vec<ToolCall>, max_tool_calls: Option<i64>) -> Vec<ToolCall> {
    if let Some(max) = max_tool_calls {
        calls.truncate(max as usize);
    }
    calls
}

/// Answers `POST /v1/responses`, as one `response` object or as a stream of events.
pub async fn create_response(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut p = prepare(&state, req)?;
    let rendered = render_and_encode(&state, &p.messages, true, p.chat_tools.as_ref(), None)
        .map_err(|e| rename_param(e, "messages", "input"))?;
    let parser = reasoning_parser(&state, &rendered);
    if answer_format(p.plan.params.guidance.as_ref()) {
        p.plan.params.reasoning_gate = reasoning_gate(&state, parser.as_ref());
    }
    let prompt = rendered.ids;
    let max_tokens = resolve_max_tokens(
        p.plan.max_tokens,
        prompt.len(),
        state.backend.max_model_len(),
    )
    .map_err(|e| {
        rename_param(
            rename_param(e, "messages", "input"),
            "max_tokens",
            "max_output_tokens",
        )
    })?;
    let run = submit_choices(&state, &prompt, &p.plan, max_tokens, arrived)?
        .pop()
        .ok_or_else(|| ApiError::internal("no generation was submitted"))?;
    if p.plan.stream {
        let codec = state.codec.clone();
        return Ok(stream_response(
            run,
            p.spec,
            parser,
            p.echo,
            codec,
            prompt.len(),
        ));
    }
    let c = collect_split(run, parser).await?;
    let (content, calls) = match &p.spec {
        Some(spec) => spec.extract(&c.text),
        None => (Some(c.text), Vec::new()),
    };
    // A block that took the whole output leaves no message to show.
    let content = content.filter(|t| c.reasoning.is_none() || !t.is_empty());
    let calls = capped(calls, p.echo.max_tool_calls);
    let ending = Ending::of(c.finish);
    let mut output = Vec::new();
    if let Some(text) = c.reasoning {
        let status = if content.is_some() || !calls.is_empty() {
            "completed"
        } else {
            ending.item_status()
        };
        output.push(reasoning_item(
            item_id("rs"),
            status,
            Some(ReasoningText::new(text)),
        ));
    }
    if content.is_some() || (calls.is_empty() && output.is_empty()) {
        // The answer's tokens only: the reasoning block's are not the message's.
        let logprobs = c.tokens[c.answer_from.min(c.tokens.len())..]
            .iter()
            .filter_map(|t| chat_logprob(state.codec.as_ref(), t))
            .collect();
        let part = OutputText::new(content.unwrap_or_default(), logprobs);
        output.push(message_item(
            item_id("msg"),
            ending.item_status(),
            Some(part),
        ));
    }
    for call in &calls {
        output.push(call_item(
            item_id("fc"),
            call,
            "completed",
            call.function.arguments.clone(),
        ));
    }
    let usage = ResponseUsage::new(prompt.len(), c.tokens.len()).with_reasoning(c.reasoning_tokens);
    Ok(Json(p.echo.response(Some(ending), output, Some(usage), None)).into_response())
}

/// `GET`/`DELETE /v1/responses/{id}`: nothing is stored, so no id can be found.
pub async fn stored_response(Path(id): Path<String>) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "No response with id `{id}`: this server does not store responses (store: false)."
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    }
}
