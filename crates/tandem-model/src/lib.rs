//! The models tandem serves (Llama, Qwen2/3, Qwen-MoE, Gemma 3 and kin, described per layer in `spec`): configuration, GGUF and safetensors loading, tokenizer, chat
//! template, streaming detokenizer, model identity, the paged KV cache storage and the CPU forward pass.

pub mod batch;
pub mod collective;
pub mod config;
pub mod detok;
pub mod error;
pub mod expert_map;
pub mod gguf;
pub mod identity;
pub mod kv;
pub mod llama;
pub mod load;
pub mod partition;
pub mod spec;
pub mod template;
pub mod tokenizer;
pub mod weights;

pub use batch::{ForwardBatch, KvDtype, KvLayout, LogitsWanted, SeqChunk};
pub use collective::{Collective, GroupBreaker, ThreadCollective};
pub use config::{DenseShape, ModelConfig};
pub use detok::IncrementalDecoder;
pub use error::ModelError;
pub use expert_map::{ExpertMap, ExpertMapError, ExpertPlacement};
pub use identity::ModelIdentity;
pub use kv::KvCache;
pub use llama::{CpuLlama, LayerExpertTokens};
pub use load::{load, LoadOptions, LoadedModel};
pub use partition::{Partition, RankShare};
pub use spec::{Activation, AttentionSpan, LayerRope, LayerSpec, MlpKind, MoeSpec};
pub use template::{ChatTemplate, RESERVED_VARIABLES};
pub use tokenizer::{TokenPiece, Tokenizer};
pub use weights::{GatedMlp, LayerWeights, LlamaWeights, MlpWeights, MoeWeights, SharedExpert};
