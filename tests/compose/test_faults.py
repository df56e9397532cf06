"""Faults against the compose deployment (deploy/compose/compose.yaml, DNS discovery), each test its own
compose project with the short time limits of head-faults.yaml, driven through the official OpenAI client:

- test_decode_killed_mid_stream: `docker kill` of a decode container while streams run on it (2 decode
  replicas): every stream ends with a finish reason, resumed on the other decode worker.
- test_scale_up_under_load: `--scale prefill=2 --scale decode=2` from 1/1 while a client loop runs: each
  new worker is listed and gets traffic within 30 s.
- test_prefill_disconnected: `docker network disconnect` of one of 2 prefill containers under load: every
  request is served (by the other prefill worker, or prefilled on decode) and none takes past the timeouts;
  connected again, it is back in routing.
- test_rolling_restart_of_decode: the decode replicas stopped (SIGTERM: drain) and started one at a time
  under load: zero failed requests.
- test_head_restarted: `docker restart` of the head: its workers are rediscovered and new requests served.
- test_worker_with_another_block_size_is_refused: a decode container with `--block-size 32` joining the
  network under the name `decode`: refused (the head's log names `block_size`), listed nowhere, no traffic.

Each prints a `FAULTS` line with its counts (requests, failures, resumes, timings) for BENCHMARKS.md.
"""

import os
import re
import threading
import time
import uuid

import openai
import requests

from conftest import CPU_IMAGE, MODEL_FILE, ROOT, run

MODEL = MODEL_FILE.removesuffix(".gguf")
# TANDEM_FAULTS_HEAD_CONFIG names another head YAML (e.g. deploy/compose/head.yaml, the default time
# limits: to see test_prefill_disconnected fail on a request held past the client's patience).
HEAD_CONFIG = os.environ.get("TANDEM_FAULTS_HEAD_CONFIG", str(ROOT / "tests" / "compose" / "head-faults.yaml"))
# A client never waits longer than this for one request: past it the request counts as hung (failed).
CLIENT_TIMEOUT_S = 60


def client(d):
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def prompt(tag=""):
    """A user message unique past the chat template's shared prefix (more than a KV block of its own), so
    the decode worker's prefix cache never covers it and it is prefilled on a prefill worker."""
    return [{"role": "user", "content": f"{tag} {uuid.uuid4().hex} Write one short sentence about the sea, "
             "the wind, the harbour lights and the boats that come home late in the evening."}]


def stream(c, max_tokens, tag="", progress=None):
    """One streamed chat completion; returns (finish_reason, content chunks, usage tokens or None).
    `progress(chunks)` is called after each content chunk."""
    finish, chunks, usage = None, 0, None
    for chunk in c.chat.completions.create(model=MODEL, messages=prompt(tag), max_tokens=max_tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            if ch.delta.content:
                chunks += 1
                if progress:
                    progress(chunks)
            finish = ch.finish_reason or finish
    return finish, chunks, usage


class Load:
    """`threads` clients sending streamed requests back to back until stopped; every outcome recorded.
    A request fails when it raises (HTTP error, broken stream, client timeout) or ends without a finish
    reason or with fewer tokens than asked for (ignore_eos: every request runs to max_tokens)."""

    def __init__(self, d, threads=2, max_tokens=16):
        self.c = client(d)
        self.max_tokens = max_tokens
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok, self.failures, self.latencies = 0, [], []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def _loop(self, i):
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                finish, _, usage = stream(self.c, self.max_tokens, f"client {i}")
                error = None
                if finish != "length" or usage != self.max_tokens:
                    error = f"finish {finish!r}, {usage} tokens"
            except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
                error = f"{type(e).__name__}: {e}"
            dt = time.monotonic() - t0
            with self.lock:
                self.latencies.append(dt)
                if error:
                    self.failures.append((time.strftime("%H:%M:%S"), round(dt, 1), error[:300]))
                else:
                    self.ok += 1

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def count(self):
        with self.lock:
            return self.ok + len(self.failures)

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self.threads), "a client thread is stuck past the client timeout"
        return self


