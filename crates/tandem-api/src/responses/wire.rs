//! The Responses API's wire types: the request body as clients send it, the `response` object, its
//! output items and the streamed events, shaped as OpenAI's so the official clients parse them.
//!
//! Fields whose refusal must name a precise path (input items, `text.format`, `tools`) arrive as raw
//! JSON and are parsed into the typed forms below by `responses.rs`, so a bad value is a 400 naming
//! `input[2].content[0].type` rather than a generic body error.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::protocol::ChatTokenLogprob;

/// Body of `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// The served model name.
    pub model: String,
    /// A user message as a string, or a list of input items.
    pub input: Option<Value>,
    /// The system prompt, placed before the input.
    pub instructions: Option<String>,
    /// Cap on generated tokens; reaching it leaves the response `incomplete`.
    pub max_output_tokens: Option<i64>,
    /// Softmax temperature in [0, 2].
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Function tools in the Responses (flat) shape.
    pub tools: Option<Value>,
    /// `auto`, `none`, `required` or `{"type": "function", "name": ...}`.
    pub tool_choice: Option<Value>,
    /// Whether several function calls may come back (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Most function calls one response returns.
    pub max_tool_calls: Option<i64>,
    /// Output format (`text.format`); `verbosity` is accepted and has no effect.
    pub text: Option<TextConfig>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options; `include_obfuscation` is accepted and nothing is obfuscated.
    pub stream_options: Option<Value>,
    /// Responses are never stored here: absent or false, anything else is refused.
    pub store: Option<bool>,
    /// Refused: nothing is stored, so there is no earlier response to continue.
    pub previous_response_id: Option<String>,
    /// Refused: conversations are state this server does not keep.
    pub conversation: Option<Value>,
    /// Refused when true: a response is answered on its own connection.
    pub background: Option<bool>,
    /// Extra output: `message.output_text.logprobs`, and `reasoning.encrypted_content` (adds nothing).
    pub include: Option<Vec<String>>,
    /// Refused when set: the models served here do not reason.
    pub reasoning: Option<Value>,
    /// Refused: stored prompt templates do not exist here.
    pub prompt: Option<Value>,
    /// `disabled` (the default); `auto` would need dropping input, which is refused.
    pub truncation: Option<String>,
    /// Alternatives per token in [0, 20]; turns token logprobs on, like including
    /// `message.output_text.logprobs`.
    pub top_logprobs: Option<i64>,
    /// Up to 16 string pairs, echoed back.
    pub metadata: Option<Map<String, Value>>,
    /// End-user id, echoed back.
    pub user: Option<String>,
    /// Abuse-tracking id, echoed back.
    pub safety_identifier: Option<String>,
    /// Prompt-cache routing hint; accepted (the prefix cache needs no hint).
    pub prompt_cache_key: Option<String>,
    /// Prompt-cache retention; accepted and not used.
    pub prompt_cache_retention: Option<String>,
    /// Accepted and reported as `default`.
    pub service_tier: Option<String>,
    /// Every other field: refused when set, as OpenAI refuses unknown parameters.
    #[serde(flatten)]
    pub unknown: Map<String, Value>,
}

/// `text` of a request: the output format.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TextConfig {
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", ...}`.
    pub format: Option<Value>,
    /// Accepted; the model's length is not steered.
    pub verbosity: Option<Value>,
}

/// `text.format` once parsed: the Responses API's flat spelling of chat's `response_format`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `schema`.
    JsonSchema {
        /// Name of the format.
        name: String,
        /// What the format is for; not used.
        description: Option<String>,
        /// The JSON Schema.
        schema: Option<Value>,
        /// OpenAI's strict mode; accepted either way.
        strict: Option<bool>,
    },
}

/// Content of an input message: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum InputContent {
    /// Plain text.
    Text(String),
    /// Content parts; only text parts are served by a text model.
    Parts(Vec<Value>),
}

/// A `message` input item (typed or OpenAI's "easy" form without `type`).
#[derive(Debug, Clone, Deserialize)]
pub struct InputMessage {
    /// `user`, `system`, `developer` or `assistant`.
    pub role: String,
    /// The message's text.
    pub content: InputContent,
}

/// A text content part (`input_text` or `output_text`).
#[derive(Debug, Clone, Deserialize)]
pub struct TextPart {
    /// The text.
    pub text: String,
}

