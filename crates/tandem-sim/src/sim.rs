//! The discrete-event simulation: a head and its workers on a virtual clock.
//!
//! Every worker holds the engine's own [`Scheduler`] and [`BlockPool`] and steps them exactly as the
//! engine thread does (plan, run, [`Scheduler::advance`], sample, reap), except that a step's duration
//! comes from the [`Profile`] instead of a model. The head routes with `tandem-cluster`'s policies
//! ([`pick_decode_cached`], [`pick_prefill`] over its [`PrefixTracker`]s, [`wants_remote_prefill`]); a remote
//! prefill pins its blocks on the prefill worker until the decode worker, having reserved room through
//! its prefix cache like `import_prefilled`, has pulled the blocks it lacks at the profile's transfer rate.
//!
//! Simplifications: load reports are fresh (the head polls every 0.5 s), the head's admission wait is
//! the decode worker's own wait for KV room, requests fail only when a worker's whole pool cannot hold
//! them (no crashes, retries or timeouts), and every worker is its own hardware unless
//! [`SimConfig::shared_device`] puts them all on one device, whose time the steps on it share.
//!
//! A step is its forward on the device, then the engine's host work for it (the profile's
//! `overheads.step_s` and `step_per_seq_s`). On a shared device the forwards of the workers that are
//! in that phase at once share it equally (processor sharing: with k of them, each runs at 1/k of
//! its speed), which is how two processes' kernels interleave on one GPU; host work is not shared.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tandem_bench::workload::RequestClass;
use tandem_bench::RequestRecord;
use tandem_cluster::prefix::{block_hashes, PrefixTracker};
use tandem_cluster::routing::{
    pick_decode_cached, pick_prefill, wants_remote_prefill, DecodeLoad, PrefillCandidate,
};
use tandem_cluster::RoutingConfig;
use tandem_engine::block_pool::{BlockPool, BlockTable};
use tandem_engine::scheduler::{Scheduler, SchedulerConfig, Sequence};
use tandem_model::ForwardBatch;

use crate::error::SimError;
use crate::profile::{Profile, TransferRate};

/// The workers of the simulated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Topology {
    /// Workers that each prefill and decode (`deployment.mode: colocated`), requests spread over them.
    Colocated {
        /// Workers.
        replicas: usize,
    },
    /// Separate prefill and decode workers (`deployment.mode: pd`).
    Disaggregated {
        /// Prefill workers.
        prefill: usize,
        /// Decode workers.
        decode: usize,
    },
}

impl Topology {
    /// Workers in all, the unit of cost.
    pub fn workers(&self) -> usize {
        match *self {
            Topology::Colocated { replicas } => replicas,
            Topology::Disaggregated { prefill, decode } => prefill + decode,
        }
    }

    /// A short label: `colocated×2`, `1P2D`.
    pub fn label(&self) -> String {
        match *self {
            Topology::Colocated { replicas } => format!("colocated×{replicas}"),
            Topology::Disaggregated { prefill, decode } => format!("{prefill}P{decode}D"),
        }
    }
}

/// What is simulated besides the profile.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The workers.
    pub topology: Topology,
    /// The head's routing knobs.
    pub routing: RoutingConfig,
    /// The KV transport between prefill and decode workers (a rate in the profile).
    pub transport: String,
    /// `engine.enable_chunked_prefill`.
    pub chunked_prefill: bool,
    /// `engine.enable_prefix_caching`.
    pub prefix_caching: bool,
    /// Seed of the routing's random choices.
    pub seed: u64,
    /// All the workers share one device's time (1P1D on one GPU: two processes whose kernels
    /// interleave on it), so forwards that overlap slow each other down; else each worker is its own
    /// device.
    pub shared_device: bool,
}

impl SimConfig {
    /// The engine's defaults and the head's, over `topology`.
    pub fn new(topology: Topology) -> SimConfig {
        SimConfig {
            topology,
            routing: RoutingConfig::default(),
            transport: "tcp".into(),
            chunked_prefill: true,
            prefix_caching: true,
            seed: 0,
            shared_device: false,
        }
    }
}

/// One request to simulate.
#[derive(Clone, Debug)]
pub struct SimRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens generated (as with `ignore_eos`).
    pub max_tokens: usize,
    /// Which part of the workload it belongs to.
    pub class: RequestClass,
    /// Send time, seconds after the start.
    pub at_s: f64,
}

/// Counters of one simulation, beside the per-request records.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SimStats {
    /// Forward steps run, all workers.
    pub steps: u64,
    /// Sequences preempted for KV room.
    pub preemptions: u64,
    /// Requests prefilled on a prefill worker.
    pub remote_prefills: u64,
    /// Requests prefilled where they decode.
    pub local_prefills: u64,
    /// KV bytes moved between workers.
    pub kv_bytes_moved: f64,
    /// Busy seconds per worker (prefill workers first).
    pub busy_s: Vec<f64>,
}

