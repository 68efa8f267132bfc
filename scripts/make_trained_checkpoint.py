#!/usr/bin/env python3
"""A trained checkpoint of tests/data/tiny-qwen3-moe's shapes, for issue 8's KL measurement
(build/quant_kl): what a quantized copy does to a network whose weights were learned, rather than
drawn (scripts/make_kl_checkpoint.py) or drawn large on purpose (the test checkpoint).

    python3 scripts/make_trained_checkpoint.py [--out DIR] [--steps N] [--threads T]

Needs torch and transformers (pip install torch transformers). Writes
tests/data/tiny-qwen3-moe-trained/ (or DIR): the test checkpoint's config, generation config and
tokenizer files, and one BF16 model.safetensors with the test checkpoint's tensor names.

Training: transformers' Qwen3MoeForCausalLM from the test checkpoint's config (its own
initialization, seed SEED), float32, on GSM8K's training split (../shared/data/gsm8k/train.jsonl:
question, a newline, answer, each example ended with the EOS id, encoded by the checkpoint's
tokenizer and packed into rows of SEQ tokens), next-token cross-entropy plus the config's router
load-balancing loss, AdamW (lr LR, betas 0.9/0.95, weight decay 0.1, 20 warm-up steps then
cosine to a tenth), BATCH rows a step, gradient norm clipped at 1. The rows are shuffled with a
fixed seed; the same machine gives the same bytes (torch's CPU kernels with a fixed thread count),
another machine may differ in the last bits. The loss of the first and last steps and of the
held-out GSM8K test split is printed.

transformers stores the experts fused (experts.gate_up_proj [E, 2F, D], experts.down_proj
[E, D, F]); they are written back per expert as the checkpoints on the hub name them
(experts.N.gate_proj / up_proj / down_proj.weight: gate is the first F rows of gate_up)."""
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quant_checkpoints import write_safetensors  # noqa: E402

SRC = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe")
DEFAULT_OUT = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe-trained")
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")
SEED = 20261130
SEQ = 256
BATCH = 16
LR = 3e-3


def encode_split(tok, path, eos):
    ids = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            ids += tok.encode(ex["question"] + "\n" + ex["answer"]).ids + [eos]
    return ids


def rows_of(ids):
    n = len(ids) // SEQ
    return np.asarray(ids[:n * SEQ], dtype=np.int64).reshape(n, SEQ)


def lr_at(step, steps):
    if step < 20:
        return LR * (step + 1) / 20
    t = (step - 20) / max(1, steps - 20)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def bf16_bits(t):
    import torch
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def main(argv):
    out_dir, steps, threads = DEFAULT_OUT, 600, 2
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--out" and args:
            out_dir = args.pop(0)
        elif a == "--steps" and args:
            steps = int(args.pop(0))
        elif a == "--threads" and args:
            threads = int(args.pop(0))
        else:
            sys.exit("usage: make_trained_checkpoint.py [--out DIR] [--steps N] [--threads T]")
    import torch
    import transformers
    from tokenizers import Tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    random.seed(SEED)
    cfg = transformers.AutoConfig.from_pretrained(SRC)
    cfg.output_router_logits = True
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = Tokenizer.from_file(os.path.join(SRC, "tokenizer.json"))
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    train = rows_of(encode_split(tok, os.path.join(GSM8K, "train.jsonl"), eos))
    test = rows_of(encode_split(tok, os.path.join(GSM8K, "test.jsonl"), eos))
    print("GSM8K: %d training rows, %d held-out rows of %d tokens; %d steps of %d rows"
          % (len(train), len(test), SEQ, steps, BATCH), flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    keep = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    order = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        if len(order) < BATCH:
            perm = list(range(len(train)))
            random.shuffle(perm)
            order += perm
        batch = torch.from_numpy(train[order[:BATCH]])
        del order[:BATCH]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print("step %4d  loss %.3f  (%.0f s)" % (step, out.loss.item(), time.time() - t0), flush=True)
    model.eval()
    with torch.no_grad():
        losses = []
        for i in range(0, min(len(test), 64), BATCH):
            b = torch.from_numpy(test[i:i + BATCH])
            logits = model(input_ids=b).logits[:, :-1].float()
            losses.append(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1)).item())
    print("held-out GSM8K loss %.3f nats per token (%d rows)" % (sum(losses) / len(losses), min(len(test), 64)))

    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[:-len("gate_up_proj")]
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors["%s%d.gate_proj.weight" % (base, e)] = bf16_bits(t[e, :F])
                tensors["%s%d.up_proj.weight" % (base, e)] = bf16_bits(t[e, F:])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                tensors["%s%d.down_proj.weight" % (base, e)] = bf16_bits(t[e])
        else:
            tensors[name] = bf16_bits(t)
    with open(os.path.join(SRC, "model.safetensors.index.json")) as f:
        want = set(json.load(f)["weight_map"])
    if set(tensors) != want:
        sys.exit("make_trained_checkpoint: tensor names differ from the test checkpoint's: %s"
                 % sorted(set(tensors) ^ want)[:8])
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(SRC, extra), out_dir)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, "bf16")
    print("wrote %s" % (os.path.relpath(out_dir, ROOT) if out_dir.startswith(ROOT) else out_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
