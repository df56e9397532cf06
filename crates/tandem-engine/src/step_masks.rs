//! One step's guided-decoding masks: computed on the rayon pool while the model runs, then read by
//! the host sampler or packed for a backend that masks its logits on the device.

use crate::backend::{BackendError, DeviceMasks, MaskSource};
use crate::error::EngineError;
use crate::guide::{Guide, Mask};
use crate::scheduler::Scheduler;
use crate::worker::Ext;
use crossbeam_channel::Receiver;

/// A guided row's matcher and the mask computed for it, by index into the step's scheduled list.
pub(crate) type MaskJob = (usize, Guide, Result<Mask, EngineError>);

/// The masks of one step, in flight until first waited for.
pub(crate) struct StepMasking {
    rx: Option<Receiver<Vec<MaskJob>>>,
    done: Vec<MaskJob>,
}

impl StepMasking {
    /// Starts computing the masks of `jobs` (scheduled index, matcher) on the rayon pool.
    pub(crate) fn start(jobs: Vec<(usize, Guide)>) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        rayon::spawn(move || {
            use rayon::prelude::*;
            let done: Vec<MaskJob> = jobs
                .into_par_iter()
                .map(|(k, mut guide)| {
                    let mask = guide.mask();
                    (k, guide, mask)
                })
                .collect();
            let _ = tx.send(done);
        });
        StepMasking {
            rx: Some(rx),
            done: Vec::new(),
        }
    }

    /// The computed masks in scheduled order, waiting for them the first time. A computation lost
    /// to a panic yields none: its rows' requests fail for want of a mask, never run unguided.
    fn results(&mut self) -> &[MaskJob] {
        if let Some(rx) = self.rx.take() {
            self.done = rx.recv().unwrap_or_default();
        }
        &self.done
    }

    /// The computed masks with their matchers, to give back to the sequences.
    pub(crate) fn into_results(mut self) -> Vec<MaskJob> {
        self.results();
        self.done
    }
}

/// Packs a step's masks for the backend's device sampler when it asks for them (after queueing the
/// model work), so the host computes them while the device runs.
pub(crate) struct DevicePacking<'a> {
    /// The step's masks in flight.
    pub(crate) masking: &'a mut StepMasking,
    /// (scheduled index, logits row) of each guided sampling row, in scheduled order.
    pub(crate) guided: &'a [(usize, usize)],
    /// The scheduler, for each row's stop tokens.
    pub(crate) sched: &'a Scheduler<Ext>,
    pub(crate) eos: &'a [u32],
    /// Width of a logits row.
    pub(crate) vocab: usize,
    /// Logits rows of the step.
    pub(crate) rows: usize,
    /// Where the packed masks go (a reused buffer).
    pub(crate) out: &'a mut DeviceMasks,
}

impl MaskSource for DevicePacking<'_> {
    fn wait(&mut self) -> Result<&DeviceMasks, BackendError> {
        let words = self.vocab.div_ceil(32);
        let out = &mut *self.out;
        out.words = words;
        out.bits.clear();
        out.row_mask.clear();
        out.row_mask.resize(self.rows, -1);
        for (k, _, mask) in self.masking.results() {
            let (Ok(mask), Ok(at)) = (mask, self.guided.binary_search_by_key(k, |g| g.0)) else {
                continue;
            };
            let row = self.guided[at].1;
            let index = out.bits.len() / words;
            out.bits.resize(out.bits.len() + words, 0);
            let seq = &self.sched.running[self.sched.scheduled()[*k].index];
            mask.pack(
                &mut out.bits[index * words..],
                &seq.ext.params.stop_token_ids,
                self.eos,
            );
            out.row_mask[row] = i32::try_from(index)
                .map_err(|_| BackendError::fatal("more guided rows than a device index holds"))?;
        }
        Ok(out)
    }
}
