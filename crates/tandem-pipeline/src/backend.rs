//! The first stage: the engine's `Backend` over a pipeline, computing stage 0 here and driving the later
//! stages over their links (routing and micro-batching as the crate docs describe).

use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tandem_engine::{
    Backend, BackendError, BackendErrorKind, BackendInfo, DeviceSampling, LayerBlocks, SampledStep,
    StageError, StageInput, StageModel, StageOutput,
};
use tandem_kv::KvError;
use tandem_model::{ForwardBatch, KvLayout, LayerExpertTokens, ModelIdentity, Partition};

use crate::link::StageClient;
use crate::model::extend_f32;
use crate::{hello, PipelineConfig, PipelineError};

/// A micro-batch on its way through the stages: its index, its hidden states (f32 logits rows once
/// back from a last stage that returns logits) and its drawn tokens (from one that samples).
type InFlight = (usize, Vec<u8>, Vec<u32>);

/// A remote stage as the first stage sees it.
pub(crate) struct Link {
    stage: usize,
    pub(crate) layers: std::ops::Range<usize>,
    /// The stage draws tokens on its device (its hello said so).
    samples: bool,
    /// The stage has mixture-of-experts layers and its link version answers their counts.
    counts: bool,
    /// Locked only by the engine thread (block operations) or by the step's link thread, never both at once.
    client: Mutex<StageClient>,
}

impl Link {
    /// Runs one block operation on the stage, naming the stage and the operation if it fails.
    fn call(
        &self,
        what: &str,
        op: impl FnOnce(&mut StageClient) -> Result<(), KvError>,
    ) -> Result<(), BackendError> {
        let r = op(&mut *self
            .client
            .lock()
            .map_err(|_| BackendError::worker_lost("pipeline link lock poisoned"))?);
        r.map_err(|e| self.err(what, e))
    }

    /// A failed operation of this link: a lost stage, whatever the cause, since the client stays
    /// failed after any error ([`StageClient`]'s docs say why) and the stage's KV may be gone with it.
    fn err(&self, what: &str, e: KvError) -> BackendError {
        let addr = self.client.lock().map(|c| c.peer().to_string());
        BackendError::caused(
            BackendErrorKind::WorkerLost,
            format_args!(
                "pipeline stage {} ({}) {what}",
                self.stage,
                addr.unwrap_or_default()
            ),
            e,
        )
    }
}

/// The later stages' expert counts as last fetched over their links ([`PipelineBackend::moe_expert_tokens`]).
#[derive(Default)]
struct RemoteCounts {
    /// Per link, what its stage last reported.
    per_link: Vec<LinkCounts>,
    /// When they were last fetched.
    fetched: Option<Instant>,
    /// Pipeline steps run at the last fetch, and when the engine last asked.
    steps_at_fetch: u64,
    steps_at_ask: u64,
}

/// One later stage's expert counts as last fetched.
#[derive(Clone, Default)]
struct LinkCounts {
    /// Its layers' counts (empty until fetched, or for a stage that does not report).
    layers: Vec<LayerExpertTokens>,
    /// Its fetch failed: not asked again (the failure also fails the next step).
    failed: bool,
}

/// The engine's `Backend` over a pipeline: the first stage computed here, later stages over their links.
pub struct PipelineBackend {
    model: Box<dyn StageModel>,
    pub(crate) links: Vec<Link>,
    info: BackendInfo,
    micro_batches: usize,
    min_micro_batch_tokens: usize,
    /// The step's micro-batches, reused across steps.
    mbs: Vec<ForwardBatch>,
    /// Per micro-batch: hidden states on the way out, logits on the way back; reused across steps.
    bufs: Vec<Vec<u8>>,
    /// Per micro-batch: tokens drawn by a last stage that samples; reused across steps.
    ids: Vec<Vec<u32>>,
    /// Steps that ran through the later stages (each may have changed their expert counts).
    steps: u64,
    /// Experts per mixture-of-experts layer (0 for a dense model).
    experts: usize,
    /// Least time between two fetches of the later stages' expert counts while steps run.
    expert_counts_every: Duration,
    /// The later stages' expert counts, fetched at most every `expert_counts_every`.
    remote_counts: Mutex<RemoteCounts>,
    /// Whatever must live exactly as long as the backend (the stage processes a worker started);
    /// declared last so the links close before it drops.
    keep_alive: Option<Box<dyn Send>>,
}

