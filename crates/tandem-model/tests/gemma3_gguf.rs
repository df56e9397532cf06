//! Gemma 3 270M, GGUF Q4_K_M (models/gemma-3-270m-q4_k_m.gguf, fetched by `scripts/fetch-model.sh gemma3`;
//! the tests pass without a word when it is absent): its Q5_0 weights load, its tokenizer and its greedy
//! logits are llama.cpp's, the logits bit for bit at every kernel level.

use std::path::PathBuf;

use tandem_kernels::{DType, Isa};
use tandem_model::{load, CpuLlama, ForwardBatch, KvCache, LoadOptions, LoadedModel, LogitsWanted};

fn gemma_path() -> Option<PathBuf> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        eprintln!(
            "skipped: {} is absent (scripts/fetch-model.sh gemma3)",
            path.display()
        );
        return None;
    }
    Some(path)
}

fn gemma() -> Option<LoadedModel> {
    let path = gemma_path()?;
    Some(load(&path, &LoadOptions { progress: false }).expect("loading Gemma 3 270M"))
}

#[test]
fn q5_0_weights_load_with_the_gemma3_layout() {
    let Some(m) = gemma() else {
        return;
    };
    let c = &m.config;
    assert_eq!(c.architecture, "gemma3");
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (18, 640, 2048)
    );
    assert_eq!(m.weights.embed.dtype(), DType::Q8_0);
    let l = &m.weights.layers[0];
    assert_eq!(
        (l.wq.dtype(), l.wk.dtype(), l.wo.dtype()),
        (DType::Q5_0, DType::Q5_0, DType::Q4K)
    );
}

/// One prompt of llama.cpp's reference (tests/fixtures/llamacpp-gemma3/ref.json, recorded by
/// scripts/fixtures/llamacpp-gemma3-ref.py): its token ids (BOS first), llama.cpp's greedy continuation
/// and, per step, the largest logit and the first 16 bytes of the sha256 of the whole f32 logits row.
struct Reference {
    name: String,
    text: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    max_logit: Vec<f32>,
    logits_sha: Vec<String>,
}

fn reference() -> Vec<Reference> {
    let path = tandem_testkit::root().join("tests/fixtures/llamacpp-gemma3/ref.json");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).expect("read ref.json")).unwrap();
    let u32s = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    meta["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Reference {
            name: p["name"].as_str().unwrap().to_string(),
            text: p["text"].as_str().unwrap().to_string(),
            ids: u32s(&p["token_ids"]),
            greedy: u32s(&p["greedy"]),
            max_logit: p["max_logit"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
            logits_sha: p["logits_sha256_128"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect(),
        })
        .collect()
}

/// The first 16 bytes of the sha256 of a logits row's f32 little-endian bytes, in hex.
fn logits_sha(row: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for v in row {
        h.update(v.to_le_bytes());
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Greedy decoding of every reference prompt as llama.cpp ran it (the prompt in one step, then one token
/// per step): returns, per prompt, where the logits first stop being llama.cpp's bit for bit and where the
/// greedy tokens first differ (None: never), and the largest |Δ max logit| before that.
fn greedy_against_llamacpp(m: &LoadedModel) -> Vec<(String, Option<usize>, Option<usize>)> {
    let mut model = CpuLlama::new(m.config.clone(), m.weights.clone(), 2);
    let mut out = Vec::new();
    for r in reference() {
        let n = r.ids.len() + r.greedy.len();
        let blocks: Vec<u32> = (0..n.div_ceil(16) as u32).collect();
        let mut kv = KvCache::new(model.kv_layout(16, blocks.len()));
        let mut batch = ForwardBatch::default();
        batch.push(&r.ids, 0, blocks.clone(), LogitsWanted::Last);
        let (mut logits, mut first_bits, mut first_token) = (Vec::new(), None, None);
        let mut max_dlogit = 0f32;
        for (i, &want) in r.greedy.iter().enumerate() {
            model.forward(&batch, &mut kv, &mut logits).unwrap();
            let best = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            if first_bits.is_none() && logits_sha(&logits) != r.logits_sha[i] {
                first_bits = Some(i);
            }
            if first_bits.is_none() {
                max_dlogit = max_dlogit.max((logits[best as usize] - r.max_logit[i]).abs());
            }
            if first_token.is_none() && best != want {
                first_token = Some(i);
            }
            // llama.cpp's token goes on, so later steps stay comparable after a difference.
            batch.clear();
            batch.push(&[want], r.ids.len() + i, blocks.clone(), LogitsWanted::Last);
        }
        eprintln!(
            "{:<9} {:>3} prompt tokens: logits {}, greedy tokens {}",
            r.name,
            r.ids.len(),
            first_bits.map_or("bit-exact at every step".to_string(), |i| format!(
                "differ from step {i}"
            )),
            first_token.map_or("identical".to_string(), |i| format!("differ at {i}")),
        );
        out.push((r.name, first_bits, first_token));
    }
    out
}

const BIT_EXACT_TEST: &str = "greedy_logits_are_llamacpps_bit_for_bit_at_every_kernel_level";

/// Gemma 3 270M's greedy continuations of 8 prompts × 64 tokens, the last one past the 512-token sliding
/// window, against llama.cpp's (AVX2 build, f32 KV cache): every step's whole logits row must be
/// llama.cpp's bit for bit (so every greedy token is too), at every kernel level the CPU has, with
/// llama.cpp's batch-dependent orders on (`set_llamacpp_batch_orders`). Each level
/// runs in a child process of this test binary capped by `TANDEM_KERNELS` (the level is fixed once per
/// process); with `TANDEM_KERNELS` set the test checks that level alone. Relies on glibc's `tanhf`,
/// `cosf` and `sinf` (the GELU table and RoPE), as llama.cpp's build does.
#[test]
fn greedy_logits_are_llamacpps_bit_for_bit_at_every_kernel_level() {
    if let Ok(level) = std::env::var("TANDEM_KERNELS") {
        // Before loading: the level is fixed at its first use. Decode steps of one token take
        // llama.cpp's one-token summation orders.
        tandem_kernels::set_isa_cap(level.parse().expect("TANDEM_KERNELS"));
        tandem_kernels::set_llamacpp_batch_orders(true);
        let Some(m) = gemma() else {
            return;
        };
        let runs = greedy_against_llamacpp(&m);
        let bad: Vec<String> = runs
            .iter()
            .filter(|(_, bits, _)| bits.is_some())
            .map(|(name, bits, tok)| {
                format!("{name}: logits differ from step {bits:?}, tokens from {tok:?}")
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{}: not bit-exact with llama.cpp: {}",
            tandem_kernels::isa().name(),
            bad.join("; ")
        );
        return;
    }
    if gemma_path().is_none() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for level in Isa::ALL.into_iter().filter(|&l| l <= tandem_kernels::isa()) {
        let out = std::process::Command::new(&exe)
            .args(["--exact", BIT_EXACT_TEST, "--nocapture", "--test-threads=1"])
            .env("TANDEM_KERNELS", level.name())
            .output()
            .unwrap();
        eprintln!(
            "== {}\n{}",
            level.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "{}: {}",
            level.name(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// tandem tokenizes the reference prompts (Gemma's SentencePiece vocabulary, control tokens included) as
/// llama.cpp does.
#[test]
fn tokenizer_matches_llamacpp() {
    let Some(m) = gemma() else {
        return;
    };
    for r in reference() {
        let ours = m.tokenizer.encode(&r.text, true).expect("encode");
        assert_eq!(
            ours, r.ids,
            "{}: tokenization differs from llama.cpp",
            r.name
        );
    }
}
