//! The typed control RPC between ingress and workers: HTTP paths and the JSON bodies on them.
//!
//! Both sides compile against these types, so a field added here is added on both ends at once.

use serde::{Deserialize, Serialize};
use tandem_engine::{EngineStats, FinishReason, SamplingParams, TokenLogprobs, TokenOutput};
use tandem_kv::{KvMetricsSnapshot, PeerInfo, TransferHandle};

/// `GET`: who the worker is and how its KV is laid out (the registration handshake reads it).
pub const PATH_INFO: &str = "/v1/worker/info";
/// `GET`: load and counters, polled by the ingress for routing and metrics.
pub const PATH_LOAD: &str = "/v1/worker/load";
/// `POST` [`PrefillRequest`] → [`PrefillResponse`]: prefill-only on a prefill worker.
pub const PATH_PREFILL: &str = "/v1/worker/prefill";
/// `POST` [`DecodeRequest`] → NDJSON of [`StreamEvent`]: decode (after a KV pull, or with a local prefill).
pub const PATH_DECODE: &str = "/v1/worker/decode";
/// `POST` [`ReleaseRequest`]: unpins a transfer nobody will pull (client gone, decode failed to start).
pub const PATH_RELEASE: &str = "/v1/worker/release";
/// `POST` [`RegisterRequest`] on the ingress: a worker started elsewhere joins the deployment.
pub const PATH_REGISTER: &str = "/v1/cluster/workers";
/// `GET` on a worker: readiness for orchestrators (200 while it takes work, 503 once it drains).
pub const PATH_HEALTH: &str = "/health";
/// `GET` on a worker: its own Prometheus metrics (engine, KV transfer, pins), for a scraper per worker.
pub const PATH_METRICS: &str = "/metrics";

/// What a worker does in a disaggregated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompt KV and the first token, then serves the KV to decode workers.
    Prefill,
    /// Pulls KV (or prefills short prompts itself) and generates the rest.
    Decode,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "unknown role `{other}` (expected prefill or decode)"
            )),
        }
    }
}

/// A worker's identity card, answered on [`PATH_INFO`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Unique name in the deployment (logs, metrics labels, transfer handles).
    pub worker_id: String,
    /// Its role.
    pub role: Role,
    /// Model identity hash and KV layout: the registration handshake compares these.
    pub peer: PeerInfo,
    /// Where its KV server listens (prefill workers; empty for decode workers).
    pub kv_endpoint: String,
    /// Longest prompt + completion its engine accepts.
    pub max_model_len: usize,
    /// Running sequences per engine step (scales the load score).
    pub max_num_seqs: usize,
    /// OS process id, so an operator (or a test) can find the process behind a worker.
    pub pid: u32,
    /// Random per process start: tells a new process at a known address (often pid 1 again, in a
    /// container) from the one that passed the handshake there.
    #[serde(default)]
    pub instance: u64,
}

/// A worker's load, answered on [`PATH_LOAD`].
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The engine's counters and gauges.
    pub engine: EngineStats,
    /// KV blocks pinned for transfers not yet acked (prefill workers).
    pub pinned_blocks: usize,
    /// Transfers pinned and not yet acked.
    pub pinned_transfers: usize,
    /// Requests this worker's RPC layer is serving now.
    pub in_flight: usize,
    /// KV transfer counters (server side on prefill workers, client side on decode workers).
    pub kv: KvMetricsSnapshot,
    /// Bytes of registered staging memory (`transport: nixl`; 0 without), and how many of them no
    /// transfer holds: equal when idle, or a transfer leaked its slice.
    #[serde(default)]
    pub staging_bytes: usize,
    /// See `staging_bytes`.
    #[serde(default)]
    pub staging_free_bytes: usize,
    /// Decode imports waiting for KV blocks (the cache is full of running sequences).
    #[serde(default)]
    pub imports_waiting: usize,
    /// The engine's bound on waiting requests, which also bounds `imports_waiting`: past it a decode
    /// worker answers 503, and the ingress refuses new requests with Retry-After when every decode
    /// worker is there.
    #[serde(default)]
    pub max_waiting: usize,
    /// The worker is draining (SIGTERM): it finishes what it has and must get no new work.
    #[serde(default)]
    pub draining: bool,
    /// Its [`WorkerInfo::instance`]: a poll answered by another process is not this worker's.
    #[serde(default)]
    pub instance: u64,
}