/// What a simulation produced.
#[derive(Clone, Debug)]
pub struct SimOutcome {
    /// One record per request, in completion order, as `tandem bench` records them.
    pub records: Vec<RequestRecord>,
    /// The request (index into the input) of each record.
    pub record_requests: Vec<usize>,
    /// Seconds from the first send to the last completion.
    pub duration_s: f64,
    /// Counters.
    pub stats: SimStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
}

/// What happens at an instant.
#[derive(Clone, Copy, Debug)]
enum Event {
    /// The client sends request `r` (or queues it for a concurrency slot).
    Send(usize),
    /// Request `r` reaches the head, which routes it.
    Route(usize),
    /// Worker `w`'s forward leaves the device, if `gen` is still its step's generation (on a shared
    /// device a forward's end moves whenever another starts or ends, and the older event is void).
    ForwardDone(usize, u64),
    /// Worker `w`'s step ends (its host work after the forward too).
    StepDone(usize),
    /// Request `r`'s prefill RPC reaches its prefill worker.
    PrefillArrive(usize),
    /// The decode worker gets request `r`'s decode RPC (its KV on the prefill worker).
    DecodeStart(usize),
    /// Request `r`'s KV has arrived on its decode worker.
    Imported(usize),
}

struct Timed {
    at: f64,
    order: u64,
    event: Event,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timed {
    /// Reversed, so that `BinaryHeap` pops the earliest (then the first scheduled).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then(other.order.cmp(&self.order))
    }
}

struct Worker {
    role: Role,
    sched: Scheduler<usize>,
    pool: BlockPool,
    batch: ForwardBatch,
    busy: bool,
    busy_s: f64,
    /// Device seconds (at the whole device's speed) left of the running step's forward; 0 once it
    /// has left the device.
    forward_left: f64,
    /// Host seconds of the running step, after its forward.
    host_s: f64,
    /// Generation of the running step's pending [`Event::ForwardDone`].
    gen: u64,
    in_flight: usize,
    prefix: PrefixTracker,
    /// Prefill-only sequences' blocks, kept for the decode worker's pull.
    pins: HashMap<usize, BlockTable>,
    /// Requests whose KV import waits for room, FCFS.
    import_wait: VecDeque<usize>,
    max_num_seqs: usize,
}

impl Worker {
    fn load(&self) -> DecodeLoad {
        DecodeLoad {
            kv_blocks_used: self.pool.num_used(),
            kv_blocks_total: self.pool.num_blocks(),
            seqs: self.sched.running.len() + self.sched.waiting.len(),
            in_flight: self.in_flight,
            max_num_seqs: self.max_num_seqs,
        }
    }
}

struct Req {
    at: f64,
    prompt: Vec<u32>,
    max_tokens: usize,
    class: RequestClass,
    hashes: Vec<u64>,
    /// Times the client saw each token.
    token_times: Vec<f64>,
    decode: usize,
    prefill: Option<usize>,
    /// Blocks reserved on the decode worker for the import.
    reserved: Option<BlockTable>,
    first_token: u32,
    error: Option<String>,
}

/// The simulation state.
struct Sim<'a> {
    profile: &'a Profile,
    cfg: &'a SimConfig,
    transfer: Option<&'a TransferRate>,
    now: f64,
    events: BinaryHeap<Timed>,
    order: u64,
    workers: Vec<Worker>,
    reqs: Vec<Req>,
    rng: ChaCha8Rng,
    slots: Option<usize>,
    queued: VecDeque<usize>,
    records: Vec<RequestRecord>,
    record_requests: Vec<usize>,
    stats: SimStats,
    /// For each request, the later turn that waits for it (its index and think time).
    next_turn: Vec<Option<(usize, f64)>>,
    /// When the shared device's occupants (the forwards running) last changed.
    device_since: f64,
}

/// A turn of a conversation that waits for the one before it: sent `think_s` after turn `after` ends,
/// its prompt that turn's prompt and answer followed by its own tokens, as a chat client sends the
/// whole history (`tandem bench --workload multi-turn`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FollowUp {
    /// Index of the earlier turn.
    pub after: usize,
    /// Seconds between that turn's end and this one's send.
    pub think_s: f64,
}

/// Simulates `requests` on the deployment of `cfg` with the costs of `profile`; `max_concurrency`
/// limits requests in flight as `tandem bench --max-concurrency` does (a request's clock starts once
/// it holds a slot).
pub fn simulate(
    profile: &Profile,
    cfg: &SimConfig,
    requests: Vec<SimRequest>,
    max_concurrency: Option<usize>,
) -> Result<SimOutcome, SimError> {
    let n = requests.len();
    simulate_turns(profile, cfg, requests, vec![None; n], max_concurrency)
}

