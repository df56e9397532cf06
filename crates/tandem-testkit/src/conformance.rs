//! The [`Backend`] contract as checks that any backend runs (the mock, CPU, CUDA, a CPU pipeline), so a
//! backend's tests state what it promises once instead of each restating part of it.
//!
//! Every check takes `make`, which builds a fresh backend (an empty cache of at least
//! [`MIN_BLOCKS`] blocks) each time it is called: checks that move KV need two. `tolerance` is the
//! largest absolute logit difference allowed where the same tokens are computed in differently shaped
//! steps (a prompt in one step or in chunks, a sequence continued on another backend): 0 for a backend
//! whose logits are bit-exact under those reshapes, a bf16 backend's rounding otherwise. Each check also
//! asserts that the logits of different inputs differ by more than that, so no tolerance passes a
//! backend whose logits ignore their input. Repeating a step is always held to bit-exactness.

use std::panic::{catch_unwind, AssertUnwindSafe};

use tandem_engine::sampler::argmax;
use tandem_engine::{Backend, DeviceSampling, LayerBlocks, SampledStep};
use tandem_model::{ForwardBatch, LogitsWanted};

/// The fewest KV blocks a backend under the checks must have.
pub const MIN_BLOCKS: usize = 24;

/// Runs every check of this module on backends built by `make`.
pub fn run<B: Backend>(mut make: impl FnMut() -> B, tolerance: f32) {
    forward_shape_and_determinism(&mut make);
    chunked_prefill_matches_one_step(&mut make, tolerance);
    kv_moves_to_another_backend(&mut make, tolerance);
    copy_block_copies_every_layer(&mut make, tolerance);
    bulk_kv_paths_match_per_block(&mut make);
    forward_sampled_greedy_is_argmax(&mut make);
    bad_blocks_and_buffers_are_errors(&mut make);
}

/// The shape a check lays its sequences out in: prompt length and blocks per sequence.
struct Plan {
    bs: usize,
    prompt_len: usize,
    blocks_per_seq: usize,
}

impl Plan {
    /// A prompt over two whole blocks and part of a third, with room for a few decoded tokens.
    fn of<B: Backend>(b: &B) -> Plan {
        let l = b.kv_layout();
        assert!(
            l.num_blocks >= MIN_BLOCKS,
            "the conformance checks need {MIN_BLOCKS} KV blocks, the backend has {}",
            l.num_blocks
        );
        let prompt_len = 2 * l.block_size + 3;
        Plan {
            bs: l.block_size,
            prompt_len,
            blocks_per_seq: (prompt_len + 2).div_ceil(l.block_size),
        }
    }

    /// Block table `i` of disjoint ones, in descending block order so that a sequence's blocks are
    /// neither contiguous nor ascending.
    fn table(&self, i: usize) -> Vec<u32> {
        let start = i * self.blocks_per_seq;
        (start..start + self.blocks_per_seq)
            .rev()
            .map(|b| b as u32)
            .collect()
    }
}

/// A prompt of `len` token ids below `vocab`, different for each `salt`.
fn prompt(vocab: usize, len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729 + 11) % vocab) as u32)
        .collect()
}

/// A token other than `t`, for a step whose logits must differ from `t`'s.
fn other_token(t: u32, vocab: usize) -> u32 {
    ((t as usize + 1) % vocab) as u32
}

/// Largest absolute difference between two logits slices of equal length (infinite where either is
/// not finite, so NaN never passes).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logits of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_finite() && y.is_finite() {
                (x - y).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

/// Asserts that `got` is within `tolerance` of `want`, and that `other` (the logits of a different
/// input) is not, so the tolerance cannot hide logits that ignore their input.
fn assert_close(what: &str, want: &[f32], got: &[f32], other: &[f32], tolerance: f32) {
    let d = max_diff(want, got);
    assert!(
        d <= tolerance,
        "{what}: logits differ by {d} (tolerance {tolerance})"
    );
    let apart = max_diff(want, other);
    assert!(
        apart.is_finite() && apart > 4.0 * tolerance,
        "{what}: the logits of a different input are only {apart} away (tolerance {tolerance}): the check could not fail"
    );
}

/// Runs `batch` on `b`, returning its logits.
fn step<B: Backend>(b: &mut B, batch: &ForwardBatch) -> Vec<f32> {
    // Stale contents, which forward must clear.
    let mut logits = vec![f32::NAN; 3];
    b.forward(batch, &mut logits).expect("forward");
    logits
}

