"""deploy/compose: the deployment brought up with docker compose, answering the OpenAI client.

- test_workers_scale_and_serve_on_the_private_network: the workers alone, scaled to two each: each
  replica its own address, the service name resolving to all, each serving its RPC on the internal
  network (and nothing published on the host).
- test_register_variant_serves_1p1d: compose.yaml + compose.register.yaml (workers register with the
  head; what tandem does without `discovery:`).
- test_default_deployment_serves / test_scale: the default compose.yaml (DNS discovery) and
  `--scale`. They need `deployment.discovery` in tandem and fail at once, saying so, where it is missing.
"""

import time

import openai

from conftest import CPU_IMAGE, MODEL_FILE, run

MODEL = MODEL_FILE.removesuffix(".gguf")


def chat(d, stream=False):
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert r.choices[0].message.content.strip(), r
        assert r.choices[0].finish_reason in ("stop", "length"), r
        assert r.usage.completion_tokens > 0
        return r.choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.strip() and finish in ("stop", "length"), (text, finish)
    return text


def probe_from_network(d, url):
    """`tandem probe URL` from a throwaway container on the project's internal network, with the cluster
    token as its bearer (the worker's control routes need it)."""
    return run(["docker", "run", "--rm", "--network", d.network("backend"), "-e", f"TANDEM_API_KEY={d.token}",
                CPU_IMAGE, "probe", url], check=False, timeout=60)


def resolve(d, name):
    """The IPv4 addresses `name` resolves to on the project's internal network, sorted."""
    out = run(["docker", "run", "--rm", "--network", d.network("backend"), "--entrypoint", "getent", CPU_IMAGE,
               "ahostsv4", name], check=False, timeout=60).stdout
    return sorted({line.split()[0] for line in out.splitlines() if line.strip()})


def test_workers_scale_and_serve_on_the_private_network(deployment):
    """The workers alone, two of each (`--scale`): every replica is its own host on the internal network,
    the service name resolves to all of them (what DNS discovery reads), and each serves its worker RPC."""
    d = deployment(["compose.yaml"], "w")
    d.up("prefill", "decode", scale={"prefill": 2, "decode": 2})
    for role in ("prefill", "decode"):
        containers = d.containers(role)
        assert len(containers) == 2, containers
        ips = sorted(
            run(["docker", "inspect", "--format",
                 "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", c], timeout=30).stdout.strip()
            for c in containers)
        assert len(set(ips)) == 2 and all(ips), ips
        d.wait_for(f"`{role}` resolving to both replicas", lambda: resolve(d, role) == ips, timeout=60, interval=2)
        for ip in ips:
            d.wait_for(f"{role} worker info at {ip}:8100 on the backend network",
                       lambda: probe_from_network(d, f"http://{ip}:8100/v1/worker/info").returncode == 0,
                       timeout=120, interval=2)
    # The containers' own HEALTHCHECK (tandem probe of TANDEM_PROBE_URL, the worker's /health) passes.
    for c in d.containers("prefill") + d.containers("decode"):
        d.wait_for("the worker's HEALTHCHECK",
                   lambda: d.state(c).get("Health", {}).get("Status") == "healthy", timeout=120)
    # Nothing of the workers is published on the host: they are reached on the internal network only.
    ports = run(["docker", "ps", "--format", "{{.Ports}}", "--filter",
                 f"label=com.docker.compose.project={d.project}"], timeout=30).stdout
    assert "->" not in ports, ports


def test_register_variant_serves_1p1d(deployment):
    d = deployment(["compose.yaml", "compose.register.yaml"], "r")
    d.up()
    d.healthy()
    d.wait_for("the external prefill and decode workers registered",
               lambda: len(d.healthy_workers("prefill")) == 1 and len(d.healthy_workers("decode")) == 2,
               timeout=120)
    urls = sorted(w["url"] for w in d.workers())
    assert "http://prefill:8100" in urls and "http://decode:8100" in urls, urls
    kv = [w["info"]["kv_endpoint"] for w in d.healthy_workers("prefill")]
    assert kv == ["prefill:8200"], kv
    chat(d)
    chat(d, stream=True)
    # The prompts were computed by the external prefill worker (the only one).
    d.wait_for("the prefill worker's load showing the prompts",
               lambda: d.healthy_workers("prefill")[0]["load"]["engine"]["prompt_tokens_total"] > 0, timeout=30)


def test_default_deployment_serves(require_dns_discovery, deployment):
    d = deployment(["compose.yaml"], "d")
    d.up()
    d.healthy()
    d.wait_for("one prefill and one decode worker discovered",
               lambda: len(d.healthy_workers("prefill")) == 1 and len(d.healthy_workers("decode")) == 1,
               timeout=120)
    for w in d.workers():
        assert not w["url"].startswith("http://127.") and "0.0.0.0" not in w["url"], w["url"]
    chat(d)
    chat(d, stream=True)


def test_scale(require_dns_discovery, deployment):
    d = deployment(["compose.yaml"], "s")
    d.up(scale={"prefill": 2, "decode": 2})
    d.healthy()
    d.wait_for("2 prefill and 2 decode workers discovered",
               lambda: len(d.healthy_workers("prefill")) == 2 and len(d.healthy_workers("decode")) == 2,
               timeout=120)
    addrs = {w["url"] for w in d.workers()}
    assert len(addrs) == 4, addrs
    names = [w["info"]["worker_id"] for w in d.workers()]
    assert len(set(names)) == 4 and all(n.startswith(("prefill-", "decode-")) for n in names), names
    for _ in range(4):
        chat(d)
    # Scale decode up: the new worker is discovered (and gets traffic) within 30 s.
    t0 = time.monotonic()
    d.up(scale={"prefill": 2, "decode": 3})
    d.wait_for("the third decode worker discovered", lambda: len(d.healthy_workers("decode")) == 3, timeout=60)
    assert time.monotonic() - t0 < 60
    urls = {w["url"] for w in d.healthy_workers("decode")}
    new = (urls - addrs).pop()
    # Decode is picked by the power of two choices: 24 requests all missing one of 3 idle workers is
    # (2/3)^24, under 1e-4.
    for _ in range(24):
        chat(d)
    d.wait_for(f"the new decode worker {new} serving requests",
               lambda: any(w["url"] == new and w["load"]["engine"]["requests_finished_total"] > 0
                           for w in d.workers()), timeout=30)
    # And down again: the removed workers are dropped.
    d.up(scale={"prefill": 1, "decode": 1})
    d.wait_for("back to one worker per role",
               lambda: len(d.healthy_workers("prefill")) == 1 and len(d.healthy_workers("decode")) == 1,
               timeout=60)
    chat(d)
