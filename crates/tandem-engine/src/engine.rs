//! The engine thread and its handle.
//!
//! One thread owns the backend, block pool and scheduler and is their only mutator. Commands reach
//! it over a channel; each request's outputs go to its own unbounded tokio channel; stats are
//! published under a briefly held lock after every step. When idle the thread blocks on the
//! command channel (with a timeout only while prefill pins have deadlines).
//!
//! This module starts that thread; the caller's side is in `handle`, the thread's loop in `worker`, and
//! its P/D pins, export and import in `kv_manager`.

pub use crate::config::{DiskOffloadConfig, EngineConfig, KvOffloadConfig};
pub use crate::error::EngineError;
pub use crate::handle::{EngineHandle, Pending, RequestStream};
pub use crate::kv_manager::{ExportedKv, ImportPlan};
pub use crate::stats::EngineStats;

use crate::backend::Backend;
use crate::block_pool::BlockPool;
use crate::guide::GuideEnv;
use crate::handle::Shared;
use crate::kv_tiers::KvTiers;
use crate::sampler::Sampler;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::worker::Worker;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use tandem_model::ForwardBatch;

/// Starts the engine thread over a backend.
pub struct Engine;

impl Engine {
    /// Validates `config` against the backend and spawns the engine thread; guided requests are
    /// refused (no vocabulary to compile them against).
    pub fn start<B: Backend>(
        backend: B,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        Self::start_guided(backend, config, None)
    }

    /// Like [`Engine::start`], constraining guided requests with `guide` (built from the model's
    /// tokenizer, over the backend's vocabulary width).
    pub fn start_guided<B: Backend>(
        backend: B,
        config: EngineConfig,
        guide: Option<Arc<GuideEnv>>,
    ) -> Result<EngineHandle, EngineError> {
        let layout = backend.kv_layout();
        if layout.block_size != config.block_size {
            return Err(EngineError::Config(format!(
                "backend block size {} differs from config block_size {}",
                layout.block_size, config.block_size
            )));
        }
        if layout.num_blocks == 0 {
            return Err(EngineError::Config(
                "KV cache holds no block; raise engine.kv_cache_memory".into(),
            ));
        }
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(EngineError::Config(
                "max_num_seqs and max_num_batched_tokens must be positive".into(),
            ));
        }
        if config.kv_offload.disk.is_some() && config.kv_offload.model_identity.is_empty() {
            return Err(EngineError::Config(
                "engine.kv_offload.disk needs the model's identity to label its block files".into(),
            ));
        }
        let tiers = KvTiers::open(&config.kv_offload, layout).map_err(|e| {
            EngineError::Config(format!(
                "engine.kv_offload.disk.path {}: {e}",
                config
                    .kv_offload
                    .disk
                    .as_ref()
                    .map_or(String::new(), |d| d.path.display().to_string())
            ))
        })?;
        let mut pool = BlockPool::new(
            layout.num_blocks,
            layout.block_size,
            config.enable_prefix_caching,
        );
        if tiers.is_some() {
            pool.record_evictions();
        }
        let model_len = backend.max_model_len();
        let max_model_len = config.max_model_len.map_or(model_len, |m| m.min(model_len));
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats {
                kv_blocks_total: layout.num_blocks,
                ..Default::default()
            }),
            live: Mutex::new(HashSet::new()),
            queued: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            failure: Mutex::new(None),
            max_model_len,
            vocab_size: backend.vocab_size(),
            max_waiting: config.max_waiting,
            pool_tokens: layout.num_blocks * layout.block_size,
            layout,
            host_pool: backend.host_pool(),
            guide,
            thread: Mutex::new(None),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = Worker {
            eos: backend.eos_token_ids().to_vec(),
            vocab: backend.vocab_size(),
            backend,
            pool,
            sched: Scheduler::new(SchedulerConfig {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                chunked_prefill: config.enable_chunked_prefill,
            }),
            sampler: Sampler::new(),
            batch: ForwardBatch::default(),
            logits: Vec::new(),
            device_sampler: true,
            device_rows: Vec::new(),
            device_tokens: Vec::new(),
            device_masks: true,
            device_guided: Vec::new(),
            packed_masks: Default::default(),
            masks: Vec::new(),
            importing: HashMap::new(),
            pins: HashMap::new(),
            staging: None,
            finished: Vec::new(),
            max_len: max_model_len.min(layout.num_blocks * layout.block_size),
            counters: EngineStats {
                kv_blocks_total: layout.num_blocks,
                ..Default::default()
            },
            shared: shared.clone(),
            rx,
            failure: None,
            tiers,
        };
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Config(format!("cannot spawn engine thread: {e}")))?;
        *shared.thread.lock() = Some(thread);
        Ok(EngineHandle { tx, shared })
    }
}
