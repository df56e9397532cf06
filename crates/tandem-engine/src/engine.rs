//! The engine thread and its handle.
//!
//! One thread owns the backend, block pool and scheduler and is their only mutator. Commands reach
//! it over a channel; each request's outputs go to its own unbounded tokio channel; stats are
//! published under a briefly held lock after every step. When idle the thread blocks on the
//! command channel (with a timeout only while prefill pins have deadlines).

use crate::backend::DeviceSampling;
use crate::backend::{Backend, BackendError};
use crate::block_pool::{BlockPool, BlockTable};
use crate::sampler::{logprobs_of, Sampled, Sampler, SeqRng};
use crate::scheduler::{Scheduler, SchedulerConfig, Sequence};
use crate::types::{
    EngineRequest, FinishReason, RequestId, RequestMode, SamplingParams, TokenLogprobs, TokenOutput,
};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tandem_model::{ForwardBatch, KvLayout, LogitsWanted};
use tokio::sync::{mpsc, oneshot};

/// Knobs of one engine; defaults suit the default model on a laptop.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of KV cache across all layers (the backend is sized from it).
    pub kv_cache_bytes: usize,
    /// Running sequences per step.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps so decodes keep flowing.
    pub enable_chunked_prefill: bool,
    /// Reuse KV of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// None = the model's context length.
    pub max_model_len: Option<usize>,
    /// Beyond this many queued requests `submit` returns QueueFull (the API answers 503).
    pub max_waiting: usize,
    /// Compute threads for the backend; 0 = all cores.
    pub threads: usize,
    /// Tensor-parallel ranks the backend splits every layer over (1 = none).
    pub tensor_parallel_size: usize,
    /// Pipeline stages the backend splits the layers over (1 = none); stage 0 runs in this process.
    pub pipeline_parallel_size: usize,
    /// Micro-batches per step of a pipelined backend (0 = one per stage).
    pub pipeline_micro_batches: usize,
    /// Addresses of stage servers 1.. of a pipeline; empty = the launcher starts them on this host.
    pub pipeline_stages: Vec<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            max_model_len: None,
            max_waiting: 1024,
            threads: 0,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            pipeline_micro_batches: 0,
            pipeline_stages: Vec::new(),
        }
    }
}

/// Why the engine refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests are queued; retry later.
    #[error("engine queue full ({waiting} waiting)")]
    QueueFull {
        /// Requests queued when this one was refused.
        waiting: usize,
    },
    /// The prompt leaves no room for a generated token.
    #[error("prompt of {prompt} tokens (+{max_tokens} to generate) exceeds the model's {max_model_len}-token context")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested max_tokens.
        max_tokens: usize,
        /// The engine's context length.
        max_model_len: usize,
    },
    /// The prompt needs more KV blocks than the whole pool has.
    #[error("prompt of {prompt} tokens needs more KV cache than the pool's {capacity} tokens")]
    KvCacheTooSmall {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens the whole pool holds.
        capacity: usize,
    },
    /// A request must have at least one prompt token.
    #[error("empty prompt")]
    EmptyPrompt,
    /// A live request already uses this id.
    #[error("duplicate request id {0}")]
    DuplicateId(RequestId),
    /// The request (or its pin) is not known to the engine.
    #[error("unknown request id {0}")]
    UnknownRequest(RequestId),
    /// The request is in the wrong state for this command (e.g. export of an unpinned request).
    #[error("request {id}: {reason}")]
    InvalidState {
        /// The request.
        id: RequestId,
        /// What was wrong.
        reason: String,
    },
    /// Sampling parameters out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
    /// Configuration does not fit the backend.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// The engine thread has stopped.
    #[error("engine stopped")]
    Stopped,
    /// The model failed while running this request.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Counters and gauges the API exports as Prometheus metrics.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Sequences in the running list.
    pub running: usize,
    /// Sequences waiting (new or preempted).
    pub waiting: usize,
    /// Blocks in the pool.
    pub kv_blocks_total: usize,
    /// Blocks referenced by a live sequence or pin (not merely cached).
    pub kv_blocks_used: usize,
    /// Free blocks still holding a reusable prefix.
    pub kv_blocks_cached: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generation_tokens_total: u64,
    /// Tokens run through prefill compute (a P/D decode worker proves 0 here).
    pub prefill_tokens_computed: u64,
    /// Blocks of imported prompts found in this engine's prefix cache: shared, so their KV is not transferred.
    #[serde(default)]
    pub import_blocks_cached: u64,
    /// Blocks of imported prompts whose KV the caller had to supply with `import_block`.
    #[serde(default)]
    pub import_blocks_needed: u64,
    /// Times a running sequence was preempted.
    pub preemptions_total: u64,
    /// Requests that ended (any reason).
    pub requests_finished_total: u64,
    /// Model steps run.
    pub steps_total: u64,
}

