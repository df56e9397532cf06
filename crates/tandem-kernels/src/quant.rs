//! GGML block formats: dtype metadata, the weight container, reference decoders and reference encoders.
//!
//! Layouts (little endian, packed, as in ggml-quants):
//! - Q4_0 `{f16 d; u8 qs[16]}`: x = (q - 8) * d, low nibbles are elements 0..16, high nibbles 16..32.
//! - Q4_1 `{f16 d; f16 m; u8 qs[16]}`: x = q * d + m, same nibble order.
//! - Q5_0 `{f16 d; u8 qh[4]; u8 qs[16]}`: x = (q - 16) * d with q = nibble | (bit j of qh) << 4, the nibbles
//!   ordered as Q4_0's (element j < 16 in the low nibble of byte j, element j + 16 in its high nibble).
//! - Q8_0 `{f16 d; i8 qs[32]}`: x = q * d.
//! - Q4_K `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`: 8 sub-blocks of 32 with 6-bit scale/min each.
//! - Q6_K `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`: 16 groups of 16 with an i8 scale each.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use half::{bf16, f16};

use crate::KernelError;

/// Element types of weights the kernels understand, named after their GGML counterparts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16 (safetensors checkpoints).
    BF16,
    /// 4-bit symmetric, blocks of 32.
    Q4_0,
    /// 4-bit with offset, blocks of 32.
    Q4_1,
    /// 5-bit symmetric, blocks of 32 (Gemma 3's GGUF Q4_K_M files hold some weights in it).
    Q5_0,
    /// 8-bit symmetric, blocks of 32.
    Q8_0,
    /// 4-bit K-quant, super-blocks of 256.
    Q4K,
    /// 6-bit K-quant, super-blocks of 256.
    Q6K,
}

impl DType {
    /// Maps a GGUF tensor type id to a dtype; `None` for formats the kernels do not implement.
    pub fn from_ggml(type_id: u32) -> Option<DType> {
        Some(match type_id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            8 => DType::Q8_0,
            12 => DType::Q4K,
            14 => DType::Q6K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Elements per block: rows must be whole blocks.
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q8_0 => 32,
            DType::Q4K | DType::Q6K => 256,
        }
    }

