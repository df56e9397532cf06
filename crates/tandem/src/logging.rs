//! The process's log subscriber: text for people (colour only on a terminal) or one JSON object per
//! line for collectors, and in both the process's tag (which worker of a P/D deployment wrote a line,
//! since the head and its workers share one stderr).
//!
//! JSON lines are flat: the event's fields and the fields of every span it is in (the request's
//! `request_id`, `method`, `path`) are top-level keys beside `timestamp`, `level`, `target`, `message`
//! and the tag's `worker`/`role`, so a collector filters on `request_id` without knowing span nesting.

use std::fmt;
use std::io::IsTerminal;
use std::sync::OnceLock;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Which process of a deployment writes the lines: set for P/D heads, workers and pipeline stages, whose
/// logs interleave on one stderr.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessTag {
    /// The worker's id (`prefill-0`), `head`, or a pipeline stage's `stage-N` (`decode-0/stage-N` when a
    /// tagged worker started it).
    pub name: String,
    /// `prefill`, `decode`, `head` or `stage`.
    pub role: String,
}

/// This process's tag name (`decode-0`, `head`), once `init` installed a tagged subscriber.
static TAG_NAME: OnceLock<String> = OnceLock::new();

/// The name this process's lines are tagged with, if any: the pipeline stages a worker starts put it
/// before their own (`[decode-0/stage-1]`).
pub fn process_name() -> Option<&'static str> {
    TAG_NAME.get().map(String::as_str)
}

/// The format this process logs in, once `set_format` has been called.
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Records the process's log format, for output that must not break JSON lines (the serving banner).
pub fn set_format(format: LogFormat) {
    let _ = FORMAT.set(format);
}

/// The process's log format: text until `set_format` (then the subscriber is installed too).
pub fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

/// Installs the global subscriber on stderr: `default_level` unless RUST_LOG says otherwise.
pub fn init(format: LogFormat, default_level: &str, tag: Option<ProcessTag>) {
    if let Some(tag) = &tag {
        let _ = TAG_NAME.set(tag.name.clone());
    }
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colour codes only for a person's terminal: redirected logs (files, containers, journald) stay plain.
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(ansi)
            .event_format(TaggedText {
                inner: tracing_subscriber::fmt::format().with_ansi(ansi),
                tag,
            })
            .init(),
        LogFormat::Json => builder
            .with_ansi(false)
            .fmt_fields(JsonFields::new())
            .event_format(JsonLine { tag })
            .init(),
    }
}

/// A JSON-lines subscriber writing to `writer` (what `init` installs for `--log-format json`, for tests).
#[cfg(test)]
fn json_subscriber<W>(writer: W, tag: Option<ProcessTag>) -> impl Subscriber + Send + Sync
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_writer(writer)
        .with_ansi(false)
        .fmt_fields(JsonFields::new())
        .event_format(JsonLine { tag })
        .finish()
}

/// Text lines, prefixed with `[tag]` when the process has one.
struct TaggedText<F> {
    inner: F,
    tag: Option<ProcessTag>,
}

impl<S, N, F> FormatEvent<S, N> for TaggedText<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if let Some(tag) = &self.tag {
            write!(writer, "[{}] ", tag.name)?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

/// One flat JSON object per event (see the module's comment).
struct JsonLine {
    tag: Option<ProcessTag>,
}

impl<S, N> FormatEvent<S, N> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), timestamp.into());
        let meta = event.metadata();
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        event.record(&mut FieldMap(&mut line));
        // Spans innermost first, so an inner span's field wins over an outer one's of the same name;
        // the event's own fields win over both. Span fields were written by `JsonFields` as an object.
        if let Some(scope) = ctx.event_scope() {
            for span in scope {
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&fields.fields) {
                    for (key, value) in fields {
                        line.entry(key).or_insert(value);
                    }
                }
                line.entry("span").or_insert_with(|| span.name().into());
            }
        }
        if let Some(tag) = &self.tag {
            line.entry("worker")
                .or_insert_with(|| tag.name.clone().into());
            line.entry("role")
                .or_insert_with(|| tag.role.clone().into());
        }
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Collects an event's fields into a JSON object, keeping numbers and booleans typed.
struct FieldMap<'a>(&'a mut Map<String, Value>);

impl Visit for FieldMap<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A `MakeWriter` into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Buffer {
        type Writer = Buffer;

        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    #[test]
    fn json_lines_carry_span_fields_and_the_process_tag_at_top_level() {
        let buffer = Buffer::default();
        let tag = ProcessTag {
            name: "decode-0".into(),
            role: "decode".into(),
        };
        tracing::subscriber::with_default(json_subscriber(buffer.clone(), Some(tag)), || {
            let outer = tracing::info_span!("request", request_id = "abc", path = "/v1/x");
            let _outer = outer.enter();
            let inner = tracing::info_span!("step", path = "/inner");
            inner.in_scope(|| tracing::info!(tokens = 12u64, ok = true, "decoded"));
            tracing::warn!(request_id = "event-wins", "overridden");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let first = &lines[0];
        assert_eq!(first["message"], "decoded");
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["tokens"], 12);
        assert_eq!(first["ok"], true);
        assert_eq!(first["request_id"], "abc");
        assert_eq!(first["path"], "/inner", "the inner span's field wins");
        assert_eq!(first["span"], "step");
        assert_eq!(first["worker"], "decode-0");
        assert_eq!(first["role"], "decode");
        assert!(first["timestamp"].as_str().unwrap().ends_with('Z'));
        assert_eq!(lines[1]["request_id"], "event-wins");
        assert_eq!(lines[1]["path"], "/v1/x");
    }
}
