//! A tiny deterministic [`Backend`] for tests of the engine and of crates built on it (no model file needed).
//!
//! Each token writes its id and position into the KV cache through the block table; the logits of a
//! position are a hash of every K entry of the sequence read back through the block table. So the
//! next token depends on the whole prefix exactly as stored in the cache: a paging, prefix-cache,
//! preemption or KV-transfer bug changes the tokens (and a misplaced position is reported as an error).
//!
//! Options make it stand for other backends: a sampler of its own that applies the engine's masks (or,
//! faulty, ignores them), slow steps, an injected failure; [`MockCounts`] tell a test which path the
//! engine took.

use std::hash::Hasher;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_engine::prefix_cache::FxHasher;
use tandem_engine::{
    Backend, BackendError, BackendErrorKind, BackendInfo, DeviceMasks, DeviceSampling, GuideEnv,
    SampledStep,
};
use tandem_model::{ForwardBatch, KvDtype, KvLayout, LogitsWanted, TokenPiece};

const LAYERS: usize = 2;
const HEAD_DIM: usize = 2;

/// The text of the mock's 63 ordinary tokens (id = index; id 63 is EOS): the characters of JSON and of
/// simple regexes, and a few multi-character pieces so that a constraint has to reason over tokens
/// that span several grammar symbols, as a real BPE vocabulary makes it.
pub const MOCK_PIECES: [&str; 63] = [
    "{", "}", "[", "]", "\"", ":", ",", "-", ".", " ", "0", "1", "2", "3", "4", "5", "6", "7", "8",
    "9", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r",
    "s", "t", "u", "v", "w", "x", "y", "z", "true", "false", "null", "{\"", "\":", ",\"", "\"}",
    "name", "age", "ab", "12", "\"a\"", "]}", "[1", "x\"", "\n", "\\",
];

/// The mock's vocabulary as bytes (EOS as the special `</s>`), for guided decoding on the mock.
pub fn mock_pieces() -> Vec<TokenPiece> {
    let mut pieces: Vec<TokenPiece> = MOCK_PIECES
        .iter()
        .map(|p| TokenPiece {
            bytes: p.as_bytes().to_vec(),
            special: false,
        })
        .collect();
    pieces.push(TokenPiece {
        bytes: b"</s>".to_vec(),
        special: true,
    });
    pieces
}

/// The guided-decoding environment of [`MockBackend`]'s vocabulary.
pub fn mock_guide() -> Arc<GuideEnv> {
    GuideEnv::new(&mock_pieces(), &[63], 64).expect("the mock vocabulary builds a token trie")
}

/// The text of mock tokens (EOS and unknown ids as nothing), to check guided output.
pub fn mock_text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .filter_map(|&t| MOCK_PIECES.get(t as usize))
        .copied()
        .collect()
}

/// The mock model and its paged cache.
#[derive(Debug, Clone)]
pub struct MockBackend {
    info: BackendInfo,
    kv: Vec<Vec<f32>>,
    /// Forward calls `steps.0..steps.1` (0-based) fail with an error of this kind.
    fail: Option<(BackendErrorKind, (u64, u64))>,
    step_delay: Duration,
    steps: u64,
    /// How the mock draws tokens itself; `None`: it has no sampler and the engine samples on the host.
    device: Option<DeviceDraw>,
    /// The logits of a step the mock samples itself, reused.
    sampled: Vec<f32>,
    /// Shared with clones and with the test that handed the mock to an engine.
    counts: Arc<MockCounts>,
}

/// How a [`MockBackend`] with its own sampler (as a GPU backend has) treats the engine's masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceDraw {
    /// Draws only tokens the step's masks allow, as a correct device does.
    Masked,
    /// Draws as if no row had a mask: a faulty device, for tests of the engine's check of its draws.
    IgnoringMasks,
}

/// What the engine asked of a [`MockBackend`], counted where the test can read it after the engine took
/// the mock (see [`MockBackend::counts`]).
#[derive(Debug, Default)]
pub struct MockCounts {
    /// Steps run through `forward`, whose logits the engine's host sampler reads.
    pub host_steps: AtomicUsize,
    /// Steps whose tokens the mock drew itself (`forward_sampled`, with or without masks).
    pub device_steps: AtomicUsize,
    /// Logits rows that came with a mask in the steps the mock drew itself.
    pub device_guided_rows: AtomicUsize,
}

