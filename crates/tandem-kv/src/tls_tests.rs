//! PEM loading refuses bad files with errors naming the setting, and the KV port under mutual TLS moves
//! the same bytes to a cluster peer while refusing one whose certificate another CA signed, or none.

use std::sync::Arc;
use std::time::Duration;

use tandem_testkit::TestPki;

use super::*;
use crate::mem::{MemSink, MemSource};
use crate::peer::tests::smollm_info;
use crate::{
    KvClient, KvError, KvServer, KvServerConfig, PeerInfo, TcpConfig, TcpTransport, TransferHandle,
};

fn paths(pki: &TestPki) -> ClusterTlsPaths {
    ClusterTlsPaths {
        ca: pki.ca.clone(),
        cert: pki.cert.clone(),
        key: pki.key.clone(),
        server_name: None,
    }
}

fn api_paths(cert: &Path, key: &Path) -> CertPaths {
    CertPaths {
        cert: cert.to_owned(),
        key: key.to_owned(),
        cert_setting: "server.tls.cert",
        key_setting: "server.tls.key",
    }
}

#[test]
fn good_files_load_and_bad_ones_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    ClusterTls::load(&paths(&pki)).unwrap();
    server_config(&api_paths(&pki.cert, &pki.key)).unwrap();

    let missing = dir.path().join("nope.pem");
    let e = server_config(&api_paths(&missing, &pki.key)).unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::Read {
                setting: "server.tls.cert",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("nope.pem"), "{e}");

    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n").unwrap();
    let e = server_config(&api_paths(&garbage, &pki.key)).unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::Pem {
                setting: "server.tls.cert",
                ..
            }
        ),
        "{e}"
    );
    let e = server_config(&api_paths(&pki.cert, &garbage)).unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::Pem {
                setting: "server.tls.key",
                ..
            }
        ),
        "{e}"
    );
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "no pem here\n").unwrap();
    let e = ClusterTls::load(&ClusterTlsPaths {
        ca: empty,
        ..paths(&pki)
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::Pem {
                setting: "deployment.cluster_tls.ca",
                ..
            }
        ),
        "{e}"
    );

    // The wrong CA's key with the right certificate: refused before any connection.
    let e = server_config(&api_paths(&pki.cert, &pki.wrong_key)).unwrap_err();
    assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
    let e = ClusterTls::load(&ClusterTlsPaths {
        key: pki.wrong_key.clone(),
        ..paths(&pki)
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::KeyMismatch {
                key_setting: "deployment.cluster_tls.key",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn server_names_come_from_the_dialled_host() {
    assert_eq!(host_of("127.0.0.1:9000"), "127.0.0.1");
    assert_eq!(
        host_of("https://worker-0.tandem:8100/v1"),
        "worker-0.tandem"
    );
    assert_eq!(host_of("[::1]:80"), "::1");
    assert_eq!(host_of("localhost"), "localhost");
}

/// A KV server under `tls` with 6 random blocks pinned.
async fn tls_server(
    tls: ClusterTls,
) -> (
    KvServer,
    crate::KvListener,
    TransferHandle,
    PeerInfo,
    Arc<MemSource>,
) {
    let info = smollm_info();
    let source = Arc::new(MemSource::random(info.layout, 12, 3));
    let config = KvServerConfig {
        io_timeout: Duration::from_secs(5),
        tls: Some(Arc::new(tls)),
        ..KvServerConfig::default()
    };
    let server = KvServer::new(config, info.clone(), source.clone());
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let handle = server.register(vec![0, 2, 4, 6, 8, 10], 6 * 16).unwrap();
    (server, listener, handle, info, source)
}

async fn pull(
    tls: Option<ClusterTls>,
    handle: &TransferHandle,
    info: &PeerInfo,
) -> Result<Arc<MemSink>, KvError> {
    let config = TcpConfig {
        streams: 3,
        io_timeout: Duration::from_secs(5),
        tls: tls.map(Arc::new),
        ..TcpConfig::default()
    };
    let sink = Arc::new(MemSink::new(info.layout, handle.block_ids.len()));
    KvClient::new(Arc::new(TcpTransport::new(info.clone(), config)))
        .pull(handle, sink.clone())
        .await?;
    Ok(sink)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_over_mutual_tls_moves_the_same_bytes_and_strangers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let (server, _listener, handle, info, source) =
        tls_server(ClusterTls::load(&paths(&pki)).unwrap()).await;

    // A certificate from another CA (which also distrusts the server), and a plain-TCP client.
    let stranger = ClusterTls::load(&ClusterTlsPaths {
        ca: pki.wrong_ca.clone(),
        cert: pki.wrong_cert.clone(),
        key: pki.wrong_key.clone(),
        server_name: None,
    })
    .unwrap();
    let e = pull(Some(stranger), &handle, &info)
        .await
        .err()
        .expect("wrong CA refused");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    // Trusting the right CA but presenting the other CA's certificate: the server refuses it.
    let wrong_cert = ClusterTls::load(&ClusterTlsPaths {
        ca: pki.ca.clone(),
        cert: pki.wrong_cert.clone(),
        key: pki.wrong_key.clone(),
        server_name: None,
    })
    .unwrap();
    assert!(pull(Some(wrong_cert), &handle, &info).await.is_err());
    assert!(
        pull(None, &handle, &info).await.is_err(),
        "plain TCP to a TLS port"
    );
    assert_eq!(
        server.metrics().snapshot().bytes_sent,
        0,
        "no byte to a stranger"
    );
    assert_eq!(server.pinned(), 1, "refused pulls leave the pin alone");

    let sink = pull(
        Some(ClusterTls::load(&paths(&pki)).unwrap()),
        &handle,
        &info,
    )
    .await
    .unwrap();
    for l in 0..info.layout.n_layers {
        for (i, &b) in handle.block_ids.iter().enumerate() {
            assert_eq!(sink.block(l, i), source.block(l, b), "layer {l} block {i}");
        }
    }
    assert_eq!(server.pinned(), 0, "the ack released the pin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_refuses_a_server_of_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let other = ClusterTls::load(&ClusterTlsPaths {
        ca: pki.wrong_ca.clone(),
        cert: pki.wrong_cert.clone(),
        key: pki.wrong_key.clone(),
        server_name: None,
    })
    .unwrap();
    let (server, _listener, handle, info, _) = tls_server(other).await;
    let e = pull(
        Some(ClusterTls::load(&paths(&pki)).unwrap()),
        &handle,
        &info,
    )
    .await
    .err()
    .expect("a server of another CA is refused");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    assert_eq!(server.metrics().snapshot().bytes_sent, 0);
}
