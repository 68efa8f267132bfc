#!/usr/bin/env python3
"""Requests that share a prompt prefix, sent together to a running server (POST /generate):

  n       one request with sampling_params.n = N over a prompt of P token ids;
  batch   B requests at once, each a prefix of P ids (the same for all) plus 20 ids of its own.

For each: the wall time, and the prompt tokens the server reports as cached (meta_info.
cached_tokens) against the prompt tokens sent. The prefix cache is flushed before each run, so
any sharing happens between the requests of the run. Standard library only.

  python3 scripts/bench_shared_prefill.py --port 30000 [--prompt 1000] [--n 8] [--batch 16]
      [--max-new-tokens 8] [--repeat 3]
"""
import argparse
import json
import random
import threading
import time
import urllib.request


def post(port, path, body):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        raw = r.read()
        return json.loads(raw) if r.headers.get_content_type() == "application/json" else None


def ids(seed, n, vocab):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run_n(a, vocab):
    prompt = ids(1, a.prompt, vocab)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": a.max_new_tokens, "n": a.n,
                                                     "ignore_eos": True, "temperature": 0}}
    t0 = time.time()
    out = post(a.port, "/generate", body)
    dt = time.time() - t0
    cached = sum(x["meta_info"]["cached_tokens"] for x in out)
    return dt, cached, a.n * len(prompt)


def run_batch(a, vocab):
    prefix = ids(2, a.prompt, vocab)
    bodies = [{"input_ids": prefix + ids(100 + i, 20, vocab),
               "sampling_params": {"max_new_tokens": a.max_new_tokens, "ignore_eos": True, "temperature": 0}}
              for i in range(a.batch)]
    outs = [None] * a.batch

    def one(i):
        outs[i] = post(a.port, "/generate", bodies[i])
    ts = [threading.Thread(target=one, args=(i,)) for i in range(a.batch)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.time() - t0
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return dt, cached, sum(len(b["input_ids"]) for b in bodies)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--prompt", type=int, default=1000)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    info = urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % a.port, timeout=60).read()
    max_len = json.loads(info)["data"][0]["max_model_len"]
    if a.prompt + 20 + a.max_new_tokens > max_len:
        raise SystemExit("--prompt %d does not fit the context length %d" % (a.prompt, max_len))
    vocab = 2048  # below every model's vocabulary here (the tiny models have 2051)
    for name, fn in (("n = %d, prompt %d" % (a.n, a.prompt), run_n),
                     ("%d requests sharing %d tokens" % (a.batch, a.prompt), run_batch)):
        times = []
        for _ in range(a.repeat):
            post(a.port, "/flush_cache", {})
            dt, cached, total = fn(a, vocab)
            times.append(dt)
        times.sort()
        print("%-36s median %.3f s (of %d), %d of %d prompt tokens cached" %
              (name, times[len(times) // 2], a.repeat, cached, total), flush=True)


if __name__ == "__main__":
    main()
