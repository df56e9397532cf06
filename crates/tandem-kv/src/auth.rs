//! The cluster secret and the challenge-response every KV connection (and the pipeline's stage link)
//! opens with when one is configured, so a stranger who reaches the port can neither read a pinned
//! block nor learn anything about the worker.
//!
//! After the client's hello the server sends `AuthChallenge{nonce}` (32 random bytes); the client answers
//! `AuthProof{nonce, mac}` with a nonce of its own and HMAC-SHA256(secret, "tandem-client" | server nonce
//! | client nonce); the server checks it in constant time (or sends an `Error` and closes) and proves
//! itself the same way with the label "tandem-server" and the nonces swapped, before its hello reply.
//! The secret never crosses the socket, a recorded exchange cannot be replayed (fresh nonces on both
//! sides), and each side knows the other holds the secret. A client with a secret refuses a server that
//! does not ask for it, and a client without one fails naming the setting.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::KvError;

type HmacSha256 = Hmac<Sha256>;

/// Label of the client's proof (so a server's proof can never be passed off as a client's).
pub const CLIENT_LABEL: &[u8] = b"tandem-client";
/// Label of the server's proof.
pub const SERVER_LABEL: &[u8] = b"tandem-server";
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;

/// The cluster secret (`cluster_token`) shared by a deployment's head, workers and stages; its `Debug`
/// never shows it.
#[derive(Clone)]
pub struct ClusterKey {
    secret: Arc<[u8]>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(redacted)")
    }
}

impl ClusterKey {
    /// A key from the token's text (surrounding whitespace, as a mounted file ends with, is trimmed);
    /// `None` for an empty token.
    pub fn new(token: &str) -> Option<Self> {
        let token = token.trim();
        (!token.is_empty()).then(|| Self {
            secret: Arc::from(token.as_bytes()),
        })
    }

    /// The token itself, for the `Authorization: Bearer` header of control calls.
    pub fn token(&self) -> &str {
        std::str::from_utf8(&self.secret).unwrap_or_default()
    }

    fn mac(&self, label: &[u8], first: &[u8], second: &[u8]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.secret).expect("HMAC takes a key of any length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }

    /// The proof of holding the secret for `label`, over the challenger's nonce then the prover's.
    pub fn prove(&self, label: &[u8], challenge: &[u8], own: &[u8]) -> Vec<u8> {
        self.mac(label, challenge, own)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `proof` is [`ClusterKey::prove`]'s answer, compared in constant time.
    pub fn verify(&self, label: &[u8], challenge: &[u8], own: &[u8], proof: &[u8]) -> bool {
        self.mac(label, challenge, own).verify_slice(proof).is_ok()
    }

    /// Whether a presented bearer token is this secret, compared in constant time (both sides are
    /// hashed under the secret first, so neither length nor content leaks through timing).
    pub fn matches_token(&self, presented: &str) -> bool {
        let expected = self.mac(b"tandem-bearer", &self.secret, &[]).finalize();
        self.mac(b"tandem-bearer", presented.as_bytes(), &[])
            .verify_slice(&expected.into_bytes())
            .is_ok()
    }
}

/// A fresh random nonce (the thread RNG is a CSPRNG seeded by the OS).
pub fn nonce() -> Vec<u8> {
    rand::random::<[u8; NONCE_LEN]>().to_vec()
}

/// Body of an `AuthChallenge` frame: the server's nonce.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthChallenge {
    /// [`NONCE_LEN`] random bytes.
    pub nonce: Vec<u8>,
}

/// Body of an `AuthProof` frame: the prover's nonce (empty from the server) and its MAC.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthProof {
    /// The client's [`NONCE_LEN`] random bytes; empty in the server's proof.
    pub nonce: Vec<u8>,
    /// HMAC-SHA256 over the label and both nonces.
    pub mac: Vec<u8>,
}

/// The error for a peer that must answer a challenge but has no secret configured.
pub fn missing_token() -> KvError {
    KvError::Auth(
        "the peer requires the cluster token: set deployment.cluster_token, cluster_token_file or \
         TANDEM_CLUSTER_TOKEN"
            .into(),
    )
}

/// The error for a peer that did not challenge although this side holds a secret.
pub fn unchallenged() -> KvError {
    KvError::Auth(
        "the peer did not ask for the cluster token: it is not part of this cluster".into(),
    )
}

/// The error for a wrong proof.
pub fn refused(who: &str) -> KvError {
    KvError::Auth(format!("{who} failed the cluster token challenge"))
}

/// Checks a client's proof against the challenge this server sent: `Ok` with the server's own proof
/// to send back, or the refusal.
pub fn check_client(
    key: &ClusterKey,
    challenge: &[u8],
    proof: &AuthProof,
) -> Result<AuthProof, KvError> {
    if proof.nonce.len() != NONCE_LEN
        || !key.verify(CLIENT_LABEL, challenge, &proof.nonce, &proof.mac)
    {
        return Err(refused("the client"));
    }
    Ok(AuthProof {
        nonce: Vec::new(),
        mac: key.prove(SERVER_LABEL, &proof.nonce, challenge),
    })
}

/// Checks the server's proof over the client's nonce and the server's challenge.
pub fn check_server(
    key: &ClusterKey,
    client_nonce: &[u8],
    challenge: &[u8],
    proof: &AuthProof,
) -> Result<(), KvError> {
    if key.verify(SERVER_LABEL, client_nonce, challenge, &proof.mac) {
        Ok(())
    } else {
        Err(refused("the server"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_label_and_nonces() {
        let key = ClusterKey::new(" s3cret\n").unwrap();
        assert_eq!(key.token(), "s3cret");
        assert!(ClusterKey::new("  \n").is_none());
        let other = ClusterKey::new("other").unwrap();
        let (challenge, own) = (nonce(), nonce());
        assert_ne!(challenge, own);
        let proof = AuthProof {
            nonce: own.clone(),
            mac: key.prove(CLIENT_LABEL, &challenge, &own),
        };
        let back = check_client(&key, &challenge, &proof).unwrap();
        check_server(&key, &own, &challenge, &back).unwrap();
        assert!(check_server(&other, &own, &challenge, &back).is_err());
        assert!(check_client(&other, &challenge, &proof).is_err());
        assert!(check_client(&key, &nonce(), &proof).is_err(), "replayed");
        let server_as_client = AuthProof {
            nonce: own.clone(),
            mac: key.prove(SERVER_LABEL, &challenge, &own),
        };
        assert!(check_client(&key, &challenge, &server_as_client).is_err());
        assert!(key.matches_token("s3cret"));
        assert!(!key.matches_token("s3cre") && !key.matches_token(""));
        assert!(!format!("{key:?}").contains("s3cret"));
    }
}
