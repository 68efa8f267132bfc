"""Side-by-side peer for scripts/bench_cpu.sh: Hugging Face transformers (PyTorch, CPU) decoding
the same checkpoint greedily with its KV cache, in BF16 (the checkpoint's dtype) and float32.
Prints decode tokens/s measured the same way: (time of N+1 tokens - time of 1 token) / N.

usage: python3 scripts/bench_peer_transformers.py MODEL_DIR [N] [THREADS]"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def best_time(model, ids, new_tokens, reps=3):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, use_cache=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    model_dir = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else torch.get_num_threads()
    torch.set_num_threads(threads)
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        model.generation_config.pad_token_id = 0
        t1 = best_time(model, ids, 1)
        tn = best_time(model, ids, n + 1)
        s = (tn - t1) / n
        print(f"{model_dir:30s} transformers {str(dtype)[6:]:8s} decode {1 / s:7.1f} tok/s  "
              f"{1000 * s:.2f} ms/token ({threads} threads, torch {torch.__version__})")
        del model


if __name__ == "__main__":
    main()
