//! Multi-turn conversations: each turn's prompt is the whole history so far (a shared document, then
//! every earlier user turn and the answer the server actually returned), as chat clients send it. What
//! a KV cache that keeps earlier turns (prefix caching, KV tiers) is measured by: the time to first
//! token of each turn index.
//!
//! Conversations come from [`MultiTurnSpec`] (synthetic: random words of the served tokenizer) or from
//! a ShareGPT-style JSONL file (`{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
//! ...}]}` per line; the user turns are sent, and each reply's length in tokens is the answer length).

use std::path::Path;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::client::Client;
use crate::error::BenchError;
use crate::metrics::percentile;
use crate::workload::{BenchRequest, Prompt, PromptBuilder, RequestClass};

/// A synthetic multi-turn load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MultiTurnSpec {
    /// Conversations, all running at once.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Tokens of the system prompt / document every conversation starts with (shared by all).
    pub shared_len: usize,
    /// Tokens of each user turn.
    pub user_len: usize,
    /// Tokens of each answer.
    pub answer_len: usize,
    /// Seconds a conversation waits between an answer and its next turn.
    pub think_s: f64,
}

/// The turns of one conversation: each user turn's token ids and its answer length.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// (user turn, tokens to generate) in order.
    pub turns: Vec<(Vec<u32>, usize)>,
}

/// What one turn saw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Which conversation.
    pub conversation: usize,
    /// Turn index, from 1.
    pub turn: usize,
    /// Prompt tokens sent (the whole history).
    pub prompt_len: usize,
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Whether it completed.
    pub success: bool,
    /// The answer's text.
    pub answer: String,
    /// Why it failed.
    pub error: Option<String>,
}

/// TTFT percentiles of one turn index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnStats {
    /// Turn index, from 1.
    pub turn: usize,
    /// Successful turns of that index.
    pub count: usize,
    /// Median TTFT, seconds.
    pub ttft_p50_s: f64,
    /// 99th percentile TTFT, seconds.
    pub ttft_p99_s: f64,
}

impl MultiTurnSpec {
    /// The shared document and the conversations, drawn from `seed`.
    pub fn generate(&self, builder: &PromptBuilder, seed: u64) -> (Vec<u32>, Vec<Conversation>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let shared = builder.random_ids(&mut rng, self.shared_len);
        let convs = (0..self.conversations)
            .map(|_| Conversation {
                turns: (0..self.turns)
                    .map(|_| (builder.random_ids(&mut rng, self.user_len), self.answer_len))
                    .collect(),
            })
            .collect();
        (shared, convs)
    }
}

/// One line of a ShareGPT-style file.
#[derive(Deserialize)]
struct ShareGptLine {
    conversations: Vec<ShareGptTurn>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    from: String,
    value: String,
}

/// Reads ShareGPT-style conversations from `path`: each `human` turn is sent, and the `gpt` turn after
/// it sets the answer length (its token count, at least 1, at most `max_answer`). Blank lines are
/// skipped; a line that is not such an object is an error naming it.
pub fn load_sharegpt(
    path: &Path,
    builder: &PromptBuilder,
    max_answer: usize,
) -> Result<Vec<Conversation>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let bad = |line: usize, message: String| BenchError::Jsonl {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut convs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: ShareGptLine = serde_json::from_str(line).map_err(|e| {
            bad(
                i + 1,
                format!("not a {{\"conversations\": [{{\"from\", \"value\"}}]}} object: {e}"),
            )
        })?;
        let mut turns = Vec::new();
        let mut it = parsed.conversations.iter().peekable();
        while let Some(t) = it.next() {
            if !matches!(t.from.as_str(), "human" | "user") {
                continue;
            }
            let user = builder.tokenizer().encode(&t.value, false)?;
            let answer = match it.peek() {
                Some(r) if matches!(r.from.as_str(), "gpt" | "assistant") => {
                    builder.tokenizer().encode(&r.value, false)?.len()
                }
                _ => max_answer,
            };
            turns.push((user, answer.clamp(1, max_answer.max(1))));
        }
        if turns.is_empty() {
            return Err(bad(i + 1, "the conversation has no human turn".into()));
        }
        convs.push(Conversation { turns });
    }
    if convs.is_empty() {
        return Err(bad(0, "no conversation in the file".into()));
    }
    Ok(convs)
}

/// Runs every conversation at once, each turn after the previous answer plus `think`: the history grows
/// by the user turn, then by the answer as the server returned it (re-encoded by `builder`'s tokenizer).
pub async fn run(
    client: &Client,
    builder: &PromptBuilder,
    shared: &[u32],
    convs: &[Conversation],
    think: Duration,
) -> Result<Vec<TurnRecord>, BenchError> {
    let start = Instant::now();
    let tasks = convs.iter().enumerate().map(|(c, conv)| async move {
        let mut history = shared.to_vec();
        let mut out = Vec::new();
        for (t, (user, answer_len)) in conv.turns.iter().enumerate() {
            if t > 0 && !think.is_zero() {
                tokio::time::sleep(think).await;
            }
            history.extend_from_slice(user);
            let req = BenchRequest {
                prompt: Prompt::Tokens(history.clone()),
                prompt_len: history.len(),
                max_tokens: *answer_len,
                class: RequestClass::Main,
                at_s: None,
            };
            let mut answer = String::new();
            let rec = client
                .send_keeping_text(&req, start, Some(&mut answer))
                .await;
            let ok = rec.success;
            if ok {
                history.extend(builder.tokenizer().encode(&answer, false)?);
            }
            out.push(TurnRecord {
                conversation: c,
                turn: t + 1,
                prompt_len: req.prompt_len,
                ttft_s: rec.ttft_s,
                success: ok,
                answer,
                error: rec.error,
            });
            if !ok {
                break;
            }
        }
        Ok::<_, BenchError>(out)
    });
    let mut records = Vec::new();
    for r in futures::future::join_all(tasks).await {
        records.extend(r?);
    }
    Ok(records)
}

