//! Workloads: the requests a run sends, built token-exact through the served model's tokenizer.
//!
//! Prompts are made of whole-word vocabulary pieces (" the", " river", ...). A byte-level BPE tokenizer
//! splits text at spaces before merging, so a sequence of such pieces decodes to text that encodes back
//! to the same number of tokens; every text prompt is re-encoded and checked anyway. With
//! [`PromptFormat::Tokens`] the ids themselves are sent and the count is exact by construction.

use std::path::{Path, PathBuf};

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tandem_model::gguf::GgufFile;
use tandem_model::Tokenizer;

use crate::arrival;
use crate::error::BenchError;

/// How a prompt travels in the request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptFormat {
    /// Text that re-encodes to exactly the intended token count; every OpenAI-compatible server takes it.
    Text,
    /// A list of token ids (`prompt: [1, 2, 3]`), which vLLM, llama-server and tandem accept.
    Tokens,
}

/// The `prompt` field of one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Plain text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// Which part of a workload a request belongs to; the bursty workload plots its steady requests' ITL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestClass {
    /// A request of a uniform workload.
    Main,
    /// A short chat of the bursty workload's steady stream.
    Steady,
    /// A long prompt of one of the bursty workload's bursts.
    Burst,
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct BenchRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Its length in tokens of the served model (without any BOS the server may add).
    pub prompt_len: usize,
    /// Tokens to generate; sent with `ignore_eos` so the server generates exactly this many.
    pub max_tokens: usize,
    /// Which part of the workload it belongs to.
    pub class: RequestClass,
    /// Send time in seconds after the start when the workload fixes it (bursty); otherwise the arrival
    /// process decides.
    pub at_s: Option<f64>,
}

/// A length: `len`, or uniform in `[len·(1−range_ratio), len·(1+range_ratio)]` like vLLM's random dataset.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LengthSpec {
    /// The mean length.
    pub len: usize,
    /// Relative half-width of the range; 0 for a fixed length.
    pub range_ratio: f64,
}

impl LengthSpec {
    /// A fixed length.
    pub fn fixed(len: usize) -> LengthSpec {
        LengthSpec {
            len,
            range_ratio: 0.0,
        }
    }

    /// Draws one length (at least 1).
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        if self.range_ratio <= 0.0 {
            return self.len.max(1);
        }
        let lo = ((self.len as f64) * (1.0 - self.range_ratio))
            .floor()
            .max(1.0) as usize;
        let hi = ((self.len as f64) * (1.0 + self.range_ratio)).ceil() as usize;
        rng.random_range(lo..=hi.max(lo))
    }
}

impl std::fmt::Display for LengthSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.range_ratio > 0.0 {
            write!(f, "{}±{:.0}%", self.len, self.range_ratio * 100.0)
        } else {
            write!(f, "{}", self.len)
        }
    }
}

/// What to send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadSpec {
    /// Random prompts of the given lengths.
    Random {
        /// Prompt length.
        input: LengthSpec,
        /// Output length.
        output: LengthSpec,
    },
    /// Requests that share one of `num_prefixes` long system prompts, then a short unique suffix.
    SharedPrefix {
        /// Tokens of each shared prefix.
        prefix_len: usize,
        /// Distinct prefixes, assigned round-robin.
        num_prefixes: usize,
        /// The unique part of each prompt.
        suffix: LengthSpec,
        /// Output length.
        output: LengthSpec,
    },
    /// Steady short chats (Poisson at `steady_rate`) plus, every `burst_interval_s`, `burst_size` long
    /// prompts at once: the load where decode latency suffers from co-scheduled prefills.
    Bursty(BurstySpec),
    /// Prompts from a JSONL file: one object per line with `prompt` (text) and optionally `max_tokens`.
    Jsonl {
        /// The file.
        path: PathBuf,
        /// Output length of lines without `max_tokens`.
        output_len: usize,
    },
}

