//! Certificates made at test time for the TLS tests: a CA, a certificate it signed for `127.0.0.1` and
//! `localhost` (server and client use, so one file serves every side of mutual TLS), and a second,
//! unrelated CA with its own certificate, which every tandem peer must refuse.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The PEM files of a test PKI, written into one directory.
#[derive(Clone, Debug)]
pub struct TestPki {
    /// The cluster's CA certificate.
    pub ca: PathBuf,
    /// A certificate `ca` signed (SANs 127.0.0.1 and localhost; server and client auth).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// Another CA, trusted by nobody in the cluster.
    pub wrong_ca: PathBuf,
    /// A certificate the wrong CA signed (same SANs).
    pub wrong_cert: PathBuf,
    /// Its key.
    pub wrong_key: PathBuf,
}

fn ca(name: &str) -> (Certificate, KeyPair) {
    let key = KeyPair::generate().expect("CA key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    (p.self_signed(&key).expect("self-signed CA"), key)
}

fn leaf(issuer: &Certificate, issuer_key: &KeyPair) -> (Certificate, KeyPair) {
    let key = KeyPair::generate().expect("leaf key");
    let mut p = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .expect("leaf params");
    p.distinguished_name
        .push(DnType::CommonName, "tandem test peer");
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    (
        p.signed_by(&key, issuer, issuer_key).expect("signed leaf"),
        key,
    )
}

impl TestPki {
    /// Generates both CAs and their certificates into `dir` (which must exist).
    pub fn generate(dir: &Path) -> TestPki {
        let (ca_cert, ca_key) = ca("tandem test CA");
        let (cert, key) = leaf(&ca_cert, &ca_key);
        let (wrong_ca, wrong_ca_key) = ca("some other CA");
        let (wrong_cert, wrong_key) = leaf(&wrong_ca, &wrong_ca_key);
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).expect("writing a test PEM");
            path
        };
        TestPki {
            ca: write("ca.pem", ca_cert.pem()),
            cert: write("cert.pem", cert.pem()),
            key: write("key.pem", key.serialize_pem()),
            wrong_ca: write("wrong-ca.pem", wrong_ca.pem()),
            wrong_cert: write("wrong-cert.pem", wrong_cert.pem()),
            wrong_key: write("wrong-key.pem", wrong_key.serialize_pem()),
        }
    }
}