/// TTFT p50/p99 of each turn index over the successful turns.
pub fn ttft_by_turn(records: &[TurnRecord]) -> Vec<TurnStats> {
    let turns = records.iter().map(|r| r.turn).max().unwrap_or(0);
    (1..=turns)
        .map(|turn| {
            let mut v: Vec<f64> = records
                .iter()
                .filter(|r| r.turn == turn && r.success)
                .map(|r| r.ttft_s)
                .collect();
            v.sort_by(f64::total_cmp);
            TurnStats {
                turn,
                count: v.len(),
                ttft_p50_s: percentile(&v, 50.0),
                ttft_p99_s: percentile(&v, 99.0),
            }
        })
        .collect()
}

/// Median TTFT over the successful turns of index `from` and later (turn 2 on: the turns a cache that
/// keeps earlier turns can help).
pub fn ttft_p50_from(records: &[TurnRecord], from: usize) -> f64 {
    let mut v: Vec<f64> = records
        .iter()
        .filter(|r| r.turn >= from && r.success)
        .map(|r| r.ttft_s)
        .collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// A fingerprint of every answer (by conversation and turn), so two runs can be checked for identical
/// greedy output.
pub fn answers_digest(records: &[TurnRecord]) -> String {
    let mut sorted: Vec<&TurnRecord> = records.iter().collect();
    sorted.sort_by_key(|r| (r.conversation, r.turn));
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in sorted {
        for b in format!("{}/{}:{}\n", r.conversation, r.turn, r.answer).bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(conversation: usize, turn: usize, ttft_s: f64, answer: &str) -> TurnRecord {
        TurnRecord {
            conversation,
            turn,
            prompt_len: 1,
            ttft_s,
            success: true,
            answer: answer.into(),
            error: None,
        }
    }

    fn builder() -> Option<PromptBuilder> {
        Some(PromptBuilder::load(&tandem_testkit::model_path()?).unwrap())
    }

    #[test]
    fn sharegpt_lines_become_conversations_and_a_broken_line_is_named() {
        let Some(b) = builder() else { return };
        let dir = std::env::temp_dir().join(format!("tandem-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.jsonl");
        let good = r#"{"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi, how can I help you today?"}, {"from": "human", "value": "Tell me a story"}]}"#;
        std::fs::write(&path, format!("{good}\n\n{good}\n")).unwrap();
        let convs = load_sharegpt(&path, &b, 32).unwrap();
        assert_eq!(convs.len(), 2);
        assert_eq!(convs[0].turns.len(), 2);
        let hello = b.tokenizer().encode("Hello there", false).unwrap();
        assert_eq!(convs[0].turns[0].0, hello);
        let reply = b
            .tokenizer()
            .encode("Hi, how can I help you today?", false)
            .unwrap();
        assert_eq!(convs[0].turns[0].1, reply.len());
        assert_eq!(convs[0].turns[1].1, 32, "no reply: the most an answer gets");
        std::fs::write(&path, format!("{good}\n{{\"conversations\": 3}}\n")).unwrap();
        let err = load_sharegpt(&path, &b, 32).unwrap_err().to_string();
        assert!(err.contains("c.jsonl:2:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn synthetic_conversations_share_one_document() {
        let Some(b) = builder() else { return };
        let spec = MultiTurnSpec {
            conversations: 3,
            turns: 4,
            shared_len: 50,
            user_len: 7,
            answer_len: 5,
            think_s: 0.0,
        };
        let (shared, convs) = spec.generate(&b, 1);
        assert_eq!(shared.len(), 50);
        assert_eq!(convs.len(), 3);
        assert!(convs
            .iter()
            .all(|c| c.turns.len() == 4 && c.turns.iter().all(|(u, a)| u.len() == 7 && *a == 5)));
        assert_eq!(spec.generate(&b, 1), (shared, convs), "seeded");
    }

    #[test]
    fn ttft_is_reported_per_turn_index() {
        let r = vec![
            rec(0, 1, 1.0, "a"),
            rec(1, 1, 3.0, "b"),
            rec(0, 2, 0.1, "c"),
            rec(1, 2, 0.3, "d"),
        ];
        let s = ttft_by_turn(&r);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].count, s[0].ttft_p50_s), (2, 2.0));
        assert!((s[1].ttft_p50_s - 0.2).abs() < 1e-12);
        assert!((ttft_p50_from(&r, 2) - 0.2).abs() < 1e-12);
        let mut swapped = r.clone();
        swapped.reverse();
        assert_eq!(answers_digest(&r), answers_digest(&swapped), "order-free");
        swapped[0].answer.push('!');
        assert_ne!(answers_digest(&r), answers_digest(&swapped));
    }
}
