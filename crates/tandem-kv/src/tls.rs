//! TLS for every tandem link: PEM loading and the rustls configurations built from it, in one place for
//! the crates that speak on the wire (the KV transport here, the cluster's control calls, the pipeline's
//! stage links, the public API's listener).
//!
//! Two shapes:
//! - [`ClusterTls`] (`deployment.cluster_tls: {ca, cert, key}`): mutual TLS. Every peer presents `cert`
//!   (signed by `ca`) and accepts only peers whose certificate `ca` signed, in both directions, so a
//!   stranger without a certificate from the cluster's CA is refused in the handshake.
//! - [`server_config`] (`server.tls: {cert, key}`): a plain server certificate for the public API, whose
//!   clients are not asked for one.
//!
//! Crypto is rustls with the `ring` provider, chosen explicitly per configuration (no process-wide default
//! is installed, so nothing depends on which crate initialised rustls first).

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Why a TLS configuration could not be built; each names the setting (and file) to fix.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read (missing, unreadable).
    #[error("{setting}: cannot read {path}: {source}")]
    Read {
        /// The setting that names the file (e.g. `server.tls.cert`).
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file holds no PEM object of the kind the setting needs, or its PEM is malformed.
    #[error("{setting}: {path} holds no valid PEM {what}: {detail}")]
    Pem {
        /// The setting that names the file.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What was expected ("certificate", "private key").
        what: &'static str,
        /// What the parser said.
        detail: String,
    },
    /// The private key does not belong to the certificate.
    #[error("{key_setting} ({key}) is not the private key of {cert_setting} ({cert})")]
    KeyMismatch {
        /// The key's setting.
        key_setting: &'static str,
        /// The key file.
        key: PathBuf,
        /// The certificate's setting.
        cert_setting: &'static str,
        /// The certificate file.
        cert: PathBuf,
    },
    /// rustls refused the certificates or key for another reason (unsupported key type, bad CA).
    #[error("{setting}: {source}")]
    Rustls {
        /// The setting whose files were refused.
        setting: &'static str,
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
    /// The CA file's certificates could not make a verifier (e.g. none is a usable trust anchor).
    #[error("{setting}: {detail}")]
    Verifier {
        /// The CA's setting.
        setting: &'static str,
        /// What rustls said.
        detail: String,
    },
    /// A peer address is no valid TLS server name (neither an IP address nor a DNS name).
    #[error("`{0}` is not a name a TLS certificate can carry")]
    ServerName(String),
}

/// The paths of a certificate and its key, with the settings that named them (for errors).
#[derive(Clone, Debug)]
pub struct CertPaths {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The setting naming `cert`, e.g. `server.tls.cert`.
    pub cert_setting: &'static str,
    /// The setting naming `key`, e.g. `server.tls.key`.
    pub key_setting: &'static str,
}

/// The ring provider. rustls 0.23.48 deprecates it because it has no post-quantum key exchange (only
/// aws-lc-rs does); ring is kept on purpose: aws-lc-rs needs cmake and minutes of C build per machine.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        setting,
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in the PEM file `path` (at least one).
pub fn load_certs(
    setting: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(setting, path)?;
    let pem = |detail: String| TlsError::Pem {
        setting,
        path: path.to_owned(),
        what: "certificate",
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The private key in the PEM file `path`.
pub fn load_key(setting: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(setting, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        setting,
        path: path.to_owned(),
        what: "private key",
        detail: e.to_string(),
    })
}

/// The certificate chain and key of `paths`, checked to belong together.
fn load_pair(
    paths: &CertPaths,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let certs = load_certs(paths.cert_setting, &paths.cert)?;
    let key = load_key(paths.key_setting, &paths.key)?;
    let provider = provider();
    let signing = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|source| TlsError::Rustls {
            setting: paths.key_setting,
            source,
        })?;
    let certified = rustls::sign::CertifiedKey::new(certs.clone(), signing);
    match certified.keys_match() {
        Ok(()) => Ok((certs, key)),
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsError::KeyMismatch {
            key_setting: paths.key_setting,
            key: paths.key.clone(),
            cert_setting: paths.cert_setting,
            cert: paths.cert.clone(),
        }),
        // The key type cannot say (no public key to compare): rustls' own check at use decides.
        Err(_) => Ok((certs, key)),
    }
}

