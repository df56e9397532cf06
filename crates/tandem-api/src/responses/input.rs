//! A Responses request checked and turned into the chat path's inputs: the refusals of what a stateless
//! server cannot serve, the input items as chat messages, `tools` as chat tools and `text.format` as the
//! engine's guidance, each refusal a 400 naming the field.

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::guidance::{response_format_guidance, GuidanceError};
use crate::protocol::{ChatMessage, JsonSchemaFormat, MessageContent, ResponseFormat};
use crate::tools;

use super::wire::*;

/// Input roles a Responses message may have.
const ROLES: &[&str] = &["user", "system", "developer", "assistant"];

/// `include` item that turns token logprobs on.
pub(super) const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

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
pub(super) fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// A 400 for a field this server does not serve.
fn unsupported(param: &str, why: &str) -> ApiError {
    invalid(format!("`{param}` is not supported: {why}"), param)
}

/// Errors of the shared chat helpers name chat's fields; a Responses client sent other ones.
pub(super) fn rename_param(mut e: ApiError, from: &str, to: &str) -> ApiError {
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
pub(super) fn refuse_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
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
        return Err(unsupported(
            "reasoning",
            "reasoning effort and summaries are not configurable on this server",
        ));
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
pub(super) fn input_messages(
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
pub(super) fn chat_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
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
pub(super) fn format_guidance(
    format: Option<&Value>,
) -> Result<Option<tandem_engine::Guidance>, ApiError> {
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
