//! The seam between scheduling and model math: the engine drives any [`Backend`] (CPU, CUDA, CPU pipeline).

use std::sync::Arc;

use tandem_model::{ForwardBatch, KvLayout, LayerExpertTokens, ModelConfig};

use crate::kv_host::{HostBuf, HostPool, KvExport, ReadyExport, StagedExport};
use crate::kv_staging::{HostStaging, KvStaging, StagedLayer, StagingSlice};

/// The cause of a backend failure, kept boxed so that logs and callers can walk the chain to the typed
/// error a device or link raised.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the engine does about a failed backend call: the four reactions [`BackendError`]'s variants
/// stand for, for callers that only need to branch on them (the API's HTTP mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendErrorKind {
    /// See [`BackendError::Retryable`].
    Retryable,
    /// See [`BackendError::Request`].
    Request,
    /// See [`BackendError::WorkerLost`].
    WorkerLost,
    /// See [`BackendError::Fatal`].
    Fatal,
}

/// Why a backend call failed, classified by what the engine must do about it (ARCHITECTURE.md, "What
/// the engine does with a backend failure"). Each variant keeps the typed error it came from as its
/// `source`; `message` says what was being done, and the source's text.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A passing shortage (device memory for this step, a pinned host buffer): nothing is broken, and
    /// the same step can run again. The engine runs the step's requests again, a bounded number of
    /// times, before failing them.
    #[error("transient backend failure: {message}")]
    Retryable {
        /// What failed, for logs and the client.
        message: String,
        /// The typed cause.
        #[source]
        source: Option<BoxError>,
    },
    /// Input the backend cannot take, the fault of particular requests: only they fail, as a
    /// client error, and the engine serves on.
    #[error("the backend cannot take this request: {message}")]
    Request {
        /// What failed, for logs and the client.
        message: String,
        /// The offending sequences, as indices into the step's `ForwardBatch::seqs`; empty for a call
        /// about one request (a KV import or export) or when the backend cannot tell which.
        seqs: Vec<usize>,
        /// The typed cause.
        #[source]
        source: Option<BoxError>,
    },
    /// The device or a pipeline stage is gone or left unusable (a lost stage link, a sticky GPU fault):
    /// this worker cannot serve. The engine fails every request it holds as unavailable, refuses new
    /// work and reports itself unhealthy, so the ingress routes elsewhere.
    #[error("backend lost: {message}")]
    WorkerLost {
        /// What failed, for logs and the client.
        message: String,
        /// The typed cause.
        #[source]
        source: Option<BoxError>,
    },
    /// A bug: the engine and the backend disagree on an invariant (a batch or block the backend
    /// refuses, a length that cannot be). Nothing it computes can be trusted; the engine fails every
    /// request and stops.
    #[error("backend fault: {message}")]
    Fatal {
        /// What failed, for logs and the client.
        message: String,
        /// The typed cause.
        #[source]
        source: Option<BoxError>,
    },
}

impl BackendError {
    /// An error of `kind` with nothing below it (a `Request` one names no sequence).
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self::build(kind, message.into(), None)
    }

    /// An error of `kind` caused by `source`; the message is `context: source`.
    pub fn caused(
        kind: BackendErrorKind,
        context: impl std::fmt::Display,
        source: impl Into<BoxError>,
    ) -> Self {
        let source = source.into();
        Self::build(kind, format!("{context}: {source}"), Some(source))
    }

    /// A [`BackendError::Retryable`] with `message`.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Retryable, message)
    }

    /// A [`BackendError::Request`] with `message`, naming the batch's sequences `seqs`.
    pub fn request(message: impl Into<String>, seqs: Vec<usize>) -> Self {
        BackendError::Request {
            message: message.into(),
            seqs,
            source: None,
        }
    }

    /// A [`BackendError::WorkerLost`] with `message`.
    pub fn worker_lost(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::WorkerLost, message)
    }

    /// A [`BackendError::Fatal`] with `message`.
    pub fn fatal(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Fatal, message)
    }

    fn build(kind: BackendErrorKind, message: String, source: Option<BoxError>) -> Self {
        match kind {
            BackendErrorKind::Retryable => BackendError::Retryable { message, source },
            BackendErrorKind::Request => BackendError::Request {
                message,
                seqs: Vec::new(),
                source,
            },
            BackendErrorKind::WorkerLost => BackendError::WorkerLost { message, source },
            BackendErrorKind::Fatal => BackendError::Fatal { message, source },
        }
    }

    /// Which reaction this error asks of the engine.
    pub fn kind(&self) -> BackendErrorKind {
        match self {
            BackendError::Retryable { .. } => BackendErrorKind::Retryable,
            BackendError::Request { .. } => BackendErrorKind::Request,
            BackendError::WorkerLost { .. } => BackendErrorKind::WorkerLost,
            BackendError::Fatal { .. } => BackendErrorKind::Fatal,
        }
    }

    /// What failed, without the kind's prefix.
    pub fn message(&self) -> &str {
        match self {
            BackendError::Retryable { message, .. }
            | BackendError::Request { message, .. }
            | BackendError::WorkerLost { message, .. }
            | BackendError::Fatal { message, .. } => message,
        }
    }

    /// The same error under `context`: the message becomes `context: message`, kind and source kept.
    pub fn context(mut self, context: impl std::fmt::Display) -> Self {
        let (BackendError::Retryable { message, .. }
        | BackendError::Request { message, .. }
        | BackendError::WorkerLost { message, .. }
        | BackendError::Fatal { message, .. }) = &mut self;
        *message = format!("{context}: {message}");
        self
    }
}

