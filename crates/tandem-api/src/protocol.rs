//! OpenAI wire types: request bodies as clients send them and the response objects we send back.
//!
//! Numeric request fields are parsed wide (`f64`, `i64`) so that out-of-range values reach validation
//! and get a 400 naming the field, rather than a generic parse error.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::tools::{ToolCall, ToolCallDelta};

/// `stop`: OpenAI accepts one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with empty `choices` and the request's `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and stopping fields shared by chat and text completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Softmax temperature in [0, 2]; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k best tokens; -1 or 0 disables (vLLM extension).
    pub top_k: Option<i64>,
    /// Minimum probability relative to the best token, in [0, 1] (vLLM extension).
    pub min_p: Option<f64>,
    /// Seed for reproducible sampling; choice i of n uses seed + i.
    pub seed: Option<i64>,
    /// OpenAI frequency penalty in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// OpenAI presence penalty in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// Multiplicative repetition penalty, > 0 (vLLM extension).
    pub repetition_penalty: Option<f64>,
    /// Stop strings; generation ends before the first occurrence.
    pub stop: Option<StopSpec>,
    /// Token ids that end generation (vLLM extension).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past EOS (vLLM extension).
    pub ignore_eos: Option<bool>,
    /// Number of choices to generate for each prompt.
    pub n: Option<i64>,
    /// Stream chunks as server-sent events.
    pub stream: Option<bool>,
    /// Options of a streamed answer.
    pub stream_options: Option<StreamOptions>,
    /// End-user id; accepted and ignored.
    pub user: Option<String>,
    /// Constrains the output's shape (JSON, a JSON schema, or the regex / grammar extensions).
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`: OpenAI's `text`, `json_object` and `json_schema`, plus tandem's `regex` and
/// `grammar` (Lark) extensions.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text: no constraint.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under the given schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
    /// Text matching a regular expression in full (tandem extension).
    Regex {
        /// The expression.
        regex: String,
    },
    /// Text derived from a Lark grammar's `start` rule (tandem extension).
    Grammar {
        /// The grammar source.
        grammar: String,
    },
}

/// `response_format.json_schema`: a named JSON Schema.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct JsonSchemaFormat {
    /// Name of the format: letters, digits, `_` and `-`, at most 64 characters.
    pub name: String,
    /// What the format is for; accepted and not used.
    pub description: Option<String>,
    /// The JSON Schema; absent means any JSON value.
    pub schema: Option<Value>,
    /// OpenAI's strict mode; the output always follows the schema here, so this is accepted either way.
    pub strict: Option<bool>,
}

/// One chat message: a role and text content (a string or a list of text parts).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text, or OpenAI's content parts; null for assistant messages with tool calls.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Everything else the message carried (name, tool_calls, tool_call_id), passed to the template.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// Message content in either of OpenAI's forms.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// A list of parts; only `{"type": "text", "text": ...}` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part kind; only `text` is supported by a text-only model.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    pub text: Option<String>,
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The served model name.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Legacy completion length cap.
    pub max_tokens: Option<i64>,
    /// Completion length cap (newer name; wins over `max_tokens`).
    pub max_completion_tokens: Option<i64>,
    /// Return logprobs of the chosen tokens.
    pub logprobs: Option<bool>,
    /// Number of alternatives per position, in [0, 20]; needs `logprobs`.
    pub top_logprobs: Option<i64>,
    /// Append the assistant header so the model answers (default true).
    pub add_generation_prompt: Option<bool>,
    /// Function tools, rendered by the chat template and called in the answer.
    pub tools: Option<Value>,
    /// `auto`, `none`, `required` or a named function.
    pub tool_choice: Option<Value>,
    /// Whether several calls may come back in one answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Extra chat template variables, e.g. `{"enable_thinking": false}` for Qwen3 (vLLM extension).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Shared sampling fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `prompt` of a text completion: OpenAI's four accepted forms.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt given as token ids.
    Tokens(Vec<u32>),
    /// Several prompts given as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The served model name.
    pub model: String,
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Completion length cap (defaults to 16, as in OpenAI).
    pub max_tokens: Option<i64>,
    /// Number of alternatives per position, in [0, 20].
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the returned text.
    pub echo: Option<bool>,
    /// Must equal n when given; server-side best-of is not supported.
    pub best_of: Option<i64>,
    /// Insertion suffix; not supported by this server.
    pub suffix: Option<String>,
    /// Shared sampling fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Token accounting of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt(s), counted once per prompt.
    pub prompt_tokens: usize,
    /// Tokens generated over all choices.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// What the completion tokens were spent on; only with the reasoning parser on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// `usage.completion_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionTokensDetails {
    /// Tokens of the reasoning blocks, over all choices.
    pub reasoning_tokens: usize,
}

