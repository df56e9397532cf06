//! Function tools on chat completions: validating `tools`/`tool_choice`, preparing tool messages for
//! the chat template, and parsing the calls a model writes back into OpenAI `tool_calls`.
//!
//! The call format is recognised from the output itself, so one parser serves every family the
//! templates produce: Hermes/Qwen `<tool_call>{json}</tool_call>`, Mistral `[TOOL_CALLS][{...}]`,
//! and Llama 3.1's JSON object (`{"name": .., "parameters": ..}`, optionally after `<|python_tag|>`).

use serde::Serialize;
use serde_json::{json, Map, Value};
use tandem_engine::Guidance;

use crate::error::ApiError;

/// Hermes/Qwen call opener.
const HERMES_OPEN: &str = "<tool_call>";
/// Hermes/Qwen call closer.
const HERMES_CLOSE: &str = "</tool_call>";
/// Mistral's call-list marker.
const MISTRAL_MARKER: &str = "[TOOL_CALLS]";
/// Llama 3.1's marker before a call (when the decoder keeps special tokens).
const LLAMA_TAG: &str = "<|python_tag|>";

/// Which calls the client allows, from `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default when tools are given).
    Auto,
    /// No call: output is returned as text.
    None,
    /// At least one call must be made.
    Required,
    /// This function must be called.
    Named(String),
}

/// One validated function tool.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    /// The function's name, as calls must spell it.
    pub name: String,
    /// The JSON schema of its arguments (an empty object schema when omitted).
    pub parameters: Value,
}

/// The tools of a request and what the client allows, once validated.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    /// The declared functions.
    pub tools: Vec<FunctionTool>,
    /// What `tool_choice` allows.
    pub choice: ToolChoice,
    /// Whether more than one call may come back (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// A call as the model wrote it, before it gets an id.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    /// The function called.
    pub name: String,
    /// Its arguments, serialized as the JSON string OpenAI returns.
    pub arguments: String,
}

/// The function part of a returned tool call.
#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    /// The function called.
    pub name: String,
    /// Its arguments as a JSON string.
    pub arguments: String,
}

/// One entry of an assistant message's `tool_calls`.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    /// `call_...`, unique per call.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCall,
}

impl ToolCall {
    /// Gives a parsed call its OpenAI id.
    pub fn new(call: ParsedCall) -> Self {
        ToolCall {
            id: format!("call_{}", uuid::Uuid::new_v4().simple()),
            kind: "function",
            function: FunctionCall {
                name: call.name,
                arguments: call.arguments,
            },
        }
    }
}

/// The function part of a streamed tool-call delta.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FunctionDelta {
    /// The function's name, in the call's first delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the arguments string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One entry of a streamed chunk's `delta.tool_calls`: the call's first delta carries id, type and
/// name; later ones append to its arguments.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the answer this extends.
    pub index: usize,
    /// The call's id, in its first delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in the call's first delta.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name and arguments pieces.
    pub function: FunctionDelta,
}

impl ToolCall {
    /// The deltas that stream this call as OpenAI does: id, type and name first, then the arguments.
    pub fn deltas(self, index: usize) -> [ToolCallDelta; 2] {
        [
            ToolCallDelta {
                index,
                id: Some(self.id),
                kind: Some(self.kind),
                function: FunctionDelta {
                    name: Some(self.function.name),
                    arguments: Some(String::new()),
                },
            },
            ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionDelta {
                    name: None,
                    arguments: Some(self.function.arguments),
                },
            },
        ]
    }
}

fn bad_tools(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some("tools"))
}

fn bad_choice(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some("tool_choice"))
}

/// OpenAI's rule for function names: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Validates one chat-completions tool (`{"type": "function", "function": {...}}`).
fn chat_tool(i: usize, tool: &Value) -> Result<FunctionTool, ApiError> {
    let kind = tool.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(bad_tools(format!(
            "tools[{i}].type must be `function`, got {}",
            kind.map_or("nothing".to_owned(), |k| format!("`{k}`"))
        )));
    }
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad_tools(format!("tools[{i}].function must be an object")))?;
    function_tool(&format!("tools[{i}].function"), function)
}

