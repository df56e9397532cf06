//! `POST /v1/responses`: OpenAI's Responses API, stateless (nothing is stored), over the chat path.
//!
//! The input items become chat messages (function calls as assistant `tool_calls`, their outputs as
//! `tool` messages), rendered with the model's chat template and generated through the same
//! [`GenerateBackend`](crate::GenerateBackend) as chat completions, so colocated and P/D serve it
//! alike; tool calls are parsed by `tools.rs` and `text.format` becomes the engine's `Guidance` through
//! `guidance.rs`. What needs state (`previous_response_id`, `conversation`, `store: true`,
//! `background`), built-in tools and non-text input are refused with a 400 naming the field.

#[cfg(test)]
mod tests;
mod wire;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::chat::render_and_encode;
use crate::codec::TextCodec;
use crate::error::ApiError;
use crate::generate::{chat_logprob, collect, submit_choices, ChoiceRun, Step};
use crate::guidance::{response_format_guidance, GuidanceError};
use crate::protocol::{
    ChatMessage, ChatTokenLogprob, JsonSchemaFormat, MessageContent, ResponseFormat, SamplingFields,
};
use crate::routes::ApiJson;
use crate::sse::to_json;
use crate::state::AppState;
use crate::tools::{self, CallHold, ToolCall, ToolSpec};
use crate::validate::{logprobs_count, plan, resolve_max_tokens, GenPlan};

pub use wire::*;

/// Input roles a Responses message may have.
const ROLES: &[&str] = &["user", "system", "developer", "assistant"];

/// `include` item that turns token logprobs on.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// `include` items served: logprobs, and encrypted reasoning, which adds nothing (there is none).
const SERVED_INCLUDES: &[&str] = &[INCLUDE_LOGPROBS, "reasoning.encrypted_content"];

/// Tool types of OpenAI's own tools, refused by name rather than as unknown.
const BUILT_IN_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer_use",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
];

/// A 400 naming `param`.
fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// A 400 for a field this server does not serve.
fn unsupported(param: &str, why: &str) -> ApiError {
    invalid(format!("`{param}` is not supported: {why}"), param)
}

/// Errors of the shared chat helpers name chat's fields; a Responses client sent other ones.
fn rename_param(mut e: ApiError, from: &str, to: &str) -> ApiError {
    if e.param.as_deref() == Some(from) {
        e.param = Some(to.to_owned());
    }
    e
}

/// Deserializes a part of the body, a 400 naming `param` when it has the wrong shape.
fn typed<T: DeserializeOwned>(value: &Value, param: &str) -> Result<T, ApiError> {
    serde_json::from_value(value.clone()).map_err(|e| invalid(format!("{param}: {e}"), param))
}

/// Refuses everything that needs state, reasoning or OpenAI's hosted features.
fn refuse_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.store == Some(true) {
        return Err(unsupported(
            "store",
            "this server does not store responses; send `store: false` or leave it out",
        ));
    }
    if req.previous_response_id.is_some() {
        return Err(unsupported(
            "previous_response_id",
            "responses are not stored, so there is nothing to continue; send the whole conversation as `input` items",
        ));
    }
    if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(unsupported(
            "conversation",
            "conversations are not stored; send the whole conversation as `input` items",
        ));
    }
    if req.background == Some(true) {
        return Err(unsupported(
            "background",
            "responses are answered on the request's connection",
        ));
    }
    if let Some(item) = req
        .include
        .iter()
        .flatten()
        .find(|i| !SERVED_INCLUDES.contains(&i.as_str()))
    {
        return Err(invalid(
            format!("`include` item `{item}` is not supported by this server"),
            "include",
        ));
    }
    if req
        .reasoning
        .as_ref()
        .and_then(Value::as_object)
        .is_some_and(|r| r.values().any(|v| !v.is_null()))
    {
        return Err(unsupported("reasoning", "the served model does not reason"));
    }
    if req.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(unsupported(
            "prompt",
            "stored prompt templates do not exist here; send `instructions` and `input`",
        ));
    }
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(unsupported(
            "truncation",
            "only `disabled` is served: input that does not fit is refused, never cut",
        ));
    }
    if let Some((name, _)) = req.unknown.iter().find(|(_, v)| !v.is_null()) {
        return Err(invalid(format!("Unknown parameter: `{name}`."), name));
    }
    Ok(())
}

/// The text of a message's content: the string, or its text parts joined.
fn content_text(content: &InputContent, at: &str) -> Result<String, ApiError> {
    let parts = match content {
        InputContent::Text(t) => return Ok(t.clone()),
        InputContent::Parts(parts) => parts,
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{at}[{j}]");
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "input_text" | "output_text" => text.push_str(&typed::<TextPart>(part, &param)?.text),
            "input_image" | "input_file" | "input_audio" => {
                return Err(invalid(
                    format!(
                    "content part type `{kind}` is not supported: the served model reads text only"
                ),
                    &format!("{param}.type"),
                ))
            }
            _ => {
                return Err(invalid(
                    format!("content part type `{kind}` is not one of input_text, output_text"),
                    &format!("{param}.type"),
                ))
            }
        }
    }
    Ok(text)
}