/// [`simulate`] with conversations: `follow_ups[i]` makes request `i` a later turn (its `prompt` then
/// holds only its own tokens and its `at_s` is ignored; it is sent once the earlier turn ends, and
/// fails if that one failed).
pub fn simulate_turns(
    profile: &Profile,
    cfg: &SimConfig,
    requests: Vec<SimRequest>,
    follow_ups: Vec<Option<FollowUp>>,
    max_concurrency: Option<usize>,
) -> Result<SimOutcome, SimError> {
    profile.check()?;
    if follow_ups.len() != requests.len() {
        return Err(SimError::Config(format!(
            "{} follow-ups for {} requests",
            follow_ups.len(),
            requests.len()
        )));
    }
    let mut next_turn = vec![None; requests.len()];
    for (i, f) in follow_ups.iter().enumerate() {
        let Some(f) = f else { continue };
        if f.after >= i || !(f.think_s.is_finite() && f.think_s >= 0.0) {
            return Err(SimError::Config(format!(
                "request {i} follows request {} after {} s: a turn follows an earlier one, after a non-negative think time",
                f.after, f.think_s
            )));
        }
        if next_turn[f.after].is_some() {
            return Err(SimError::Config(format!(
                "request {} has two later turns",
                f.after
            )));
        }
        next_turn[f.after] = Some((i, f.think_s));
    }
    let (n_prefill, n_decode) = match cfg.topology {
        Topology::Colocated { replicas } => (0, replicas),
        Topology::Disaggregated { prefill, decode } => {
            if prefill == 0 {
                return Err(SimError::Config(
                    "a disaggregated deployment needs at least one prefill worker".into(),
                ));
            }
            (prefill, decode)
        }
    };
    if n_decode == 0 {
        return Err(SimError::Config(
            "the deployment needs at least one worker that decodes".into(),
        ));
    }
    let transfer = if n_prefill > 0 {
        Some(profile.transfer(&cfg.transport)?)
    } else {
        None
    };
    let sched_cfg = SchedulerConfig {
        max_num_seqs: profile.max_num_seqs,
        max_num_batched_tokens: profile.max_num_batched_tokens,
        chunked_prefill: cfg.chunked_prefill,
    };
    let worker = |role| Worker {
        role,
        sched: Scheduler::new(sched_cfg),
        pool: BlockPool::new(profile.kv_blocks, profile.block_size, cfg.prefix_caching),
        batch: ForwardBatch::default(),
        busy: false,
        busy_s: 0.0,
        forward_left: 0.0,
        host_s: 0.0,
        gen: 0,
        in_flight: 0,
        prefix: PrefixTracker::new(profile.kv_blocks),
        pins: HashMap::new(),
        import_wait: VecDeque::new(),
        max_num_seqs: profile.max_num_seqs,
    };
    let mut workers: Vec<Worker> = (0..n_prefill).map(|_| worker(Role::Prefill)).collect();
    workers.extend((0..n_decode).map(|_| worker(Role::Decode)));
    let mut sim = Sim {
        profile,
        cfg,
        transfer,
        now: 0.0,
        events: BinaryHeap::new(),
        order: 0,
        workers,
        reqs: Vec::with_capacity(requests.len()),
        rng: ChaCha8Rng::seed_from_u64(cfg.seed),
        slots: max_concurrency.map(|c| c.max(1)),
        queued: VecDeque::new(),
        records: Vec::with_capacity(requests.len()),
        record_requests: Vec::with_capacity(requests.len()),
        stats: SimStats::default(),
        next_turn,
        device_since: 0.0,
    };
    for (i, r) in requests.into_iter().enumerate() {
        if r.prompt.is_empty() || r.max_tokens == 0 {
            return Err(SimError::Config(format!(
                "request {i} has an empty prompt or asks for no tokens"
            )));
        }
        if follow_ups[i].is_none() {
            sim.push(r.at_s, Event::Send(i));
        }
        sim.reqs.push(Req {
            at: r.at_s,
            hashes: block_hashes(&r.prompt, profile.block_size),
            prompt: r.prompt,
            max_tokens: r.max_tokens,
            class: r.class,
            token_times: Vec::new(),
            decode: 0,
            prefill: None,
            reserved: None,
            first_token: 0,
            error: None,
        });
    }
    while let Some(Timed { at, event, .. }) = sim.events.pop() {
        sim.now = at;
        match event {
            Event::Send(r) => sim.send(r),
            Event::Route(r) => sim.route(r),
            Event::PrefillArrive(r) => sim.prefill_arrive(r),
            Event::ForwardDone(w, gen) => sim.forward_done(w, gen),
            Event::StepDone(w) => sim.step_done(w),
            Event::DecodeStart(r) => sim.decode_start(r),
            Event::Imported(r) => sim.imported(r),
        }
    }
    // Whatever is left could never run (a prompt larger than a worker's whole pool).
    for r in 0..sim.reqs.len() {
        if sim.reqs[r].error.is_none() && sim.reqs[r].token_times.len() < sim.reqs[r].max_tokens {
            sim.fail(r, "never finished: the KV cache cannot hold it".into());
        }
    }
    let duration_s = sim
        .records
        .iter()
        .map(|r| r.start_s + r.e2e_s)
        .fold(0.0, f64::max);
    sim.stats.busy_s = sim.workers.iter().map(|w| w.busy_s).collect();
    Ok(SimOutcome {
        records: sim.records,
        record_requests: sim.record_requests,
        duration_s,
        stats: sim.stats,
    })
}

