//! The engine thread's loop: applies commands, runs scheduled steps through the backend, samples, emits
//! tokens and publishes stats.

use crate::backend::{
    Backend, BackendError, BackendErrorKind, DeviceMasks, DeviceSampling, SampledStep,
};
use crate::block_pool::BlockPool;
use crate::error::EngineError;
use crate::guide::{Guide, Mask};
use crate::handle::{Command, Item, Shared};
use crate::kv_manager::Pin;
use crate::kv_offload::TierRestore;
use crate::kv_staging::KvStaging;
use crate::kv_tiers::KvTiers;
use crate::sampler::{argmax, logprobs_of, Sampled, Sampler, SeqRng};
use crate::scheduler::{Scheduler, Sequence};
use crate::stats::EngineStats;
use crate::step_masks::{DevicePacking, StepMasking};
use crate::types::{
    FinishReason, RequestId, RequestMode, SamplingParams, TokenLogprobs, TokenOutput,
};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tandem_model::{ForwardBatch, LogitsWanted};
use tokio::sync::mpsc;

/// Per-request data the engine keeps beside the scheduler's state.
pub(crate) struct Ext {
    pub(crate) params: SamplingParams,
    pub(crate) mode: RequestMode,
    pub(crate) rng: SeqRng,
    pub(crate) tx: mpsc::UnboundedSender<Item>,
    /// Still counted in `Shared::queued` (not yet admitted for the first time).
    pub(crate) queued: bool,
    /// Imported requests: the first token, emitted when decoding starts.
    pub(crate) first_token: Option<u32>,
    /// Requests scoring their prompt: one entry per prompt position, filled as prompt chunks run and
    /// handed out with the first token.
    pub(crate) prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// Guided requests: the grammar state after every token so far (taken out while a step computes
    /// its mask).
    pub(crate) guide: Option<Guide>,
    /// The submitter's span, entered for every line logged about this request (its `request_id`).
    pub(crate) span: tracing::Span,
    /// Steps of this request in a row that failed for a passing reason ([`BackendError::Retryable`]);
    /// past [`MAX_STEP_RETRIES`] the request fails.
    pub(crate) retries: u32,
}

/// How many times in a row a request's step may fail for a passing reason and run again before the
/// request fails with that error: enough to ride out a neighbour's burst of device memory, few enough
/// that a shortage that does not pass reaches the client in milliseconds.
pub(crate) const MAX_STEP_RETRIES: u32 = 3;

/// A sequence as the engine thread keeps it.
pub(crate) type Seq = Sequence<Ext>;

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

/// Whether a request's draws can be made by a backend's own sampler: the filters it implements
/// and nothing that needs the whole logits row on the host.
fn device_samplable(p: &SamplingParams) -> bool {
    p.repetition_penalty == 1.0
        && p.frequency_penalty == 0.0
        && p.presence_penalty == 0.0
        && p.logprobs.is_none()
        && p.prompt_logprobs.is_none()
}

/// The engine thread's state: the only owner and mutator of the backend, block pool and scheduler.
pub(crate) struct Worker<B: Backend> {
    pub(crate) backend: B,
    pub(crate) pool: BlockPool,
    pub(crate) sched: Scheduler<Ext>,
    pub(crate) sampler: Sampler,
    pub(crate) batch: ForwardBatch,
    pub(crate) logits: Vec<f32>,
    /// Whether to offer steps to the backend's own sampler (cleared when it declines once).
    pub(crate) device_sampler: bool,
    /// This step's rows for the backend's sampler and the tokens it drew (reused buffers).
    pub(crate) device_rows: Vec<DeviceSampling>,
    pub(crate) device_tokens: Vec<u32>,
    /// Whether to offer guided steps to the backend's own sampler (cleared when it declines once).
    pub(crate) device_masks: bool,
    /// This step's guided rows for the backend's sampler: (scheduled index, logits row).
    pub(crate) device_guided: Vec<(usize, usize)>,
    /// This step's masks packed for the backend's sampler (reused buffer).
    pub(crate) packed_masks: DeviceMasks,
    /// This step's allowed-token masks, by index into the scheduled list (guided rows only).
    pub(crate) masks: Vec<Option<Result<Mask, EngineError>>>,
    /// Requests whose prompt KV is being imported, until `start_decoding` (see `kv_manager`).
    pub(crate) importing: HashMap<RequestId, Seq>,
    /// Finished prefill-only requests' KV, held for export (see `kv_manager`).
    pub(crate) pins: HashMap<RequestId, Pin>,
    /// Staging memory exports go into while it has room (zero-copy transports).
    pub(crate) staging: Option<Arc<KvStaging>>,
    /// Indices into `sched.running` that finished this step (reused buffer).
    pub(crate) finished: Vec<usize>,
    pub(crate) eos: Vec<u32>,
    pub(crate) vocab: usize,
    /// Longest sequence allowed: the context length, capped by what the pool can hold.
    pub(crate) max_len: usize,
    pub(crate) counters: EngineStats,
    pub(crate) shared: Arc<Shared>,
    pub(crate) rx: Receiver<Command>,
    /// The backend failure that ended serving (worker lost or fatal); the loop stops once it is set.
    pub(crate) failure: Option<Arc<BackendError>>,
    /// The KV tiers evicted blocks go down to (`kv_offload`), if any.
    pub(crate) tiers: Option<KvTiers>,
}

