#!/usr/bin/env python3
"""Greedy (temperature 0) continuations of one GGUF by llama.cpp and by a running tandem server, compared.

For each prompt, llama.cpp (llama-cpp-python from the venv of scripts/peers/llamacpp-venv.sh, f32 KV cache)
tokenizes it, decodes greedily one token per step, and the same token ids go to tandem's /v1/completions
(temperature 0, logprobs 2). It prints where the two texts first differ, llama.cpp's top-1 margin there
(a near-tie when small), the largest |Δ logprob| of the chosen tokens before that point, and, for scale,
llama.cpp against itself: the same tokens teacher-forced in one batch instead of one token per step (its
batched kernels round differently), the largest |Δ logprob| of those tokens and how many argmaxes flip.

Usage: greedy-vs-llamacpp.py --model models/gemma-3-270m-q4_k_m.gguf --url http://127.0.0.1:8000 [--tokens 64]
Run it with the llama-cpp-python venv's python; tandem must serve the same file (`tandem serve MODEL`).
"""

import argparse
import json
import os
import sys
import urllib.request

import numpy as np

# The llama.cpp session of the reference scripts (scripts/fixtures/llamacpp_reference.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from llamacpp_reference import reference_llama  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built simple wooden machines that riders pushed along the road with their feet.",
    "A key-value cache stores the attention keys and values of every token a transformer has already "
    "processed. During decoding,",
]


def log_softmax(row):
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with urllib.request.urlopen(args.url + "/v1/models", timeout=30) as r:
        served = json.load(r)["data"][0]["id"]
    llm = reference_llama(args.model, 1024, args.threads)
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        tandem_ids = post(args.url + "/tokenize", {"prompt": text})["tokens"]
        llm.reset()
        llm.eval(ids)
        rows = [np.array(llm.scores[len(ids) - 1], dtype=np.float64)]
        toks = []
        for _ in range(args.tokens):
            toks.append(int(np.argmax(rows[-1])))
            llm.eval([toks[-1]])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
        lps = [log_softmax(r) for r in rows[:-1]]
        chosen = [float(lp[t]) for lp, t in zip(lps, toks)]
        margins = [float(lp[t] - np.sort(lp)[-2]) for lp, t in zip(lps, toks)]
        pieces = [llm.detokenize([t], special=True).decode("utf-8", "replace") for t in toks]
        # llama.cpp against itself: the same tokens in one batch.
        llm.reset()
        llm.eval(ids + toks)
        batch = [log_softmax(np.array(llm.scores[len(ids) - 1 + i], dtype=np.float64)) for i in range(len(toks))]
        self_dlp = max(abs(b[t] - c) for b, t, c in zip(batch, toks, chosen))
        self_flips = sum(int(np.argmax(b)) != t for b, t in zip(batch, toks))
        body = {"model": served, "prompt": ids, "max_tokens": args.tokens, "temperature": 0, "logprobs": 2}
        choice = post(args.url + "/v1/completions", body)["choices"][0]
        got, got_lp = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        div = next((i for i, (a, b) in enumerate(zip(pieces, got)) if a != b), None)
        if div is None and len(got) != len(pieces):
            div = min(len(got), len(pieces))
        upto = len(got) if div is None else div
        dlp = max((abs(a - b) for a, b in zip(chosen[:upto], got_lp)), default=0.0)
        print(
            json.dumps(
                {
                    "prompt": text[:48],
                    "prompt_tokens": len(ids),
                    "same_tokenization": tandem_ids == ids,
                    "first_difference_at": div,
                    "llamacpp_margin_there": None if div is None or div >= len(margins) else round(margins[div], 4),
                    "llamacpp_token_there": None if div is None or div >= len(pieces) else pieces[div],
                    "tandem_top2_there": None
                    if div is None or div >= len(got)
                    else choice["logprobs"]["top_logprobs"][div],
                    "max_abs_dlogprob_before": round(dlp, 4),
                    "llamacpp_self_max_abs_dlogprob": round(float(self_dlp), 4),
                    "llamacpp_self_argmax_flips": self_flips,
                    "llamacpp": "".join(pieces),
                    "tandem": choice["text"],
                },
                ensure_ascii=False,
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
