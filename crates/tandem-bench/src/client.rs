//! The streaming client: one `/v1/completions` request per [`BenchRequest`], every chunk timestamped.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::BenchError;
use crate::metrics::RequestRecord;
use crate::workload::BenchRequest;

/// An OpenAI-compatible server to benchmark.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The name shown in tables and plots.
    pub name: String,
    /// Base URL without `/v1`, e.g. `http://127.0.0.1:8000`.
    pub base_url: String,
}

impl Endpoint {
    /// Parses `name=url` or a bare URL (named after its host and port).
    pub fn parse(s: &str) -> Endpoint {
        let (name, url) = match s.split_once('=') {
            Some((name, url)) if !name.contains('/') => (name.to_string(), url.to_string()),
            _ => {
                let bare = s
                    .trim_start_matches("http://")
                    .trim_start_matches("https://");
                (bare.trim_end_matches('/').to_string(), s.to_string())
            }
        };
        let base_url = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        Endpoint { name, base_url }
    }
}

/// A connection to one endpoint, with the model name resolved.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    endpoint: Endpoint,
    model: String,
    api_key: Option<String>,
    timeout: Duration,
    /// Sent as every request's `response_format` (guided decoding runs).
    response_format: Option<Value>,
}

/// `GET /v1/models`.
#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

impl Client {
    /// Connects to `endpoint`; `model` defaults to the first model of its `GET /v1/models`. `roots` are
    /// the CA certificates an https endpoint's certificate may chain to (`--ca-cert`).
    pub async fn connect(
        endpoint: Endpoint,
        model: Option<String>,
        api_key: Option<String>,
        timeout: Duration,
        roots: &[reqwest::Certificate],
    ) -> Result<Client, BenchError> {
        // No connection reuse: a server may close an idle kept-alive connection just as a request goes
        // out on it (llama-server does after 5 s), which would count as a failed request. A loopback
        // connect costs well under a millisecond of the TTFT.
        let http = roots
            .iter()
            .fold(reqwest::Client::builder(), |b, cert| {
                b.add_root_certificate(cert.clone())
            })
            .pool_max_idle_per_host(0)
            .build()
            .map_err(|e| BenchError::Endpoint {
                url: endpoint.base_url.clone(),
                message: e.to_string(),
            })?;
        let model = match model {
            Some(m) => m,
            None => {
                let fail = |message: String| BenchError::Endpoint {
                    url: endpoint.base_url.clone(),
                    message,
                };
                let mut req = http.get(format!("{}/v1/models", endpoint.base_url));
                if let Some(key) = &api_key {
                    req = req.bearer_auth(key);
                }
                let list: ModelList = req
                    .send()
                    .await
                    .map_err(|e| {
                        if e.is_connect() {
                            BenchError::Unreachable {
                                url: endpoint.base_url.clone(),
                                source: e,
                            }
                        } else {
                            fail(format!("GET /v1/models: {e}"))
                        }
                    })?
                    .error_for_status()
                    .map_err(|e| fail(format!("GET /v1/models: {e}")))?
                    .json()
                    .await
                    .map_err(|e| fail(format!("GET /v1/models: {e}")))?;
                list.data
                    .into_iter()
                    .next()
                    .map(|m| m.id)
                    .ok_or_else(|| fail("GET /v1/models lists no model".into()))?
            }
        };
        Ok(Client {
            http,
            endpoint,
            model,
            api_key,
            timeout,
            response_format: None,
        })
    }

