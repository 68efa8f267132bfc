#!/usr/bin/env python3
"""Expert parallelism on GPUs against one GPU: the same requests to `moeserve serve --device cuda`
alone and to `mpirun -np N moeserve serve --device cuda --moe-a2a-backend T`, prompt and output
logprobs compared position by position (greedy, so the tokens must agree too).

    scripts/gpu_ep_compare.py [--np 2] [--backends nvlink_one_sided,nccl] [--model DIR] [--dummy]
                              [--deterministic] [--graphs N] [--device cuda|cpu]
                              [--combine auto|slots|partial]

--dummy serves a config.json-only folder with random weights (--load-format dummy
--skip-tokenizer-init; every weight is seeded by its name, so each rank's experts are the single
GPU's), e.g. --model config/models/qwen3-30b-a3b.

Requests: 12 prompts of random token ids of 5 to 400 tokens, 24 greedy tokens each, with
return_logprob and logprob_start_len 0; sent all at once, spread over the ranks, so the ranks'
batches differ in size from step to step (and some ranks have none); then again spread the other
way after /flush_cache on every rank; then once more with the prefix cache holding every prompt.
Prints one line per check and "N passed, M failed" last; exit 1 on any failure. The tolerance is
2e-2, BF16's (the whole-model check's): the all-to-all carries fp32 activations and brings every
slot's output home to be summed in slot order, so the experts give the single GPU's bits, but
which tokens share a step depends on when requests arrive (and, warm, on the prefix cache), and
the dense GEMMs' kernels are chosen by the step's size (the deterministic mode's business). The
worst difference is printed, and how many rounds gave the single GPU's bits exactly.
--deterministic serves every run with --enable-deterministic-inference, and then every round
must give the single GPU's bits exactly (a check of its own). --graphs N serves every run with
--cuda-graph-max-bs N: decode steps replay CUDA graphs, under mpirun too (nvlink_one_sided; the
nccl transport cannot be captured and runs eagerly); without it every run has --disable-cuda-graph.
--combine passes --moe-a2a-combine to the ranks (auto, the default, passes nothing: partial on
GPUs, slots on CPUs and in the deterministic mode). With the partial form (each owner rank's
weighted sum in BF16) a near tie may pick another greedy token, so it is checked apart: at least
3 requests in 4 with one GPU's tokens, and the mean |dlogprob| within 2e-2 over the positions
before each request's first differing token.
--device cpu runs the same with CPU ranks (oversubscribed, OpenMPI yielding when idle) and the shm
transport unless --backends names another: a dry run of a GPU script (scripts/gpu_scale.sh) on a
machine without GPU."""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "moeserve")
TOL = 2e-2
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    print(("ok   " if ok else "FAIL ") + name + (": " + detail if detail else ""), flush=True)
    if ok:
        passed += 1
    else:
        failed += 1


