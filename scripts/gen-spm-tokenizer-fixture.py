#!/usr/bin/env python3
"""Writes crates/tandem-model/tests/fixtures/spm/: a SentencePiece (Llama 2 style) tokenizer as a GGUF file
of tokenizer metadata only, and the ids that SentencePiece itself gives for tricky strings.

The model is trained here with the options Llama 2's tokenizer uses (BPE, byte fallback, split digits,
dummy prefix, no normalization), then exported the way llama.cpp's converter exports a tokenizer.model:
every piece with its score and type (normal, unknown, control, byte). The Rust test
crates/tandem-model/tests/spm_tokenizer.rs builds tandem's tokenizer from that GGUF and must reproduce
SentencePiece's ids and decode them back.

Usage: .venv-ref/bin/python scripts/gen-spm-tokenizer-fixture.py  (needs: pip install sentencepiece gguf)
"""
import io
import json
import os

import gguf
import sentencepiece as spm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "tandem-model", "tests", "fixtures", "spm")

CORPUS = """
The quick brown fox jumps over the lazy dog. A tandem bicycle has two seats, and both riders pedal.
Prefill reads the whole prompt at once; decode produces one token at a time and reuses the key-value cache.
Paged attention stores keys and values in fixed-size blocks, so that many sequences share one pool of memory.
Numbers like 2026, 3.14159 and 1,000,000 appear in text; so do URLs such as https://example.com/a?b=c.
def add(a, b):
    return a + b
Les élèves étudient à l'école. Der Straßenverkehr ist dicht. El niño come una manzana.
"""

CASES = [
    "Hello world",
    " leading space",
    "two  spaces and\ttab",
    "line one\nline two\n\nline four",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 3.14",
    "Prefill and decode, tandem!",
    "Unicode: café, naïve, Straße, 東京, emoji 🚲🙂",
    "def add(a, b):\n    return a + b",
    "https://example.com/path?q=1&r=2",
    "   ",
    "ends with space ",
]


def main():
    os.makedirs(OUT, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in (CORPUS * 8).splitlines() if line.strip()]),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)

    w = gguf.GGUFWriter(os.path.join(OUT, "tokenizer.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cases = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in CASES]
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(
            {
                "generator": "scripts/gen-spm-tokenizer-fixture.py",
                "sentencepiece": spm.__version__,
                "vocab_size": sp.get_piece_size(),
                "cases": cases,
            },
            f,
            indent=1,
            ensure_ascii=False,
        )
        f.write("\n")
    print(f"wrote {OUT}: {sp.get_piece_size()} pieces, {len(cases)} cases")


if __name__ == "__main__":
    main()
