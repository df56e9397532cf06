//! NIXL data plane: the server exports the pinned blocks into its registered memory and announces each
//! layer; this side READs every layer into its own registered buffer as soon as it is announced, hands it to
//! the sink, and acks on the TCP control connection (aborting on any failure, so the pin is released once).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::nixl::server::{NixlOpen, NixlPullRequest};
use crate::nixl::{slow_transfer_warning, MemRegion, NixlAgent, PoolLease, Xfer};
use crate::transport::control::{self, ControlPull};
use crate::transport::tcp::{TcpConfig, TcpTransport};
use crate::wire::{FrameKind, FrameReader};
use crate::{KvError, KvSink, PeerInfo, PullSelection, TransferHandle};

/// Polls of a running READ answered by yielding before falling back to short sleeps.
const SPIN_POLLS: u32 = 64;

/// Pulls by NIXL READ, with a TCP connection for the handshake, layer announcements and the ack.
pub struct NixlTransport {
    local: PeerInfo,
    config: TcpConfig,
    agent: NixlAgent,
    /// Server agent learned per endpoint, so its metadata is sent only when it changed.
    peers: Mutex<HashMap<String, String>>,
    /// Pulls from servers without NIXL (`TransferHandle::nixl` false).
    tcp: TcpTransport,
    /// Endpoints already reported as pulled over TCP, so the warning is logged once per server.
    tcp_only: Mutex<std::collections::HashSet<String>>,
}

impl NixlTransport {
    /// A NIXL transport reading through `agent` (its pool provides the receive buffers).
    pub fn new(local: PeerInfo, config: TcpConfig, agent: NixlAgent) -> Self {
        NixlTransport {
            tcp: TcpTransport::new(local.clone(), config.clone()),
            local,
            config,
            agent,
            peers: Mutex::new(HashMap::new()),
            tcp_only: Mutex::new(Default::default()),
        }
    }

    /// Logs once per endpoint that a server without NIXL is pulled from over TCP.
    fn warn_tcp_only(&self, handle: &TransferHandle) {
        if self.tcp_only.lock().insert(handle.endpoint.clone()) {
            tracing::warn!(
                endpoint = %handle.endpoint,
                worker = %handle.worker_id,
                "this KV server has no NIXL agent; pulling its KV over TCP"
            );
        }
    }
}

/// The NIXL pull is a one-connection pull: the request names the server agent it already knows, the
/// data arrives by READs outside the connection.
impl ControlPull for NixlTransport {
    type Request = NixlPullRequest;
    const KIND: FrameKind = FrameKind::NixlPull;

    fn socket(&self) -> (&PeerInfo, &TcpConfig) {
        (&self.local, &self.config)
    }

    fn request(&self, handle: &TransferHandle, selection: &PullSelection) -> NixlPullRequest {
        let known = self
            .peers
            .lock()
            .get(&handle.endpoint)
            .and_then(|a| Some((a.clone(), self.agent.remote_generation(a)?)));
        NixlPullRequest {
            selection: selection.clone(),
            known,
        }
    }

