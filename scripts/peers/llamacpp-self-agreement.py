#!/usr/bin/env python3
"""How often llama.cpp agrees with ITSELF on the teacher-forced top-1 tokens of tests/fixtures/llamacpp.

The fixture (scripts/fixtures/llamacpp-ref.py) records llama.cpp's argmax at every prompt position, computed over the
whole prompt in one batch with an f32 KV cache. This script asks llama.cpp's own llama-server (the same
llama.cpp source, built by scripts/peers/build-llama-server.sh) for the same positions another way: one request per
prefix, n_predict=1, so every position is computed as a 1-token decode step over the cached prefix. It does so
for several KV cache configurations and prints each one's top-1 agreement with the fixture, how far apart
(under the fixture's own distribution) the disagreeing tokens are, and the agreement between configurations.

What this measures is the floor of the llamacpp_reference test's top-1 check: two correct runs of llama.cpp
that differ only in batch shape or KV precision already disagree at that rate, every time on a near-tie.

Usage: scripts/peers/llamacpp-self-agreement.py [--server PATH] [--configs NAME=ARGS ...]
Needs models/SmolLM2-135M-Instruct.Q4_1.gguf and a llama-server binary; talks to it over loopback only.
Takes about 3-4 minutes per configuration on 2 cores.
"""

import argparse
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# llama.cpp's KV cache in the fixture (f32, no flash attention) and llama.cpp's defaults (f16 K and V,
# flash attention chosen automatically).
DEFAULT_CONFIGS = ["f32=-ctk f32 -ctv f32 -fa off", "f16-default=", "f16-fa-off=-fa off"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def server_top1(server, model, threads, extra, prompts):
    """Top-1 token at every position of every prompt, one cached-prefix request per position."""
    port = free_port()
    args = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-c", "1024", "-np", "1", *extra]
    # llama.cpp's AMX matmul crashes in this sandbox's kernel; --no-repack avoids the buffer type it runs in.
    with open("/proc/cpuinfo") as f:
        if " amx_tile" in f.read():
            args.append("--no-repack")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    sys.exit(f"llama-server did not start ({' '.join(args)})")
                time.sleep(0.5)
        top = []
        for ids in prompts:
            for n in range(1, len(ids) + 1):
                j = post(port, {"prompt": ids[:n], "n_predict": 1, "n_probs": 1, "temperature": 0,
                                "cache_prompt": True, "post_sampling_probs": False})
                top.append(j["completion_probabilities"][0]["top_logprobs"][0]["id"])
        return top
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default=os.path.join(ROOT, ".cache", "llama.cpp", "bin", "llama-server"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--fixture", default=os.path.join(ROOT, "tests", "fixtures", "llamacpp"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                    help="NAME=llama-server arguments, e.g. 'q8=-ctk q8_0 -ctv q8_0'")
    args = ap.parse_args()

    meta = json.load(open(os.path.join(args.fixture, "ref.json")))
    prompts = [p["token_ids"] for p in meta["prompts"]]
    fixture = [t for p in meta["prompts"] for t in p["argmax"]]
    k = meta["topk"]
    raw = open(os.path.join(args.fixture, meta["topk_file"]), "rb").read()
    fixture_lp = []
    for i in range(len(fixture)):
        rec = raw[i * k * 8:(i + 1) * k * 8]
        fixture_lp.append(dict(zip(struct.unpack(f"<{k}I", rec[:k * 4]), struct.unpack(f"<{k}f", rec[k * 4:]))))

    total = len(fixture)
    runs = {"fixture": fixture}
    for spec in args.configs:
        name, _, extra = spec.partition("=")
        t0 = time.time()
        top = server_top1(args.server, args.model, args.threads, shlex.split(extra), prompts)
        runs[name] = top
        # Gap: the fixture's log-probability of its own top token minus that of this run's top token.
        gaps = sorted(lp[f] - lp.get(t, float("inf")) for t, f, lp in zip(top, fixture, fixture_lp) if t != f)
        agree = total - len(gaps)
        print(f"{name:<14} ({extra or 'llama.cpp defaults'}): top-1 agreement with the fixture "
              f"{agree}/{total} = {100 * agree / total:.2f}%; disagreement gaps (nats) median "
              f"{gaps[len(gaps) // 2] if gaps else 0:.3f} max {gaps[-1] if gaps else 0:.3f} "
              f"[{time.time() - t0:.0f} s]", flush=True)
    names = list(runs)
    print("\npairwise top-1 agreement (positions out of %d)" % total)
    print(" " * 14 + "".join(f"{n:>14}" for n in names))
    for a in names:
        print(f"{a:<14}" + "".join(f"{sum(x == y for x, y in zip(runs[a], runs[b])):>14}" for b in names))


if __name__ == "__main__":
    main()
