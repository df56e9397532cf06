//! Streaming detokenization: text deltas that never split a UTF-8 character.
//!
//! Decoding token by token breaks on byte-level tokens that carry half an emoji and on decoders that
//! treat the first token specially (SentencePiece's leading-space strip). The usual remedy: decode a
//! short window twice, once up to the last emitted token (`prefix`) and once including the new ones,
//! and emit the difference once it no longer ends in U+FFFD.

use crate::error::ModelError;
use crate::tokenizer::Tokenizer;

/// Streaming detokenizer: turns tokens into text deltas that never split a UTF-8 character.
#[derive(Debug)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// Tokens of the current window; older ones are dropped once emitted.
    ids: Vec<u32>,
    /// Start of the context decoded for comparison.
    prefix_offset: usize,
    /// End of what has been emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder for one generated sequence.
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Decodes the text already emitted from the window (`prefix`) and the whole window (`full`);
    /// the new text is what `full` has beyond `prefix`.
    fn decode_window(&self) -> Result<(String, String), ModelError> {
        let prefix = self.tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        Ok((prefix, full))
    }

    /// Adds one token and returns the new text ("" while a character is incomplete).
    pub fn push(&mut self, token: u32) -> Result<String, ModelError> {
        self.ids.push(token);
        let (prefix, full) = self.decode_window()?;
        if full.len() <= prefix.len()
            || full.ends_with('\u{FFFD}')
            || !full.is_char_boundary(prefix.len())
        {
            return Ok(String::new());
        }
        let delta = full[prefix.len()..].to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the window bounded: everything before prefix_offset is never decoded again.
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(delta)
    }

    /// Flushes whatever is held back (lossy if the bytes are truly broken) and resets the window.
    pub fn finish(&mut self) -> Result<String, ModelError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let (prefix, full) = self.decode_window()?;
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(match full.get(prefix.len()..) {
            Some(tail) if full.starts_with(&prefix) => tail.to_string(),
            _ => full,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level BPE with all 256 byte tokens, a few merges, and one special token: enough to
    /// split emoji across tokens and exercise skip_special_tokens.
    fn tokenizer() -> Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| {
            let alphabet = ByteLevel::alphabet();
            let mut chars: Vec<char> = alphabet.into_iter().collect();
            chars.sort_unstable();
            let mut vocab: tokenizers::models::bpe::Vocab = chars
                .iter()
                .enumerate()
                .map(|(i, c)| (c.to_string(), i as u32))
                .collect();
            let merges = vec![
                ("Ġ".to_string(), "h".to_string()),
                ("Ġh".to_string(), "i".to_string()),
            ];
            for (a, b) in &merges {
                let n = vocab.len() as u32;
                vocab.insert(format!("{a}{b}"), n);
            }
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .build()
                .unwrap();
            let mut tk = tokenizers::Tokenizer::new(bpe);
            tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            tk.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
            tk.add_special_tokens(&[tokenizers::AddedToken::from("<|end|>", true)]);
            Tokenizer::from_inner(tk, None, Some("<|end|>".into()))
        })
        .clone()
    }

    fn stream(t: &Tokenizer, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut d = IncrementalDecoder::new(t.clone(), skip);
        let deltas: Vec<String> = ids.iter().map(|&i| d.push(i).unwrap()).collect();
        let tail = d.finish().unwrap();
        (deltas, tail)
    }

    #[test]
    fn emoji_split_across_byte_tokens_is_held_back() {
        let t = tokenizer();
        let ids = t.encode("a 🦀!", false).unwrap();
        assert!(
            ids.len() >= 6,
            "the crab must be several byte tokens: {ids:?}"
        );
        let (deltas, tail) = stream(&t, &ids, false);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
        assert_eq!(deltas.concat() + &tail, "a 🦀!");
        // The crab's four bytes produce nothing until the last arrives, then the whole character.
        assert_eq!(
            deltas.iter().filter(|d| d.is_empty()).count(),
            3,
            "{deltas:?}"
        );
        assert!(deltas.iter().any(|d| d.contains('🦀')), "{deltas:?}");
    }

    #[test]
    fn truncated_character_is_flushed_lossily_by_finish() {
        let t = tokenizer();
        let ids = t.encode("x🦀", false).unwrap();
        let (deltas, tail) = stream(&t, &ids[..ids.len() - 1], false);
        assert_eq!(deltas.concat(), "x");
        assert_eq!(tail, "\u{FFFD}");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let t = tokenizer();
        let ids = t.encode("hi<|end|>", false).unwrap();
        assert_eq!(stream(&t, &ids, true).0.concat(), "hi");
        assert_eq!(stream(&t, &ids, false).0.concat(), "hi<|end|>");
    }

    proptest::proptest! {
        #[test]
        fn streamed_text_equals_full_decode(s in "[\\PC&&[^\\x{FFFD}]]{0,40}") {
            let t = tokenizer();
            let ids = t.encode(&s, false).unwrap();
            let (deltas, tail) = stream(&t, &ids, false);
            proptest::prop_assert_eq!(deltas.concat() + &tail, t.decode(&ids, false).unwrap());
            proptest::prop_assert!(deltas.iter().all(|d| !d.contains(char::REPLACEMENT_CHARACTER)));
        }
    }
}
