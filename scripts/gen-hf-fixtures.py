#!/usr/bin/env python3
"""Generate tiny random Hugging Face model folders and their reference logits.

The Rust test crates/tandem-model/tests/hf_reference.rs loads each folder with tandem_model::load and
compares its forward pass against the logits that transformers computes here. Everything is seeded, so
rerunning the script reproduces the same files (up to float summation order of the torch build).

Usage: .venv-ref/bin/python scripts/gen-hf-fixtures.py [--out tests/fixtures/hf] [--only NAME ...]
(the venv holds CPU torch + transformers + gguf; scripts/gen-hf-fixtures.sh makes it).

Each folder gets, besides the usual HF files:
  expected.json        prompts (token ids), tokenizer cases and the layout of expected_logits.bin
  expected_logits.bin  little-endian f32 logits, prompt after prompt, one row of vocab_size per position

One fixture is a GGUF file instead of an HF folder: tiny-llama3-gguf/model.gguf holds the Llama 3 rope
model of tiny-llama3-rope written the way llama.cpp's converter writes Llama 3.1 (Q/K permuted for
interleaved RoPE, the frequency scaling as a `rope_freqs.weight` tensor, the BPE vocabulary and merges
as tokenizer metadata), with the same expected logits.
"""

import argparse
import copy
import json
import math
import os
import shutil

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 512
SEED = 1234

CORPUS = """
The quick brown fox jumps over the lazy dog. A tandem bicycle has two seats, and both riders pedal.
Prefill reads the whole prompt at once; decode produces one token at a time and reuses the key-value cache.
fn main() { let x = vec![1, 2, 3]; println!("{:?}", x.iter().sum::<i32>()); }
def add(a, b):
    return a + b
Large language models predict the next token. Paged attention stores keys and values in fixed-size blocks,
so that many sequences share one pool of memory without fragmentation. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42.
"""

PROMPT_TEXTS = [
    "The",
    "A tandem bicycle has two seats.",
    "Paged attention stores keys and values in blocks, so many sequences share one pool.",
    "def add(a, b):\n    return a + b\nfn main() { let x = vec![1, 2, 3]; } The quick brown fox jumps over the lazy dog.",
]

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(specials, bos, eos, template):
    """A byte-level BPE of exactly VOCAB entries trained on CORPUS, wrapped as a transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so that merges reach the full vocabulary size.
    tok.train_from_iterator([CORPUS] * 4 + [CORPUS.lower(), CORPUS.upper()], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        chat_template=template,
    )
    assert len(fast) <= VOCAB, len(fast)
    return fast


def randomize(model, std):
    """Replace HF's tiny default init with larger weights (and non-trivial norms and biases) so that
    attention patterns and logits are far from uniform and every tensor matters to the output."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)


def legacy_layout(path):
    """Rewrite the folder the way most published checkpoints (transformers 4: SmolLM2, Llama 3, Qwen2.5)
    spell it: transformers >= 5 saves `rope_parameters: {rope_type, rope_theta, ...}` and a separate
    chat_template.jinja, where older folders carry top-level `rope_theta`/`rope_scaling` in config.json
    and the template as `chat_template` inside tokenizer_config.json."""
    tc_path = os.path.join(path, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    jinja = os.path.join(path, "chat_template.jinja")
    with open(jinja) as f:
        tc["chat_template"] = f.read()
    os.remove(jinja)
    tc.pop("backend", None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, sort_keys=True)
        f.write("\n")

    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    params = cfg.pop("rope_parameters", None)
    if params is not None:
        params = dict(params)
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_fixture(out_dir, name, model, tokenizer, save_dtype=None, max_shard_size=None, legacy_config=True,
                  gguf=False):
    """Save the model folder (or, with `gguf`, one model.gguf) and the reference logits computed in f32
    from the weights as saved."""
    path = os.path.join(out_dir, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        do_sample=False,
        max_new_tokens=16,
    )
    to_save = model
    if save_dtype is not None:
        # Round the parameters to the stored dtype and compute the reference in f32 from those values.
        # Only parameters: `model.to(bf16)` would also round the rotary inv_freq buffer, which no
        # checkpoint stores and every runtime recomputes.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(save_dtype).to(torch.float32))
        to_save = copy.deepcopy(model).to(save_dtype)
    kwargs = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    if gguf:
        write_gguf(os.path.join(path, "model.gguf"), model, tokenizer)
    else:
        to_save.save_pretrained(path, **kwargs)
        tokenizer.save_pretrained(path)
        if legacy_config:
            legacy_layout(path)
    model = model.eval()

    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS]
    rows = []
    index = []
    offset = 0
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].to(torch.float32).contiguous()
            assert logits.shape == (len(ids), model.config.vocab_size)
            rows.append(logits.numpy().astype("<f4").tobytes())
            index.append({"token_ids": ids, "row_offset": offset, "rows": len(ids)})
            offset += len(ids)
    with open(os.path.join(path, "expected_logits.bin"), "wb") as f:
        for r in rows:
            f.write(r)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = {
        "generator": "scripts/gen-hf-fixtures.py",
        "torch": torch.__version__,
        "vocab_size": model.config.vocab_size,
        "logits_file": "expected_logits.bin",
        "logits_dtype": "f32le",
        "prompts": index,
        "tokenizer_cases": [
            {"text": t, "ids": tokenizer.encode(t, add_special_tokens=False)} for t in PROMPT_TEXTS
        ],
        "chat_case": {
            "messages": messages,
            "add_generation_prompt": True,
            "rendered": tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        },
    }
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(path, p)) for p in os.listdir(path))
    print(f"{name}: {total / 1024:.0f} KiB, files: {sorted(os.listdir(path))}")


