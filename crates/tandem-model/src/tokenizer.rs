//! Tokenizer wrapper over the `tokenizers` crate: loaded from an HF `tokenizer.json`, or built from the
//! vocabulary embedded in GGUF metadata so that a lone `.gguf` file is servable.

use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use crate::error::ModelError;
use crate::gguf::{GgufFile, GgufValue};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
mod token_type {
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// SentencePiece's word-boundary marker.
const SPM_SPACE: &str = "\u{2581}";

/// Tokenizer wrapper (Arc inside; Clone is cheap; Send + Sync).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    bos: Option<String>,
    eos: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Loads an HF `tokenizer.json` (bos/eos strings can be attached with [`Tokenizer::with_special_tokens`]).
    pub fn from_file(path: &Path) -> Result<Tokenizer, ModelError> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer {
            inner: Arc::new(inner),
            bos: None,
            eos: None,
        })
    }

    /// Wraps an already-built `tokenizers` tokenizer.
    pub fn from_inner(
        inner: tokenizers::Tokenizer,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Tokenizer {
        Tokenizer {
            inner: Arc::new(inner),
            bos,
            eos,
        }
    }

    /// Sets the bos/eos token strings (HF keeps them in tokenizer_config.json, not tokenizer.json).
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Tokenizer {
        self.bos = bos;
        self.eos = eos;
        self
    }

    /// Builds the tokenizer described by GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer, ModelError> {
        let model = gguf
            .get("tokenizer.ggml.model")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| ModelError::Tokenizer("GGUF lacks tokenizer.ggml.model".into()))?;
        let tokens: Vec<&str> = gguf
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .ok_or_else(|| ModelError::Tokenizer("GGUF lacks tokenizer.ggml.tokens".into()))?
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    ModelError::Tokenizer("non-string token in tokenizer.ggml.tokens".into())
                })
            })
            .collect::<Result<_, _>>()?;
        let types: Vec<i64> = match gguf
            .get("tokenizer.ggml.token_type")
            .and_then(GgufValue::as_array)
        {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let id_of = |key: &str| gguf.get(key).and_then(GgufValue::as_u64).map(|v| v as u32);
        let name_of = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
        };
        let bos = name_of(id_of("tokenizer.ggml.bos_token_id"));
        let eos = name_of(id_of("tokenizer.ggml.eos_token_id"));
        let flag = |key: &str| gguf.get(key).and_then(GgufValue::as_bool);
        let spec = GgufVocab {
            tokens: &tokens,
            types: &types,
            bos: id_of("tokenizer.ggml.bos_token_id"),
            unk: id_of("tokenizer.ggml.unknown_token_id"),
            add_bos: flag("tokenizer.ggml.add_bos_token"),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix"),
        };
        let inner = match model {
            "gpt2" => {
                let merges: Vec<&str> = gguf
                    .get("tokenizer.ggml.merges")
                    .and_then(GgufValue::as_array)
                    .ok_or_else(|| {
                        ModelError::Tokenizer("gpt2 tokenizer without tokenizer.ggml.merges".into())
                    })?
                    .iter()
                    .filter_map(GgufValue::as_str)
                    .collect();
                let pre = gguf
                    .get("tokenizer.ggml.pre")
                    .and_then(GgufValue::as_str)
                    .unwrap_or("default");
                build_gpt2(&spec, &merges, pre)?
            }
            "llama" => {
                let scores: Vec<f32> = match gguf
                    .get("tokenizer.ggml.scores")
                    .and_then(GgufValue::as_array)
                {
                    Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
                    None => {
                        return Err(ModelError::Tokenizer(
                            "llama tokenizer without tokenizer.ggml.scores".into(),
                        ))
                    }
                };
                build_spm(&spec, &scores)?
            }
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "unsupported GGUF tokenizer model {other:?}"
                )))
            }
        };
        Ok(Tokenizer {
            inner: Arc::new(inner),
            bos,
            eos,
        })
    }

    /// Text to token ids; `add_special_tokens` adds bos etc. as the tokenizer's post-processor defines.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a vocabulary piece or added token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The raw vocabulary piece of an id (e.g. "Ġthe", "<|im_end|>").
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The beginning-of-sequence token string, for chat templates.
    pub fn bos_token(&self) -> Option<String> {
        self.bos.clone()
    }

    /// The end-of-sequence token string, for chat templates.
    pub fn eos_token(&self) -> Option<String> {
        self.eos.clone()
    }

    /// Every id's bytes as the model emits them, for guided decoding's token trie: byte-level BPE
    /// pieces mapped back through GPT-2's byte-to-character table, SentencePiece pieces with `▁` as a
    /// space and `<0xHH>` as that byte. Special (control) tokens are flagged and carry their name.
    pub fn token_pieces(&self) -> Vec<TokenPiece> {
        let byte_level = matches!(self.inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let unbyte = byte_level.then(gpt2_char_to_byte);
        let specials = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size() as u32)
            .map(|id| {
                let Some(piece) = self.inner.id_to_token(id) else {
                    return TokenPiece::default();
                };
                if specials.get(&id).is_some_and(|t| t.special) {
                    return TokenPiece {
                        bytes: piece.into_bytes(),
                        special: true,
                    };
                }
                let bytes = match &unbyte {
                    Some(map) => piece
                        .chars()
                        .map(|c| map.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        // A piece outside the byte alphabet is an added plain-text token.
                        .unwrap_or_else(|| piece.clone().into_bytes()),
                    None => spm_piece_bytes(&piece),
                };
                TokenPiece {
                    bytes,
                    special: false,
                }
            })
            .collect()
    }

    /// The underlying `tokenizers` tokenizer, for callers that need offsets or batching.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// One vocabulary entry as raw bytes, from [`Tokenizer::token_pieces`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenPiece {
    /// The bytes the token stands for (a special token's name, e.g. `<|im_end|>`).
    pub bytes: Vec<u8>,
    /// A control token: never text, only allowed where a grammar ends.
    pub special: bool,
}

/// GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the others were
/// shifted to U+0100 onwards in byte order.
fn gpt2_char_to_byte() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("U+0100..U+0143 are chars")
        };
        map.insert(c, b);
    }
    map
}

/// A SentencePiece piece's bytes: `<0xHH>` byte-fallback pieces are that byte, `▁` is a space.
fn spm_piece_bytes(piece: &str) -> Vec<u8> {
    if let Some(hex) = piece
        .strip_prefix("<0x")
        .and_then(|r| r.strip_suffix('>'))
        .filter(|h| h.len() == 2)
    {
        if let Ok(b) = u8::from_str_radix(hex, 16) {
            return vec![b];
        }
    }
    piece.replace(SPM_SPACE, " ").into_bytes()
}

/// The parts of GGUF tokenizer metadata both builders need.
struct GgufVocab<'a> {
    tokens: &'a [&'a str],
    types: &'a [i64],
    bos: Option<u32>,
    unk: Option<u32>,
    add_bos: Option<bool>,
    add_space_prefix: Option<bool>,
}

impl GgufVocab<'_> {
    fn vocab(&self) -> Vocab {
        let mut v = Vocab::with_capacity(self.tokens.len());
        for (i, t) in self.tokens.iter().enumerate() {
            // On duplicate pieces keep the first id, as llama.cpp's token-to-id map does.
            v.entry(t.to_string()).or_insert(i as u32);
        }
        v
    }

    /// Control (and unknown) tokens become special added tokens so "<|im_start|>" encodes to one id
    /// and `skip_special_tokens` drops them; user-defined tokens are added but not special.
    fn added_tokens(&self) -> Vec<AddedToken> {
        self.tokens
            .iter()
            .zip(self.types)
            .filter_map(|(t, &ty)| match ty {
                token_type::CONTROL | token_type::UNKNOWN => {
                    Some(AddedToken::from(t.to_string(), true))
                }
                token_type::USER_DEFINED => {
                    Some(AddedToken::from(t.to_string(), false).normalized(false))
                }
                _ => None,
            })
            .collect()
    }

    /// A post-processor that prepends bos when GGUF asks for it.
    fn bos_processor(
        &self,
        default_add_bos: bool,
    ) -> Result<Option<TemplateProcessing>, ModelError> {
        let (true, Some(id)) = (self.add_bos.unwrap_or(default_add_bos), self.bos) else {
            return Ok(None);
        };
        let bos = self
            .tokens
            .get(id as usize)
            .ok_or_else(|| ModelError::Tokenizer(format!("bos id {id} out of range")))?;
        let p = TemplateProcessing::builder()
            .try_single(format!("{bos}:0 $A:0"))
            .map_err(tok_err)?
            .try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1"))
            .map_err(tok_err)?
            .special_tokens(vec![(bos.to_string(), id)])
            .build()
            .map_err(tok_err)?;
        Ok(Some(p))
    }
}