    /// Sends `format` as every request's `response_format`, to measure guided decoding.
    pub fn with_response_format(mut self, format: Option<Value>) -> Self {
        self.response_format = format;
        self
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The model name sent in every request.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The request body: greedy, streamed with usage, exactly `max_tokens` tokens thanks to `ignore_eos`.
    pub fn body(&self, req: &BenchRequest) -> Value {
        let mut body = json!({
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(f) = &self.response_format {
            body["response_format"] = f.clone();
        }
        body
    }

    /// Sends one request and records its timings; `run_start` is the run's time zero. Never fails: a
    /// failed request is a record with `success: false` and the error message.
    pub async fn send(&self, req: &BenchRequest, run_start: Instant) -> RequestRecord {
        self.send_keeping_text(req, run_start, None).await
    }

    /// Like [`Self::send`], appending the streamed text to `text` when given (a multi-turn run sends
    /// each answer back in the next turn's prompt).
    pub async fn send_keeping_text(
        &self,
        req: &BenchRequest,
        run_start: Instant,
        text: Option<&mut String>,
    ) -> RequestRecord {
        let start = Instant::now();
        let mut rec = RequestRecord {
            class: req.class,
            start_s: start.duration_since(run_start).as_secs_f64(),
            success: false,
            prompt_len: req.prompt_len,
            server_prompt_tokens: None,
            output_len: 0,
            ttft_s: 0.0,
            itl_s: Vec::new(),
            e2e_s: 0.0,
            error: None,
        };
        let outcome =
            tokio::time::timeout(self.timeout, self.stream(req, start, &mut rec, text)).await;
        rec.e2e_s = start.elapsed().as_secs_f64();
        match outcome {
            Ok(Ok(())) => rec.success = true,
            Ok(Err(message)) => rec.error = Some(message),
            Err(_) => rec.error = Some(format!("timed out after {:?}", self.timeout)),
        }
        rec
    }

    /// Streams the response into `rec`; an `Err` carries the message to record.
    async fn stream(
        &self,
        req: &BenchRequest,
        start: Instant,
        rec: &mut RequestRecord,
        mut text: Option<&mut String>,
    ) -> Result<(), String> {
        let mut builder = self
            .http
            .post(format!("{}/v1/completions", self.endpoint.base_url))
            .json(&self.body(req));
        if let Some(key) = &self.api_key {
            builder = builder.bearer_auth(key);
        }
        let resp = builder.send().await.map_err(|e| without_url(&e))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!(
                "HTTP {}: {}",
                status.as_u16(),
                error_message(&text)
            ));
        }
        let mut events = resp.bytes_stream().eventsource();
        let mut chunks = 0usize;
        let mut last = start;
        let mut usage_tokens = None;
        let mut done = false;
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| format!("stream: {e}"))?;
            let data = event.data.trim();
            if data == "[DONE]" {
                done = true;
                break;
            }
            let now = Instant::now();
            let chunk: Value =
                serde_json::from_str(data).map_err(|e| format!("bad chunk {data:?}: {e}"))?;
            if chunk.get("error").is_some() {
                return Err(format!("stream error: {}", error_message(data)));
            }
            if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                let count = |k: &str| usage.get(k).and_then(Value::as_u64).map(|n| n as usize);
                usage_tokens = count("completion_tokens");
                rec.server_prompt_tokens = count("prompt_tokens");
            }
            let chunk_text = chunk
                .get("choices")
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("text"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if let Some(out) = text.as_deref_mut() {
                out.push_str(chunk_text);
            }
            if !chunk_text.is_empty() {
                if chunks == 0 {
                    rec.ttft_s = now.duration_since(start).as_secs_f64();
                } else {
                    rec.itl_s.push(now.duration_since(last).as_secs_f64());
                }
                last = now;
                chunks += 1;
            }
        }
        if !done {
            return Err("stream ended without [DONE]".into());
        }
        if chunks == 0 {
            return Err("no token was streamed".into());
        }
        rec.output_len = usage_tokens.unwrap_or(chunks);
        Ok(())
    }
}

/// A reqwest error without the URL (the same for every request, and noise in error counts).
fn without_url(e: &reqwest::Error) -> String {
    let mut msg = e.to_string();
    if let Some(url) = e.url() {
        msg = msg.replace(&format!(" ({url})"), "");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// The `error.message` of an OpenAI-shaped error body, else the body itself (shortened).
fn error_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        let e = v.get("error")?;
        e.get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| e.as_str().map(str::to_string))
    });
    let mut msg = message.unwrap_or_else(|| body.trim().to_string());
    if msg.len() > 300 {
        let cut = (0..=300)
            .rev()
            .find(|&i| msg.is_char_boundary(i))
            .unwrap_or(0);
        msg.truncate(cut);
        msg.push('…');
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_and_without_names() {
        assert_eq!(
            Endpoint::parse("llama=http://127.0.0.1:8080/v1/"),
            Endpoint {
                name: "llama".into(),
                base_url: "http://127.0.0.1:8080".into()
            }
        );
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:8000"),
            Endpoint {
                name: "127.0.0.1:8000".into(),
                base_url: "http://127.0.0.1:8000".into()
            }
        );
    }

    #[test]
    fn error_messages_come_from_openai_error_bodies() {
        assert_eq!(
            error_message(r#"{"error":{"message":"queue full","type":"x"}}"#),
            "queue full"
        );
        assert_eq!(error_message("plain failure\n"), "plain failure");
        assert_eq!(error_message(&"x".repeat(400)).chars().count(), 301);
    }
}