/// Validates a function definition's name and parameter schema; shared by both APIs' tool shapes.
pub fn function_tool(at: &str, function: &Map<String, Value>) -> Result<FunctionTool, ApiError> {
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| valid_name(n))
        .ok_or_else(|| {
            bad_tools(format!(
                "{at}.name must be 1 to 64 letters, digits, `_` or `-`"
            ))
        })?;
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(bad_tools(format!(
                "{at}.parameters must be a JSON schema object"
            )))
        }
    };
    Ok(FunctionTool {
        name: name.to_owned(),
        parameters,
    })
}

/// Parses `tool_choice` against the declared tools.
pub fn parse_choice(
    choice: Option<&Value>,
    tools: &[FunctionTool],
) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => return Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad_choice(format!(
                    "tool_choice `{other}` is not one of auto, none, required"
                )))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                // The Responses API puts the name at the top level.
                .or_else(|| o.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_owned()),
                _ => {
                    return Err(bad_choice(
                        "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(_) => return Err(bad_choice("tool_choice must be a string or an object")),
    };
    if let ToolChoice::Named(name) = &choice {
        if !tools.iter().any(|t| &t.name == name) {
            return Err(bad_choice(format!(
                "tool_choice names function `{name}`, which is not in tools"
            )));
        }
    }
    Ok(choice)
}

/// Validates a chat request's `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools.
pub fn chat_spec(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolSpec>, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => {
            if choice.is_some_and(|c| !c.is_null()) {
                return Err(bad_choice(
                    "tool_choice is only allowed when tools are given",
                ));
            }
            return Ok(None);
        }
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, t)| chat_tool(i, t))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(bad_tools("tools must be an array")),
    };
    let choice = parse_choice(choice, &tools)?;
    Ok(Some(ToolSpec {
        tools,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// The JSON Schema of one call to `tool`: its name and arguments under its parameters schema.
fn call_schema(tool: &FunctionTool) -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": tool.parameters,
        },
        "required": ["name", "arguments"],
        "additionalProperties": false
    })
}

impl ToolSpec {
    /// Whether the output should be searched for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// Whether the answer must be calls (`required` or a named function): then the output is
    /// guided to them and read as nothing but calls.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The constraint a forced choice puts on the output: `{"name": .., "arguments": ..}` for the
    /// named function, or for any declared one (`required`), as a non-empty array of such calls when
    /// `required` allows parallel calls. None when the model chooses.
    pub fn guidance(&self) -> Option<Guidance> {
        let schema = match &self.choice {
            ToolChoice::Named(name) => call_schema(self.tools.iter().find(|t| &t.name == name)?),
            ToolChoice::Required => {
                let one = match self.tools.as_slice() {
                    [only] => call_schema(only),
                    many => json!({"anyOf": many.iter().map(call_schema).collect::<Vec<_>>()}),
                };
                if self.parallel {
                    json!({"type": "array", "items": one, "minItems": 1})
                } else {
                    one
                }
            }
            ToolChoice::Auto | ToolChoice::None => return None,
        };
        Some(Guidance::JsonSchema(schema))
    }

    /// Puts a forced choice's constraint on `params` (chat completions and the Responses API alike, so
    /// neither answers a forced choice unguided); refused when `params` already carries the request's
    /// own output format (`format_param`), since a forced answer is the calls.
    pub fn guide(
        &self,
        params: &mut tandem_engine::SamplingParams,
        format_param: &str,
    ) -> Result<(), ApiError> {
        let Some(guidance) = self.guidance() else {
            return Ok(());
        };
        if params.guidance.is_some() {
            return Err(ApiError::invalid(
                format!(
                    "{format_param} cannot be combined with tool_choice `required` or a named \
                     function: the answer is the calls"
                ),
                Some(format_param),
            ));
        }
        params.guidance = Some(guidance);
        Ok(())
    }

