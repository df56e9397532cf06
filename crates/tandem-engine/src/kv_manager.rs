//! The engine thread's KV manager for P/D disaggregation, on top of the block pool: pins holding a finished
//! prefill's blocks for export, export of pinned KV, and import of a prefilled prompt's KV (sharing what
//! the prefix cache already holds) until it starts decoding. Like every other mutation of the pool, these
//! run on the engine thread only.

use crate::backend::{Backend, BackendError, LayerBlocks};
use crate::block_pool::BlockTable;
use crate::error::EngineError;
use crate::guide::Guide;
use crate::handle::{ImportData, Item};
use crate::kv_host::KvExport;
use crate::kv_staging::KvStaging;
use crate::sampler::SeqRng;
use crate::scheduler::Sequence;
use crate::types::{EngineRequest, RequestId};
use crate::worker::{Ext, Seq, Worker};
use std::sync::Arc;
use std::time::Instant;
use tandem_model::KvLayout;
use tokio::sync::mpsc;

/// The KV of a pinned prefill, ready to ship to a decode worker.
pub struct ExportedKv {
    /// Layout of the source cache (a receiver must have the same per-block shape).
    pub layout: KvLayout,
    /// Prompt tokens covered.
    pub num_tokens: usize,
    /// Logical blocks covered (`num_tokens.div_ceil(block_size)`).
    pub num_blocks: usize,
    /// The first generated token.
    pub first_token: u32,
    /// The blocks' bytes, layer by layer (each layer's `num_blocks` blocks back to back), landing
    /// asynchronously on backends that copy off the engine thread.
    pub data: Box<dyn KvExport>,
}

impl ExportedKv {
    /// The bytes of one layer's blocks, once they have landed (waits for them).
    pub fn layer(&self, layer: usize) -> Result<&[u8], BackendError> {
        self.data.layer(layer)
    }

    /// Waits until one layer has landed, wherever the export lives.
    pub fn wait_layer(&self, layer: usize) -> Result<(), BackendError> {
        self.data.wait_layer(layer)
    }

    /// The staging slice holding the export when it went into staging memory (zero-copy transports).
    pub fn staged(&self) -> Option<&crate::kv_staging::StagingSlice> {
        self.data.staged()
    }

    /// The bytes of one (layer, logical block), once they have landed.
    pub fn block(&self, layer: usize, block: usize) -> Result<&[u8], BackendError> {
        let n = self.layout.block_bytes();
        Ok(&self.layer(layer)?[block * n..(block + 1) * n])
    }
}

impl std::fmt::Debug for ExportedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedKv")
            .field("layout", &self.layout)
            .field("num_tokens", &self.num_tokens)
            .field("num_blocks", &self.num_blocks)
            .field("first_token", &self.first_token)
            .finish_non_exhaustive()
    }
}

/// How an import was set up: of the prompt's logical blocks, the leading `cached` ones were found in this
/// engine's prefix cache and are shared (reference counted, like a normal admission's prefix hit); only
/// the rest need their KV supplied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportPlan {
    /// Logical blocks of the prompt (`prompt_len.div_ceil(block_size)`).
    pub num_blocks: usize,
    /// Leading blocks already holding this prompt's KV; always full blocks, never the last partial one.
    pub cached: usize,
    /// Per layer, the first logical block the import supplies: `cached`, or later for a sliding-window
    /// layer, whose blocks wholly behind the first decoded position's window are never read again.
    pub layer_from: Vec<usize>,
}

impl ImportPlan {
    /// The logical blocks whose KV must be imported (of some layer) before
    /// [`EngineHandle::start_decoding`](crate::EngineHandle::start_decoding).
    pub fn needed(&self) -> std::ops::Range<usize> {
        self.cached..self.num_blocks
    }

    /// The logical blocks of `layer` the import supplies.
    pub fn layer_needed(&self, layer: usize) -> std::ops::Range<usize> {
        self.layer_from
            .get(layer)
            .copied()
            .unwrap_or(self.cached)
            .min(self.num_blocks)..self.num_blocks
    }
}

/// Per layer, the first logical block an import of a `prompt_len`-token prompt must supply when its first
/// `cached` blocks are already here: the block of the first position the next query (at `prompt_len`)
/// sees, for a layer of window `w` (it sees `prompt_len + 1 - w ..= prompt_len`), and `cached` otherwise.
pub(crate) fn import_starts(
    windows: &[Option<usize>],
    prompt_len: usize,
    cached: usize,
    block_size: usize,
) -> Vec<usize> {
    windows
        .iter()
        .map(|w| match w {
            Some(w) => cached.max((prompt_len + 1).saturating_sub(*w) / block_size),
            None => cached,
        })
        .collect()
}

