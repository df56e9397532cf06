//! FP8 (E4M3) checkpoints in the two layouts in use — block-wise scales (`quant_method: fp8` with
//! `weight_block_size`, Qwen3-FP8 / DeepSeek) and per-channel scales (`compressed-tensors`) — load,
//! dequantized to bf16 exactly as `fp8 value × scale`, and answer as the model they were quantized from.
//! The checkpoints are made here from the tiny Qwen3 fixture, with the quantization those checkpoints
//! use (scale = absmax / 448 per block or row, round to the nearest E4M3 value).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tandem_model::weights::fp8::e4m3_to_f32;
use tandem_model::{load, CpuLlama, ForwardBatch, KvCache, LoadOptions, LogitsWanted};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/tiny-qwen3")
}

/// The positive E4M3 values with their codes, ascending (NaN left out).
fn codes() -> Vec<(f32, u8)> {
    (0..0x7fu8).map(|b| (e4m3_to_f32(b), b)).collect()
}

/// The E4M3 code nearest `x` (|x| ≤ 448).
fn to_e4m3(x: f32, table: &[(f32, u8)]) -> u8 {
    let a = x.abs();
    let (_, code) = table
        .iter()
        .min_by(|p, q| (p.0 - a).abs().total_cmp(&(q.0 - a).abs()))
        .expect("a code");
    if x < 0.0 {
        code | 0x80
    } else {
        *code
    }
}

/// Scale of weight (r, c): one per `block` (rows, cols), or one per row when `block` is `None`.
fn scale_index(r: usize, c: usize, cols: usize, block: Option<(usize, usize)>) -> usize {
    match block {
        Some((br, bc)) => (r / br) * cols.div_ceil(bc) + c / bc,
        None => r,
    }
}

/// A quantized copy of the fixture in `dir`: every projection FP8 with its scales, the rest as is.
/// Returns, per quantized weight, the values the loader must produce (bf16 of code × scale).
fn write_fp8(dir: &Path, block: Option<(usize, usize)>) -> HashMap<String, Vec<f32>> {
    std::fs::create_dir_all(dir).unwrap();
    let src = fixture();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name != "model.safetensors" && name != "config.json" {
            std::fs::copy(&p, dir.join(&name)).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = match block {
        Some((r, c)) => serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [r, c]}),
        None => {
            serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}})
        }
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let table = codes();
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut expected = HashMap::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let shape = view.shape().to_vec();
        if !name.ends_with("proj.weight") {
            out.push((name, Dtype::F32, shape, view.data().to_vec()));
            continue;
        }
        let (rows, cols) = (shape[0], shape[1]);
        let w: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let n_scales = match block {
            Some((br, bc)) => rows.div_ceil(br) * cols.div_ceil(bc),
            None => rows,
        };
        let mut amax = vec![0f32; n_scales];
        for r in 0..rows {
            for c in 0..cols {
                let s = &mut amax[scale_index(r, c, cols, block)];
                *s = s.max(w[r * cols + c].abs());
            }
        }
        let scales: Vec<f32> = amax.iter().map(|a| a.max(1e-12) / 448.0).collect();
        let mut q = Vec::with_capacity(rows * cols);
        let mut want = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for c in 0..cols {
                let s = scales[scale_index(r, c, cols, block)];
                let code = to_e4m3(w[r * cols + c] / s, &table);
                q.push(code);
                want.push(half::bf16::from_f32(e4m3_to_f32(code) * s).to_f32());
            }
        }
        expected.insert(name.clone(), want);
        let (scale_name, scale_shape) = match block {
            Some((br, bc)) => (
                format!("{name}_scale_inv"),
                vec![rows.div_ceil(br), cols.div_ceil(bc)],
            ),
            None => (format!("{name}_scale"), vec![rows, 1]),
        };
        let sb: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        out.push((scale_name, Dtype::F32, scale_shape, sb));
        out.push((name, Dtype::F8_E4M3, shape, q));
    }
    let views: Vec<(String, TensorView)> = out
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    expected
}