/// One logits row's draw for a backend that samples where the logits are (a GPU): the host
/// sampler's filters without penalties or logprobs, which need the whole row on the host.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DeviceSampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0: off.
    pub top_k: u32,
    /// Keep the smallest set reaching this mass; 1.0: off.
    pub top_p: f32,
    /// Drop tokens below min_p times the top token's probability; 0: off.
    pub min_p: f32,
    /// Seed of this one draw (the request's generator at this output index, so a seeded request
    /// repeats on the same backend).
    pub seed: u64,
}

/// The allowed-token masks of one step's logits rows, packed for a backend that applies them where
/// the logits are (guided decoding on a GPU): bit `t % 32` of word `t / 32` of a row's mask allows
/// token `t`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceMasks {
    /// Words per mask: the logits width rounded up to whole words.
    pub words: usize,
    /// The guided rows' masks back to back, in logits-row order.
    pub bits: Vec<u32>,
    /// Per logits row, the index of its mask in `bits` (in masks), or -1 for an unguided row
    /// (`i32` as the device reads it).
    pub row_mask: Vec<i32>,
}

impl DeviceMasks {
    /// The mask of logits row `row`, if it has one.
    pub fn row(&self, row: usize) -> Option<&[u32]> {
        let m = usize::try_from(*self.row_mask.get(row)?).ok()?;
        self.bits.get(m * self.words..(m + 1) * self.words)
    }
}

/// Hands a backend the masks of the step it runs once they are computed. The backend asks after
/// queueing the step's model work, so the masks are computed on the host while the device runs.
pub trait MaskSource {
    /// Blocks until every guided row's mask is ready. A row whose mask could not be computed has
    /// none (the engine fails that request and discards the row's draw).
    fn wait(&mut self) -> Result<&DeviceMasks, BackendError>;
}

/// The fixed facts about a backend's model and cache that the engine reads, kept in one place so that
/// backends answer [`Backend`]'s accessors from it instead of each repeating them.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendInfo {
    /// Shape of the KV cache.
    pub layout: KvLayout,
    /// Width of one logits row.
    pub vocab: usize,
    /// The model's context length.
    pub max_len: usize,
    /// Tokens that end generation unless a request sets `ignore_eos`.
    pub eos: Vec<u32>,
    /// Per layer, the positions a query sees back when the layer attends through a sliding window
    /// (itself included), `None` for global attention: what a KV import may leave behind.
    pub windows: Vec<Option<usize>>,
}

impl BackendInfo {
    /// The facts of a model served at its configured context length over a cache of `layout`.
    pub fn new(config: &ModelConfig, layout: KvLayout) -> Self {
        BackendInfo {
            layout,
            vocab: config.vocab_size,
            max_len: config.max_position_embeddings,
            eos: config.eos_token_ids.clone(),
            windows: config.layers.iter().map(|l| l.attention.window()).collect(),
        }
    }
}

/// Blocks of one layer of the KV cache, their bytes back to back in the canonical layout of
/// [`KvLayout`]: the unit a KV copy moves (one layer's share of a transfer, one request to the
/// pipeline stage owning the layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerBlocks<'a> {
    /// The layer: global for a [`Backend`], stage-local for a [`crate::StageModel`].
    pub layer: usize,
    /// The blocks, in the order of their bytes.
    pub blocks: &'a [u32],
}

impl<'a> LayerBlocks<'a> {
    /// `blocks` of `layer`.
    pub fn new(layer: usize, blocks: &'a [u32]) -> Self {
        LayerBlocks { layer, blocks }
    }

