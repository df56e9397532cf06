"""deploy/compose/compose.autoscale.yaml: `tandem autoscale` driving the compose deployment.

Two tests. The prefill one: with decode fixed at one worker and prefill 1..2 on a profile whose prompt
steps are slow on purpose (tests/compose/autoscale-prefill.yaml, autoscale-prefill-profile.yaml), a
stream of long prompts with short answers makes the autoscaler add a prefill worker (and no decode
worker), and short prompts afterwards drain it away with every request answered.

The decode one (about a minute past start-up): with one prefill and one decode worker and the autoscaler
(tests/compose/autoscale.yaml: 2 s windows, up after 2, down after 4, decode 1..2, prefill fixed at
1, on the slow datasheet profile tests/compose/autoscale-profile.yaml), a load step makes the
autoscaler add a decode replica (a container the head discovers and routes to), a steady load keeps it
there (no flapping), and a light load afterwards makes it drain one away (SIGTERM, exit 0, removed)
with every client request answered throughout.
"""

import json
import threading
import time

import openai

from conftest import MODEL_FILE, ROOT, run

MODEL = MODEL_FILE.removesuffix(".gguf")
HERE = ROOT / "tests" / "compose"


class Load:
    """`clients` threads sending streamed chat requests until stopped, `pause` seconds apart each;
    every request's outcome is counted (a failure keeps its error). `filler` words of text after the
    request's own opening make a long prompt (distinct per request from its first block, so no prefix
    cache serves it)."""

    def __init__(self, url, clients, max_tokens, pause=0.0, filler=0):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
        self.max_tokens, self.pause = max_tokens, pause
        self.filler = " ".join(f"item{k % 97}" for k in range(filler))
        self.stop = threading.Event()
        self.ok, self.errors = 0, []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def loop(self, i):
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                text, finish = "", None
                for chunk in self.client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user",
                                                "content": f"Client {i} try {n}: count to ten. {self.filler}"}],
                        max_tokens=self.max_tokens, temperature=0, stream=True):
                    for c in chunk.choices:
                        text += c.delta.content or ""
                        finish = c.finish_reason or finish
                if finish not in ("stop", "length"):
                    raise RuntimeError(f"stream ended without a finish ({text!r})")
                with self.lock:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                with self.lock:
                    self.errors.append(repr(e))
            self.stop.wait(self.pause)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)
        return self.ok, self.errors


def running(d, service):
    return run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={d.project}",
                "--filter", f"label=com.docker.compose.service={service}"], timeout=30).stdout.split()


def records(d):
    """The autoscaler's JSON lines (one per window) from its container's output."""
    out = run(["docker", "logs", running(d, "autoscaler")[0]], timeout=30).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{\"t\":")]


def test_load_step_scales_decode_up_and_drains_it_down(deployment, tmp_path):
    d = deployment(["compose.yaml", "compose.autoscale.yaml"], "as")
    d.env["TANDEM_PROFILE"] = str(HERE / "autoscale-profile.yaml")
    d.env["TANDEM_AUTOSCALE_CONFIG"] = str(HERE / "autoscale.yaml")
    d.up()
    d.healthy()
    d.wait_for("one prefill and one decode worker discovered",
               lambda: len(d.healthy_workers("prefill")) == 1 and len(d.healthy_workers("decode")) == 1,
               timeout=120)
    d.wait_for("the autoscaler's first window", lambda: records(d), timeout=60)

    # Step up: six clients streaming without pause. The model (decode capacity of the slow profile at
    # the ITL objective) asks for two decode workers.
    heavy = Load(d.url, clients=6, max_tokens=32)
    t0 = time.monotonic()
    try:
        d.wait_for("a second decode container", lambda: len(running(d, "decode")) == 2, timeout=60)
        up_s = time.monotonic() - t0
        d.wait_for("the head routing to two decode workers", lambda: len(d.healthy_workers("decode")) == 2,
                   timeout=60)
        # Steady load: no change for 12 s (decode is at its max; the load is far above the
        # scale-down threshold).
        steady_from = time.monotonic()
        while time.monotonic() - steady_from < 12:
            assert len(running(d, "decode")) == 2, "the decode replicas changed under a steady load"
            time.sleep(2)
    finally:
        heavy_ok, heavy_errors = heavy.end()

    # Step down: a light load keeps requests in flight while one decode worker drains away.
    light = Load(d.url, clients=1, max_tokens=8, pause=1.0)
    t1 = time.monotonic()
    try:
        d.wait_for("back to one decode container", lambda: len(running(d, "decode")) == 1, timeout=90)
        down_s = time.monotonic() - t1
        d.wait_for("the head back to one decode worker",
                   lambda: len(d.healthy_workers("decode")) == 1 and len(d.workers()) == 2, timeout=60)
        time.sleep(2)
    finally:
        light_ok, light_errors = light.end()

    assert not heavy_errors and not light_errors, (heavy_errors + light_errors)[:5]
    assert heavy_ok > 6 and light_ok > 0, (heavy_ok, light_ok)
    # Exactly one change each way: up by one, then down by one (no flapping).
    changes = [(c["role"], c["from"], c["to"]) for r in records(d) for c in r["decisions"]]
    assert changes == [("decode", 1, 2), ("decode", 2, 1)], changes
    logs = run(["docker", "logs", running(d, "autoscaler")[0]], timeout=30).stdout
    assert "replica drained and removed" in logs and "exit_code=0" in logs, logs[-3000:]
    # The drain broke no stream (none had to be resumed elsewhere), and the head exported the per-role
    # waits the autoscaler reads.
    m = d.metrics()
    assert m["tandem:decode_failures_total"] == 0 and m["tandem:decode_resumes_total"] == 0, m
    for role in ("prefill", "decode"):
        assert m[f'tandem:role_wait_seconds_count{{role="{role}"}}'] > 0, role
    for r in records(d):
        for c in r["decisions"]:
            print(f"t={r['t']:.0f}s {c['role']} {c['from']}->{c['to']}: {c['reason']}")

    # A profile of another model is refused at start-up, naming the field, before anything is scaled.
    other = tmp_path / "profile.yaml"
    other.write_text((HERE / "autoscale-profile.yaml").read_text().replace(
        "name: SmolLM2-135M-Instruct.Q4_1", "name: another-model"))
    p = run(["docker", "run", "--rm", "--user", "0:0", "--network", d.network("backend"),
             "-v", "/var/run/docker.sock:/var/run/docker.sock",
             "-v", f"{HERE / 'autoscale.yaml'}:/etc/tandem/autoscale.yaml:ro",
             "-v", f"{other}:/etc/tandem/profile.yaml:ro", "-e", f"TANDEM_CLUSTER_TOKEN={d.token}",
             d.env["TANDEM_IMAGE"], "autoscale", "--config", "/etc/tandem/autoscale.yaml", "--project", d.project],
            check=False, timeout=60)
    assert p.returncode != 0 and "field `profile`" in p.stdout and "another-model" in p.stdout, p.stdout[-2000:]
    assert len(running(d, "decode")) == 1
    print(f"scale-up {up_s:.1f} s after the step, scale-down {down_s:.1f} s after it; "
          f"{heavy_ok} heavy and {light_ok} light requests, none failed")