    /// The calls of a forced answer (one call object or an array of them); text that is not calls
    /// (a guided answer cut short by `max_tokens`) stays text.
    fn forced_calls(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let calls = match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(list)) => list.iter().map(call_of).collect::<Option<Vec<_>>>(),
            Ok(one) => call_of(&one).map(|c| vec![c]),
            Err(_) => None,
        };
        match calls {
            Some(calls) if !calls.is_empty() => {
                (None, calls.into_iter().map(ToolCall::new).collect())
            }
            _ => (Some(text.to_owned()), Vec::new()),
        }
    }

    /// Splits a finished output into its text and the calls to return (at most one without
    /// `parallel_tool_calls`); calls to undeclared functions stay text.
    pub fn extract(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        if !self.parses_calls() {
            return (Some(text.to_owned()), Vec::new());
        }
        if self.forced() {
            return self.forced_calls(text);
        }
        match parse_calls(text) {
            Some((content, calls))
                if !calls.is_empty()
                    && calls
                        .iter()
                        .all(|c| self.tools.iter().any(|t| t.name == c.name)) =>
            {
                let keep = if self.parallel { calls.len() } else { 1 };
                let calls = calls.into_iter().take(keep).map(ToolCall::new).collect();
                let content = (!content.trim().is_empty()).then_some(content);
                (content, calls)
            }
            _ => (Some(text.to_owned()), Vec::new()),
        }
    }
}

/// A call object in any family's spelling: `name` plus `arguments` or `parameters`.
fn call_of(v: &Value) -> Option<ParsedCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_owned();
    let args = o.get("arguments").or_else(|| o.get("parameters"));
    let arguments = match args {
        None => "{}".to_owned(),
        // Some models write the arguments already serialized.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => {
            s.clone()
        }
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// One call object or a list of them.
fn calls_of(v: &Value) -> Option<Vec<ParsedCall>> {
    match v {
        Value::Array(items) => items.iter().map(call_of).collect(),
        v => call_of(v).map(|c| vec![c]),
    }
}

/// Reads the calls in `text`: the text outside them, and the calls in order; `None` when `text`
/// holds no well-formed call.
pub fn parse_calls(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    if text.contains(HERMES_OPEN) {
        return parse_hermes(text);
    }
    if let Some(at) = text.find(MISTRAL_MARKER) {
        let rest = text[at + MISTRAL_MARKER.len()..].trim();
        let calls = calls_of(&serde_json::from_str(rest).ok()?)?;
        return Some((text[..at].to_owned(), calls));
    }
    let (content, body) = match text.find(LLAMA_TAG) {
        Some(at) => (&text[..at], &text[at + LLAMA_TAG.len()..]),
        None => ("", text),
    };
    let body = body.trim();
    if !(body.starts_with('{') || body.starts_with('[')) {
        return None;
    }
    // Llama 3.1 writes one object, or several separated by `;`.
    let mut calls = Vec::new();
    for part in body.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        calls.extend(calls_of(&serde_json::from_str(part).ok()?)?);
    }
    Some((content.to_owned(), calls))
}

/// `<tool_call>{json}</tool_call>` blocks, as many as there are; an unclosed last one runs to the end.
fn parse_hermes(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        content.push_str(&rest[..open]);
        let body_start = &rest[open + HERMES_OPEN.len()..];
        let (body, after) = match body_start.find(HERMES_CLOSE) {
            Some(close) => (
                &body_start[..close],
                &body_start[close + HERMES_CLOSE.len()..],
            ),
            None => (body_start, ""),
        };
        calls.push(call_of(&serde_json::from_str(body.trim()).ok()?)?);
        rest = after;
    }
    content.push_str(rest);
    Some((content, calls))
}

