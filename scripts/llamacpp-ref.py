#!/usr/bin/env python3
"""Record llama.cpp's outputs on the default GGUF as the reference for tests/llamacpp_reference.rs.

Run through scripts/llamacpp-ref.sh (it builds/reuses the .venv-llamacpp venv). For each prompt (tokenized
by llama.cpp itself) it records, teacher-forced over the whole prompt in one batch:
  * per position: the argmax token, the log-sum-exp of the logits, and the top-K log-probabilities;
  * at a sample of positions: the FULL logits as f16, so that the Rust test computes the exact
    KL(llama.cpp || tandem) there (full logits at every position would be ~70 MB);
and a greedy (argmax) continuation of GREEDY_TOKENS tokens decoded one token at a time.

Files written to tests/fixtures/llamacpp/:
  ref.json      metadata, prompts, continuations, per-position argmax/lse, layout of the binary files
  topk.bin      per position (prompt after prompt): K little-endian u32 token ids, then K f32 logprobs
  full_f16.bin  one row of n_vocab little-endian f16 logits minus their max per sampled position
"""

import argparse
import hashlib
import json
import os
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

TOPK = 64
GREEDY_TOKENS = 32
# Positions with pos % FULL_EVERY == FULL_EVERY - 1, plus each prompt's last position, get full logits.
FULL_EVERY = 16

CHAT_SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

PROMPTS = [
    (
        "prose",
        "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and "
        "France built simple wooden machines that riders pushed along the road with their feet. Pedals attached to the front "
        "wheel came decades later, and the safety bicycle, with two wheels of equal size and a chain driving "
        "the rear wheel, made cycling popular with",
    ),
    (
        "technical",
        "A key-value cache stores the attention keys and values of every token a transformer has already "
        "processed. During decoding, each new token only needs to compute its own query, key and value, and "
        "then attends over the cached entries. Paged attention splits this cache into fixed-size blocks so "
        "that the memory of many concurrent requests",
    ),
    (
        "python",
        "import math\n\n\ndef is_prime(n: int) -> bool:\n    \"\"\"Return True when n is a prime number.\"\"\"\n"
        "    if n < 2:\n        return False\n    for d in range(2, int(math.isqrt(n)) + 1):\n"
        "        if n % d == 0:\n            return False\n    return True\n\n\ndef primes_below(limit):\n",
    ),
    (
        "rust",
        "use std::collections::HashMap;\n\n/// Counts how often each word occurs in `text`.\n"
        "pub fn word_counts(text: &str) -> HashMap<String, usize> {\n    let mut counts = HashMap::new();\n"
        "    for word in text.split_whitespace() {\n        *counts.entry(word.to_lowercase()).or_insert(0) += 1;\n"
        "    }\n    counts\n}\n\nfn main() {\n    let counts = word_counts(\"the cat and the hat\");\n",
    ),
    (
        "chat",
        CHAT_SYS
        + "<|im_start|>user\nWhat are three good habits for staying healthy while working from home? I sit at my "
        "desk most of the day, I often skip lunch, and I rarely go outside. "
        "Please keep the answer short and practical.<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "chat-multi",
        CHAT_SYS
        + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        "The capital of France is Paris.<|im_end|>\n<|im_start|>user\nAnd what river flows through it? "
        "Tell me one fact about it.<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "json",
        '{\n  "name": "tandem",\n  "version": "0.1.0",\n  "description": "LLM serving in Rust",\n'
        '  "workers": [\n    {"role": "prefill", "threads": 2, "port": 8001},\n'
        '    {"role": "decode", "threads": 2, "port": 8002}\n  ],\n  "model": {\n    "path": "models/',
    ),
    (
        "story",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "named Elias. Every morning he opened his shop at seven o'clock, wound every clock on the walls, and "
        "waited for customers. One rainy afternoon, a young girl carrying a broken pocket watch knocked on "
        "the door and asked",
    ),
    (
        "math",
        "Question: A train travels 60 kilometers in the first hour and 80 kilometers in the second hour. "
        "What is its average speed over the two hours?\nAnswer: The total distance is 60 + 80 = 140 "
        "kilometers. The total time is 2 hours. So the average speed is",
    ),
]


def log_softmax(x):
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x.astype(np.float64) - m))))
    return x.astype(np.float64) - lse, lse


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(root, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "llamacpp"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    with open(args.model, "rb") as f:
        model_sha = hashlib.sha256(f.read()).hexdigest()
    llm = Llama(
        model_path=args.model,
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        # f32 KV cache, like tandem's CPU cache: the reference should not carry f16 KV rounding.
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        seed=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    prompts_meta = []
    full_positions = []
    topk_f = open(os.path.join(args.out, "topk.bin"), "wb")
    full_f = open(os.path.join(args.out, "full_f16.bin"), "wb")
    t0 = time.time()
    for pi, (name, text) in enumerate(PROMPTS):
        # add_bos=True lets llama.cpp apply the model's own add_bos_token setting (false for SmolLM2).
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert len(ids) >= 64, (name, len(ids))
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
        argmax, lses = [], []
        for pos in range(len(ids)):
            row = scores[pos]
            lp, lse = log_softmax(row)
            top = np.argsort(-row, kind="stable")[:TOPK]
            topk_f.write(top.astype("<u4").tobytes())
            topk_f.write(lp[top].astype("<f4").tobytes())
            argmax.append(int(top[0]))
            lses.append(lse)
            if pos % FULL_EVERY == FULL_EVERY - 1 or pos == len(ids) - 1:
                # Shifted so the largest is 0: f16 is most precise where the probability mass is.
                full_f.write((row - row.max()).astype("<f2").tobytes())
                full_positions.append([pi, pos])
        # Greedy continuation, one token per decode step as a server would run it.
        greedy = []
        nxt = int(np.argmax(scores[len(ids) - 1]))
        for _ in range(GREEDY_TOKENS):
            greedy.append(nxt)
            llm.eval([nxt])
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prompts_meta.append(
            {
                "name": name,
                "text": text,
                "token_ids": ids,
                "argmax": argmax,
                "lse": [round(x, 5) for x in lses],
                "greedy": greedy,
                "greedy_text": llm.detokenize(greedy, special=True).decode("utf-8", "replace"),
            }
        )
        print(f"{name}: {len(ids)} tokens; greedy: {prompts_meta[-1]['greedy_text']!r}")
    topk_f.close()
    full_f.close()

    ref = {
        "generator": "scripts/llamacpp-ref.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_file": os.path.basename(args.model),
        "model_sha256": model_sha,
        "n_vocab": n_vocab,
        "kv_cache_type": "f32",
        "topk": TOPK,
        "topk_file": "topk.bin",
        "topk_layout": "per position, prompt after prompt: topk u32le token ids, then topk f32le logprobs",
        "full_file": "full_f16.bin",
        "full_layout": "one row of n_vocab f16le (logits - max logit) per entry of full_positions",
        "full_positions": full_positions,
        "greedy_tokens": GREEDY_TOKENS,
        "prompts": prompts_meta,
    }
    with open(os.path.join(args.out, "ref.json"), "w") as f:
        json.dump(ref, f)
        f.write("\n")
    print(f"{len(PROMPTS)} prompts, {len(full_positions)} full-logit positions, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
