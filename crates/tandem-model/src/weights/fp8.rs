//! FP8 (E4M3) checkpoints: which scaling an HF `quantization_config` declares, and the
//! dequantization of an FP8 weight with its scales to bf16 at load.
//!
//! Two layouts are in use: block-wise scales (`quant_method: fp8` with `weight_block_size`, Qwen3-FP8
//! and DeepSeek: one fp32 scale per 128 × 128 block, in `<weight>_scale_inv`) and per-channel or
//! per-tensor scales (`compressed-tensors` FP8, `fbgemm_fp8`, `fp8` without a block size: in
//! `<weight>_scale`). Either way the weight is `fp8 value × scale`.

use serde_json::Value;

use crate::error::ModelError;

/// How an FP8 checkpoint's weights are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// One scale per block of `rows × cols` weights (the last blocks of a row or column may be
    /// partial).
    Block {
        /// Weight rows a block spans.
        rows: usize,
        /// Weight columns a block spans.
        cols: usize,
    },
    /// One scale per output row, or one for the whole tensor (told apart by the scale's shape).
    ChannelOrTensor,
}

/// The quantization methods served, for error messages.
const SERVED: &str =
    "fp8 (with or without weight_block_size), fbgemm_fp8, compressed-tensors with \
                      8-bit float weights";

/// The FP8 scaling an HF `config.json` declares in `quantization_config` (`None`: no such key, the
/// weights are plain floats); any other quantization is refused naming its method.
pub fn fp8_scales_of(config: &Value) -> Result<Option<Fp8Scales>, ModelError> {
    let Some(q) = config.get("quantization_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let refuse = |what: String| {
        Err(ModelError::Config(format!(
            "quantization_config: {what} is not served (served: {SERVED})"
        )))
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    match method {
        "fp8" => {
            if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
                if fmt != "e4m3" {
                    return refuse(format!("fp8 format {fmt:?}"));
                }
            }
            match q.get("weight_block_size").filter(|v| !v.is_null()) {
                Some(b) => block_of(b, "weight_block_size").map(Some),
                None => Ok(Some(Fp8Scales::ChannelOrTensor)),
            }
        }
        "fbgemm_fp8" => Ok(Some(Fp8Scales::ChannelOrTensor)),
        "compressed-tensors" => {
            let groups = q
                .get("config_groups")
                .and_then(Value::as_object)
                .filter(|g| !g.is_empty())
                .ok_or_else(|| {
                    ModelError::Config(
                        "quantization_config: compressed-tensors without config_groups".into(),
                    )
                })?;
            let mut found = None;
            for (name, g) in groups {
                let w = g.get("weights").unwrap_or(&Value::Null);
                let bits = w.get("num_bits").and_then(Value::as_u64);
                let kind = w.get("type").and_then(Value::as_str);
                if bits != Some(8) || kind != Some("float") {
                    return refuse(format!(
                        "compressed-tensors group {name} with {bits:?}-bit {kind:?} weights"
                    ));
                }
                let scales = match w.get("strategy").and_then(Value::as_str) {
                    Some("channel") | Some("tensor") => Fp8Scales::ChannelOrTensor,
                    Some("block") => block_of(
                        w.get("block_structure").unwrap_or(&Value::Null),
                        "block_structure",
                    )?,
                    other => {
                        return refuse(format!(
                            "compressed-tensors group {name} with strategy {other:?}"
                        ))
                    }
                };
                if found.is_some_and(|f| f != scales) {
                    return refuse("compressed-tensors groups of different scalings".into());
                }
                found = Some(scales);
            }
            Ok(found)
        }
        other => refuse(format!("quant_method {other:?}")),
    }
}

fn block_of(v: &Value, key: &str) -> Result<Fp8Scales, ModelError> {
    let dims: Vec<usize> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as usize)
                .collect()
        })
        .unwrap_or_default();
    match dims[..] {
        [rows, cols] if rows > 0 && cols > 0 => Ok(Fp8Scales::Block { rows, cols }),
        _ => Err(ModelError::Config(format!(
            "quantization_config.{key} must be two positive sizes, got {v}"
        ))),
    }
}