impl Usage {
    /// Usage from the two counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens_details: None,
        }
    }

    /// The same usage with the reasoning tokens reported (the parser is on).
    pub fn with_reasoning(mut self, reasoning_tokens: usize) -> Self {
        self.completion_tokens_details = Some(CompletionTokensDetails { reasoning_tokens });
        self
    }
}

/// One alternative token of a chat logprobs entry.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
}

/// Logprobs of one generated token in a chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
    /// The most likely alternatives at this position.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// `logprobs` of a chat choice.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// `logprobs` of a text-completion choice (the legacy format).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Log-probability of each token (null for echoed prompt tokens).
    pub token_logprobs: Vec<Option<f32>>,
    /// Alternatives per position, token text to logprob (null for echoed prompt tokens).
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// An assistant message of a non-streamed chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text; null when the answer is only tool calls (or only reasoning).
    pub content: Option<String>,
    /// The model's reasoning block, apart from the answer; only with the reasoning parser on and a
    /// block in the output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The calls the model made, when it made any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One choice of a non-streamed chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Position among the n choices.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// Token logprobs when requested.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: Option<&'static str>,
}

/// The delta of a streamed chat chunk.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant` in a choice's first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text (reasoning parser on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// New parts of tool calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

impl ChatDelta {
    /// Wraps the delta as choice `index` of a chunk.
    pub fn choice(
        self,
        index: usize,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> ChatChunkChoice {
        ChatChunkChoice {
            index,
            delta: self,
            logprobs,
            finish_reason,
        }
    }
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Position among the n choices.
    pub index: usize,
    /// What is new.
    pub delta: ChatDelta,
    /// Logprobs of the tokens behind this delta.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// One choice of a text completion (streamed or not).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// prompt_index * n + choice_index.
    pub index: usize,
    /// The generated (or echoed + generated) text.
    pub text: String,
    /// Legacy logprobs when requested.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length` at the end, null before.
    pub finish_reason: Option<&'static str>,
}

/// A response object of one answer (a chat answer, a chat chunk, a text completion or one chunk of it):
/// the fields OpenAI repeats in every object of an answer, its choices, and token usage where it has one.
#[derive(Debug, Clone, Serialize)]
#[serde(bound(serialize = "C: Serialize, U: Serialize + UsageSlot"))]
pub struct Answer<C, U> {
    /// `chatcmpl-...` or `cmpl-...`, the same in every chunk of one answer.
    pub id: String,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: i64,
    /// The served model name.
    pub model: String,
    /// Identifies the server build and model.
    pub system_fingerprint: String,
    /// The choices; a chunk usually has one, the final usage chunk none.
    pub choices: Vec<C>,
    /// Token accounting: always in a whole answer; in a stream only in the final chunk, when
    /// `stream_options.include_usage` is set.
    #[serde(skip_serializing_if = "UsageSlot::is_absent")]
    pub usage: U,
}

/// Token usage as an answer object holds it: always ([`Usage`]) or in some objects only (`Option`).
pub trait UsageSlot {
    /// Whether the object leaves `usage` out.
    fn is_absent(&self) -> bool;
}

impl UsageSlot for Usage {
    fn is_absent(&self) -> bool {
        false
    }
}

impl UsageSlot for Option<Usage> {
    fn is_absent(&self) -> bool {
        self.is_none()
    }
}

/// A non-streamed chat answer (`chat.completion`).
pub type ChatCompletionResponse = Answer<ChatChoice, Usage>;

/// A streamed chat chunk (`chat.completion.chunk`).
pub type ChatCompletionChunk = Answer<ChatChunkChoice, Option<Usage>>;

/// A text completion answer, or one streamed chunk of it (same object type, as in OpenAI).
pub type CompletionResponse = Answer<CompletionChoice, Option<Usage>>;

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The served model name.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds of server start.
    pub created: i64,
    /// Always `tandem`.
    pub owned_by: &'static str,
    /// The model the name refers to.
    pub root: String,
    /// Context length served.
    pub max_model_len: usize,
}

/// Body of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// Body of `POST /tokenize`: either a prompt or chat messages.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// Optional model name, checked when given.
    pub model: Option<String>,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Chat messages to render with the template and tokenize.
    pub messages: Option<Vec<ChatMessage>>,
    /// Add BOS etc. to a plain prompt (default true; never added to rendered chats).
    pub add_special_tokens: Option<bool>,
    /// Append the assistant header to rendered chats (default true).
    pub add_generation_prompt: Option<bool>,
    /// Extra chat template variables, as in chat completions.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// Answer of `POST /tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    /// Number of tokens.
    pub count: usize,
    /// Context length served.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
}

/// Body of `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// Optional model name, checked when given.
    pub model: Option<String>,
    /// Token ids to turn into text.
    pub tokens: Vec<u32>,
}

/// Answer of `POST /detokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    /// The text.
    pub prompt: String,
}