/// The KV of a finished prefill-only request, held for export until released or past its deadline.
pub(crate) struct Pin {
    pub(crate) table: BlockTable,
    pub(crate) num_tokens: usize,
    pub(crate) first_token: u32,
    pub(crate) deadline: Instant,
    /// The prefill request's span, for the lines logged about its pin and export.
    pub(crate) span: tracing::Span,
}

impl<B: Backend> Worker<B> {
    pub(crate) fn release_pin(&mut self, id: RequestId) {
        if let Some(mut pin) = self.pins.remove(&id) {
            self.pool.release(&mut pin.table);
            self.shared.live.lock().remove(&id);
        }
    }

    pub(crate) fn expire_pins(&mut self) {
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
            if let Some(pin) = self.pins.get(&id) {
                pin.span.in_scope(|| {
                    tracing::debug!(id, "prefill pin expired: its KV blocks are freed")
                });
            }
            self.release_pin(id);
        }
    }

    pub(crate) fn export(&mut self, id: RequestId) -> Result<ExportedKv, EngineError> {
        let pin = self.pins.get(&id).ok_or(EngineError::UnknownRequest(id))?;
        let layout = self.backend.kv_layout();
        let num_blocks = self.pool.blocks_for(pin.num_tokens);
        let (num_tokens, first_token) = (pin.num_tokens, pin.first_token);
        let blocks = pin.table.blocks[..num_blocks].to_vec();
        // Into staging memory while it has room (a zero-copy transport reads it there), else into host
        // buffers. Enqueued, not waited for: readers wait per layer (`ExportedKv::layer`).
        let bytes = layout.n_layers * blocks.len() * layout.block_bytes();
        let slice = self.staging.as_ref().and_then(|s| s.take(bytes));
        let _in = pin.span.clone().entered();
        if self.staging.is_some() && slice.is_none() {
            tracing::debug!(id, bytes, "KV staging full: exporting through host memory");
        }
        tracing::debug!(
            id,
            blocks = blocks.len(),
            bytes,
            staged = slice.is_some(),
            "KV export started"
        );
        let data = match slice {
            Some(slice) => self.backend.export_kv_staged(&blocks, slice),
            None => self.backend.export_kv(&blocks),
        }
        .map_err(|e| self.backend_failed(e.context(format_args!("request {id}: KV export"))))?;
        Ok(ExportedKv {
            layout,
            num_tokens,
            num_blocks,
            first_token,
            data,
        })
    }

    pub(crate) fn import_prefilled(
        &mut self,
        req: EngineRequest,
        first_token: u32,
        guide: Option<Guide>,
        tx: mpsc::UnboundedSender<Item>,
        span: tracing::Span,
    ) -> Result<ImportPlan, EngineError> {
        let id = req.id;
        let _in = span.clone().entered();
        // An import queues behind the requests already waiting to run, a preempted sequence first of
        // all: taking the blocks they wait for would starve them.
        if !self.sched.waiting.is_empty() {
            self.shared.live.lock().remove(&id);
            return Err(EngineError::KvBusy {
                id,
                reason: format!(
                    "{} requests ahead of it wait to run",
                    self.sched.waiting.len()
                ),
            });
        }
        let ext = Ext {
            rng: SeqRng::new(req.params.seed),
            params: req.params,
            mode: req.mode,
            tx,
            queued: false,
            first_token: Some(first_token),
            prompt_logprobs: None,
            guide,
            span,
            retries: 0,
        };
        let mut seq = Sequence::new(id, req.prompt, ext);
        // The cached prefix's KV is already here: those blocks are shared and only the rest is imported.
        // `num_computed` marks where the imported part begins until decoding starts.
        seq.num_computed = self.pool.match_full_blocks(&mut seq.table, &seq.tokens);
        if let Err(e) = self.pool.ensure_capacity(&mut seq.table, seq.prompt_len) {
            self.pool.release(&mut seq.table);
            self.shared.live.lock().remove(&id);
            return Err(EngineError::KvBusy {
                id,
                reason: e.to_string(),
            });
        }
        let cached = seq.num_computed / self.pool.block_size();
        let plan = ImportPlan {
            num_blocks: seq.table.blocks.len(),
            cached,
            layer_from: import_starts(
                self.backend.attention_windows(),
                seq.prompt_len,
                cached,
                self.pool.block_size(),
            ),
        };
        if plan.layer_from.iter().any(|&f| f > cached) {
            // Some layers of the skipped blocks will hold no KV: never offer them to a prefix lookup.
            seq.table.keep_unnamed();
        }
        self.counters.prompt_tokens_total += seq.prompt_len as u64;
        self.counters.import_blocks_cached += plan.cached as u64;
        self.counters.import_blocks_needed += plan.needed().len() as u64;
        tracing::debug!(
            id,
            blocks = plan.num_blocks,
            cached = plan.cached,
            "KV import planned: the uncached blocks are reserved"
        );
        self.importing.insert(id, seq);
        Ok(plan)
    }

    /// An importing request, the cache layout, and the first logical block the import supplies of `layer`.
    fn importing_seq(
        &self,
        id: RequestId,
        layer: usize,
    ) -> Result<(&Seq, KvLayout, usize), EngineError> {
        let seq = self
            .importing
            .get(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        let bs = self.pool.block_size();
        let cached = seq.num_computed / bs;
        let window = self
            .backend
            .attention_windows()
            .get(layer)
            .copied()
            .flatten();
        let from = import_starts(&[window], seq.prompt_len, cached, bs)[0];
        Ok((
            seq,
            self.backend.kv_layout(),
            from.min(seq.table.blocks.len()),
        ))
    }

    pub(crate) fn import_block(
        &mut self,
        id: RequestId,
        layer: usize,
        block: usize,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let (seq, layout, from) = self.importing_seq(id, layer)?;
        if layer >= layout.n_layers
            || block >= seq.table.blocks.len()
            || block < from
            || data.len() != layout.block_bytes()
        {
            return Err(EngineError::InvalidState {
                id,
                reason: format!(
                    "bad import: layer {layer}, block {block} (blocks {from}..{} expected), {} bytes (expected {})",
                    seq.table.blocks.len(),
                    data.len(),
                    layout.block_bytes()
                ),
            });
        }
        self.backend
            .import_block(layer, seq.table.blocks[block], data)
            .map_err(|e| self.backend_failed(e.context(format_args!("request {id}: KV import"))))
    }

    pub(crate) fn import_layer(
        &mut self,
        id: RequestId,
        layer: usize,
        data: ImportData,
    ) -> Result<(), EngineError> {
        let (seq, layout, from) = self.importing_seq(id, layer)?;
        // Owned: the backend call below borrows the engine mutably (a few ids per layer).
        let blocks = seq.table.blocks[from..].to_vec();
        if layer >= layout.n_layers || data.len() != blocks.len() * layout.block_bytes() {
            return Err(EngineError::InvalidState {
                id,
                reason: format!(
                    "bad import: layer {layer} of {}, {} bytes (expected {} blocks of {})",
                    layout.n_layers,
                    data.len(),
                    blocks.len(),
                    layout.block_bytes()
                ),
            });
        }
        match data {
            ImportData::Host(buf) => self
                .backend
                .import_kv(LayerBlocks::new(layer, &blocks), buf),
            ImportData::Staged(staged) => self
                .backend
                .import_kv_staged(LayerBlocks::new(layer, &blocks), staged),
        }
        .map_err(|e| self.backend_failed(e.context(format_args!("request {id}: KV import"))))
    }

    pub(crate) fn enable_staging(&mut self, bytes: usize) -> Result<Arc<KvStaging>, EngineError> {
        if let Some(s) = &self.staging {
            return Ok(Arc::clone(s));
        }
        let staging = self.backend.kv_staging(bytes).map_err(|e| {
            self.backend_failed(e.context(format_args!("KV staging of {bytes} bytes")))
        })?;
        tracing::info!(bytes, kind = ?staging.kind(), "KV staging memory allocated");
        self.staging = Some(Arc::clone(&staging));
        Ok(staging)
    }

    pub(crate) fn start_decoding(&mut self, id: RequestId) -> Result<(), EngineError> {
        if !self.importing.contains_key(&id) {
            return Err(EngineError::UnknownRequest(id));
        }
        // Imports run asynchronously on some backends: this request's steps must read them. On
        // failure the request stays importing; the caller's abort frees its blocks.
        if let Err(e) = self.backend.import_fence() {
            return Err(self.backend_failed(e.context(format_args!("request {id}: KV import"))));
        }
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
        seq.ext
            .span
            .in_scope(|| tracing::debug!(id, "KV imported: decoding starts"));
        self.sched.add_running(seq);
        let idx = self.sched.running.len() - 1;
        self.emit(idx, token, None);
        self.reap();
        Ok(())
    }
}
