//! The serving engine: paged KV block pool with prefix caching, a continuous-batching scheduler with
//! chunked prefill and preemption, a sampler, and the engine thread that drives a model [`Backend`].
//!
//! Callers talk to the engine thread through a cheap [`EngineHandle`]; each request streams its tokens
//! back on its own [`RequestStream`].

pub mod backend;
pub mod bench;
pub mod block_pool;
mod config;
pub mod engine;
mod error;
pub mod guide;
mod handle;
pub mod kv_host;
mod kv_manager;
mod kv_offload;
pub mod kv_staging;
pub mod kv_tiers;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod stage;
mod stats;
mod step_masks;
pub mod types;
mod worker;

pub use backend::{
    Backend, BackendError, BackendErrorKind, BackendInfo, BoxError, DeviceMasks, DeviceSampling,
    LayerBlocks, MaskSource, SampledStep,
};
pub use engine::{
    DiskOffloadConfig, Engine, EngineConfig, EngineError, EngineHandle, EngineStats, ExportedKv,
    ImportPlan, KvOffloadConfig, Pending, RequestStream,
};
pub use guide::GuideEnv;
pub use kv_host::{HostBuf, HostMem, HostPool, KvExport, ReadyExport, StagedExport, VecPool};
pub use kv_offload::{export_layer_major, restore_layer_major};
pub use kv_staging::{HostStaging, KvStaging, StagedLayer, StagingKind, StagingMem, StagingSlice};
pub use stage::{Activations, SizedPool, StageError, StageInput, StageModel, StageOutput};
pub use stats::{KvTierStats, RestoreHistogram};
/// Part of [`EngineStats`]: what a mixture-of-experts backend counted per layer.
pub use tandem_model::{KvDtype, LayerExpertTokens};
pub use types::*;
