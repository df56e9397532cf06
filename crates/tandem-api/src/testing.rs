//! In-process fakes for handler tests: a byte-level codec and a scripted backend, so validation,
//! error shapes, SSE framing and stop strings are tested without a model file.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Map, Value};
use tandem_engine::{EngineStats, FinishReason, RequestId, TokenLogprobs, TokenOutput};

use crate::backend::{BackendError, GenerateBackend, GenerateRequest, TokenStream};
use crate::codec::{CodecError, StreamDecoder, TextCodec};
use crate::state::{ApiConfig, AppState};

/// The fake EOS id: just past the 256 byte tokens.
pub const EOS: u32 = 256;

/// Tokens are bytes; id 256 is a special EOS token rendered as `<eos>`.
pub struct ByteCodec;

/// Streams bytes out, releasing only complete UTF-8 characters.
struct ByteDecoder(Vec<u8>);

impl StreamDecoder for ByteDecoder {
    fn push(&mut self, token: u32) -> Result<String, CodecError> {
        if token == EOS {
            return Ok(String::new());
        }
        self.0.push(token as u8);
        match std::str::from_utf8(&self.0) {
            Ok(s) => {
                let s = s.to_owned();
                self.0.clear();
                Ok(s)
            }
            Err(e) if e.error_len().is_none() => Ok(String::new()),
            Err(_) => Ok(String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned()),
        }
    }

    fn finish(&mut self) -> Result<String, CodecError> {
        Ok(String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned())
    }
}

impl TextCodec for ByteCodec {
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, CodecError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, CodecError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if id == EOS {
                if !skip_special_tokens {
                    bytes.extend_from_slice(b"<eos>");
                }
            } else {
                bytes.push(id as u8);
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn stream_decoder(&self) -> Box<dyn StreamDecoder> {
        Box::new(ByteDecoder(Vec::new()))
    }

    fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        _tools: Option<&Value>,
        extra: &Map<String, Value>,
    ) -> Result<String, CodecError> {
        let mut out = String::new();
        for m in messages {
            out.push_str(&format!(
                "<{}>{}\n",
                m["role"].as_str().unwrap_or(""),
                m["content"].as_str().unwrap_or("")
            ));
        }
        if add_generation_prompt {
            out.push_str("<assistant>");
            // Like Qwen3's templates: thinking opened for the model, or closed before it starts.
            match extra.get("enable_thinking").and_then(Value::as_bool) {
                Some(true) => out.push_str("<think>\n"),
                Some(false) => out.push_str("<think>\n\n</think>\n\n"),
                None => {}
            }
        }
        Ok(out)
    }

    fn vocab_size(&self) -> usize {
        257
    }
}

/// Answers every request with the bytes of `reply` (then EOS), honouring max_tokens and logprobs.
pub struct FakeBackend {
    /// What every request generates.
    pub reply: Mutex<String>,
    /// Context length.
    pub max_model_len: usize,
    /// Refuse submissions with QueueFull.
    pub queue_full: AtomicBool,
    /// Fail health checks, as a stopped engine would.
    pub stopped: AtomicBool,
    /// Streams not yet dropped: proves that disconnects and stop strings release requests.
    pub live: Arc<AtomicUsize>,
    /// Every submission, in order.
    pub submitted: Mutex<Vec<GenerateRequest>>,
    /// Delay between tokens, so a disconnect can happen mid-stream.
    pub token_delay: std::time::Duration,
    /// When above 0, streams fail with `BackendError::Failed("boom")` after this many tokens.
    pub fail_after: AtomicUsize,
}

impl FakeBackend {
    /// A backend replying `reply` with an 8192-token context.
    pub fn new(reply: &str) -> Self {
        Self {
            reply: Mutex::new(reply.to_owned()),
            max_model_len: 8192,
            queue_full: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            live: Arc::new(AtomicUsize::new(0)),
            submitted: Mutex::new(Vec::new()),
            token_delay: std::time::Duration::ZERO,
            fail_after: AtomicUsize::new(0),
        }
    }
}