impl MockBackend {
    /// A mock with `num_blocks` blocks of `block_size` tokens, a vocab of 64 and EOS = 63.
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        let layout = KvLayout {
            n_layers: LAYERS,
            n_kv_heads: 1,
            head_dim: HEAD_DIM,
            block_size,
            num_blocks,
            dtype: KvDtype::F32,
        };
        Self {
            info: BackendInfo {
                layout,
                vocab: 64,
                max_len: 4096,
                eos: vec![63],
                windows: vec![None; LAYERS],
            },
            kv: vec![vec![0.0; layout.block_elems() * num_blocks]; LAYERS],
            fail: None,
            step_delay: Duration::ZERO,
            steps: 0,
            device: None,
            sampled: Vec::new(),
            counts: Arc::default(),
        }
    }

    /// Makes the first layer attend through a sliding window of `window` positions, as a Gemma 3 local
    /// layer: its forward reads (and checks) only the positions the window reaches.
    pub fn with_window(mut self, window: usize) -> Self {
        self.info.windows[0] = Some(window);
        self
    }

    /// Sets the context length the mock reports.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.info.max_len = max_len;
        self
    }

    /// Makes the `step`-th forward call (0-based) fail as the fault of the step's first request, to
    /// test error handling (`fail_steps(step..=step, BackendErrorKind::Request)`).
    pub fn fail_at_step(self, step: u64) -> Self {
        self.fail_steps(step..=step, BackendErrorKind::Request)
    }

    /// Makes the forward calls numbered `steps` (0-based; `2..` fails every call from the third on)
    /// fail with an error of `kind`, to test the engine's reaction to it. A `Request` failure names
    /// the step's first sequence as the one at fault.
    pub fn fail_steps(mut self, steps: impl RangeBounds<u64>, kind: BackendErrorKind) -> Self {
        let start = match steps.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s + 1,
            Bound::Unbounded => 0,
        };
        let end = match steps.end_bound() {
            Bound::Included(&e) => e + 1,
            Bound::Excluded(&e) => e,
            Bound::Unbounded => u64::MAX,
        };
        self.fail = Some((kind, (start, end)));
        self
    }

    /// Makes every forward call take at least `delay`, so tests can act while requests are running.
    pub fn with_step_delay(mut self, delay: Duration) -> Self {
        self.step_delay = delay;
        self
    }

    /// Gives the mock a sampler of its own, as a GPU backend has: `forward_sampled` draws greedy rows
    /// by argmax of the mock's logits (so they equal the host sampler's) and other rows by a pure
    /// function of the draw's seed (so a token shows which seed the engine passed), and a step with
    /// masks draws only tokens they allow.
    pub fn with_device_sampling(mut self) -> Self {
        self.device = Some(DeviceDraw::Masked);
        self
    }

    /// Like [`MockBackend::with_device_sampling`], but draws as if no row had a mask: a faulty device,
    /// for tests that the engine checks a device's draws against the constraint.
    pub fn with_device_sampling_ignoring_masks(mut self) -> Self {
        self.device = Some(DeviceDraw::IgnoringMasks);
        self
    }

    /// The counters of what the engine asked of this mock (shared with its clones).
    pub fn counts(&self) -> Arc<MockCounts> {
        self.counts.clone()
    }

    fn slot(&self, block: u32, slot: usize, v: bool) -> usize {
        let bs = self.info.layout.block_size;
        block as usize * self.info.layout.block_elems()
            + usize::from(v) * bs * HEAD_DIM
            + slot * HEAD_DIM
    }

    /// A step of a mock with its own sampler, its logits kept in `sampled` for the draw: `Ok(false)`,
    /// doing nothing, when the mock has no sampler (the engine then calls `forward`).
    fn device_step(&mut self, batch: &ForwardBatch) -> Result<bool, BackendError> {
        if self.device.is_none() {
            return Ok(false);
        }
        self.counts.device_steps.fetch_add(1, Ordering::Relaxed);
        let mut logits = std::mem::take(&mut self.sampled);
        let stepped = self.step(batch, &mut logits);
        self.sampled = logits;
        stepped.map(|()| true)
    }

    /// One model step: writes the batch's K/V and computes its logits rows.
    fn step(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let step = self.steps;
        self.steps += 1;
        if let Some((kind, (from, to))) = self.fail {
            if (from..to).contains(&step) {
                let message = format!("injected failure at step {step}");
                return Err(match kind {
                    BackendErrorKind::Request => BackendError::request(message, vec![0]),
                    kind => BackendError::new(kind, message),
                });
            }
        }
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        let bs = self.info.layout.block_size;
        for c in &batch.seqs {
            let end = c.pos + c.tokens.len();
            if c.blocks.len() * bs < end {
                return Err(BackendError::fatal(format!(
                    "block table of {} blocks cannot hold {end} tokens",
                    c.blocks.len()
                )));
            }
            for (k, &t) in batch.tokens[c.tokens.clone()].iter().enumerate() {
                let p = c.pos + k;
                let block = c.blocks[p / bs];
                if block as usize >= self.info.layout.num_blocks {
                    return Err(BackendError::fatal(format!("block {block} out of range")));
                }
                for l in 0..LAYERS {
                    let i = self.slot(block, p % bs, false);
                    self.kv[l][i] = t as f32 + l as f32;
                    self.kv[l][i + 1] = p as f32;
                    let j = self.slot(block, p % bs, true);
                    self.kv[l][j] = (t as f32) * 2.0;
                    self.kv[l][j + 1] = l as f32;
                }
            }
        }
        logits.clear();
        for c in &batch.seqs {
            let n = c.tokens.len();
            let rows = match c.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => n - 1..n,
                LogitsWanted::All => 0..n,
            };
            for r in rows {
                let q = c.pos + r;
                let mut h = FxHasher::default();
                for p in 0..=q {
                    let block = c.blocks[p / bs];
                    for l in 0..LAYERS {
                        // A windowed layer reads only the positions its window reaches.
                        if self.info.windows[l].is_some_and(|w| p + w <= q) {
                            continue;
                        }
                        let i = self.slot(block, p % bs, false);
                        let (k0, k1) = (self.kv[l][i], self.kv[l][i + 1]);
                        if k1 != p as f32
                            || k0 - l as f32 != self.kv[l][self.slot(block, p % bs, true)] / 2.0
                        {
                            return Err(BackendError::fatal(format!(
                                "KV of position {p} is corrupt (found position {k1})"
                            )));
                        }
                        h.write_u32(k0.to_bits());
                    }
                }
                let seed = h.finish();
                logits.extend((0..self.info.vocab as u64).map(|v| {
                    let mut x = FxHasher::default();
                    x.write_u64(seed);
                    x.write_u64(v);
                    (x.finish() >> 40) as f32 / (1u64 << 24) as f32 * 8.0
                }));
            }
        }
        Ok(())
    }

    /// The mock sampler's tokens, one per row of the last sampled step's logits (see
    /// [`MockBackend::with_device_sampling`]).
    fn draw(&self, rows: &[DeviceSampling], masks: Option<&DeviceMasks>, out: &mut Vec<u32>) {
        let v = self.info.vocab;
        assert_eq!(rows.len() * v, self.sampled.len(), "one row per logits row");
        out.clear();
        for (i, (r, row)) in rows.iter().zip(self.sampled.chunks(v)).enumerate() {
            let mask = masks
                .and_then(|m| m.row(i))
                .filter(|_| self.device == Some(DeviceDraw::Masked));
            let allowed = |t: &usize| mask.is_none_or(|bits| bits[t / 32] >> (t % 32) & 1 == 1);
            let score = |t: usize| {
                if r.temperature == 0.0 {
                    row[t]
                } else {
                    let h =
                        (r.seed ^ (t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(31);
                    (h >> 40) as f32
                }
            };
            // The first allowed token of highest score, as the host sampler's argmax breaks ties.
            let best = (0..v)
                .filter(allowed)
                .reduce(|b, t| if score(t) > score(b) { t } else { b })
                .expect("a mask allows some token");
            out.push(best as u32);
        }
    }

    /// Refuses a (layer, block) outside the cache or a buffer that is not one block.
    fn check_block(&self, layer: usize, block: u32, len: usize) -> Result<(), BackendError> {
        let l = &self.info.layout;
        if layer >= l.n_layers || block as usize >= l.num_blocks || len != l.block_bytes() {
            return Err(BackendError::fatal(format!(
                "layer {layer} block {block} with {len} bytes: the cache has {} layers of {} blocks of {} bytes",
                l.n_layers,
                l.num_blocks,
                l.block_bytes()
            )));
        }
        Ok(())
    }
}

impl Backend for MockBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.counts.host_steps.fetch_add(1, Ordering::Relaxed);
        self.step(batch, logits)
    }

    fn forward_sampled(&mut self, step: SampledStep) -> Result<bool, BackendError> {
        if !self.device_step(step.batch)? {
            return Ok(false);
        }
        let masks = match step.masks {
            Some(source) => {
                let masks = source.wait()?;
                assert_eq!(
                    masks.row_mask.len(),
                    step.rows.len(),
                    "one entry per logits row"
                );
                let guided = masks.row_mask.iter().filter(|&&m| m >= 0).count();
                self.counts
                    .device_guided_rows
                    .fetch_add(guided, Ordering::Relaxed);
                Some(masks)
            }
            None => None,
        };
        self.draw(step.rows, masks, step.out);
        Ok(true)
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError> {
        self.check_block(layer, block, out.len())?;
        let n = self.info.layout.block_elems();
        let src = &self.kv[layer][block as usize * n..(block as usize + 1) * n];
        for (o, v) in out.chunks_exact_mut(4).zip(src) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError> {
        self.check_block(layer, block, data.len())?;
        let n = self.info.layout.block_elems();
        let dst = &mut self.kv[layer][block as usize * n..(block as usize + 1) * n];
        for (d, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
            *d = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError> {
        let bytes = self.info.layout.block_bytes();
        self.check_block(0, src, bytes)?;
        self.check_block(0, dst, bytes)?;
        let n = self.info.layout.block_elems();
        for layer in &mut self.kv {
            layer.copy_within(src as usize * n..(src as usize + 1) * n, dst as usize * n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_depend_on_cache_contents_not_block_ids() {
        let mut a = MockBackend::new(2, 8);
        let mut b = ForwardBatch::default();
        let mut la = Vec::new();
        b.push(&[5, 6, 7], 0, vec![3, 1], LogitsWanted::Last);
        a.forward(&b, &mut la).unwrap();
        // Same tokens in other blocks, computed in two chunks: same logits.
        let mut lb = Vec::new();
        b.clear();
        b.push(&[5, 6], 0, vec![0, 5], LogitsWanted::None);
        a.forward(&b, &mut lb).unwrap();
        b.clear();
        b.push(&[7], 2, vec![0, 5], LogitsWanted::Last);
        a.forward(&b, &mut lb).unwrap();
        assert_eq!(la, lb);
        // A different prefix gives (almost surely) different logits.
        b.clear();
        b.push(&[4, 6, 7], 0, vec![2, 4], LogitsWanted::Last);
        a.forward(&b, &mut lb).unwrap();
        assert_ne!(la, lb);
        assert!(tandem_engine::sampler::argmax(&la) < 64);
    }

    #[test]
    fn wrong_block_table_is_detected() {
        let mut a = MockBackend::new(2, 8);
        let mut b = ForwardBatch::default();
        let mut l = Vec::new();
        b.push(&[5, 6], 0, vec![3], LogitsWanted::None);
        a.forward(&b, &mut l).unwrap();
        b.clear();
        b.push(&[7], 2, vec![4, 1], LogitsWanted::Last);
        assert!(
            a.forward(&b, &mut l).is_err(),
            "reading unwritten blocks must fail"
        );
        b.clear();
        b.push(&[7, 8, 9], 0, vec![4], LogitsWanted::Last);
        assert!(
            a.forward(&b, &mut l).is_err(),
            "a too-short table must fail"
        );
    }

    #[test]
    fn export_import_round_trips() {
        let mut a = MockBackend::new(2, 4);
        let mut b = ForwardBatch::default();
        let mut l = Vec::new();
        b.push(&[9, 8, 7], 0, vec![2, 0], LogitsWanted::Last);
        a.forward(&b, &mut l).unwrap();
        let mut c = MockBackend::new(2, 4);
        let mut buf = vec![0u8; a.kv_layout().block_bytes()];
        for layer in 0..LAYERS {
            for (src, dst) in [(2, 1), (0, 3)] {
                a.export_block(layer, src, &mut buf).unwrap();
                c.import_block(layer, dst, &buf).unwrap();
            }
        }
        let mut l2 = Vec::new();
        b.clear();
        b.push(&[7], 2, vec![1, 3], LogitsWanted::Last);
        c.forward(&b, &mut l2).unwrap();
        assert_eq!(l, l2);
    }
}