/// The KV of a pinned prefill, ready to ship to a decode worker.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportedKv {
    /// Layout of the source cache (a receiver must have the same per-block shape).
    pub layout: KvLayout,
    /// Prompt tokens covered.
    pub num_tokens: usize,
    /// Logical blocks covered (`num_tokens.div_ceil(block_size)`).
    pub num_blocks: usize,
    /// The first generated token.
    pub first_token: u32,
    /// `block_bytes` per (layer, block), layer-major: entry `layer * num_blocks + block`.
    pub data: Vec<u8>,
}

impl ExportedKv {
    /// The bytes of one (layer, logical block).
    pub fn block(&self, layer: usize, block: usize) -> &[u8] {
        let n = self.layout.block_bytes();
        let i = layer * self.num_blocks + block;
        &self.data[i * n..(i + 1) * n]
    }
}

/// How an import was set up: of the prompt's logical blocks, the leading `cached` ones were found in this
/// engine's prefix cache and are shared (reference counted, like a normal admission's prefix hit); only
/// the rest need their KV supplied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportPlan {
    /// Logical blocks of the prompt (`prompt_len.div_ceil(block_size)`).
    pub num_blocks: usize,
    /// Leading blocks already holding this prompt's KV; always full blocks, never the last partial one.
    pub cached: usize,
}

impl ImportPlan {
    /// The logical blocks whose KV must be imported before [`EngineHandle::start_decoding`].
    pub fn needed(&self) -> std::ops::Range<usize> {
        self.cached..self.num_blocks
    }
}

/// A reply the engine thread will send; await it or block on it.
pub struct Pending<T> {
    rx: oneshot::Receiver<Result<T, EngineError>>,
}

impl<T> Pending<T> {
    /// Waits asynchronously.
    pub async fn wait(self) -> Result<T, EngineError> {
        self.rx.await.unwrap_or(Err(EngineError::Stopped))
    }

    /// Waits by blocking the current thread (not from inside an async runtime).
    pub fn wait_blocking(self) -> Result<T, EngineError> {
        self.rx.blocking_recv().unwrap_or(Err(EngineError::Stopped))
    }

    fn failed(e: EngineError) -> Self {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Err(e));
        Self { rx }
    }
}

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;
type Item = Result<TokenOutput, EngineError>;

enum Command {
    Submit(Box<EngineRequest>, mpsc::UnboundedSender<Item>),
    Abort(RequestId),
    ReleasePin(RequestId),
    Export(RequestId, Reply<ExportedKv>),
    ImportPrefilled(
        Box<EngineRequest>,
        u32,
        mpsc::UnboundedSender<Item>,
        Reply<ImportPlan>,
    ),
    ImportBlock {
        id: RequestId,
        layer: usize,
        block: usize,
        data: Vec<u8>,
        reply: Reply<()>,
    },
    StartDecoding(RequestId, Reply<()>),
    Check(Reply<EngineStats>),
    Shutdown,
}

struct Shared {
    stats: Mutex<EngineStats>,
    live: Mutex<HashSet<RequestId>>,
    queued: AtomicUsize,
    stopped: AtomicBool,
    max_model_len: usize,
    vocab_size: usize,
    max_waiting: usize,
    pool_tokens: usize,
    layout: KvLayout,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Cheap-to-clone, Send + Sync handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
}

/// Per-request stream of outputs; dropping it before the end aborts the request (frees its blocks at once).
pub struct RequestStream {
    id: RequestId,
    rx: mpsc::UnboundedReceiver<Item>,
    done: bool,
    error: Option<EngineError>,
    tx: Sender<Command>,
}

impl RequestStream {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next output; None after the output with `finish` set, after an abort, or after an error
    /// (then [`Self::error`] says what failed).
    pub async fn recv(&mut self) -> Option<TokenOutput> {
        let item = self.rx.recv().await;
        self.take(item)
    }