/// Decrements the live count when a fake stream is dropped.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl GenerateBackend for FakeBackend {
    fn submit(&self, req: GenerateRequest) -> Result<TokenStream, BackendError> {
        let params = req.params.clone();
        if self.queue_full.load(Ordering::SeqCst) {
            return Err(BackendError::QueueFull { waiting: 7 });
        }
        if req.prompt.len() + params.max_tokens > self.max_model_len {
            return Err(BackendError::PromptTooLong {
                prompt: req.prompt.len(),
                max_tokens: params.max_tokens,
                max_model_len: self.max_model_len,
            });
        }
        self.submitted.lock().push(req);
        let mut tokens: Vec<u32> = self.reply.lock().bytes().map(u32::from).collect();
        tokens.push(EOS);
        let mut outputs = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let last_by_length = i + 1 == params.max_tokens;
            let finish = if t == EOS && !params.ignore_eos {
                Some(FinishReason::Stop)
            } else if last_by_length {
                Some(FinishReason::Length)
            } else {
                None
            };
            let logprobs = params.logprobs.map(|k| TokenLogprobs {
                logprob: -0.25,
                top: (0..k as u32)
                    .map(|j| (t.saturating_sub(j), -0.25 - j as f32))
                    .collect(),
            });
            outputs.push(TokenOutput {
                token: t,
                logprobs,
                finish,
                prompt_logprobs: None,
            });
            if finish.is_some() {
                break;
            }
        }
        let mut outputs: Vec<Result<TokenOutput, BackendError>> =
            outputs.into_iter().map(Ok).collect();
        let fail_after = self.fail_after.load(Ordering::SeqCst);
        if fail_after > 0 {
            outputs.truncate(fail_after);
            outputs.push(Err(BackendError::Failed("boom".to_owned())));
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(self.live.clone());
        let delay = self.token_delay;
        Ok(Box::pin(futures::stream::unfold(
            (outputs.into_iter(), guard),
            move |(mut it, guard)| async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                it.next().map(|o| (o, (it, guard)))
            },
        )))
    }

    fn abort(&self, _id: RequestId) {}

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.live.load(Ordering::SeqCst),
            kv_blocks_total: 64,
            ..EngineStats::default()
        }
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn health(&self) -> futures::future::BoxFuture<'static, Result<(), BackendError>> {
        let result = if self.stopped.load(Ordering::SeqCst) {
            Err(BackendError::Unavailable(
                "the engine has stopped".to_owned(),
            ))
        } else {
            Ok(())
        };
        Box::pin(std::future::ready(result))
    }
}

/// An app state over a fake backend and the byte codec.
pub fn fake_state(backend: Arc<FakeBackend>, api_key: Option<&str>) -> Arc<AppState> {
    state_with(backend, api_key, false)
}

/// [`fake_state`] with the reasoning parser on.
pub fn fake_reasoning_state(backend: Arc<FakeBackend>) -> Arc<AppState> {
    state_with(backend, None, true)
}

/// [`fake_reasoning_state`] over another codec (one whose vocabulary has the reasoning tags as tokens).
pub fn fake_reasoning_state_with(
    backend: Arc<FakeBackend>,
    codec: Arc<dyn TextCodec>,
) -> Arc<AppState> {
    codec_state(backend, codec, None, true)
}

fn state_with(
    backend: Arc<FakeBackend>,
    api_key: Option<&str>,
    reasoning_parser: bool,
) -> Arc<AppState> {
    codec_state(backend, Arc::new(ByteCodec), api_key, reasoning_parser)
}

fn codec_state(
    backend: Arc<FakeBackend>,
    codec: Arc<dyn TextCodec>,
    api_key: Option<&str>,
    reasoning_parser: bool,
) -> Arc<AppState> {
    let config = ApiConfig {
        served_model_names: vec!["fake".to_owned(), "alias".to_owned()],
        model_root: "fake-root".to_owned(),
        api_key: api_key.map(str::to_owned),
        system_fingerprint: "fp_test".to_owned(),
        max_body_bytes: 1 << 20,
        probes_need_key: false,
        reasoning_parser,
    };
    Arc::new(AppState::new(backend, codec, config).expect("metrics register"))
}