def post(port, body, timeout=300):
    req = urllib.request.Request("http://127.0.0.1:%d/generate" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def flush(port):
    req = urllib.request.Request("http://127.0.0.1:%d/flush_cache" % port, b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status == 200


def healthy(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(cmd, ports, log):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            return proc, False
        if all(healthy(p) for p in ports):
            return proc, True
        time.sleep(0.5)
    return proc, False


def stop(proc):
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, 9)
        proc.wait()


def run(ports, reqs):
    """Every request at once, request i to ports[i % len(ports)]."""
    out = [None] * len(reqs)

    def one(i):
        try:
            out[i] = post(ports[i % len(ports)], reqs[i])
        except Exception as e:  # reported by the caller as a missing answer
            out[i] = {"error": str(e)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def logprobs(ans):
    mi = ans["meta_info"]
    return [x[0] for x in mi["input_token_logprobs"][1:]] + [x[0] for x in mi["output_token_logprobs"]]


def same_prefix_diffs(ans, ref):
    """|dlogprob| at the positions of ans and ref before the first output token they differ in
    (from there on they score different tokens or prefixes)."""
    a, b = logprobs(ans), logprobs(ref)
    n = len(b) - len(ref["meta_info"]["output_token_logprobs"])
    for x, y in zip(ans["output_ids"], ref["output_ids"]):
        if x != y:
            break
        n += 1
    return [abs(x - y) for x, y in zip(a[:n], b[:n])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backends", default="nvlink_one_sided,nccl")
    ap.add_argument("--model", default=os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe"))
    ap.add_argument("--port", type=int, default=32000)
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp/gpu-ep"))
    ap.add_argument("--dummy", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--graphs", type=int, default=0,
                    help="--cuda-graph-max-bs for every server (decode steps as CUDA graphs)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--combine", choices=("auto", "slots", "partial"), default="auto")
    a = ap.parse_args()
    partial = a.combine == "partial" or (a.combine == "auto" and a.device == "cuda"
                                         and not a.deterministic)
    mpirun_flags = []
    if a.device == "cpu":
        mpirun_flags = ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
        if a.backends == ap.get_default("backends"):
            a.backends = "shm"
    vocab = 2048  # the test checkpoint's ids below its end-of-text token
    if a.dummy:
        with open(os.path.join(a.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
    os.makedirs(a.log_dir, exist_ok=True)
    rng = random.Random(11)
    reqs = []
    for i in range(12):
        n = rng.choice([5, 17, 64, 150, 400])
        reqs.append({"input_ids": [rng.randrange(vocab) for _ in range(n)], "return_logprob": True,
                     "logprob_start_len": 0,
                     "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
    serve = ["serve", "--model-path", a.model, "--device", a.device, "--host", "127.0.0.1"]
    if a.dummy:
        serve += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if a.deterministic:
        serve += ["--enable-deterministic-inference"]
    # without --graphs every run is eager (the GPU's default would replay graphs)
    serve += ["--cuda-graph-max-bs", str(a.graphs)] if a.graphs else ["--disable-cuda-graph"]
    with open(os.path.join(a.log_dir, "single.log"), "w") as log:
        proc, up = start([BIN] + serve + ["--port", str(a.port)], [a.port], log)
        check("one GPU: the server starts", up)
        ref = run([a.port], reqs) if up else []
        stop(proc)
    if not up:
        return
    check("one GPU: every request answered", all("meta_info" in r for r in ref))
    for backend in a.backends.split(","):
        ports = [a.port + 10 + r for r in range(a.np)]
        cmd = ["mpirun", "--allow-run-as-root"] + mpirun_flags + ["-np", str(a.np), "-x",
               "NCCL_NVLS_ENABLE", "-x", "LD_LIBRARY_PATH", BIN] + serve + ["--port", str(ports[0]),
                                                        "--moe-a2a-backend", backend]
        if a.combine != "auto":
            cmd += ["--moe-a2a-combine", a.combine]
        with open(os.path.join(a.log_dir, "ep-%s.log" % backend), "w") as log:
            proc, up = start(cmd, ports, log)
            check("np %d %s: every rank starts" % (a.np, backend), up)
            got = run(ports, reqs) if up else []
            if up:
                flushed = all(flush(p) for p in ports)
                check("np %d %s: /flush_cache on every rank" % (a.np, backend), flushed)
                got_again = run(list(reversed(ports)), reqs)
                got_warm = run(ports, reqs)
            stop(proc)
        if not up:
            continue
        exact = 0
        for name, res in (("spread", got), ("spread the other way, cache flushed", got_again),
                          ("prefix cache warm", got_warm)):
            answered = all("meta_info" in r for r in res)
            check("np %d %s %s: every request answered" % (a.np, backend, name), answered,
                  "" if answered else str([r.get("error") for r in res if "error" in r][:2]))
            if not answered:
                continue
            if partial:
                label = "np %d %s %s, partial combine" % (a.np, backend, name)
                diffs = [d for r, s in zip(res, ref) for d in same_prefix_diffs(r, s)]
                n_same = sum(r["output_ids"] == s["output_ids"] for r, s in zip(res, ref))
                mean = sum(diffs) / max(len(diffs), 1)
                check("%s: one GPU's greedy tokens in 3 requests of 4 or more" % label,
                      4 * n_same >= 3 * len(ref), "%d of %d" % (n_same, len(ref)))
                check("%s: mean |dlogprob| within %g of one GPU's" % (label, TOL), mean <= TOL,
                      "mean %.3g, max %.3g over %d positions" % (mean, max(diffs, default=0),
                                                                   len(diffs)))
                continue
            same_tokens = all(r["output_ids"] == s["output_ids"] for r, s in zip(res, ref))
            worst = max(abs(x - y) for r, s in zip(res, ref)
                        for x, y in zip(logprobs(r), logprobs(s)))
            n = sum(len(logprobs(s)) for s in ref)
            check("np %d %s %s: greedy tokens equal one GPU's" % (a.np, backend, name), same_tokens)
            check("np %d %s %s: logprobs within %g of one GPU's" % (a.np, backend, name, TOL),
                  worst <= TOL, "worst |diff| %.3g over %d positions" % (worst, n))
            exact += worst == 0
        if partial:
            continue
        print("np %d %s: %d of 3 rounds gave one GPU's logprobs bit for bit" % (a.np, backend, exact),
              flush=True)
        if a.deterministic:
            check("np %d %s, deterministic: every round gives one GPU's logprobs bit for bit"
                  % (a.np, backend), exact == 3, "%d of 3" % exact)


if __name__ == "__main__":
    try:
        main()
    finally:
        print("%d passed, %d failed" % (passed, failed), flush=True)
    sys.exit(1 if failed else 0)