impl Sim<'_> {
    fn push(&mut self, at: f64, event: Event) {
        self.order += 1;
        self.events.push(Timed {
            at,
            order: self.order,
            event,
        });
    }

    fn send(&mut self, r: usize) {
        match &mut self.slots {
            Some(0) => self.queued.push_back(r),
            Some(n) => {
                *n -= 1;
                self.start(r);
            }
            None => self.start(r),
        }
    }

    fn start(&mut self, r: usize) {
        self.reqs[r].at = self.now;
        let at = self.now + self.profile.overheads.request_s;
        self.push(at, Event::Route(r));
    }

    /// The request's end (done or failed): its record, and its slot to the next queued one.
    fn finish(&mut self, r: usize) {
        let req = &mut self.reqs[r];
        let times = &req.token_times;
        let ok = req.error.is_none();
        self.record_requests.push(r);
        let ttft = times.first().map_or(0.0, |t| t - req.at);
        let e2e = times.last().map_or(self.now - req.at, |t| t - req.at);
        self.records.push(RequestRecord {
            class: req.class,
            start_s: req.at,
            success: ok,
            prompt_len: req.prompt.len(),
            server_prompt_tokens: Some(req.prompt.len()),
            output_len: if ok { times.len() } else { 0 },
            ttft_s: ttft,
            itl_s: times.windows(2).map(|w| w[1] - w[0]).collect(),
            e2e_s: e2e,
            error: req.error.clone(),
        });
        let d = req.decode;
        self.workers[d].in_flight = self.workers[d].in_flight.saturating_sub(1);
        if let Some(n) = &mut self.slots {
            *n += 1;
            if let Some(next) = self.queued.pop_front() {
                *n -= 1;
                self.start(next);
            }
        }
        if let Some((next, think_s)) = self.next_turn[r].take() {
            if ok {
                self.send_turn(r, next, think_s);
            } else {
                self.drop_turn(next, format!("the turn before it (request {r}) failed"));
            }
        }
    }

    /// A turn never sent because the one before it failed: its failed record, and the same for the
    /// turns after it.
    fn drop_turn(&mut self, r: usize, message: String) {
        let req = &mut self.reqs[r];
        req.error = Some(message.clone());
        self.record_requests.push(r);
        self.records.push(RequestRecord {
            class: req.class,
            start_s: self.now,
            success: false,
            prompt_len: req.prompt.len(),
            server_prompt_tokens: None,
            output_len: 0,
            ttft_s: 0.0,
            itl_s: Vec::new(),
            e2e_s: 0.0,
            error: Some(message),
        });
        if let Some((next, _)) = self.next_turn[r].take() {
            self.drop_turn(next, format!("the turn before it (request {r}) failed"));
        }
    }

    /// The conversation's next turn: the history (prompt and the answer the engine sampled) before its
    /// own tokens, sent after the think time.
    fn send_turn(&mut self, prev: usize, next: usize, think_s: f64) {
        let before = &self.reqs[prev];
        let mut prompt = before.prompt.clone();
        let len = prompt.len();
        prompt.extend((0..before.max_tokens).map(|i| sampled_token(prev, len + i)));
        prompt.extend_from_slice(&self.reqs[next].prompt);
        let req = &mut self.reqs[next];
        req.hashes = block_hashes(&prompt, self.profile.block_size);
        req.prompt = prompt;
        req.at = self.now + think_s;
        self.push(self.now + think_s, Event::Send(next));
    }

    fn fail(&mut self, r: usize, message: String) {
        self.reqs[r].error = Some(message);
        self.finish(r);
    }

    fn decoders(&self) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|&w| self.workers[w].role == Role::Decode)
            .collect()
    }

    fn prefillers(&self) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|&w| self.workers[w].role == Role::Prefill)
            .collect()
    }

    /// The head's `route`: a decode worker by load, then the local-prefill rule, then a prefill worker.
    fn route(&mut self, r: usize) {
        let decoders = self.decoders();
        let loads: Vec<DecodeLoad> = decoders.iter().map(|&w| self.workers[w].load()).collect();
        let matched: Vec<usize> = decoders
            .iter()
            .map(|&w| {
                self.workers[w].prefix.matched_blocks(&self.reqs[r].hashes)
                    * self.profile.block_size
            })
            .collect();
        let i = pick_decode_cached(&loads, &matched, &self.cfg.routing, &mut self.rng)
            .expect("decode workers exist");
        let d = decoders[i];
        self.workers[d].in_flight += 1;
        self.reqs[r].decode = d;
        let req = &self.reqs[r];
        let cached = matched[i].min(req.prompt.len());
        let uncached = req.prompt.len() - cached;
        let prefillers = self.prefillers();
        if !wants_remote_prefill(uncached, cached, prefillers.len(), &self.cfg.routing) {
            self.stats.local_prefills += 1;
            let hashes = std::mem::take(&mut self.reqs[r].hashes);
            self.workers[d].prefix.insert(&hashes);
            self.reqs[r].hashes = hashes;
            let seq = Sequence::new(r as u64, self.reqs[r].prompt.clone(), r);
            self.workers[d].sched.add(seq);
            self.kick(d);
            return;
        }
        self.stats.remote_prefills += 1;
        let cands: Vec<PrefillCandidate> = prefillers
            .iter()
            .map(|&w| PrefillCandidate {
                matched_score: self.workers[w].prefix.matched_score(&req.hashes),
                in_flight: self.workers[w].in_flight,
            })
            .collect();
        let p = prefillers[pick_prefill(&cands, self.cfg.routing.prefill_load_bound)
            .expect("prefill workers exist")];
        self.reqs[r].prefill = Some(p);
        self.workers[p].in_flight += 1;
        let at = self.now + self.profile.overheads.rpc_s;
        self.push(at, Event::PrefillArrive(r));
    }

    /// The prefill RPC reaches the prefill worker's engine.
    fn prefill_arrive(&mut self, r: usize) {
        let p = self.reqs[r].prefill.expect("routed to a prefill worker");
        let seq = Sequence::new(r as u64, self.reqs[r].prompt.clone(), r);
        self.workers[p].sched.add(seq);
        self.kick(p);
    }

    /// Starts a step on an idle worker with work.
    fn kick(&mut self, w: usize) {
        let worker = &mut self.workers[w];
        if worker.busy || !worker.sched.has_work() {
            return;
        }
        worker.sched.schedule(&mut worker.pool, &mut worker.batch);
        self.stats.preemptions += worker.sched.preempted().len() as u64;
        let out_of_room: Vec<u64> = worker.sched.out_of_room().to_vec();
        for id in out_of_room {
            let worker = &mut self.workers[w];
            if let Some(mut seq) = worker.sched.remove(id) {
                worker.pool.release(&mut seq.table);
            }
            self.fail(id as usize, "the KV cache is too small for it".into());
        }
        let worker = &mut self.workers[w];
        if worker.sched.scheduled().is_empty() {
            return;
        }
        let (mut tokens, mut prefill, mut context) = (0usize, 0usize, 0.0f64);
        for s in worker.sched.scheduled() {
            let seq = &worker.sched.running[s.index];
            let pos = seq.num_computed;
            tokens += s.len;
            if s.len > 1 || pos < seq.prompt_len {
                prefill += s.len;
            }
            context += (s.len * pos) as f64;
        }
        let seqs = worker.sched.scheduled().len();
        let forward = self.profile.forward_time(tokens, seqs, prefill, context);
        let host = self.profile.host_time(seqs);
        self.stats.steps += 1;
        if self.cfg.shared_device && forward > 0.0 {
            self.settle_device();
        }
        let worker = &mut self.workers[w];
        worker.busy = true;
        worker.busy_s += forward + host;
        worker.host_s = host;
        if forward <= 0.0 {
            let at = self.now + host;
            self.push(at, Event::StepDone(w));
        } else if self.cfg.shared_device {
            worker.forward_left = forward;
            self.device_changed();
        } else {
            // A device of its own: the forward ends when its time is up, whatever the others do.
            worker.forward_left = forward;
            worker.gen += 1;
            let (gen, at) = (worker.gen, self.now + forward);
            self.push(at, Event::ForwardDone(w, gen));
        }
    }

    /// Forwards on the shared device now.
    fn sharing(&self) -> f64 {
        self.workers
            .iter()
            .filter(|o| o.forward_left > 0.0)
            .count()
            .max(1) as f64
    }

    /// Charges the time since the last change of the shared device's occupants to the forwards on it,
    /// each at its share of the device.
    fn settle_device(&mut self) {
        let elapsed = self.now - self.device_since;
        self.device_since = self.now;
        if elapsed <= 0.0 {
            return;
        }
        let done = elapsed / self.sharing();
        for o in self.workers.iter_mut().filter(|o| o.forward_left > 0.0) {
            o.forward_left = (o.forward_left - done).max(0.0);
        }
    }

    /// (Re)schedules the end of every forward on the shared device after a change of its occupants: a
    /// forward's end is its work left times the sharing.
    fn device_changed(&mut self) {
        let share = self.sharing();
        let now = self.now;
        let mut ends = Vec::new();
        for (w, o) in self.workers.iter_mut().enumerate() {
            if o.busy && o.forward_left > 0.0 {
                o.gen += 1;
                ends.push((w, o.gen, now + o.forward_left * share));
            }
        }
        for (w, gen, at) in ends {
            self.push(at, Event::ForwardDone(w, gen));
        }
    }

    /// A forward left the device (unless the event is void): the others speed up, and the step's
    /// host work follows.
    fn forward_done(&mut self, w: usize, gen: u64) {
        if self.workers[w].gen != gen || !self.workers[w].busy {
            return;
        }
        if self.cfg.shared_device {
            self.settle_device();
        }
        let worker = &mut self.workers[w];
        worker.forward_left = 0.0;
        let at = self.now + worker.host_s;
        if self.cfg.shared_device {
            self.device_changed();
        }
        self.push(at, Event::StepDone(w));
    }

    /// The engine thread's step end: advance every chunk, sample, reap.
    fn step_done(&mut self, w: usize) {
        let now = self.now;
        let rpc = self.profile.overheads.rpc_s;
        let plan = self.workers[w].sched.scheduled().to_vec();
        let mut finished = Vec::new();
        let mut firsts = Vec::new();
        let mut done = Vec::new();
        {
            let worker = &mut self.workers[w];
            for s in plan {
                worker.sched.advance(&mut worker.pool, s);
                if !s.sample {
                    continue;
                }
                let seq = &mut worker.sched.running[s.index];
                let r = seq.ext;
                let token = sampled_token(r, seq.tokens.len());
                seq.tokens.push(token);
                let req = &mut self.reqs[r];
                if worker.role == Role::Prefill {
                    // Prefill-only: the first token goes back to the head, its KV stays pinned.
                    req.first_token = token;
                    req.token_times.push(now + rpc);
                    firsts.push(r);
                    finished.push(s.index);
                } else {
                    req.token_times.push(now);
                    if seq.output().len() >= req.max_tokens {
                        finished.push(s.index);
                        done.push(r);
                    }
                }
            }
            worker.busy = false;
            finished.sort_unstable();
            for idx in finished.into_iter().rev() {
                let mut seq = worker.sched.running.remove(idx);
                if worker.role == Role::Prefill {
                    worker.pins.insert(seq.ext, std::mem::take(&mut seq.table));
                } else {
                    worker.pool.release(&mut seq.table);
                }
            }
        }
        for r in firsts {
            let hashes = std::mem::take(&mut self.reqs[r].hashes);
            self.workers[w].prefix.insert(&hashes);
            self.workers[w].in_flight = self.workers[w].in_flight.saturating_sub(1);
            let d = self.reqs[r].decode;
            self.workers[d].prefix.insert(&hashes);
            self.reqs[r].hashes = hashes;
            if self.reqs[r].max_tokens <= 1 {
                if let Some(mut t) = self.workers[w].pins.remove(&r) {
                    self.workers[w].pool.release(&mut t);
                }
                self.finish(r);
            } else {
                // The head sends the decode RPC once the first token is back.
                self.push(now + 2.0 * rpc, Event::DecodeStart(r));
            }
        }
        for r in done {
            self.finish(r);
        }
        if self.workers[w].role == Role::Decode {
            self.retry_imports(w);
        }
        self.kick(w);
    }

    /// `import_prefilled` on the decode worker: the prompt's cached blocks shared, the rest reserved,
    /// then the pull of what it lacks; waits (FCFS) while the pool has no room.
    fn decode_start(&mut self, r: usize) {
        let d = self.reqs[r].decode;
        if !self.workers[d].import_wait.is_empty() || !self.reserve(r) {
            self.workers[d].import_wait.push_back(r);
        }
    }

    fn reserve(&mut self, r: usize) -> bool {
        let d = self.reqs[r].decode;
        let bs = self.profile.block_size;
        let worker = &mut self.workers[d];
        let prompt = &self.reqs[r].prompt;
        let mut table = BlockTable::default();
        let cached = worker.pool.match_full_blocks(&mut table, prompt);
        if worker
            .pool
            .ensure_capacity(&mut table, prompt.len() + 1)
            .is_err()
        {
            worker.pool.release(&mut table);
            return false;
        }
        let needed_blocks = prompt.len().div_ceil(bs) - cached / bs;
        let bytes = (needed_blocks * bs) as f64 * self.profile.kv_bytes_per_token;
        self.stats.kv_bytes_moved += bytes;
        let rate = self
            .transfer
            .expect("disaggregated deployments have a rate");
        let at = self.now + rate.latency_s + bytes / rate.bytes_per_s;
        self.reqs[r].reserved = Some(table);
        self.push(at, Event::Imported(r));
        true
    }

    fn retry_imports(&mut self, d: usize) {
        while let Some(&r) = self.workers[d].import_wait.front() {
            if !self.reserve(r) {
                break;
            }
            self.workers[d].import_wait.pop_front();
        }
    }

    /// The pull is done: the prefill worker unpins (ack) and the decode worker starts decoding.
    fn imported(&mut self, r: usize) {
        if let Some(p) = self.reqs[r].prefill {
            if let Some(mut t) = self.workers[p].pins.remove(&r) {
                self.workers[p].pool.release(&mut t);
            }
            self.kick(p);
        }
        let d = self.reqs[r].decode;
        let req = &mut self.reqs[r];
        let mut seq = Sequence::new(r as u64, req.prompt.clone(), r);
        seq.tokens.push(req.first_token);
        seq.num_computed = seq.prompt_len;
        seq.table = req.reserved.take().expect("reserved before the pull");
        let worker = &mut self.workers[d];
        worker
            .pool
            .register_computed(&mut seq.table, &seq.tokens, seq.num_computed);
        worker.sched.add_running(seq);
        self.kick(d);
    }
}

