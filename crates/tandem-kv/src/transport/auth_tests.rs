//! The cluster secret on the KV port: a stranger (no secret, or a wrong one) can neither pull a pinned
//! block nor get past the hello, a client with the secret refuses a server that does not ask for it,
//! and peers sharing it move KV as before over TCP and shared memory.

use std::sync::Arc;
use std::time::Duration;

use crate::mem::{MemSink, MemSource};
use crate::peer::tests::smollm_info;
use crate::wire::{self, FrameKind, FrameReader, PullRequest};
use crate::*;

/// A KV server holding `key`, with a transfer of 5 blocks pinned.
async fn pinned_server(key: Option<&str>) -> (KvServer, KvListener, TransferHandle, PeerInfo) {
    let info = smollm_info();
    let source = Arc::new(MemSource::random(info.layout, 16, 7));
    let config = KvServerConfig {
        io_timeout: Duration::from_secs(5),
        cluster_key: key.and_then(ClusterKey::new),
        ..KvServerConfig::default()
    };
    let server = KvServer::new(config, info.clone(), source);
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let handle = server.register(vec![1, 3, 5, 7, 9], 5 * 16).unwrap();
    (server, listener, handle, info)
}

fn tcp(key: Option<&str>) -> TcpConfig {
    TcpConfig {
        streams: 2,
        io_timeout: Duration::from_secs(5),
        cluster_key: key.and_then(ClusterKey::new),
        ..TcpConfig::default()
    }
}

async fn pull(
    t: Arc<dyn KvTransport>,
    handle: &TransferHandle,
    info: &PeerInfo,
) -> Result<PullStats, KvError> {
    let sink = Arc::new(MemSink::new(info.layout, handle.block_ids.len()));
    KvClient::new(t).pull(handle, sink).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_cannot_pull_and_cluster_members_can() {
    let (server, _listener, handle, info) = pinned_server(Some("cluster-secret")).await;
    for (key, wanted) in [
        (None, "requires the cluster token"),
        (Some("guess"), "cluster token challenge"),
    ] {
        let t = Arc::new(TcpTransport::new(info.clone(), tcp(key)));
        let err = pull(t, &handle, &info).await.unwrap_err();
        assert!(err.to_string().contains(wanted), "{key:?}: {err}");
        assert_eq!(server.pinned(), 1, "a refused pull leaves the pin alone");
    }
    assert_eq!(server.metrics().snapshot().bytes_sent, 0);

    // By hand: after a hello the server only challenges; a pull instead of the proof gets an error, no data.
    let stream = tokio::net::TcpStream::connect(&handle.endpoint)
        .await
        .unwrap();
    let mut r = FrameReader::new(stream, Duration::from_secs(5));
    let io = Duration::from_secs(5);
    wire::send_json(r.get_mut(), FrameKind::Hello, 0, &info, io)
        .await
        .unwrap();
    let first = r.header().await.unwrap().unwrap();
    assert_eq!(first.kind, FrameKind::AuthChallenge);
    let _: crate::auth::AuthChallenge = r.json(&first).await.unwrap();
    let req = PullRequest {
        layers: vec![0],
        selection: PullSelection::uniform(BlockSelection::all(handle.block_ids.len())),
        control: true,
        checksum: false,
    };
    wire::send_json(r.get_mut(), FrameKind::Pull, handle.transfer_id, &req, io)
        .await
        .unwrap();
    let err = r.expect_frame().await.unwrap_err();
    assert!(
        matches!(err, KvError::Remote(_) | KvError::Protocol(_)),
        "{err}"
    );
    assert!(
        r.header().await.map(|h| h.is_none()).unwrap_or(true),
        "closed"
    );
    assert_eq!(server.metrics().snapshot().bytes_sent, 0);
    assert_eq!(server.pinned(), 1);

    let shm = ShmTransport::new(info.clone(), tcp(Some("cluster-secret")), default_shm_dir());
    let stats = pull(Arc::new(shm), &handle, &info).await.unwrap();
    assert_eq!(stats.bytes, handle.total_bytes());
    let handle = server.register(vec![2, 4], 2 * 16).unwrap();
    let t = Arc::new(TcpTransport::new(info.clone(), tcp(Some("cluster-secret"))));
    assert_eq!(
        pull(t, &handle, &info).await.unwrap().bytes,
        handle.total_bytes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_the_secret_refuses_a_server_without_it() {
    let (server, _listener, handle, info) = pinned_server(None).await;
    let t = Arc::new(TcpTransport::new(info.clone(), tcp(Some("cluster-secret"))));
    let err = pull(t, &handle, &info).await.unwrap_err();
    assert!(matches!(err, KvError::Auth(_)), "{err}");
    assert!(
        err.to_string().contains("not part of this cluster"),
        "{err}"
    );
    // Without a secret on either side the port stays open, as before.
    let t = Arc::new(TcpTransport::new(info.clone(), tcp(None)));
    assert_eq!(
        pull(t, &handle, &info).await.unwrap().bytes,
        handle.total_bytes()
    );
    assert_eq!(server.pinned(), 0);
}
