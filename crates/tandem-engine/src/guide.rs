//! Guided decoding: a request's [`Guidance`] compiled by llguidance against the model's vocabulary
//! into a per-request matcher, whose allowed-token mask is applied to every logits row the request
//! samples from. A guided request is never answered unguided: a constraint that does not compile
//! is refused at submit time, and an engine without a vocabulary refuses guided requests.

use crate::error::EngineError;
use crate::types::{Guidance, ReasoningGate};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use tandem_model::TokenPiece;

/// llguidance's tokenizer side: the trie of every token's bytes. Tokenizing text greedily over the
/// trie is not the model's tokenization, so llguidance is told it is not canonical and uses it only
/// where any valid spelling will do.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The per-model half of guided decoding, built once from the tokenizer's vocabulary and shared by
/// every request: compiles constraints into matchers.
pub struct GuideEnv {
    factory: ParserFactory,
    vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for GuideEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuideEnv")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GuideEnv {
    /// Builds the token trie over `vocab_size` ids (the logits row width; ids past the tokenizer's
    /// pieces are padding and never allowed) with `eos` as the tokens that end a finished grammar.
    pub fn new(
        pieces: &[TokenPiece],
        eos: &[u32],
        vocab_size: usize,
    ) -> Result<Arc<Self>, EngineError> {
        let Some(&first_eos) = eos.first() else {
            return Err(EngineError::Config(
                "guided decoding needs an end-of-sequence token".into(),
            ));
        };
        if eos.iter().any(|&t| t as usize >= vocab_size) {
            return Err(EngineError::Config(format!(
                "end-of-sequence tokens {eos:?} outside a vocabulary of {vocab_size}"
            )));
        }
        let words: Vec<Vec<u8>> = (0..vocab_size)
            .map(|id| match pieces.get(id) {
                // A special token is only reachable through its marker byte, so no text spells it.
                Some(p) if p.special || eos.contains(&(id as u32)) => {
                    let mut w = Vec::with_capacity(p.bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&p.bytes);
                    w
                }
                Some(p) => p.bytes.clone(),
                None => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| EngineError::Config(format!("guided decoding setup: {e}")))?;
        factory.quiet();
        Ok(Arc::new(Self {
            factory,
            vocab: vocab_size,
            eos: eos.to_vec(),
        }))
    }

    /// Compiles a constraint into a fresh matcher; the error is llguidance's account of what in the
    /// schema, regex or grammar it cannot use.
    pub fn compile(&self, guidance: &Guidance) -> Result<Guide, EngineError> {
        self.compile_gated(guidance, None)
    }

    /// [`Self::compile`], the constraint waiting out a reasoning model's thinking block (`gate`).
    pub fn compile_gated(
        &self,
        guidance: &Guidance,
        gate: Option<ReasoningGate>,
    ) -> Result<Guide, EngineError> {
        for t in gate
            .iter()
            .flat_map(|g| g.open.into_iter().chain([g.close]))
        {
            if t as usize >= self.vocab {
                return Err(EngineError::Guidance(format!(
                    "reasoning tag token {t} outside a vocabulary of {}",
                    self.vocab
                )));
            }
        }
        let grammar = match guidance {
            Guidance::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Guidance::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Guidance::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Guidance::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| EngineError::Guidance(format!("{e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(EngineError::Guidance(e));
        }
        let phase = match gate {
            None => Phase::Answer,
            Some(ReasoningGate {
                open: Some(open),
                close,
            }) => Phase::MayOpen { open, close },
            Some(ReasoningGate { open: None, close }) => Phase::Reasoning { close },
        };
        Ok(Guide {
            matcher,
            vocab: self.vocab,
            eos: self.eos.clone(),
            phase,
        })
    }
}

/// Where a guided request stands against its reasoning gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The first token: `open` starts the thinking block, anything else the constrained answer.
    MayOpen { open: u32, close: u32 },
    /// Inside the thinking block: free text (but no end of output) until `close`.
    Reasoning { close: u32 },
    /// The constrained answer.
    Answer,
}

/// JSON without free whitespace between tokens: a small model given the choice can emit spaces or
/// newlines until `max_tokens`, and compact JSON is what OpenAI returns too. A schema that sets its
/// own `x-guidance` options keeps them.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let serde_json::Value::Object(map) = &mut schema {
        map.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// One request's matcher: the grammar state after the tokens it has consumed.
pub struct Guide {
    matcher: Matcher,
    vocab: usize,
    eos: Vec<u32>,
    phase: Phase,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Guide {
    /// Advances over tokens already generated (a decode worker's first token from prefill, or the
    /// output delivered before a failover); refused when they break the constraint.
    pub fn consume(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
        let mut rest = tokens;
        while let Some((&t, tail)) = rest.split_first() {
            match self.phase {
                Phase::Answer => break,
                Phase::MayOpen { open, close } if t == open => {
                    self.phase = Phase::Reasoning { close };
                }
                Phase::MayOpen { .. } => {
                    self.phase = Phase::Answer;
                    break;
                }
                Phase::Reasoning { close } if t == close => self.phase = Phase::Answer,
                Phase::Reasoning { .. } => {}
            }
            rest = tail;
        }
        self.matcher
            .consume_tokens(rest)
            .map_err(|e| EngineError::Guidance(format!("tokens outside the constraint: {e}")))
    }

    /// The tokens allowed next (end-of-sequence tokens once the grammar accepts; inside a thinking
    /// block every token but those).
    pub fn mask(&mut self) -> Result<Mask, EngineError> {
        if let Phase::Reasoning { .. } = self.phase {
            let mut vob = SimpleVob::alloc_ones(self.vocab);
            for &t in &self.eos {
                vob.disallow_token(t);
            }
            return Ok(Mask {
                vob,
                vocab: self.vocab,
            });
        }
        let mut vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| EngineError::Guidance(format!("computing the token mask: {e}")))?;
        if let Phase::MayOpen { open, .. } = self.phase {
            vob.allow_token(open);
        }
        if vob.is_zero() {
            return Err(EngineError::Guidance(
                "the constraint allows no token here".into(),
            ));
        }
        Ok(Mask {
            vob,
            vocab: self.vocab,
        })
    }

    /// Whether the grammar is complete and nothing but end-of-sequence can follow.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Answer && self.matcher.is_stopped()
    }
}

/// The tokens one row may sample.
pub struct Mask {
    vob: SimpleVob,
    vocab: usize,
}

impl Mask {
    /// Whether `token` may be sampled.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.vocab && self.vob.is_allowed(token)
    }

