#!/usr/bin/env python3
"""Serving benchmark for `moeserve serve`, after SGLang's bench_serving (backend sglang).

N requests, each a random GSM8K question ("Question: ...\\nAnswer:"), are sent at a fixed
concurrency as POST /generate with stream true, temperature 0, ignore_eos and a fixed output
length. Per request: E2E latency, TTFT (time to the first chunk with text), ITL (time between
chunks, divided over the tokens a chunk adds, from the growth of meta_info.completion_tokens), TPOT
((E2E - TTFT) / (output tokens - 1)). Prints SGLang's "Serving Benchmark Result" block, then the
scheduler's own figures (steps, time per step in and outside the forward pass) from GET
/get_server_info internal_states[0] or, failing that, GET /metrics, read before and after the run,
when the server reports them.

Prompts: --input-len-max N truncates each prompt to N tokens. The client has no tokenizer, so the
prompts are tokenized by the server before the timed run (POST /generate with max_new_tokens 0 and
input logprobs, whose entries carry the ids), sent as input_ids, and the prefix cache is flushed
before the timed run starts. Without it the prompts go as text.

Standard library only:
    python3 scripts/bench_serving.py --port 30000 --num-prompts 200 --concurrency 8 --output-len 128
"""
import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATASET = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


def request_json(host, port, method, path, body=None, timeout=600):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError("%s %s: HTTP %d %s" % (method, path, r.status, data[:300]))
        try:
            return json.loads(data)
        except ValueError:  # /flush_cache answers plain text, as SGLang's does
            return data.decode("utf-8", "replace")
    finally:
        conn.close()


def load_prompts(path, n, seed):
    with open(path) as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    rng = random.Random(seed)
    return ["Question: %s\nAnswer:" % rng.choice(questions) for _ in range(n)]


def tokenize_on_server(host, port, prompts, max_len):
    """Prompt ids via the server's tokenizer, each cut to max_len; the prefix cache is flushed after."""
    out = []
    for i in range(0, len(prompts), 64):
        body = {"text": prompts[i:i + 64], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0}
        for ans in request_json(host, port, "POST", "/generate", body):
            out.append([e[1] for e in ans["meta_info"]["input_token_logprobs"]][:max_len])
    request_json(host, port, "POST", "/flush_cache", {})
    return out


class Result:
    __slots__ = ("ok", "error", "prompt_len", "output_len", "ttft", "itl", "latency")

    def __init__(self):
        self.ok = False
        self.error = ""
        self.prompt_len = 0
        self.output_len = 0
        self.ttft = 0.0
        self.itl = []
        self.latency = 0.0


