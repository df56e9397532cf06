//! KV cache transfer between a prefill worker and a decode worker.
//!
//! A prefill worker computes a prompt's KV, keeps its blocks pinned, and [`KvServer::register`]s them,
//! getting a [`TransferHandle`] (worker, endpoint, transfer id, block ids, token count, layout). A decode
//! worker allocates blocks and [`KvClient::pull`]s the handle into its [`KvSink`] — or, when its own
//! prefix cache already holds the first blocks, [`KvClient::pull_blocks`] only a [`BlockSelection`] of
//! them, so cached blocks never cross the wire ([`KvClient::pull_selection`] narrows it per layer, so a
//! sliding-window layer's blocks behind its window stay behind too); when every layer has landed the client acks and the
//! server calls [`KvSource::release`] (an empty selection moves no data but still acks). Release happens exactly once per
//! transfer: on ack, on abort (decode failure, sink error, prefill-side [`KvServer::abort`]), when the
//! pulling control connection drops, or when nobody acked within `pin_timeout`.
//!
//! Transports ([`KvTransport`]): [`InProcTransport`] (direct calls, for engine tests), [`TcpTransport`]
//! (several connections per pull, layer `l` on connection `l % streams`, one frame per layer's blocks,
//! vectored header+payload writes, one reusable receive buffer per connection) and [`ShmTransport`]
//! (same host: the server copies blocks into a `/dev/shm` file, only offsets travel on the socket). Both
//! socket transports hand each layer to the sink as it arrives, so decode can start on layer 0 early.
//! [`NixlTransport`] READs the layers through NIXL (loaded at run time, [`nixl`]) out of the server's registered
//! memory, with the TCP connection kept for handshake, announcements and the ack (`NixlPull` → `NixlOpen` →
//! `NixlLayer`* → `PullDone`).
//!
//! # Wire format (version 3)
//!
//! Every frame is a 40-byte little-endian header followed by `payload_len` bytes:
//!
//! | offset | size | field                                                      |
//! |-------:|-----:|------------------------------------------------------------|
//! | 0      | 4    | magic `b"TNKV"`                                            |
//! | 4      | 2    | version (3); a different version is a `wire_version` mismatch |
//! | 6      | 1    | kind ([`wire::FrameKind`])                                 |
//! | 7      | 1    | flags (bit 0: `checksum` holds the payload's CRC32)        |
//! | 8      | 8    | transfer id                                                |
//! | 16     | 4    | layer                                                      |
//! | 20     | 4    | first block (index into the transfer's block list)         |
//! | 24     | 4    | number of blocks                                           |
//! | 28     | 4    | checksum (CRC32, optional)                                 |
//! | 32     | 8    | payload length                                             |
//!
//! Control payloads are JSON (cold path); `Data` payloads are raw block bytes, `n_blocks * block_bytes`,
//! each block being the engine's contiguous `[K|V][kv_head][slot][head_dim]` range for one layer.
//!
//! A connection: client `Hello(PeerInfo)` → (with a cluster secret: the challenge-response of [`auth`])
//! → server `HelloReply(PeerInfo)`. Both sides compare model id,
//! dtype, block size, layer count, head counts and head dim; a difference is refused at first contact as
//! [`KvError::Mismatch`] naming the field (never a silent recompute). Every pull names the blocks it wants
//! as a [`PullSelection`] `selection`: `{"blocks": [[start, end], ...], "layer_from": [...]}`, runs of indices
//! into the transfer's block list, and per layer the first index that layer wants (absent: 0 for every
//! layer). Layer `l` carries the selected indices from `layer_from[l]` on, possibly none (version 3; version
//! 2 had no `layer_from`, version 1 always moved every block). "Packed" below means every layer's selected
//! blocks back to back in ascending index order, layer after layer ([`PullSelection::packed_layers`]). Then
//! either
//! - `Pull{layers, selection, control, checksum}` → `Data`* → `PullDone` (TCP data plane), where each layer's
//!   `Data` frames cover its selected runs in order and never span two runs (a layer of no block has none), or
//! - `ShmPull{selection}` → `ShmOpen{path, map_len, total_len}` → `ShmLayer`* → `PullDone`, where the file
//!   holds the selection packed and each `ShmLayer` is sent once that layer is written (layers may finish in
//!   any order); or
//! - `NixlPull{selection, known}` → `NixlOpen{agent, md_gen, md, layers}` → `NixlLayer`* → `PullDone`, where
//!   `layers` names each layer's packed region in the server's registered memory, which the client READs;
//!
//! and on the control connection `Ack` → `AckOk` or `Abort`. A pull of no block skips straight to `Ack`. An `Error(WireError)` frame may replace any
//! server reply; the server then closes. Shared-memory files are pooled: a segment belongs to one transfer
//! from `ShmOpen` until that transfer's ack, abort or disconnect, then returns to the server's pool (files
//! beyond `shm_cache_bytes` are unlinked); clients keep their read-only mappings cached.
//!
//! The `Stage*` frame kinds belong to the pipeline stage link (`tandem_pipeline::link`), which reuses this
//! header over its own blocking sockets; this crate only reserves their numbers.

pub mod auth;
pub mod bench;
mod error;
#[cfg(fuzzing)]
pub mod fuzzing;
pub mod mem;
mod metrics;
pub mod nixl;
mod peer;
mod registry;
mod selection;
mod server;
mod shm_pool;
mod source;
pub mod tls;
pub mod transport;
pub mod wire;

pub use auth::ClusterKey;
pub use error::KvError;
pub use metrics::{KvMetrics, KvMetricsSnapshot, ReleaseReason};
pub use nixl::{
    MemKind, MemRegion, NixlAgent, NixlBackend, NixlConfig, NixlEnv, NixlError, Registration,
};
pub use peer::{check_field, PeerInfo, WireDtype, WireLayout};
pub use selection::{BlockSelection, PullSelection};
pub use server::{default_shm_dir, KvListener, KvServer, KvServerConfig};
pub use source::{KvSink, KvSource, TransferHandle};
pub use tls::{ClusterTls, ClusterTlsPaths, TlsError};
pub use transport::inproc::InProcTransport;
pub use transport::nixl::NixlTransport;
pub use transport::shm::ShmTransport;
pub use transport::tcp::{TcpConfig, TcpTransport};
pub use transport::{KvClient, KvTransport, PullStats};
