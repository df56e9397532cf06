#!/usr/bin/env python3
"""Sums ncu's gpu__time_duration per kernel name from `ncu --csv` output (one decode step's kernels)."""
import csv
import sys
from collections import defaultdict


def main():
    total = defaultdict(float)
    count = defaultdict(int)
    with open(sys.argv[1]) as f:
        lines = [l for l in f if l.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0][:60]
        unit = row.get("Metric Unit", "ns")
        v = float(row["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        total[name] += v * scale
        count[name] += 1
    s = sum(total.values())
    print(f"{'kernel':60} {'calls':>6} {'us':>10} {'share':>7}")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{name:60} {count[name]:6d} {us:10.1f} {100 * us / s:6.1f}%")
    print(f"{'total':60} {sum(count.values()):6d} {s:10.1f}")


if __name__ == "__main__":
    main()