def one_request(host, port, prompt, output_len):
    """One streamed /generate; timing as SGLang's async_request_sglang_generate."""
    res = Result()
    body = {"sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
            "stream": True, "return_logprob": False, "logprob_start_len": -1, "lora_path": None}
    body["input_ids" if isinstance(prompt, list) else "text"] = prompt
    conn = http.client.HTTPConnection(host, port, timeout=600)
    st = time.perf_counter()
    last = st
    try:
        conn.request("POST", "/generate", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            res.error = "HTTP %d %s" % (r.status, r.read()[:200])
            return res
        n_seen = 0
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            data = json.loads(payload)
            now = time.perf_counter()
            mi = data.get("meta_info") or {}
            n = mi.get("completion_tokens", n_seen)
            if data.get("text") or n > n_seen:
                if res.ttft == 0.0:
                    res.ttft = now - st
                elif n > n_seen:
                    gap = (now - last) / (n - n_seen)
                    res.itl.extend([gap] * (n - n_seen))
                last = now
                n_seen = n
            res.prompt_len = mi.get("prompt_tokens", res.prompt_len)
        res.output_len = n_seen
        res.latency = time.perf_counter() - st
        res.ok = n_seen > 0
        if not res.ok:
            res.error = "no output tokens"
    except (OSError, ValueError, http.client.HTTPException) as e:
        res.error = "%s: %s" % (type(e).__name__, e)
    finally:
        conn.close()
    return res


def run(host, port, prompts, output_len, concurrency):
    results = [None] * len(prompts)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            results[i] = one_request(host, port, prompts[i], output_len)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metrics_state(host, port):
    """n_steps / step_*_seconds from the Prometheus counters of GET /metrics (--enable-metrics)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode("utf-8", "replace")
        if r.status != 200:
            return {}
    except OSError:
        return {}
    finally:
        conn.close()
    out = {}
    wanted = (("steps_total", "n_steps"), ("scheduler_seconds_total", "step_sched_seconds"),
              ("forward_seconds_total", "step_forward_seconds"), ("sample_seconds_total", "step_sample_seconds"))
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split()[0]
        for suffix, key in wanted:
            if name.endswith(suffix) and key not in out:
                try:
                    out[key] = float(line.rsplit(None, 1)[1])
                except ValueError:
                    pass
    return out


def server_state(host, port):
    """internal_states[0] of GET /get_server_info (or /server_info), completed from /metrics."""
    state = {}
    for path in ("/get_server_info", "/server_info"):
        try:
            info = request_json(host, port, "GET", path)
            state = dict((info.get("internal_states") or [{}])[0])
            break
        except (OSError, RuntimeError, ValueError, AttributeError):
            continue
    if "n_steps" not in state or "step_sched_seconds" not in state:
        for k, v in metrics_state(host, port).items():
            state.setdefault(k, v)
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--output-len", type=int, default=128, help="new tokens per request (ignore_eos)")
    ap.add_argument("--input-len-max", type=int, default=0, help="cut prompts to this many tokens (0: whole)")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="GSM8K jsonl (question, answer)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1, help="requests sent (and not timed) first")
    args = ap.parse_args()
    if args.num_prompts < 1 or args.concurrency < 1 or args.output_len < 1:
        ap.error("--num-prompts, --concurrency and --output-len must be >= 1")

    prompts = load_prompts(args.dataset, args.num_prompts, args.seed)
    if args.input_len_max > 0:
        prompts = tokenize_on_server(args.host, args.port, prompts, args.input_len_max)
    for i in range(args.warmup):
        w = one_request(args.host, args.port, prompts[i % len(prompts)], min(args.output_len, 16))
        if not w.ok:
            sys.exit("warm-up request failed: %s" % w.error)
    if args.input_len_max > 0 or args.warmup:
        request_json(args.host, args.port, "POST", "/flush_cache", {})

    before = server_state(args.host, args.port)
    results, duration = run(args.host, args.port, prompts, args.output_len, args.concurrency)
    after = server_state(args.host, args.port)

    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print("request failed: %s" % r.error, file=sys.stderr)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    e2e = [r.latency * 1000 for r in ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1]
    itl = [x * 1000 for r in ok for x in r.itl]

    def line(label, value, fmt="{:<10.2f}"):
        print("{:<40} {}".format(label, fmt.format(value) if not isinstance(value, str) else value))

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Backend:", "sglang (moeserve)")
    line("Traffic request rate:", "inf")
    line("Max request concurrency:", str(args.concurrency))
    line("Successful requests:", str(len(ok)))
    line("Benchmark duration (s):", duration)
    line("Total input tokens:", str(total_in))
    line("Total generated tokens:", str(total_out))
    line("Request throughput (req/s):", len(ok) / duration)
    line("Input token throughput (tok/s):", total_in / duration)
    line("Output token throughput (tok/s):", total_out / duration)
    line("Total token throughput (tok/s):", (total_in + total_out) / duration)
    line("Concurrency:", sum(e2e) / 1000 / duration)
    for title, name, xs in (("End-to-End Latency", "E2E Latency", e2e), ("Time to First Token", "TTFT", ttft),
                            ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
                            ("Inter-Token Latency", "ITL", itl)):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line("Mean %s (ms):" % name, statistics.mean(xs) if xs else 0.0)
        line("Median %s (ms):" % name, statistics.median(xs) if xs else 0.0)
        line("P99 %s (ms):" % name, pct(xs, 99))
    print("=" * 50)

    keys = ("n_steps", "step_sched_seconds", "step_forward_seconds")
    if all(isinstance(before.get(k), (int, float)) and isinstance(after.get(k), (int, float)) for k in keys):
        steps = after["n_steps"] - before["n_steps"]
        sched = after["step_sched_seconds"] - before["step_sched_seconds"]
        fwd = after["step_forward_seconds"] - before["step_forward_seconds"]
        per = lambda x: x / steps * 1e6 if steps else 0.0
        print("{s:{c}^{n}}".format(s="Scheduler (server side)", n=50, c="-"))
        line("Steps:", str(steps))
        line("Forward time per step (us):", per(fwd))
        line("Time outside forward per step (us):", per(sched))
        if isinstance(after.get("step_sample_seconds"), (int, float)):
            sample = after["step_sample_seconds"] - before.get("step_sample_seconds", 0.0)
            line("  of which scoring and sampling (us):", per(sample))
            line("  of which scheduling (us):", per(sched - sample))
        line("Outside-forward share of step time (%):", 100.0 * sched / (sched + fwd) if sched + fwd > 0 else 0.0)
        print("=" * 50)
    elif after:
        print("server internal_states[0]: %s" % json.dumps(after))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