/// A chat message as the template path takes it.
fn message(role: &str, content: Option<String>, extra: Map<String, Value>) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content: content.map(MessageContent::Text),
        extra,
    }
}

/// Turns `instructions` and `input` into the chat messages the template renders: function calls join
/// the assistant turn they belong to as `tool_calls`, their outputs become `tool` messages.
fn input_messages(
    instructions: Option<&str>,
    input: Option<&Value>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::new();
    if let Some(system) = instructions {
        messages.push(message("system", Some(system.to_owned()), Map::new()));
    }
    let items = match input {
        None | Some(Value::Null) => return Err(invalid("`input` is required", "input")),
        Some(Value::String(text)) => {
            messages.push(message("user", Some(text.clone()), Map::new()));
            return Ok(messages);
        }
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(invalid("`input` must not be empty", "input"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(invalid(
                "`input` must be a string or a list of items",
                "input",
            ))
        }
    };
    // Function names by call id, so a call's output can name its function (some templates want it).
    let mut call_names: HashMap<String, String> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = match item.get("type").and_then(Value::as_str) {
            Some(kind) => kind,
            None if item.get("role").is_some() => "message",
            None => {
                return Err(invalid(
                    format!("{at} must be a message or an item with a `type`"),
                    &at,
                ))
            }
        };
        match kind {
            "message" => {
                let m: InputMessage = typed(item, &at)?;
                if !ROLES.contains(&m.role.as_str()) {
                    return Err(invalid(
                        format!(
                            "unknown role `{}`; expected one of {}",
                            m.role,
                            ROLES.join(", ")
                        ),
                        &format!("{at}.role"),
                    ));
                }
                let text = content_text(&m.content, &format!("{at}.content"))?;
                messages.push(message(&m.role, Some(text), Map::new()));
            }
            "function_call" => {
                let call: FunctionCallItem = typed(item, &at)?;
                call_names.insert(call.call_id.clone(), call.name.clone());
                let entry = json!({
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                });
                // Consecutive calls (and a text reply just before them) are one assistant turn.
                match messages.last_mut() {
                    Some(last) if last.role == "assistant" => {
                        let calls = last
                            .extra
                            .entry("tool_calls")
                            .or_insert_with(|| Value::Array(Vec::new()));
                        if let Value::Array(calls) = calls {
                            calls.push(entry);
                        }
                    }
                    _ => {
                        let mut extra = Map::new();
                        extra.insert("tool_calls".to_owned(), Value::Array(vec![entry]));
                        messages.push(message("assistant", None, extra));
                    }
                }
            }
            "function_call_output" => {
                let out: FunctionCallOutputItem = typed(item, &at)?;
                let text = content_text(&out.output, &format!("{at}.output"))?;
                let mut extra = Map::new();
                if let Some(name) = call_names.get(&out.call_id) {
                    extra.insert("name".to_owned(), Value::from(name.clone()));
                }
                extra.insert("tool_call_id".to_owned(), Value::from(out.call_id));
                messages.push(message("tool", Some(text), extra));
            }
            other => {
                return Err(invalid(
                    format!(
                        "input item type `{other}` is not supported; expected message, function_call or function_call_output"
                    ),
                    &format!("{at}.type"),
                ))
            }
        }
    }
    Ok(messages)
}

/// The request's tools in chat's nested shape (what templates and `tools.rs` read), or `None`.
fn chat_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) if list.is_empty() => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid("`tools` must be an array", "tools")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let obj = tool
            .as_object()
            .ok_or_else(|| invalid(format!("{at} must be an object"), "tools"))?;
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(kind) if BUILT_IN_TOOLS.contains(&kind) => {
                return Err(invalid(
                    format!(
                        "{at}: built-in tool `{kind}` is not supported; only `function` tools are"
                    ),
                    "tools",
                ))
            }
            kind => {
                return Err(invalid(
                    format!(
                        "{at}.type must be `function`, got {}",
                        kind.map_or("nothing".to_owned(), |k| format!("`{k}`"))
                    ),
                    "tools",
                ))
            }
        }
        tools::function_tool(&at, obj)?;
        let mut function = obj.clone();
        function.remove("type");
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// `text.format` as the engine's guidance, through the rules chat's `response_format` follows.
fn format_guidance(format: Option<&Value>) -> Result<Option<tandem_engine::Guidance>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let rf = match typed::<TextFormat>(format, "text.format")? {
        TextFormat::Text => ResponseFormat::Text,
        TextFormat::JsonObject => ResponseFormat::JsonObject,
        TextFormat::JsonSchema {
            name,
            description,
            schema,
            strict,
        } => ResponseFormat::JsonSchema {
            json_schema: JsonSchemaFormat {
                name,
                description,
                schema,
                strict,
            },
        },
    };
    response_format_guidance(&rf).map_err(|e| {
        let param = match e {
            GuidanceError::BadName(_) => "text.format.name",
            _ => "text.format.schema",
        };
        invalid(e.to_string(), param)
    })
}

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

