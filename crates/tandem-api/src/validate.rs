//! Request validation: turns OpenAI fields into engine [`SamplingParams`], answering 400 with the
//! offending field for anything out of range.

use tandem_engine::SamplingParams;

use crate::error::ApiError;
use crate::guidance::response_format_guidance;
use crate::protocol::{SamplingFields, StopSpec};

/// Most choices one request may ask for (OpenAI's limit).
pub const MAX_N: i64 = 128;
/// Most stop strings one request may carry (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Most alternatives per position logprobs may return.
pub const MAX_LOGPROBS: i64 = 20;

/// A validated request, minus the prompt-dependent completion length.
#[derive(Debug, Clone, PartialEq)]
pub struct GenPlan {
    /// Choices per prompt.
    pub n: usize,
    /// Engine parameters; `max_tokens` is set per prompt by [`resolve_max_tokens`], `seed` per choice.
    pub params: SamplingParams,
    /// The requested completion length, if any.
    pub max_tokens: Option<usize>,
    /// Stop strings, matched on the API side.
    pub stops: Vec<String>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Append a usage chunk to a stream.
    pub include_usage: bool,
}

impl GenPlan {
    /// Parameters of choice `i`: seeded requests derive `seed + i` so choices differ but stay reproducible.
    pub fn params_for_choice(&self, i: usize, max_tokens: usize) -> SamplingParams {
        let mut p = self.params.clone();
        p.seed = p.seed.map(|s| s.wrapping_add(i as u64));
        p.max_tokens = max_tokens;
        p
    }
}

fn check_range(value: Option<f64>, lo: f64, hi: f64, param: &str) -> Result<Option<f64>, ApiError> {
    match value {
        Some(v) if !(lo..=hi).contains(&v) || v.is_nan() => Err(ApiError::invalid(
            format!("{param} must be between {lo} and {hi}, got {v}"),
            Some(param),
        )),
        other => Ok(other),
    }
}

/// Validates the fields shared by chat and completions; `max_tokens` and `logprobs` come from the
/// endpoint-specific fields.
pub fn plan(
    f: &SamplingFields,
    max_tokens: Option<i64>,
    max_tokens_param: &str,
    logprobs: Option<usize>,
) -> Result<GenPlan, ApiError> {
    let temperature = check_range(f.temperature, 0.0, 2.0, "temperature")?.unwrap_or(1.0);
    let top_p = f.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("top_p must be in (0, 1], got {top_p}"),
            Some("top_p"),
        ));
    }
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                format!("top_k must be -1 (disabled) or at least 1, got {k}"),
                Some("top_k"),
            ))
        }
    };
    let min_p = check_range(f.min_p, 0.0, 1.0, "min_p")?.unwrap_or(0.0);
    let frequency_penalty =
        check_range(f.frequency_penalty, -2.0, 2.0, "frequency_penalty")?.unwrap_or(0.0);
    let presence_penalty =
        check_range(f.presence_penalty, -2.0, 2.0, "presence_penalty")?.unwrap_or(0.0);
    let repetition_penalty = f.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::invalid(
            format!("repetition_penalty must be in (0, 10], got {repetition_penalty}"),
            Some("repetition_penalty"),
        ));
    }
    let n = f.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            format!("n must be between 1 and {MAX_N}, got {n}"),
            Some("n"),
        ));
    }
    let max_tokens = match max_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                format!("{max_tokens_param} must be at least 1, got {m}"),
                Some(max_tokens_param),
            ))
        }
        Some(m) => Some(m as usize),
        None => None,
    };
    let stops = match &f.stop {
        None => Vec::new(),
        Some(StopSpec::One(s)) => vec![s.clone()],
        Some(StopSpec::Many(v)) => v.clone(),
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_STOP_STRINGS} stop sequences are allowed, got {}",
                stops.len()
            ),
            Some("stop"),
        ));
    }
    let stream = f.stream.unwrap_or(false);
    let include_usage = f.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if f.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options is only allowed with stream=true",
            Some("stream_options"),
        ));
    }
    let params = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed: f.seed.map(|s| s as u64),
        repetition_penalty: repetition_penalty as f32,
        frequency_penalty: frequency_penalty as f32,
        presence_penalty: presence_penalty as f32,
        max_tokens: max_tokens.unwrap_or(0),
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs,
        prompt_logprobs: None,
        guidance: match &f.response_format {
            Some(rf) => response_format_guidance(rf)?,
            None => None,
        },
        // Set once the prompt is rendered (`chat::reasoning_gate`).
        reasoning_gate: None,
    };
    Ok(GenPlan {
        n: n as usize,
        params,
        max_tokens,
        stops,
        stream,
        include_usage,
    })
}

