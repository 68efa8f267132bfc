"""PyTorch's grouped GEMM (torch._grouped_mm, where this PyTorch has it) on the MoE shapes of
tests/test_cuda_moe.c, to set beside its figures: the two GEMMs of the experts (gate+up, then
down) over tokens grouped by expert, balanced routing, BF16, timed with CUDA events.

    python3 scripts/bench_grouped_mm_torch.py

Prints one line per shape: microseconds for both GEMMs and TFLOP/s; or why it could not run."""
import sys

import torch


def bench(fn, warm=3, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / reps  # microseconds


def main():
    if not torch.cuda.is_available():
        print("no GPU")
        return 1
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    if not hasattr(torch, "_grouped_mm"):
        print("torch._grouped_mm: not in this PyTorch")
        return 0
    shapes = [("Qwen3-30B-A3B", 128, 2048, 768, 8), ("DeepSeek-V3-like", 256, 7168, 2048, 8)]
    for name, E, D, F, K in shapes:
        for T in (64, 4096):
            pairs = T * K
            per = pairs // E
            if per * E != pairs:
                continue
            offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * per
            x = torch.randn(pairs, D, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(pairs, F, device="cuda", dtype=torch.bfloat16)
            # weights as [E, K, N] with the last two dims column-major (the layout it asks for)
            w1 = torch.randn(E, 2 * F, D, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
            w2 = torch.randn(E, D, F, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
            try:
                us = bench(lambda: (torch._grouped_mm(x, w1, offs=offs),
                                    torch._grouped_mm(h, w2, offs=offs)))
            except Exception as e:  # the private API changes between versions
                print(f"{name} T={T}: torch._grouped_mm failed: {str(e).splitlines()[0]}")
                continue
            flops = 2.0 * pairs * D * 2 * F + 2.0 * pairs * F * D
            print(f"{name} T={T} ({per} tokens per expert): {us:.1f} us, "
                  f"{flops / us / 1e6:.1f} TFLOP/s (two GEMMs, no SiLU, no gather/scatter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