/// Whether streamed text that starts with `head` may still turn out to be a call, so it must be
/// held back rather than sent as content.
pub fn may_open_call(head: &str) -> bool {
    let head = head.trim_start();
    head.is_empty()
        || head.starts_with('{')
        || head.starts_with('[')
        || [HERMES_OPEN, MISTRAL_MARKER, LLAMA_TAG]
            .iter()
            .any(|m| m.starts_with(head) || head.starts_with(m))
}

/// Prepares an OpenAI message for HF templates: assistant `tool_calls` arguments become objects
/// (templates write them with `tojson`), as transformers expects.
pub fn template_message(obj: &mut Map<String, Value>) {
    let Some(Value::Array(calls)) = obj.get_mut("tool_calls") else {
        return;
    };
    for call in calls {
        let Some(args) = call
            .get_mut("function")
            .and_then(|f| f.get_mut("arguments"))
        else {
            continue;
        };
        if let Value::String(s) = args {
            if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                *args = parsed;
            }
        }
    }
}

/// Streamed text of one choice while it may still be a call: held back until it cannot be one
/// (then it passes through as content) or until the end (then it is parsed).
#[derive(Debug, Default)]
pub struct CallHold {
    held: String,
    passing: bool,
    /// A forced choice's answer is all calls: everything is held.
    forced: bool,
}

impl CallHold {
    /// A hold for `spec`'s answers.
    pub fn new(spec: &ToolSpec) -> Self {
        Self {
            forced: spec.forced(),
            ..Self::default()
        }
    }

    /// Takes the next streamed text; returns what can be sent as content now.
    pub fn push(&mut self, text: &str) -> String {
        if self.passing {
            return text.to_owned();
        }
        self.held.push_str(text);
        if self.forced || may_open_call(&self.held) {
            return String::new();
        }
        self.passing = true;
        std::mem::take(&mut self.held)
    }

    /// At the choice's end: the held text that is content, and the calls it held.
    pub fn finish(&mut self, spec: &ToolSpec) -> (Option<String>, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return (None, Vec::new());
        }
        spec.extract(&held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> ParsedCall {
        ParsedCall {
            name: name.to_owned(),
            arguments: args.to_string(),
        }
    }

    #[test]
    fn hermes_calls_with_text_before() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_calls(text).unwrap();
        assert_eq!(content.trim(), "Let me check.");
        assert_eq!(
            calls,
            vec![
                call("get_weather", json!({"city": "Paris"})),
                call("get_time", json!({}))
            ]
        );
    }

    #[test]
    fn hermes_unclosed_last_call_and_broken_json() {
        let (_, calls) =
            parse_calls("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}").unwrap();
        assert_eq!(calls, vec![call("f", json!({"a": 1}))]);
        assert!(parse_calls("<tool_call>{\"name\": \"f\", \"argu").is_none());
    }

