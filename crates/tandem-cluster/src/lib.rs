//! Prefill/decode disaggregation behind one OpenAI endpoint.
//!
//! Three roles: the **ingress** (the OpenAI API of `tandem-api`, tokenization, templates, routing and
//! streaming) runs [`Ingress`], a [`tandem_api::GenerateBackend`]; **prefill workers** and **decode
//! workers** each run one engine behind a [`WorkerService`]. A request goes:
//!
//! 1. the ingress picks a decode worker D (least loaded by KV blocks and sequences, power of two
//!    choices) and, unless the part of the prompt not already cached on D is shorter than
//!    `routing.local_prefill_threshold`, a prefill worker P (longest cached prefix, within a load bound);
//! 2. P runs the prompt prefill-only, pins its KV blocks and answers with the first token and a
//!    [`tandem_kv::TransferHandle`]; the ingress streams that first token to the client at once;
//! 3. D reserves blocks, **pulls** the KV from P over `tandem-kv` (which acks, so P unpins), decodes,
//!    and streams the remaining tokens back as NDJSON.
//!
//! Failures: a prefill RPC that fails is retried on another prefill worker, then on D itself; a pull that
//! fails makes D prefill itself. The client gets a complete answer either way. A decode worker lost
//! mid-stream (killed, unreachable, engine error) is replaced: the ingress resumes the request on another
//! healthy decode worker, which recomputes the prompt and the tokens already delivered
//! (`RequestMode::Resume`, so greedy and seeded outputs continue unchanged) and streams the rest; with no
//! decode worker left the stream ends with an error the client sees, never a hang. Pins are released on ack,
//! on abort (client gone: the ingress posts `release`), on pull failure and by timeout.
//!
//! # Why the control RPC is HTTP + JSON
//!
//! Ingress ↔ worker control traffic (register, prefill, decode, release, load polls) is HTTP with JSON
//! bodies whose serde types live in [`protocol`], served by axum on the worker and called with reqwest
//! from the ingress; token streams are NDJSON. No protoc or code generation, the same stack as the
//! OpenAI API, and every call can be debugged with curl. The hot data path — the KV bytes — does not go
//! through this RPC at all: it is `tandem-kv`'s binary wire format over TCP or shared memory.
//!
//! Membership: the workers `tandem serve` starts, those that register themselves, and with
//! [`DiscoveryConfig`] `mode: dns` every address a role's DNS name resolves to (`discovery`). A worker
//! drains on SIGTERM ([`WorkerService::drain`]): its `/health` answers 503 and its load says so, the
//! ingress routes nothing new to it, and it exits once its requests and pins are done.
//!
//! Worker compatibility is checked twice: at registration in the ingress (model identity and KV layout,
//! a mismatch refused with [`ClusterError::Refused`] naming the field) and again in every `tandem-kv`
//! connection handshake.

mod admission;
pub mod auth;
pub mod discovery;
mod engine_kv;
pub mod error;
pub mod ingress;
pub mod metrics;
pub mod prefix;
pub mod protocol;
mod registry;
pub mod routing;
mod rpc;
pub mod worker;

pub use discovery::{DiscoveryConfig, DiscoveryMode, DnsResolver, Resolver};
pub use error::ClusterError;
pub use ingress::{Ingress, TimeoutConfig, WorkerStatus};
pub use protocol::{Role, WorkerInfo, WorkerLoad};
pub use routing::RoutingConfig;
pub use rpc::with_cluster_tls;
pub use tandem_kv::{ClusterKey, ClusterTls, NixlBackend};
pub use worker::{peer_info, KvTransferConfig, TransportKind, WorkerConfig, WorkerService};

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod cluster_tests;
