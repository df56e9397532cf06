//! The crate's typed error.

use std::time::Duration;

/// Everything that can go wrong while moving KV between workers; callers match on it to decide
/// between retrying a pull, recomputing a prefill, or refusing a peer outright.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The two workers disagree on something that makes their KV bytes incompatible; named so the
    /// operator sees which setting to fix instead of getting silently wrong tokens.
    #[error("KV peer mismatch on `{field}`: local {local}, remote {remote}")]
    Mismatch {
        /// Which handshake field differs (e.g. `"dtype"`, `"block_size"`).
        field: &'static str,
        /// This worker's value.
        local: String,
        /// The peer's value.
        remote: String,
    },
    /// A socket or file operation failed.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What the transfer was doing.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An await exceeded its deadline; every network wait is bounded so nothing hangs.
    #[error("timed out after {after:?} while {context}")]
    Timeout {
        /// What the transfer was waiting for.
        context: &'static str,
        /// The deadline that elapsed.
        after: Duration,
    },
    /// The peer failed the cluster token challenge, or this side cannot answer one (`crate::auth`).
    #[error("cluster authentication failed: {0}")]
    Auth(String),
    /// The peer sent bytes that do not follow the wire format.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A peer's reply states a length other than the request implies (a stage's forward reply, a block
    /// export); refused before anything is allocated, so no peer sizes the reader's buffers.
    #[error("{peer} answered a {what} of {stated} bytes, expected {expected}")]
    ReplyLength {
        /// The peer that sent the reply.
        peer: std::net::SocketAddr,
        /// What the reply was for.
        what: &'static str,
        /// The length the reply's header states.
        stated: u64,
        /// The length the request implies.
        expected: u64,
    },
    /// The transfer id is not (or no longer) pinned on the serving worker: released, timed out or never registered.
    #[error("unknown or released transfer {0}")]
    UnknownTransfer(u64),
    /// A transfer with no blocks was registered; there is nothing to pull.
    #[error("a transfer needs at least one block")]
    EmptyTransfer,
    /// A transfer id was registered twice.
    #[error("transfer {0} is already registered")]
    DuplicateTransfer(u64),
    /// The serving side reported an error it could not express more precisely.
    #[error("remote error: {0}")]
    Remote(String),
    /// The `KvSource` failed to provide block bytes.
    #[error("KV source failed: {0}")]
    Source(String),
    /// The `KvSink` refused or failed to store block bytes.
    #[error("KV sink failed: {0}")]
    Sink(String),
    /// A TLS configuration could not be built from its files (names the setting and file).
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// NIXL could not be loaded or one of its calls failed; names the library, symbol, plugin or call.
    #[error(transparent)]
    Nixl(#[from] crate::nixl::NixlError),
    /// A frame's checksum did not match its payload.
    #[error("checksum mismatch on transfer {transfer_id} layer {layer}")]
    Checksum {
        /// The transfer the frame belonged to.
        transfer_id: u64,
        /// The layer the frame carried.
        layer: u32,
    },
}

impl KvError {
    /// Wraps an I/O error with what was being done, for `map_err`.
    pub(crate) fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> KvError {
        move |source| KvError::Io { context, source }
    }
}

/// Awaits `fut` for at most `after`, turning an elapsed deadline into [`KvError::Timeout`].
pub(crate) async fn timed<T, F>(
    after: Duration,
    context: &'static str,
    fut: F,
) -> Result<T, KvError>
where
    F: std::future::Future<Output = Result<T, KvError>>,
{
    match tokio::time::timeout(after, fut).await {
        Ok(r) => r,
        Err(_) => Err(KvError::Timeout { context, after }),
    }
}