    /// Like [`Self::recv`], blocking the current thread (not from inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<TokenOutput> {
        let item = self.rx.blocking_recv();
        self.take(item)
    }

    /// Why the stream ended without a finish reason, if the engine failed the request.
    pub fn error(&self) -> Option<&EngineError> {
        self.error.as_ref()
    }

    /// Takes the error that ended the stream, if any (for callers that propagate it).
    pub fn take_error(&mut self) -> Option<EngineError> {
        self.error.take()
    }

    fn take(&mut self, item: Option<Item>) -> Option<TokenOutput> {
        if self.done {
            return None;
        }
        match item {
            Some(Ok(out)) => {
                self.done = out.finish.is_some();
                Some(out)
            }
            Some(Err(e)) => {
                self.done = true;
                self.error = Some(e);
                None
            }
            None => {
                self.done = true;
                None
            }
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

impl EngineHandle {
    fn validate(&self, req: &EngineRequest) -> Result<(), EngineError> {
        let s = &self.shared;
        if s.stopped.load(Ordering::Acquire) {
            return Err(EngineError::Stopped);
        }
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        // A resumed request recomputes its earlier output with the prompt, so both must fit.
        let resumed: &[u32] = match &req.mode {
            RequestMode::Resume { output } => output,
            _ => &[],
        };
        let tokens = req.prompt.len() + resumed.len();
        if tokens >= s.max_model_len {
            return Err(EngineError::PromptTooLong {
                prompt: tokens,
                max_tokens: req.params.max_tokens,
                max_model_len: s.max_model_len,
            });
        }
        if tokens >= s.pool_tokens {
            return Err(EngineError::KvCacheTooSmall {
                prompt: tokens,
                capacity: s.pool_tokens,
            });
        }
        if resumed.len() >= req.params.max_tokens {
            return Err(EngineError::InvalidParams(format!(
                "resuming after {} tokens leaves nothing to generate within max_tokens {}",
                resumed.len(),
                req.params.max_tokens
            )));
        }
        if let Some(&t) = req
            .prompt
            .iter()
            .chain(resumed)
            .find(|&&t| t as usize >= s.vocab_size)
        {
            return Err(EngineError::InvalidParams(format!(
                "token id {t} outside the vocabulary"
            )));
        }
        let p = &req.params;
        // Written positively so that NaN fails every check.
        let ok = p.temperature >= 0.0
            && p.top_p > 0.0
            && p.top_p <= 1.0
            && (0.0..=1.0).contains(&p.min_p)
            && p.repetition_penalty > 0.0
            && p.frequency_penalty.is_finite()
            && p.presence_penalty.is_finite();
        if !ok {
            return Err(EngineError::InvalidParams(format!("{p:?}")));
        }
        if p.max_tokens == 0 {
            return Err(EngineError::InvalidParams(
                "max_tokens must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn register(
        &self,
        req: &EngineRequest,
        queued: bool,
    ) -> Result<(RequestStream, mpsc::UnboundedSender<Item>), EngineError> {
        self.validate(req)?;
        if queued {
            let waiting = self.shared.queued.load(Ordering::Acquire);
            if waiting >= self.shared.max_waiting {
                return Err(EngineError::QueueFull { waiting });
            }
        }
        if !self.shared.live.lock().insert(req.id) {
            return Err(EngineError::DuplicateId(req.id));
        }
        if queued {
            self.shared.queued.fetch_add(1, Ordering::AcqRel);
        }
        let (otx, orx) = mpsc::unbounded_channel();
        let stream = RequestStream {
            id: req.id,
            rx: orx,
            done: false,
            error: None,
            tx: self.tx.clone(),
        };
        Ok((stream, otx))
    }

    /// Queues a request; validation happens here, synchronously.
    pub fn submit(&self, req: EngineRequest) -> Result<RequestStream, EngineError> {
        let (stream, otx) = self.register(&req, true)?;
        if self.tx.send(Command::Submit(Box::new(req), otx)).is_err() {
            return Err(EngineError::Stopped);
        }
        Ok(stream)
    }

    /// Ends a request wherever it is (its stream closes without a finish) and releases its pin if any.
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Releases the KV pinned by a finished prefill-only request.
    pub fn release_pin(&self, id: RequestId) {
        let _ = self.tx.send(Command::ReleasePin(id));
    }

    /// Copies out the KV of a pinned prefill-only request.
    pub fn export_blocks(&self, id: RequestId) -> Pending<ExportedKv> {
        self.call(|reply| Command::Export(id, reply))
    }

    /// Starts a request whose prompt KV will be imported: shares the prompt's longest cached run of full
    /// blocks from the prefix cache, reserves fresh blocks for the rest, and returns the stream (which
    /// begins with `first_token`) and the reply carrying the [`ImportPlan`]: the blocks in
    /// [`ImportPlan::needed`] must be filled with [`Self::import_block`] before [`Self::start_decoding`].
    pub fn import_prefilled(
        &self,
        req: EngineRequest,
        first_token: u32,
    ) -> Result<(RequestStream, Pending<ImportPlan>), EngineError> {
        if req.mode != RequestMode::Normal {
            return Err(EngineError::InvalidParams(format!(
                "an imported request decodes normally, not as {:?}",
                req.mode
            )));
        }
        if first_token as usize >= self.shared.vocab_size {
            return Err(EngineError::InvalidParams(format!(
                "first token {first_token} outside the vocabulary"
            )));
        }
        let (stream, otx) = self.register(&req, false)?;
        let pending =
            self.call(|reply| Command::ImportPrefilled(Box::new(req), first_token, otx, reply));
        Ok((stream, pending))
    }

    /// Writes one (layer, logical block) of an importing request's KV; refused for blocks the plan shares
    /// from the prefix cache (other sequences read them).
    pub fn import_block(
        &self,
        id: RequestId,
        layer: usize,
        block: usize,
        data: Vec<u8>,
    ) -> Pending<()> {
        self.call(|reply| Command::ImportBlock {
            id,
            layer,
            block,
            data,
            reply,
        })
    }

    /// Marks an imported request's KV complete: it joins the running sequences and decodes
    /// without any prefill compute.
    pub fn start_decoding(&self, id: RequestId) -> Pending<()> {
        self.call(|reply| Command::StartDecoding(id, reply))
    }

    /// Stats as of after every earlier command, once the engine has verified its block accounting
    /// (every block free, cached or referenced by exactly the live tables and pins).
    pub fn checked_stats(&self) -> Pending<EngineStats> {
        self.call(Command::Check)
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Pending<T> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(make(tx)).is_err() {
            return Pending::failed(EngineError::Stopped);
        }
        Pending { rx }
    }

    /// A snapshot of the engine's counters.
    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().clone()
    }

    /// The context length requests are checked against.
    pub fn max_model_len(&self) -> usize {
        self.shared.max_model_len
    }

    /// Width of the model's vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.shared.vocab_size
    }

    /// The KV layout of the backend (P/D peers compare it before moving blocks).
    pub fn kv_layout(&self) -> KvLayout {
        self.shared.layout
    }

    /// Stops the engine thread (live requests' streams close) and waits for it to exit.
    pub fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.shared.thread.lock().take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Starts the engine thread over a backend.
pub struct Engine;

impl Engine {
    /// Validates `config` against the backend and spawns the engine thread.
    pub fn start<B: Backend>(
        backend: B,
        config: EngineConfig,
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
                "KV cache holds no block; raise kv_cache_bytes".into(),
            ));
        }
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(EngineError::Config(
                "max_num_seqs and max_num_batched_tokens must be positive".into(),
            ));
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
            max_model_len,
            vocab_size: backend.vocab_size(),
            max_waiting: config.max_waiting,
            pool_tokens: layout.num_blocks * layout.block_size,
            layout,
            thread: Mutex::new(None),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = Worker {
            eos: backend.eos_token_ids().to_vec(),
            vocab: backend.vocab_size(),
            backend,
            pool: BlockPool::new(
                layout.num_blocks,
                layout.block_size,
                config.enable_prefix_caching,
            ),
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
            importing: HashMap::new(),
            pins: HashMap::new(),
            finished: Vec::new(),
            max_len: max_model_len.min(layout.num_blocks * layout.block_size),
            counters: EngineStats {
                kv_blocks_total: layout.num_blocks,
                ..Default::default()
            },
            shared: shared.clone(),
            rx,
        };
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Config(format!("cannot spawn engine thread: {e}")))?;
        *shared.thread.lock() = Some(thread);
        Ok(EngineHandle { tx, shared })
    }
}