/// A stand-in for the sampled token: distinct per request and position, so generated blocks never
/// falsely share a prefix.
fn sampled_token(r: usize, pos: usize) -> u32 {
    let h = (r as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(pos as u64)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    1000 + (h >> 40) as u32 % 30_000
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::profile;

    fn req(prompt: Vec<u32>, max_tokens: usize, at_s: f64) -> SimRequest {
        SimRequest {
            prompt,
            max_tokens,
            class: RequestClass::Main,
            at_s,
        }
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 100_000 + i).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn one_request_costs_its_prefill_then_one_decode_step_per_token() {
        let p = profile();
        let cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
        let out = simulate(&p, &cfg, vec![req(prompt(1, 100), 5, 0.0)], None).unwrap();
        let r = &out.records[0];
        assert!(r.success);
        assert_eq!(r.output_len, 5);
        let prefill = p.prefill.at(100.0, 0.0);
        assert!(close(r.ttft_s, prefill), "{} vs {prefill}", r.ttft_s);
        assert_eq!(r.itl_s.len(), 4);
        assert!(r.itl_s.iter().all(|&t| close(t, p.decode.at(1.0, 0.0))));
        assert!(close(out.duration_s, r.e2e_s));
        assert_eq!(out.stats.steps, 5);
    }

    #[test]
    fn long_prompts_go_to_a_prefill_worker_and_short_ones_stay() {
        let p = profile();
        let cfg = SimConfig::new(Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        });
        let reqs = vec![req(prompt(1, 100), 4, 0.0), req(prompt(2, 8), 4, 1.0)];
        let out = simulate(&p, &cfg, reqs, None).unwrap();
        assert!(out.records.iter().all(|r| r.success && r.output_len == 4));
        assert_eq!(
            (out.stats.remote_prefills, out.stats.local_prefills),
            (1, 1)
        );
        // 100 tokens = 7 blocks of 16 pulled.
        assert!(close(out.stats.kv_bytes_moved, 7.0 * 16.0 * 1000.0));
        let long = out.records.iter().find(|r| r.prompt_len == 100).unwrap();
        // The first token comes from the prefill worker; the second waits for the pull.
        let pull = 0.001 + 7.0 * 16.0 * 1000.0 / 1e9;
        assert!(long.itl_s[0] > pull, "{:?}", long.itl_s);
        assert!(out.stats.busy_s[0] > 0.0 && out.stats.busy_s[1] > 0.0);
    }

    #[test]
    fn a_shared_prefix_is_not_prefilled_twice() {
        let p = profile();
        let cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
        let mut second = prompt(1, 96);
        second.extend(prompt(2, 4));
        let reqs = vec![req(prompt(1, 100), 2, 0.0), req(second, 2, 1.0)];
        let out = simulate(&p, &cfg, reqs.clone(), None).unwrap();
        let ttft = |o: &SimOutcome| o.records[1].ttft_s;
        let mut off = cfg.clone();
        off.prefix_caching = false;
        let uncached = simulate(&p, &off, reqs, None).unwrap();
        // Six cached blocks: only the last 4 tokens run, at positions 96..100.
        let four = p.prefill.at(4.0, 4.0 * 96.0);
        assert!(close(ttft(&out), four), "{} vs {four}", ttft(&out));
        let all = p.prefill.at(100.0, 0.0);
        assert!(close(ttft(&uncached), all), "{} vs {all}", ttft(&uncached));
    }

    #[test]
    fn a_small_pool_preempts_and_still_finishes_everything() {
        let mut p = profile();
        p.kv_blocks = 12;
        let cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
        let reqs = (0..4).map(|i| req(prompt(i, 40), 20, 0.0)).collect();
        let out = simulate(&p, &cfg, reqs, None).unwrap();
        assert!(out.stats.preemptions > 0);
        assert!(out.records.iter().all(|r| r.success && r.output_len == 20));
        // A prompt larger than the whole pool fails instead of hanging.
        let out = simulate(&p, &cfg, vec![req(prompt(9, 400), 2, 0.0)], None).unwrap();
        assert!(!out.records[0].success);
    }

    #[test]
    fn a_concurrency_limit_serialises_requests_and_more_workers_go_faster() {
        let p = profile();
        let one = SimConfig::new(Topology::Colocated { replicas: 1 });
        let reqs: Vec<_> = (0..8).map(|i| req(prompt(i, 64), 16, 0.0)).collect();
        let serial = simulate(&p, &one, reqs.clone(), Some(1)).unwrap();
        let batched = simulate(&p, &one, reqs.clone(), None).unwrap();
        assert!(serial.duration_s > 3.0 * batched.duration_s);
        // With one slot, no request waits behind another inside the engine.
        let first = serial.records[0].ttft_s;
        assert!(serial.records.iter().all(|r| close(r.ttft_s, first)));
        let two = SimConfig::new(Topology::Colocated { replicas: 2 });
        let spread = simulate(&p, &two, reqs, None).unwrap();
        assert!(spread.duration_s < batched.duration_s);
    }

    /// The profile's host overheads land where the server spends them: the per-request cost before the
    /// first step (on the TTFT only), the per-step cost on every step.
    #[test]
    fn host_overheads_add_to_the_first_token_and_to_every_step() {
        let mut p = profile();
        p.overheads.request_s = 0.05;
        p.overheads.step_s = 0.002;
        p.overheads.step_per_seq_s = 0.0005;
        let cfg = SimConfig::new(Topology::Colocated { replicas: 1 });
        let out = simulate(&p, &cfg, vec![req(prompt(1, 100), 5, 0.0)], None).unwrap();
        let r = &out.records[0];
        let prefill = p.prefill.at(100.0, 0.0) + 0.0025;
        assert!(close(r.ttft_s, 0.05 + prefill), "{}", r.ttft_s);
        let decode = p.decode.at(1.0, 0.0) + 0.0025;
        assert!(r.itl_s.iter().all(|&t| close(t, decode)), "{:?}", r.itl_s);
        assert!(close(out.stats.busy_s[0], prefill + 4.0 * decode));
        // Two sequences decoding together: each step costs the per-sequence share twice.
        let two = vec![req(prompt(1, 100), 5, 0.0), req(prompt(2, 100), 5, 0.0)];
        let out = simulate(&p, &cfg, two, None).unwrap();
        let decode2 = p.decode.at(2.0, 0.0) + 0.002 + 2.0 * 0.0005;
        let itl = &out.records[0].itl_s;
        assert!(close(*itl.last().unwrap(), decode2), "{itl:?}");
    }

    /// Two forwards on one device at once each run at half speed: two equal prompts on two colocated
    /// workers both take twice their prefill on a shared device, and their prefill apart.
    #[test]
    fn forwards_on_a_shared_device_share_its_time() {
        let p = profile();
        let prefill = p.prefill.at(100.0, 0.0);
        let mut cfg = SimConfig::new(Topology::Colocated { replicas: 2 });
        let reqs = vec![req(prompt(1, 100), 1, 0.0), req(prompt(2, 100), 1, 0.0)];
        for (shared, ttft) in [(false, prefill), (true, 2.0 * prefill)] {
            cfg.shared_device = shared;
            let out = simulate(&p, &cfg, reqs.clone(), None).unwrap();
            assert!(
                out.stats.busy_s.iter().all(|&b| close(b, prefill)),
                "{:?}",
                out.stats
            );
            for r in &out.records {
                assert!(
                    r.success && close(r.ttft_s, ttft),
                    "shared {shared}: {} vs {ttft}",
                    r.ttft_s
                );
            }
        }
    }

    /// On a shared device a prefill worker's and a decode worker's forwards share one device's time:
    /// the run takes at least the sum of their busy times, where on two devices they overlap and it
    /// takes less.
    #[test]
    fn workers_on_a_shared_device_use_one_device() {
        let p = profile();
        let mut cfg = SimConfig::new(Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        });
        // Long prompts prefill remotely while the earlier ones decode.
        let reqs: Vec<_> = (0..6)
            .map(|i| req(prompt(i, 200), 30, i as f64 * 0.05))
            .collect();
        let apart = simulate(&p, &cfg, reqs.clone(), None).unwrap();
        let busy = |o: &SimOutcome| o.stats.busy_s.iter().sum::<f64>();
        assert!(apart.stats.remote_prefills > 0);
        assert!(
            apart.duration_s < busy(&apart),
            "two devices overlap: {} vs {}",
            apart.duration_s,
            busy(&apart)
        );
        cfg.shared_device = true;
        let shared = simulate(&p, &cfg, reqs, None).unwrap();
        assert!(shared
            .records
            .iter()
            .all(|r| r.success && r.output_len == 30));
        assert!(
            shared.duration_s + 1e-9 >= busy(&shared),
            "one device serialises: {} vs {}",
            shared.duration_s,
            busy(&shared)
        );
        assert!(shared.duration_s > apart.duration_s);
    }

    #[test]
    fn impossible_deployments_are_refused() {
        let p = profile();
        let none = SimConfig::new(Topology::Disaggregated {
            prefill: 1,
            decode: 0,
        });
        assert!(simulate(&p, &none, vec![], None).is_err());
        let mut shm = SimConfig::new(Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        });
        shm.transport = "shm".into();
        let e = simulate(&p, &shm, vec![], None).unwrap_err().to_string();
        assert!(e.contains("transfer"), "{e}");
    }
}