/// A server configuration presenting `paths`' certificate, asking clients for none (the public API).
pub fn server_config(paths: &CertPaths) -> Result<Arc<ServerConfig>, TlsError> {
    let (certs, key) = load_pair(paths)?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            setting: paths.cert_setting,
            source,
        })?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::Rustls {
            setting: paths.cert_setting,
            source,
        })?;
    Ok(Arc::new(with_alpn(config)))
}

/// Offers HTTP/1.1 in ALPN: tandem's HTTP listeners speak only it.
fn with_alpn(mut config: ServerConfig) -> ServerConfig {
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

/// The files of `deployment.cluster_tls`.
#[derive(Clone, Debug)]
pub struct ClusterTlsPaths {
    /// The cluster's CA certificate(s): the only issuer a peer's certificate may have.
    pub ca: PathBuf,
    /// This process's certificate (signed by `ca`), presented to every peer.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// When set, a server's certificate is checked for this name instead of the address dialled (peers
    /// found by address, e.g. DNS discovery's pod IPs, all presenting one certificate name).
    pub server_name: Option<String>,
}

/// Mutual TLS for the cluster's internal links: the server side (client certificates required, checked
/// against the CA) and the client side (presents this process's certificate, checks the server's).
#[derive(Clone)]
pub struct ClusterTls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClusterTls {
    /// Loads and checks the files (CA, certificate, key belonging together) and builds both sides.
    pub fn load(paths: &ClusterTlsPaths) -> Result<ClusterTls, TlsError> {
        const CA: &str = "deployment.cluster_tls.ca";
        let pair = CertPaths {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
            cert_setting: "deployment.cluster_tls.cert",
            key_setting: "deployment.cluster_tls.key",
        };
        let (certs, key) = load_pair(&pair)?;
        let mut roots = RootCertStore::empty();
        for ca in load_certs(CA, &paths.ca)? {
            roots.add(ca).map_err(|source| TlsError::Rustls {
                setting: CA,
                source,
            })?;
        }
        let roots = Arc::new(roots);
        let provider = provider();
        let verifier_err = |e: rustls::server::VerifierBuilderError| TlsError::Verifier {
            setting: CA,
            detail: e.to_string(),
        };
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(verifier_err)?;
        let rustls_err = |setting| move |source| TlsError::Rustls { setting, source };
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(rustls_err(CA))?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(rustls_err(pair.cert_setting))?;
        let server_name = match &paths.server_name {
            Some(n) => {
                Some(ServerName::try_from(n.clone()).map_err(|_| TlsError::ServerName(n.clone()))?)
            }
            None => None,
        };
        let web = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
            .build()
            .map_err(verifier_err)?;
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(rustls_err(CA))?;
        let builder = match &server_name {
            Some(name) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(FixedNameVerifier {
                    inner: web,
                    name: name.clone(),
                })),
            None => builder.with_webpki_verifier(web),
        };
        let client = builder
            .with_client_auth_cert(certs, key)
            .map_err(rustls_err(pair.cert_setting))?;
        Ok(ClusterTls {
            server: Arc::new(server),
            client: Arc::new(client),
            server_name,
        })
    }

    /// The server side: a listener accepting only clients with a certificate from the CA.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server)
    }

    /// The client side: presents this process's certificate, accepts only servers the CA signed.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.client)
    }

    /// The name a server at `endpoint` (`host:port`, `[v6]:port` or a bare host) must prove: its host,
    /// or the configured fixed name (checked by the verifier either way).
    pub fn server_name(&self, endpoint: &str) -> Result<ServerName<'static>, TlsError> {
        if let Some(name) = &self.server_name {
            return Ok(name.clone());
        }
        let host = host_of(endpoint);
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(ServerName::IpAddress(ip.into()));
        }
        ServerName::try_from(host.to_owned()).map_err(|_| TlsError::ServerName(host.to_owned()))
    }

    /// Client side of a handshake on `stream` to the server at `endpoint`.
    pub async fn connect(
        &self,
        endpoint: &str,
        stream: TcpStream,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let name = self
            .server_name(endpoint)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        tokio_rustls::TlsConnector::from(self.client_config())
            .connect(name, stream)
            .await
    }

    /// Server side of a handshake on an accepted `stream` (fails for a client without a CA-signed certificate).
    pub async fn accept(
        &self,
        stream: TcpStream,
    ) -> io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        tokio_rustls::TlsAcceptor::from(self.server_config())
            .accept(stream)
            .await
    }
}