    /// Bytes per block, to size and index weight buffers.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q8_0 => 34,
            DType::Q4K => 144,
            DType::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` elements (`cols` must be a multiple of `block_len`).
    pub fn row_bytes(self, cols: usize) -> usize {
        debug_assert_eq!(cols % self.block_len(), 0);
        cols / self.block_len() * self.block_bytes()
    }

    /// Whether the dtype is a block-quantized format (matmul quantizes activations for these).
    pub fn is_quantized(self) -> bool {
        !matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

/// Bytes of a weight tensor: owned, or a shared slice of a memory map (zero-copy GGUF).
#[derive(Clone)]
pub enum WeightBytes {
    /// Bytes owned by this weight (converted or synthesized tensors).
    Owned(Arc<Vec<u8>>),
    /// A range of a buffer owned elsewhere, typically a memory-mapped GGUF file.
    Shared {
        /// Keeps the underlying buffer alive.
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        /// Byte range of this tensor inside `owner`.
        range: Range<usize>,
    },
}

impl WeightBytes {
    /// The tensor's bytes, wherever they live.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            WeightBytes::Owned(v) => v.as_slice(),
            WeightBytes::Shared { owner, range } => &(**owner).as_ref()[range.clone()],
        }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.as_slice().len())
    }
}

/// A 2-D weight: `rows` output features, each a row of `cols` inputs stored in `dtype`'s block format (GGML layout).
#[derive(Clone, Debug)]
pub struct Matrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: WeightBytes,
    /// The AVX2 kernel's repacked copy of Q4_1 weights ([`pack_q4_1_pairs`]), built at most once and
    /// shared by clones.
    pairs: PairsCache,
}

/// Lazily built repacked weight bytes; its `Debug` prints the size only.
#[derive(Clone, Default)]
struct PairsCache(Arc<OnceLock<Vec<u8>>>);

impl std::fmt::Debug for PairsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.get() {
            Some(v) => write!(f, "PairsCache({} bytes)", v.len()),
            None => write!(f, "PairsCache(empty)"),
        }
    }
}

/// Bytes of one row pair × block pair of the [`pack_q4_1_pairs`] layout: 2 × 32 nibble bytes + 8 f16 scales.
pub(crate) const Q4_1_PAIR_BYTES: usize = 80;

/// Repacks Q4_1 rows for the AVX2 kernel, same size as the GGML layout: rows go in pairs (an odd last row
/// gets a zero partner) and blocks in pairs (an odd last block a zero partner); per row pair, per block pair
/// (A, B) 80 bytes: for each of the two rows 32 bytes whose byte k holds element k of block A in its low
/// nibble and element k of block B in its high nibble (one 256-bit load and one mask give a whole block in
/// element order, where the GGML layout needs a shift, two masks and a lane insert), then the f16 scales
/// `d0A d0B m0A m0B d1A d1B m1A m1B` (one conversion gives row 0's in the low 128-bit lane, row 1's in the
/// high). The quants and scales are the GGML ones, so the dot products are unchanged bit for bit.
pub(crate) fn pack_q4_1_pairs(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / 32;
    let (nbp, rb) = (nb.div_ceil(2), nb * 20);
    let mut out = vec![0u8; rows.div_ceil(2) * nbp * Q4_1_PAIR_BYTES];
    for (r, row) in bytes.chunks_exact(rb).enumerate().take(rows) {
        let (pair, half) = (r / 2, r % 2);
        for (b, blk) in row.chunks_exact(20).enumerate() {
            let dst = &mut out[(pair * nbp + b / 2) * Q4_1_PAIR_BYTES..][..Q4_1_PAIR_BYTES];
            let shift = 4 * (b % 2);
            let (lo, hi) = dst[32 * half..32 * half + 32].split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&blk[4..20]) {
                *l |= (q & 0x0F) << shift;
                *h |= (q >> 4) << shift;
            }
            // Scales: f16 slot (4 · row-in-pair + 2 · is-min + block-in-pair).
            for (j, src) in [0usize, 2].into_iter().enumerate() {
                let at = 64 + 2 * (4 * half + 2 * j + b % 2);
                dst[at..at + 2].copy_from_slice(&blk[src..src + 2]);
            }
        }
    }
    out
}

impl Matrix {
    /// Wraps weight bytes after checking that they hold exactly `rows` rows of `cols` elements.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: WeightBytes,
    ) -> Result<Matrix, KernelError> {
        if !cols.is_multiple_of(dtype.block_len()) {
            return Err(KernelError::RaggedRow {
                dtype,
                cols,
                block_len: dtype.block_len(),
            });
        }
        let expected = rows * dtype.row_bytes(cols);
        let got = data.as_slice().len();
        if expected != got {
            return Err(KernelError::SizeMismatch {
                dtype,
                rows,
                cols,
                expected,
                got,
            });
        }
        let m = Matrix {
            dtype,
            rows,
            cols,
            data,
            pairs: PairsCache::default(),
        };
        // Repack at load time, not in the first forward pass, when the AVX2 kernel will read it.
        if crate::matmul::uses_q4_1_pairs(dtype, crate::dispatch::isa()) {
            m.q4_1_pairs();
        }
        Ok(m)
    }

    /// The [`pack_q4_1_pairs`] copy of a Q4_1 weight, built on first use (AVX2 kernel only).
    pub(crate) fn q4_1_pairs(&self) -> &[u8] {
        debug_assert_eq!(self.dtype, DType::Q4_1);
        self.pairs
            .0
            .get_or_init(|| pack_q4_1_pairs(self.bytes(), self.rows, self.cols))
    }

    /// Builds an F32 weight from row-major floats (tests, converted checkpoints).
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(
            data.len(),
            rows * cols,
            "from_f32: data length must be rows * cols"
        );
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Matrix {
            dtype: DType::F32,
            rows,
            cols,
            data: WeightBytes::Owned(Arc::new(bytes)),
            pairs: PairsCache::default(),
        }
    }

    /// Element type of the stored rows.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// All rows' bytes, row-major.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols)
    }

    /// Rows `range` as a matrix sharing these bytes: a tensor-parallel rank's output features or a
    /// vocabulary slice of the head, without copying.
    pub fn slice_rows(&self, range: Range<usize>) -> Matrix {
        assert!(
            range.start <= range.end && range.end <= self.rows,
            "slice_rows {range:?} out of {} rows",
            self.rows
        );
        let rb = self.row_bytes();
        let (owner, base): (Arc<dyn AsRef<[u8]> + Send + Sync>, usize) = match &self.data {
            WeightBytes::Owned(v) => (Arc::clone(v) as _, 0),
            WeightBytes::Shared { owner, range } => (Arc::clone(owner), range.start),
        };
        Matrix {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            data: WeightBytes::Shared {
                owner,
                range: base + range.start * rb..base + range.end * rb,
            },
            pairs: PairsCache::default(),
        }
    }

    /// Decodes one row to f32 (embedding lookup; `out.len() == cols`).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "row {row} out of range for {} rows",
            self.rows
        );
        assert_eq!(out.len(), self.cols);
        let rb = self.row_bytes();
        dequantize(self.dtype, &self.bytes()[row * rb..(row + 1) * rb], out);
    }
}

/// Reads a little-endian f16 at `b[0..2]` as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Reference decoder of whole blocks: `out.len()` elements from `src` (which holds exactly those blocks).
pub fn dequantize(dtype: DType, src: &[u8], out: &mut [f32]) {
    let bl = dtype.block_len();
    assert_eq!(out.len() % bl, 0, "dequantize: output is not whole blocks");
    assert_eq!(
        src.len(),
        out.len() / bl * dtype.block_bytes(),
        "dequantize: source size mismatch"
    );
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = f16_at(b);
                for j in 0..16 {
                    o[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                    o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let d = f16_at(b);
                let m = f16_at(&b[2..]);
                for j in 0..16 {
                    o[j] = (b[4 + j] & 0xF) as f32 * d + m;
                    o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(22)) {
                let d = f16_at(b);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = (q5_0_value(b, j) - 16) as f32 * d;
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = f16_at(b);
                for j in 0..32 {
                    o[j] = b[2 + j] as i8 as f32 * d;
                }
            }
        }
        DType::Q4K => {
            for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(144)) {
                let d = f16_at(b);
                let dmin = f16_at(&b[2..]);
                let scales = &b[4..16];
                let qs = &b[16..144];
                for c in 0..4 {
                    let (sc0, m0) = scale_min_k4(2 * c, scales);
                    let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
                    let (d0, mm0) = (d * sc0 as f32, dmin * m0 as f32);
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        o[64 * c + l] = d0 * (q & 0xF) as f32 - mm0;
                        o[64 * c + 32 + l] = d1 * (q >> 4) as f32 - mm1;
                    }
                }
            }
        }
        DType::Q6K => {
            for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(210)) {
                let d = f16_at(&b[208..]);
                for (i, v) in o.iter_mut().enumerate() {
                    let sc = b[192 + i / 16] as i8 as f32;
                    *v = d * sc * (q6k_value(b, i) - 32) as f32;
                }
            }
        }
    }
}

/// Elements sharing one (scale, min) pair in [`affine_codes`]: 32 for the 32-element formats and
/// Q4_K's sub-blocks, 16 for Q6_K's; `None` for the float types, which have no codes.
pub fn affine_group(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => None,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q8_0 | DType::Q4K => Some(32),
        DType::Q6K => Some(16),
    }
}

/// Whether every code [`affine_codes`] gives for `dtype` lies in 0..16 (a 4-bit unsigned code).
pub fn affine_codes_are_u4(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q4K)
}

/// The blocks in `src` as integer codes and one (scale, min) pair per [`affine_group`] elements:
/// element i is `scale * codes[i] as f32 + min` of its group, which equals what [`dequantize`] gives
/// (as floats: a zero may differ in sign). Block formats are decoded once here so that a backend can
/// lay the codes out its own way (the CUDA backend's GEMVs read them without the GGML block headers).
pub fn affine_codes(dtype: DType, src: &[u8], codes: &mut [i8], params: &mut Vec<(f32, f32)>) {
    let group = affine_group(dtype).expect("affine_codes takes a block-quantized dtype");
    let bl = dtype.block_len();
    assert_eq!(
        codes.len() % bl,
        0,
        "affine_codes: output is not whole blocks"
    );
    assert_eq!(
        src.len(),
        codes.len() / bl * dtype.block_bytes(),
        "affine_codes: source size mismatch"
    );
    params.reserve(codes.len() / group);
    for (o, b) in codes
        .chunks_exact_mut(bl)
        .zip(src.chunks_exact(dtype.block_bytes()))
    {
        match dtype {
            DType::Q4_0 | DType::Q4_1 => {
                let at = if dtype == DType::Q4_0 { 2 } else { 4 };
                for j in 0..16 {
                    o[j] = (b[at + j] & 0xF) as i8;
                    o[j + 16] = (b[at + j] >> 4) as i8;
                }
                let d = f16_at(b);
                // (q - 8) * d is exact in f32 (an f16 times a 4-bit integer), and so is q * d - 8 * d.
                let min = if dtype == DType::Q4_0 {
                    -8.0 * d
                } else {
                    f16_at(&b[2..])
                };
                params.push((d, min));
            }
            DType::Q5_0 => {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = (q5_0_value(b, j) - 16) as i8;
                }
                params.push((f16_at(b), 0.0));
            }
            DType::Q8_0 => {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = b[2 + j] as i8;
                }
                params.push((f16_at(b), 0.0));
            }
            DType::Q4K => {
                let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
                let (scales, qs) = (&b[4..16], &b[16..144]);
                for c in 0..4 {
                    for half in 0..2 {
                        let (sc, m) = scale_min_k4(2 * c + half, scales);
                        params.push((d * sc as f32, -(dmin * m as f32)));
                        for l in 0..32 {
                            let q = qs[32 * c + l];
                            o[64 * c + 32 * half + l] =
                                if half == 0 { q & 0xF } else { q >> 4 } as i8;
                        }
                    }
                }
            }
            DType::Q6K => {
                let d = f16_at(&b[208..]);
                for g in 0..16 {
                    params.push((d * b[192 + g] as i8 as f32, 0.0));
                }
                for (i, v) in o.iter_mut().enumerate() {
                    *v = (q6k_value(b, i) - 32) as i8;
                }
            }
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("no codes"),
        }
    }
}

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block (llama.cpp's `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The unsigned 5-bit quant (0..32) of element `j` (0..32) of a Q5_0 block: its nibble and bit `j` of `qh`.
#[inline(always)]
pub(crate) fn q5_0_value(b: &[u8], j: usize) -> i32 {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let nib = if j < 16 {
        b[6 + j] & 0xF
    } else {
        b[6 + j - 16] >> 4
    };
    (nib as u32 | ((qh >> j) & 1) << 4) as i32
}

/// The unsigned 6-bit quant (0..64) of element `i` (0..256) of a Q6_K block.
#[inline(always)]
pub(crate) fn q6k_value(b: &[u8], i: usize) -> i32 {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let half = i / 128;
    let e = i % 128;
    let l = e % 32;
    let quarter = e / 32;
    let lo = ql[64 * half + l + 32 * (quarter & 1)];
    let lo = if quarter >= 2 { lo >> 4 } else { lo & 0xF };
    let hi = (qh[32 * half + l] >> (2 * quarter)) & 3;
    (lo | (hi << 4)) as i32
}

/// Reference encoder: appends the blocks of `x` (whole blocks) in `dtype`'s format to `out`.
///
/// Used by tests and tools to build weights; simple round-to-nearest, not llama.cpp's optimizing search.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let bl = dtype.block_len();
    assert_eq!(x.len() % bl, 0, "quantize_row: input is not whole blocks");
    match dtype {
        DType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::Q4_0 => {
            for b in x.chunks_exact(32) {
                let max = b
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        DType::Q5_0 => {
            for b in x.chunks_exact(32) {
                let max = b
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u32> = b
                    .iter()
                    .map(|&v| ((v * id + 16.5) as i32).clamp(0, 31) as u32)
                    .collect();
                let qh = q
                    .iter()
                    .enumerate()
                    .fold(0u32, |h, (j, &v)| h | (v >> 4) << j);
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&qh.to_le_bytes());
                out.extend((0..16).map(|j| (q[j] & 0xF) as u8 | ((q[j + 16] & 0xF) as u8) << 4));
            }
        }
        DType::Q4_1 => {
            for b in x.chunks_exact(32) {
                let min = b.iter().cloned().fold(f32::INFINITY, f32::min);
                let max = b.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        DType::Q8_0 => {
            for b in x.chunks_exact(32) {
                let amax = b.iter().fold(0f32, |a, &v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|&v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4K => x.chunks_exact(256).for_each(|b| quantize_q4k_block(b, out)),
        DType::Q6K => x.chunks_exact(256).for_each(|b| quantize_q6k_block(b, out)),
    }
}

fn quantize_q4k_block(x: &[f32], out: &mut Vec<u8>) {
    // Per sub-block affine range [min, max] with min <= 0 (the format subtracts a non-negative min).
    let mut scale = [0f32; 8];
    let mut minv = [0f32; 8];
    for j in 0..8 {
        let s = &x[32 * j..32 * j + 32];
        let mn = s.iter().cloned().fold(f32::INFINITY, f32::min).min(0.0);
        let mx = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        scale[j] = (mx - mn) / 15.0;
        minv[j] = -mn;
    }
    let max_scale = scale.iter().cloned().fold(0f32, f32::max);
    let max_min = minv.iter().cloned().fold(0f32, f32::max);
    let d = max_scale / 63.0;
    let dmin = max_min / 63.0;
    let d16 = f16::from_f32(d);
    let dmin16 = f16::from_f32(dmin);
    let (dq, dminq) = (d16.to_f32(), dmin16.to_f32());
    let mut sc = [0u8; 8];
    let mut mq = [0u8; 8];
    for j in 0..8 {
        sc[j] = if dq > 0.0 {
            (scale[j] / dq).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        mq[j] = if dminq > 0.0 {
            (minv[j] / dminq).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
    }
    out.extend_from_slice(&d16.to_le_bytes());
    out.extend_from_slice(&dmin16.to_le_bytes());
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mq[j] | ((mq[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0xF) | ((mq[j + 4] & 0xF) << 4);
    }
    out.extend_from_slice(&scales);
    let mut q = [0u8; 256];
    for j in 0..8 {
        let ds = dq * sc[j] as f32;
        let dm = dminq * mq[j] as f32;
        for l in 0..32 {
            let v = x[32 * j + l];
            q[32 * j + l] = if ds > 0.0 {
                ((v + dm) / ds).round().clamp(0.0, 15.0) as u8
            } else {
                0
            };
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            out.push(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        }
    }
}

fn quantize_q6k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut gscale = [0f32; 16];
    for g in 0..16 {
        let amax = x[16 * g..16 * g + 16]
            .iter()
            .fold(0f32, |a, &v| a.max(v.abs()));
        gscale[g] = amax / 31.0;
    }
    let max_scale = gscale.iter().cloned().fold(0f32, f32::max);
    let d16 = f16::from_f32(max_scale / 127.0);
    let d = d16.to_f32();
    let mut sc = [0i8; 16];
    for g in 0..16 {
        sc[g] = if d > 0.0 {
            (gscale[g] / d).round().clamp(-128.0, 127.0) as i8
        } else {
            0
        };
    }
    let mut q = [0u8; 256];
    for (i, qi) in q.iter_mut().enumerate() {
        let s = d * sc[i / 16] as f32;
        let v = if s != 0.0 {
            (x[i] / s).round().clamp(-32.0, 31.0) as i32
        } else {
            0
        };
        *qi = (v + 32) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        for l in 0..32 {
            let base = 128 * half;
            let (q1, q2, q3, q4) = (
                q[base + l],
                q[base + l + 32],
                q[base + l + 64],
                q[base + l + 96],
            );
            ql[64 * half + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[64 * half + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d16.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::tests::ALL;
    use rand::{Rng, SeedableRng};

    pub(crate) fn random_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Codes and (scale, min) pairs rebuild every element of every block format as the reference
    /// decoder gives it, and 4-bit formats' codes stay in 0..16.
    #[test]
    fn affine_codes_rebuild_the_reference_decoder() {
        for dtype in ALL.into_iter().filter(|d| d.is_quantized()) {
            let group = affine_group(dtype).unwrap();
            let x = random_vec(512, 7);
            let mut bytes = Vec::new();
            quantize_row(dtype, &x, &mut bytes);
            let mut want = vec![0f32; x.len()];
            dequantize(dtype, &bytes, &mut want);
            let mut codes = vec![0i8; x.len()];
            let mut params = Vec::new();
            affine_codes(dtype, &bytes, &mut codes, &mut params);
            assert_eq!(params.len(), x.len() / group, "{dtype:?}");
            for (i, (&c, &w)) in codes.iter().zip(&want).enumerate() {
                let (scale, min) = params[i / group];
                assert_eq!(scale * c as f32 + min, w, "{dtype:?} element {i}");
                if affine_codes_are_u4(dtype) {
                    assert!((0..16).contains(&c), "{dtype:?} code {c}");
                }
            }
        }
    }

    /// The AVX2 repacked Q4_1 layout holds every quant and scale of the GGML rows where its kernel reads
    /// them (odd row and block counts included: their padding partners stay zero), so each element
    /// decodes from it to the GGML decoder's bits.
    #[test]
    fn q4_1_pairs_layout_holds_every_quant_and_scale() {
        for &(rows, cols) in &[(1, 32), (7, 96), (6, 64), (13, 576)] {
            let w = crate::matmul::tests::quantized_matrix(DType::Q4_1, rows, cols, 5);
            let packed = pack_q4_1_pairs(w.bytes(), rows, cols);
            let nbp = (cols / 32).div_ceil(2);
            assert_eq!(packed.len(), rows.div_ceil(2) * nbp * Q4_1_PAIR_BYTES);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for (k, &v) in row.iter().enumerate() {
                    let (b, e) = (k / 32, k % 32);
                    let at = ((r / 2) * nbp + b / 2) * Q4_1_PAIR_BYTES;
                    let blk = &packed[at..at + Q4_1_PAIR_BYTES];
                    let q = (blk[32 * (r % 2) + e] >> (4 * (b % 2))) & 0x0F;
                    let scale = |j: usize| f16_at(&blk[64 + 2 * (4 * (r % 2) + 2 * j + b % 2)..]);
                    let (d, m) = (scale(0), scale(1));
                    assert_eq!(
                        (q as f32 * d + m).to_bits(),
                        v.to_bits(),
                        "{rows}x{cols} [{r}][{k}]"
                    );
                }
            }
            // Padding: the zero partner row of an odd count, the zero partner block of an odd count.
            if rows % 2 == 1 {
                let last = (rows / 2) * nbp * Q4_1_PAIR_BYTES;
                for q in 0..nbp {
                    let blk = &packed[last + q * Q4_1_PAIR_BYTES..][..Q4_1_PAIR_BYTES];
                    assert!(blk[32..64].iter().chain(&blk[72..80]).all(|&b| b == 0));
                }
            }
        }
    }

    /// Row slices decode to exactly the corresponding rows of the whole matrix, in every format.
    #[test]
    fn slices_decode_to_the_same_elements() {
        let (rows, cols) = (6, 512);
        for dt in ALL {
            let x = random_vec(rows * cols, 11);
            let mut bytes = Vec::new();
            for r in x.chunks_exact(cols) {
                let mut row = Vec::new();
                quantize_row(dt, r, &mut row);
                bytes.extend_from_slice(&row);
            }
            let m = Matrix::new(dt, rows, cols, WeightBytes::Owned(Arc::new(bytes))).unwrap();
            let full = |m: &Matrix, r: usize| {
                let mut o = vec![0.0; m.cols()];
                m.dequantize_row(r, &mut o);
                o
            };
            let sub = m.slice_rows(2..5);
            assert_eq!(sub.rows(), 3);
            for r in 0..3 {
                assert_eq!(full(&sub, r), full(&m, r + 2), "{dt:?} rows");
            }
            let twice = sub.slice_rows(1..2);
            assert_eq!(full(&twice, 0), full(&m, 3), "{dt:?} nested rows");
        }
    }

    #[test]
    fn ggml_ids_round_trip_sizes() {
        assert_eq!(DType::from_ggml(3), Some(DType::Q4_1));
        assert_eq!(DType::from_ggml(30), Some(DType::BF16));
        assert_eq!(DType::from_ggml(6), Some(DType::Q5_0));
        assert_eq!(DType::from_ggml(7), None);
        assert_eq!(DType::Q5_0.row_bytes(640), 20 * 22);
        assert_eq!(DType::Q4K.row_bytes(512), 288);
        assert_eq!(DType::Q8_0.row_bytes(576), 18 * 34);
    }

    /// Quantize then dequantize must reproduce the input within the format's step size.
    #[test]
    fn quantize_dequantize_round_trip() {
        for dt in ALL {
            let x = random_vec(1024, 7);
            let mut bytes = Vec::new();
            quantize_row(dt, &x, &mut bytes);
            assert_eq!(bytes.len(), dt.row_bytes(1024), "{dt:?}");
            let mut y = vec![0f32; 1024];
            dequantize(dt, &bytes, &mut y);
            let tol = match dt {
                DType::F32 => 0.0,
                DType::F16 => 1e-3,
                DType::BF16 => 8e-3,
                DType::Q8_0 => 0.01,
                DType::Q6K => 0.04,
                DType::Q4_1 => 0.09,
                // Asymmetric range: the +|max| side clamps at q = 15, up to one full step.
                DType::Q4_0 => 0.13,
                DType::Q5_0 => 0.07,
                DType::Q4K => 0.12,
            };
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{dt:?}: max error {err} > {tol}");
        }
    }

    #[test]
    fn q4_1_layout_is_ggml() {
        // d = 1, m = -8: element j = low nibble of byte j, element j+16 = high nibble.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-8.0).to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize(DType::Q4_1, &b, &mut y);
        assert_eq!(y[3], 3.0 - 8.0);
        assert_eq!(y[16 + 3], 12.0 - 8.0);
    }

    #[test]
    fn matrix_checks_sizes() {
        let data = WeightBytes::Owned(Arc::new(vec![0u8; 20 * 3]));
        assert!(Matrix::new(DType::Q4_1, 3, 32, data.clone()).is_ok());
        assert!(matches!(
            Matrix::new(DType::Q4_1, 2, 32, data.clone()),
            Err(KernelError::SizeMismatch { .. })
        ));
        assert!(matches!(
            Matrix::new(DType::Q4_1, 3, 30, data),
            Err(KernelError::RaggedRow { .. })
        ));
        let m = Matrix::from_f32(2, 2, vec![1.0, 2.0, 3.0, 4.0]);
        let mut r = [0f32; 2];
        m.dequantize_row(1, &mut r);
        assert_eq!(r, [3.0, 4.0]);
    }
}
