//! Requests into the engine and the per-token outputs it streams back.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Engine-wide unique id of a request; chosen by the caller (the API maps OpenAI ids onto it).
pub type RequestId = u64;

/// How tokens are chosen and when generation stops, per request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches p; 1.0 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p times the top token's; 0 disables.
    pub min_p: f32,
    /// Seed for this request's own RNG, so a sampled answer is reproducible; None draws one.
    pub seed: Option<u64>,
    /// Multiplicative penalty (HF/vLLM semantics) on tokens already in prompt or output; 1.0 disables.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty over generated tokens; 0 disables.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty over generated tokens; 0 disables.
    pub presence_penalty: f32,
    /// Upper bound on generated tokens.
    pub max_tokens: usize,
    /// Token ids that end generation (besides EOS unless `ignore_eos`); the stop token is reported.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS tokens.
    pub ignore_eos: bool,
    /// Return the chosen token's logprob and this many top alternatives; None returns none.
    pub logprobs: Option<usize>,
    /// Also score the prompt (OpenAI `echo` with `logprobs`): each prompt token's logprob and this many
    /// alternatives, delivered with the first output. Such a prompt bypasses the prefix cache.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// Constrains the output to a grammar (OpenAI `response_format`); travels with the request to a
    /// decode worker so the constraint holds across the P/D split and failover.
    #[serde(default)]
    pub guidance: Option<Guidance>,
    /// With `guidance`, for a reasoning model: the thinking block the constraint waits out, so the
    /// model thinks in free text and only its answer is constrained. Travels with the request too.
    #[serde(default)]
    pub reasoning_gate: Option<ReasoningGate>,
}

/// The tokens of a reasoning model's thinking block, as a guided request sees them: until `close` the
/// constraint does not apply (but the block cannot end the output), after it the answer is constrained.
/// With `open` set the model may open the block itself as its first token (any other first token
/// starts the constrained answer); without, generation starts inside the block (the prompt opened it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasoningGate {
    /// The token that opens the block, when the model is to write it.
    pub open: Option<u32>,
    /// The token that closes the block.
    pub close: u32,
}

/// A constraint on what a request may generate: only tokens the grammar accepts are sampled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum Guidance {
    /// Any JSON object (OpenAI `json_object`).
    JsonObject,
    /// A JSON value valid under this JSON Schema (OpenAI `json_schema`).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression in full (tandem extension).
    Regex(String),
    /// Text derived from this Lark grammar's `start` rule (tandem extension).
    Lark(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            guidance: None,
            reasoning_gate: None,
        }
    }
}

impl SamplingParams {
    /// Greedy sampling of exactly `max_tokens` tokens (EOS ignored): the deterministic request of
    /// benchmarks and tests.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        }
    }
}

/// Why a request stopped producing tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// An EOS or stop token was generated (OpenAI `stop`).
    Stop,
    /// `max_tokens` or the model's context length was reached (OpenAI `length`).
    Length,
    /// The caller aborted the request.
    Abort,
}

/// Logprob of one generated token and its top alternatives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// Log-probability of the token that was chosen, under the model's unmodified distribution.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One step's output for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOutput {
    /// The generated token.
    pub token: u32,
    /// Its logprobs, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// Set on the request's last output.
    pub finish: Option<FinishReason>,
    /// On the first output of a request that asked for `prompt_logprobs`: one entry per prompt token,
    /// `None` for the first (nothing precedes it).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

/// How the engine treats a request: the seam for prefill/decode disaggregation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum RequestMode {
    /// Prefill, then decode until a stop condition.
    #[default]
    Normal,
    /// Compute the prompt's KV and the first token only, then keep the KV blocks pinned (for export
    /// to a decode worker) until `release_pin` or until `pin_timeout` has passed.
    PrefillOnly {
        /// How long the pinned KV outlives the request if nobody releases it.
        pin_timeout: Duration,
    },
    /// Continue a request another engine started and lost (decode failover): `output` holds the tokens
    /// already generated and delivered. They are recomputed after the prompt like a preempted sequence's,
    /// so sampling continues at the same output index (seeded RNG stream, penalties, `max_tokens`) and
    /// only new tokens are emitted.
    Resume {
        /// Tokens generated so far, in order (fewer than `max_tokens`).
        output: Vec<u32>,
    },
}

/// A request for generation from token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    /// Caller-chosen id, unique among live requests.
    pub id: RequestId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// Normal generation or prefill-only (P/D).
    pub mode: RequestMode,
}

impl EngineRequest {
    /// A normal-mode request.
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            id,
            prompt,
            params,
            mode: RequestMode::Normal,
        }
    }
}
