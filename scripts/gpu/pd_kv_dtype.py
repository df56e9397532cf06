#!/usr/bin/env python3
"""One 4,096-token prompt through 1P1D on this one GPU (two worker processes, KV over TCP) with a bf16 and
then an FP8 KV cache (`cuda.kv_cache_dtype`), and the same prompt colocated with each: prints, per KV dtype,
the KV bytes the decode worker pulled (tandem:kv_transfer_bytes_total) and whether the 1P1D completion
equals the colocated one (greedy). Writes the rows as JSON to --out.

  python3 scripts/gpu/pd_kv_dtype.py --bin out/tandem --model models/SmolLM2-135M-Instruct.Q4_1.gguf --out pd_kv.json
"""
import argparse
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(bin_, cfg, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen([bin_, "serve", "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def wait_healthy(base, proc, timeout=240):
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def complete(base, ids, n):
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        name = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": name, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return out["choices"][0]["text"], out["usage"]["prompt_tokens"], time.time() - t


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        page = r.read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", page, re.M)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    work = tempfile.mkdtemp()
    ids = [1] + [(i * 7919) % 40000 + 1000 for i in range(a.prompt_tokens - 1)]
    rows, ok = [], True
    for dtype in ("bf16", "fp8"):
        texts = {}
        for mode in ("pd", "colocated"):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            cfg = os.path.join(work, f"{mode}-{dtype}.yaml")
            deploy = ("deployment:\n  mode: pd\n  prefill: {replicas: 1}\n  decode: {replicas: 1}\n"
                      "  kv_transfer: {transport: tcp}\n  routing: {local_prefill_threshold: 4}\n"
                      if mode == "pd" else "deployment: {mode: colocated}\n")
            with open(cfg, "w") as f:
                f.write(f"model: {a.model}\nserver: {{host: 127.0.0.1, port: {port}}}\n"
                        "engine: {device: cuda, block_size: 16, kv_cache_memory: 1GiB, max_model_len: 8192}\n"
                        f"cuda: {{kv_cache_dtype: {dtype}}}\n" + deploy)
            proc, log = serve(a.bin, cfg, os.path.join(work, f"{mode}-{dtype}.log"))
            try:
                wait_healthy(base, proc)
                text, n_prompt, secs = complete(base, ids, a.max_tokens)
                texts[mode] = text
                row = {"kv_cache_dtype": dtype, "mode": mode, "prompt_tokens": n_prompt, "seconds": round(secs, 3),
                       "text": text}
                if mode == "pd":
                    row["kv_bytes_pulled"] = metric(base, "tandem:kv_transfer_bytes_total")
                    row["remote_prefills"] = metric(base, 'tandem:pd_requests_total{prefill="remote"}')
                rows.append(row)
                print(json.dumps(row), flush=True)
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"FAIL {dtype} {mode}: {e}; log tail:", flush=True)
                log.flush()
                print("".join(open(log.name).readlines()[-15:]), flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
        same = texts.get("pd") is not None and texts.get("pd") == texts.get("colocated")
        ok &= same
        print(f"{'PASS' if same else 'FAIL'} {dtype}: 1P1D greedy equals colocated", flush=True)
    pulled = {r["kv_cache_dtype"]: r.get("kv_bytes_pulled") for r in rows if r["mode"] == "pd"}
    if pulled.get("bf16") and pulled.get("fp8"):
        ratio = pulled["fp8"] / pulled["bf16"]
        print(f"KV bytes pulled: fp8 {pulled['fp8']:.0f} / bf16 {pulled['bf16']:.0f} = {ratio:.3f}", flush=True)
        ok &= abs(ratio - 0.5) < 0.01
    else:
        ok = False
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "pass": ok}, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
