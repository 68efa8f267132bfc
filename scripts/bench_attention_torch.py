#!/usr/bin/env python3
"""Decode and prefill attention through PyTorch on the GPU: the figures to set beside
`build/tests/test_cuda_attention --bench` (run both in one device call).

Qwen3-30B-A3B's attention shape (H 32, Hkv 4, Dh 128), batch 1, 8, 64, 256, context 1024, 2048
and 8192, bf16 and fp32, K and V contiguous per sequence ([B, Hkv, ctx, Dh]), one query token per
sequence. scaled_dot_product_attention is called two ways:
  gqa      q [B, H, 1, Dh] with enable_gqa=True (PyTorch picks the backend)
  grouped  q viewed as [B, Hkv, H / Hkv, Dh]: the query heads sharing a kv head become the query
           rows of one attention over that kv head (a decode token sees every cached position,
           so no mask), the form that lets the fused backends serve GQA decode
Timed with torch.cuda.Event after warm-up; GB/s counts the K and V bytes read, against a 1 GiB
device-to-device copy counted read + write. Then prefill: causal attention over 2048-token prompts,
1 and 8 sequences (q, k, v [B, H or Hkv, 2048, Dh], enable_gqa=True), with TFLOP/s counting
4 * pairs * H * Dh as the CUDA test does.

    python3 scripts/bench_attention_torch.py
"""
import math
import sys

import torch
import torch.nn.functional as F

H, HKV, DH = 32, 4, 128
BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 2048, 8192)
PREFILLS = ((1, 2048), (8, 2048))  # sequences, tokens each


def time_call(fn, budget_s=0.15):
    """Seconds per call: 2 warm-ups, a calibration call, then enough calls to fill budget_s."""
    for _ in range(2):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    once = e0.elapsed_time(e1) / 1e3
    iters = max(3, min(2000, int(budget_s / max(once, 1e-6))))
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3 / iters


def copy_bandwidth():
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    s = time_call(lambda: b.copy_(a))
    gbs = 2 * a.numel() * 4 / s / 1e9
    print(f"device copy 1 GiB: {s * 1e6:.1f} us, {gbs:.0f} GB/s (read + write)")
    return gbs


def main():
    if not torch.cuda.is_available():
        print("skipped: no GPU for PyTorch")
        return 0
    torch.manual_seed(0)
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: "
          f"scaled_dot_product_attention decode, H {H} Hkv {HKV} Dh {DH}")
    copy_gbs = copy_bandwidth()
    scale = 1.0 / math.sqrt(DH)
    for dtype in (torch.bfloat16, torch.float32):
        esize = torch.finfo(dtype).bits // 8
        for ctx in CONTEXTS:
            for B in BATCHES:
                k = torch.rand(B, HKV, ctx, DH, dtype=dtype, device="cuda") * 2 - 1
                v = torch.rand(B, HKV, ctx, DH, dtype=dtype, device="cuda") * 2 - 1
                q = torch.rand(B, H, 1, DH, dtype=dtype, device="cuda") * 2 - 1
                qg = q.view(B, HKV, H // HKV, DH)
                kv_bytes = 2 * B * HKV * ctx * DH * esize
                ways = {
                    "gqa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                  enable_gqa=True),
                    "grouped": lambda: F.scaled_dot_product_attention(qg, k, v, scale=scale),
                }
                row = []
                for name, fn in ways.items():
                    try:
                        s = time_call(fn)
                        gbs = kv_bytes / s / 1e9
                        row.append(f"{name} {s * 1e6:9.1f} us {gbs:6.0f} GB/s "
                                   f"{100 * gbs / copy_gbs:5.1f}%")
                    except (RuntimeError, torch.OutOfMemoryError) as e:
                        row.append(f"{name} failed: {str(e).splitlines()[0][:60]}")
                        torch.cuda.empty_cache()
                dname = str(dtype).replace("torch.", "")
                print(f"torch sdpa {dname:8s} B={B:<3d} ctx={ctx:<5d} KV {kv_bytes / 1e6:8.1f} MB  "
                      + "  |  ".join(row), flush=True)
                del k, v, q, qg
                torch.cuda.empty_cache()
    for dtype in (torch.bfloat16, torch.float32):
        for B, L in PREFILLS:
            q = torch.rand(B, H, L, DH, dtype=dtype, device="cuda") * 2 - 1
            k = torch.rand(B, HKV, L, DH, dtype=dtype, device="cuda") * 2 - 1
            v = torch.rand(B, HKV, L, DH, dtype=dtype, device="cuda") * 2 - 1
            pairs = B * L * (L + 1) / 2
            dname = str(dtype).replace("torch.", "")
            try:
                s = time_call(lambda: F.scaled_dot_product_attention(
                    q, k, v, scale=scale, is_causal=True, enable_gqa=True))
                print(f"torch sdpa {dname:8s} prefill {B} x {L} tokens causal: {s * 1e6:9.1f} us "
                      f"{4 * pairs * H * DH / s / 1e12:5.1f} TFLOP/s {B * L / s:9.0f} tokens/s",
                      flush=True)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                print(f"torch sdpa {dname:8s} prefill {B} x {L}: failed: {str(e).splitlines()[0][:60]}")
            del q, k, v
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