/// The value of an E4M3 ("fn": no infinities, 0x7f and 0xff are NaN) byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 0xf && m == 7.0 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// The E4M3 code of finite `x`, rounded to nearest even and saturated at ±448 (NaN saturates too):
/// the encoding the CUDA backend's `quant_fp8` kernel writes, step for step, so that a host
/// reference can hold exactly the weights the GPU holds.
pub fn e4m3_of(x: f32) -> u8 {
    let sign = if x < 0.0 { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() || a >= 464.0 {
        return sign | 0x7e;
    }
    if a < 0.015625 {
        // Subnormal: m × 2^-9, m in 0..=8 (8 is the smallest normal, 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let mut m = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as u32;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) as u32) << 3 | m).min(0x7e);
    sign | code as u8
}

/// Rows and columns of one FP8 scale block of a block-scaled checkpoint, and the columns of one
/// scale group of FP8 weights quantized at load.
pub const FP8_BLOCK: usize = 128;

/// Quantizes a row-major `rows × cols` matrix to E4M3 codes with one scale per row and 128-column
/// group (the group's largest magnitude / 448, 1 for an all-zero group; the last group of a row may
/// be partial), as the CUDA backend's `quant_fp8` does at load: the codes, and the scales row by
/// row (`scales[r * cols.div_ceil(128) + c / 128]`). One scale per row rather than per 128 × 128
/// block: a row's outliers coarsen only its own codes.
pub fn quantize_fp8_rows(values: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(values.len(), rows * cols, "values are rows × cols");
    let kb = cols.div_ceil(FP8_BLOCK);
    let mut scales = vec![1f32; rows * kb];
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for g in 0..kb {
            let c = g * FP8_BLOCK..((g + 1) * FP8_BLOCK).min(cols);
            let span = r * cols + c.start..r * cols + c.end;
            let amax = values[span.clone()]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            scales[r * kb + g] = s;
            for i in span {
                codes[i] = e4m3_of(values[i] / s);
            }
        }
    }
    (codes, scales)
}

/// The scale tensor of an FP8 weight, as read from the checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct ScaleTensor<'a> {
    /// Its name (errors name it).
    pub name: &'a str,
    /// Its values, row-major.
    pub values: &'a [f32],
    /// Its shape as stored.
    pub shape: &'a [usize],
}

