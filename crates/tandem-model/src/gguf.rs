//! A zero-copy GGUF (v2/v3) reader: the header, metadata and tensor table are parsed once, and
//! tensor data stays in the memory map so quantized blocks reach the kernels without copies.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use tandem_kernels::{DType, WeightBytes};

use crate::error::ModelError;

/// "GGUF" read as a little-endian u32.
const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the tensor data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Refuse absurd counts before allocating for them (a corrupt header must not exhaust memory).
const MAX_COUNT: u64 = 1 << 32;

/// What is wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file does not start with the GGUF magic.
    #[error("bad magic {0:#010x}: not a GGUF file")]
    BadMagic(u32),
    /// The format version is one we do not read (v1 used 32-bit lengths; big-endian files look like huge versions).
    #[error("unsupported GGUF version {0} (only 2 and 3 are read)")]
    UnsupportedVersion(u32),
    /// The file ends before the structure being read.
    #[error("truncated while reading {what} at byte {offset}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it started.
        offset: usize,
    },
    /// A string is not valid UTF-8.
    #[error("invalid UTF-8 in {0}")]
    BadUtf8(String),
    /// A metadata value has a type id outside the specification.
    #[error("metadata key {key}: unknown value type {type_id}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// A count or size is implausibly large.
    #[error("{what} is implausibly large ({value})")]
    TooLarge {
        /// What was counted.
        what: String,
        /// The value found.
        value: u64,
    },
    /// A tensor uses a ggml type we have no kernel for.
    #[error("tensor {tensor}: unsupported ggml type {type_id}")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The ggml type id.
        type_id: u32,
    },
    /// A tensor's shape is not a whole number of quantization blocks.
    #[error("tensor {tensor}: shape {shape:?} does not fit {dtype:?} blocks")]
    BadShape {
        /// The tensor's name.
        tensor: String,
        /// Its dimensions, innermost first.
        shape: Vec<u64>,
        /// Its element type.
        dtype: DType,
    },
    /// A tensor's data lies outside the file.
    #[error("tensor {tensor}: data range {start}..{end} exceeds file size {file_len}")]
    OutOfBounds {
        /// The tensor's name.
        tensor: String,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// The file's size.
        file_len: usize,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("invalid general.alignment {0}")]
    BadAlignment(u64),
    /// Two tensors share a name.
    #[error("duplicate tensor name {0}")]
    DuplicateTensor(String),
}

/// One metadata value, typed as the file stores it.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// GGUF type 0.
    U8(u8),
    /// GGUF type 1.
    I8(i8),
    /// GGUF type 2.
    U16(u16),
    /// GGUF type 3.
    I16(i16),
    /// GGUF type 4.
    U32(u32),
    /// GGUF type 5.
    I32(i32),
    /// GGUF type 6.
    F32(f32),
    /// GGUF type 7.
    Bool(bool),
    /// GGUF type 8.
    String(String),
    /// GGUF type 9: a homogeneous array (possibly of arrays).
    Array(Vec<GgufValue>),
    /// GGUF type 10.
    U64(u64),
    /// GGUF type 11.
    I64(i64),
    /// GGUF type 12.
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is any non-negative integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer type that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    /// Dimensions, innermost (contiguous) first, as ggml orders them.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
    /// Absolute byte range of the data in the file.
    pub range: Range<usize>,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A parsed GGUF file whose tensor data is served from a shared memory map.