impl std::fmt::Debug for PipelineBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineBackend")
            .field("stages", &(self.links.len() + 1))
            .field("micro_batches", &self.micro_batches)
            .field("layout", &self.info.layout)
            .finish()
    }
}

impl PipelineBackend {
    /// Makes `model` (stage 0's layers, on any device) the first stage of `stage_addrs.len() + 1`
    /// stages, sizes its KV pool and connects to the servers of the others (in stage order), checking
    /// model identity, stage, layers and KV pool at each handshake.
    pub fn connect(
        mut model: Box<dyn StageModel>,
        identity: &ModelIdentity,
        stage_addrs: &[String],
        cfg: &PipelineConfig,
    ) -> Result<PipelineBackend, PipelineError> {
        let config = &model.config().clone();
        let stages = stage_addrs.len() + 1;
        if cfg.block_size == 0 {
            return Err(PipelineError::Config("block_size 0".into()));
        }
        let first = Partition::stage(config, 0, stages)?;
        if &first != model.partition() {
            return Err(PipelineError::Config(format!(
                "stage 0 of {stages} holds layers {:?}, the model given holds {:?}",
                first.layers,
                model.partition().layers
            )));
        }
        let layout = KvLayout::for_budget(
            config,
            cfg.block_size,
            cfg.kv_cache_memory,
            model.kv_dtype(),
        );
        let num_blocks = layout.num_blocks;
        model.size_pool(cfg.block_size, num_blocks)?;
        let mut links = Vec::with_capacity(stages - 1);
        for (i, addr) in stage_addrs.iter().enumerate() {
            let stage = i + 1;
            let part = Partition::stage(config, stage, stages)?;
            let h = hello(
                &*model,
                identity,
                &part,
                (stage, stages),
                (cfg.block_size, num_blocks),
            );
            let client = StageClient::connect_tls(
                addr.as_str(),
                &h,
                cfg.timeouts,
                cfg.cluster_key.as_ref(),
                cfg.tls.as_deref(),
            )
            .map_err(|source| PipelineError::Link {
                stage,
                addr: addr.clone(),
                source,
            })?;
            tracing::info!(stage, addr = %addr, layers = ?part.layers, "pipeline stage connected");
            let moe = config.has_moe_in(part.layers.clone());
            if moe && !client.answers_expert_tokens() {
                tracing::warn!(
                    stage,
                    addr = %addr,
                    layers = ?part.layers,
                    version = client.remote().version,
                    "the stage's link version does not report expert counts: \
                     tandem:moe_expert_tokens_total leaves out its layers"
                );
            }
            links.push(Link {
                stage,
                layers: part.layers,
                samples: client.remote().samples,
                counts: moe && client.answers_expert_tokens(),
                client: Mutex::new(client),
            });
        }
        let micro_batches = if cfg.micro_batches == 0 {
            stages
        } else {
            cfg.micro_batches
        };
        tracing::info!(stages, micro_batches, num_blocks, "pipeline ready");
        let mut info = BackendInfo::new(config, layout);
        // Every stage is sized alike, so stage 0's limit is the pipeline's.
        info.max_len = model.max_len();
        let remote_counts = RemoteCounts {
            per_link: vec![LinkCounts::default(); links.len()],
            ..RemoteCounts::default()
        };
        Ok(PipelineBackend {
            model,
            links,
            info,
            micro_batches,
            min_micro_batch_tokens: cfg.min_micro_batch_tokens,
            mbs: Vec::new(),
            bufs: Vec::new(),
            ids: Vec::new(),
            steps: 0,
            experts: config.moe.as_ref().map_or(0, |m| m.num_experts),
            expert_counts_every: cfg.expert_counts_every,
            remote_counts: Mutex::new(remote_counts),
            keep_alive: None,
        })
    }

    /// Ties `guard` (e.g. the stage processes serving this pipeline) to the backend's lifetime.
    pub fn keep_alive(&mut self, guard: Box<dyn Send>) {
        self.keep_alive = Some(guard);
    }

    /// Pipeline stages, this one included.
    pub fn stages(&self) -> usize {
        self.links.len() + 1
    }