/// The parameters of [`WorkloadSpec::Bursty`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BurstySpec {
    /// Prompt length of the steady requests.
    pub steady_input: LengthSpec,
    /// Output length of the steady requests.
    pub steady_output: LengthSpec,
    /// Steady requests per second.
    pub steady_rate: f64,
    /// Prompt length of the burst requests.
    pub burst_input: usize,
    /// Output length of the burst requests.
    pub burst_output: usize,
    /// Requests per burst.
    pub burst_size: usize,
    /// Seconds between bursts (the first comes after one interval).
    pub burst_interval_s: f64,
}

/// The generated requests of one run, in send order.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The requests.
    pub requests: Vec<BenchRequest>,
    /// Burst start times in seconds (bursty workload only), for the plots.
    pub burst_times_s: Vec<f64>,
}

impl WorkloadSpec {
    /// A short name: random, shared_prefix, bursty or jsonl.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkloadSpec::Random { .. } => "random",
            WorkloadSpec::SharedPrefix { .. } => "shared_prefix",
            WorkloadSpec::Bursty { .. } => "bursty",
            WorkloadSpec::Jsonl { .. } => "jsonl",
        }
    }

    /// A one-line description with the lengths, for tables.
    pub fn describe(&self) -> String {
        match self {
            WorkloadSpec::Random { input, output } => format!("random in={input} out={output}"),
            WorkloadSpec::SharedPrefix {
                prefix_len,
                num_prefixes,
                suffix,
                output,
            } => format!("shared_prefix {num_prefixes}×{prefix_len} + {suffix} out={output}"),
            WorkloadSpec::Bursty(b) => format!(
                "bursty steady {}/{} at {}/s + {}×{}/{} every {}s",
                b.steady_input,
                b.steady_output,
                b.steady_rate,
                b.burst_size,
                b.burst_input,
                b.burst_output,
                b.burst_interval_s
            ),
            WorkloadSpec::Jsonl { path, .. } => format!("jsonl {}", path.display()),
        }
    }

    /// Builds `n` requests (the bursty workload: `n` steady ones plus its bursts) from `seed`.
    pub fn generate(
        &self,
        builder: &PromptBuilder,
        n: usize,
        format: PromptFormat,
        seed: u64,
    ) -> Result<Workload, BenchError> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut burst_times_s = Vec::new();
        let requests = match self {
            WorkloadSpec::Random { input, output } => (0..n)
                .map(|_| {
                    let len = input.sample(&mut rng);
                    let max_tokens = output.sample(&mut rng);
                    builder.request(&mut rng, &[], len, max_tokens, format, RequestClass::Main)
                })
                .collect::<Result<Vec<_>, _>>()?,
            WorkloadSpec::SharedPrefix {
                prefix_len,
                num_prefixes,
                suffix,
                output,
            } => {
                if *num_prefixes == 0 {
                    return Err(BenchError::Config(
                        "shared-prefix needs at least one prefix".into(),
                    ));
                }
                let prefixes: Vec<Vec<u32>> = (0..*num_prefixes)
                    .map(|_| builder.random_ids(&mut rng, *prefix_len))
                    .collect();
                (0..n)
                    .map(|i| {
                        let len = suffix.sample(&mut rng);
                        let max_tokens = output.sample(&mut rng);
                        builder.request(
                            &mut rng,
                            &prefixes[i % num_prefixes],
                            len,
                            max_tokens,
                            format,
                            RequestClass::Main,
                        )
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            WorkloadSpec::Bursty(b) => {
                b.requests(builder, n, format, &mut rng, &mut burst_times_s)?
            }
            WorkloadSpec::Jsonl { path, output_len } => {
                read_jsonl(builder, path, n, *output_len, format)?
            }
        };
        Ok(Workload {
            requests,
            burst_times_s,
        })
    }
}

impl BurstySpec {
    /// The steady requests at Poisson times and, every interval within their span, a burst; in send
    /// order. Records each burst's start in `burst_times_s`.
    fn requests(
        &self,
        builder: &PromptBuilder,
        n: usize,
        format: PromptFormat,
        rng: &mut ChaCha8Rng,
        burst_times_s: &mut Vec<f64>,
    ) -> Result<Vec<BenchRequest>, BenchError> {
        if !(self.steady_rate.is_finite() && self.steady_rate > 0.0 && self.burst_interval_s > 0.0)
        {
            return Err(BenchError::Config(
                "bursty needs a finite steady rate and a positive burst interval".into(),
            ));
        }
        let times = arrival::poisson_offsets(n, self.steady_rate, rng);
        let mut all = Vec::with_capacity(n);
        for t in &times {
            let len = self.steady_input.sample(rng);
            let max_tokens = self.steady_output.sample(rng);
            let mut r = builder.request(rng, &[], len, max_tokens, format, RequestClass::Steady)?;
            r.at_s = Some(*t);
            all.push(r);
        }
        let span = times.last().copied().unwrap_or(0.0);
        let mut t = self.burst_interval_s;
        while t <= span {
            burst_times_s.push(t);
            for _ in 0..self.burst_size {
                let mut r = builder.request(
                    rng,
                    &[],
                    self.burst_input,
                    self.burst_output,
                    format,
                    RequestClass::Burst,
                )?;
                r.at_s = Some(t);
                all.push(r);
            }
            t += self.burst_interval_s;
        }
        all.sort_by(|a, b| a.at_s.unwrap_or(0.0).total_cmp(&b.at_s.unwrap_or(0.0)));
        Ok(all)
    }
}

/// One line of a JSONL prompt file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonlLine {
    prompt: String,
    #[serde(default, alias = "output_len")]
    max_tokens: Option<usize>,
}

