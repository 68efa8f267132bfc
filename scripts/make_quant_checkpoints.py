#!/usr/bin/env python3
"""The test checkpoint in the two public quantized formats, from the BF16 one, with numpy alone.

    python3 scripts/make_quant_checkpoints.py   (from the repository root)

writes, beside tests/data/tiny-qwen3-moe/ (the same config, tokenizer and generation config):

  tiny-qwen3-moe-fp8/    DeepSeek-V3's block FP8: each quantized linear's `weight` as F8_E4M3 and
                         `weight_scale_inv` F32 [ceil(out / 128), ceil(in / 128)] with w = q s,
                         s = amax / 448 of the 128 x 128 block (1 for a zero block); config.json
                         gains quantization_config {quant_method fp8, fmt e4m3, activation_scheme
                         dynamic, weight_block_size [128, 128]}.
  tiny-qwen3-moe-nvfp4/  NVIDIA ModelOpt NVFP4: `weight` U8 [out, in / 2] (two E2M1 codes a byte,
                         the even element in the low nibble), `weight_scale` F8_E4M3 [out, in / 16],
                         `weight_scale_2` F32 0-d = amax / (6 448), `input_scale` F32 0-d; and
                         hf_quant_config.json plus config.json's quantization_config {quant_method
                         modelopt, quant_algo NVFP4, group_size 16, ignore [...]}.

Quantized: every q/k/v/o projection and every expert's and dense MLP's gate/up/down projection.
Left in BF16 (the ignore list): the router (mlp.gate), the embedding, lm_head and the norms, as
both formats' published checkpoints do. Rounding is to nearest, ties to even, saturating, in the
order kernels/cpu/quant.c computes (the scaled value w / s in fp32): tests/test_quant_ckpt.c checks
that the C quantizers give these files' bytes from the BF16 weights. input_scale has no
calibration data here: it is the amax of the embedding table over 6 x 448, a stand-in that W4A16
(how Hopper runs NVFP4) never reads. The bytes are the same on every run."""
import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe")
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def e4m3_values():
    """Values of the positive finite E4M3 codes 0x00 .. 0x7e, ascending."""
    v = []
    for c in range(127):
        e, m = c >> 3, c & 7
        v.append(m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(v, dtype=np.float64)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def nearest_code(a, vals):
    """Codes of the nearest values to a >= 0 (ties to the even code), saturating at the last."""
    mids = (vals[:-1] + vals[1:]) / 2
    idx = np.searchsorted(mids, a, side="left")
    tie = (idx < len(mids)) & (a == mids[np.minimum(idx, len(mids) - 1)])
    idx = np.where(tie & (idx % 2 == 1), idx + 1, idx)
    return np.minimum(idx, len(vals) - 1)


def to_e4m3(x):
    x = np.asarray(x, dtype=np.float32)
    code = nearest_code(np.abs(x).astype(np.float64), e4m3_values()).astype(np.uint8)
    code = np.where(np.abs(x) >= E4M3_MAX, 0x7E, code).astype(np.uint8)
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def from_e4m3(code):
    vals = np.concatenate([e4m3_values(), [np.nan]])
    v = vals[code & 0x7F].astype(np.float32)
    return np.where(code & 0x80, -v, v)


def to_e2m1(x):
    x = np.asarray(x, dtype=np.float32)
    code = nearest_code(np.abs(x).astype(np.float64), E2M1).astype(np.uint8)
    return code | np.where(np.signbit(x), 8, 0).astype(np.uint8)


def quant_fp8_blocks(w):
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((bn, bk), dtype=np.float32)
    for i in range(bn):
        for j in range(bk):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            a = np.float32(np.abs(blk).max())
            sc = np.float32(a / np.float32(E4M3_MAX)) if a > 0 else np.float32(1.0)
            s[i, j] = sc
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = to_e4m3(blk / sc)
    return q, s


def quant_nvfp4(w):
    n, k = w.shape
    a = np.float32(np.abs(w).max())
    s2 = np.float32(a / np.float32(E2M1_MAX * E4M3_MAX)) if a > 0 else np.float32(1.0)
    g = w.reshape(n, k // 16, 16)
    gmax = np.abs(g).max(axis=2).astype(np.float32)
    sf = to_e4m3(gmax / np.float32(np.float32(E2M1_MAX) * s2))
    scale = (from_e4m3(sf) * s2).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, :, None]
    codes = np.where(scale[:, :, None] > 0, to_e2m1(g / safe), 0).astype(np.uint8).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sf, s2


def quantized(name):
    return name.endswith("_proj.weight")


def main():
    index = json.load(open(os.path.join(SRC, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    with open(os.path.join(SRC, "config.json")) as f:
        config = json.load(f)
    bf16 = {}  # name -> uint16 array of BF16 bits
    for shard in shards:
        bf16.update(read_bf16_safetensors(os.path.join(SRC, shard)))
    embed = bf16_to_f32(bf16["model.embed_tokens.weight"])
    input_scale = np.float32(np.float32(np.abs(embed).max()) / np.float32(E2M1_MAX * E4M3_MAX))
    ignore = sorted({n.rsplit(".", 1)[0] for n in bf16 if n.endswith("weight") and not quantized(n)
                     and not n.endswith("norm.weight")})

    for fmt in ("fp8", "nvfp4"):
        dst = SRC + "-" + fmt
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(SRC, extra), dst)
        out = {}
        for name in sorted(bf16):
            raw = bf16[name]
            if not quantized(name):
                out[name] = bf16[name]
                continue
            w = bf16_to_f32(raw).reshape(raw.shape)
            base = name[: -len(".weight")]
            if fmt == "fp8":
                q, s = quant_fp8_blocks(w)
                out[name] = q  # written as F8_E4M3 below
                out[base + ".weight_scale_inv"] = s
            else:
                q, sf, s2 = quant_nvfp4(w)
                out[name] = q
                out[base + ".weight_scale"] = sf  # F8_E4M3 below
                out[base + ".weight_scale_2"] = np.array(s2, dtype=np.float32)
                out[base + ".input_scale"] = np.array(input_scale, dtype=np.float32)
        cfg = dict(config)
        if fmt == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
        else:
            cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                          "group_size": 16, "ignore": ignore}
            with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
                json.dump({"producer": {"name": "modelopt"},
                           "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                            "exclude_modules": ignore}}, f, indent=2)
                f.write("\n")
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(dst, "model.safetensors"), out, fmt)
        print("wrote", os.path.relpath(dst, ROOT))


def read_bf16_safetensors(path):
    """Every tensor of a safetensors file whose tensors are all BF16, as uint16 arrays (numpy has
    no BF16 type)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] != "BF16":
            sys.exit("%s: %s is %s, not BF16" % (path, name, h["dtype"]))
        b, e = h["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype="<u2").reshape(h["shape"]).copy()
    return out


def write_safetensors(path, tensors, fmt):
    """safetensors by hand: numpy has no F8 or BF16 type, and the header must name them."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype == np.float32:
            dt = "F32"
        elif t.dtype == np.uint8:
            fp8_codes = name.endswith(".weight_scale") or (fmt == "fp8" and quantized(name))
            dt = "F8_E4M3" if fp8_codes else "U8"
        elif t.dtype == np.uint16:
            dt = "BF16"
        else:
            sys.exit("unexpected dtype %s of %s" % (t.dtype, name))
        data = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


if __name__ == "__main__":
    main()