    /// Whether the last stage draws tokens on its device (so `forward_sampled` moves no logits).
    pub fn samples_on_device(&self) -> bool {
        self.links
            .last()
            .map_or_else(|| self.model.samples_on_device(), |l| l.samples)
    }

    /// Refreshes the later stages' expert counts in `r` from their links: stages that report them,
    /// one request each. A failed request leaves the link failed, as any does (the next step then fails
    /// naming the stage); its stage keeps its last counts and is not asked again.
    fn fetch_remote_counts(&self, r: &mut RemoteCounts) {
        for (link, last) in self.links.iter().zip(&mut r.per_link) {
            if !link.counts || last.failed {
                continue;
            }
            let mut fresh = Vec::new();
            match link.call("expert counts", |c| {
                c.expert_tokens(self.experts, &mut fresh)
            }) {
                Ok(()) => last.layers = fresh,
                Err(e) => {
                    tracing::warn!(error = %e, "could not read a stage's expert token counts");
                    last.failed = true;
                }
            }
        }
        r.fetched = Some(Instant::now());
        r.steps_at_fetch = self.steps;
    }

    /// The link owning global `layer`, or None for the local first stage.
    fn owner(&self, layer: usize) -> Result<Option<&Link>, BackendError> {
        if self.model.partition().layers.contains(&layer) {
            return Ok(None);
        }
        self.links
            .iter()
            .find(|l| l.layers.contains(&layer))
            .map(Some)
            .ok_or_else(|| BackendError::fatal(format!("layer {layer} beyond the model")))
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), BackendError> {
        match blocks
            .iter()
            .find(|&&b| b as usize >= self.info.layout.num_blocks)
        {
            None => Ok(()),
            Some(b) => Err(BackendError::fatal(format!(
                "block {b} beyond the pool of {}",
                self.info.layout.num_blocks
            ))),
        }
    }

    /// Checks that `bytes` holds `blocks` blocks of every one of `layers` layers.
    fn check_len(&self, blocks: &[u32], layers: usize, bytes: usize) -> Result<(), BackendError> {
        let want = layers * blocks.len() * self.info.layout.block_bytes();
        if bytes == want {
            Ok(())
        } else {
            Err(BackendError::fatal(format!(
                "{bytes} bytes for {} blocks of {layers} layers ({want} expected)",
                blocks.len()
            )))
        }
    }
}

