#!/usr/bin/env python3
"""Many concurrent streaming clients against a P/D deployment, a share of them hanging up at random
points; then checks that the deployment let go of everything (issue 16's "load with disconnects").

It starts `tandem serve --config examples/pd.yaml` on a free loopback port (or uses --url), runs
--clients streaming chat completions at once, each with a random prompt over a shared prefix and a
random max_tokens; --drop of them close their connection at a random point (before the headers, or
after some chunks). Afterwards every worker must report zero running, waiting, in-flight and pinned,
no KV block in use (cached prefixes aside), and the survivors' streams must all have ended with a
finish_reason and [DONE], with no error event. It runs --rounds rounds: the first ones touch the KV
pools' pages (resident memory grows by up to the pools' size as new blocks are first written), so the
processes' resident memory after the last round must be within 10% (+32 MiB) of that after the one before. Throughout, the head's worker listing is
sampled twice a second: a worker marked unhealthy while the machine is saturated fails the run (the
ingress must not drop live workers because a poll was slow). The listing needs the cluster token: the
script hands the head it starts TANDEM_CLUSTER_TOKEN (its own, or a random one) and sends it as the bearer;
with --url, set TANDEM_CLUSTER_TOKEN to the deployment's. It prints one JSON line of figures and exits 1
when a check fails.

    scripts/load_disconnects.py --clients 1000 --drop 0.33      # the recorded run (docs/reliability.md)
"""

import argparse
import asyncio
import json
import os
import pathlib
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]


# The cluster token the head's worker listing asks for (given to the head this script starts).
CLUSTER_TOKEN = os.environ.get("TANDEM_CLUSTER_TOKEN") or secrets.token_hex(32)
CLUSTER_HEADERS = {"authorization": f"Bearer {CLUSTER_TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The process and all its children, grandchildren... (the P/D workers are the head's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


async def one_client(client, url, model, rng, drop, stats):
    prompt = "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": rng.randint(4, stats["max_tokens"]),
        "stream": True,
    }
    dropping = rng.random() < drop
    cut_after = rng.randint(0, 12)
    if dropping and rng.random() < 0.2:
        task = asyncio.ensure_future(client.post(url, json=body))
        await asyncio.sleep(rng.random() * 0.5)
        task.cancel()
        stats["dropped"] += 1
        return
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                stats["refused"][str(resp.status_code)] = stats["refused"].get(str(resp.status_code), 0) + 1
                return
            chunks, finish, done = 0, None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    stats["errors"].append(event["error"].get("message", str(event)))
                    return
                chunks += 1
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if dropping and chunks >= cut_after:
                    stats["dropped"] += 1
                    return
            stats["tokens"] += chunks
            if done and finish:
                stats["completed"] += 1
            else:
                stats["errors"].append(f"stream ended without finish/[DONE] after {chunks} chunks")
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")


async def settled(client, base, timeout):
    """Polls the workers until they hold nothing; returns (ok, last listing)."""
    deadline = time.monotonic() + timeout
    workers = []
    while time.monotonic() < deadline:
        workers = (await client.get(f"{base}/v1/cluster/workers", headers=CLUSTER_HEADERS)).json()
        busy = [
            w for w in workers
            if w["load"]["engine"]["running"] or w["load"]["engine"]["waiting"]
            or w["load"]["engine"]["kv_blocks_used"] or w["load"]["pinned_blocks"]
            or w["load"]["pinned_transfers"] or w["load"]["in_flight"]
        ]
        if workers and not busy:
            return True, workers
        await asyncio.sleep(0.5)
    return False, workers