    #[test]
    fn mistral_list() {
        let text = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": \"y\"}}, {\"name\": \"g\", \"arguments\": {}}]";
        let (content, calls) = parse_calls(text).unwrap();
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![call("f", json!({"x": "y"})), call("g", json!({}))]
        );
    }

    #[test]
    fn llama_json_with_and_without_python_tag() {
        let text = "{\"name\": \"f\", \"parameters\": {\"n\": 3}}";
        assert_eq!(
            parse_calls(text).unwrap().1,
            vec![call("f", json!({"n": 3}))]
        );
        let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"n\": 3}}; {\"name\": \"g\", \"parameters\": {}}";
        assert_eq!(
            parse_calls(tagged).unwrap().1,
            vec![call("f", json!({"n": 3})), call("g", json!({}))]
        );
        assert!(parse_calls("Plain answer.").is_none());
        assert!(parse_calls("{\"not\": \"a call\"}").is_none());
    }

    #[test]
    fn stringified_arguments_are_kept() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
        assert_eq!(parse_calls(text).unwrap().1[0].arguments, "{\"a\": 1}");
    }

    fn spec(choice: Value, parallel: Option<bool>) -> Result<Option<ToolSpec>, ApiError> {
        let tools = json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g"}},
        ]);
        chat_spec(Some(&tools), Some(&choice), parallel)
    }

    #[test]
    fn extract_filters_undeclared_and_respects_parallel() {
        let two = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let s = spec(json!("auto"), None).unwrap().unwrap();
        let (content, calls) = s.extract(two);
        assert!(content.is_none());
        assert_eq!(calls.len(), 2);
        assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
        let single = spec(json!("auto"), Some(false)).unwrap().unwrap();
        assert_eq!(single.extract(two).1.len(), 1);
        let unknown = "<tool_call>{\"name\": \"h\", \"arguments\": {}}</tool_call>";
        let (content, calls) = s.extract(unknown);
        assert_eq!(content.as_deref(), Some(unknown));
        assert!(calls.is_empty());
        let none = spec(json!("none"), None).unwrap().unwrap();
        assert!(none.extract(two).1.is_empty());
    }

    #[test]
    fn choices_parse_and_bad_ones_name_the_param() {
        let tools = [FunctionTool {
            name: "g".into(),
            parameters: json!({"type": "object"}),
        }];
        assert_eq!(
            parse_choice(Some(&json!("required")), &tools).unwrap(),
            ToolChoice::Required
        );
        let named = json!({"type": "function", "function": {"name": "g"}});
        assert_eq!(
            parse_choice(Some(&named), &tools).unwrap(),
            ToolChoice::Named("g".into())
        );
        // A forced choice guides the output to calls of the declared functions.
        for forced in [json!("required"), named] {
            let s = spec(forced, None).unwrap().unwrap();
            assert!(s.forced());
            assert!(matches!(s.guidance(), Some(Guidance::JsonSchema(_))));
        }
        assert_eq!(spec(json!("auto"), None).unwrap().unwrap().guidance(), None);
        for bad in [
            json!("sometimes"),
            json!({"type": "function", "function": {"name": "nope"}}),
            json!(3),
        ] {
            assert_eq!(
                spec(bad, None).unwrap_err().param.as_deref(),
                Some("tool_choice")
            );
        }
        let err = chat_spec(None, Some(&json!("auto")), None).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn bad_tools_are_rejected() {
        for tools in [
            json!({"type": "function"}),
            json!([{"type": "web_search"}]),
            json!([{"type": "function", "function": {"name": "has space"}}]),
            json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        ] {
            let err = chat_spec(Some(&tools), None, None).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("tools"), "{tools}");
        }
    }

    #[test]
    fn held_back_prefixes() {
        assert!(may_open_call(""));
        assert!(may_open_call("  <tool"));
        assert!(may_open_call("<tool_call>{\"na"));
        assert!(may_open_call("[TOOL"));
        assert!(may_open_call("{\"name\""));
        assert!(!may_open_call("Hello"));
        assert!(!may_open_call("<b>"));
    }

    #[test]
    fn hold_passes_text_and_keeps_calls() {
        let s = spec(json!("auto"), None).unwrap().unwrap();
        let mut text = CallHold::default();
        assert_eq!(text.push(" "), "");
        assert_eq!(text.push("Hi"), " Hi");
        assert_eq!(text.push(" <tool_call>"), " <tool_call>");
        let (content, calls) = text.finish(&s);
        assert!(content.is_none() && calls.is_empty());
        let mut call = CallHold::default();
        for piece in [
            "<tool",
            "_call>{\"name\": \"f\",",
            " \"arguments\": {}}</tool_call>",
        ] {
            assert_eq!(call.push(piece), "");
        }
        let (content, calls) = call.finish(&s);
        assert!(content.is_none());
        assert_eq!(calls[0].function.name, "f");
    }

    #[test]
    fn template_messages_get_object_arguments() {
        let mut m = json!({"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
        ]});
        template_message(m.as_object_mut().unwrap());
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
    }
}
