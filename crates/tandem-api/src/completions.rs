//! `POST /v1/completions`: text and token-id prompts (one or many), echo, legacy logprobs.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::codec::TextCodec;
use crate::error::ApiError;
use crate::generate::{
    collect, push_completion_logprobs, submit_choices, AnswerHead, GeneratedToken, Step,
};
use crate::protocol::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptInput, Usage,
};
use crate::routes::{check_token_ids, ApiJson};
use crate::sse::{stream_choices, to_json, UsageRenderer};
use crate::state::AppState;
use crate::validate::{logprobs_count, plan, resolve_max_tokens};
use tandem_engine::TokenLogprobs;

/// OpenAI's default completion length for this endpoint.
const DEFAULT_MAX_TOKENS: i64 = 16;

/// One prompt, tokenized, with the text echo would return.
struct Prompt {
    ids: Vec<u32>,
    text: String,
}

fn tokenize_prompts(state: &AppState, input: PromptInput) -> Result<Vec<Prompt>, ApiError> {
    let encode = |text: String| -> Result<Prompt, ApiError> {
        let ids = state
            .codec
            .encode(&text, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
        Ok(Prompt { ids, text })
    };
    let from_ids = |ids: Vec<u32>| -> Result<Prompt, ApiError> {
        check_token_ids(state, &ids, "prompt")?;
        let text = state
            .codec
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
        Ok(Prompt { ids, text })
    };
    let prompts = match input {
        PromptInput::Text(t) => vec![encode(t)?],
        PromptInput::Texts(v) => v.into_iter().map(encode).collect::<Result<_, _>>()?,
        PromptInput::Tokens(ids) => vec![from_ids(ids)?],
        PromptInput::TokenLists(v) => v.into_iter().map(from_ids).collect::<Result<_, _>>()?,
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "prompt must not be an empty list",
            Some("prompt"),
        ));
    }
    if prompts.iter().any(|p| p.ids.is_empty()) {
        return Err(ApiError::invalid(
            "prompt must not be empty",
            Some("prompt"),
        ));
    }
    Ok(prompts)
}

/// The echoed prompt of one choice: its text (when echoing) and, when logprobs were asked for, its
/// tokens with their scores (`scores[i]` is token i's; absent scores give nulls).
fn echo_part(
    codec: &dyn TextCodec,
    prompt: &Prompt,
    echo: bool,
    logprobs: Option<usize>,
    scores: Option<&[Option<TokenLogprobs>]>,
    offset: &mut usize,
) -> (String, Option<CompletionLogprobs>) {
    let logprobs = logprobs.map(|_| {
        let mut lp = CompletionLogprobs::default();
        if echo {
            let tokens: Vec<GeneratedToken> = prompt
                .ids
                .iter()
                .enumerate()
                .map(|(i, &id)| GeneratedToken {
                    id,
                    logprobs: scores.and_then(|s| s.get(i).cloned().flatten()),
                })
                .collect();
            push_completion_logprobs(codec, &mut lp, &tokens, offset);
        }
        lp
    });
    let text = if echo {
        prompt.text.clone()
    } else {
        String::new()
    };
    (text, logprobs)
}