/// Reads the first `n` prompts of a JSONL file (all of them when `n` is 0).
fn read_jsonl(
    builder: &PromptBuilder,
    path: &Path,
    n: usize,
    output_len: usize,
    format: PromptFormat,
) -> Result<Vec<BenchRequest>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if n > 0 && out.len() == n {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| BenchError::Jsonl {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let parsed: JsonlLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let ids = builder.tokenizer.encode(&parsed.prompt, false)?;
        if ids.is_empty() {
            return Err(bad("empty prompt".into()));
        }
        let prompt_len = ids.len();
        let prompt = match format {
            PromptFormat::Text => Prompt::Text(parsed.prompt),
            PromptFormat::Tokens => Prompt::Tokens(ids),
        };
        out.push(BenchRequest {
            prompt,
            prompt_len,
            max_tokens: parsed.max_tokens.unwrap_or(output_len).max(1),
            class: RequestClass::Main,
            at_s: None,
        });
    }
    if out.is_empty() {
        return Err(BenchError::Config(format!(
            "{} holds no prompts",
            path.display()
        )));
    }
    if n > 0 && out.len() < n {
        tracing::warn!(path = %path.display(), wanted = n, found = out.len(), "JSONL file has fewer prompts than requested; sending all of them");
    }
    Ok(out)
}

/// Makes prompts of exact token counts for one tokenizer.
#[derive(Clone, Debug)]
pub struct PromptBuilder {
    tokenizer: Tokenizer,
    /// Ids of whole-word pieces that round-trip through decode and encode alone.
    words: Vec<u32>,
}

/// Attempts at a random text prompt before giving up on exactness.
const TEXT_ATTEMPTS: usize = 8;

impl PromptBuilder {
    /// Loads the tokenizer of a GGUF file or an HF folder (its `tokenizer.json`); no weights are read.
    pub fn load(model_path: &Path) -> Result<PromptBuilder, BenchError> {
        let tokenizer = if model_path.is_dir() {
            Tokenizer::from_file(&model_path.join("tokenizer.json"))?
        } else {
            Tokenizer::from_gguf(&GgufFile::open(model_path)?)?
        };
        PromptBuilder::new(tokenizer)
    }