/// Validates a logprobs count (chat `top_logprobs`, completions `logprobs`).
pub fn logprobs_count(value: Option<i64>, param: &str) -> Result<Option<usize>, ApiError> {
    match value {
        Some(v) if !(0..=MAX_LOGPROBS).contains(&v) => Err(ApiError::invalid(
            format!("{param} must be between 0 and {MAX_LOGPROBS}, got {v}"),
            Some(param),
        )),
        Some(v) => Ok(Some(v as usize)),
        None => Ok(None),
    }
}

/// The completion length of one prompt: the request's, or what is left of the context; 400 when the
/// prompt and the completion do not fit.
pub fn resolve_max_tokens(
    requested: Option<usize>,
    prompt_len: usize,
    max_model_len: usize,
) -> Result<usize, ApiError> {
    if prompt_len >= max_model_len {
        return Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your prompt \
                 has {prompt_len} tokens, which leaves no room for a completion."
            ),
            Some("messages"),
        ));
    }
    match requested {
        Some(m) if prompt_len + m > max_model_len => Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested \
                 {} tokens ({prompt_len} in the prompt, {m} in the completion). Please reduce the length \
                 of the prompt or completion.",
                prompt_len + m
            ),
            Some("max_tokens"),
        )),
        Some(m) => Ok(m),
        None => Ok(max_model_len - prompt_len),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: serde_json::Value) -> SamplingFields {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn defaults_follow_openai() {
        let p = plan(&fields(serde_json::json!({})), None, "max_tokens", None).unwrap();
        assert_eq!(p.n, 1);
        assert_eq!(p.params.temperature, 1.0);
        assert_eq!(p.params.top_p, 1.0);
        assert_eq!(p.params.top_k, 0);
        assert!(!p.stream);
        assert!(p.stops.is_empty());
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let cases = [
            (serde_json::json!({"temperature": 2.5}), "temperature"),
            (serde_json::json!({"temperature": -0.1}), "temperature"),
            (serde_json::json!({"top_p": 0.0}), "top_p"),
            (serde_json::json!({"top_p": 1.5}), "top_p"),
            (serde_json::json!({"n": 0}), "n"),
            (serde_json::json!({"top_k": -2}), "top_k"),
            (serde_json::json!({"min_p": 1.5}), "min_p"),
            (
                serde_json::json!({"presence_penalty": 3.0}),
                "presence_penalty",
            ),
            (
                serde_json::json!({"repetition_penalty": 0.0}),
                "repetition_penalty",
            ),
            (
                serde_json::json!({"stop": ["a", "b", "c", "d", "e"]}),
                "stop",
            ),
            (
                serde_json::json!({"stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ];
        for (json, param) in cases {
            let err = plan(&fields(json.clone()), None, "max_tokens", None).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{json}");
        }
        let err = plan(
            &fields(serde_json::json!({})),
            Some(0),
            "max_completion_tokens",
            None,
        )
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("max_completion_tokens"));
        assert!(logprobs_count(Some(21), "top_logprobs").is_err());
        assert_eq!(logprobs_count(Some(20), "top_logprobs").unwrap(), Some(20));
    }

    #[test]
    fn seeds_are_derived_per_choice() {
        let p = plan(
            &fields(serde_json::json!({"seed": 7, "n": 3})),
            Some(5),
            "max_tokens",
            None,
        )
        .unwrap();
        assert_eq!(p.params_for_choice(0, 5).seed, Some(7));
        assert_eq!(p.params_for_choice(2, 5).seed, Some(9));
        assert_eq!(p.params_for_choice(2, 5).max_tokens, 5);
        let unseeded = plan(&fields(serde_json::json!({})), None, "max_tokens", None).unwrap();
        assert_eq!(unseeded.params_for_choice(1, 5).seed, None);
    }

    #[test]
    fn max_tokens_must_fit_the_context() {
        assert_eq!(resolve_max_tokens(None, 10, 100).unwrap(), 90);
        assert_eq!(resolve_max_tokens(Some(90), 10, 100).unwrap(), 90);
        assert!(resolve_max_tokens(Some(91), 10, 100).is_err());
        assert!(resolve_max_tokens(None, 100, 100).is_err());
    }
}