impl PipelineBackend {
    /// One step through every stage: logits rows into `logits`, or with `rows` (a last stage that
    /// samples) the drawn tokens into `ids`.
    fn step(
        &mut self,
        batch: &ForwardBatch,
        rows: Option<&[DeviceSampling]>,
        logits: &mut Vec<f32>,
        ids: &mut Vec<u32>,
    ) -> Result<(), BackendError> {
        let to_err = |e: StageError| stage0_err("forward", e);
        if self.links.is_empty() {
            let input = StageInput {
                batch,
                hidden: None,
            };
            if let Some(rows) = rows {
                let output = StageOutput::Tokens { rows, out: ids };
                return self.model.forward(input, output).map_err(to_err);
            }
            self.bufs.resize_with(self.bufs.len().max(1), Vec::new);
            self.model
                .forward(input, StageOutput::Hidden(&mut self.bufs[0]))
                .map_err(to_err)?;
            extend_f32(logits, &self.bufs[0]);
            return Ok(());
        }
        if batch.seqs.is_empty() {
            return Ok(());
        }
        self.steps += 1;
        let worth = batch.tokens.len() / self.min_micro_batch_tokens.max(1);
        let m = split(batch, self.micro_batches.min(worth), &mut self.mbs);
        if self.bufs.len() < m {
            self.bufs.resize_with(m, Vec::new);
            self.ids.resize_with(m, Vec::new);
        }
        // Each micro-batch's share of the sampling rows (one per logits row, in batch order).
        let mut row_ranges = Vec::with_capacity(m);
        let mut at = 0;
        for mb in &self.mbs[..m] {
            row_ranges.push(at..at + mb.logits_rows());
            at += mb.logits_rows();
        }
        let PipelineBackend {
            model,
            links,
            mbs,
            bufs,
            ids: id_bufs,
            ..
        } = self;
        let mbs = &mbs[..m];
        let row_ranges = &row_ranges;
        let last = links.len() - 1;
        let result = std::thread::scope(|s| {
            // First stage → link thread of stage 1 → ... → the last link thread → back here.
            let (tx_first, mut rx) = mpsc::channel::<InFlight>();
            let mut threads = Vec::with_capacity(links.len());
            for (k, link) in links.iter_mut().enumerate() {
                let (tx, rx_next) = mpsc::channel::<InFlight>();
                let rx_in = std::mem::replace(&mut rx, rx_next);
                let sample = rows.filter(|_| k == last);
                threads.push(s.spawn(move || -> Result<(), BackendError> {
                    let stage = link.stage;
                    let client = link.client.get_mut().map_err(|_| {
                        BackendError::worker_lost(format!(
                            "pipeline stage {stage}: link lock poisoned"
                        ))
                    })?;
                    for (i, mut buf, mut got) in rx_in {
                        let r = match sample {
                            Some(rows) => client.forward_sampled(
                                &mbs[i],
                                &rows[row_ranges[i].clone()],
                                &buf,
                                &mut got,
                            ),
                            None => client.forward(&mbs[i], &mut buf),
                        };
                        if let Err(e) = r {
                            return Err(link.err("forward", e));
                        }
                        if tx.send((i, buf, got)).is_err() {
                            break;
                        }
                    }
                    Ok(())
                }));
            }
            let mut first_err = None;
            for (i, mb) in mbs.iter().enumerate() {
                let mut buf = std::mem::take(&mut bufs[i]);
                let input = StageInput {
                    batch: mb,
                    hidden: None,
                };
                if let Err(e) = model.forward(input, StageOutput::Hidden(&mut buf)) {
                    first_err = Some(to_err(e));
                    break;
                }
                if tx_first
                    .send((i, buf, std::mem::take(&mut id_bufs[i])))
                    .is_err()
                {
                    break;
                }
            }
            drop(tx_first);
            let mut done = 0;
            for (i, buf, got) in rx {
                bufs[i] = buf;
                id_bufs[i] = got;
                done += 1;
            }
            for t in threads {
                let r = t.join().unwrap_or_else(|_| {
                    Err(BackendError::worker_lost("pipeline link thread panicked"))
                });
                if let (Err(e), None) = (r, &first_err) {
                    first_err = Some(e);
                }
            }
            match first_err {
                Some(e) => Err(e),
                None if done != m => Err(BackendError::fatal(format!(
                    "pipeline returned {done} of {m} micro-batches"
                ))),
                None => Ok(()),
            }
        });
        result?;
        match rows {
            Some(_) => self.ids[..m].iter().for_each(|b| ids.extend_from_slice(b)),
            None => self.bufs[..m].iter().for_each(|b| extend_f32(logits, b)),
        }
        Ok(())
    }
}

/// An operation of the local first stage that failed (its layers are global = local: it starts at 0),
/// classified by [`stage_kind`].
fn stage0_err(what: &str, e: StageError) -> BackendError {
    BackendError::caused(stage_kind(&e), format_args!("pipeline stage 0 {what}"), e)
}

/// What the engine must do about a failure of the first stage's model: the device's own
/// classification when it gave one (a device stage boxes a [`BackendError`] as its
/// [`StageError::Device`] cause: CUDA's out-of-memory is retryable, a sticky fault loses the worker),
/// else a fault: the engine sends batches and blocks it checked, so a stage refusing them is a bug.
pub(crate) fn stage_kind(e: &StageError) -> BackendErrorKind {
    match e {
        StageError::Device(source) => source
            .downcast_ref::<BackendError>()
            .map_or(BackendErrorKind::Fatal, BackendError::kind),
        _ => BackendErrorKind::Fatal,
    }
}

/// Cuts `batch`'s sequences into at most `m` contiguous non-empty groups of about equal token counts
/// (into the reused `mbs`); returns how many groups were filled.
pub(crate) fn split(batch: &ForwardBatch, m: usize, mbs: &mut Vec<ForwardBatch>) -> usize {
    let n = batch.seqs.len();
    let m = m.clamp(1, n.max(1));
    if mbs.len() < m {
        mbs.resize_with(m, ForwardBatch::default);
    }
    for mb in mbs.iter_mut().take(m) {
        mb.clear();
    }
    let total = batch.tokens.len().max(1);
    let (mut j, mut acc) = (0, 0);
    for (k, s) in batch.seqs.iter().enumerate() {
        mbs[j].push(
            &batch.tokens[s.tokens.clone()],
            s.pos,
            s.blocks.clone(),
            s.logits,
        );
        acc += s.tokens.len();
        let (left_seqs, left_mbs) = (n - k - 1, m - j - 1);
        if left_mbs > 0 && (acc * m >= total * (j + 1) || left_seqs == left_mbs) {
            j += 1;
        }
    }
    j + 1
}