    /// Collects the tokenizer's whole-word pieces that prompts are made of.
    pub fn new(tokenizer: Tokenizer) -> Result<PromptBuilder, BenchError> {
        let mut words = Vec::new();
        for id in 0..tokenizer.vocab_size() as u32 {
            let Some(piece) = tokenizer.id_to_token(id) else {
                continue;
            };
            // "Ġ" is byte-level BPE's space, "▁" SentencePiece's.
            let Some(word) = piece
                .strip_prefix('\u{120}')
                .or_else(|| piece.strip_prefix('\u{2581}'))
            else {
                continue;
            };
            if !(2..=12).contains(&word.len()) || !word.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            let text = tokenizer.decode(&[id], false)?;
            if tokenizer.encode(&text, false)? == [id] {
                words.push(id);
            }
        }
        if words.len() < 64 {
            return Err(BenchError::Prompt(format!(
                "the tokenizer has only {} whole-word pieces that round-trip",
                words.len()
            )));
        }
        Ok(PromptBuilder { tokenizer, words })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// `n` random word ids.
    pub fn random_ids(&self, rng: &mut impl Rng, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| *self.words.choose(rng).expect("words is never empty"))
            .collect()
    }

    /// A request whose prompt is `prefix` followed by `len` random words, exactly `prefix.len() + len`
    /// tokens long.
    fn request(
        &self,
        rng: &mut impl Rng,
        prefix: &[u32],
        len: usize,
        max_tokens: usize,
        format: PromptFormat,
        class: RequestClass,
    ) -> Result<BenchRequest, BenchError> {
        let target = prefix.len() + len;
        for _ in 0..TEXT_ATTEMPTS {
            let mut ids = prefix.to_vec();
            ids.extend(self.random_ids(rng, len));
            let prompt = match format {
                PromptFormat::Tokens => Prompt::Tokens(ids),
                PromptFormat::Text => {
                    let text = self.tokenizer.decode(&ids, false)?;
                    if self.tokenizer.encode(&text, false)?.len() != target {
                        continue;
                    }
                    Prompt::Text(text)
                }
            };
            return Ok(BenchRequest {
                prompt,
                prompt_len: target,
                max_tokens,
                class,
                at_s: None,
            });
        }
        Err(BenchError::Prompt(format!(
            "no random text of {target} tokens re-encoded to {target} tokens in {TEXT_ATTEMPTS} attempts; use --prompt-format tokens"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default model's tokenizer, or `None` (the test skips) when scripts/fetch-model.sh has not run.
    fn builder() -> Option<PromptBuilder> {
        Some(PromptBuilder::load(&tandem_testkit::model_path()?).unwrap())
    }

    fn ids_of(b: &PromptBuilder, p: &Prompt) -> Vec<u32> {
        match p {
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Text(t) => b.tokenizer().encode(t, false).unwrap(),
        }
    }

    #[test]
    fn prompts_are_token_exact_in_both_formats() {
        let Some(b) = builder() else { return };
        let spec = WorkloadSpec::Random {
            input: LengthSpec {
                len: 100,
                range_ratio: 0.5,
            },
            output: LengthSpec::fixed(7),
        };
        for format in [PromptFormat::Text, PromptFormat::Tokens] {
            let w = spec.generate(&b, 20, format, 3).unwrap();
            assert_eq!(w.requests.len(), 20);
            for r in &w.requests {
                assert!((50..=150).contains(&r.prompt_len), "{}", r.prompt_len);
                assert_eq!(ids_of(&b, &r.prompt).len(), r.prompt_len);
                assert_eq!(r.max_tokens, 7);
            }
            let lens: std::collections::BTreeSet<_> =
                w.requests.iter().map(|r| r.prompt_len).collect();
            assert!(lens.len() > 1, "ranged lengths vary");
        }
        // The same seed gives the same prompts; another seed other ones.
        let a = spec.generate(&b, 3, PromptFormat::Text, 3).unwrap();
        let again = spec.generate(&b, 3, PromptFormat::Text, 3).unwrap();
        let other = spec.generate(&b, 3, PromptFormat::Text, 4).unwrap();
        assert_eq!(a.requests[0].prompt, again.requests[0].prompt);
        assert_ne!(a.requests[0].prompt, other.requests[0].prompt);
    }

    #[test]
    fn shared_prefix_prompts_share_their_prefix() {
        let Some(b) = builder() else { return };
        let spec = WorkloadSpec::SharedPrefix {
            prefix_len: 64,
            num_prefixes: 2,
            suffix: LengthSpec::fixed(8),
            output: LengthSpec::fixed(4),
        };
        let w = spec.generate(&b, 6, PromptFormat::Text, 1).unwrap();
        let ids: Vec<Vec<u32>> = w.requests.iter().map(|r| ids_of(&b, &r.prompt)).collect();
        assert!(ids.iter().all(|i| i.len() == 72));
        assert_eq!(ids[0][..64], ids[2][..64]);
        assert_eq!(ids[1][..64], ids[5][..64]);
        assert_ne!(ids[0][..64], ids[1][..64]);
        assert_ne!(ids[0][64..], ids[2][64..]);
    }

    #[test]
    fn bursty_adds_timed_bursts_of_long_prompts() {
        let Some(b) = builder() else { return };
        let spec = WorkloadSpec::Bursty(BurstySpec {
            steady_input: LengthSpec::fixed(16),
            steady_output: LengthSpec::fixed(8),
            steady_rate: 4.0,
            burst_input: 200,
            burst_output: 2,
            burst_size: 3,
            burst_interval_s: 1.0,
        });
        // Serialized flat, its fields beside the tag, as when they were the variant's own.
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            (json["kind"].as_str(), json["burst_size"].as_u64()),
            (Some("bursty"), Some(3))
        );
        assert_eq!(serde_json::from_value::<WorkloadSpec>(json).unwrap(), spec);
        let w = spec.generate(&b, 40, PromptFormat::Tokens, 5).unwrap();
        let steady: Vec<_> = w
            .requests
            .iter()
            .filter(|r| r.class == RequestClass::Steady)
            .collect();
        let burst: Vec<_> = w
            .requests
            .iter()
            .filter(|r| r.class == RequestClass::Burst)
            .collect();
        assert_eq!(steady.len(), 40);
        assert!(!w.burst_times_s.is_empty());
        assert_eq!(burst.len(), 3 * w.burst_times_s.len());
        assert!(burst
            .iter()
            .all(|r| r.prompt_len == 200 && r.max_tokens == 2));
        assert!(w
            .burst_times_s
            .iter()
            .all(|t| burst.iter().any(|r| r.at_s == Some(*t))));
        let times: Vec<f64> = w.requests.iter().map(|r| r.at_s.unwrap()).collect();
        assert!(
            times.windows(2).all(|p| p[0] <= p[1]),
            "sorted by send time"
        );
    }

    #[test]
    fn jsonl_prompts_are_read_and_bad_lines_named() {
        let Some(b) = builder() else { return };
        let dir = std::env::temp_dir().join(format!("tandem-bench-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        std::fs::write(
            &good,
            "{\"prompt\": \"Name three rivers.\", \"max_tokens\": 5}\n\n{\"prompt\": \"Hello there\"}\n",
        )
        .unwrap();
        let spec = WorkloadSpec::Jsonl {
            path: good,
            output_len: 9,
        };
        let w = spec.generate(&b, 0, PromptFormat::Text, 0).unwrap();
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].max_tokens, 5);
        assert_eq!(w.requests[1].max_tokens, 9);
        assert_eq!(
            w.requests[1].prompt_len,
            b.tokenizer().encode("Hello there", false).unwrap().len()
        );
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"prompt\": \"ok\"}\n{\"text\": 1}\n").unwrap();
        let err = WorkloadSpec::Jsonl {
            path: bad,
            output_len: 1,
        }
        .generate(&b, 0, PromptFormat::Text, 0)
        .unwrap_err();
        assert!(err.to_string().contains("bad.jsonl:2:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