/// Prefills `p` over `table` in one step and returns its last logits row.
fn prefill<B: Backend>(b: &mut B, p: &[u32], table: &[u32]) -> Vec<f32> {
    let mut batch = ForwardBatch::default();
    batch.push(p, 0, table.to_vec(), LogitsWanted::Last);
    step(b, &batch)
}

/// Feeds `token` at `pos` of the sequence over `table` and returns its logits row.
fn decode<B: Backend>(b: &mut B, token: u32, pos: usize, table: &[u32]) -> Vec<f32> {
    let mut batch = ForwardBatch::default();
    batch.push(&[token], pos, table.to_vec(), LogitsWanted::Last);
    step(b, &batch)
}

/// `forward` returns exactly `batch.logits_rows()` finite rows of `vocab_size`, which depend on the
/// input, and the same step gives the same bits again (on the same backend and on a fresh one).
pub fn forward_shape_and_determinism<B: Backend>(mut make: impl FnMut() -> B) {
    let mut b = make();
    let plan = Plan::of(&b);
    let v = b.vocab_size();
    let (p0, p1, p2) = (
        prompt(v, plan.prompt_len, 0),
        prompt(v, plan.bs + 1, 1),
        prompt(v, 3, 2),
    );
    let mut batch = ForwardBatch::default();
    batch.push(&p0, 0, plan.table(0), LogitsWanted::All);
    batch.push(&p1, 0, plan.table(1), LogitsWanted::Last);
    batch.push(&p2, 0, plan.table(2), LogitsWanted::None);
    let logits = step(&mut b, &batch);
    assert_eq!(batch.logits_rows(), plan.prompt_len + 1);
    assert_eq!(
        logits.len(),
        batch.logits_rows() * v,
        "forward returns logits_rows() rows of vocab_size"
    );
    assert!(
        logits.iter().all(|x| x.is_finite()),
        "forward returns finite logits"
    );
    let rows: Vec<&[f32]> = logits.chunks(v).collect();
    assert!(
        max_diff(rows[plan.prompt_len - 1], rows[plan.prompt_len]) > 0.0,
        "two prompts' last rows are equal: the logits ignore the input"
    );
    assert!(
        max_diff(rows[0], rows[1]) > 0.0,
        "two positions' rows are equal: the logits ignore the input"
    );
    let again = step(&mut b, &batch);
    assert!(
        again == logits,
        "the same step repeated on the same cache gives other logits (max diff {})",
        max_diff(&again, &logits)
    );
    let fresh = step(&mut make(), &batch);
    assert!(
        fresh == logits,
        "the same step on a fresh backend gives other logits (max diff {})",
        max_diff(&fresh, &logits)
    );
}

/// A prompt prefilled in one step and in chunks (cut inside blocks, over another block table) gives
/// the same last logits, and so does the next decode step.
pub fn chunked_prefill_matches_one_step<B: Backend>(mut make: impl FnMut() -> B, tolerance: f32) {
    let mut b = make();
    let plan = Plan::of(&b);
    let v = b.vocab_size();
    let p = prompt(v, plan.prompt_len, 3);
    let n = p.len();
    let (whole_t, chunked_t) = (plan.table(0), plan.table(1));
    let whole = prefill(&mut b, &p, &whole_t);
    // Chunks of bs-1, bs+2 and the rest: no boundary on a block's edge.
    let cuts = [0, plan.bs - 1, 2 * plan.bs + 1, n];
    let mut chunked = Vec::new();
    for w in cuts.windows(2) {
        let mut batch = ForwardBatch::default();
        let last = w[1] == n;
        let wanted = if last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        batch.push(&p[w[0]..w[1]], w[0], chunked_t.clone(), wanted);
        chunked = step(&mut b, &batch);
        assert_eq!(chunked.len(), usize::from(last) * v, "rows of chunk {w:?}");
    }
    let other = prefill(&mut b, &prompt(v, n, 4), &plan.table(2));
    assert_close(
        "chunked prefill against one step",
        &whole,
        &chunked,
        &other,
        tolerance,
    );
    let t = argmax(&whole);
    let next_whole = decode(&mut b, t, n, &whole_t);
    let next_chunked = decode(&mut b, t, n, &chunked_t);
    let next_other = decode(&mut b, t, n, &plan.table(2));
    assert_close(
        "the decode step after a chunked prefill",
        &next_whole,
        &next_chunked,
        &next_other,
        tolerance,
    );
}

