#!/usr/bin/env python3
"""Write a random Qwen3-MoE checkpoint big enough for CPU decode benchmarks.

Default shape: hidden 1024, 8 layers (all MoE), 16 q heads / 4 kv heads, head_dim 64, 32 experts
top-4, moe_intermediate 512, vocab = tests/data/tokenizer.json's (2051): about 0.9 GB of BF16 in
shards of at most --shard-mb, with model.safetensors.index.json, config.json,
generation_config.json, tokenizer.json and tokenizer_config.json (the last two copied from
tests/data and tests/data/tiny-qwen3-moe).

Only numpy is used: weights are drawn as float32 from a fixed seed, scaled like a trained model
(std 1/sqrt(fan_in), norm weights near 1) so activations stay finite through every layer, rounded
to BF16 (round to nearest even) and written with a hand-made safetensors header. The values mean
nothing; only the shapes and the cost matter. Not committed: regenerate it where it is needed.

Usage: python3 scripts/make_bench_model.py [--out /tmp/moeserve-bench-model] [--hidden 1024]
           [--layers 8] [--experts 32] [--top-k 4]
"""

import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DATA = os.path.join(REPO_ROOT, "tests", "data")


def to_bf16(x):
    """float32 array -> uint16 BF16 bits, round to nearest even (no NaNs are produced here)."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def tensor_specs(cfg):
    """(name, shape, kind) in checkpoint order; kind picks the init rule."""
    D, Dh = cfg["hidden_size"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, F, V = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    specs = [("model.embed_tokens.weight", (V, D), "embed")]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        specs += [
            (p + "input_layernorm.weight", (D,), "norm"),
            (p + "self_attn.q_proj.weight", (H * Dh, D), "linear"),
            (p + "self_attn.k_proj.weight", (Hkv * Dh, D), "linear"),
            (p + "self_attn.v_proj.weight", (Hkv * Dh, D), "linear"),
            (p + "self_attn.o_proj.weight", (D, H * Dh), "linear"),
            (p + "self_attn.q_norm.weight", (Dh,), "norm"),
            (p + "self_attn.k_norm.weight", (Dh,), "norm"),
            (p + "post_attention_layernorm.weight", (D,), "norm"),
            (p + "mlp.gate.weight", (E, D), "router"),
        ]
        for e in range(E):
            q = p + "mlp.experts.%d." % e
            specs += [
                (q + "gate_proj.weight", (F, D), "linear"),
                (q + "up_proj.weight", (F, D), "linear"),
                (q + "down_proj.weight", (D, F), "linear"),
            ]
    specs += [("model.norm.weight", (D,), "norm"), ("lm_head.weight", (V, D), "linear")]
    return specs


def draw(rng, shape, kind):
    if kind == "norm":
        return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)
    std = {"embed": 1.0, "linear": 1.0 / np.sqrt(shape[1]), "router": 4.0 / np.sqrt(shape[1])}[kind]
    return rng.standard_normal(size=shape, dtype=np.float32) * np.float32(std)


def write_shard(path, tensors):
    """tensors: list of (name, shape, uint16 array); writes one safetensors file."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, arr in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, arr in tensors:
            f.write(arr.tobytes())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/moeserve-bench-model")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--shard-mb", type=int, default=400, help="largest shard, in MB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    tok_path = os.path.join(TESTS_DATA, "tokenizer.json")
    tok_cfg_path = os.path.join(TESTS_DATA, "tiny-qwen3-moe", "tokenizer_config.json")
    for p in (tok_path, tok_cfg_path):
        if not os.path.exists(p):
            sys.exit("make_bench_model: %s missing; run scripts/make_reference.py first" % p)
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab_size = max(list(tok["model"]["vocab"].values()) + list(special.values())) + 1
    if args.top_k > args.experts:
        sys.exit("make_bench_model: --top-k %d exceeds --experts %d" % (args.top_k, args.experts))

    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": special["<|endoftext|>"],
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": args.moe_intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": args.heads,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "num_hidden_layers": args.layers,
        "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    gen_cfg = {
        "bos_token_id": None,
        "do_sample": False,
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"],
    }

    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    rng = np.random.default_rng(args.seed)
    specs = tensor_specs(cfg)
    limit = args.shard_mb * 1000 * 1000

    # Group tensors into shards first (sizes are known), then draw and write one shard at a time.
    groups, cur, cur_bytes = [], [], 0
    for name, shape, kind in specs:
        nbytes = 2 * int(np.prod(shape))
        if cur and cur_bytes + nbytes > limit:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, kind))
        cur_bytes += nbytes
    groups.append(cur)

    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else "model-%05d-of-%05d.safetensors" % (i + 1, len(groups))
        tensors = [(name, shape, to_bf16(draw(rng, shape, kind))) for name, shape, kind in group]
        write_shard(os.path.join(args.out, fname), tensors)
        for name, _, arr in tensors:
            weight_map[name] = fname
            total += arr.nbytes
        del tensors
    if len(groups) > 1:
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")

    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")
    shutil.copyfile(tok_path, os.path.join(args.out, "tokenizer.json"))
    with open(tok_cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
        f.write("\n")
    print("make_bench_model: wrote %s: %d tensors, %.1f MB BF16 in %d file(s)"
          % (args.out, len(specs), total / 1e6, len(groups)))


if __name__ == "__main__":
    main()