/// The pre-tokenizer llama.cpp applies for a GGUF `tokenizer.ggml.pre` value, expressed with HF parts.
fn gpt2_pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = ByteLevel::new(false, true, true);
    match pre {
        // GPT-2's regex alone.
        "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => Ok(byte_level.into()),
        // Every digit is its own word first (llama.cpp: "\p{N}" then the GPT-2 regex); matches the HF
        // tokenizer.json of these models (Digits(individual_digits) + ByteLevel).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            Ok(PreSequence::new(vec![Digits::new(true).into(), byte_level.into()]).into())
        }
        other => Err(ModelError::Tokenizer(format!(
            "unsupported GGUF pre-tokenizer {other:?}"
        ))),
    }
}

/// Byte-level BPE (GPT-2 family) from GGUF tokens + merges.
fn build_gpt2(
    spec: &GgufVocab,
    merges: &[&str],
    pre: &str,
) -> Result<tokenizers::Tokenizer, ModelError> {
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge {m:?}")))
        })
        .collect::<Result<_, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(spec.vocab(), merges)
        .build()
        .map_err(tok_err)?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(gpt2_pre_tokenizer(pre)?));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(p) = spec.bos_processor(false)? {
        tk.with_post_processor(Some(p));
    }
    tk.add_special_tokens(&spec.added_tokens());
    Ok(tk)
}

