#!/usr/bin/env python3
"""Write a GGUF file with a real model's shape and random block-quantized weights.

Why: the CUDA backend's packed-GGUF GEMV kernels need timing on an 8B-sized model, but the GPU
machines have no network to fetch one from. This script makes such a file there from nothing but
numpy and the standard library (no `gguf` package): GGUF v3, architecture `llama`, llama.cpp's
tensor names, every matrix (token_embd.weight and an untied output.weight included) in one block
type whose codes are uniform random bytes, scales chosen so weights lie in about +-0.02, and the
norms f32 ones. The output is noise, but it loads and decodes like the real model would.

The tokenizer (every `tokenizer.*` key) is copied verbatim from `--like`, an existing GGUF, so
tandem can load the result; the vocabulary, and so token_embd/output's row count, is therefore that
file's (49152 for the default SmolLM2-135M), not Llama 3's 128256. An 8B-shaped file thus has
~7.4B parameters rather than 8.0B; per-layer weights, which dominate decode time, are exact.

    python3 scripts/gpu/random_gguf.py --like models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --shape llama-8b --qtype q4_1 --out /tmp/llama8b-q4_1.gguf [--layers N] [--seed 0]

`--shape smollm2-135m` takes every dimension from the `--like` file's metadata (and writes
output.weight only if that file has one), for trying the result on a small machine.
"""

import argparse
import mmap
import struct
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

GGUF_VERSION = 3
ALIGNMENT = 32
# Every block type written here packs 32 values.
BLOCK_LEN = 32
# Quantized data is generated and written this many blocks at a time (~20-34 MiB).
CHUNK_BLOCKS = 1 << 20
# Weights span about +-WEIGHT_RANGE.
WEIGHT_RANGE = 0.02

# GGUF metadata value types.
GGUF_U32, GGUF_F32, GGUF_STRING, GGUF_ARRAY = 4, 6, 8, 9
# struct formats of the fixed-size metadata value types.
SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
GGML_F32 = 0


@dataclass(frozen=True)
class QType:
    """A ggml block type: its ids, its block size, and the fixed scale bytes that open each block."""

    ggml_type: int
    file_type: int  # llama.cpp's `general.file_type` (LLAMA_FTYPE_MOSTLY_*)
    block_bytes: int
    header: bytes


QTYPES = {
    # f16 d, then 16 bytes of nibbles q: w = (q - 8) * d.
    "q4_0": QType(2, 2, 18, np.array([WEIGHT_RANGE / 8], "<f2").tobytes()),
    # f16 d, f16 m, then 16 bytes of nibbles q: w = q * d + m.
    "q4_1": QType(3, 3, 20, np.array([WEIGHT_RANGE / 8, -WEIGHT_RANGE], "<f2").tobytes()),
    # f16 d, then 32 int8 q: w = q * d.
    "q8_0": QType(8, 7, 34, np.array([WEIGHT_RANGE / 128], "<f2").tobytes()),
}