/// The fixture in `dir` with each projection replaced by `dequantized` (f32): what an FP8 checkpoint
/// must compute exactly.
fn write_reference(dir: &Path, dequantized: &HashMap<String, Vec<f32>>) {
    std::fs::create_dir_all(dir).unwrap();
    let src = fixture();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name != "model.safetensors" {
            std::fs::copy(&p, dir.join(&name)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let b = match dequantized.get(&name) {
                Some(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                None => view.data().to_vec(),
            };
            (name, view.shape().to_vec(), b)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// rel L2 of `b` against `a`, and the rows (of `vocab`) whose argmax agree.
fn compare(a: &[f32], b: &[f32], vocab: usize) -> (f32, usize) {
    let diff: f32 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f32>()
        .sqrt();
    let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|p, q| p.1.total_cmp(q.1))
            .unwrap()
            .0
    };
    let agree = a
        .chunks(vocab)
        .zip(b.chunks(vocab))
        .filter(|(x, y)| argmax(x) == argmax(y))
        .count();
    (diff / norm, agree)
}

/// Logits of every position of `ids` through the model at `dir`.
fn logits(dir: &Path, ids: &[u32]) -> (Vec<f32>, usize) {
    let m = load(dir, &LoadOptions { progress: false }).unwrap();
    let vocab = m.config.vocab_size;
    let mut model = CpuLlama::new(m.config, m.weights, 1);
    let mut kv = KvCache::new(model.kv_layout(4, 64));
    let mut batch = ForwardBatch::default();
    let blocks: Vec<u32> = (0..ids.len().div_ceil(4) as u32).collect();
    batch.push(ids, 0, blocks, LogitsWanted::All);
    let mut out = Vec::new();
    model.forward(&batch, &mut kv, &mut out).unwrap();
    (out, vocab)
}

fn check_layout(block: Option<(usize, usize)>, tag: &str) {
    let dir = std::env::temp_dir().join(format!("tandem-fp8-{tag}-{}", std::process::id()));
    let expected = write_fp8(&dir, block);

    // The loader's weights are exactly the checkpoint's code × scale, in bf16.
    let m = load(&dir, &LoadOptions { progress: false }).unwrap();
    let wq = &m.weights.layers[0].wq;
    let want = &expected["model.layers.0.self_attn.q_proj.weight"];
    let mut row = vec![0f32; wq.cols()];
    for r in 0..wq.rows() {
        wq.dequantize_row(r, &mut row);
        assert_eq!(
            row,
            want[r * wq.cols()..(r + 1) * wq.cols()],
            "{tag} row {r}"
        );
    }

    // The whole model computes what the same weights stored dequantized compute...
    let reference = dir.with_extension("reference");
    write_reference(&reference, &expected);
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 500).collect();
    let (fp8, vocab) = logits(&dir, &ids);
    let (deq, _) = logits(&reference, &ids);
    let (rel, agree) = compare(&deq, &fp8, vocab);
    assert!(
        rel < 1e-5 && agree == ids.len(),
        "{tag}: rel L2 {rel}, top-1 {agree}"
    );
    // ...and stays near the model it was quantized from (random tiny weights: logits close to
    // uniform, so FP8's few mantissa bits show more than on a trained model).
    let (src, _) = logits(&fixture(), &ids);
    let (rel, agree) = compare(&src, &fp8, vocab);
    println!(
        "{tag}: against the source model rel L2 {rel:.4}, top-1 {agree}/{}",
        ids.len()
    );
    assert!(
        rel < 0.25 && agree * 2 >= ids.len(),
        "{tag}: rel L2 {rel}, top-1 {agree}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&reference).unwrap();
}

#[test]
fn block_scaled_fp8_checkpoint_loads_and_answers_as_its_source() {
    // 16 × 16 blocks: several per matrix, partial ones at no edge (the widths are multiples of 16).
    check_layout(Some((16, 16)), "block");
}

#[test]
fn per_channel_fp8_checkpoint_loads_and_answers_as_its_source() {
    check_layout(None, "channel");
}

/// The error loading `dir` gives (it must give one).
fn refusal(dir: &Path) -> String {
    match load(dir, &LoadOptions { progress: false }) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn fp8_weights_without_their_scales_or_quantization_config_are_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("tandem-fp8-bad-{}", std::process::id()));
    write_fp8(&dir, Some((16, 16)));
    // Without quantization_config the FP8 tensors cannot be read.
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = refusal(&dir);
    assert!(
        e.contains("F8_E4M3") && e.contains("quantization_config"),
        "{e}"
    );
    // A method tandem does not serve is named.
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = refusal(&dir);
    assert!(e.contains("\"gptq\""), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