impl Backend for PipelineBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// The first stage's counts, then each later stage's in stage (so layer) order. The later stages'
    /// come over their links, fetched off the step path: the engine asks after every step, so they are
    /// fetched at most every `expert_counts_every` while steps run, and again when it asks with no step
    /// since it last asked (its publish before idling), so counts at rest are exact. A stage whose link
    /// version predates them is left out (warned at connect).
    fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        self.model.moe_expert_tokens(out);
        let Ok(mut r) = self.remote_counts.lock() else {
            return;
        };
        let stale = r.fetched.is_none() || r.steps_at_fetch != self.steps;
        let due = r
            .fetched
            .is_none_or(|t| t.elapsed() >= self.expert_counts_every)
            || r.steps_at_ask == self.steps;
        r.steps_at_ask = self.steps;
        if stale && due && self.links.iter().any(|l| l.counts) {
            self.fetch_remote_counts(&mut r);
        }
        for counts in &r.per_link {
            out.extend(counts.layers.iter().cloned());
        }
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        logits.clear();
        self.step(batch, None, logits, &mut Vec::new())
    }

    /// Only a last stage that samples on its device draws, and never under masks.
    fn forward_sampled(&mut self, step: SampledStep) -> Result<bool, BackendError> {
        if step.masks.is_some() || !self.samples_on_device() {
            return Ok(false);
        }
        step.out.clear();
        self.step(step.batch, Some(step.rows), &mut Vec::new(), step.out)?;
        Ok(true)
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError> {
        self.export_layer(LayerBlocks::new(layer, &[block]), out)
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError> {
        self.import_layer(LayerBlocks::new(layer, &[block]), data)
    }

    /// One request to the stage owning the layer.
    fn export_layer(&self, at: LayerBlocks, out: &mut [u8]) -> Result<(), BackendError> {
        self.check_blocks(at.blocks)?;
        self.check_len(at.blocks, 1, out.len())?;
        match self.owner(at.layer)? {
            None => self
                .model
                .export_blocks(at, out)
                .map_err(|e| stage0_err("export", e)),
            Some(link) => link.call("export", |c| c.export_blocks(at.layer, at.blocks, out)),
        }
    }

    /// One request to the stage owning the layer.
    fn import_layer(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), BackendError> {
        self.check_blocks(at.blocks)?;
        self.check_len(at.blocks, 1, data.len())?;
        match self.owner(at.layer)? {
            None => self
                .model
                .import_blocks(at, data)
                .map_err(|e| stage0_err("import", e)),
            Some(link) => link.call("import", |c| c.import_blocks(at.layer, at.blocks, data)),
        }
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError> {
        self.check_blocks(&[src, dst])?;
        self.model
            .copy_block(src, dst)
            .map_err(|e| stage0_err("copy", e))?;
        for link in &self.links {
            link.call("copy", |c| c.copy_block(src, dst))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;

    #[test]
    fn a_stage_s_device_error_keeps_its_kind_and_anything_else_is_a_fault() {
        let oom = StageError::Device(Box::new(BackendError::retryable("out of device memory")));
        assert_eq!(
            stage0_err("forward", oom).kind(),
            BackendErrorKind::Retryable
        );
        let lost = StageError::Device(Box::new(BackendError::worker_lost("illegal address")));
        assert_eq!(
            stage0_err("forward", lost).kind(),
            BackendErrorKind::WorkerLost
        );
        let unknown = StageError::Device("a device error of no known kind".into());
        assert_eq!(
            stage0_err("forward", unknown).kind(),
            BackendErrorKind::Fatal
        );
        let e = stage0_err("export", StageError::Unsized);
        assert_eq!(e.kind(), BackendErrorKind::Fatal);
        let source = std::error::Error::source(&e).expect("the stage's error is kept");
        assert!(matches!(
            source.downcast_ref::<StageError>(),
            Some(StageError::Unsized)
        ));
    }
}
