//! Drives one engine request (one choice): detokenizes its tokens, applies stop strings, records
//! latency metrics, and yields one [`Step`] per generated token.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use tandem_engine::{FinishReason, TokenLogprobs};

use crate::backend::{GenerateRequest, TokenStream};
use crate::codec::{StreamDecoder, TextCodec};
use crate::error::ApiError;
use crate::protocol::{Answer, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs};
use crate::reasoning::ReasoningParser;
use crate::request_log::{current_tally, Tally};
use crate::state::AppState;
use crate::stop::StopMatcher;
use crate::validate::GenPlan;

/// A generated token with its logprobs, kept for the logprobs part of an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// The token id.
    pub id: u32,
    /// Chosen-token and top logprobs, when requested.
    pub logprobs: Option<TokenLogprobs>,
}

/// What one engine output turned into.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Text now safe to send (may be empty while a character or a possible stop string is held back).
    pub text: String,
    /// The token behind this step.
    pub token: GeneratedToken,
    /// OpenAI finish reason on the choice's last step.
    pub finish: Option<&'static str>,
    /// On the first step of a request that scored its prompt (echo with logprobs): one entry per
    /// prompt token, `None` for the first.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

/// What every response object of one answer repeats, fixed when the answer starts.
#[derive(Debug, Clone)]
pub struct AnswerHead {
    id: String,
    created: i64,
    model: String,
    fingerprint: String,
}

