#!/usr/bin/env python3
"""Turns pd_bench.sh's pd_bench.jsonl into the colocated-vs-1P1D table of issue 14's targets, and the
guided-vs-unguided table of its `guided` part when it ran."""
import json
import sys

rows = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        r = json.loads(line)
        rows[r["label"]] = r["summary"]


def get(label, *path):
    v = rows.get(label)
    for p in path:
        if v is None:
            return None
        v = v.get(p)
    return v


def fmt(v, unit=""):
    return "-" if v is None else f"{v:,.1f}{unit}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


lines = ["| measure | colocated | 1P1D | 1P1D / colocated | target |", "|---|---|---|---|---|"]
for name, kind, path, target in [
    ("TTFT p50, c1, 1,024 tokens (ms)", "ttft-1k", ("ttft_ms", "median"), "<= 1.15x"),
    ("TTFT p50, c1, 4,096 tokens (ms)", "ttft-4k", ("ttft_ms", "median"), "<= 1.15x"),
    ("output tok/s, c64", "c64", ("output_throughput",), ">= 0.8x"),
    ("output tok/s, c256", "c256", ("output_throughput",), ""),
    ("failed requests, c256", "c256", ("failed",), "0"),
    ("bursty ITL p99 (ms)", "bursty", ("itl_ms", "p99"), "<= 0.5x"),
    ("bursty TTFT p50 (ms)", "bursty", ("ttft_ms", "median"), "<= 1.5x"),
]:
    c, p = get("colocated-" + kind, *path), get("pd-" + kind, *path)
    lines.append(f"| {name} | {fmt(c)} | {fmt(p)} | {ratio(p, c)} | {target} |")
print("\n".join(lines))

if any(label.startswith("guided-") for label in rows):
    print()
    print("| concurrency | unguided output tok/s | guided output tok/s | guided / unguided | failed (guided) |")
    print("|---|---|---|---|---|")
    for c in (1, 64):
        u, g = get(f"unguided-c{c}", "output_throughput"), get(f"guided-c{c}", "output_throughput")
        print(f"| {c} | {fmt(u)} | {fmt(g)} | {ratio(g, u)} | {fmt(get(f'guided-c{c}', 'failed'))} |")
