//! What the targets share: the default model's tokenizer and chat template (read from its GGUF, no
//! weights: `TANDEM_FUZZ_MODEL` or the repository's `models/`), a backend that answers at once, and
//! one current-thread runtime.

// Each target uses only part of this module.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use tandem_api::{BackendError, GenerateBackend, GenerateRequest, ModelCodec, TokenStream};
use tandem_engine::{EngineStats, FinishReason, RequestId, TokenLogprobs, TokenOutput};
use tandem_model::gguf::{GgufFile, GgufValue};
use tandem_model::Tokenizer;

/// The codec `tandem serve` builds for the default model.
pub fn codec() -> Arc<ModelCodec> {
    static CODEC: OnceLock<Arc<ModelCodec>> = OnceLock::new();
    CODEC
        .get_or_init(|| {
            let path = std::env::var_os("TANDEM_FUZZ_MODEL")
                .map(Into::into)
                .unwrap_or_else(tandem_testkit::default_model);
            let gguf = GgufFile::open(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
            let tokenizer = Tokenizer::from_gguf(&gguf).expect("tokenizer");
            let template = gguf
                .get("tokenizer.chat_template")
                .and_then(GgufValue::as_str)
                .map(str::to_owned);
            Arc::new(ModelCodec::new(tokenizer, template.as_deref()).expect("template"))
        })
        .clone()
}

/// One runtime for every input (building one per input would dominate the run).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// A backend that checks the context like the engine and streams back the prompt's first tokens, so
/// the API's whole answer path (stop strings, logprobs, streaming, usage) runs on every input.
pub struct EchoBackend;

/// Context length the echo backend reports.
const MAX_LEN: usize = 2048;

impl GenerateBackend for EchoBackend {
    fn submit(&self, req: GenerateRequest) -> Result<TokenStream, BackendError> {
        let GenerateRequest { prompt, params, .. } = req;
        if prompt.is_empty() || prompt.len() + params.max_tokens > MAX_LEN {
            return Err(BackendError::PromptTooLong {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                max_model_len: MAX_LEN,
            });
        }
        let n = params.max_tokens.min(prompt.len()).min(8);
        let outputs: Vec<_> = prompt[..n]
            .iter()
            .enumerate()
            .map(|(i, &token)| {
                Ok(TokenOutput {
                    token,
                    logprobs: params.logprobs.map(|k| TokenLogprobs {
                        logprob: -0.5,
                        top: (0..k as u32).map(|j| (j, -1.0 - j as f32)).collect(),
                    }),
                    finish: (i + 1 == n).then_some(if n == params.max_tokens {
                        FinishReason::Length
                    } else {
                        FinishReason::Stop
                    }),
                    prompt_logprobs: None,
                })
            })
            .collect();
        Ok(Box::pin(futures::stream::iter(outputs)))
    }

    fn abort(&self, _id: RequestId) {}

    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    fn max_model_len(&self) -> usize {
        MAX_LEN
    }

    fn health(&self) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}