/// Dequantizes the `rows × cols` FP8 weight `name` with its `scale` tensor to bf16 bits, checking
/// the scale's shape against `scheme` and refusing NaN weights by name.
pub fn dequantize_fp8(
    name: &str,
    bytes: &[u8],
    (rows, cols): (usize, usize),
    scheme: Fp8Scales,
    scale: ScaleTensor<'_>,
) -> Result<Vec<u16>, ModelError> {
    let (scale_name, scales, scale_shape) = (scale.name, scale.values, scale.shape);
    let shape_err = |expected: Vec<usize>| ModelError::Shape {
        tensor: scale_name.to_string(),
        expected,
        actual: scale_shape.to_vec(),
    };
    // Index of the scale of weight (r, c).
    let scale_at: Box<dyn Fn(usize, usize) -> usize> = match scheme {
        Fp8Scales::Block { rows: br, cols: bc } => {
            let want = vec![rows.div_ceil(br), cols.div_ceil(bc)];
            if scale_shape != want.as_slice() {
                return Err(shape_err(want));
            }
            let per_row = want[1];
            Box::new(move |r, c| (r / br) * per_row + c / bc)
        }
        Fp8Scales::ChannelOrTensor => match scale_shape {
            [] | [1] => Box::new(|_, _| 0),
            [n] | [n, 1] if *n == rows => Box::new(|r, _| r),
            _ => return Err(shape_err(vec![rows, 1])),
        },
    };
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let v = table[bytes[r * cols + c] as usize];
            if v.is_nan() {
                return Err(ModelError::Config(format!(
                    "tensor {name}: NaN at row {r}, column {c}"
                )));
            }
            out.push(half::bf16::from_f32(v * scales[scale_at(r, c)]).to_bits());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Every finite code encodes back to itself, values between two codes round to the nearer one
    /// (ties to the even code), and the range saturates at ±448.
    #[test]
    fn e4m3_encoding_round_trips_and_rounds_to_nearest_even() {
        for b in 0u8..=255 {
            let v = super::e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = super::e4m3_of(v);
            // -0 encodes as 0x80 and +0 as 0x00; every other code is its own.
            assert_eq!(super::e4m3_to_f32(back), v, "code {b:#04x} ({v})");
        }
        for b in 0u8..0x7e {
            let (lo, hi) = (super::e4m3_to_f32(b), super::e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(
                super::e4m3_of(mid),
                even,
                "tie between {b:#04x} and the next"
            );
            assert_eq!(super::e4m3_of(lo + (hi - lo) * 0.25), b);
            assert_eq!(super::e4m3_of(lo + (hi - lo) * 0.75), b + 1);
        }
        assert_eq!(super::e4m3_of(1000.0), 0x7e);
        assert_eq!(super::e4m3_of(-1000.0), 0xfe);
        assert_eq!(super::e4m3_of(f32::NAN) & 0x7f, 0x7e);
        assert_eq!(super::e4m3_to_f32(super::e4m3_of(450.0)), 448.0);
    }

    /// Scales are each row's 128-column group's largest magnitude / 448 (a partial group at the
    /// end), a row's outlier leaves the next row's scale alone, and every weight comes back within
    /// half a code step of its group.
    #[test]
    fn row_quantization_scales_each_row_group_by_its_largest_value() {
        let (rows, cols) = (130, 200);
        let mut values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                ((i * 7919 % 1000) as f32 - 500.0) / 100.0 * if i % cols < 128 { 1.0 } else { 0.01 }
            })
            .collect();
        values[5 * cols + 3] = 1000.0;
        let (codes, scales) = super::quantize_fp8_rows(&values, rows, cols);
        assert_eq!(scales.len(), rows * 2);
        for r in 0..rows {
            for g in 0..2 {
                let c = g * 128..((g + 1) * 128).min(cols);
                let amax = values[r * cols + c.start..r * cols + c.end]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(scales[r * 2 + g], amax / 448.0, "row {r} group {g}");
            }
        }
        assert_eq!(scales[5 * 2], 1000.0 / 448.0);
        assert!(
            scales[6 * 2] < 5.0 / 448.0 * 1.0001,
            "the outlier stays in its row"
        );
        for r in 0..rows {
            for c in 0..cols {
                let s = scales[r * 2 + c / 128];
                let back = super::e4m3_to_f32(codes[r * cols + c]) * s;
                let v = values[r * cols + c];
                // E4M3 keeps 3 mantissa bits: a relative step of 2^-3, or the subnormal step 2^-9·s.
                assert!(
                    (back - v).abs() <= (v.abs() / 16.0).max(s / 1024.0) * 1.0001,
                    "{v} -> {back}"
                );
            }
        }
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn e4m3_values_match_the_format() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x3c), 1.5);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Monotone over the positive codes.
        for b in 1..0x7fu8 {
            assert!(e4m3_to_f32(b) > e4m3_to_f32(b - 1), "{b:#x}");
        }
    }

    #[test]
    fn both_checkpoint_layouts_parse_and_other_methods_are_refused_by_name() {
        let cfg = |q: Value| json!({ "quantization_config": q });
        assert_eq!(fp8_scales_of(&json!({})).unwrap(), None);
        assert_eq!(
            fp8_scales_of(&cfg(json!({"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [128, 128]})))
            .unwrap(),
            Some(Fp8Scales::Block {
                rows: 128,
                cols: 128
            })
        );
        assert_eq!(
            fp8_scales_of(&cfg(json!({"quant_method": "fbgemm_fp8"}))).unwrap(),
            Some(Fp8Scales::ChannelOrTensor)
        );
        let ct = json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}});
        assert_eq!(
            fp8_scales_of(&cfg(ct)).unwrap(),
            Some(Fp8Scales::ChannelOrTensor)
        );
        let int4 = json!({"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}});
        let e = fp8_scales_of(&cfg(int4)).unwrap_err().to_string();
        assert!(
            e.contains("4") && e.contains("int") && e.contains("served"),
            "{e}"
        );
        let e = fp8_scales_of(&cfg(json!({"quant_method": "awq"})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"awq\""), "{e}");
        let e = fp8_scales_of(&cfg(
            json!({"quant_method": "fp8", "weight_block_size": [128]}),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("weight_block_size"), "{e}");
    }

    #[test]
    fn block_scales_cover_partial_blocks_and_a_wrong_scale_shape_is_named() {
        // 3 × 5 weights of 1.0 (0x38), 2 × 2 blocks: scales [2, 3], the last row and column partial.
        let bytes = [0x38u8; 15];
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let block = Fp8Scales::Block { rows: 2, cols: 2 };
        let st = |shape| ScaleTensor {
            name: "w_scale_inv",
            values: &scales,
            shape,
        };
        let got = dequantize_fp8("w", &bytes, (3, 5), block, st(&[2, 3])).unwrap();
        let f: Vec<f32> = got
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        assert_eq!(&f[..5], &[1.0, 1.0, 2.0, 2.0, 3.0]);
        assert_eq!(&f[10..], &[4.0, 4.0, 5.0, 5.0, 6.0]);
        let e = dequantize_fp8("w", &bytes, (3, 5), block, st(&[3, 2]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("w_scale_inv") && e.contains("[2, 3]"), "{e}");

        let per_row = dequantize_fp8(
            "w",
            &bytes,
            (3, 5),
            Fp8Scales::ChannelOrTensor,
            ScaleTensor {
                name: "w_scale",
                values: &[0.5, 1.0, 2.0],
                shape: &[3, 1],
            },
        )
        .unwrap();
        assert_eq!(half::bf16::from_bits(per_row[14]).to_f32(), 2.0);
        let mut nan = bytes;
        nan[7] = 0x7f;
        let one = ScaleTensor {
            name: "s",
            values: &[1.0],
            shape: &[],
        };
        let e = dequantize_fp8("w", &nan, (3, 5), Fp8Scales::ChannelOrTensor, one)
            .unwrap_err()
            .to_string();
        assert!(e.contains("NaN at row 1, column 2"), "{e}");
    }
}