/// A `function_call` input item: a call the model made earlier, fed back with the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallItem {
    /// The id the call's output refers to.
    pub call_id: String,
    /// The function called.
    pub name: String,
    /// Its arguments as a JSON string.
    pub arguments: String,
}

/// A `function_call_output` input item: what running a call returned.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallOutputItem {
    /// The call this answers.
    pub call_id: String,
    /// The result, as a string or text parts.
    pub output: InputContent,
}

/// One content part of an output message.
#[derive(Debug, Clone, Serialize)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The generated text.
    pub text: String,
    /// Always empty: nothing here cites sources.
    pub annotations: Vec<Value>,
    /// Every generated token's logprob, when the request included them.
    pub logprobs: Vec<ChatTokenLogprob>,
}

impl OutputText {
    /// A part holding `text` and its tokens' logprobs.
    pub fn new(text: String, logprobs: Vec<ChatTokenLogprob>) -> Self {
        OutputText {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs,
        }
    }
}

/// The text part of a `reasoning` item.
#[derive(Debug, Clone, Serialize)]
pub struct ReasoningText {
    /// Always `reasoning_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The reasoning block's text.
    pub text: String,
}

impl ReasoningText {
    /// A part holding `text`.
    pub fn new(text: String) -> Self {
        ReasoningText {
            kind: "reasoning_text",
            text,
        }
    }
}

/// One item of a response's `output`.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The model's reasoning block (reasoning parser on), before the message it led to.
    Reasoning {
        /// `rs_...`.
        id: String,
        /// Always empty: the block is returned whole in `content`, not summarised.
        summary: Vec<Value>,
        /// The block's text (one part, or none while a stream opens the item).
        content: Vec<ReasoningText>,
        /// `in_progress` while streaming, then `completed` or `incomplete`.
        status: &'static str,
    },
    /// The assistant's text.
    Message {
        /// `msg_...`.
        id: String,
        /// Always `assistant`.
        role: &'static str,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        /// The text parts (one, or none while a stream opens the item).
        content: Vec<OutputText>,
    },
    /// A function call the client should run.
    FunctionCall {
        /// `fc_...`, the item's id.
        id: String,
        /// `call_...`, what the call's output item refers to.
        call_id: String,
        /// The function called.
        name: String,
        /// Its arguments as a JSON string.
        arguments: String,
        /// `in_progress` while streaming, then `completed`.
        status: &'static str,
    },
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct InputTokensDetails {
    /// Always 0: prefix-cache hits are not reported per request.
    pub cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OutputTokensDetails {
    /// Tokens of the reasoning block (0 unless the reasoning parser found one).
    pub reasoning_tokens: usize,
}

/// Token accounting of a response.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ResponseUsage {
    /// Tokens of the rendered prompt.
    pub input_tokens: usize,
    /// Cache detail (none reported).
    pub input_tokens_details: InputTokensDetails,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Reasoning detail.
    pub output_tokens_details: OutputTokensDetails,
    /// Their sum.
    pub total_tokens: usize,
}

impl ResponseUsage {
    /// Usage from the two counts.
    pub fn new(input_tokens: usize, output_tokens: usize) -> Self {
        ResponseUsage {
            input_tokens,
            input_tokens_details: InputTokensDetails { cached_tokens: 0 },
            output_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: input_tokens + output_tokens,
        }
    }

    /// The same usage with `reasoning_tokens` of the output spent on reasoning.
    pub fn with_reasoning(mut self, reasoning_tokens: usize) -> Self {
        self.output_tokens_details.reasoning_tokens = reasoning_tokens;
        self
    }
}

/// `incomplete_details` of an incomplete response.
#[derive(Debug, Clone, Serialize)]
pub struct IncompleteDetails {
    /// Always `max_output_tokens` here (the output cap or the end of the context).
    pub reason: &'static str,
}

/// `error` of a failed response.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseError {
    /// `server_error`.
    pub code: &'static str,
    /// What went wrong.
    pub message: String,
}

/// `text` of a response: the format in effect.
#[derive(Debug, Clone, Serialize)]
pub struct TextEcho {
    /// The request's `text.format`, or `{"type": "text"}`.
    pub format: Value,
}

