//! GGUF block-quantized matrices in the layouts the GPU kernels read, packed on the host at load.
//!
//! GGML blocks interleave an f16 header with their codes (18 bytes for 32 Q4_0 values), so a warp's
//! 16-byte loads would straddle blocks. The upload splits every matrix into two arrays instead: the
//! codes, 16 bytes a chunk, and one (scale, min) pair of f32 per chunk, with element
//! `scale * code + min` — the values the CPU's reference decoder gives (`tandem_kernels::affine_codes`).
//! - [`PackedFormat::Q4`]: 32 unsigned 4-bit codes a chunk (byte j holds element j in its low nibble
//!   and element j + 16 in its high one), a pair per 32 elements: Q4_0, Q4_1 and Q4_K.
//! - [`PackedFormat::Q8`]: 16 signed 8-bit codes a chunk, a pair per 16 elements: every other
//!   format (Q5_0, Q8_0, Q6_K), and a fused matrix whose parts mix 4-bit and wider formats.
//!
//! The pairs cost 2 bits a weight in Q4 (a Q4_1 block's two f16 cost 1) and 4 in Q8: f32 keeps every
//! weight exactly what the CPU decodes (a K-quant's sub-block scale is an f16 times a 6-bit integer).

use tandem_kernels::{affine_codes, affine_codes_are_u4, affine_group, Matrix};

/// A packed layout of the GPU's GEMV and dequantization kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    /// Unsigned 4-bit codes, one (scale, min) pair per 32 elements.
    Q4,
    /// Signed 8-bit codes, one (scale, min) pair per 16 elements.
    Q8,
}

impl PackedFormat {
    /// Elements per 16-byte chunk of codes (and per (scale, min) pair).
    pub fn chunk_values(self) -> usize {
        match self {
            PackedFormat::Q4 => 32,
            PackedFormat::Q8 => 16,
        }
    }

    /// Bytes of codes of a row of `cols` elements.
    pub fn row_code_bytes(self, cols: usize) -> usize {
        cols / self.chunk_values() * 16
    }

    /// f32 values of (scale, min) pairs of a row of `cols` elements.
    pub fn row_params(self, cols: usize) -> usize {
        2 * cols / self.chunk_values()
    }
}

/// Matrices packed for the GPU: codes and (scale, min) pairs, rows in the inputs' order.
#[derive(Debug)]
pub struct Packed {
    /// The layout.
    pub format: PackedFormat,
    /// Codes, `format.row_code_bytes(cols)` bytes a row.
    pub codes: Vec<u8>,
    /// (scale, min) pairs, `format.row_params(cols)` f32 a row.
    pub params: Vec<f32>,
    /// Rows of all the inputs together.
    pub rows: usize,
    /// Elements a row.
    pub cols: usize,
}

/// The layout matrices with the same column count can share once row-concatenated (a fused
/// [q; k; v] or [gate; up]): `None` when any of them is not block-quantized (it is then uploaded as
/// bf16) or its rows are not whole 32-element chunks.
pub fn format_of(ms: &[&Matrix]) -> Option<PackedFormat> {
    let mut format = PackedFormat::Q4;
    for m in ms {
        affine_group(m.dtype())?;
        if !m.cols().is_multiple_of(32) {
            return None;
        }
        if !affine_codes_are_u4(m.dtype()) {
            format = PackedFormat::Q8;
        }
    }
    Some(format)
}

/// Packs matrices (same column count) row-concatenated in `format` ([`format_of`] must allow it).
pub fn pack(ms: &[&Matrix], format: PackedFormat) -> Packed {
    let cols = ms[0].cols();
    let rows: usize = ms.iter().map(|m| m.rows()).sum();
    let mut codes = Vec::with_capacity(rows * format.row_code_bytes(cols));
    let mut params = Vec::with_capacity(rows * format.row_params(cols));
    let mut row_codes = vec![0i8; cols];
    let mut row_params = Vec::with_capacity(cols / 16);
    let chunk = format.chunk_values();
    for m in ms {
        assert_eq!(m.cols(), cols, "packed matrices share their column count");
        let group = affine_group(m.dtype()).expect("a block-quantized matrix");
        let rb = m.row_bytes();
        for r in 0..m.rows() {
            row_params.clear();
            affine_codes(
                m.dtype(),
                &m.bytes()[r * rb..(r + 1) * rb],
                &mut row_codes,
                &mut row_params,
            );
            for (c, values) in row_codes.chunks_exact(chunk).enumerate() {
                let (scale, min) = row_params[c * chunk / group];
                params.extend([scale, min]);
                match format {
                    PackedFormat::Q4 => codes.extend(
                        (0..16).map(|j| (values[j] as u8 & 0xF) | ((values[j + 16] as u8) << 4)),
                    ),
                    PackedFormat::Q8 => codes.extend(values.iter().map(|&v| v as u8)),
                }
            }
        }
    }
    Packed {
        format,
        codes,
        params,
        rows,
        cols,
    }
}

