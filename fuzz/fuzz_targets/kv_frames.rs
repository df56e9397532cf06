//! Any bytes as a KV connection's stream, read as the server and client read it: frame headers
//! (magic, version, kind), then each frame's control body (the handshake, pulls, shm opens, errors,
//! auth) or its raw payload when the length is one a caller would accept.
#![no_main]

#[path = "common.rs"]
mod common;

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tandem_kv::auth::{AuthChallenge, AuthProof};
use tandem_kv::wire::{FrameKind, FrameReader, PullRequest, ShmOpen, ShmPullRequest, WireError};
use tandem_kv::{KvError, PeerInfo};

fuzz_target!(|data: &[u8]| {
    common::runtime().block_on(async {
        let mut reader = FrameReader::new(data, Duration::from_secs(1));
        for _ in 0..16 {
            let Ok(Some(h)) = reader.header().await else {
                return;
            };
            let read: Result<(), KvError> = match h.kind {
                FrameKind::Hello | FrameKind::HelloReply => {
                    reader.json::<PeerInfo>(&h).await.map(drop)
                }
                FrameKind::Pull => reader.json::<PullRequest>(&h).await.map(drop),
                FrameKind::ShmPull => reader.json::<ShmPullRequest>(&h).await.map(drop),
                FrameKind::ShmOpen => reader.json::<ShmOpen>(&h).await.map(drop),
                FrameKind::Error => reader
                    .json::<WireError>(&h)
                    .await
                    .map(|w| drop(KvError::from(w))),
                FrameKind::AuthChallenge => reader.json::<AuthChallenge>(&h).await.map(drop),
                FrameKind::AuthProof => reader.json::<AuthProof>(&h).await.map(drop),
                // Data frames: the transports check the length against the transfer's layout first.
                _ if h.payload_len <= data.len() as u64 => reader.payload(&h).await.map(drop),
                _ => return,
            };
            if read.is_err() {
                return;
            }
        }
    });
});
