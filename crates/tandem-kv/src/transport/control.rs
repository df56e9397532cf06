//! The pull of the transports whose data moves outside one control connection (shared memory; NIXL can
//! adopt it): one request frame, the transport's own receive loop, then the ack or abort on that connection.

use std::future::Future;
use std::sync::Arc;

use crate::tls::MaybeTls;
use serde::Serialize;

use crate::transport::tcp::{ack_only, connect, finish_on_control, TcpConfig};
use crate::wire::{self, FrameKind, FrameReader};
use crate::{KvError, KvSink, PeerInfo, PullSelection, TransferHandle};

/// What a one-connection transport adds to [`pull`]: its request frame and how it receives the data.
pub(crate) trait ControlPull: Send + Sync {
    /// The request frame's payload.
    type Request: Serialize + Send + Sync;
    /// The request frame's kind.
    const KIND: FrameKind;
    /// The decode side's identity and the socket knobs the control connection is made with.
    fn socket(&self) -> (&PeerInfo, &TcpConfig);
    /// The request for `selection` of `handle`, built once connected.
    fn request(&self, handle: &TransferHandle, selection: &PullSelection) -> Self::Request;
    /// Reads the server's answer to the request and delivers the data into `sink`, returning its bytes;
    /// `sink.complete()` is left to [`pull`].
    fn receive(
        &self,
        c: &mut FrameReader<MaybeTls>,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: &Arc<dyn KvSink>,
    ) -> impl Future<Output = Result<u64, KvError>> + Send;
}

/// Acks an empty selection at once; otherwise connects, sends the request, receives, completes the sink,
/// and acks on success or aborts with the first error on the same connection.
pub(crate) async fn pull<T: ControlPull>(
    t: &T,
    handle: &TransferHandle,
    selection: &PullSelection,
    sink: Arc<dyn KvSink>,
) -> Result<u64, KvError> {
    let (local, config) = t.socket();
    if selection.is_empty() {
        return ack_only(handle, local, config, &*sink).await;
    }
    let tid = handle.transfer_id;
    let io = config.io_timeout;
    let mut c = connect(&handle.endpoint, local, config).await?;
    wire::send_json(c.get_mut(), T::KIND, tid, &t.request(handle, selection), io).await?;
    let received = t.receive(&mut c, handle, selection, &sink).await;
    let (bytes, err) = match received.and_then(|b| sink.complete().map(|()| b)) {
        Ok(b) => (b, None),
        Err(e) => (0, Some(e)),
    };
    finish_on_control(&mut c, tid, err, io)
        .await
        .map(|()| bytes)
}
