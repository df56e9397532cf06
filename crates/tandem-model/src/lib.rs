//! Llama-family models for tandem: configuration, GGUF and safetensors loading, tokenizer, chat
//! template, streaming detokenizer, model identity, the paged KV cache storage and the CPU forward pass.

pub mod batch;
pub mod config;
pub mod error;
pub mod gguf;
pub mod tokenizer;
pub mod weights;

pub use batch::{ForwardBatch, KvDtype, KvLayout, LogitsWanted, SeqChunk};
pub use config::ModelConfig;
pub use error::ModelError;
pub use tokenizer::Tokenizer;
pub use weights::{LayerWeights, LlamaWeights};