impl WorkerLoad {
    /// The requests and imports waiting on this worker when they reach its bound, else `None` (also
    /// for a worker that reports no bound).
    pub fn saturated(&self) -> Option<usize> {
        let waiting = self.engine.waiting + self.imports_waiting;
        (self.max_waiting > 0 && waiting >= self.max_waiting).then_some(waiting)
    }
}

/// Body of [`PATH_PREFILL`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PrefillRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling parameters (the first token is sampled here).
    pub params: SamplingParams,
}

/// Answer of [`PATH_PREFILL`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PrefillResponse {
    /// The first generated token; its `finish` is set when the request ends with it.
    pub first: WireToken,
    /// Where to pull the prompt's KV; `None` when the request already finished (nothing stays pinned).
    pub handle: Option<TransferHandle>,
}

/// Body of [`PATH_DECODE`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DecodeRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// The KV to pull and the first token it produced; `None` means prefill here.
    pub prefilled: Option<Prefilled>,
    /// Tokens already generated and delivered by a decode worker that was lost mid-stream: this worker
    /// recomputes them after the prompt and streams only what follows (needs `prefilled: None`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume: Vec<u32>,
}

/// A finished remote prefill handed to a decode worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Prefilled {
    /// The first token the prefill worker sampled.
    pub first_token: u32,
    /// Where its KV is pinned.
    pub handle: TransferHandle,
}

/// Body of [`PATH_RELEASE`].
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct ReleaseRequest {
    /// The transfer to unpin.
    pub transfer_id: u64,
}

/// Body of [`PATH_REGISTER`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// Base URL of the worker's RPC server, e.g. `http://10.0.0.5:8101`.
    pub url: String,
}

/// A generated token as it travels between processes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireToken {
    /// Token id.
    pub token: u32,
    /// Logprobs, when requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<TokenLogprobs>,
    /// Set on the request's last token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish: Option<FinishReason>,
    /// On the first token of a request that scored its prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

impl From<TokenOutput> for WireToken {
    fn from(o: TokenOutput) -> Self {
        WireToken {
            token: o.token,
            logprobs: o.logprobs,
            finish: o.finish,
            prompt_logprobs: o.prompt_logprobs,
        }
    }
}

impl From<WireToken> for TokenOutput {
    fn from(w: WireToken) -> Self {
        TokenOutput {
            token: w.token,
            logprobs: w.logprobs,
            finish: w.finish,
            prompt_logprobs: w.prompt_logprobs,
        }
    }
}

/// One line of the NDJSON answer of [`PATH_DECODE`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEvent {
    /// The KV pull finished (first line when the prompt was prefilled remotely); feeds ingress metrics.
    Transfer {
        /// Payload bytes moved.
        bytes: u64,
        /// Wall time of the pull.
        seconds: f64,
        /// Blocks moved.
        blocks: usize,
        /// Prompt blocks the decode worker's prefix cache already held, so they were not moved.
        #[serde(default)]
        skipped_blocks: usize,
    },
    /// A generated token (after a pull the first one repeats the prefill worker's first token).
    Token(WireToken),
    /// The worker failed the request; no more lines follow.
    Error(String),
}

/// The JSON body of every non-2xx worker answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for logs and for the operator.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_events_round_trip_as_single_lines() {
        let events = vec![
            StreamEvent::Transfer {
                bytes: 10,
                seconds: 0.5,
                blocks: 2,
                skipped_blocks: 3,
            },
            StreamEvent::Token(WireToken {
                token: 7,
                logprobs: None,
                finish: Some(FinishReason::Stop),
                prompt_logprobs: None,
            }),
            StreamEvent::Error("boom".into()),
        ];
        for e in events {
            let line = serde_json::to_string(&e).unwrap();
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<StreamEvent>(&line).unwrap(), e);
        }
    }

    #[test]
    fn roles_parse_and_print() {
        for r in [Role::Prefill, Role::Decode] {
            assert_eq!(r.to_string().parse::<Role>().unwrap(), r);
        }
        assert!("both".parse::<Role>().is_err());
    }
}