pub struct GgufFile {
    /// The format version (2 or 3).
    pub version: u32,
    /// Metadata, in file order.
    pub metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    tensors: HashMap<String, GgufTensorInfo>,
    tensor_order: Vec<String>,
    data: Arc<dyn AsRef<[u8]> + Send + Sync>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` and parses its header.
    pub fn open(path: &Path) -> Result<GgufFile, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only; like every mmap-based loader we rely on the file not being
        // truncated or rewritten while the model is loaded.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        GgufFile::parse(Arc::new(map)).map_err(|source| ModelError::Gguf {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses a GGUF image held by `data` (a memory map, or bytes in tests).
    pub fn parse(data: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Result<GgufFile, GgufError> {
        let bytes: &[u8] = (*data).as_ref();
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.count("tensor count")?;
        let n_kv = r.count("metadata count")?;

        let mut metadata = Vec::with_capacity(n_kv.min(4096));
        let mut index = HashMap::with_capacity(n_kv.min(4096));
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let type_id = r.u32(&key)?;
            let value = r.value(&key, type_id, 0)?;
            index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            Some(v) => {
                let a = v.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
            None => DEFAULT_ALIGNMENT,
        };

        let mut raw = Vec::with_capacity(n_tensors.min(65536));
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32(&name)?;
            if n_dims > 8 {
                return Err(GgufError::TooLarge {
                    what: format!("dimension count of {name}"),
                    value: n_dims.into(),
                });
            }
            let mut shape = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                shape.push(r.u64(&name)?);
            }
            let type_id = r.u32(&name)?;
            let offset = r.u64(&name)?;
            raw.push((name, shape, type_id, offset));
        }
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = HashMap::with_capacity(raw.len());
        let mut tensor_order = Vec::with_capacity(raw.len());
        for (name, shape, type_id, offset) in raw {
            let dtype =
                DType::from_ggml(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                    tensor: name.clone(),
                    type_id,
                })?;
            let inner = shape.first().copied().unwrap_or(1);
            if inner % dtype.block_len() as u64 != 0 {
                return Err(GgufError::BadShape {
                    tensor: name,
                    shape,
                    dtype,
                });
            }
            let elements = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let size = elements
                .and_then(|e| {
                    (e / dtype.block_len() as u64).checked_mul(dtype.block_bytes() as u64)
                })
                .ok_or_else(|| GgufError::TooLarge {
                    what: format!("size of {name}"),
                    value: u64::MAX,
                })?;
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size));
            let (start, end) = match (start, end) {
                (Some(s), Some(e)) if e <= bytes.len() as u64 => (s, e),
                _ => {
                    return Err(GgufError::OutOfBounds {
                        tensor: name,
                        start: data_start.saturating_add(offset),
                        end: data_start.saturating_add(offset).saturating_add(size),
                        file_len: bytes.len(),
                    })
                }
            };
            let info = GgufTensorInfo {
                shape,
                dtype,
                range: start as usize..end as usize,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(GgufError::DuplicateTensor(name));
            }
            tensor_order.push(name);
        }
        Ok(GgufFile {
            version,
            metadata,
            index,
            tensors,
            tensor_order,
            data,
        })
    }

    /// Looks up a metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Looks up a tensor's table entry.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.get(name)
    }

    /// Tensor names in file order (the order identity hashing and progress use).
    pub fn tensor_names(&self) -> &[String] {
        &self.tensor_order
    }

    /// A tensor's bytes as a zero-copy slice of the map.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> WeightBytes {
        WeightBytes::Shared {
            owner: self.data.clone(),
            range: info.range.clone(),
        }
    }
}

/// Bounds-checked little-endian cursor over the file image.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn count(&mut self, what: &str) -> Result<usize, GgufError> {
        let v = self.u64(what)?;
        if v > MAX_COUNT {
            return Err(GgufError::TooLarge {
                what: what.to_string(),
                value: v,
            });
        }
        Ok(v as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.bytes.len() as u64 {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
            });
        }
        let s = self.take(len as usize, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::BadUtf8(what.to_string()))
    }

    fn value(&mut self, key: &str, type_id: u32, depth: usize) -> Result<GgufValue, GgufError> {
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => GgufValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => GgufValue::String(self.string(key)?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::TooLarge {
                        what: format!("array nesting of {key}"),
                        value: depth as u64,
                    });
                }
                let elem_type = self.u32(key)?;
                let len = self.count(key)?;
                // Every element takes at least one byte: a length beyond the file is corruption.
                if len > self.bytes.len() - self.pos {
                    return Err(GgufError::Truncated {
                        what: key.to_string(),
                        offset: self.pos,
                    });
                }
                let mut items = Vec::with_capacity(len);
                for _ in 0..len {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            _ => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_string(),
                    type_id,
                })
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds small GGUF images for tests.
    #[derive(Default)]
    pub(crate) struct GgufWriter {
        kv: Vec<u8>,
        n_kv: u64,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    impl GgufWriter {
        fn str(buf: &mut Vec<u8>, s: &str) {
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }

        pub(crate) fn kv_raw(&mut self, key: &str, type_id: u32, payload: &[u8]) -> &mut Self {
            Self::str(&mut self.kv, key);
            self.kv.extend_from_slice(&type_id.to_le_bytes());
            self.kv.extend_from_slice(payload);
            self.n_kv += 1;
            self
        }

        pub(crate) fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv_raw(key, 4, &v.to_le_bytes())
        }

        pub(crate) fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.kv_raw(key, 6, &v.to_le_bytes())
        }

        pub(crate) fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut p = Vec::new();
            Self::str(&mut p, v);
            self.kv_raw(key, 8, &p)
        }

        pub(crate) fn kv_str_array(&mut self, key: &str, items: &[&str]) -> &mut Self {
            let mut p = Vec::new();
            p.extend_from_slice(&8u32.to_le_bytes());
            p.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for s in items {
                Self::str(&mut p, s);
            }
            self.kv_raw(key, 9, &p)
        }

        pub(crate) fn tensor_f32(&mut self, name: &str, shape: &[u64], data: &[f32]) -> &mut Self {
            let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.tensors
                .push((name.to_string(), shape.to_vec(), 0, bytes));
            self
        }

        pub(crate) fn finish(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            let mut offset = 0u64;
            for (name, shape, ty, data) in &self.tensors {
                Self::str(&mut out, name);
                out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
                for d in shape {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                offset += (data.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
            }
            out.resize(
                out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize,
                0,
            );
            for (_, _, _, data) in &self.tensors {
                out.extend_from_slice(data);
                out.resize(
                    out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize,
                    0,
                );
            }
            out
        }
    }

    fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Arc::new(bytes))
    }

    #[test]
    fn reads_metadata_of_every_type_and_tensors() {
        let mut w = GgufWriter::default();
        w.kv_raw("u8", 0, &[7])
            .kv_raw("i8", 1, &[0xff])
            .kv_raw("u16", 2, &513u16.to_le_bytes())
            .kv_raw("i16", 3, &(-2i16).to_le_bytes())
            .kv_u32("u32", 70000)
            .kv_raw("i32", 5, &(-5i32).to_le_bytes())
            .kv_f32("f32", 1.5)
            .kv_raw("bool", 7, &[1])
            .kv_str("str", "héllo")
            .kv_str_array("arr", &["a", "b c"])
            .kv_raw("u64", 10, &(1u64 << 40).to_le_bytes())
            .kv_raw("i64", 11, &(-9i64).to_le_bytes())
            .kv_raw("f64", 12, &2.25f64.to_le_bytes())
            .tensor_f32("w", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .tensor_f32("b", &[4], &[9.0; 4]);
        let f = parse(w.finish()).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.get("u8"), Some(&GgufValue::U8(7)));
        assert_eq!(f.get("i8"), Some(&GgufValue::I8(-1)));
        assert_eq!(f.get("u16").and_then(GgufValue::as_u64), Some(513));
        assert_eq!(f.get("i16").and_then(GgufValue::as_i64), Some(-2));
        assert_eq!(f.get("u32").and_then(GgufValue::as_u64), Some(70000));
        assert_eq!(f.get("i32").and_then(GgufValue::as_i64), Some(-5));
        assert_eq!(f.get("f32").and_then(GgufValue::as_f64), Some(1.5));
        assert_eq!(f.get("bool").and_then(GgufValue::as_bool), Some(true));
        assert_eq!(f.get("str").and_then(GgufValue::as_str), Some("héllo"));
        let arr = f.get("arr").and_then(GgufValue::as_array).unwrap();
        assert_eq!(
            arr,
            &[
                GgufValue::String("a".into()),
                GgufValue::String("b c".into())
            ]
        );
        assert_eq!(f.get("u64").and_then(GgufValue::as_u64), Some(1 << 40));
        assert_eq!(f.get("i64").and_then(GgufValue::as_i64), Some(-9));
        assert_eq!(f.get("f64").and_then(GgufValue::as_f64), Some(2.25));
        assert_eq!(f.tensor_names(), &["w".to_string(), "b".to_string()]);
        let w = f.tensor("w").unwrap();
        assert_eq!(w.shape, vec![2, 3]);
        assert_eq!(w.dtype, DType::F32);
        let bytes = f.tensor_bytes(w);
        let vals: Vec<f32> = bytes
            .as_slice()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = f.tensor("b").unwrap();
        assert_eq!(b.range.start % 32, 0);
    }

    #[test]
    fn rejects_bad_magic_and_version() {
        assert!(matches!(
            parse(b"GGML\x03\0\0\0".to_vec()),
            Err(GgufError::BadMagic(_))
        ));
        let mut img = GgufWriter::default().finish();
        img[4] = 1;
        assert!(matches!(parse(img), Err(GgufError::UnsupportedVersion(1))));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let mut w = GgufWriter::default();
        w.kv_str("general.architecture", "llama")
            .kv_str_array("x", &["a", "b"])
            .tensor_f32("t", &[4], &[1.0; 4]);
        let img = w.finish();
        let end = parse(img.clone()).unwrap().tensor("t").unwrap().range.end;
        // Cutting anywhere inside the header or the tensor data must give a typed error.
        for cut in 0..end {
            let r = parse(img[..cut].to_vec());
            assert!(r.is_err(), "cut at {cut} parsed");
        }
    }

    #[test]
    fn unknown_value_type_names_the_key() {
        let mut w = GgufWriter::default();
        w.kv_raw("weird", 99, &[]);
        match parse(w.finish()) {
            Err(GgufError::UnknownValueType { key, type_id: 99 }) => assert_eq!(key, "weird"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn rejects_invalid_alignment() {
        let mut w = GgufWriter::default();
        w.kv_u32("general.alignment", 3);
        assert!(matches!(parse(w.finish()), Err(GgufError::BadAlignment(3))));
    }
}
