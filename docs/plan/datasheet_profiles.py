#!/usr/bin/env python3
"""Writes the datasheet profiles that `tandem plan` compares against DistServe's and Splitwise's
published configurations (docs/plan/profiles/*.json). Nothing here was measured: every figure is a
datasheet number or a stated assumption, and the profiles say `source: datasheet`.

Step-time model of one device holding the whole model (the profile's own TP1 curves; the profile's
`scaling` section derives TP/PP layouts from them, see crates/tandem-sim/src/layout.rs):
  prefill step of x tokens: max(weights / (0.8 x HBM bandwidth), 2 x params x x / (0.6 x peak FLOP/s))
  decode step of b sequences: weights / (0.8 x HBM) + 2 x params x b / (0.6 x peak)
  attention: prefill 4 x hidden x layers FLOPs, decode one KV read (kv bytes per token), per cached position.
Memory: 90% of each device for the engine, the rest of it after the weights for KV.
Pipeline hops use tandem's stage link (host memory and TCP, not NVLink): 5 GB/s, 100 us a hop.
"""
import json
import os

GPUS = {
    # Datasheets: A100 SXM4 80GB (312 TFLOP/s dense fp16, 2.039 TB/s, NVLink 600 GB/s both ways);
    # H100 SXM5 80GB (989 TFLOP/s dense bf16, 3.35 TB/s, NVLink 900 GB/s both ways).
    "a100": {"name": "NVIDIA A100-SXM4-80GB (datasheet)", "flops": 312e12, "hbm": 2.039e12,
             "nvlink_one_way": 300e9, "memory": 80e9},
    "h100": {"name": "NVIDIA H100-SXM5-80GB (datasheet)", "flops": 989e12, "hbm": 3.35e12,
             "nvlink_one_way": 450e9, "memory": 80e9},
}

MODELS = {
    # name: (params, hidden, layers, kv bytes per token (fp16 K and V over all layers))
    "opt-13b": (13e9, 5120, 40, 2 * 40 * 5120 * 2),
    "opt-66b": (66e9, 9216, 64, 2 * 64 * 9216 * 2),
    "opt-175b": (175e9, 12288, 96, 2 * 96 * 12288 * 2),
    # Llama 2 70B: grouped-query attention, 8 KV heads of 128.
    "llama2-70b": (70e9, 8192, 80, 2 * 80 * 8 * 128 * 2),
}

MFU = 0.6
MBU = 0.8


def profile(gpu_key, model_key, max_num_seqs, max_num_batched_tokens, transfer):
    g = GPUS[gpu_key]
    params, hidden, layers, kv = MODELS[model_key]
    weights = 2 * params
    flops = MFU * g["flops"]
    hbm = MBU * g["hbm"]
    prefill = [[x, max(weights / hbm, 2 * params * x / flops)]
               for x in [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
               if x <= max(max_num_batched_tokens, 16)]
    decode = [[b, weights / hbm + 2 * params * b / flops]
              for b in [1, 8, 32, 64, 128, 256, 512, 1024] if b <= max_num_seqs]
    return {
        "source": "datasheet",
        "hardware": {"name": g["name"], "device": "cuda", "devices_per_worker": 1},
        "model": {"name": model_key},
        "block_size": 16,
        # Sized per layout from the memory figures below (scaling); this one is not used.
        "kv_blocks": 1,
        "kv_bytes_per_token": float(kv),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "decode": {"points": decode, "per_context_s": kv / hbm},
        "prefill": {"points": prefill, "per_context_s": 4 * hidden * layers / flops},
        "transfer": transfer,
        "overheads": {"request_s": 0.002, "rpc_s": 0.0005},
        "startup_s": 120.0,
        "scaling": {
            "tp": [2, 4, 8],
            "pp": [2, 4, 8],
            "hidden_size": hidden,
            "layers": layers,
            "activation_bytes": 2.0,
            # A ring all-reduce's bus bandwidth: 80% of one direction of the NVLink figure.
            "allreduce_bytes_per_s": 0.8 * g["nvlink_one_way"],
            "allreduce_latency_s": 1e-5,
            "stage_bytes_per_s": 5e9,
            "stage_latency_s": 1e-4,
            "device_memory_bytes": 0.9 * g["memory"],
            "weight_bytes": weights,
        },
    }


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
    os.makedirs(out, exist_ok=True)
    # DistServe's testbed: 8 A100-80GB per node over NVLink, nodes over 25 Gbit/s. Prefill and decode
    # of one model sit in one node, so KV moves over NVLink ("nvlink"); "tcp" is the 25 Gbit/s link.
    a100_transfer = [
        {"transport": "nvlink", "bytes_per_s": 0.8 * GPUS["a100"]["nvlink_one_way"], "latency_s": 1e-4},
        {"transport": "tcp", "bytes_per_s": 25e9 / 8, "latency_s": 5e-4},
    ]
    # Splitwise: DGX-H100 machines, KV between machines over InfiniBand (8 x 400 Gbit/s per machine).
    h100_transfer = [
        {"transport": "ib", "bytes_per_s": 8 * 400e9 / 8 * 0.8, "latency_s": 1e-4},
        {"transport": "tcp", "bytes_per_s": 25e9 / 8, "latency_s": 5e-4},
    ]
    for model in ["opt-13b", "opt-66b", "opt-175b"]:
        p = profile("a100", model, 256, 2048, a100_transfer)
        with open(os.path.join(out, f"distserve-{model}-a100.json"), "w") as f:
            json.dump(p, f, indent=2)
            f.write("\n")
    p = profile("h100", "llama2-70b", 256, 2048, h100_transfer)
    with open(os.path.join(out, "splitwise-llama2-70b-h100.json"), "w") as f:
        json.dump(p, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
