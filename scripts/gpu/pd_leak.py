#!/usr/bin/env python3
"""Nothing leaks across many P/D requests, a tenth of them abandoned mid-flight.

Against a running P/D `tandem serve` (any transport; on the GPU: `nixl` with device staging), sends
--requests streaming completions of --prompt-len token ids at --concurrency; every --abort-every'th client
hangs up after a random delay of up to --abort-ms (during prefill, the KV transfer or the first tokens).
Before and after (once every worker is idle again) it records each worker's load — KV blocks referenced,
running, waiting, pinned blocks and transfers, staging bytes free — and, where nvidia-smi exists, the GPU
memory each worker process holds. It passes when every one of them is back where it was.

usage: pd_leak.py [--base-url URL] [--requests N] [--concurrency C] [--out FILE.json]
The worker listing and loads need the deployment's cluster token: set TANDEM_CLUSTER_TOKEN.
Standard library only (runs on the GPU machine's python3).
"""
import argparse, http.client, json, os, random, shutil, subprocess, sys, threading, time, urllib.request

p = argparse.ArgumentParser()
p.add_argument("--base-url", default="http://127.0.0.1:8000")
p.add_argument("--requests", type=int, default=1000)
p.add_argument("--concurrency", type=int, default=32)
p.add_argument("--abort-every", type=int, default=10)
p.add_argument("--abort-ms", type=float, default=200.0)
p.add_argument("--prompt-len", type=int, default=1024)
p.add_argument("--max-tokens", type=int, default=16)
p.add_argument("--settle-s", type=float, default=60.0)
p.add_argument("--warmup", type=int, default=64, help="requests before the first snapshot (lazy allocations)")
p.add_argument("--out", default=None)
a = p.parse_args()
host = a.base_url.split("://", 1)[1].rstrip("/")


def get(url):
    token = os.environ.get("TANDEM_CLUSTER_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return json.load(urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30))


def snapshot():
    """Per worker: what must come back to its idle value."""
    out = {}
    for w in get(a.base_url + "/v1/cluster/workers"):
        load = get(w["url"] + "/v1/worker/load")
        e = load["engine"]
        out[w["info"]["worker_id"]] = {
            "pid": w["info"].get("pid"),
            "kv_blocks_used": e["kv_blocks_used"],
            "running": e["running"],
            "waiting": e["waiting"],
            "pinned_blocks": load["pinned_blocks"],
            "pinned_transfers": load["pinned_transfers"],
            "in_flight": load["in_flight"],
            "staging_free_bytes": load.get("staging_free_bytes", 0),
            "staging_bytes": load.get("staging_bytes", 0),
        }
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout
        gpu = {int(l.split(",")[0]): int(l.split(",")[1]) for l in q.strip().splitlines() if "," in l}
        for v in out.values():
            v["gpu_mib"] = gpu.get(v["pid"])
    return out


def idle(s):
    return all(v["running"] == 0 and v["waiting"] == 0 and v["in_flight"] == 0 and v["pinned_transfers"] == 0
               for v in s.values())


model = get(a.base_url + "/v1/models")["data"][0]["id"]
counts = {"ok": 0, "aborted": 0, "failed": 0}
errors = []
lock = threading.Lock()


def one(i):
    rng = random.Random(i)
    prompt = [rng.randrange(10, 30000) for _ in range(a.prompt_len)]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    abort = i % a.abort_every == a.abort_every - 1
    c = http.client.HTTPConnection(host, timeout=120)
    try:
        c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        if abort:
            time.sleep(rng.uniform(0, a.abort_ms) / 1000)
            c.sock.close()
            return "aborted"
        r = c.getresponse()
        data = r.read().decode(errors="replace")
        if r.status != 200 or "[DONE]" not in data:
            with lock:
                errors.append(f"{r.status}: {data[:200]}")
            return "failed"
        return "ok"
    except Exception as e:  # noqa: BLE001 - counted and reported
        with lock:
            errors.append(repr(e))
        return "failed"
    finally:
        c.close()


def worker():
    while True:
        with lock:
            i = next(next_i, None)
        if i is None:
            return
        k = one(i)
        with lock:
            counts[k] += 1


def run(ids):
    global next_i
    next_i = iter(ids)
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def settled():
    deadline = time.time() + a.settle_s
    s = snapshot()
    while not idle(s) and time.time() < deadline:
        time.sleep(1)
        s = snapshot()
    time.sleep(2)  # GPU frees of the last transfers
    return snapshot()


# Warm up with requests that are never aborted (ids whose abort slot is not hit: negative ids), so
# allocations made once (batch buffers, graphs) happen before the first snapshot.
run(range(-a.warmup * a.abort_every, 0, a.abort_every))
counts.update(ok=0, aborted=0, failed=0)
before = settled()
t0 = time.time()
run(range(a.requests))
elapsed = time.time() - t0
after = settled()

diffs = []
for wid, b in before.items():
    aft = after.get(wid)
    if aft is None:
        diffs.append(f"{wid}: gone")
        continue
    for k in ("kv_blocks_used", "running", "waiting", "pinned_blocks", "pinned_transfers", "in_flight",
              "staging_free_bytes", "gpu_mib"):
        if b.get(k) != aft.get(k):
            diffs.append(f"{wid}: {k} {b.get(k)} -> {aft.get(k)}")
result = {"requests": a.requests, "concurrency": a.concurrency, "elapsed_s": round(elapsed, 1), **counts,
          "before": before, "after": after, "differences": diffs, "errors": errors[:10],
          "pass": not diffs and counts["failed"] == 0}
if a.out:
    json.dump(result, open(a.out, "w"), indent=1)
print(json.dumps({k: result[k] for k in ("requests", "elapsed_s", "ok", "aborted", "failed", "differences", "pass")}))
print("PASS" if result["pass"] else "FAIL", "no leak after", a.requests, "P/D requests,", counts["aborted"], "abandoned")
sys.exit(0 if result["pass"] else 1)
