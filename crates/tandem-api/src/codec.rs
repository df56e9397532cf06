//! Text <-> token conversion the API needs (tokenize, detokenize, stream-detokenize, chat template),
//! behind a trait so handlers can be tested without a model file.

use parking_lot::Mutex;
use serde_json::{Map, Value};
use tandem_model::{ChatTemplate, IncrementalDecoder, Tokenizer};

/// Why tokenization or template rendering failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// The tokenizer rejected the input or could not decode ids.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template failed to render these messages.
    #[error("chat template error: {0}")]
    Template(String),
    /// The model has no chat template and none was given with --chat-template.
    #[error("this model has no chat template; start the server with --chat-template FILE")]
    NoChatTemplate,
}

/// Streams text out of tokens one at a time without ever splitting a UTF-8 character.
pub trait StreamDecoder: Send {
    /// Text newly completed by this token ("" while a character is incomplete).
    fn push(&mut self, token: u32) -> Result<String, CodecError>;
    /// Whatever was held back at the end of generation.
    fn finish(&mut self) -> Result<String, CodecError>;
}

/// The tokenizer and chat template of the served model, as the handlers use them.
pub trait TextCodec: Send + Sync + 'static {
    /// Text to token ids; `add_special_tokens` adds BOS etc. as the tokenizer is configured to.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, CodecError>;
    /// Token ids to text.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, CodecError>;
    /// A fresh streaming decoder that skips special tokens.
    fn stream_decoder(&self) -> Box<dyn StreamDecoder>;
    /// Renders OpenAI-style messages into one prompt string with the model's template; `extra` are
    /// further template variables (a request's `chat_template_kwargs`, already checked against the
    /// names the server sets).
    fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
        extra: &Map<String, Value>,
    ) -> Result<String, CodecError>;
    /// Number of token ids the tokenizer knows; ids at or above it are rejected.
    fn vocab_size(&self) -> usize;
}

/// The real codec: the model's tokenizer plus its (or an overriding) chat template.
pub struct ModelCodec {
    tokenizer: Tokenizer,
    /// Behind a mutex because the template type makes no Sync promise; rendering is short.
    template: Option<Mutex<ChatTemplate>>,
}

impl ModelCodec {
    /// Builds the codec; `template_source` is the model's template or the --chat-template override.
    pub fn new(tokenizer: Tokenizer, template_source: Option<&str>) -> Result<Self, CodecError> {
        let template = template_source
            .map(|src| {
                ChatTemplate::new(src, tokenizer.bos_token(), tokenizer.eos_token())
                    .map(Mutex::new)
                    .map_err(|e| CodecError::Template(e.to_string()))
            })
            .transpose()?;
        Ok(Self {
            tokenizer,
            template,
        })
    }
}

/// Adapter from the model's incremental decoder to [`StreamDecoder`].
struct ModelStreamDecoder(IncrementalDecoder);

impl StreamDecoder for ModelStreamDecoder {
    fn push(&mut self, token: u32) -> Result<String, CodecError> {
        self.0
            .push(token)
            .map_err(|e| CodecError::Tokenizer(e.to_string()))
    }

    fn finish(&mut self) -> Result<String, CodecError> {
        self.0
            .finish()
            .map_err(|e| CodecError::Tokenizer(e.to_string()))
    }
}

impl TextCodec for ModelCodec {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, CodecError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| CodecError::Tokenizer(e.to_string()))
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, CodecError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| CodecError::Tokenizer(e.to_string()))
    }

    fn stream_decoder(&self) -> Box<dyn StreamDecoder> {
        Box::new(ModelStreamDecoder(IncrementalDecoder::new(
            self.tokenizer.clone(),
            true,
        )))
    }

    fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
        extra: &Map<String, Value>,
    ) -> Result<String, CodecError> {
        let template = self.template.as_ref().ok_or(CodecError::NoChatTemplate)?;
        template
            .lock()
            .render_with(messages, add_generation_prompt, tools, extra)
            .map_err(|e| CodecError::Template(e.to_string()))
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }
}
