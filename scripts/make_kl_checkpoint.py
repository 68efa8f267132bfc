#!/usr/bin/env python3
"""A random checkpoint of tests/data/tiny-qwen3-moe's shapes with realistic layer scales, for
issue 8's KL measurement (build/quant_kl), with numpy alone.

    python3 scripts/make_kl_checkpoint.py [--out DIR] [--wide S] [FAMILY=GAIN ...]

writes tests/data/tiny-qwen3-moe-kl/ (or DIR): the test checkpoint's config, generation config and
tokenizer files, and one BF16 model.safetensors (1.4 MB) with the same tensor names and shapes,
the same bytes on every run (numpy's PCG64 from a fixed seed, tensors drawn in name order).

Why: the test checkpoint (scripts/make_reference.py) draws its weights large on purpose, so that
the engine tests see decisive logits and routing: std 0.15 for every projection of a hidden size
of 64 (a gain, std x sqrt(fan_in), of 1.2, and 1.7 for o_proj), a router of std 1.0 (router
logits of std 8) and an embedding of std 0.3. Such a random network amplifies any perturbation
from layer to layer: 26% of the FP8 model's top-1 tokens differ from BF16's (build/quant_kl), and
the KL of a quantized copy says more about that than about the format. Here each matrix is
N(0, (GAIN / sqrt(fan_in))^2), with the defaults

    attn=1 mlp=1 router=1 (q, k, v, gate, up, router: a layer neither grows nor shrinks its input)
    out=1/sqrt(2 L) (o_proj and down_proj, the projections that write into the residual stream:
        GPT-2's and Megatron-LM's scaled init, which keeps each block's update a fraction of the
        stream; L = 4 layers, 0.354)
    embed=1 (absolute std)   lm_head=4 (the test checkpoint's logit scale: the mean next-token
        entropy stays about 2.7 nats, the test checkpoint's 2.6)   norms 1

--wide S multiplies the hidden size and both MLP widths by S (attention heads, experts and the
vocabulary as they are): --wide 2 gives a hidden size and expert width of 128, the narrowest the
CUDA backend's FP8 x FP8 experts take (medium precision, kernels/cuda/fp8_gemm.h), so that
`build/quant_kl --device cuda --matmul-precision medium` measures them.

FAMILY=GAIN arguments override them (attn, mlp, out, router, lm_head; embed is the absolute std),
e.g. `attn=1.2 mlp=1.2 out=1.2 router=8 embed=0.3` for about the test checkpoint's regime."""
import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quant_checkpoints import write_safetensors  # noqa: E402

SRC = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe")
DEFAULT_OUT = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe-kl")
GAINS = {"attn": 1.0, "mlp": 1.0, "out": None, "router": 1.0, "lm_head": 4.0, "embed": 1.0}
SEED = 20261130


def family(name):
    if name.endswith("norm.weight"):
        return "norm"
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "lm_head"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if name.endswith(".o_proj.weight") or name.endswith(".down_proj.weight"):
        return "out"
    if ".self_attn." in name:
        return "attn"
    if ".mlp." in name:
        return "mlp"
    sys.exit("make_kl_checkpoint: no rule for " + name)


def to_bf16_bits(x):
    """float32 -> BF16 bits, round to nearest even (finite values)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def shapes_of(folder):
    """name -> shape of every tensor of a (sharded) safetensors checkpoint, from the headers."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


def widened(name, shape, s):
    """name's shape with the hidden size and the MLP widths times s."""
    if s == 1:
        return shape
    if name.endswith("norm.weight"):
        return shape if (".q_norm." in name or ".k_norm." in name) else [shape[0] * s]
    rows, cols = shape
    if name.endswith(".o_proj.weight"):
        return [rows * s, cols]
    if ".mlp." in name and not name.endswith("mlp.gate.weight"):
        return [rows * s, cols * s]
    return [rows, cols * s]  # q, k, v, the router, the embedding and lm_head: inputs of width D


def main(argv):
    out_dir = DEFAULT_OUT
    gains = dict(GAINS)
    wide = 1
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--out" and args:
            out_dir = args.pop(0)
        elif a == "--wide" and args:
            wide = int(args.pop(0))
        elif "=" in a and a.split("=", 1)[0] in gains:
            k, v = a.split("=", 1)
            gains[k] = float(v)
        else:
            sys.exit("usage: make_kl_checkpoint.py [--out DIR] [--wide S] [FAMILY=GAIN ...] "
                     "(families: %s)"
                     % ", ".join(sorted(gains)))
    with open(os.path.join(SRC, "config.json")) as f:
        n_layers = json.load(f)["num_hidden_layers"]
    if gains["out"] is None:
        gains["out"] = 1 / np.sqrt(2 * n_layers)
    rng = np.random.Generator(np.random.PCG64(SEED))
    tensors = {}
    for name, shape in sorted(shapes_of(SRC).items()):
        shape = widened(name, shape, wide)
        fam = family(name)
        if fam == "norm":
            w = np.ones(shape, dtype=np.float32)
        else:
            std = gains[fam] if fam == "embed" else gains[fam] / np.sqrt(shape[1])
            w = (std * rng.standard_normal(shape)).astype(np.float32)
        tensors[name] = to_bf16_bits(w)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(SRC, extra), out_dir)
    if wide != 1:
        with open(os.path.join(out_dir, "config.json")) as f:
            cfg = json.load(f)
        for k in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            cfg[k] *= wide
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, "bf16")
    print("wrote %s (%s%s)" % (os.path.relpath(out_dir, ROOT) if out_dir.startswith(ROOT) else out_dir,
                               " ".join("%s=%g" % kv for kv in sorted(gains.items())),
                               " wide=%d" % wide if wide != 1 else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
