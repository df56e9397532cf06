//! Test support for tandem's crates (a dev-dependency only, never published): the default model with one
//! rule for when it is missing, the mock backend, the checks of the `Backend` contract that every
//! backend runs, greedy request bodies, free ports, health polling, certificates for the TLS tests, a
//! `tandem serve` child process (plain or HTTPS) killed on drop with HTTP helpers that assert on its
//! answers, a `tandem worker` started by hand, and any child read up to its ready line (`spawn_ready`).
//!
//! It depends only on `tandem-model` and `tandem-engine`, so every crate above them may use it in its unit
//! tests without a dependency cycle; the engine itself uses it from its integration tests only.

pub mod conformance;
mod mock;
mod model;
pub mod pki;
mod server;
mod worker;

pub use mock::{mock_guide, mock_pieces, mock_text, MockBackend, MockCounts, MOCK_PIECES};
pub use model::{
    default_model, model, model_path, root, run_ok, DEFAULT_MODEL, DEFAULT_MODEL_NAME,
};
pub use pki::TestPki;
pub use server::{
    free_port, greedy_body, health_status, healthy, json_of, signal, text, worker_urls, Server,
};
pub use worker::{spawn_ready, Killed, Worker};

use serde_json::Value;
use tandem_model::Tokenizer;

/// Three long prose prompts (several KV blocks each) whose greedy answers the multi-process tests compare
/// between deployments.
pub const PROMPTS: &[&str] = &[
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith \
     from Mainz, combined movable metal type with an oil-based ink and a screw press adapted from",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to \
     synthesize foods from carbon dioxide and water. In plants it generally involves the green pigment",
    "In computer science, a hash table is a data structure that implements an associative array, which \
     maps keys to values. A hash table uses a hash function to compute an index into an array of",
];

/// Checks one tokenizer fixture case (`{"text": ..., "ids": [...]}`, as the fixture scripts write them):
/// `tok` encodes the text without special tokens to exactly the ids and decodes those back to
/// `case[decoded_key]`. `label` prefixes the assertion messages; returns the text and the ids.
pub fn assert_tokenizer_case<'a>(
    tok: &Tokenizer,
    case: &'a Value,
    decoded_key: &str,
    label: &str,
) -> (&'a str, Vec<u32>) {
    let text = case["text"].as_str().unwrap();
    let want: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let got = tok.encode(text, false).unwrap();
    assert_eq!(got, want, "{label}encode({text:?})");
    let decoded = case[decoded_key].as_str().unwrap();
    assert_eq!(
        tok.decode(&got, false).unwrap(),
        decoded,
        "{label}decode of {text:?}"
    );
    (text, got)
}
