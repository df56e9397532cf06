#!/usr/bin/env python3
"""Writes crates/tandem-model/tests/fixtures/smollm2_tokenizer.json: token ids that the Python
`tokenizers` package produces for tricky strings, using a tokenizer built from the vocabulary and merges
inside the SmolLM2 GGUF exactly as SmolLM2's HF tokenizer.json is configured (Digits(individual_digits)
+ ByteLevel(add_prefix_space=False) pre-tokenizer, ByteLevel decoder, control tokens as special tokens).

Usage: python3 scripts/gen_gguf_tokenizer_fixture.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]
Needs: pip install gguf tokenizers
"""
import json
import os
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
reader = gguf.GGUFReader(path)


def field(name):
    return reader.fields[name].contents()


tokens = field("tokenizer.ggml.tokens")
types = field("tokenizer.ggml.token_type")
merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
vocab = {}
for i, t in enumerate(tokens):
    vocab.setdefault(t, i)

tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
tk.pre_tokenizer = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
)
tk.decoder = decoders.ByteLevel()
tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])

texts = [
    "Hello, world!",
    "What is the capital of France?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "multiple   spaces\tand\ttabs  \n\n\nnewlines",
    "unicode: naïve café, Ελληνικά, 日本語のテキスト, Привет",
    "emoji: 🦀🚀👩‍👩‍👧 ok",
    "numbers 1234567 and 3.14159",
    "code: fn main() { println!(\"{}\", x[0]); }",
    "  leading and trailing  ",
    "I'm sure they've done what we'd do",
]
cases = [{"text": t, "ids": tk.encode(t, add_special_tokens=False).ids} for t in texts]
out = os.path.join(ROOT, "crates", "tandem-model", "tests", "fixtures", "smollm2_tokenizer.json")
with open(out, "w", encoding="utf-8") as f:
    json.dump({"source": os.path.basename(path), "cases": cases}, f, ensure_ascii=False, indent=1)
    f.write("\n")
print("wrote", out, len(cases), "cases")
