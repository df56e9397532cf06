//! Any bytes as a pipeline stage link connection, sent over loopback to a real stage server: stage 1 of
//! 2 of the default model on the CPU (`tandem_pipeline::serve_stage`), its KV pool sized once by a
//! well-behaved client. An even first byte puts that client's valid hello in front of the rest, so the
//! fuzzer works on what follows a handshake (forwards, block exports and imports, copies); an odd one
//! sends the bytes as they are, handshake included. A panic or abort in the server, a server that stops
//! answering, or memory past libFuzzer's limits is a finding.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tandem_kv::wire::{FrameHeader, FrameKind};
use tandem_model::Partition;
use tandem_pipeline::link::{StageClient, StageHello, STAGE_LINK_VERSION};
use tandem_engine::Activations;
use tandem_pipeline::{serve_stage, CpuStage, StageServer, StageServing, StageTimeouts};

/// The served stage and the hello frame (header and body) of a client that matches it.
struct Served {
    server: StageServer,
    hello: Vec<u8>,
}

fn served() -> &'static Served {
    static SERVED: OnceLock<Served> = OnceLock::new();
    SERVED.get_or_init(|| {
        let m = tandem_testkit::model().expect("the default model (run scripts/fetch-model.sh)");
        let part = Partition::stage(&m.config, 1, 2).expect("two stages");
        let hello = StageHello {
            model_id: m.identity.0.clone(),
            stage: 1,
            stages: 2,
            layer_start: part.layers.start,
            layer_end: part.layers.end,
            hidden_size: m.config.hidden_size,
            vocab_size: m.config.vocab_size,
            activations: Activations::F32,
            block_size: 4,
            num_blocks: 64,
            samples: false,
            version: STAGE_LINK_VERSION,
        };
        let stage = CpuStage::new(&m.config, &m.weights, 1, part).expect("stage");
        let listener = TcpListener::bind("127.0.0.1:0").expect("loopback listener");
        let server = serve_stage(
            Box::new(stage),
            &m.identity,
            1,
            2,
            listener,
            StageServing {
                io: Duration::from_secs(1),
                // The whole model's KV at the client's 64 blocks of 4 tokens, f32.
                kv_cache_memory: 64
                    * 4
                    * m.config.num_layers
                    * 2
                    * m.config.num_kv_heads
                    * m.config.head_dim
                    * 4,
                key: None,
                tls: None,
            },
        )
        .expect("stage server");
        drop(
            StageClient::connect(server.addr(), &hello, StageTimeouts::default(), None)
                .expect("sizing the stage's pool"),
        );
        let body = serde_json::to_vec(&hello).expect("hello");
        let mut frame = FrameHeader::control(FrameKind::StageHello, 0, body.len())
            .encode()
            .to_vec();
        frame.extend_from_slice(&body);
        Served {
            server,
            hello: frame,
        }
    })
}

/// Sends `bytes` on a fresh connection, closes the sending side and reads whatever comes back until
/// the server closes (bounded: a server that neither answers nor closes fails the read, and the next
/// connection would then wait in its accept queue, which libFuzzer's `-timeout` reports as a hang).
fn exchange(addr: SocketAddr, bytes: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        panic!("the stage server stopped accepting");
    };
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    // The server may refuse and close mid-write: a reset here is an answer, not a finding.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let served = served();
    if mode % 2 == 0 {
        let mut bytes = served.hello.clone();
        bytes.extend_from_slice(rest);
        exchange(served.server.addr(), &bytes);
    } else {
        exchange(served.server.addr(), rest);
    }
});