/// The handler.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    state.check_model(&req.model)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
    }
    let logprobs = logprobs_count(req.logprobs, "logprobs")?;
    let mut plan = plan(
        &req.sampling,
        Some(req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
        "max_tokens",
        logprobs,
    )?;
    if req.best_of.is_some_and(|b| b != plan.n as i64) {
        return Err(ApiError::invalid(
            "best_of other than n is not supported",
            Some("best_of"),
        ));
    }
    let echo = req.echo.unwrap_or(false);
    if echo {
        // Echoed prompt tokens carry logprobs too: the engine scores the prompt.
        plan.params.prompt_logprobs = logprobs;
    }
    let prompts = tokenize_prompts(&state, req.prompt)?;
    let max_model_len = state.backend.max_model_len();
    let mut runs = Vec::with_capacity(prompts.len() * plan.n);
    for (p, prompt) in prompts.iter().enumerate() {
        let max_tokens = resolve_max_tokens(plan.max_tokens, prompt.ids.len(), max_model_len)?;
        let choices = submit_choices(&state, &prompt.ids, &plan, max_tokens, arrived)?;
        runs.extend(
            choices
                .into_iter()
                .enumerate()
                .map(|(i, run)| (p * plan.n + i, run)),
        );
    }
    let prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
    let head = AnswerHead::new(&state, "cmpl");
    let response =
        move |choices: Vec<CompletionChoice>, usage: Option<Usage>| -> CompletionResponse {
            head.answer("text_completion", choices, usage)
        };
    if plan.stream {
        let total = prompts.len() * plan.n;
        let mut offsets = vec![0usize; total];
        let mut prelude = Vec::new();
        // Scores arrive with the first token, so a scored echo rides on each choice's first chunk;
        // a plain echo goes out at once.
        let scored_echo = echo && logprobs.is_some();
        if echo && !scored_echo {
            for (index, offset) in offsets.iter_mut().enumerate() {
                let (text, logprobs) = echo_part(
                    state.codec.as_ref(),
                    &prompts[index / plan.n],
                    echo,
                    logprobs,
                    None,
                    offset,
                );
                let choice = CompletionChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason: None,
                };
                prelude.push(to_json(&response(vec![choice], None)));
            }
        }
        let mut echo_pending = vec![scored_echo; total];
        let n = plan.n;
        let codec = state.codec.clone();
        let step_response = response.clone();
        let render = move |index: usize, step: Step| {
            let (mut text, mut logprobs) = if std::mem::take(&mut echo_pending[index]) {
                echo_part(
                    codec.as_ref(),
                    &prompts[index / n],
                    echo,
                    logprobs,
                    step.prompt_logprobs.as_deref(),
                    &mut offsets[index],
                )
            } else {
                (
                    String::new(),
                    logprobs.map(|_| CompletionLogprobs::default()),
                )
            };
            if let Some(lp) = logprobs.as_mut() {
                push_completion_logprobs(
                    codec.as_ref(),
                    lp,
                    std::slice::from_ref(&step.token),
                    &mut offsets[index],
                );
            }
            text.push_str(&step.text);
            if text.is_empty() && logprobs.is_none() && step.finish.is_none() {
                return None;
            }
            let choice = CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: step.finish,
            };
            Some(to_json(&step_response(vec![choice], None)))
        };
        let usage = plan.include_usage.then(|| {
            let renderer: UsageRenderer =
                Box::new(move |u| to_json(&response(Vec::new(), Some(u))));
            (prompt_tokens, renderer)
        });
        return Ok(stream_choices(runs, prelude, render, usage));
    }

    let indices: Vec<usize> = runs.iter().map(|(i, _)| *i).collect();
    let collected = futures::future::join_all(runs.into_iter().map(|(_, run)| collect(run))).await;
    let mut choices = Vec::with_capacity(collected.len());
    let mut completion_tokens = 0;
    for (index, c) in indices.into_iter().zip(collected) {
        let c = c?;
        completion_tokens += c.tokens.len();
        let mut offset = 0;
        let (mut text, mut logprobs) = echo_part(
            state.codec.as_ref(),
            &prompts[index / plan.n],
            echo,
            logprobs,
            c.prompt_logprobs.as_deref(),
            &mut offset,
        );
        if let Some(lp) = logprobs.as_mut() {
            push_completion_logprobs(state.codec.as_ref(), lp, &c.tokens, &mut offset);
        }
        text.push_str(&c.text);
        choices.push(CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: c.finish,
        });
    }
    Ok(Json(response(
        choices,
        Some(Usage::new(prompt_tokens, completion_tokens)),
    ))
    .into_response())
}