@dataclass(frozen=True)
class Shape:
    """The dimensions written as `llama.*` metadata and used for the tensors."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int
    tied: bool


LLAMA_8B = Shape(
    hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
    rope_theta=500000.0, rms_eps=1e-5, context=8192, tied=False,
)


class LikeFile:
    """The metadata and tensor names of an existing GGUF (its tensor data is never read)."""

    def __init__(self, path):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            self.buf = m
            self.pos = 0
            if m[:4] != b"GGUF":
                sys.exit(f"{path}: not a GGUF file")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
            if version not in (2, 3):
                sys.exit(f"{path}: GGUF version {version}, only 2 and 3 are read")
            self.pos = 24
            # key -> (value, the whole entry's bytes as the file stores them)
            self.kv = {}
            for _ in range(n_kv):
                start = self.pos
                key = self.string()
                value = self.value(self.unpack("<I"))
                self.kv[key] = (value, bytes(m[start:self.pos]))
            self.tensors = set()
            for _ in range(n_tensors):
                self.tensors.add(self.string())
                n_dims = self.unpack("<I")
                self.pos += 8 * n_dims + 4 + 8  # dims, type, offset
            del self.buf

    def unpack(self, fmt):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode()
        self.pos += n
        return s

    def value(self, vtype):
        if vtype in SCALAR_FORMATS:
            return self.unpack(SCALAR_FORMATS[vtype])
        if vtype == GGUF_STRING:
            return self.string()
        if vtype == GGUF_ARRAY:
            etype = self.unpack("<I")
            n = self.unpack("<Q")
            if etype in SCALAR_FORMATS:
                fmt = SCALAR_FORMATS[etype]
                # A copy: a view would pin the map open.
                a = np.frombuffer(self.buf, np.dtype(fmt), n, self.pos).copy()
                self.pos += a.nbytes
                return a
            return [self.value(etype) for _ in range(n)]
        sys.exit(f"unknown GGUF value type {vtype}")

    def get(self, key):
        return self.kv[key][0] if key in self.kv else None


def shape_of_like(like):
    """The --like file's own dimensions, from its `{arch}.*` metadata."""
    arch = like.get("general.architecture")

    def key(k, default=None):
        v = like.get(f"{arch}.{k}")
        if v is None and default is None:
            sys.exit(f"--like file lacks {arch}.{k}")
        return default if v is None else v

    hidden, heads = key("embedding_length"), key("attention.head_count")
    return Shape(
        hidden=hidden,
        ffn=key("feed_forward_length"),
        layers=key("block_count"),
        heads=heads,
        kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("rope.dimension_count", hidden // heads),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        context=key("context_length"),
        tied="output.weight" not in like.tensors,
    )


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv_entry(key, vtype, value):
    if vtype == GGUF_STRING:
        payload = gguf_string(value)
    else:
        payload = struct.pack(SCALAR_FORMATS[vtype], value)
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def metadata(like, shape, qtype_name, shape_name, vocab):
    """Our `general.*` and `llama.*` keys, then the --like file's `tokenizer.*` entries verbatim."""
    ours = [
        ("general.architecture", GGUF_STRING, "llama"),
        ("general.name", GGUF_STRING, f"random {shape_name} {qtype_name}"),
        ("general.alignment", GGUF_U32, ALIGNMENT),
        ("general.file_type", GGUF_U32, QTYPES[qtype_name].file_type),
        ("llama.vocab_size", GGUF_U32, vocab),
        ("llama.context_length", GGUF_U32, shape.context),
        ("llama.embedding_length", GGUF_U32, shape.hidden),
        ("llama.block_count", GGUF_U32, shape.layers),
        ("llama.feed_forward_length", GGUF_U32, shape.ffn),
        ("llama.attention.head_count", GGUF_U32, shape.heads),
        ("llama.attention.head_count_kv", GGUF_U32, shape.kv_heads),
        ("llama.attention.layer_norm_rms_epsilon", GGUF_F32, shape.rms_eps),
        ("llama.rope.freq_base", GGUF_F32, shape.rope_theta),
        ("llama.rope.dimension_count", GGUF_U32, shape.head_dim),
    ]
    entries = [kv_entry(*kv) for kv in ours]
    entries += [raw for key, (_, raw) in like.kv.items() if key.startswith("tokenizer.")]
    return entries


def tensor_list(shape, vocab, qtype):
    """(name, ne, ggml type) in file order; ne is innermost first, so ne[0] is a matrix's columns."""
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    t = qtype.ggml_type
    tensors = [("token_embd.weight", (h, vocab), t)]
    for l in range(shape.layers):
        p = f"blk.{l}."
        tensors += [
            (p + "attn_norm.weight", (h,), GGML_F32),
            (p + "attn_q.weight", (h, q_dim), t),
            (p + "attn_k.weight", (h, kv_dim), t),
            (p + "attn_v.weight", (h, kv_dim), t),
            (p + "attn_output.weight", (q_dim, h), t),
            (p + "ffn_norm.weight", (h,), GGML_F32),
            (p + "ffn_gate.weight", (h, shape.ffn), t),
            (p + "ffn_up.weight", (h, shape.ffn), t),
            (p + "ffn_down.weight", (shape.ffn, h), t),
        ]
    tensors.append(("output_norm.weight", (h,), GGML_F32))
    if not shape.tied:
        tensors.append(("output.weight", (h, vocab), t))
    return tensors


def nbytes(ne, ggml_type, qtype):
    elements = int(np.prod(ne))
    if ggml_type == GGML_F32:
        return 4 * elements
    if ne[0] % BLOCK_LEN:
        sys.exit(f"row length {ne[0]} is not a whole number of {BLOCK_LEN}-value blocks")
    return elements // BLOCK_LEN * qtype.block_bytes


def pad(n):
    return -n % ALIGNMENT


def write_quantized(f, size, qtype, rng):
    """`size` bytes of blocks: random codes behind the fixed scale bytes, a chunk at a time."""
    header = np.frombuffer(qtype.header, np.uint8)
    blocks = size // qtype.block_bytes
    for start in range(0, blocks, CHUNK_BLOCKS):
        n = min(CHUNK_BLOCKS, blocks - start) * qtype.block_bytes
        raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
        chunk = raw.reshape(-1, qtype.block_bytes)
        chunk[:, :header.size] = header
        f.write(chunk.data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--like", required=True, type=Path,
                    help="GGUF whose tokenizer (and, for --shape smollm2-135m, dimensions) to copy")
    ap.add_argument("--shape", required=True, choices=["llama-8b", "smollm2-135m"])
    ap.add_argument("--qtype", required=True, choices=sorted(QTYPES))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, help="override the shape's layer count")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    like = LikeFile(args.like)
    tokens = like.get("tokenizer.ggml.tokens")
    if tokens is None:
        sys.exit(f"{args.like} has no tokenizer.ggml.tokens")
    vocab = len(tokens)
    shape = LLAMA_8B if args.shape == "llama-8b" else shape_of_like(like)
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    qtype = QTYPES[args.qtype]

    kvs = metadata(like, shape, args.qtype, args.shape, vocab)
    tensors = tensor_list(shape, vocab, qtype)
    infos, offset = [], 0
    for name, ne, ggml_type in tensors:
        size = nbytes(ne, ggml_type, qtype)
        infos.append(gguf_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset))
        offset += size + pad(size)
    head = b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs)) + b"".join(kvs + infos)
    head += bytes(pad(len(head)))
    total = len(head) + offset
    print(f"{args.out}: {args.shape} ({shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}, "
          f"vocab {vocab}), {args.qtype}, {len(tensors)} tensors, {total / 1e9:.3f} GB", flush=True)

    rng = np.random.default_rng(args.seed)
    ones = np.ones(shape.hidden, "<f4").tobytes()
    part = args.out.with_name(args.out.name + ".part")
    t0 = time.monotonic()
    with open(part, "wb") as f:
        f.write(head)
        for name, ne, ggml_type in tensors:
            size = nbytes(ne, ggml_type, qtype)
            if ggml_type == GGML_F32:
                f.write(ones)
            else:
                write_quantized(f, size, qtype, rng)
            f.write(bytes(pad(size)))
            if name.endswith("ffn_down.weight") or name == tensors[-1][0]:
                done, secs = f.tell(), time.monotonic() - t0
                print(f"  {name}: {done / 1e9:.3f}/{total / 1e9:.3f} GB, {secs:.1f} s, "
                      f"{done / 1e9 / max(secs, 1e-9):.2f} GB/s", flush=True)
        written = f.tell()
    if written != total:
        sys.exit(f"wrote {written} bytes, expected {total}")
    part.replace(args.out)
    print(f"wrote {written} bytes to {args.out} in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