impl AnswerHead {
    /// A fresh answer id (`{id_prefix}-` and a random UUID), the time now, and the served model's name
    /// and fingerprint.
    pub fn new(state: &AppState, id_prefix: &str) -> Self {
        AnswerHead {
            id: format!("{id_prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: chrono::Utc::now().timestamp(),
            model: state.primary_model_name().to_owned(),
            fingerprint: state.config.system_fingerprint.clone(),
        }
    }

    /// One response object of this answer, of OpenAI type `object`.
    pub fn answer<C, U>(&self, object: &'static str, choices: Vec<C>, usage: U) -> Answer<C, U> {
        Answer {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: self.fingerprint.clone(),
            choices,
            usage,
        }
    }
}

/// The state of one choice while it generates.
pub struct ChoiceRun {
    /// `None` once finished: dropping it aborts the engine request when a stop string ended it early.
    stream: Option<TokenStream>,
    decoder: Box<dyn StreamDecoder>,
    stop: StopMatcher,
    state: Arc<AppState>,
    arrived: Instant,
    last_token_at: Option<Instant>,
    /// Time to the first token, and tokens so far: the finish line's figures.
    ttft: Option<std::time::Duration>,
    tokens: usize,
    failed: bool,
    /// The HTTP request's token tally (its access line's counts), when it runs under `request_log`.
    tally: Option<Arc<Tally>>,
}

/// The OpenAI name of an engine finish reason.
pub fn finish_reason_str(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

impl ChoiceRun {
    /// Wraps a submitted request; `arrived` is when the HTTP request came in (for TTFT).
    pub fn new(
        state: Arc<AppState>,
        stream: TokenStream,
        stops: &[String],
        arrived: Instant,
    ) -> Self {
        Self {
            stream: Some(stream),
            decoder: state.codec.stream_decoder(),
            stop: StopMatcher::new(stops),
            state,
            arrived,
            last_token_at: None,
            ttft: None,
            tokens: 0,
            failed: false,
            tally: current_tally(),
        }
    }

    /// The next step, `None` after the last one; an error when the backend vanished mid-request.
    pub async fn next(&mut self) -> Option<Result<Step, ApiError>> {
        let stream = self.stream.as_mut()?;
        let out = match stream.next().await {
            Some(Ok(out)) => out,
            ended => {
                self.stream = None;
                if self.failed {
                    return None;
                }
                self.failed = true;
                return Some(Err(match ended {
                    Some(Err(e)) => e.into(),
                    _ => ApiError::internal(
                        "generation ended before a finish reason (engine stopped?)",
                    ),
                }));
            }
        };
        let now = Instant::now();
        match self.last_token_at {
            None => self
                .state
                .metrics
                .observe_ttft((now - self.arrived).as_secs_f64()),
            Some(prev) => self.state.metrics.observe_itl((now - prev).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        self.ttft.get_or_insert(now - self.arrived);
        self.tokens += 1;
        if let Some(tally) = &self.tally {
            tally.token();
        }
        match self.step(&out) {
            Ok(mut step) => {
                step.prompt_logprobs = out.prompt_logprobs;
                if let Some(reason) = step.finish {
                    self.stream = None;
                    let total = now - self.arrived;
                    self.state
                        .metrics
                        .observe_finished(reason, total.as_secs_f64());
                    // One line per choice, in the request's span; the access line (`request_log`)
                    // sums the choices when the body ends.
                    tracing::info!(
                        finish = reason,
                        completion_tokens = self.tokens,
                        ttft_ms = self.ttft.unwrap_or_default().as_millis() as u64,
                        duration_ms = total.as_millis() as u64,
                        "generation finished"
                    );
                }
                Some(Ok(step))
            }
            Err(e) => {
                self.stream = None;
                self.failed = true;
                Some(Err(e))
            }
        }
    }

    fn step(&mut self, out: &tandem_engine::TokenOutput) -> Result<Step, ApiError> {
        let token = GeneratedToken {
            id: out.token,
            logprobs: out.logprobs.clone(),
        };
        let decode_err = |e: crate::codec::CodecError| ApiError::internal(e.to_string());
        // A `Stop` finish means this token is EOS or a stop token id: its text is not part of the answer.
        let piece = if out.finish == Some(FinishReason::Stop) {
            String::new()
        } else {
            self.decoder.push(out.token).map_err(decode_err)?
        };
        let first = self.stop.push(&piece);
        let mut text = first.emit;
        if first.stopped {
            return Ok(Step {
                text,
                token,
                finish: Some("stop"),
                prompt_logprobs: None,
            });
        }
        let Some(reason) = out.finish else {
            return Ok(Step {
                text,
                token,
                finish: None,
                prompt_logprobs: None,
            });
        };
        let tail = self.decoder.finish().map_err(decode_err)?;
        let last = self.stop.push(&tail);
        text.push_str(&last.emit);
        if last.stopped {
            return Ok(Step {
                text,
                token,
                finish: Some("stop"),
                prompt_logprobs: None,
            });
        }
        text.push_str(&self.stop.flush());
        Ok(Step {
            text,
            token,
            finish: Some(finish_reason_str(reason)),
            prompt_logprobs: None,
        })
    }
}

/// Everything one choice produced, for non-streamed answers.
#[derive(Debug, Clone, Default)]
pub struct CollectedChoice {
    /// The full text.
    pub text: String,
    /// Every generated token.
    pub tokens: Vec<GeneratedToken>,
    /// The finish reason.
    pub finish: Option<&'static str>,
    /// The prompt's scores, when the request asked for them.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// The reasoning block, when a reasoning parser ran and the output had one (`text` is then the
    /// answer after it).
    pub reasoning: Option<String>,
    /// Tokens of the reasoning block.
    pub reasoning_tokens: usize,
    /// Index in `tokens` of the answer's first token (past the reasoning block).
    pub answer_from: usize,
}

/// Runs a choice to its end.
pub async fn collect(run: ChoiceRun) -> Result<CollectedChoice, ApiError> {
    collect_split(run, None).await
}

/// Runs a choice to its end, splitting its reasoning block off the answer when `parser` is given.
pub async fn collect_split(
    mut run: ChoiceRun,
    mut parser: Option<ReasoningParser>,
) -> Result<CollectedChoice, ApiError> {
    let mut out = CollectedChoice::default();
    let mut reasoning = String::new();
    while let Some(step) = run.next().await {
        let step = step?;
        if step.prompt_logprobs.is_some() {
            out.prompt_logprobs = step.prompt_logprobs;
        }
        match parser.as_mut() {
            Some(p) => {
                let split = p.push(&step.text);
                if split.in_reasoning {
                    out.answer_from = out.tokens.len() + 1;
                }
                reasoning.push_str(&split.reasoning);
                out.text.push_str(&split.content);
            }
            None => out.text.push_str(&step.text),
        }
        out.tokens.push(step.token);
        out.finish = step.finish;
    }
    if let Some(p) = parser.as_mut() {
        let rest = p.finish();
        reasoning.push_str(&rest.reasoning);
        out.text.push_str(&rest.content);
        out.reasoning = p.reasoned().then_some(reasoning);
        out.reasoning_tokens = p.reasoning_tokens();
    }
    Ok(out)
}

/// Logprob values JSON can carry: -inf becomes a large negative number (serde_json would write null).
pub fn finite_logprob(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// The text of one token as logprobs report it.
pub fn token_text(codec: &dyn TextCodec, id: u32) -> String {
    codec.decode(&[id], false).unwrap_or_default()
}

/// A chat `logprobs.content` entry for a token, if its logprobs were requested.
pub fn chat_logprob(codec: &dyn TextCodec, token: &GeneratedToken) -> Option<ChatTokenLogprob> {
    let lp = token.logprobs.as_ref()?;
    let text = token_text(codec, token.id);
    let top_logprobs = lp
        .top
        .iter()
        .map(|&(id, l)| {
            let t = token_text(codec, id);
            ChatTopLogprob {
                bytes: t.as_bytes().to_vec(),
                token: t,
                logprob: finite_logprob(l),
            }
        })
        .collect();
    Some(ChatTokenLogprob {
        bytes: text.as_bytes().to_vec(),
        token: text,
        logprob: finite_logprob(lp.logprob),
        top_logprobs,
    })
}

/// Appends tokens to legacy completion logprobs; `offset` is the running character offset in the text.
/// Tokens without logprobs (echoed prompt tokens) get nulls, as OpenAI does for the first token.
pub fn push_completion_logprobs(
    codec: &dyn TextCodec,
    out: &mut CompletionLogprobs,
    tokens: &[GeneratedToken],
    offset: &mut usize,
) {
    for token in tokens {
        let text = token_text(codec, token.id);
        out.text_offset.push(*offset);
        *offset += text.chars().count();
        match &token.logprobs {
            Some(lp) => {
                out.token_logprobs.push(Some(finite_logprob(lp.logprob)));
                let top = lp
                    .top
                    .iter()
                    .map(|&(id, l)| {
                        (
                            token_text(codec, id),
                            serde_json::Value::from(finite_logprob(l)),
                        )
                    })
                    .collect();
                out.top_logprobs.push(Some(top));
            }
            None => {
                out.token_logprobs.push(None);
                out.top_logprobs.push(None);
            }
        }
        out.tokens.push(text);
    }
}

/// Submits one engine request per choice; earlier submissions are aborted (dropped) if a later one fails.
pub fn submit_choices(
    state: &Arc<AppState>,
    prompt: &[u32],
    plan: &GenPlan,
    max_tokens: usize,
    arrived: Instant,
) -> Result<Vec<ChoiceRun>, ApiError> {
    if let Some(tally) = current_tally() {
        tally.prompt(prompt.len());
    }
    (0..plan.n)
        .map(|i| {
            let stream = state.backend.submit(GenerateRequest::new(
                state.next_request_id(),
                prompt.to_vec(),
                plan.params_for_choice(i, max_tokens),
            ))?;
            Ok(ChoiceRun::new(state.clone(), stream, &plan.stops, arrived))
        })
        .collect()
}