def summary(name, **counts):
    counts = {k: re.sub(r"\x1b\[[0-9;]*m", "", v) if isinstance(v, str) else v for k, v in counts.items()}
    print(f"\nFAULTS {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))


def counter(d, name):
    return d.metrics().get(name, 0.0)


def up(deployment, name, prefill, decode):
    """The compose deployment with head-faults.yaml, `prefill`/`decode` replicas, all discovered."""
    d = deployment(["compose.yaml"], name, head_config=HEAD_CONFIG)
    d.up(scale={"prefill": prefill, "decode": decode})
    d.healthy()
    d.wait_for(f"{prefill} prefill and {decode} decode workers discovered",
               lambda: len(d.healthy_workers("prefill")) == prefill and len(d.healthy_workers("decode")) == decode,
               timeout=120)
    return d


def by_ip(d, role):
    """{container address on the backend network: container id} of one service."""
    return {d.ip(c): c for c in d.containers(role)}


def listed(d, url):
    return next((w for w in d.workers() if w["url"] == url), None)


def test_decode_killed_mid_stream(require_dns_discovery, deployment):
    d = up(deployment, "fk", prefill=1, decode=2)
    c = client(d)
    n, max_tokens = 6, 160
    results, errors, received = [None] * n, [None] * n, [0] * n

    def one(i):
        try:
            results[i] = stream(c, max_tokens, f"stream {i}", progress=lambda k: received.__setitem__(i, k))
        except Exception as e:  # noqa: BLE001
            errors[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    # Kill the decode worker serving the most streams once every stream has delivered tokens to the client.
    ips = by_ip(d, "decode")
    d.wait_for("5 tokens received on every stream", lambda: min(received) >= 5, timeout=60, interval=0.1)
    victim = d.wait_for("every stream decoding", lambda: (
        lambda ws: sum(w["load"]["in_flight"] for w in ws) >= n and max(ws, key=lambda w: w["load"]["in_flight"]))(
            d.healthy_workers("decode")), timeout=60, interval=0.2)
    on_victim = victim["load"]["in_flight"]
    received_at_kill = sorted(received)
    generated = victim["load"]["engine"]["generation_tokens_total"]
    container = ips[victim["url"].removeprefix("http://").rsplit(":", 1)[0]]
    t_kill = time.monotonic()
    run(["docker", "kill", container], timeout=30)
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
    took = time.monotonic() - t_kill
    assert not any(t.is_alive() for t in threads), "a stream is stuck past the client timeout"
    assert d.state(container)["Running"] is False, "the killed decode container is running again"
    failed = [(i, e) for i, e in enumerate(errors) if e]
    bad = [(i, r) for i, r in enumerate(results) if r and (r[0] != "length" or r[2] != max_tokens)]
    resumes = counter(d, "tandem:decode_resumes_total")
    summary("decode killed mid-stream", streams=n, on_killed_worker=on_victim, failures=len(failed) + len(bad),
            decode_resumes=int(resumes), decode_failures=int(counter(d, "tandem:decode_failures_total")),
            client_tokens_at_kill=received_at_kill, worker_tokens_at_kill=generated,
            streams_done_after_kill_s=round(took, 1))
    assert max(received_at_kill) < max_tokens, "a stream had finished before the kill: not mid-stream"
    assert not failed, f"streams that raised: {failed}"
    assert not bad, f"streams without their {max_tokens} tokens and finish reason 'length': {bad}"
    # Every stream of the killed worker was resumed elsewhere (it had started: the kill came mid-stream).
    assert resumes >= on_victim, f"{resumes} resumes for {on_victim} streams on the killed worker"
    d.wait_for("the killed worker dropped from the routable decode workers",
               lambda: len(d.healthy_workers("decode")) == 1, timeout=30)


def test_scale_up_under_load(require_dns_discovery, deployment):
    d = up(deployment, "fs", prefill=1, decode=1)
    before = {w["url"] for w in d.workers()}
    load = Load(d, threads=2).start()
    try:
        d.wait_for("requests flowing", lambda: load.count() >= 2, timeout=60)
        t0 = time.monotonic()
        d.up(scale={"prefill": 2, "decode": 2})
        t_up = time.monotonic() - t0

        def new_serving(role, counter_name):
            new = [w for w in d.workers() if w["url"] not in before and w["info"]["role"] == role]
            return next((w for w in new if w["load"]["engine"][counter_name] > 0), None)

        # Within 30 s of the new containers running (compose returns once they are started). Decode is
        # picked by load (power of two choices), so the idle newcomer takes requests of the loop at once.
        dec = d.wait_for("the new decode worker serving requests",
                         lambda: new_serving("decode", "requests_finished_total"), timeout=30, interval=0.5)
        t_decode = time.monotonic() - t0
        # Prefill is picked by cached prefix within a load bound (2 requests in flight above the least
        # loaded): the warm worker, holding the chat template's prefix, keeps a light load, and the
        # newcomer gets the prompts past the bound. A burst of 8 concurrent requests goes past it.
        d.wait_for("the new prefill worker routable",
                   lambda: [w for w in d.healthy_workers("prefill") if w["url"] not in before], timeout=30)
        bursts, bad = 0, []

        def burst_until_served():
            # Bursts of 8 concurrent requests until the newcomer has prompts (or the 30 s are up).
            nonlocal bursts
            out = [None] * 8

            def one(i):
                try:
                    out[i] = stream(client(d), 8, f"burst {bursts} {i}")
                except Exception as e:  # noqa: BLE001
                    out[i] = f"{type(e).__name__}: {e}"

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(out))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(CLIENT_TIMEOUT_S + 10)
            bursts += 1
            bad.extend(b for b in out if not (isinstance(b, tuple) and b[0] == "length" and b[2] == 8))
            return new_serving("prefill", "prompt_tokens_total")

        pre = d.wait_for("the new prefill worker serving prompts", burst_until_served,
                         timeout=max(1.0, 30 - (time.monotonic() - t0)), interval=0.5)
        t_served = time.monotonic() - t0
    finally:
        load.stop()
    summary("scale-up 1P1D -> 2P2D under load", requests=load.count(), failures=len(load.failures),
            bursts_of_8=bursts, burst_failures=len(bad), compose_up_s=round(t_up, 1),
            new_decode_served_after_s=round(t_decode, 1), new_prefill_served_after_s=round(t_served, 1),
            new_decode_requests=dec["load"]["engine"]["requests_finished_total"],
            new_prefill_prompt_tokens=pre["load"]["engine"]["prompt_tokens_total"])
    assert not load.failures, f"failed requests while scaling up: {load.failures}"
    assert not bad, f"failed requests of the burst: {bad}"


def test_prefill_disconnected(require_dns_discovery, deployment):
    d = up(deployment, "fp", prefill=2, decode=1)
    ips = by_ip(d, "prefill")
    net = d.network("backend")
    load = Load(d, threads=3).start()
    disconnected = None
    try:
        # Both prefill workers take prompts before the fault.
        d.wait_for("both prefill workers serving", lambda: all(
            w["load"]["engine"]["prompt_tokens_total"] > 0 for w in d.healthy_workers("prefill")) and
            len(d.healthy_workers("prefill")) == 2, timeout=60, interval=0.5)
        victim = max(d.healthy_workers("prefill"), key=lambda w: w["load"]["in_flight"])
        victim_ip = victim["url"].removeprefix("http://").rsplit(":", 1)[0]
        other = next(w for w in d.healthy_workers("prefill") if w["url"] != victim["url"])
        other_before = other["load"]["engine"]["prompt_tokens_total"]
        n0, fallback0 = load.count(), counter(d, 'tandem:pd_requests_total{prefill="fallback"}')
        run(["docker", "network", "disconnect", "--force", net, ips[victim_ip]], timeout=30)
        disconnected = ips[victim_ip]
        t0 = time.monotonic()
        # Requests go on being served while the worker is cut off: at least 12 after the fault, and the
        # routing moved off it (it vanished from DNS, or its polls failed).
        d.wait_for("12 requests after the disconnect",
                   lambda: load.count() - n0 >= 12 and load.ok > 0, timeout=90, interval=0.5)
        d.wait_for("the cut-off prefill worker out of routing",
                   lambda: all(w["url"] != victim["url"] for w in d.healthy_workers("prefill") if not w["draining"]),
                   timeout=30)
        t_after = time.monotonic() - t0
    finally:
        load.stop()
    other_after = listed(d, other["url"])["load"]["engine"]["prompt_tokens_total"]
    fallback = counter(d, 'tandem:pd_requests_total{prefill="fallback"}') - fallback0
    slowest = max(load.latencies)
    summary("prefill disconnected (2P1D)", requests=load.count(), after_fault=load.count() - n0,
            failures=len(load.failures), prefill_failures=int(counter(d, "tandem:prefill_failures_total")),
            fallback_prefills=int(fallback), other_prefill_tokens_gained=other_after - other_before,
            slowest_request_s=round(slowest, 1), window_s=round(t_after, 1))
    assert not load.failures, f"failed requests with a prefill worker cut off: {load.failures}"
    assert other_after > other_before, "the remaining prefill worker took no prompt after the fault"
    # prefill_secs (10) + decode of 16 tokens: nothing waits on the cut-off worker past its timeouts.
    assert slowest < 25, f"a request took {slowest:.1f}s, past the time limits of head-faults.yaml"
    # The partition heals: connected again under its service name, it is rediscovered (a new handshake).
    t0 = time.monotonic()
    run(["docker", "network", "connect", "--alias", "prefill", net, disconnected], timeout=30)
    d.wait_for("the reconnected prefill worker back in routing",
               lambda: len([w for w in d.healthy_workers("prefill") if not w["draining"]]) == 2, timeout=30)
    summary("prefill reconnected", back_in_routing_after_s=round(time.monotonic() - t0, 1))


def test_rolling_restart_of_decode(require_dns_discovery, deployment):
    d = up(deployment, "fr", prefill=1, decode=2)
    containers = d.containers("decode")
    load = Load(d, threads=3, max_tokens=32).start()
    stops, in_flight_at_stop = [], []
    try:
        d.wait_for("requests flowing", lambda: load.count() >= 3, timeout=60)
        for c in containers:
            old = {w["info"]["instance"] for w in d.healthy_workers("decode")}
            # Stop it while it streams (its own count, read on the bridge network), so the drain has work.
            ip = d.ip(c)
            d.wait_for(f"a stream on decode {ip}", lambda: requests.get(
                f"http://{ip}:8100/v1/worker/load", headers=d.auth, timeout=5).json()["in_flight"] > 0,
                timeout=30, interval=0.05)
            in_flight_at_stop.append(requests.get(f"http://{ip}:8100/v1/worker/load", headers=d.auth,
                                                  timeout=5).json()["in_flight"])
            t0 = time.monotonic()
            run(["docker", "stop", "-t", "40", c], timeout=60)
            stops.append(round(time.monotonic() - t0, 1))
            code = d.state(c)["ExitCode"]
            assert code == 0, f"decode container {c[:12]} exited {code} on SIGTERM, not 0 after its drain"
            run(["docker", "start", c], timeout=60)
            # Back: two routable decode workers again, one of them the restarted process (a new instance).
            d.wait_for("the restarted decode worker back in routing", lambda: (
                lambda ws: len(ws) == 2 and len({w["info"]["instance"] for w in ws} - old) == 1)(
                    [w for w in d.healthy_workers("decode") if not w["draining"]]), timeout=90, interval=0.5)
        n = load.count()
        d.wait_for("requests served after the last restart", lambda: load.count() >= n + 3, timeout=60)
    finally:
        load.stop()
    resumes = int(counter(d, "tandem:decode_resumes_total"))
    summary("rolling restart of 2 decode replicas under load", requests=load.count(),
            failures=len(load.failures), streams_on_worker_at_sigterm=in_flight_at_stop, decode_resumes=resumes,
            decode_failures=int(counter(d, "tandem:decode_failures_total")), stop_s=stops)
    assert not load.failures, f"failed requests during the rolling restart: {load.failures}"
    # The drain finished the streams in flight on the stopped worker itself: none had to be resumed
    # elsewhere (a resume here means a stream broke on a SIGTERM, i.e. the drain did not hold).
    assert resumes == 0, f"{resumes} streams broke and were resumed during the rolling restart"


def test_head_restarted(require_dns_discovery, deployment):
    d = up(deployment, "fh", prefill=1, decode=1)
    c = client(d)
    for i in range(2):
        stream(c, 8, f"before {i}")
    workers = sorted(w["info"]["instance"] for w in d.workers())
    head = d.containers("head")
    assert len(head) == 1, head
    t0 = time.monotonic()
    run(["docker", "restart", "-t", "20", head[0]], timeout=60)
    d.healthy()
    t_health = time.monotonic() - t0
    d.wait_for("both workers rediscovered",
               lambda: len(d.healthy_workers("prefill")) == 1 and len(d.healthy_workers("decode")) == 1, timeout=60)
    results = [stream(c, 8, f"after {i}") for i in range(6)]
    t_served = time.monotonic() - t0
    after = sorted(w["info"]["instance"] for w in d.workers())
    summary("head restarted (1P1D)", requests_after=len(results),
            failures=sum(r[0] != "length" for r in results), head_healthy_after_s=round(t_health, 1),
            six_served_after_s=round(t_served, 1))
    assert all(r[0] == "length" and r[2] == 8 for r in results), results
    # The same worker processes (not restarted with it): rediscovered, not replaced.
    assert after == workers, (workers, after)
    assert counter(d, 'tandem:pd_requests_total{prefill="remote"}') > 0, "no prompt went to the prefill worker"


def test_worker_with_another_block_size_is_refused(require_dns_discovery, deployment):
    d = up(deployment, "fb", prefill=1, decode=1)
    name = f"{d.project}_decode_bs32"
    d.extra.append(name)
    # With the cluster's token, so the head's refusal is about its block size, not a stranger's 401.
    run(["docker", "run", "-d", "--name", name, "--network", d.network("backend"), "--network-alias", "decode",
         "-v", f"{d.env['TANDEM_MODELS']}:/models:ro", "-e", f"TANDEM_CLUSTER_TOKEN={d.token}", CPU_IMAGE,
         "worker", "--role", "decode", "--worker-id", "decode-bs32", "--model", f"/models/{MODEL_FILE}",
         "--host", "0.0.0.0", "--port", "8100", "--kv-port", "8200", "--block-size", "32"], timeout=60)
    ip = d.wait_for("the block-size-32 worker's address", lambda: d.ip(name), timeout=30)
    url = f"http://{ip}:8100"
    # It answers on the network (so it is refused, not unreachable) ...
    d.wait_for("the block-size-32 worker answering", lambda: run(
        ["docker", "exec", "-e", f"TANDEM_API_KEY={d.token}", name, "tandem", "probe",
         "http://127.0.0.1:8100/v1/worker/info"],
        check=False, timeout=30).returncode == 0, timeout=90)
    # ... and the head, resolving `decode` to it too, refuses it naming the field.
    refusal = d.wait_for("the head refusing it, naming block_size", lambda: [
        line for line in d("logs", "--no-color", "head", timeout=60, check=False).stdout.splitlines()
        if ip in line and "block_size" in line], timeout=30)
    c = client(d)
    results = [stream(c, 8, f"req {i}") for i in range(8)]
    assert all(r[0] == "length" for r in results), results
    assert listed(d, url) is None, f"{url} is listed: {listed(d, url)}"
    assert len(d.healthy_workers("decode")) == 1
    # No traffic: the worker's own counters (read from this host on the project's bridge network).
    load = requests.get(url + "/v1/worker/load", headers=d.auth, timeout=5).json()
    summary("decode worker with block_size 32", requests=len(results),
            failures=sum(r[0] != "length" for r in results), listed=False,
            its_requests=load["engine"]["requests_finished_total"], refusal=refusal[-1][-160:])
    assert load["engine"]["requests_finished_total"] == 0 and load["engine"]["prompt_tokens_total"] == 0, \
        f"the refused worker served requests: {load['engine']}"
