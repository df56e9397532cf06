#!/usr/bin/env python3
"""Turns tandem_bench.jsonl and hf_bench.jsonl of one run into the markdown table BENCHMARKS.md keeps."""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    out = sys.argv[1]
    t = load(os.path.join(out, "tandem_bench.jsonl"))
    hf = load(os.path.join(out, "hf_bench.jsonl"))
    peer = {(r["what"], r["batch"], r["context"]): r for r in hf if "tokens_per_s" in r}
    print("| figure | tandem | graphs | logits to host | GEMV | step ms | MBU | TFLOP/s | HF | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in t:
        p = peer.get((r["what"], r["batch"], r["context"]))
        name = f"{r['what']} batch {r['batch']} ctx {r['context']}" if r["what"] == "decode" else f"prefill {r['context']} tokens"
        mbu = f"{100 * r['mbu']:.1f}%" if r.get("mbu") is not None else ""
        tf = f"{r['tflops']:.0f}" if r.get("tflops") is not None else ""
        hf_v = f"{p['tokens_per_s']:.1f}" if p else ""
        ratio = f"{r['tokens_per_s'] / p['tokens_per_s']:.1f}x" if p else ""
        print(f"| {name}, tok/s | {r['tokens_per_s']:.1f} | {r['graphs']} | {r['logits_to_host']} | {r.get('gemv', '')} | "
              f"{r['median_step_ms']:.2f} | {mbu} | {tf} | {hf_v} | {ratio} |")
    chk = os.path.join(out, "check.json")
    if os.path.exists(chk):
        with open(chk) as f:
            c = json.load(f)
        print()
        for name, v in c["checks"].items():
            brief = {k: (round(x, 5) if isinstance(x, float) else x) for k, x in v.items()
                     if k not in ("detail", "tandem", "hf", "text")}
            print(f"- {name}: {json.dumps(brief)}")


if __name__ == "__main__":
    main()