/// The `response` object, whole or as a streamed event carries it.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// Always `response`.
    pub object: &'static str,
    /// Unix seconds when the request arrived.
    pub created_at: i64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    /// Unix seconds when it completed; null otherwise.
    pub completed_at: Option<i64>,
    /// Why it failed, when it did.
    pub error: Option<ResponseError>,
    /// Why it is incomplete, when it is.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's instructions.
    pub instructions: Option<String>,
    /// The request's output cap.
    pub max_output_tokens: Option<i64>,
    /// The request's call cap.
    pub max_tool_calls: Option<i64>,
    /// The request's alternatives per token.
    pub top_logprobs: Option<i64>,
    /// The served model name.
    pub model: String,
    /// Messages and function calls, in order.
    pub output: Vec<OutputItem>,
    /// Whether several calls could come back.
    pub parallel_tool_calls: bool,
    /// Always null: nothing is stored to continue from.
    pub previous_response_id: Option<String>,
    /// Always null: reasoning effort is not configurable here.
    pub reasoning: Option<Value>,
    /// Always false: responses are not stored.
    pub store: bool,
    /// Always false: answered in the foreground.
    pub background: bool,
    /// The temperature used.
    pub temperature: f64,
    /// The nucleus mass used.
    pub top_p: f64,
    /// The output format.
    pub text: TextEcho,
    /// The request's tool choice (`auto` by default).
    pub tool_choice: Value,
    /// The request's tools, as sent.
    pub tools: Vec<Value>,
    /// Always `disabled`.
    pub truncation: &'static str,
    /// Always `default`.
    pub service_tier: &'static str,
    /// Token accounting; null until the response ends.
    pub usage: Option<ResponseUsage>,
    /// The request's end-user id.
    pub user: Option<String>,
    /// The request's safety identifier.
    pub safety_identifier: Option<String>,
    /// The request's metadata.
    pub metadata: Map<String, Value>,
}

/// One streamed event: its `type`, its place in the stream, and the fields of that type.
#[derive(Debug, Clone, Serialize)]
pub struct StreamEvent {
    /// `response.created`, `response.output_text.delta`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// 0, 1, 2, ... in the order sent.
    pub sequence_number: usize,
    /// The type's own fields.
    #[serde(flatten)]
    pub body: EventBody,
}

/// The fields of each event type.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum EventBody {
    /// `response.created`, `.in_progress`, `.completed`, `.incomplete`, `.failed`.
    Response {
        /// The response as it stands.
        response: Box<ResponseObject>,
    },
    /// `response.output_item.added` and `.done`.
    Item {
        /// Position in `output`.
        output_index: usize,
        /// The item as it stands.
        item: OutputItem,
    },
    /// `response.content_part.added` and `.done`.
    Part {
        /// The message's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the message's content.
        content_index: usize,
        /// The part as it stands.
        part: OutputText,
    },
    /// `response.output_text.delta`.
    TextDelta {
        /// The message's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the message's content.
        content_index: usize,
        /// New text.
        delta: String,
        /// Logprobs of the tokens behind `delta`, when requested.
        logprobs: Vec<ChatTokenLogprob>,
    },
    /// `response.output_text.done`.
    TextDone {
        /// The message's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the message's content.
        content_index: usize,
        /// The whole text.
        text: String,
        /// Logprobs of every token, when requested.
        logprobs: Vec<ChatTokenLogprob>,
    },
    /// `response.content_part.added` and `.done` of a reasoning item.
    ReasoningPart {
        /// The reasoning item's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the item's content.
        content_index: usize,
        /// The part as it stands.
        part: ReasoningText,
    },
    /// `response.reasoning_text.delta`.
    ReasoningDelta {
        /// The reasoning item's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the item's content.
        content_index: usize,
        /// New reasoning text.
        delta: String,
    },
    /// `response.reasoning_text.done`.
    ReasoningDone {
        /// The reasoning item's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// Position in the item's content.
        content_index: usize,
        /// The whole reasoning text.
        text: String,
    },
    /// `response.function_call_arguments.delta`.
    ArgumentsDelta {
        /// The call item's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// New argument text.
        delta: String,
    },
    /// `response.function_call_arguments.done`.
    ArgumentsDone {
        /// The call item's id.
        item_id: String,
        /// Position in `output`.
        output_index: usize,
        /// The function called.
        name: String,
        /// The whole arguments string.
        arguments: String,
    },
}