/// Per-request data the engine keeps beside the scheduler's state.
struct Ext {
    params: SamplingParams,
    mode: RequestMode,
    rng: SeqRng,
    tx: mpsc::UnboundedSender<Item>,
    /// Still counted in `Shared::queued` (not yet admitted for the first time).
    queued: bool,
    /// Imported requests: the first token, emitted when decoding starts.
    first_token: Option<u32>,
    /// Requests scoring their prompt: one entry per prompt position, filled as prompt chunks run and
    /// handed out with the first token.
    prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

type Seq = Sequence<Ext>;

/// Scores prompt positions `start + 1 ..` from the chunk's logits rows (row j predicts the token after
/// position `start + j`); a no-op for sequences that did not ask for prompt logprobs.
fn score_prompt_rows(seq: &mut Seq, start: usize, rows: &[f32], vocab: usize) {
    let top_n = seq.ext.params.prompt_logprobs.unwrap_or(0);
    let Some(scores) = seq.ext.prompt_logprobs.as_mut() else {
        return;
    };
    for (j, logits) in rows.chunks_exact(vocab).enumerate() {
        let next = start + j + 1;
        if next >= seq.prompt_len {
            break;
        }
        scores[next] = Some(logprobs_of(logits, seq.tokens[next], top_n));
    }
}

struct Pin {
    table: BlockTable,
    num_tokens: usize,
    first_token: u32,
    deadline: Instant,
}

/// Whether a request's draws can be made by a backend's own sampler: the filters it implements
/// and nothing that needs the whole logits row on the host.
fn device_samplable(p: &SamplingParams) -> bool {
    p.repetition_penalty == 1.0
        && p.frequency_penalty == 0.0
        && p.presence_penalty == 0.0
        && p.logprobs.is_none()
        && p.prompt_logprobs.is_none()
}

struct Worker<B: Backend> {
    backend: B,
    pool: BlockPool,
    sched: Scheduler<Ext>,
    sampler: Sampler,
    batch: ForwardBatch,
    logits: Vec<f32>,
    /// Whether to offer steps to the backend's own sampler (cleared when it declines once).
    device_sampler: bool,
    /// This step's rows for the backend's sampler and the tokens it drew (reused buffers).
    device_rows: Vec<DeviceSampling>,
    device_tokens: Vec<u32>,
    importing: HashMap<RequestId, Seq>,
    pins: HashMap<RequestId, Pin>,
    /// Indices into `sched.running` that finished this step (reused buffer).
    finished: Vec<usize>,
    eos: Vec<u32>,
    vocab: usize,
    /// Longest sequence allowed: the context length, capped by what the pool can hold.
    max_len: usize,
    counters: EngineStats,
    shared: Arc<Shared>,
    rx: Receiver<Command>,
}

impl<B: Backend> Worker<B> {
    fn run(mut self) {
        tracing::debug!(blocks = self.pool.num_blocks(), "engine thread started");
        'outer: loop {
            while let Ok(cmd) = self.rx.try_recv() {
                if !self.handle(cmd) {
                    break 'outer;
                }
            }
            self.expire_pins();
            let progressed = self.sched.has_work() && self.step();
            if !progressed {
                self.publish();
                // Idle (or stalled until pinned blocks are released): block for the next command.
                let cmd = match self.pins.values().map(|p| p.deadline).min() {
                    Some(d) => match self.rx.recv_deadline(d) {
                        Ok(c) => c,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    },
                    None => match self.rx.recv() {
                        Ok(c) => c,
                        Err(_) => break,
                    },
                };
                if !self.handle(cmd) {
                    break;
                }
            }
        }
        self.shutdown_all();
        tracing::debug!("engine thread stopped");
    }