async def run(base, model, clients, drop, max_tokens, seed, pids, rounds):
    rng = random.Random(seed)
    stats = {"clients": clients, "rounds": rounds, "drop": drop, "max_tokens": max_tokens, "completed": 0, "dropped": 0,
             "tokens": 0, "refused": {}, "errors": [], "workers_seen_unhealthy": 0,
             "fewest_workers_listed": 1 << 30}
    limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        await client.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2})
        ok, _ = await settled(client, base, 30)
        stats["rss_baseline_mib"] = round(rss_mib(pids), 1)
        peak = stats["rss_baseline_mib"]

        async def sample():
            nonlocal peak
            while True:
                peak = max(peak, rss_mib(pids))
                try:
                    listing = (await client.get(f"{base}/v1/cluster/workers", headers=CLUSTER_HEADERS,
                                                timeout=10)).json()
                    stats["workers_seen_unhealthy"] += sum(1 for w in listing if not w["healthy"])
                    stats["fewest_workers_listed"] = min(stats["fewest_workers_listed"], len(listing))
                except (httpx.HTTPError, ValueError) as e:
                    stats["errors"].append(f"listing workers: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)

        sampler = asyncio.ensure_future(sample())
        url = f"{base}/v1/chat/completions"
        stats["rss_after_round_mib"], stats["seconds"], ok = [], [], True
        for _ in range(rounds):
            start = time.monotonic()
            await asyncio.gather(*(one_client(client, url, model, random.Random(rng.random()), drop, stats)
                                   for _ in range(clients)))
            stats["seconds"].append(round(time.monotonic() - start, 1))
            idle, workers = await settled(client, base, 120)
            ok = ok and idle
            stats["rss_after_round_mib"].append(round(rss_mib(pids), 1))
        sampler.cancel()
        stats["rss_peak_mib"] = round(peak, 1)
        stats["workers_idle"] = ok
        stats["workers"] = [
            {k: w["load"]["engine"][k] for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_cached")}
            | {"role": w["info"]["role"], "pinned_blocks": w["load"]["pinned_blocks"],
               "in_flight": w["load"]["in_flight"]}
            for w in workers
        ]
    return stats


SYSTEM = "You are a concise assistant. Answer in one short paragraph."
WORDS = ("rivers mountains tea history compilers bridges music stars bread rain cities gardens "
         "trains clocks paper glass birds maps salt copper").split()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--drop", type=float, default=0.33, help="share of clients that hang up")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3,
                    help="early rounds also touch the KV pools' pages; the last must not grow memory")
    ap.add_argument("--bin", default=os.environ.get("TANDEM_BIN", str(ROOT / "target/release/tandem")))
    ap.add_argument("--config", default=str(ROOT / "examples/pd.yaml"))
    ap.add_argument("--url", help="use a running deployment instead of starting one (RSS is then not measured)")
    args = ap.parse_args()

    proc, log = None, None
    if args.url:
        base, pids = args.url.rstrip("/"), []
    else:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="tandem-load-", suffix=".log", delete=False)
        proc = subprocess.Popen([args.bin, "serve", "--config", args.config, "--port", str(port),
                                 "--served-model-name", "load"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TANDEM_CLUSTER_TOKEN": CLUSTER_TOKEN})
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"tandem did not start; log: {log.name}")
            time.sleep(0.5)
        pids = descendants(proc.pid)
    model = "load" if proc else httpx.get(base + "/v1/models").json()["data"][0]["id"]
    try:
        stats = asyncio.run(run(base, model, args.clients, args.drop, args.max_tokens, args.seed, pids, args.rounds))
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
    stats["errors_total"] = len(stats["errors"])
    stats["errors"] = stats["errors"][:5]
    if log:
        stats["log"] = log.name
    print(json.dumps(stats))
    after = stats["rss_after_round_mib"]
    stats["rss_growth_last_round_mib"] = round(after[-1] - after[-2], 1) if pids and len(after) > 1 else None
    grew = bool(pids) and len(after) > 1 and after[-1] > after[-2] * 1.1 + 32
    # Overload must never cost a live worker its place: the head marks one unhealthy only after
    # consecutive failed polls, and a busy worker still answers them.
    failed = (stats["errors_total"] or not stats["workers_idle"] or stats["refused"] or grew
              or stats["workers_seen_unhealthy"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