    /// Sets every disallowed logit to -inf, 32 tokens per mask word; `extra` (stop tokens) stays
    /// allowed where the grammar may end.
    pub fn apply(&self, logits: &mut [f32], extra: &[u32], eos: &[u32]) {
        let saved: Vec<(usize, f32)> = if eos.iter().any(|&t| self.allows(t)) {
            extra
                .iter()
                .filter(|&&t| (t as usize) < logits.len())
                .map(|&t| (t as usize, logits[t as usize]))
                .collect()
        } else {
            Vec::new()
        };
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = self.vob.as_slice().get(w).copied().unwrap_or(0);
            if bits == u32::MAX && (w + 1) * 32 <= self.vocab {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 || w * 32 + b >= self.vocab {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (t, l) in saved {
            logits[t] = l;
        }
    }

    /// Writes the tokens [`Mask::apply`] leaves finite as bits into `out` (bit `t % 32` of word
    /// `t / 32`; `out.len() * 32` covers the logits row), for a backend that masks on its device.
    pub fn pack(&self, out: &mut [u32], extra: &[u32], eos: &[u32]) {
        let src = self.vob.as_slice();
        let full_words = self.vocab / 32;
        for (w, o) in out.iter_mut().enumerate() {
            let bits = src.get(w).copied().unwrap_or(0);
            *o = match w.cmp(&full_words) {
                std::cmp::Ordering::Less => bits,
                // The word holding the vocabulary's end keeps only tokens below it.
                std::cmp::Ordering::Equal => bits & ((1u32 << (self.vocab % 32)) - 1),
                std::cmp::Ordering::Greater => 0,
            };
        }
        if eos.iter().any(|&t| self.allows(t)) {
            for &t in extra {
                if let Some(o) = out.get_mut(t as usize / 32) {
                    *o |= 1 << (t % 32);
                }
            }
        }
    }
}
