//! The FP8 KV cache (`kv_dtype: Fp8E4m3`, `kv_cache_dtype: fp8`) against a float32 reference. It
//! needs an NVIDIA GPU, so it skips with a message where the driver is absent; on the GPU machine
//! `scripts/gpu/run.sh kvfp8` runs it (built here with
//! `cargo test --release -p tandem-cuda --test kv_fp8 --no-run`).
//!
//! Every attention kernel reads the codes: the tensor-core prefill (its tiles widened to bf16), the
//! reference kernel, both decode kernels, and the prefill of a chunk over keys an earlier chunk wrote.
//! E4M3 keeps 3 mantissa bits, so an FP8 run sits above the bf16-KV run's distance to the float32
//! reference, but by a small multiple of it: a wrong byte offset, code or plane puts it at O(1). The
//! blocks a P/D transfer moves are the codes themselves: a second instance that imports them decodes
//! exactly what the first does.

mod common;

use common::{compare, format_test_config, format_test_layer, run, uniform, Rows, BLOCK, BLOCKS};
use tandem_cuda::{AttnMode, CudaLlama, CudaOptions, WeightSource};
use tandem_kernels::Matrix;
use tandem_model::{
    CpuLlama, ForwardBatch, KvCache, KvDtype, LlamaWeights, LoadOptions, LogitsWanted, ModelConfig,
};

/// The model of the weight-format tests (one KV head of 128 dims under two query heads) with random
/// weights.
fn wide_model() -> (ModelConfig, LlamaWeights) {
    let c = format_test_config();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut matrix = |rows: usize, cols: usize| {
        let scale = 1.7 / (cols as f32).sqrt();
        let v = (0..rows * cols)
            .map(|_| uniform(&mut seed) * scale)
            .collect();
        Matrix::from_f32(rows, cols, v)
    };
    let (h, f, q, kv) = (256, 512, 256, 128);
    let layers = (0..c.num_layers)
        .map(|_| {
            format_test_layer([
                matrix(q, h),
                matrix(kv, h),
                matrix(kv, h),
                matrix(h, q),
                matrix(f, h),
                matrix(f, h),
                matrix(h, f),
            ])
        })
        .collect();
    let w = LlamaWeights {
        embed: matrix(512, h),
        layers,
        norm: vec![1.0; h],
        lm_head: Some(matrix(512, h)),
    };
    (c, w)
}

fn options(kv_dtype: KvDtype, attn: AttnMode) -> CudaOptions {
    CudaOptions {
        block_size: BLOCK,
        num_blocks: Some(BLOCKS),
        max_tokens: 64,
        max_seqs: 1,
        max_model_len: Some(BLOCK * BLOCKS),
        graphs: false,
        attn,
        kv_dtype,
        ..CudaOptions::default()
    }
}

const PROMPT_LEN: usize = 40;
const STEPS: usize = 8;

fn prompt(vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let prompt = (0..PROMPT_LEN as u32)
        .map(|i| (i * 37 + 11) % vocab as u32)
        .collect();
    let steps = (0..STEPS as u32)
        .map(|i| (i * 53 + 5) % vocab as u32)
        .collect();
    (prompt, steps)
}

/// (prefill, decode) relative L2 errors against the float32 reference of a bf16-KV run and of an
/// FP8-KV run, with the prompt in `chunk`-token steps.
fn errors(c: &ModelConfig, w: &LlamaWeights, chunk: usize, attn: AttnMode) -> [(f64, f64); 2] {
    let vocab = c.vocab_size;
    let (prompt, steps) = prompt(vocab);
    let reference: Rows = {
        let mut model = CpuLlama::new(c.clone(), w.clone(), 1);
        let mut kv = KvCache::new(model.kv_layout(BLOCK, BLOCKS));
        run(
            |b, l| model.forward(b, &mut kv, l).expect("CPU step"),
            vocab,
            &prompt,
            prompt.len(),
            &steps,
        )
    };
    let mut out = Vec::new();
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
        let mut gpu = CudaLlama::new(c.clone(), WeightSource::Host(w), options(dtype, attn))
            .expect("the CUDA model loads");
        assert_eq!(gpu.kv_layout().dtype, dtype);
        let got = run(
            |b, l| gpu.forward(b, l).expect("CUDA step"),
            vocab,
            &prompt,
            chunk,
            &steps,
        );
        let prefill = compare(&got, &reference, 0..PROMPT_LEN);
        let decode = compare(&got, &reference, PROMPT_LEN..got.len());
        eprintln!(
            "head_dim {} chunk {chunk} {attn:?} {dtype:?}: prefill rel L2 {:.4} ({} of {PROMPT_LEN} top-1), \
             decode rel L2 {:.4} ({} of {STEPS} top-1)",
            c.head_dim, prefill.0, prefill.1, decode.0, decode.1
        );
        out.push((prefill.0, decode.0));
    }
    [out[0], out[1]]
}

