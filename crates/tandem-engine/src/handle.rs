//! The handle callers hold: submit validation, the commands it sends the engine thread, and each
//! request's output stream.

use crate::backend::BackendError;
use crate::error::EngineError;
use crate::guide::{Guide, GuideEnv};
use crate::kv_host::{HostBuf, HostPool};
use crate::kv_manager::{ExportedKv, ImportPlan};
use crate::kv_staging::{KvStaging, StagedLayer};
use crate::stats::EngineStats;
use crate::types::{EngineRequest, RequestId, RequestMode, TokenOutput};
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use tandem_model::KvLayout;
use tokio::sync::{mpsc, oneshot};

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

/// Where the engine thread sends a command's answer.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, EngineError>>;
/// One entry of a request's output stream.
pub(crate) type Item = Result<TokenOutput, EngineError>;

/// What a handle asks of the engine thread. A request's commands carry the caller's span (`Span::current()`
/// at `submit` or `import_prefilled`: the API's or a worker RPC's `request` span, with its `request_id`), which
/// the engine thread enters for every line it logs about that request.
pub(crate) enum Command {
    Submit(
        Box<EngineRequest>,
        Option<Guide>,
        mpsc::UnboundedSender<Item>,
        tracing::Span,
    ),
    Abort(RequestId),
    ReleasePin(RequestId),
    Export(RequestId, Reply<ExportedKv>),
    ImportPrefilled(
        Box<EngineRequest>,
        u32,
        Option<Guide>,
        mpsc::UnboundedSender<Item>,
        tracing::Span,
        Reply<ImportPlan>,
    ),
    ImportBlock {
        id: RequestId,
        layer: usize,
        block: usize,
        data: Vec<u8>,
        reply: Reply<()>,
    },
    ImportLayer {
        id: RequestId,
        layer: usize,
        data: ImportData,
        reply: Reply<()>,
    },
    EnableStaging(usize, Reply<Arc<KvStaging>>),
    StartDecoding(RequestId, Reply<()>),
    Check(Reply<EngineStats>),
    Shutdown,
}

/// Where an imported layer's bytes are: a host buffer, or staging memory a zero-copy transport filled.
pub(crate) enum ImportData {
    Host(HostBuf),
    Staged(StagedLayer),
}

impl ImportData {
    pub(crate) fn len(&self) -> usize {
        match self {
            ImportData::Host(b) => b.len(),
            ImportData::Staged(l) => l.len,
        }
    }
}

/// What the handles and the engine thread share: published stats, live ids, and the limits `submit`
/// validates against without a round trip to the thread.
pub(crate) struct Shared {
    pub(crate) stats: Mutex<EngineStats>,
    pub(crate) live: Mutex<HashSet<RequestId>>,
    pub(crate) queued: AtomicUsize,
    pub(crate) stopped: AtomicBool,
    /// The backend failure that ended serving (worker lost or fatal), once there is one: new work is
    /// refused with it and [`EngineHandle::health`] reports it.
    pub(crate) failure: Mutex<Option<Arc<BackendError>>>,
    pub(crate) max_model_len: usize,
    pub(crate) vocab_size: usize,
    pub(crate) max_waiting: usize,
    pub(crate) pool_tokens: usize,
    pub(crate) layout: KvLayout,
    /// The backend's host buffers, for imports filled off the engine thread.
    pub(crate) host_pool: Arc<dyn HostPool>,
    /// Compiles guided requests' constraints; None refuses them.
    pub(crate) guide: Option<Arc<GuideEnv>>,
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
}

/// Cheap-to-clone, Send + Sync handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) tx: Sender<Command>,
    pub(crate) shared: Arc<Shared>,
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
    /// Whether the engine takes work: an error once it stopped, with the backend failure that
    /// stopped it if one did (a lost device or stage, a fault), so a health check can say why.
    pub fn health(&self) -> Result<(), EngineError> {
        if let Some(e) = self.shared.failure.lock().as_ref() {
            return Err(EngineError::Backend(e.clone()));
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(EngineError::Stopped);
        }
        Ok(())
    }

    fn validate(&self, req: &EngineRequest) -> Result<(), EngineError> {
        self.health()?;
        let s = &self.shared;
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

    /// Compiles a guided request's constraint (on the caller's thread, so a bad one is refused before
    /// anything is queued) and feeds it the tokens the request already has: a resumed request's
    /// delivered output, or an imported request's first token.
    fn guide(&self, req: &EngineRequest, have: &[u32]) -> Result<Option<Guide>, EngineError> {
        let Some(guidance) = &req.params.guidance else {
            return Ok(None);
        };
        let Some(env) = &self.shared.guide else {
            return Err(EngineError::Guidance(
                "this engine has no tokenizer vocabulary for guided decoding".to_owned(),
            ));
        };
        let mut guide = env.compile_gated(guidance, req.params.reasoning_gate)?;
        if !have.is_empty() {
            guide.consume(have)?;
        }
        Ok(Some(guide))
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

    /// Queues a request; validation happens here, synchronously. The engine thread logs about it inside
    /// the caller's current span, so its lines carry the caller's request id.
    pub fn submit(&self, req: EngineRequest) -> Result<RequestStream, EngineError> {
        self.validate(&req)?;
        let resumed: &[u32] = match &req.mode {
            RequestMode::Resume { output } => output,
            _ => &[],
        };
        let guide = self.guide(&req, resumed)?;
        let (stream, otx) = self.register(&req, true)?;
        if self
            .tx
            .send(Command::Submit(
                Box::new(req),
                guide,
                otx,
                tracing::Span::current(),
            ))
            .is_err()
        {
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
        self.validate(&req)?;
        let guide = self.guide(&req, &[first_token])?;
        let (stream, otx) = self.register(&req, false)?;
        let span = tracing::Span::current();
        let pending = self.call(|reply| {
            Command::ImportPrefilled(Box::new(req), first_token, guide, otx, span, reply)
        });
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

    /// Writes one layer of every block an importing request still needs ([`ImportPlan::needed`], back
    /// to back, in a buffer from [`Self::host_pool`]); the engine thread only enqueues the copy.
    pub fn import_layer(&self, id: RequestId, layer: usize, data: HostBuf) -> Pending<()> {
        self.call(|reply| Command::ImportLayer {
            id,
            layer,
            data: ImportData::Host(data),
            reply,
        })
    }

    /// Like [`Self::import_layer`], from a layer that landed in this engine's staging memory
    /// ([`Self::enable_kv_staging`]); the backend copies it into the cache without a host round trip.
    pub fn import_staged(&self, id: RequestId, layer: usize, data: StagedLayer) -> Pending<()> {
        self.call(|reply| Command::ImportLayer {
            id,
            layer,
            data: ImportData::Staged(data),
            reply,
        })
    }

    /// Allocates `bytes` of the backend's staging memory (device memory on a GPU) for zero-copy
    /// transfers, once: from then on exports go into it while it has room, and the returned arena is
    /// what a transport registers and lands imports in.
    pub fn enable_kv_staging(&self, bytes: usize) -> Pending<Arc<KvStaging>> {
        self.call(|reply| Command::EnableStaging(bytes, reply))
    }

    /// Host buffers of the backend's preferred kind (page-locked on a GPU) for [`Self::import_layer`].
    pub fn host_pool(&self) -> Arc<dyn HostPool> {
        self.shared.host_pool.clone()
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

    /// Requests that may wait for admission before more are refused (`EngineConfig::max_waiting`); a
    /// P/D decode worker bounds the imports waiting for KV blocks by the same number.
    pub fn max_waiting(&self) -> usize {
        self.shared.max_waiting
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