impl ClusterTls {
    /// Client side of a handshake on a blocking `stream` to the server at `endpoint` (the pipeline's
    /// stage links), completed before returning so a refused peer fails here.
    pub fn connect_blocking(
        &self,
        endpoint: &str,
        mut stream: std::net::TcpStream,
    ) -> io::Result<BlockingStream> {
        let name = self
            .server_name(endpoint)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut conn =
            rustls::ClientConnection::new(self.client_config(), name).map_err(io::Error::other)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut stream)?;
        }
        Ok(BlockingStream::Client(Box::new(rustls::StreamOwned::new(
            conn, stream,
        ))))
    }

    /// Server side of a handshake on an accepted blocking `stream`, completed before returning.
    pub fn accept_blocking(&self, mut stream: std::net::TcpStream) -> io::Result<BlockingStream> {
        let mut conn =
            rustls::ServerConnection::new(self.server_config()).map_err(io::Error::other)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut stream)?;
        }
        Ok(BlockingStream::Server(Box::new(rustls::StreamOwned::new(
            conn, stream,
        ))))
    }
}

/// A blocking connection (the pipeline's stage link): plain TCP, or either side of TLS over it.
pub enum BlockingStream {
    /// Plain TCP.
    Plain(std::net::TcpStream),
    /// The client side of TLS.
    Client(Box<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>>),
    /// The server side of TLS.
    Server(Box<rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>>),
}

impl BlockingStream {
    /// The TCP socket underneath (for deadlines and shutdown).
    pub fn tcp(&self) -> &std::net::TcpStream {
        match self {
            BlockingStream::Plain(s) => s,
            BlockingStream::Client(s) => &s.sock,
            BlockingStream::Server(s) => &s.sock,
        }
    }
}

impl io::Read for BlockingStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.read(buf),
            BlockingStream::Client(s) => s.read(buf),
            BlockingStream::Server(s) => s.read(buf),
        }
    }
}

impl io::Write for BlockingStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.write(buf),
            BlockingStream::Client(s) => s.write(buf),
            BlockingStream::Server(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            BlockingStream::Plain(s) => s.flush(),
            BlockingStream::Client(s) => s.flush(),
            BlockingStream::Server(s) => s.flush(),
        }
    }
}

/// The host part of `host:port`, `[v6]:port`, a bare host or a URL's authority.
fn host_of(endpoint: &str) -> &str {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => authority,
    }
}

/// Checks a server's chain against the CA for one configured name, whatever address was dialled.
#[derive(Debug)]
struct FixedNameVerifier {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for FixedNameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A KV connection: plain TCP, or TLS over it. With TLS off every call goes straight to the socket (one
/// enum match, no extra buffer or copy), so the default path keeps its speed.
#[allow(clippy::large_enum_variant)]
pub enum MaybeTls {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (either side of the handshake).
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl MaybeTls {
    /// The TCP socket underneath (for socket options).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            MaybeTls::Plain(s) => s,
            MaybeTls::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for MaybeTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MaybeTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
#[path = "tls_tests.rs"]
mod tests;