def test_long_prompts_scale_prefill_up_and_drain_it_down(deployment):
    d = deployment(["compose.yaml", "compose.autoscale.yaml"], "asp")
    d.env["TANDEM_PROFILE"] = str(HERE / "autoscale-prefill-profile.yaml")
    d.env["TANDEM_AUTOSCALE_CONFIG"] = str(HERE / "autoscale-prefill.yaml")
    d.up()
    d.healthy()
    d.wait_workers(1, 1)
    d.wait_for("the autoscaler's first window", lambda: records(d), timeout=60)

    # Long prompts (a few hundred tokens each), four tokens out: prompt tokens/s above what the
    # profile's prefill worker takes at 80%, generated tokens/s far below one decode worker's.
    heavy = Load(d.url, clients=3, max_tokens=4, filler=300)
    t0 = time.monotonic()
    try:
        d.wait_for("a second prefill container", lambda: len(running(d, "prefill")) == 2, timeout=60)
        up_s = time.monotonic() - t0
        d.wait_for("the head routing to two prefill workers", lambda: len(d.healthy_workers("prefill")) == 2,
                   timeout=60)
        time.sleep(4)
    finally:
        heavy_ok, heavy_errors = heavy.end()

    light = Load(d.url, clients=1, max_tokens=4, pause=1.0)
    t1 = time.monotonic()
    try:
        d.wait_for("back to one prefill container", lambda: len(running(d, "prefill")) == 1, timeout=90)
        down_s = time.monotonic() - t1
        d.wait_for("the head back to one prefill worker",
                   lambda: len(d.healthy_workers("prefill")) == 1 and len(d.workers()) == 2, timeout=60)
        time.sleep(2)
    finally:
        light_ok, light_errors = light.end()

    assert not heavy_errors and not light_errors, (heavy_errors + light_errors)[:5]
    assert heavy_ok > 3 and light_ok > 0, (heavy_ok, light_ok)
    changes = [(c["role"], c["from"], c["to"]) for r in records(d) for c in r["decisions"]]
    assert changes == [("prefill", 1, 2), ("prefill", 2, 1)], changes
    assert len(running(d, "decode")) == 1
    logs = run(["docker", "logs", running(d, "autoscaler")[0]], timeout=30).stdout
    assert "replica drained and removed" in logs and "exit_code=0" in logs, logs[-3000:]
    m = d.metrics()
    assert m["tandem:decode_failures_total"] == 0, m
    for r in records(d):
        for c in r["decisions"]:
            print(f"t={r['t']:.0f}s {c['role']} {c['from']}->{c['to']}: {c['reason']}")
    print(f"prefill scale-up {up_s:.1f} s after the step, scale-down {down_s:.1f} s after it; "
          f"{heavy_ok} heavy and {light_ok} light requests, none failed")
