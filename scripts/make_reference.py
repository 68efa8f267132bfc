#!/usr/bin/env python3
"""Make the small random Qwen3-MoE checkpoints and their reference outputs.

Writes (paths relative to the repo root; see tests/data/README.md):
  tests/data/tiny-qwen3-moe/             test checkpoint: hidden 64, 4 layers (layer 1 dense),
                                         4 q heads / 2 kv heads, head_dim 32, 8 experts top-2,
                                         untied lm_head, BF16 in 2 shards + index.
  tests/data/reference-tiny-qwen3-moe.json   its greedy and teacher-forced reference.
  models/tiny-qwen3-moe/                 the default model of `make run`: hidden 128, 4 layers
                                         (layer 0 dense), 8 q / 2 kv heads, head_dim 32, 16 experts
                                         top-4, tied embeddings, one BF16 model.safetensors.
  tests/data/reference-default.json      its reference.

Reference JSON shape:
  {"model_dir": str,
   "greedy": [{"prompt", "input_ids", "output_ids" (32), "margins" (32)}],
   "teacher_forced": [{"input_ids", "logprobs"}]}
output_ids come from a plain greedy loop (argmax of the float32 logits of a full forward pass,
no eos stop); margins[i] is top-1 minus top-2 log-probability at step i, so a small margin flags
a step where a correct engine may legitimately pick the other token. logprobs[i] is
log_softmax(logits[i-1])[input_ids[i]], logprobs[0] is null.

Choices:
- Weights are drawn from a fixed seed with larger scales than a trained-from-scratch init (std
  0.1-0.3, norm weights uniform in [0.8, 1.2], decisive router), so that logits are far from
  flat, routing is not a coin toss and every norm weight matters.
- The reference runs the model loaded back from the saved files in float32 with eager attention,
  so it sees exactly the BF16 values the C engine reads.
- config.json spells the expert count `num_experts` (the spelling of the published Qwen3-MoE
  files; transformers 5 itself writes `num_local_experts`) and carries RoPE theta both as
  `rope_parameters.rope_theta` (transformers 5) and as top-level `rope_theta` (transformers 4 and
  the published files), with the same value.
- Floats are single-threaded float32 results written with repr, so reruns on one machine give
  identical files.

Usage: python3 scripts/make_reference.py [--out-tests tests/data] [--out-models models]
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_PATH = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
N_NEW_TOKENS = 32

# ChatML, as Qwen's chat models format conversations.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The two models. "init" holds the std of each weight family (see init_weights).
TINY = {
    "name": "tiny-qwen3-moe",
    "seed": 1,
    "config": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "init": dict(embed=0.3, attn=0.15, mlp=0.15, router=1.0, lm_head=0.5),
    "shards": 2,
}

DEFAULT = {
    "name": "tiny-qwen3-moe",
    "seed": 2,
    "config": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "init": dict(embed=0.4, attn=0.17, mlp=0.17, router=1.0, lm_head=None),
    "shards": 1,
}

ROPE_THETA = 10000.0


# ----------------------------------------------------------------------------------------------
# inputs


def find_gsm8k(arg):
    for d in [arg, os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k"),
              os.path.join(REPO_ROOT, "shared", "data", "gsm8k")]:
        if d and os.path.exists(os.path.join(d, "test.jsonl")):
            return d
    sys.exit("make_reference: GSM8K not found (expected ../shared/data/gsm8k/{train,test}.jsonl "
             "from the repo root); pass --gsm8k DIR")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ensure_tokenizer():
    if not os.path.exists(TOKENIZER_PATH):
        print("make_reference: %s missing, running scripts/make_tokenizer_data.py" % TOKENIZER_PATH)
        subprocess.run([sys.executable, os.path.join("scripts", "make_tokenizer_data.py")],
                       cwd=REPO_ROOT, check=True)
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TOKENIZER_PATH)


# ----------------------------------------------------------------------------------------------
# model files


def init_weights(model, init, seed):
    """Overwrite every parameter from a private generator, in name order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(init["embed"] * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                if init["lm_head"] is not None:
                    p.copy_(init["lm_head"] * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(init["router"] * torch.randn(p.shape, generator=gen))
            elif ".self_attn." in name:
                p.copy_(init["attn"] * torch.randn(p.shape, generator=gen))
            elif ".mlp." in name:
                p.copy_(init["mlp"] * torch.randn(p.shape, generator=gen))
            else:
                raise RuntimeError("make_reference: no init rule for " + name)


def model_config(spec, tok):
    from transformers import Qwen3MoeConfig
    c = dict(spec["config"])
    return Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        eos_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
        pad_token_id=None,
        dtype="bfloat16",
        **c,
    )


def fix_config_json(path):
    """Spell the config as the published Qwen3-MoE files do (see the file header)."""
    with open(path) as f:
        cfg = json.load(f)
    out = {}
    for k, v in cfg.items():
        if k == "num_local_experts":
            k = "num_experts"
        out[k] = v
    assert out["rope_parameters"]["rope_theta"] == ROPE_THETA
    out["rope_theta"] = ROPE_THETA
    with open(path, "w") as f:
        json.dump(dict(sorted(out.items())), f, indent=2)
        f.write("\n")


def write_tokenizer_files(out_dir, tok, max_len):
    shutil.copyfile(TOKENIZER_PATH, os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        added[str(tok.token_to_id(s))] = {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def save_model(spec, tok, out_dir):
    """Build the random model, save it as BF16 in spec["shards"] files, and check that loading
    it back gives the same BF16 values."""
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = model_config(spec, tok)
    model = Qwen3MoeForCausalLM(cfg).float()
    init_weights(model, spec["init"], spec["seed"])
    model = model.to(torch.bfloat16).eval()

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    n_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    if spec["config"]["tie_word_embeddings"]:
        n_bytes -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    if spec["shards"] == 1:
        shard = "%dMB" % (n_bytes // 1000000 + 10)
    else:
        shard = "%dKB" % (n_bytes // 1000 // spec["shards"] + 40)
    model.save_pretrained(out_dir, max_shard_size=shard)
    fix_config_json(os.path.join(out_dir, "config.json"))
    gen = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        do_sample=False,
    )
    gen.save_pretrained(out_dir)
    write_tokenizer_files(out_dir, tok, spec["config"]["max_position_embeddings"])

    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    if len(files) != spec["shards"]:
        raise RuntimeError("make_reference: wanted %d safetensors files, got %s" % (spec["shards"], files))
    check_saved(model, out_dir, spec)
    return model


def check_saved(model, out_dir, spec):
    """The files hold per-expert hub names, the right dtypes, and load back bit-exactly."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    names = {}
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, f), "pt") as s:
                for k in s.keys():
                    names[k] = s.get_slice(k).get_dtype()
    assert all(d == "BF16" for d in names.values()), "non-BF16 tensor in " + out_dir
    c = spec["config"]
    for layer in range(c["num_hidden_layers"]):
        pre = "model.layers.%d.mlp." % layer
        if layer in c["mlp_only_layers"]:
            assert pre + "gate_proj.weight" in names
        else:
            assert pre + "gate.weight" in names
            for e in range(c["num_experts"]):
                for w in ("gate_proj", "up_proj", "down_proj"):
                    assert "%sexperts.%d.%s.weight" % (pre, e, w) in names, (layer, e, w)
    assert ("lm_head.weight" in names) == (not c["tie_word_embeddings"])
    if len([f for f in os.listdir(out_dir) if f.endswith(".safetensors")]) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"]) == set(names)

    back = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    assert back.config.rope_parameters["rope_theta"] == ROPE_THETA
    assert back.config.num_experts == c["num_experts"]
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), "reload differs at " + k
    if c["tie_word_embeddings"]:
        assert torch.equal(back.lm_head.weight, back.model.embed_tokens.weight)


# ----------------------------------------------------------------------------------------------
# reference


def load_f32(out_dir):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


class RouterProbe:
    """Records, for every routed token, the gap between the k-th and (k+1)-th router logit: a
    tiny gap is a routing decision that rounding could flip."""

    def __init__(self, model):
        self.gaps = []
        self.handles = []
        for mod in model.modules():
            if type(mod).__name__ == "Qwen3MoeTopKRouter":
                self.handles.append(mod.register_forward_hook(self.hook))

    def hook(self, mod, args, out):
        logits = out[0].detach().float()
        top = torch.topk(logits, mod.top_k + 1, dim=-1).values
        self.gaps.append((top[:, -2] - top[:, -1]).reshape(-1))

    def min_gap_count(self, below):
        g = torch.cat(self.gaps) if self.gaps else torch.zeros(0)
        return float(g.min()) if g.numel() else float("nan"), int((g < below).sum()), int(g.numel())


@torch.no_grad()
def greedy(model, ids):
    ids = list(ids)
    out, margins, stats = [], [], []
    for _ in range(N_NEW_TOKENS):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, 2)
        nxt = int(torch.argmax(logits))
        assert nxt == int(top.indices[0])
        out.append(nxt)
        margins.append(float(top.values[0] - top.values[1]))
        stats.append(step_stats(lp))
        ids.append(nxt)
    return out, margins, stats


def step_stats(lp):
    p = lp.exp()
    return {"top1": float(p.max()), "entropy": float(-(p * lp).sum())}


@torch.no_grad()
def teacher_forced(model, ids):
    logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    vals = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    return vals, [step_stats(lp[i]) for i in range(len(ids) - 1)]


def encode(tok, hf_tok, text):
    ids = tok.encode(text).ids  # add_special_tokens as the tokenizer says (none here)
    assert hf_tok(text)["input_ids"] == ids, "AutoTokenizer and tokenizer.json disagree on %r" % text
    return ids


def question_prompt(row):
    return "Question: " + row["question"] + "\nAnswer:"


def qa_text(row):
    return "Question: " + row["question"] + "\nAnswer: " + row["answer"]


def long_prompt(tok, hf_tok, train, test_row, target):
    """Few-shot GSM8K prompt of about `target` tokens ending in an open question."""
    shots, i = [], 0
    tail = question_prompt(test_row)
    while True:
        cand = "\n\n".join(shots + [qa_text(train[i])]) + "\n\n" + tail
        if len(encode(tok, hf_tok, cand)) > target:
            break
        shots.append(qa_text(train[i]))
        i += 1
    return "\n\n".join(shots) + "\n\n" + tail


def tf_sequences(tok, hf_tok, train, lengths, start):
    """GSM8K text cut to each length in tokens; each sequence starts at a different example."""
    seqs = []
    for n, length in enumerate(lengths):
        ids, i = [], start + 7 * n
        while len(ids) < length:
            ids += encode(tok, hf_tok, qa_text(train[i]) + "\n\n")
            i += 1
        seqs.append(ids[:length])
    return seqs


def tiny_cases(tok, hf_tok, train, test):
    """6 GSM8K questions, a 1-token prompt, a ~300-token few-shot prompt; 6 teacher-forced
    sequences from 5 to 450 tokens."""
    texts = [question_prompt(test[i]) for i in (0, 1, 2, 5, 10, 20)]
    texts += ["The", long_prompt(tok, hf_tok, train, test[30], 300)]
    prompts = [(t, encode(tok, hf_tok, t)) for t in texts]
    assert len(prompts[6][1]) == 1
    return prompts, tf_sequences(tok, hf_tok, train, [5, 24, 70, 150, 280, 450], start=100)


def default_cases(tok, hf_tok, train, test):
    """A GSM8K question, a 1-token prompt, a ChatML-formatted question; 3 teacher-forced
    sequences, the longest 700 tokens."""
    chat = hf_tok.apply_chat_template([{"role": "user", "content": test[3]["question"]}],
                                      tokenize=False, add_generation_prompt=True)
    texts = [question_prompt(test[4]), "She", chat]
    prompts = [(t, encode(tok, hf_tok, t)) for t in texts]
    assert len(prompts[1][1]) == 1
    return prompts, tf_sequences(tok, hf_tok, train, [9, 130, 700], start=300)


def make_reference(model, model_dir_rel, prompts, tf_ids, tok):
    probe = RouterProbe(model)
    ref = {"model_dir": model_dir_rel, "greedy": [], "teacher_forced": []}
    g_stats, t_stats = [], []
    print("  greedy:")
    for text, ids in prompts:
        out, margins, st = greedy(model, ids)
        g_stats += st
        ref["greedy"].append({"prompt": text, "input_ids": ids, "output_ids": out, "margins": margins})
        print("    %4d prompt tokens -> %s | min margin %.4f | %d distinct" % (
            len(ids), repr(tok.decode(out))[:70], min(margins), len(set(out))))
    for ids in tf_ids:
        lps, st = teacher_forced(model, ids)
        t_stats += st
        ref["teacher_forced"].append({"input_ids": ids, "logprobs": lps})
    ref_stats = summarize(ref, g_stats, t_stats, probe)
    for h in probe.handles:
        h.remove()
    return ref, ref_stats


def summarize(ref, g_stats, t_stats, probe):
    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))]
    margins = [m for g in ref["greedy"] for m in g["margins"]]
    for label, st in (("greedy steps", g_stats), ("teacher-forced positions", t_stats)):
        top1 = [s["top1"] for s in st]
        ent = [s["entropy"] for s in st]
        print("  %s (%d): top-1 prob p10/p50/p90 %.3f/%.3f/%.3f, entropy p10/p50/p90 %.2f/%.2f/%.2f nats"
              % (label, len(st), q(top1, .1), q(top1, .5), q(top1, .9), q(ent, .1), q(ent, .5), q(ent, .9)))
    print("  greedy margins: p10/p50/p90 %.3f/%.3f/%.3f, min %.2e, < 1e-2: %d of %d, < 1e-3: %d"
          % (q(margins, .1), q(margins, .5), q(margins, .9), min(margins),
             sum(m < 1e-2 for m in margins), len(margins), sum(m < 1e-3 for m in margins)))
    lps = [x for t in ref["teacher_forced"] for x in t["logprobs"] if x is not None]
    print("  teacher-forced: mean logprob %.3f over %d tokens (uniform would be %.3f)"
          % (sum(lps) / len(lps), len(lps), -math.log(2051)))
    mn, n_small, n = probe.min_gap_count(1e-3)
    print("  router: min gap between k-th and (k+1)-th logit %.2e, %d of %d below 1e-3" % (mn, n_small, n))
    return {"top1_g": q([s["top1"] for s in g_stats], .5), "top1_t": q([s["top1"] for s in t_stats], .5),
            "small_margins": sum(m < 1e-2 for m in margins), "router_min_gap": mn,
            "distinct": min(len(set(g["output_ids"])) for g in ref["greedy"])}


def write_json(path, ref):
    """One line per case field, so diffs stay readable; floats as repr."""
    lines = ["{", '"model_dir": %s,' % json.dumps(ref["model_dir"])]
    for key in ("greedy", "teacher_forced"):
        lines.append('"%s": [' % key)
        cases = []
        for case in ref[key]:
            fields = ["  %s: %s" % (json.dumps(k), json.dumps(v, separators=(",", ":"), ensure_ascii=False))
                      for k, v in case.items()]
            cases.append(" {\n" + ",\n".join(fields) + "\n }")
        lines.append(",\n".join(cases))
        lines.append("],")
    lines[-1] = "]"
    lines.append("}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == ref
    print("  wrote %s (%d bytes)" % (path, os.path.getsize(path)))


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-tests", default=os.path.join(REPO_ROOT, "tests", "data"))
    ap.add_argument("--out-models", default=os.path.join(REPO_ROOT, "models"))
    ap.add_argument("--gsm8k", default=None, help="folder with GSM8K train.jsonl and test.jsonl")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    tok = ensure_tokenizer()
    gsm = find_gsm8k(args.gsm8k)
    train = read_jsonl(os.path.join(gsm, "train.jsonl"))
    test = read_jsonl(os.path.join(gsm, "test.jsonl"))

    def rel(p):
        return os.path.relpath(os.path.abspath(p), REPO_ROOT)

    for spec, out_dir, ref_name, make_cases in (
        (TINY, os.path.join(args.out_tests, TINY["name"]), "reference-tiny-qwen3-moe.json", tiny_cases),
        (DEFAULT, os.path.join(args.out_models, DEFAULT["name"]), "reference-default.json", default_cases),
    ):
        print("%s:" % rel(out_dir))
        save_model(spec, tok, out_dir)
        hf_tok = AutoTokenizer.from_pretrained(out_dir)
        assert len(hf_tok) == tok.get_vocab_size(with_added_tokens=True)
        prompts, tf_ids = make_cases(tok, hf_tok, train, test)
        ref, _ = make_reference(load_f32(out_dir), rel(out_dir), prompts, tf_ids, tok)
        write_json(os.path.join(args.out_tests, ref_name), ref)

if __name__ == "__main__":
    main()