/// A fresh output item id (`msg_...`, `fc_...`).
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
    let p = prepare(&state, req)?;
    let prompt = render_and_encode(&state, &p.messages, true, p.chat_tools.as_ref())
        .map_err(|e| rename_param(e, "messages", "input"))?;
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
        return Ok(stream_response(run, p.spec, p.echo, codec, prompt.len()));
    }
    let c = collect(run).await?;
    let (content, calls) = match &p.spec {
        Some(spec) => spec.extract(&c.text),
        None => (Some(c.text), Vec::new()),
    };
    let calls = capped(calls, p.echo.max_tool_calls);
    let ending = Ending::of(c.finish);
    let mut output = Vec::new();
    if content.is_some() || calls.is_empty() {
        let logprobs = c
            .tokens
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
    let usage = ResponseUsage::new(prompt.len(), c.tokens.len());
    Ok(Json(p.echo.response(Some(ending), output, Some(usage), None)).into_response())
}

/// The message item being streamed: its place in `output`, id, and text and logprobs so far.
struct OpenMessage {
    index: usize,
    id: String,
    text: String,
    logprobs: Vec<ChatTokenLogprob>,
}

/// One streamed response: turns the generation's steps into OpenAI's event sequence.
///
/// It owns the [`ChoiceRun`], so a client that hangs up drops it and aborts the engine request.
struct EventWriter {
    run: Option<ChoiceRun>,
    spec: Option<ToolSpec>,
    hold: CallHold,
    echo: Echo,
    sequence: usize,
    input_tokens: usize,
    output_tokens: usize,
    message: Option<OpenMessage>,
    /// Finished items, in `output` order.
    done: Vec<OutputItem>,
    codec: Arc<dyn TextCodec>,
    /// Logprobs of tokens whose text has not been sent yet (held, or an incomplete character).
    pending: Vec<ChatTokenLogprob>,
}

impl EventWriter {
    /// The next SSE event: an `event:` line with the type, the JSON with its sequence number.
    fn event(&mut self, kind: &'static str, body: EventBody) -> Event {
        let event = StreamEvent {
            kind,
            sequence_number: self.sequence,
            body,
        };
        self.sequence += 1;
        Event::default().event(kind).data(to_json(&event))
    }

    /// A `response.*` event carrying the response as it stands.
    fn lifecycle(
        &mut self,
        kind: &'static str,
        ending: Option<Ending>,
        error: Option<String>,
    ) -> Event {
        let usage = ending.map(|_| ResponseUsage::new(self.input_tokens, self.output_tokens));
        let response = self.echo.response(ending, self.done.clone(), usage, error);
        self.event(
            kind,
            EventBody::Response {
                response: Box::new(response),
            },
        )
    }

    /// `response.created` and `response.in_progress`.
    fn opening(&mut self) -> Vec<Event> {
        vec![
            self.lifecycle("response.created", None, None),
            self.lifecycle("response.in_progress", None, None),
        ]
    }

