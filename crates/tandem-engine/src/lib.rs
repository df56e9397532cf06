//! The serving engine: paged KV block pool with prefix caching, a continuous-batching scheduler with
//! chunked prefill and preemption, a sampler, and the engine thread that drives a model [`Backend`].
//!
//! Callers talk to the engine thread through a cheap [`EngineHandle`]; each request streams its tokens
//! back on its own [`RequestStream`].

pub mod backend;
pub mod bench;
pub mod block_pool;
pub mod cpu;
pub mod engine;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod types;

pub use backend::{Backend, BackendError, DeviceSampling};
pub use cpu::CpuBackend;
pub use engine::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineStats, ExportedKv, ImportPlan, Pending,
    RequestStream,
};
pub use types::*;