impl<B: Backend> Worker<B> {
    pub(crate) fn run(mut self) {
        tracing::debug!(blocks = self.pool.num_blocks(), "engine thread started");
        'outer: loop {
            while let Ok(cmd) = self.rx.try_recv() {
                if !self.handle(cmd) {
                    break 'outer;
                }
            }
            self.expire_pins();
            let progressed = self.sched.has_work() && self.step();
            if self.failure.is_some() {
                break;
            }
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

    /// Fails every request the engine holds, with the failure that ended serving or as stopped.
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
            self.fail(id, self.stop_error());
        }
        let pins: Vec<RequestId> = self.pins.keys().copied().collect();
        for id in pins {
            self.release_pin(id);
        }
        self.shared.stopped.store(true, Ordering::Release);
        // Requests submitted while the engine was stopping get its answer rather than a stream that
        // ends without one; other commands' replies drop, which their callers read as stopped.
        while let Ok(cmd) = self.rx.try_recv() {
            if let Command::Submit(req, _, tx, _) = cmd {
                self.shared.queued.fetch_sub(1, Ordering::AcqRel);
                self.shared.live.lock().remove(&req.id);
                let _ = tx.send(Err(self.stop_error()));
            }
        }
        self.publish();
    }

    /// What a request still here when serving ends fails with.
    fn stop_error(&self) -> EngineError {
        self.failure
            .clone()
            .map_or(EngineError::Stopped, EngineError::Backend)
    }

    /// Ends serving after a failure that leaves the backend unusable (worker lost, fatal): handles see
    /// it at once (new work is refused with it and health reports it), and the loop stops, failing
    /// every request with it.
    pub(crate) fn halt(&mut self, e: Arc<BackendError>) {
        tracing::error!(error = %e, kind = ?e.kind(), "backend unusable: the engine stops serving");
        self.shared.failure.lock().get_or_insert_with(|| e.clone());
        self.failure.get_or_insert(e);
    }

    /// A backend failure outside a step (a KV export or import) as its caller sees it; a failure that
    /// leaves the backend unusable also halts the engine, as it would in a step.
    pub(crate) fn backend_failed(&mut self, e: BackendError) -> EngineError {
        let e = Arc::new(e);
        if matches!(
            e.kind(),
            BackendErrorKind::WorkerLost | BackendErrorKind::Fatal
        ) {
            self.halt(e.clone());
        }
        EngineError::Backend(e)
    }

    /// Applies one command; false means shut down.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req, guide, tx, span) => {
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
                    guide,
                    span,
                    retries: 0,
                };
                let mut seq = Sequence::new(req.id, req.prompt, ext);
                seq.ext.span.in_scope(|| {
                    tracing::debug!(
                        id = seq.id,
                        prompt_tokens = seq.prompt_len,
                        resumed_tokens = resumed.len(),
                        "request queued"
                    );
                });
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
            Command::ImportPrefilled(req, first_token, guide, tx, span, reply) => {
                let _ = reply.send(self.import_prefilled(*req, first_token, guide, tx, span));
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
            Command::ImportLayer {
                id,
                layer,
                data,
                reply,
            } => {
                let _ = reply.send(self.import_layer(id, layer, data));
            }
            Command::EnableStaging(bytes, reply) => {
                let _ = reply.send(self.enable_staging(bytes));
            }
            Command::StartDecoding(id, reply) => {
                let _ = reply.send(self.start_decoding(id));
            }
            Command::Check(reply) => {
                let _ = reply.send(self.check());
            }
            Command::Shutdown => return false,
        }
        // An import may have evicted cached blocks that later commands overwrite.
        self.offload_evicted();
        self.failure.is_none()
    }

    /// Releases a removed sequence's blocks and forgets its id.
    pub(crate) fn drop_seq(&mut self, seq: &mut Seq) {
        self.pool.release(&mut seq.table);
        if seq.ext.queued {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
        self.shared.live.lock().remove(&seq.id);
    }

    fn fail(&mut self, id: RequestId, err: EngineError) {
        if let Some(mut seq) = self.sched.remove(id).or_else(|| self.importing.remove(&id)) {
            seq.ext
                .span
                .in_scope(|| tracing::debug!(id, error = %err, "request failed"));
            let _ = seq.ext.tx.send(Err(err));
            self.drop_seq(&mut seq);
            self.counters.requests_finished_total += 1;
        }
    }

    /// Runs one scheduled step; false if nothing could be scheduled.
    fn step(&mut self) -> bool {
        let started = Instant::now();
        self.read_ahead_waiting();
        let restore_failed = match self.tiers.as_mut() {
            Some(tiers) => {
                let mut source = TierRestore::new(&mut self.backend, tiers);
                self.sched
                    .schedule_with(&mut self.pool, &mut self.batch, &mut source);
                source.failure
            }
            None => {
                self.sched.schedule(&mut self.pool, &mut self.batch);
                None
            }
        };
        if let Some(e) = restore_failed {
            // The plan holds only blocks restored whole, so the step can run unless the backend is gone.
            self.backend_failed(e);
            if self.failure.is_some() {
                return false;
            }
        }
        // Blocks evicted to make room for this step go down to the tiers before it overwrites them.
        self.offload_evicted();
        self.counters.preemptions_total += self.sched.preempted().len() as u64;
        for &id in self.sched.preempted() {
            if let Some(seq) = self.sched.waiting.iter().find(|s| s.id == id) {
                seq.ext.span.in_scope(|| {
                    tracing::debug!(
                        id,
                        tokens = seq.tokens.len(),
                        "preempted: its KV blocks are freed and it will be recomputed"
                    );
                });
            }
        }
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
                seq.ext.span.in_scope(|| {
                    tracing::debug!(
                        id = seq.id,
                        cached_tokens = seq.num_computed,
                        "request scheduled"
                    );
                });
            }
            if s.len > 1 || seq.num_computed < seq.prompt_len {
                self.counters.prefill_tokens_computed += s.len as u64;
            }
        }
        self.counters.steps_total += 1;
        // Guided rows' masks are computed on other threads while the model runs.
        let mut masking = self.start_masks();
        let forward_started = Instant::now();
        let forwarded = self.forward(masking.as_mut());
        self.counters.forward_seconds_total += forward_started.elapsed().as_secs_f64();
        self.join_masks(masking);
        let on_device = match forwarded {
            Ok(on_device) => on_device,
            Err(e) => {
                self.step_failed(e);
                self.counters.step_seconds_total += started.elapsed().as_secs_f64();
                return true;
            }
        };
        let mut row = 0;
        let mut failed = Vec::new();
        for k in 0..self.sched.scheduled().len() {
            let s = self.sched.scheduled()[k];
            let start = self.sched.advance(&mut self.pool, s);
            let seq = &mut self.sched.running[s.index];
            seq.ext.retries = 0;
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
            let mask = match self.masks.get_mut(k).and_then(Option::take) {
                Some(Ok(mask)) => Some(mask),
                Some(Err(e)) => {
                    failed.push((seq.id, e));
                    continue;
                }
                // A matcher lost to a panic in the mask computation: never sample unguided.
                None if seq.ext.params.guidance.is_some() => {
                    let e = EngineError::Guidance("the token mask computation failed".into());
                    failed.push((seq.id, e));
                    continue;
                }
                None => None,
            };
            let ends = |t: u32| self.eos.contains(&t) || seq.ext.params.stop_token_ids.contains(&t);
            let out = if on_device {
                let token = self.device_tokens[row - 1];
                // The device applied the mask; a token outside it is a backend fault, and the
                // request fails rather than leave its constraint.
                if mask
                    .as_ref()
                    .is_some_and(|m| !m.allows(token) && !ends(token))
                {
                    let e = EngineError::Guidance(format!(
                        "the device sampler drew token {token}, which the constraint does not allow"
                    ));
                    failed.push((seq.id, e));
                    continue;
                }
                Sampled {
                    token,
                    logprobs: None,
                }
            } else {
                let logits = &mut self.logits[(row - 1) * self.vocab..row * self.vocab];
                if let Some(mask) = &mask {
                    mask.apply(logits, &seq.ext.params.stop_token_ids, &self.eos);
                }
                let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
                let mut out =
                    self.sampler
                        .sample(logits, &seq.ext.params, prompt, output, &mut seq.ext.rng);
                if let Some(mask) = &mask {
                    // A draw can land on a zero-probability token through float rounding; the
                    // constraint wins over the draw.
                    if !mask.allows(out.token) && !ends(out.token) {
                        out.token = argmax(logits);
                    }
                }
                out
            };
            if let Some(guide) = seq.ext.guide.as_mut() {
                if !ends(out.token) {
                    if let Err(e) = guide.consume(&[out.token]) {
                        failed.push((seq.id, e));
                        continue;
                    }
                }
            }
            seq.tokens.push(out.token);
            self.emit(s.index, out.token, out.logprobs);
        }
        self.reap();
        for (id, e) in failed {
            if let Some(seq) = self.sched.running.iter().find(|s| s.id == id) {
                seq.ext
                    .span
                    .in_scope(|| tracing::warn!(id, error = %e, "guided request failed"));
            }
            self.fail(id, e);
        }
        self.counters.step_seconds_total += started.elapsed().as_secs_f64();
        self.publish();
        true
    }

    /// Reacts to a step the backend failed, by the failure's kind (ARCHITECTURE.md, "What the engine
    /// does with a backend failure"). None of the step's results were applied: its sequences are as
    /// they were before it, so one that runs again recomputes the same positions and draws the same
    /// tokens.
    fn step_failed(&mut self, e: BackendError) {
        let ids: Vec<RequestId> = self
            .sched
            .scheduled()
            .iter()
            .map(|s| self.sched.running[s.index].id)
            .collect();
        let kind = e.kind();
        let named = match &e {
            BackendError::Request { seqs, .. } => {
                seqs.iter().filter_map(|&k| ids.get(k).copied()).collect()
            }
            _ => Vec::new(),
        };
        let e = Arc::new(e);
        let failed: Vec<RequestId> = match kind {
            BackendErrorKind::Retryable => {
                tracing::warn!(error = %e, "step failed for a passing reason; its requests run again");
                self.sched
                    .running
                    .iter_mut()
                    .filter(|s| ids.contains(&s.id))
                    .filter_map(|s| {
                        s.ext.retries += 1;
                        (s.ext.retries > MAX_STEP_RETRIES).then_some(s.id)
                    })
                    .collect()
            }
            BackendErrorKind::Request => {
                tracing::warn!(error = %e, "step failed on its input; failing the requests at fault");
                // A backend that cannot tell which request was at fault names none: all of them were.
                if named.is_empty() {
                    ids
                } else {
                    named
                }
            }
            BackendErrorKind::WorkerLost | BackendErrorKind::Fatal => {
                self.halt(e);
                return;
            }
        };
        for id in failed {
            self.fail(id, EngineError::Backend(e.clone()));
        }
        self.publish();
    }

    /// Takes the matchers of this step's guided sampling rows and starts computing their masks on
    /// the rayon pool, so they are ready when the logits are.
    fn start_masks(&mut self) -> Option<StepMasking> {
        let mut jobs = Vec::new();
        for k in 0..self.sched.scheduled().len() {
            let s = self.sched.scheduled()[k];
            if !s.sample {
                continue;
            }
            if let Some(guide) = self.sched.running[s.index].ext.guide.take() {
                jobs.push((k, guide));
            }
        }
        (!jobs.is_empty()).then(|| StepMasking::start(jobs))
    }

    /// Waits for the masks `start_masks` began (unless the backend already did) and gives the
    /// matchers back to their sequences.
    fn join_masks(&mut self, masking: Option<StepMasking>) {
        self.masks.clear();
        let Some(masking) = masking else {
            return;
        };
        self.masks
            .resize_with(self.sched.scheduled().len(), || None);
        for (k, guide, mask) in masking.into_results() {
            let s = self.sched.scheduled()[k];
            self.sched.running[s.index].ext.guide = Some(guide);
            self.masks[k] = Some(mask);
        }
    }

    /// Runs the step's model pass: through the backend's own sampler when it has one and every
    /// logits row is a draw it can make (no penalties, logprobs or prompt scoring), so the logits
    /// stay where they are (`Ok(true)`, tokens in `device_tokens`); else `forward`, with the logits
    /// in `logits` for the host sampler (`Ok(false)`).
    /// A step with guided rows (`masking`) goes to the backend's sampler only if it applies masks.
    fn forward(&mut self, masking: Option<&mut StepMasking>) -> Result<bool, BackendError> {
        let offer = match masking {
            Some(_) => self.device_sampler && self.device_masks,
            None => self.device_sampler,
        };
        if offer && self.fill_device_rows() {
            let drawn = match masking {
                Some(masking) => {
                    let mut packing = DevicePacking {
                        masking,
                        guided: &self.device_guided,
                        sched: &self.sched,
                        eos: &self.eos,
                        vocab: self.vocab,
                        rows: self.device_rows.len(),
                        out: &mut self.packed_masks,
                    };
                    let drawn = self.backend.forward_sampled(SampledStep {
                        batch: &self.batch,
                        rows: &self.device_rows,
                        masks: Some(&mut packing),
                        out: &mut self.device_tokens,
                    })?;
                    self.device_masks &= drawn;
                    drawn
                }
                None => {
                    let drawn = self.backend.forward_sampled(SampledStep {
                        batch: &self.batch,
                        rows: &self.device_rows,
                        masks: None,
                        out: &mut self.device_tokens,
                    })?;
                    self.device_sampler &= drawn;
                    drawn
                }
            };
            if drawn {
                return Ok(true);
            }
        }
        self.backend.forward(&self.batch, &mut self.logits)?;
        Ok(false)
    }

    /// Fills `device_rows` with one draw per logits row of the step; false when some row needs the
    /// host sampler.
    fn fill_device_rows(&mut self) -> bool {
        self.device_rows.clear();
        self.device_guided.clear();
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
            if p.guidance.is_some() {
                self.device_guided.push((k, self.device_rows.len()));
            }
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
    pub(crate) fn emit(
        &mut self,
        idx: usize,
        token: u32,
        logprobs: Option<crate::types::TokenLogprobs>,
    ) {
        let seq = &self.sched.running[idx];
        let p = &seq.ext.params;
        self.counters.generation_tokens_total += 1;
        // A complete grammar allows only EOS next, which ends the request even under `ignore_eos`
        // (the constraint's answer is complete). Ending on the grammar's last text token instead
        // would make it look like a stop token, whose text callers drop.
        let grammar_done = seq.ext.guide.as_ref().is_some_and(Guide::is_stopped);
        let is_eos = self.eos.contains(&token);
        let finish = if (!p.ignore_eos && is_eos)
            || p.stop_token_ids.contains(&token)
            || (grammar_done && is_eos)
        {
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
    pub(crate) fn reap(&mut self) {
        if self.finished.is_empty() {
            return;
        }
        self.finished.sort_unstable();
        self.finished.dedup();
        while let Some(idx) = self.finished.pop() {
            let mut seq = self.sched.running.remove(idx);
            self.counters.requests_finished_total += 1;
            seq.ext.span.in_scope(|| {
                tracing::debug!(
                    id = seq.id,
                    prompt_tokens = seq.prompt_len,
                    output_tokens = seq.output().len(),
                    "request finished on the engine"
                );
            });
            if let RequestMode::PrefillOnly { pin_timeout } = seq.ext.mode {
                // The KV stays for export even if the client is gone; its Abort (if any) or the
                // deadline frees it.
                let table = std::mem::take(&mut seq.table);
                let pin = Pin {
                    table,
                    num_tokens: seq.prompt_len,
                    first_token: seq.tokens[seq.prompt_len],
                    deadline: Instant::now() + pin_timeout,
                    span: seq.ext.span.clone(),
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
        self.backend.moe_expert_tokens(&mut c.moe_expert_tokens);
        if let Some(tiers) = &self.tiers {
            c.kv_tiers = tiers.stats();
            c.kv_restore_seconds.clone_from(&tiers.restore_seconds);
        }
        self.shared.stats.lock().clone_from(c);
    }
}