/// SentencePiece (llama) vocabularies as HF's `LlamaConverter` builds them: a byte-fallback BPE whose merges
/// come from the piece scores, with "▁" for spaces.
fn build_spm(spec: &GgufVocab, scores: &[f32]) -> Result<tokenizers::Tokenizer, ModelError> {
    if scores.len() != spec.tokens.len() {
        return Err(ModelError::Tokenizer(format!(
            "{} scores for {} tokens",
            scores.len(),
            spec.tokens.len()
        )));
    }
    let vocab = spec.vocab();
    // A merge (l, r) exists for every normal piece that splits into two pieces of the vocabulary; pieces
    // with higher scores merge first (HF's SentencePieceExtractor ordering).
    let mut merges: Vec<(usize, usize, usize, f32)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        if matches!(
            spec.types[id],
            token_type::CONTROL | token_type::BYTE | token_type::UNUSED | token_type::UNKNOWN
        ) {
            continue;
        }
        let mut local: Vec<(usize, usize, usize, f32)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(i, _)| {
                let (l, r) = piece.split_at(i);
                Some((
                    *vocab.get(l)? as usize,
                    *vocab.get(r)? as usize,
                    id,
                    scores[id],
                ))
            })
            .collect();
        local.sort_by_key(|&(l, r, _, _)| (l, r));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.3.total_cmp(&a.3));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(l, r, _, _)| (spec.tokens[l].to_string(), spec.tokens[r].to_string()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = spec.unk.and_then(|u| spec.tokens.get(u as usize)) {
        builder = builder.unk_token(unk.to_string());
    }
    let bpe = builder.build().map_err(tok_err)?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let replace = Replace::new(" ", SPM_SPACE).map_err(tok_err)?;
    if spec.add_space_prefix.unwrap_or(true) {
        tk.with_normalizer(Some(NormalizerSequence::new(vec![
            Prepend::new(SPM_SPACE.to_string()).into(),
            replace.into(),
        ])));
    } else {
        tk.with_normalizer(Some(replace));
    }
    let mut decoders: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(
            Replace::new(SPM_SPACE, " ").map_err(tok_err)?,
        ),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if spec.add_space_prefix.unwrap_or(true) {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tk.with_decoder(Some(DecoderSequence::new(decoders)));
    if let Some(p) = spec.bos_processor(true)? {
        tk.with_post_processor(Some(p));
    }
    tk.add_special_tokens(&spec.added_tokens());
    Ok(tk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::GgufWriter;

    /// A tiny SentencePiece-style vocabulary: bytes, a few pieces, and their scores.
    fn spm_gguf() -> GgufFile {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types: Vec<i32> = vec![2, 3, 3];
        let mut scores: Vec<f32> = vec![0.0; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (p, s) in [
            ("▁", -1.0),
            ("h", -2.0),
            ("i", -2.0),
            ("▁h", -3.0),
            ("▁hi", -4.0),
            ("t", -2.0),
            ("he", -5.0),
            ("▁t", -3.5),
        ] {
            tokens.push(p.into());
            types.push(1);
            scores.push(s);
        }
        let mut w = GgufWriter::default();
        let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        w.kv_str("tokenizer.ggml.model", "llama")
            .kv_str_array("tokenizer.ggml.tokens", &refs);
        let mut p = Vec::new();
        p.extend_from_slice(&5u32.to_le_bytes());
        p.extend_from_slice(&(types.len() as u64).to_le_bytes());
        types
            .iter()
            .for_each(|t| p.extend_from_slice(&t.to_le_bytes()));
        w.kv_raw("tokenizer.ggml.token_type", 9, &p);
        let mut p = Vec::new();
        p.extend_from_slice(&6u32.to_le_bytes());
        p.extend_from_slice(&(scores.len() as u64).to_le_bytes());
        scores
            .iter()
            .for_each(|s| p.extend_from_slice(&s.to_le_bytes()));
        w.kv_raw("tokenizer.ggml.scores", 9, &p);
        w.kv_u32("tokenizer.ggml.bos_token_id", 1)
            .kv_u32("tokenizer.ggml.eos_token_id", 2)
            .kv_u32("tokenizer.ggml.unknown_token_id", 0);
        GgufFile::parse(Arc::new(w.finish())).unwrap()
    }

    #[test]
    fn spm_vocab_encodes_with_metaspace_and_byte_fallback() {
        let t = Tokenizer::from_gguf(&spm_gguf()).unwrap();
        let id = |s: &str| t.token_to_id(s).unwrap();
        assert_eq!(t.bos_token().as_deref(), Some("<s>"));
        assert_eq!(t.encode("hi", false).unwrap(), vec![id("▁hi")]);
        assert_eq!(t.encode("hi", true).unwrap(), vec![id("<s>"), id("▁hi")]);
        // "é" is not a piece: it falls back to its two UTF-8 bytes.
        assert_eq!(
            t.encode("hi é", false).unwrap(),
            vec![id("▁hi"), id("▁"), id("<0xC3>"), id("<0xA9>")]
        );
        assert_eq!(
            t.decode(&t.encode("hi é", true).unwrap(), true).unwrap(),
            "hi é"
        );
        // Control tokens in the text are matched before normalization, as HF does.
        assert_eq!(t.encode("</s>", false).unwrap(), vec![2]);
    }
}