/// Every layer of a prefilled sequence's blocks, moved by `export_block`/`import_block` into other
/// blocks of a second backend, lets the second continue the sequence as the first does.
pub fn kv_moves_to_another_backend<B: Backend>(mut make: impl FnMut() -> B, tolerance: f32) {
    let mut a = make();
    let plan = Plan::of(&a);
    let v = a.vocab_size();
    let layout = a.kv_layout();
    let p = prompt(v, plan.prompt_len, 5);
    let (from, to) = (plan.table(0), plan.table(3));
    let first = prefill(&mut a, &p, &from);
    let t = argmax(&first);
    let mut b = make();
    let mut buf = vec![0u8; layout.block_bytes()];
    for layer in 0..layout.n_layers {
        for (&src, &dst) in from.iter().zip(&to) {
            a.export_block(layer, src, &mut buf).expect("export_block");
            b.import_block(layer, dst, &buf).expect("import_block");
        }
    }
    let want = decode(&mut a, t, p.len(), &from);
    let got = decode(&mut b, t, p.len(), &to);
    let other = decode(&mut a, other_token(t, v), p.len(), &from);
    assert_close(
        "a sequence continued on the backend its KV was imported into",
        &want,
        &got,
        &other,
        tolerance,
    );
}

/// `copy_block` copies a block in every layer: the copy exports the same bytes, and a sequence whose
/// table names the copy continues as over the original.
pub fn copy_block_copies_every_layer<B: Backend>(mut make: impl FnMut() -> B, tolerance: f32) {
    let mut b = make();
    let plan = Plan::of(&b);
    let v = b.vocab_size();
    let layout = b.kv_layout();
    let p = prompt(v, plan.prompt_len, 6);
    let table = plan.table(0);
    let logits = prefill(&mut b, &p, &table);
    let t = argmax(&logits);
    // The prompt's first block (whole and written) copied into a block of another table.
    let (src, dst) = (table[0], plan.table(2)[0]);
    let (mut s, mut d) = (
        vec![0u8; layout.block_bytes()],
        vec![0u8; layout.block_bytes()],
    );
    b.export_block(0, src, &mut s).expect("export_block");
    b.export_block(0, dst, &mut d).expect("export_block");
    assert!(
        s != d,
        "the source block equals the unwritten destination before the copy"
    );
    b.copy_block(src, dst).expect("copy_block");
    for layer in 0..layout.n_layers {
        b.export_block(layer, src, &mut s).expect("export_block");
        b.export_block(layer, dst, &mut d).expect("export_block");
        assert!(s == d, "layer {layer}: the copy differs from its source");
    }
    let mut copied = table.clone();
    copied[0] = dst;
    let want = decode(&mut b, t, p.len(), &table);
    let got = decode(&mut b, t, p.len(), &copied);
    let other = decode(&mut b, other_token(t, v), p.len(), &table);
    assert_close(
        "a sequence over a copied block",
        &want,
        &got,
        &other,
        tolerance,
    );
}

/// `export_kv` holds, per layer, exactly the bytes `export_block` gives block by block, and
/// `import_kv` (then `import_fence`) writes what `import_block` would.
pub fn bulk_kv_paths_match_per_block<B: Backend>(mut make: impl FnMut() -> B) {
    let mut a = make();
    let plan = Plan::of(&a);
    let v = a.vocab_size();
    let layout = a.kv_layout();
    let n = layout.block_bytes();
    let p = prompt(v, plan.prompt_len, 7);
    let table = plan.table(0);
    prefill(&mut a, &p, &table);
    // A block twice, as a shared prefix block may be.
    let blocks = [table[1], table[0], table[1]];
    let bulk = a.export_kv(&blocks).expect("export_kv");
    assert_eq!(bulk.num_layers(), layout.n_layers);
    let mut one = vec![0u8; n];
    let mut b = make();
    let moved = [plan.table(2)[0], plan.table(2)[1], plan.table(3)[0]];
    for layer in 0..layout.n_layers {
        let got = bulk.layer(layer).expect("export_kv layer");
        assert_eq!(got.len(), blocks.len() * n, "layer {layer}: bytes");
        for (i, &blk) in blocks.iter().enumerate() {
            a.export_block(layer, blk, &mut one).expect("export_block");
            assert!(
                got[i * n..(i + 1) * n] == one[..],
                "layer {layer} block {blk}: export_kv differs from export_block"
            );
        }
        let mut data = b.host_pool().take(got.len()).expect("host buffer");
        data.as_mut_slice().copy_from_slice(got);
        b.import_kv(LayerBlocks::new(layer, &moved), data)
            .expect("import_kv");
    }
    b.import_fence().expect("import_fence");
    let mut back = vec![0u8; n];
    for layer in 0..layout.n_layers {
        for (&src, &dst) in blocks.iter().zip(&moved) {
            a.export_block(layer, src, &mut one).expect("export_block");
            b.export_block(layer, dst, &mut back).expect("export_block");
            assert!(
                one == back,
                "layer {layer}: import_kv into block {dst} differs from block {src}"
            );
        }
    }
    assert!(
        one.iter().any(|&x| x != 0),
        "the exported KV is all zeros: the prefill wrote nothing"
    );
}

