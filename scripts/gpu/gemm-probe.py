#!/usr/bin/env python3
"""Times the 4k-prefill building blocks through PyTorch on the GPU (the peer's kernels): the four
projection GEMMs of a Llama-3.1-8B layer at 4,096 tokens and causal SDPA attention, for comparison
with tandem's per-kernel ncu times. Prints one line per shape: median ms and TFLOP/s."""
import torch
import torch.nn.functional as F


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    t = 4096
    dev = "cuda"
    for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]:
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        ms = bench(lambda: x @ w.t())
        print(f"gemm {name:8} {t}x{n}x{k}: {ms:.3f} ms {2 * t * n * k / ms / 1e9:.0f} TFLOP/s")
    q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)
    kk = torch.randn(1, 8, t, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 8, t, 128, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True))
    flops = 4 * 32 * 128 * t * (t + 1) / 2
    print(f"sdpa causal 32/8 heads x {t}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