def permute_for_interleaved_rope(w, n_heads):
    """llama.cpp's converter reorders each head's Q/K rows from NeoX halves to adjacent pairs, so that its
    interleaved RoPE rotates the same coordinates HF's rotate_half does."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_params(cfg):
    """rope_theta and scaling keys of a config, from transformers 5's `rope_parameters` or the older keys."""
    if getattr(cfg, "rope_parameters", None):
        return dict(cfg.rope_parameters)
    return dict(cfg.rope_scaling or {}, rope_theta=cfg.rope_theta)


def llama3_freq_factors(cfg):
    """Per-pair frequency divisors equivalent to HF's llama3 rope rule, as a GGUF rope_freqs tensor."""
    rs = rope_params(cfg)
    dim = cfg.hidden_size // cfg.num_attention_heads
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rs["rope_theta"] ** (i / dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(path, model, tokenizer):
    """An f32 GGUF of a Llama model with a byte-level BPE tokenizer, laid out as llama.cpp writes it."""
    import gguf
    import numpy as np

    cfg = model.config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama3-gguf")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(cfg.hidden_size // nh)
    w.add_rope_freq_base(rope_params(cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)

    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    w.add_tensor("rope_freqs.weight", np.array(llama3_freq_factors(cfg), dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute_for_interleaved_rope(sd[p + "self_attn.q_proj.weight"], nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute_for_interleaved_rope(sd[p + "self_attn.k_proj.weight"], nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_shape(**over):
    """The shared tiny Llama-family shape: GQA (4 query heads over 2 KV heads), head_dim 16."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(over)
    return cfg


def llama_config(**over):
    """A LlamaConfig of the tiny shape."""
    return LlamaConfig(**tiny_shape(**over))


def main():
    ap = argparse.ArgumentParser()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", help="regenerate only these fixtures (default: all)")
    args = ap.parse_args()
    wanted = lambda name: not args.only or name in args.only
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)

    llama_tok = build_tokenizer(["<unk>", "<s>", "</s>"], "<s>", "</s>", LLAMA_TEMPLATE)
    assert llama_tok.convert_tokens_to_ids("<s>") == 1 and llama_tok.convert_tokens_to_ids("</s>") == 2

    # (a) plain Llama, untied head, f32.
    m = LlamaForCausalLM(llama_config())
    m.config._attn_implementation = "eager"
    randomize(m, 0.2)
    if wanted("tiny-llama"):
        write_fixture(args.out, "tiny-llama", m, llama_tok)

    # (a') Llama 3 style rope scaling: with head_dim 16 and theta 1e4, the two lowest frequencies fall in
    # the scaled and the smoothed bands of the llama3 rule, so a wrong implementation changes the logits.
    m = LlamaForCausalLM(
        llama_config(
            rope_theta=10000.0,
            max_position_embeddings=131072,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    m.config._attn_implementation = "eager"
    randomize(m, 0.2)
    if wanted("tiny-llama3-rope"):
        write_fixture(args.out, "tiny-llama3-rope", m, llama_tok)
    # (a'') the same model as llama.cpp's converter writes a Llama 3.1 GGUF (rope_freqs tensor).
    if wanted("tiny-llama3-gguf"):
        write_fixture(args.out, "tiny-llama3-gguf", m, llama_tok, gguf=True)

    # (b) Qwen2: q/k/v biases, tied embeddings, 3 layers.
    qwen_tok = build_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML_TEMPLATE
    )
    qcfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=qwen_tok.convert_tokens_to_ids("<|im_end|>"),
        use_sliding_window=False,
    )
    m = Qwen2ForCausalLM(qcfg)
    m.config._attn_implementation = "eager"
    randomize(m, 0.2)
    m.tie_weights()
    if wanted("tiny-qwen2"):
        write_fixture(args.out, "tiny-qwen2", m, qwen_tok)

    # (c) bf16 weights sharded over several safetensors files with an index; the folder keeps the
    # transformers 5 layout (`rope_parameters`, chat_template.jinja) so that both layouts are covered,
    # and its rope_theta is not the 10000 a parser would fall back to.
    m = LlamaForCausalLM(llama_config(num_hidden_layers=3, rope_theta=50000.0))
    m.config._attn_implementation = "eager"
    randomize(m, 0.2)
    if wanted("tiny-llama-sharded-bf16"):
        write_fixture(
            args.out, "tiny-llama-sharded-bf16", m, llama_tok, save_dtype=torch.bfloat16, max_shard_size="200KB",
            legacy_config=False,
        )

    # (d) Mistral with a sliding window shorter than every prompt but the first, and not a multiple of
    # the tests' block size: tokens beyond the window must drop out of attention.
    mcfg = MistralConfig(**tiny_shape(head_dim=16, sliding_window=7))
    m = MistralForCausalLM(mcfg)
    m.config._attn_implementation = "eager"
    randomize(m, 0.2)
    if wanted("tiny-mistral-sw"):
        write_fixture(args.out, "tiny-mistral-sw", m, llama_tok)


if __name__ == "__main__":
    main()