    /// Each block with its `block_bytes` bytes of `buf`, in order (as many as both hold).
    pub fn zip<'b>(self, buf: &'b [u8], block_bytes: usize) -> impl Iterator<Item = (u32, &'b [u8])>
    where
        'a: 'b,
    {
        self.blocks
            .iter()
            .copied()
            .zip(buf.chunks_exact(block_bytes))
    }

    /// Each block with its `block_bytes` bytes of `buf`, mutably, in order (as many as both hold).
    pub fn zip_mut<'b>(
        self,
        buf: &'b mut [u8],
        block_bytes: usize,
    ) -> impl Iterator<Item = (u32, &'b mut [u8])>
    where
        'a: 'b,
    {
        self.blocks
            .iter()
            .copied()
            .zip(buf.chunks_exact_mut(block_bytes))
    }
}

/// A model plus the paged KV storage it reads and writes, owned by the engine thread.
pub trait Backend: Send + 'static {
    /// The model's and cache's fixed facts, which the accessors below read.
    fn info(&self) -> &BackendInfo;
    /// Shape of the KV cache; `num_blocks` sizes the engine's block pool.
    fn kv_layout(&self) -> KvLayout {
        self.info().layout
    }
    /// Width of one logits row.
    fn vocab_size(&self) -> usize {
        self.info().vocab
    }
    /// The model's context length.
    fn max_model_len(&self) -> usize {
        self.info().max_len
    }
    /// Tokens that end generation unless a request sets `ignore_eos`.
    fn eos_token_ids(&self) -> &[u32] {
        &self.info().eos
    }
    /// Each layer's sliding window (`None`: global), as [`BackendInfo::windows`].
    fn attention_windows(&self) -> &[Option<usize>] {
        &self.info().windows
    }
    /// Copies into `out` the token rows routed to each expert of the model's mixture-of-experts layers
    /// this backend computes, since load (left empty for a dense model or a backend that does not count).
    fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        out.clear();
    }
    /// Runs one step: writes the batch's K/V through its block tables and returns
    /// `batch.logits_rows()` rows of `vocab_size` logits (cleared, then filled).
    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError>;
    /// Copies one (layer, block) of KV out as bytes (`out.len() == kv_layout().block_bytes()`), in the
    /// canonical layout of [`KvLayout`] whatever way the backend splits it internally (tensor-parallel
    /// ranks, pipeline stages). Fails when the storage is unreachable (device lost, stage process gone).
    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError>;
    /// Overwrites one (layer, block) of KV with bytes produced by `export_block` of an equal layout.
    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError>;
    /// Copies a block across all layers (copy-on-write of a shared block).
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError>;
    /// The pool of host buffers KV moves through on this backend's side of a transfer (page-locked
    /// on a GPU); shared with transport threads, which fill import buffers off the engine thread.
    fn host_pool(&self) -> Arc<dyn HostPool> {
        crate::kv_host::vec_pool()
    }
    /// Copies the blocks of `at` into `out` (their bytes back to back). The default goes block by
    /// block through [`Self::export_block`]; a backend with a bulk path per layer (one request to a
    /// pipeline stage) overrides it, and [`Self::export_kv`]'s and [`Self::export_kv_staged`]'s
    /// defaults take it layer by layer.
    fn export_layer(&self, at: LayerBlocks, out: &mut [u8]) -> Result<(), BackendError> {
        let n = self.kv_layout().block_bytes();
        check_layer_len(at, n, out.len())?;
        for (b, chunk) in at.zip_mut(out, n) {
            self.export_block(at.layer, b, chunk)?;
        }
        Ok(())
    }
    /// Overwrites the blocks of `at` from `data` (their bytes back to back, as [`Self::export_layer`]
    /// lays them out). The default goes block by block through [`Self::import_block`]; it is what
    /// [`Self::import_kv`]'s and [`Self::import_kv_staged`]'s defaults call.
    fn import_layer(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), BackendError> {
        let n = self.kv_layout().block_bytes();
        check_layer_len(at, n, data.len())?;
        for (b, chunk) in at.zip(data, n) {
            self.import_block(at.layer, b, chunk)?;
        }
        Ok(())
    }
    /// Starts copying every layer of `blocks` out, in the canonical layout, layer-major, and returns
    /// at once where the backend can copy asynchronously: the engine thread never waits for a
    /// transfer, and readers wait per layer. Blocks written by earlier steps are what is exported.
    /// The default copies layer by layer through [`Self::export_layer`] before returning.
    fn export_kv(&mut self, blocks: &[u32]) -> Result<Box<dyn KvExport>, BackendError> {
        let layout = self.kv_layout();
        let mut buf = self
            .host_pool()
            .take(layout.n_layers * blocks.len() * layout.block_bytes())?;
        export_layers(self, blocks, buf.as_mut_slice())?;
        Ok(Box::new(ReadyExport::new(buf, layout.n_layers.max(1))))
    }
    /// Overwrites the blocks of `at` with `data` (their bytes back to back, as [`Self::export_kv`]
    /// lays out one layer). An asynchronous backend keeps `data` until its copy is done; the copy is
    /// ordered before any step after the next [`Self::import_fence`]. The default is
    /// [`Self::import_layer`].
    fn import_kv(&mut self, at: LayerBlocks, data: HostBuf) -> Result<(), BackendError> {
        self.import_layer(at, data.as_slice())
    }
    /// Allocates `bytes` of staging memory for zero-copy transfers (see [`crate::kv_staging`]), once,
    /// where this backend's KV lives: device memory on a GPU. The default is host memory, which the
    /// block-by-block defaults of [`Self::export_kv_staged`] and [`Self::import_kv_staged`] use.
    fn kv_staging(&mut self, bytes: usize) -> Result<Arc<KvStaging>, BackendError> {
        Ok(KvStaging::new(Box::new(HostStaging::new(bytes))))
    }
    /// Like [`Self::export_kv`], into `dest`, a slice of this backend's [`Self::kv_staging`] of
    /// `layers × blocks × block_bytes` bytes. The default copies into host staging layer by layer
    /// through [`Self::export_layer`].
    fn export_kv_staged(
        &mut self,
        blocks: &[u32],
        mut dest: StagingSlice,
    ) -> Result<Box<dyn KvExport>, BackendError> {
        let kind = dest.kind();
        let out = dest.host_bytes_mut().ok_or_else(|| {
            BackendError::fatal(format!("this backend cannot export into {kind:?} staging"))
        })?;
        export_layers(self, blocks, out)?;
        Ok(Box::new(StagedExport::new(
            dest,
            self.kv_layout().n_layers.max(1),
        )))
    }
    /// Like [`Self::import_kv`], from a layer that landed in this backend's staging. The default reads
    /// host staging through [`Self::import_layer`].
    fn import_kv_staged(&mut self, at: LayerBlocks, src: StagedLayer) -> Result<(), BackendError> {
        self.import_layer(at, src.host_bytes()?)
    }
    /// Orders every import started so far before the next step's reads of the cache, without
    /// waiting on the host (a no-op for backends that import synchronously).
    fn import_fence(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Runs one step like `forward` and draws each logits row's token where the logits are, under
    /// `step.rows` (one per logits row): `Ok(true)` with the tokens in `step.out`. With `step.masks`
    /// (a step with guided rows) the backend takes the masks once the step's model work is queued and
    /// draws only allowed tokens. A backend without its own sampler, or one that cannot apply masks
    /// when the step has some, returns `Ok(false)` before doing anything (the default), and the engine
    /// runs the step through `forward` and the host sampler.
    fn forward_sampled(&mut self, step: SampledStep) -> Result<bool, BackendError> {
        let _ = step;
        Ok(false)
    }
}