    /// Streams `text` into the message item, opening it first if needed.
    fn text(&mut self, text: String, out: &mut Vec<Event>) {
        if self.message.is_none() {
            let (index, id) = (self.done.len(), item_id("msg"));
            let item = message_item(id.clone(), "in_progress", None);
            out.push(self.event(
                "response.output_item.added",
                EventBody::Item {
                    output_index: index,
                    item,
                },
            ));
            let part = EventBody::Part {
                item_id: id.clone(),
                output_index: index,
                content_index: 0,
                part: OutputText::new(String::new(), Vec::new()),
            };
            out.push(self.event("response.content_part.added", part));
            self.message = Some(OpenMessage {
                index,
                id,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        if text.is_empty() {
            return;
        }
        let Some(m) = self.message.as_mut() else {
            return;
        };
        m.text.push_str(&text);
        let logprobs = std::mem::take(&mut self.pending);
        m.logprobs.extend(logprobs.iter().cloned());
        let body = EventBody::TextDelta {
            item_id: m.id.clone(),
            output_index: m.index,
            content_index: 0,
            delta: text,
            logprobs,
        };
        out.push(self.event("response.output_text.delta", body));
    }

    /// Closes the message item, if one is open.
    fn close_message(&mut self, status: &'static str, out: &mut Vec<Event>) {
        let Some(mut m) = self.message.take() else {
            return;
        };
        // Tokens that added no text (the end-of-sequence token) still count in the whole list.
        m.logprobs.append(&mut self.pending);
        let done = EventBody::TextDone {
            item_id: m.id.clone(),
            output_index: m.index,
            content_index: 0,
            text: m.text.clone(),
            logprobs: m.logprobs.clone(),
        };
        out.push(self.event("response.output_text.done", done));
        let text = OutputText::new(m.text, m.logprobs);
        let part = EventBody::Part {
            item_id: m.id.clone(),
            output_index: m.index,
            content_index: 0,
            part: text.clone(),
        };
        out.push(self.event("response.content_part.done", part));
        let item = message_item(m.id, status, Some(text));
        self.done.push(item.clone());
        out.push(self.event(
            "response.output_item.done",
            EventBody::Item {
                output_index: m.index,
                item,
            },
        ));
    }

    /// A function call item: added, its arguments in one delta, done.
    fn call(&mut self, call: &ToolCall, out: &mut Vec<Event>) {
        let (index, id) = (self.done.len(), item_id("fc"));
        let added = call_item(id.clone(), call, "in_progress", String::new());
        out.push(self.event(
            "response.output_item.added",
            EventBody::Item {
                output_index: index,
                item: added,
            },
        ));
        let arguments = call.function.arguments.clone();
        let delta = EventBody::ArgumentsDelta {
            item_id: id.clone(),
            output_index: index,
            delta: arguments.clone(),
        };
        out.push(self.event("response.function_call_arguments.delta", delta));
        let done = EventBody::ArgumentsDone {
            item_id: id.clone(),
            output_index: index,
            name: call.function.name.clone(),
            arguments: arguments.clone(),
        };
        out.push(self.event("response.function_call_arguments.done", done));
        let item = call_item(id, call, "completed", arguments);
        self.done.push(item.clone());
        out.push(self.event(
            "response.output_item.done",
            EventBody::Item {
                output_index: index,
                item,
            },
        ));
    }

    /// The events of one generation step; the last step also closes the items and the response.
    fn step(&mut self, step: Step) -> Vec<Event> {
        self.output_tokens += 1;
        self.pending
            .extend(chat_logprob(self.codec.as_ref(), &step.token));
        let mut out = Vec::new();
        let mut text = step.text;
        let mut calls = Vec::new();
        if let Some(spec) = &self.spec {
            text = self.hold.push(&text);
            if step.finish.is_some() {
                let (rest, found) = self.hold.finish(spec);
                text.extend(rest);
                calls = capped(found, self.echo.max_tool_calls);
            }
        }
        if !text.is_empty() {
            self.text(text, &mut out);
        }
        let Some(finish) = step.finish else {
            return out;
        };
        self.run = None;
        let ending = Ending::of(Some(finish));
        // Like the whole answer, a response without calls always has a message, empty or not.
        if calls.is_empty() && self.message.is_none() {
            self.text(String::new(), &mut out);
        }
        self.close_message(ending.item_status(), &mut out);
        for call in &calls {
            self.call(call, &mut out);
        }
        out.push(self.lifecycle(ending.event(), Some(ending), None));
        out
    }

    /// A failure mid-stream: what was streamed stays, marked incomplete, and the response fails.
    fn failure(&mut self, error: ApiError) -> Vec<Event> {
        self.run = None;
        let mut out = Vec::new();
        self.close_message("incomplete", &mut out);
        out.push(self.lifecycle("response.failed", Some(Ending::Failed), Some(error.message)));
        out
    }
}

/// The SSE answer: the opening events, then the steps' events as they come. Unlike chat completions
/// there is no `[DONE]`: the terminal `response.*` event ends the stream, as in OpenAI's API.
fn stream_response(
    run: ChoiceRun,
    spec: Option<ToolSpec>,
    echo: Echo,
    codec: Arc<dyn TextCodec>,
    input_tokens: usize,
) -> Response {
    let mut writer = EventWriter {
        run: Some(run),
        spec,
        hold: CallHold::default(),
        echo,
        sequence: 0,
        input_tokens,
        output_tokens: 0,
        message: None,
        done: Vec::new(),
        codec,
        pending: Vec::new(),
    };
    let opening = writer.opening();
    let steps = stream::unfold(writer, |mut w| async move {
        let next = w.run.as_mut()?.next().await;
        let events = match next {
            Some(Ok(step)) => w.step(step),
            Some(Err(e)) => w.failure(e),
            None => w.failure(ApiError::internal(
                "generation ended before a finish reason",
            )),
        };
        Some((stream::iter(events), w))
    })
    .flatten();
    let events = stream::iter(opening).chain(steps).map(Ok::<_, Infallible>);
    Sse::new(events).into_response()
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