impl Packed {
    /// Decodes row `r` as the GPU kernels read it (tests hold it to the CPU's decoder).
    pub fn row(&self, r: usize) -> Vec<f32> {
        let f = self.format;
        let codes = &self.codes[r * f.row_code_bytes(self.cols)..];
        let params = &self.params[r * f.row_params(self.cols)..];
        (0..self.cols)
            .map(|i| {
                let c = i / f.chunk_values();
                let (scale, min) = (params[2 * c], params[2 * c + 1]);
                let code = match f {
                    PackedFormat::Q4 => {
                        let byte = codes[16 * c + i % 16];
                        f32::from(if i % 32 < 16 { byte & 0xF } else { byte >> 4 })
                    }
                    PackedFormat::Q8 => f32::from(codes[i] as i8),
                };
                scale * code + min
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kernels::{quantize_row, DType, WeightBytes};

    fn matrix(dtype: DType, rows: usize, cols: usize, seed: u32) -> Matrix {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        let mut bytes = Vec::new();
        for _ in 0..rows {
            let x: Vec<f32> = (0..cols)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 17;
                    s ^= s << 5;
                    (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
                })
                .collect();
            quantize_row(dtype, &x, &mut bytes);
        }
        Matrix::new(
            dtype,
            rows,
            cols,
            WeightBytes::Owned(std::sync::Arc::new(bytes)),
        )
        .unwrap()
    }

    fn reference_rows(ms: &[&Matrix]) -> Vec<Vec<f32>> {
        ms.iter()
            .flat_map(|m| {
                (0..m.rows()).map(|r| {
                    let mut row = vec![0f32; m.cols()];
                    m.dequantize_row(r, &mut row);
                    row
                })
            })
            .collect()
    }

    /// Every GGUF format, alone and fused with others, packs into the layout the kernels read and
    /// decodes from it to the CPU decoder's values.
    #[test]
    fn packed_rows_decode_to_the_cpu_values() {
        let q4 = [DType::Q4_0, DType::Q4_1, DType::Q4K];
        let wide = [DType::Q5_0, DType::Q8_0, DType::Q6K];
        let mut cases: Vec<(Vec<DType>, PackedFormat)> = Vec::new();
        for d in q4 {
            cases.push((vec![d], PackedFormat::Q4));
        }
        for d in wide {
            cases.push((vec![d], PackedFormat::Q8));
        }
        // Q4_K_M files mix formats inside one fused projection.
        cases.push((vec![DType::Q4K, DType::Q4_0, DType::Q4_1], PackedFormat::Q4));
        cases.push((vec![DType::Q4K, DType::Q4K, DType::Q6K], PackedFormat::Q8));
        for (i, (dtypes, want)) in cases.iter().enumerate() {
            let ms: Vec<Matrix> = dtypes
                .iter()
                .enumerate()
                .map(|(j, &d)| matrix(d, 3 + j, 512, (i * 7 + j) as u32))
                .collect();
            let refs: Vec<&Matrix> = ms.iter().collect();
            let format = format_of(&refs).unwrap();
            assert_eq!(format, *want, "{dtypes:?}");
            let p = pack(&refs, format);
            assert_eq!(p.codes.len(), p.rows * format.row_code_bytes(512));
            assert_eq!(p.params.len(), p.rows * format.row_params(512));
            for (r, want) in reference_rows(&refs).iter().enumerate() {
                let got = p.row(r);
                for (k, (g, w)) in got.iter().zip(want).enumerate() {
                    assert_eq!(g, w, "{dtypes:?} row {r} element {k}");
                }
            }
        }
    }

    /// A float matrix anywhere in a fused projection keeps the whole of it out of the packed formats.
    #[test]
    fn float_parts_are_not_packed() {
        let q = matrix(DType::Q4_0, 2, 64, 1);
        let f = Matrix::from_f32(2, 64, vec![0.5; 128]);
        assert_eq!(format_of(&[&q]), Some(PackedFormat::Q4));
        assert_eq!(format_of(&[&q, &f]), None);
        assert_eq!(format_of(&[&f]), None);
    }
}
