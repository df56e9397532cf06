#!/usr/bin/env python3
"""The peer: HF transformers `generate` on the 8B-shaped Llama or (--shape qwen3-30b-a3b) Qwen3-30B-A3B's
mixture of experts (random bf16 weights made on the GPU), measured the same way as `tandem cuda-bench`
(runs on the GPU machine).

decode tok/s at batch B and context C: (tokens of a 1 + N-token generate minus those of a 1-token
generate) over the time difference, so the prompt's prefill is not counted. prefill: one forward of
a P-token prompt (logits of the last position only), median of 5.
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def moe_config(layers):
    """Qwen3-30B-A3B: 128 experts of 768 features, top-8 renormalised, 32/4 heads of 128."""
    return Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def config(layers):
    return LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=1, eos_token_id=2,
    )


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["llama3-8b", "qwen3-30b-a3b"], default="llama3-8b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", default="1024,4096", help="prompt lengths, comma-separated; 0: none")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    # Built in bf16 directly: the 30B model would not fit the GPU in fp32 first.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        if a.shape == "llama3-8b":
            model = LlamaForCausalLM(config(a.layers or 32)).eval()
        else:
            model = Qwen3MoeForCausalLM(moe_config(a.layers or 48)).eval()
    print(f"hf model ready in {time.time() - t0:.1f} s", flush=True)
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    # Warm-up.
    model.generate(torch.randint(3, 128000, (1, 16), device="cuda"), max_new_tokens=4, min_new_tokens=4, **gen)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        ids = torch.randint(3, 128000, (b, a.context), device="cuda")
        mask = torch.ones_like(ids)
        try:
            t1, _ = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **gen))
            n = a.new_tokens
            tn, out = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n + 1,
                                                   min_new_tokens=n + 1, **gen))
            assert out.shape[1] == a.context + n + 1
            dt = tn - t1
            rows.append({"what": "decode", "batch": b, "context": a.context, "tokens_per_s": b * n / dt,
                         "median_step_ms": dt / n * 1e3, "peer": "hf-generate"})
        except torch.OutOfMemoryError as e:
            rows.append({"what": "decode", "batch": b, "context": a.context, "error": str(e)[:200]})
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    # "0" (or nothing) asks for no prefill timing, as cuda-bench's --prefill does.
    for p in [int(x) for x in a.prefill.split(",") if x and int(x) > 0]:
        ids = torch.randint(3, 128000, (1, p), device="cuda")
        times = []
        for i in range(6):
            dt, _ = timed(lambda: model(ids, logits_to_keep=1))
            if i:
                times.append(dt)
        times.sort()
        med = times[len(times) // 2]
        rows.append({"what": "prefill", "batch": 1, "context": p, "tokens_per_s": p / med,
                     "median_step_ms": med * 1e3, "peer": "hf-forward"})
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