    /// Reads `NixlOpen`, loads the server's metadata when sent, then READs each announced layer and
    /// delivers it. Every READ is released (or its buffer leaked) before this returns.
    async fn receive(
        &self,
        c: &mut FrameReader<crate::tls::MaybeTls>,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: &Arc<dyn KvSink>,
    ) -> Result<u64, KvError> {
        let n_layers = handle.layout.n_layers;
        let bb = handle.layout.block_bytes();
        let packed = selection.packed_layers(n_layers, bb);
        let h = c.expect_frame().await?;
        if h.kind != FrameKind::NixlOpen {
            return Err(KvError::Protocol(format!(
                "expected NixlOpen, got {:?}",
                h.kind
            )));
        }
        let open: NixlOpen = c.json(&h).await?;
        check_open(&open, &packed)?;
        if let Some(md) = &open.md {
            self.agent.load_remote(&open.agent, open.md_gen, md)?;
            let old = self
                .peers
                .lock()
                .insert(handle.endpoint.clone(), open.agent.clone());
            if let Some(old) = old.filter(|o| *o != open.agent) {
                // The server at this endpoint restarted: its old agent is gone.
                self.agent.forget_remote(&old);
            }
        } else if self.agent.remote_generation(&open.agent).is_none() {
            return Err(KvError::Protocol(format!(
                "server sent no NIXL metadata for unknown agent {}",
                open.agent
            )));
        }
        let total = selection.bytes(n_layers, bb) as usize;
        // READ straight into the sink's staging memory when it offers some of the kind the server's
        // regions are (GPU to GPU), else into a registered buffer of ours and deliver from there.
        let remote_kind = open.layers[0].kind;
        let dest = match sink.landing(total)? {
            Some(r) if r.kind == remote_kind && r.len >= total as u64 => Dest::Landing(r),
            _ => Dest::Lease(Arc::new(self.agent.lease(total)?)),
        };
        let local = dest.region().pieces(&packed);
        let mut reads = Reads {
            running: Vec::new(),
            seen: vec![false; n_layers],
            left: n_layers,
            started: None,
        };
        let runs: Vec<Vec<(usize, usize, usize)>> = (0..n_layers)
            .map(|l| selection.layer(l).packed_runs(bb))
            .collect();
        loop {
            let h = c.expect_frame().await?;
            match h.kind {
                FrameKind::NixlLayer => {
                    let layer = h.layer as usize;
                    if layer >= n_layers || reads.seen[layer] {
                        return Err(KvError::Protocol(format!(
                            "bad or repeated NIXL layer {layer}"
                        )));
                    }
                    reads.seen[layer] = true;
                    reads.started.get_or_insert_with(Instant::now);
                    if local[layer].len == 0 {
                        // A layer of no block (its window starts past the pulled ones): nothing to READ.
                        reads.deliver(layer, &dest, &local, &runs, &**sink)?;
                        continue;
                    }
                    let x = self.agent.read(
                        &local[layer..=layer],
                        &open.layers[layer..=layer],
                        &open.agent,
                        dest.keep_alive(sink),
                    )?;
                    reads.running.push((layer, x));
                    reads.deliver_done(&dest, &local, &runs, &**sink)?;
                }
                FrameKind::PullDone => break,
                k => {
                    return Err(KvError::Protocol(format!(
                        "unexpected {k:?} during a NIXL pull"
                    )))
                }
            }
        }
        if reads.seen.iter().any(|s| !s) {
            return Err(KvError::Protocol("NIXL pull ended early".into()));
        }
        let mut polls = 0u32;
        while reads.left > 0 {
            reads.deliver_done(&dest, &local, &runs, &**sink)?;
            if reads.left == 0 {
                break;
            }
            polls += 1;
            if polls < SPIN_POLLS {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            // Bounded like every other wait.
            if reads
                .started
                .is_some_and(|s| s.elapsed() > self.config.io_timeout)
            {
                return Err(KvError::Timeout {
                    context: "waiting for NIXL READs",
                    after: self.config.io_timeout,
                });
            }
        }
        let bytes = total as u64;
        if let Some(start) = reads.started {
            let elapsed = start.elapsed();
            tracing::debug!(
                transfer_id = handle.transfer_id,
                bytes,
                micros = elapsed.as_micros() as u64,
                gbps = bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9,
                in_place = matches!(dest, Dest::Landing(_)),
                kind = ?remote_kind,
                "NIXL READs done (first announcement to last READ)"
            );
            if let Some(w) =
                slow_transfer_warning(bytes, elapsed, remote_kind, self.agent.warn_below_gbps())
            {
                tracing::warn!(transfer_id = handle.transfer_id, "{w}");
            }
        }
        Ok(bytes)
    }
}

/// Where a pull's READs land.
enum Dest {
    /// A registered buffer of this transport's pool; layers are delivered to the sink from it.
    Lease(Arc<PoolLease>),
    /// The sink's own registered staging memory; layers are handed over in place.
    Landing(MemRegion),
}

impl Dest {
    fn region(&self) -> MemRegion {
        match self {
            Dest::Lease(l) => l.region(),
            Dest::Landing(r) => *r,
        }
    }

