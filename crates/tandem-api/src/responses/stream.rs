//! A streamed response: the generation's steps as OpenAI's event sequence (`response.created` to the
//! terminal `response.*` event), tool calls held back until they parse.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};

use crate::codec::TextCodec;
use crate::error::ApiError;
use crate::generate::{chat_logprob, ChoiceRun, Step};
use crate::protocol::ChatTokenLogprob;
use crate::reasoning::ReasoningParser;
use crate::sse::to_json;
use crate::tools::{CallHold, ToolCall, ToolSpec};

use super::wire::*;
use super::{call_item, capped, item_id, message_item, reasoning_item, Echo, Ending};

/// The message item being streamed: its place in `output`, id, and text and logprobs so far.
struct OpenMessage {
    index: usize,
    id: String,
    text: String,
    logprobs: Vec<ChatTokenLogprob>,
}

/// The reasoning item being streamed: its place in `output`, id, and text so far.
struct OpenReasoning {
    index: usize,
    id: String,
    text: String,
}

/// One streamed response: turns the generation's steps into OpenAI's event sequence.
///
/// It owns the [`ChoiceRun`], so a client that hangs up drops it and aborts the engine request.
struct EventWriter {
    run: Option<ChoiceRun>,
    spec: Option<ToolSpec>,
    hold: CallHold,
    /// Splits the reasoning block off the answer (reasoning parser on).
    parser: Option<ReasoningParser>,
    reasoning: Option<OpenReasoning>,
    /// Whether a reasoning item was opened (it may be closed since): at most one per response.
    reasoning_seen: bool,
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
        let reasoning_tokens = self.parser.as_ref().map_or(0, |p| p.reasoning_tokens());
        let usage = ending.map(|_| {
            ResponseUsage::new(self.input_tokens, self.output_tokens)
                .with_reasoning(reasoning_tokens)
        });
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

    /// Streams `text` into the reasoning item, opening it first if needed.
    fn reasoning_text(&mut self, text: String, out: &mut Vec<Event>) {
        if !self.reasoning_seen {
            self.reasoning_seen = true;
            let (index, id) = (self.done.len(), item_id("rs"));
            let item = reasoning_item(id.clone(), "in_progress", None);
            out.push(self.event(
                "response.output_item.added",
                EventBody::Item {
                    output_index: index,
                    item,
                },
            ));
            let part = EventBody::ReasoningPart {
                item_id: id.clone(),
                output_index: index,
                content_index: 0,
                part: ReasoningText::new(String::new()),
            };
            out.push(self.event("response.content_part.added", part));
            self.reasoning = Some(OpenReasoning {
                index,
                id,
                text: String::new(),
            });
        }
        if text.is_empty() {
            return;
        }
        let Some(r) = self.reasoning.as_mut() else {
            return;
        };
        r.text.push_str(&text);
        let body = EventBody::ReasoningDelta {
            item_id: r.id.clone(),
            output_index: r.index,
            content_index: 0,
            delta: text,
        };
        out.push(self.event("response.reasoning_text.delta", body));
    }

    /// Closes the reasoning item, if one is open.
    fn close_reasoning(&mut self, status: &'static str, out: &mut Vec<Event>) {
        let Some(r) = self.reasoning.take() else {
            return;
        };
        let done = EventBody::ReasoningDone {
            item_id: r.id.clone(),
            output_index: r.index,
            content_index: 0,
            text: r.text.clone(),
        };
        out.push(self.event("response.reasoning_text.done", done));
        let part = EventBody::ReasoningPart {
            item_id: r.id.clone(),
            output_index: r.index,
            content_index: 0,
            part: ReasoningText::new(r.text.clone()),
        };
        out.push(self.event("response.content_part.done", part));
        let item = reasoning_item(r.id, status, Some(ReasoningText::new(r.text)));
        self.done.push(item.clone());
        out.push(self.event(
            "response.output_item.done",
            EventBody::Item {
                output_index: r.index,
                item,
            },
        ));
    }

    /// Streams `text` into the message item, opening it first if needed (and closing the reasoning
    /// item, which the answer follows).
    fn text(&mut self, text: String, out: &mut Vec<Event>) {
        self.close_reasoning("completed", out);
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
        self.close_reasoning("completed", out);
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
        let logprob = chat_logprob(self.codec.as_ref(), &step.token);
        let mut out = Vec::new();
        let mut text = step.text;
        let mut answer_token = true;
        if let Some(parser) = self.parser.as_mut() {
            let mut split = parser.push(&text);
            if step.finish.is_some() {
                let rest = parser.finish();
                split.reasoning.push_str(&rest.reasoning);
                split.content.push_str(&rest.content);
            }
            // The reasoning block's tokens are not the message's: their logprobs stay out of it.
            answer_token = !split.in_reasoning;
            text = split.content;
            if parser.reasoned() && self.message.is_none() {
                self.reasoning_text(split.reasoning, &mut out);
            }
        }
        if answer_token {
            self.pending.extend(logprob);
        }
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
        let answered = self.message.is_some() || !calls.is_empty();
        self.close_reasoning(
            if answered {
                "completed"
            } else {
                ending.item_status()
            },
            &mut out,
        );
        // Like the whole answer, a response without calls or reasoning always has a message.
        if calls.is_empty() && self.message.is_none() && !self.reasoning_seen {
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
        self.close_reasoning("incomplete", &mut out);
        self.close_message("incomplete", &mut out);
        out.push(self.lifecycle("response.failed", Some(Ending::Failed), Some(error.message)));
        out
    }
}

/// The SSE answer: the opening events, then the steps' events as they come. Unlike chat completions
/// there is no `[DONE]`: the terminal `response.*` event ends the stream, as in OpenAI's API.
pub(super) fn stream_response(
    run: ChoiceRun,
    spec: Option<ToolSpec>,
    parser: Option<ReasoningParser>,
    echo: Echo,
    codec: Arc<dyn TextCodec>,
    input_tokens: usize,
) -> Response {
    let mut writer = EventWriter {
        run: Some(run),
        spec,
        hold: CallHold::default(),
        parser,
        reasoning: None,
        reasoning_seen: false,
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