/// Where a backend samples itself, `forward_sampled`'s greedy draws are the argmax of the logits
/// `forward` gives for the same step; a backend without a sampler says so (`Ok(false)`).
pub fn forward_sampled_greedy_is_argmax<B: Backend>(mut make: impl FnMut() -> B) {
    let mut a = make();
    let plan = Plan::of(&a);
    let v = a.vocab_size();
    let mut batch = ForwardBatch::default();
    for s in 0..3 {
        batch.push(
            &prompt(v, plan.prompt_len - s, 8 + s),
            0,
            plan.table(s),
            LogitsWanted::Last,
        );
    }
    let rows = vec![
        DeviceSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        };
        3
    ];
    let mut drawn = Vec::new();
    if !a
        .forward_sampled(SampledStep {
            batch: &batch,
            rows: &rows,
            masks: None,
            out: &mut drawn,
        })
        .expect("forward_sampled")
    {
        eprintln!(
            "conformance: this backend has no sampler of its own; forward_sampled not checked"
        );
        return;
    }
    let logits = step(&mut make(), &batch);
    let want: Vec<u32> = logits.chunks(v).map(argmax).collect();
    assert_eq!(
        drawn, want,
        "greedy draws of forward_sampled against the argmax of forward"
    );
}

/// Calls `f`, asserting that it returns an error rather than succeeding or panicking.
fn assert_refused<T>(what: &str, f: impl FnOnce() -> Result<T, tandem_engine::BackendError>) {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Err(_)) => {}
        Ok(Ok(_)) => panic!("{what}: accepted"),
        Err(_) => panic!("{what}: panicked instead of returning an error"),
    }
}

/// A block index outside the cache, a layer outside the model and a buffer that is not one block are
/// errors, not panics, and leave the backend serving as before.
pub fn bad_blocks_and_buffers_are_errors<B: Backend>(mut make: impl FnMut() -> B) {
    let mut b = make();
    let plan = Plan::of(&b);
    let v = b.vocab_size();
    let layout = b.kv_layout();
    let n = layout.block_bytes();
    let p = prompt(v, plan.prompt_len, 11);
    let table = plan.table(0);
    let before = prefill(&mut b, &p, &table);
    let past = layout.num_blocks as u32;
    let mut buf = vec![0u8; n];
    assert_refused("export_block of a block past the cache", || {
        b.export_block(0, past, &mut buf)
    });
    assert_refused("export_block of a layer past the model", || {
        b.export_block(layout.n_layers, 0, &mut buf)
    });
    assert_refused("export_block into a short buffer", || {
        b.export_block(0, 0, &mut buf[..n - 1])
    });
    let mut long = vec![0u8; n + 1];
    assert_refused("export_block into a long buffer", || {
        b.export_block(0, 0, &mut long)
    });
    let data = vec![0u8; n];
    assert_refused("import_block of a block past the cache", || {
        b.import_block(0, past, &data)
    });
    assert_refused("import_block of a layer past the model", || {
        b.import_block(layout.n_layers, 0, &data)
    });
    assert_refused("import_block of a short buffer", || {
        b.import_block(0, table[0], &data[..n - 1])
    });
    assert_refused("copy_block from a block past the cache", || {
        b.copy_block(past, table[0])
    });
    assert_refused("copy_block to a block past the cache", || {
        b.copy_block(table[0], past)
    });
    let again = prefill(&mut b, &p, &table);
    assert!(
        again == before,
        "after the refused calls the same prefill gives other logits (max diff {})",
        max_diff(&again, &before)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MockBackend;

    #[test]
    fn the_mock_conforms() {
        run(|| MockBackend::new(3, MIN_BLOCKS), 0.0);
        run(|| MockBackend::new(4, 40).with_device_sampling(), 0.0);
    }
}