    /// What a READ into this destination keeps alive (leaks, if NIXL cannot cancel it): the buffer, or
    /// the sink that owns the landing memory.
    fn keep_alive(&self, sink: &Arc<dyn KvSink>) -> Box<dyn Send> {
        match self {
            Dest::Lease(l) => Box::new(Arc::clone(l)),
            Dest::Landing(_) => Box::new(Arc::clone(sink)),
        }
    }
}

/// The READs of one pull still running; dropped (released) before the receive buffer.
struct Reads {
    running: Vec<(usize, Xfer)>,
    seen: Vec<bool>,
    left: usize,
    started: Option<Instant>,
}

impl Reads {
    /// Hands every finished layer to the sink.
    fn deliver_done(
        &mut self,
        dest: &Dest,
        local: &[MemRegion],
        runs: &[Vec<(usize, usize, usize)>],
        sink: &dyn KvSink,
    ) -> Result<(), KvError> {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].1.poll()? {
                let (layer, x) = self.running.swap_remove(i);
                drop(x);
                self.deliver(layer, dest, local, runs, sink)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Hands `layer`, whose bytes are in `local[layer]`, to the sink: in place, or written run by run.
    fn deliver(
        &mut self,
        layer: usize,
        dest: &Dest,
        local: &[MemRegion],
        runs: &[Vec<(usize, usize, usize)>],
        sink: &dyn KvSink,
    ) -> Result<(), KvError> {
        let base = (local[layer].addr - local[0].addr) as usize;
        match dest {
            Dest::Landing(_) => sink.landed(layer, base, local[layer].len as usize)?,
            Dest::Lease(lease) => {
                let bytes: &[u8] = (**lease).as_ref();
                for &(first, off, len) in &runs[layer] {
                    sink.write(layer, first, &bytes[base + off..base + off + len])?;
                }
                sink.layer_complete(layer)?;
            }
        }
        self.left -= 1;
        Ok(())
    }
}

/// Refuses an announcement that does not describe one region per layer of the pull's `packed` bytes.
pub(crate) fn check_open(open: &NixlOpen, packed: &[(usize, usize)]) -> Result<(), KvError> {
    if open.layers.is_empty()
        || open.layers.len() != packed.len()
        || open
            .layers
            .iter()
            .zip(packed)
            .any(|(r, &(_, len))| r.len != len as u64)
    {
        return Err(KvError::Protocol(format!(
            "NIXL regions of {:?} bytes do not match the pull's layers of {:?}",
            open.layers.iter().map(|r| r.len).collect::<Vec<_>>(),
            packed.iter().map(|p| p.1).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

// A server without NIXL is pulled from over TCP; an empty selection only acks (in `control::pull`).
kv_transport!(
    NixlTransport,
    "nixl",
    |this, handle, selection, sink| async move {
        if !selection.is_empty() && !handle.nixl {
            this.warn_tcp_only(handle);
            return this.tcp.pull(handle, selection, sink).await;
        }
        control::pull(this, handle, selection, sink).await
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nixl::MemKind;

    fn open(layers: usize, len: u64) -> NixlOpen {
        NixlOpen {
            agent: "p".into(),
            md_gen: 1,
            md: None,
            layers: (0..layers as u64)
                .map(|i| MemRegion {
                    addr: 4096 + i * len,
                    len,
                    kind: MemKind::Dram,
                    device: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn announcements_must_match_the_pull() {
        let layers = |n: usize, len: usize| (0..n).map(|i| (i * len, len)).collect::<Vec<_>>();
        assert!(check_open(&open(3, 200), &layers(3, 200)).is_ok());
        assert!(check_open(&open(2, 200), &layers(3, 200)).is_err());
        assert!(check_open(&open(3, 100), &layers(3, 200)).is_err());
        assert!(check_open(&open(3, 200), &[(0, 200), (200, 200), (400, 100)]).is_err());
        // No layer: nothing to READ, and the receiver reads the first region's memory kind.
        assert!(check_open(&open(0, 200), &[]).is_err());
    }
}
