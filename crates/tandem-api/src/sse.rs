//! Server-sent-event framing shared by chat and text completions: merges the choices' steps into one
//! `data: {json}\n\n` stream, optionally appends a usage chunk, and always ends with `data: [DONE]`.
//!
//! The stream owns every [`ChoiceRun`]; when the client disconnects axum drops it, which drops the
//! backend streams and aborts the engine requests.

use std::convert::Infallible;
use std::future::ready;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};

use crate::generate::{ChoiceRun, Step};
use crate::protocol::Usage;

/// Renders the usage chunk from the final counts.
pub type UsageRenderer = Box<dyn FnOnce(Usage) -> String + Send>;

/// Builds the SSE response.
///
/// * `runs`: each choice with its index in the answer.
/// * `prelude`: events sent before any token (role announcements, echoed prompts).
/// * `render`: turns a step of choice `index` into its events (none, one, or several).
/// * `usage`: the prompt token count and the usage-chunk renderer, when `include_usage` was asked.
pub fn stream_choices<R, E>(
    runs: Vec<(usize, ChoiceRun)>,
    prelude: Vec<String>,
    mut render: R,
    usage: Option<(usize, UsageRenderer)>,
) -> Response
where
    R: FnMut(usize, Step) -> E + Send + 'static,
    E: IntoIterator<Item = String>,
{
    let completion_tokens = Arc::new(AtomicUsize::new(0));
    let counter = completion_tokens.clone();
    let per_choice = runs.into_iter().map(|(index, run)| {
        stream::unfold(run, move |mut run| async move {
            run.next().await.map(|r| ((index, r), run))
        })
        .boxed()
    });
    let body = stream::select_all(per_choice)
        .scan(false, move |failed, (index, result)| {
            // After an error event the stream ends, dropping (and aborting) the other choices.
            let item = if *failed {
                None
            } else {
                match result {
                    Ok(step) => {
                        counter.fetch_add(1, Ordering::Relaxed);
                        Some(render(index, step).into_iter().collect::<Vec<_>>())
                    }
                    Err(e) => {
                        *failed = true;
                        Some(vec![e.body_json()])
                    }
                }
            };
            ready(item)
        })
        .flat_map(stream::iter);
    let usage_event = stream::once(async move {
        usage.map(|(prompt_tokens, render_usage)| {
            render_usage(Usage::new(
                prompt_tokens,
                completion_tokens.load(Ordering::Relaxed),
            ))
        })
    })
    .filter_map(ready);
    let events = stream::iter(prelude)
        .chain(body)
        .chain(usage_event)
        .chain(stream::once(ready("[DONE]".to_owned())))
        .map(|data| Ok::<_, Infallible>(Event::default().data(data)));
    Sse::new(events).into_response()
}

/// JSON of a response object; our types always serialize, so a failure is a bug worth surfacing loudly.
/// U+0085, U+2028 and U+2029 are escaped: JSON allows them raw in strings, but clients that split an
/// event stream the way Python's `str.splitlines` does (httpx's `iter_lines`) break a line at them and
/// then read half an event.
pub fn to_json<T: serde::Serialize>(value: &T) -> String {
    let json = serde_json::to_string(value).unwrap_or_else(|e| {
        tracing::error!(error = %e, "failed to serialize a response chunk");
        String::from("{}")
    });
    if !json.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        return json;
    }
    // Outside strings JSON is ASCII, so these characters stand inside strings, where an escape is equal.
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        match c {
            '\u{85}' | '\u{2028}' | '\u{2029}' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_separators_inside_strings_are_escaped_and_the_value_is_unchanged() {
        let v = serde_json::json!({"text": "a\u{85}b\u{2028}c\u{2029}d\ne", "n": 1});
        let json = to_json(&v);
        assert_eq!(json.lines().count(), 1, "{json}");
        assert!(!json.contains(['\u{85}', '\u{2028}', '\u{2029}']), "{json}");
        assert!(
            json.contains("\\u0085") && json.contains("\\u2028"),
            "{json}"
        );
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back, v);
    }
}