/// FP8 KV within `3 ×` the bf16-KV floor `+ 0.03` (E4M3's rounding of keys and values on top of the
/// floor; a kernel reading the wrong bytes lands near 1).
fn assert_fp8_near(floor: (f64, f64), fp8: (f64, f64), what: &str) {
    for (part, f, g) in [("prefill", floor.0, fp8.0), ("decode", floor.1, fp8.1)] {
        assert!(
            g <= 3.0 * f + 0.03,
            "{what} {part}: FP8 KV {g:.4} against the bf16-KV floor {f:.4}"
        );
    }
}

#[test]
fn fp8_kv_stays_near_the_float32_reference() {
    if !tandem_cuda::driver_available() {
        eprintln!("skipping: no NVIDIA driver (libcuda.so.1) on this machine");
        return;
    }
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/tiny-llama");
    let tiny = tandem_model::load(&dir, &LoadOptions::default()).expect("the fixture loads");
    let wide = wide_model();
    for (name, c, w) in [
        ("tiny-llama (head_dim 16)", &tiny.config, &tiny.weights),
        ("wide (head_dim 128)", &wide.0, &wide.1),
    ] {
        // The whole prompt in one step, then in chunks whose prefill reads an earlier chunk's codes;
        // and the reference attention kernel.
        for (chunk, attn) in [
            (PROMPT_LEN, AttnMode::Fast),
            (7, AttnMode::Fast),
            (PROMPT_LEN, AttnMode::Simple),
        ] {
            let [floor, fp8] = errors(c, w, chunk, attn);
            assert_fp8_near(floor, fp8, &format!("{name} chunk {chunk} {attn:?}"));
        }
    }
}

/// What prefill hands to decode is the codes: blocks exported from one FP8 instance and imported into
/// another give bit-identical decode logits, at half the bytes of a bf16 block.
#[test]
fn fp8_kv_blocks_move_between_instances_unchanged() {
    if !tandem_cuda::driver_available() {
        eprintln!("skipping: no NVIDIA driver (libcuda.so.1) on this machine");
        return;
    }
    let (c, w) = wide_model();
    let (prompt, steps) = prompt(c.vocab_size);
    let new = |dtype| {
        CudaLlama::new(
            c.clone(),
            WeightSource::Host(&w),
            options(dtype, AttnMode::Fast),
        )
        .expect("the CUDA model loads")
    };
    let bf16_bytes = new(KvDtype::Bf16).kv_layout().block_bytes();
    let mut prefill = new(KvDtype::Fp8E4m3);
    let mut decode = new(KvDtype::Fp8E4m3);
    let layout = prefill.kv_layout();
    assert_eq!(2 * layout.block_bytes(), bf16_bytes);
    let table: Vec<u32> = (0..BLOCKS as u32).collect();
    let mut batch = ForwardBatch::default();
    let mut logits = Vec::new();
    batch.push(&prompt, 0, table.clone(), LogitsWanted::Last);
    prefill.forward(&batch, &mut logits).expect("prefill");
    let mut block = vec![0u8; layout.block_bytes()];
    for l in 0..layout.n_layers {
        for b in 0..PROMPT_LEN.div_ceil(BLOCK) as u32 {
            prefill.export_block(l, b, &mut block).expect("export");
            decode.import_block(l, b, &block).expect("import");
        }
    }
    let mut a = Vec::new();
    let mut b = Vec::new();
    for (i, &t) in steps.iter().enumerate() {
        batch.clear();
        batch.push(&[t], PROMPT_LEN + i, table.clone(), LogitsWanted::Last);
        prefill
            .forward(&batch, &mut a)
            .expect("decode on the prefill instance");
        decode
            .forward(&batch, &mut b)
            .expect("decode on the importing instance");
        assert_eq!(a, b, "decode step {i} differs after the import");
    }
}