    fn shutdown_all(&mut self) {
        let ids: Vec<RequestId> = self
            .sched
            .running
            .iter()
            .chain(self.sched.waiting.iter())
            .map(|s| s.id)
            .chain(self.importing.keys().copied())
            .collect();
        for id in ids {
            self.fail(id, EngineError::Stopped);
        }
        let pins: Vec<RequestId> = self.pins.keys().copied().collect();
        for id in pins {
            self.release_pin(id);
        }
        self.shared.stopped.store(true, Ordering::Release);
        self.publish();
    }

    /// Applies one command; false means shut down.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req, tx) => {
                self.counters.prompt_tokens_total += req.prompt.len() as u64;
                let (mode, resumed) = match req.mode {
                    RequestMode::Resume { output } => (RequestMode::Normal, output),
                    mode => (mode, Vec::new()),
                };
                // A resumed request's prompt logprobs went out with its first token, elsewhere.
                let score_prompt = req.params.prompt_logprobs.is_some() && resumed.is_empty();
                let ext = Ext {
                    rng: SeqRng::new(req.params.seed),
                    prompt_logprobs: score_prompt.then(|| vec![None; req.prompt.len()]),
                    params: req.params,
                    mode,
                    tx,
                    queued: true,
                    first_token: None,
                };
                let mut seq = Sequence::new(req.id, req.prompt, ext);
                // Like a preempted sequence: the earlier output is recomputed, then sampling goes on.
                seq.tokens.extend_from_slice(&resumed);
                seq.score_prompt = score_prompt;
                self.sched.add(seq);
            }
            Command::Abort(id) => {
                if let Some(mut seq) = self.sched.remove(id).or_else(|| self.importing.remove(&id))
                {
                    self.drop_seq(&mut seq);
                    self.counters.requests_finished_total += 1;
                }
                self.release_pin(id);
            }
            Command::ReleasePin(id) => self.release_pin(id),
            Command::Export(id, reply) => {
                let _ = reply.send(self.export(id));
            }
            Command::ImportPrefilled(req, first_token, tx, reply) => {
                let _ = reply.send(self.import_prefilled(*req, first_token, tx));
            }
            Command::ImportBlock {
                id,
                layer,
                block,
                data,
                reply,
            } => {
                let _ = reply.send(self.import_block(id, layer, block, &data));
            }
            Command::StartDecoding(id, reply) => {
                let _ = reply.send(self.start_decoding(id));
            }
            Command::Check(reply) => {
                let _ = reply.send(self.check());
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// Releases a removed sequence's blocks and forgets its id.
    fn drop_seq(&mut self, seq: &mut Seq) {
        self.pool.release(&mut seq.table);
        if seq.ext.queued {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
        self.shared.live.lock().remove(&seq.id);
    }

    fn fail(&mut self, id: RequestId, err: EngineError) {
        if let Some(mut seq) = self.sched.remove(id).or_else(|| self.importing.remove(&id)) {
            let _ = seq.ext.tx.send(Err(err));
            self.drop_seq(&mut seq);
            self.counters.requests_finished_total += 1;
        }
    }

    fn release_pin(&mut self, id: RequestId) {
        if let Some(mut pin) = self.pins.remove(&id) {
            self.pool.release(&mut pin.table);
            self.shared.live.lock().remove(&id);
        }
    }

    fn expire_pins(&mut self) {
        if self.pins.is_empty() {
            return;
        }
        let now = Instant::now();
        let expired: Vec<RequestId> = self
            .pins
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            tracing::debug!(id, "prefill pin expired");
            self.release_pin(id);
        }
    }

    fn export(&mut self, id: RequestId) -> Result<ExportedKv, EngineError> {
        let pin = self.pins.get(&id).ok_or(EngineError::UnknownRequest(id))?;
        let layout = self.backend.kv_layout();
        let n = layout.block_bytes();
        let num_blocks = self.pool.blocks_for(pin.num_tokens);
        let mut data = vec![0u8; layout.n_layers * num_blocks * n];
        for layer in 0..layout.n_layers {
            for (b, &phys) in pin.table.blocks[..num_blocks].iter().enumerate() {
                let i = layer * num_blocks + b;
                self.backend
                    .export_block(layer, phys, &mut data[i * n..(i + 1) * n])
                    .map_err(|e| EngineError::InvalidState {
                        id,
                        reason: format!("KV export failed: {e}"),
                    })?;
            }
        }
        Ok(ExportedKv {
            layout,
            num_tokens: pin.num_tokens,
            num_blocks,
            first_token: pin.first_token,
            data,
        })
    }

    fn import_prefilled(
        &mut self,
        req: EngineRequest,
        first_token: u32,
        tx: mpsc::UnboundedSender<Item>,
    ) -> Result<ImportPlan, EngineError> {
        let id = req.id;
        let ext = Ext {
            rng: SeqRng::new(req.params.seed),
            params: req.params,
            mode: req.mode,
            tx,
            queued: false,
            first_token: Some(first_token),
            prompt_logprobs: None,
        };
        let mut seq = Sequence::new(id, req.prompt, ext);
        // The cached prefix's KV is already here: those blocks are shared and only the rest is imported.
        // `num_computed` marks where the imported part begins until decoding starts.
        seq.num_computed = self.pool.match_full_blocks(&mut seq.table, &seq.tokens);
        if let Err(e) = self.pool.ensure_capacity(&mut seq.table, seq.prompt_len) {
            self.pool.release(&mut seq.table);
            self.shared.live.lock().remove(&id);
            return Err(EngineError::InvalidState {
                id,
                reason: e.to_string(),
            });
        }
        let plan = ImportPlan {
            num_blocks: seq.table.blocks.len(),
            cached: seq.num_computed / self.pool.block_size(),
        };
        self.counters.prompt_tokens_total += seq.prompt_len as u64;
        self.counters.import_blocks_cached += plan.cached as u64;
        self.counters.import_blocks_needed += plan.needed().len() as u64;
        self.importing.insert(id, seq);
        Ok(plan)
    }

    fn import_block(
        &mut self,
        id: RequestId,
        layer: usize,
        block: usize,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let seq = self
            .importing
            .get(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        let layout = self.backend.kv_layout();
        let cached = seq.num_computed / self.pool.block_size();
        if layer >= layout.n_layers
            || block >= seq.table.blocks.len()
            || block < cached
            || data.len() != layout.block_bytes()
        {
            return Err(EngineError::InvalidState {
                id,
                reason: format!(
                    "bad import: layer {layer}, block {block} (blocks {cached}..{} expected), {} bytes (expected {})",
                    seq.table.blocks.len(),
                    data.len(),
                    layout.block_bytes()
                ),
            });
        }
        self.backend
            .import_block(layer, seq.table.blocks[block], data)
            .map_err(|e| EngineError::InvalidState {
                id,
                reason: format!("KV import failed: {e}"),
            })
    }

    fn start_decoding(&mut self, id: RequestId) -> Result<(), EngineError> {
        let mut seq = self
            .importing
            .remove(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        seq.num_computed = seq.prompt_len;
        self.pool
            .register_computed(&mut seq.table, &seq.tokens, seq.num_computed);
        let token = seq
            .ext
            .first_token
            .take()
            .expect("importing sequences carry their first token");
        seq.tokens.push(token);
        self.sched.add_running(seq);
        let idx = self.sched.running.len() - 1;
        self.emit(idx, token, None);
        self.reap();
        Ok(())
    }

    /// Runs one scheduled step; false if nothing could be scheduled.
    fn step(&mut self) -> bool {
        self.sched.schedule(&mut self.pool, &mut self.batch);
        self.counters.preemptions_total += self.sched.preempted().len() as u64;
        let capacity = self.pool.num_blocks() * self.pool.block_size();
        for id in self.sched.out_of_room().to_vec() {
            self.fail(
                id,
                EngineError::KvCacheTooSmall {
                    prompt: 0,
                    capacity,
                },
            );
        }
        if self.sched.scheduled().is_empty() {
            return false;
        }
        for k in 0..self.sched.scheduled().len() {
            let s = self.sched.scheduled()[k];
            let seq = &mut self.sched.running[s.index];
            if seq.ext.queued {
                seq.ext.queued = false;
                self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            }
            if s.len > 1 || seq.num_computed < seq.prompt_len {
                self.counters.prefill_tokens_computed += s.len as u64;
            }
        }
        self.counters.steps_total += 1;
        let on_device = match self.forward() {
            Ok(on_device) => on_device,
            Err(e) => {
                tracing::error!(error = %e, "forward failed; failing the step's requests");
                let ids: Vec<RequestId> = self
                    .sched
                    .scheduled()
                    .iter()
                    .map(|s| self.sched.running[s.index].id)
                    .collect();
                for id in ids {
                    self.fail(
                        id,
                        EngineError::Backend(BackendError::new(e.message.clone())),
                    );
                }
                return true;
            }
        };
        let mut row = 0;
        for k in 0..self.sched.scheduled().len() {
            let s = self.sched.scheduled()[k];
            let seq = &mut self.sched.running[s.index];
            let start = seq.num_computed;
            seq.num_computed += s.len;
            self.pool
                .register_computed(&mut seq.table, &seq.tokens, seq.num_computed);
            let rows = match self.batch.seqs[k].logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.len,
            };
            let first_row = row;
            row += rows;
            if self.batch.seqs[k].logits == LogitsWanted::All {
                score_prompt_rows(
                    seq,
                    start,
                    &self.logits[first_row * self.vocab..row * self.vocab],
                    self.vocab,
                );
            }
            if !s.sample {
                continue;
            }
            let out = if on_device {
                Sampled {
                    token: self.device_tokens[row - 1],
                    logprobs: None,
                }
            } else {
                let logits = &self.logits[(row - 1) * self.vocab..row * self.vocab];
                let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
                self.sampler
                    .sample(logits, &seq.ext.params, prompt, output, &mut seq.ext.rng)
            };
            seq.tokens.push(out.token);
            self.emit(s.index, out.token, out.logprobs);
        }
        self.reap();
        self.publish();
        true
    }

    /// Runs the step's model pass: through the backend's own sampler when it has one and every
    /// logits row is a draw it can make (no penalties, logprobs or prompt scoring), so the logits
    /// stay where they are (`Ok(true)`, tokens in `device_tokens`); else `forward`, with the logits
    /// in `logits` for the host sampler (`Ok(false)`).
    fn forward(&mut self) -> Result<bool, BackendError> {
        if self.device_sampler && self.fill_device_rows() {
            let drawn = self.backend.forward_sampled(
                &self.batch,
                &self.device_rows,
                &mut self.device_tokens,
            )?;
            if drawn {
                return Ok(true);
            }
            self.device_sampler = false;
        }
        self.backend.forward(&self.batch, &mut self.logits)?;
        Ok(false)
    }

    /// Fills `device_rows` with one draw per logits row of the step; false when some row needs the
    /// host sampler.
    fn fill_device_rows(&mut self) -> bool {
        self.device_rows.clear();
        for k in 0..self.sched.scheduled().len() {
            let s = self.sched.scheduled()[k];
            let rows = match self.batch.seqs[k].logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => return false,
            };
            if rows == 0 {
                continue;
            }
            let seq = &mut self.sched.running[s.index];
            let p = &seq.ext.params;
            if !s.sample || !device_samplable(p) {
                return false;
            }
            let index = seq.tokens.len() - seq.prompt_len;
            self.device_rows.push(DeviceSampling {
                temperature: p.temperature,
                top_k: p.top_k.min(u32::MAX as usize) as u32,
                top_p: p.top_p,
                min_p: p.min_p,
                seed: seq.ext.rng.draw_seed(index),
            });
        }
        !self.device_rows.is_empty()
    }

    /// Sends `token` for running sequence `idx` (already appended to its tokens), marking it finished
    /// when a stop condition holds.
    fn emit(&mut self, idx: usize, token: u32, logprobs: Option<crate::types::TokenLogprobs>) {
        let seq = &self.sched.running[idx];
        let p = &seq.ext.params;
        self.counters.generation_tokens_total += 1;
        let finish =
            if (!p.ignore_eos && self.eos.contains(&token)) || p.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if seq.output().len() >= p.max_tokens
                || seq.tokens.len() >= self.max_len
                || matches!(seq.ext.mode, RequestMode::PrefillOnly { .. })
            {
                Some(FinishReason::Length)
            } else {
                None
            };
        let prompt_logprobs = self.sched.running[idx].ext.prompt_logprobs.take();
        let seq = &self.sched.running[idx];
        let sent = seq
            .ext
            .tx
            .send(Ok(TokenOutput {
                token,
                logprobs,
                finish,
                prompt_logprobs,
            }))
            .is_ok();
        // A closed stream is a client that went away: end the request now.
        if finish.is_some() || !sent {
            self.finished.push(idx);
        }
    }

    /// Removes this step's finished sequences, freeing or pinning their blocks.
    fn reap(&mut self) {
        if self.finished.is_empty() {
            return;
        }
        self.finished.sort_unstable();
        self.finished.dedup();
        while let Some(idx) = self.finished.pop() {
            let mut seq = self.sched.running.remove(idx);
            self.counters.requests_finished_total += 1;
            if let RequestMode::PrefillOnly { pin_timeout } = seq.ext.mode {
                // The KV stays for export even if the client is gone; its Abort (if any) or the
                // deadline frees it.
                let table = std::mem::take(&mut seq.table);
                let pin = Pin {
                    table,
                    num_tokens: seq.prompt_len,
                    first_token: seq.tokens[seq.prompt_len],
                    deadline: Instant::now() + pin_timeout,
                };
                self.pins.insert(seq.id, pin);
                continue;
            }
            self.drop_seq(&mut seq);
        }
    }

    fn check(&mut self) -> Result<EngineStats, EngineError> {
        let s = &self.sched;
        let refs: Vec<u32> = s
            .running
            .iter()
            .chain(s.waiting.iter())
            .chain(self.importing.values())
            .flat_map(|q| q.table.blocks.iter().copied())
            .chain(
                self.pins
                    .values()
                    .flat_map(|p| p.table.blocks.iter().copied()),
            )
            .collect();
        self.pool
            .check_invariants(&refs)
            .map_err(|reason| EngineError::InvalidState { id: 0, reason })?;
        self.publish();
        Ok(self.counters.clone())
    }

    fn publish(&mut self) {
        let c = &mut self.counters;
        c.running = self.sched.running.len();
        c.waiting = self.sched.waiting.len();
        c.kv_blocks_used = self.pool.num_used();
        c.kv_blocks_cached = self.pool.num_cached();
        (c.prefix_cache_queries, c.prefix_cache_hits) = self.pool.prefix_counters();
        self.shared.stats.lock().clone_from(c);
    }
}