/// One step for [`Backend::forward_sampled`]: what a backend that samples where the logits are needs,
/// with or without guided rows, in one value.
pub struct SampledStep<'a> {
    /// The step's sequences.
    pub batch: &'a ForwardBatch,
    /// One draw per logits row.
    pub rows: &'a [DeviceSampling],
    /// The guided rows' masks, handed over once they are computed; `None` for a step without guided
    /// rows.
    pub masks: Option<&'a mut dyn MaskSource>,
    /// The drawn tokens, one per logits row (cleared, then filled).
    pub out: &'a mut Vec<u32>,
}

/// Copies every layer of `blocks` into `out` (layer-major, blocks back to back) one layer at a time.
fn export_layers<B: Backend + ?Sized>(
    backend: &B,
    blocks: &[u32],
    out: &mut [u8],
) -> Result<(), BackendError> {
    let layers = backend.kv_layout().n_layers;
    let per_layer = blocks.len() * backend.kv_layout().block_bytes();
    if out.len() != layers * per_layer {
        return Err(BackendError::fatal(format!(
            "KV export of {} blocks of {layers} layers given {} bytes",
            blocks.len(),
            out.len()
        )));
    }
    if per_layer == 0 {
        return Ok(());
    }
    for (layer, o) in out.chunks_exact_mut(per_layer).enumerate() {
        backend.export_layer(LayerBlocks::new(layer, blocks), o)?;
    }
    Ok(())
}

/// Fails unless `len` bytes are exactly the blocks of `at`, `block_bytes` each.
fn check_layer_len(at: LayerBlocks, block_bytes: usize, len: usize) -> Result<(), BackendError> {
    if len == at.blocks.len() * block_bytes {
        Ok(())
    } else {
        Err(BackendError::fatal(format!(
            "KV copy of {} blocks of {block_bytes} bytes given {len} bytes",
            at.blocks.len()
        )))
    }
}
