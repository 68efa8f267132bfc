#!/usr/bin/env python3
"""End-to-end tests of `moeserve serve --enable-deterministic-inference` (issue 9, the CPU part).

The mode promises a request the same bits whatever else the server is doing. Every comparison
here is exact: output ids, and every input and output logprob as the JSON float the server wrote
(a float32 printed to round-trip), compared with ==; no tolerance anywhere. The checks, on
tests/data/tiny-qwen3-moe (8 experts, top-2, 4 layers, context 512; ids < 2048, 2048 is eos):

  flags   /server_info says enable_deterministic_inference true with the flag and false without.
  batch   one prompt at temperature 0 sent as batches of 1, 2, 4, 8, 16 and 32 copies (one
          /generate with a list of prompts), and as 32 concurrent requests: one unique output
          (ids, output logprobs, input logprobs from position 0, top-3 logprobs of each).
  match   SGLang's input/output match: 16 prompts of 1..440 ids generate 64 tokens at
          temperature 1 with a seed and return_logprob, all at once; then prompt + output are
          replayed with max_new_tokens 0 and logprob_start_len 0, all at once: the last 64 input
          logprobs equal the output logprobs (so their KL is exactly 0).
  sample  sampled requests with a seed (sampling_seed on /generate, seed on /v1/completions), and
          an unseeded one (the mode's fixed seed): the same answer twice alone, and twice more
          while 24 other requests run.
  cache   a 333-id prompt scored from position 300: uncached after /flush_cache, then cached by
          its own earlier run, then cached by another request that shares its first 320 ids,
          then uncached again after /flush_cache, and scored from position 0 (never cached):
          the same logprobs every time; a generation replayed as a prompt that is scored only
          over its outputs reuses the KV its decode steps wrote, and gives the same logprobs.
  cli     `moeserve generate` with the flag gives the server's bits, greedy and sampled.
  load    200 requests (prompts of 1..300 ids, a third sharing prefixes, greedy and seeded
          sampling, some with penalties, some scoring their prompt, some with top logprobs) each
          run alone, then all with random arrival times over 1.5 s (about a third of their solo
          time): each answer equals its solo run.
  tight   40 requests of 40..80 outputs at once in a KV pool of 640 tokens: requests are
          preempted and recomputed (/metrics counts the preemptions), and each answer still
          equals its solo run.
  ranks   mpirun -np 1, 2, 3, 4 and 8 (experts split over the ranks, tokens through the
          shared-memory all-to-all, one thread a rank): np 1 with prefill chunks of 16 tokens and
          pages of 8, np 2 with chunks of 48, np 4, np 8 with chunks of 32, requests spread over
          the ranks' ports; np 3 balanced, every request sent to rank 0 and relayed. All at once, then staggered: every answer equals
          the single process's (two threads, chunks of 512). Skipped, with a line saying so,
          when mpirun is not installed.
  quant   the block-FP8 and NVFP4 checkpoints: batches of 1..16 and the input/output match
          (4 prompts); FP8 also under mpirun -np 2 against one process.

On the GPU machine, DET_TEST_DEVICE_FLAGS="--device cuda --cuda-graph-max-bs 16" (say) adds its
flags to every server and `generate` started here; the groups that need several ranks on one
device (ranks, and quant's np 2) are then left out, with a line saying so
(scripts/gpu_ep_compare.py --deterministic checks two GPUs against one).

Standard library only. `python3 tests/test_determinism.py [GROUP...]` runs the groups named
(default all). The binary is ${BUILD:-build}/moeserve. Each check prints "ok name" or "FAIL name:
detail" (the first differences: position, the two values); the last line is "N passed, M
failed"; exit status 0 only when nothing failed. Every server started is stopped at the end of
its group whatever happens; when $DET_TEST_PIDFILE names a file, the process groups still alive
are listed there for tests/determinism_test.sh to kill if this script is itself killed.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "moeserve")
MODEL = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe")
MPIRUN = shutil.which("mpirun")
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
FLAG = "--enable-deterministic-inference"
STARTUP_TIMEOUT = 60.0
REQUEST_TIMEOUT = 120.0
PIDFILE = os.environ.get("DET_TEST_PIDFILE")
DEVICE_FLAGS = os.environ.get("DET_TEST_DEVICE_FLAGS", "").split()
EOS = 2048  # ids of prompts stay below it

# ---------------------------------------------------------------------------------------------
# Results


R = harness.Results(cut=1200)
short = harness.short
free_port_block = harness.free_port_block


def check(name, ok, detail=""):
    return R.check(name, ok, detail)


# ---------------------------------------------------------------------------------------------
# HTTP and servers


def http_json(port, method, path, body=None, timeout=REQUEST_TIMEOUT):
    return harness.http_json(port, method, path, body, timeout)


LIVE = []
LIVE_LOCK = threading.Lock()


def write_pidfile():
    if not PIDFILE:
        return
    with LIVE_LOCK:
        lines = ["pgid %d" % s.proc.pid for s in LIVE if s.proc is not None]
    try:
        with open(PIDFILE + ".tmp", "w") as f:
            f.write("".join(line + "\n" for line in lines))
        os.replace(PIDFILE + ".tmp", PIDFILE)
    except OSError:
        pass


class Server(harness.Logged):
    """np 0: one plain `moeserve serve`; np >= 1: mpirun -np np of them on ports base..base+np-1.
    In a session of its own, so that one killpg reaches mpirun and every rank."""

    def __init__(self, name, np=0, flags=(FLAG,), threads=None, model=MODEL):
        self.name = name
        self.model = model
        self.np = np
        self.n_ranks = max(np, 1)
        self.flags = list(flags)
        self.threads = threads
        self.proc = None
        self.log = None
        self.base = None
        self.cmd = []

    @property
    def ports(self):
        return [self.base + r for r in range(self.n_ranks)]

    def launch(self):
        self.base = free_port_block(self.n_ranks)
        cmd = [BIN, "serve", "--model-path", self.model, "--host", "127.0.0.1", "--port", str(self.base)]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        cmd += self.flags + DEVICE_FLAGS
        if self.np:
            cmd = [MPIRUN] + MPIRUN_FLAGS + ["-np", str(self.np)] + cmd
        self.cmd = cmd
        tag = re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")
        self.open_log("moeserve-det-%s-" % tag)
        env = dict(os.environ)
        if self.np:
            env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        with LIVE_LOCK:
            LIVE.append(self)
        write_pidfile()

    def start(self):
        self.launch()
        deadline = time.time() + STARTUP_TIMEOUT
        pending = list(self.ports)
        while pending and time.time() < deadline and self.proc.poll() is None:
            still = []
            for port in pending:
                try:
                    status, _, _ = http_json(port, "GET", "/health", timeout=5)
                except harness.NOT_READY:
                    status = 0
                if status != 200:
                    still.append(port)
            pending = still
            if pending:
                time.sleep(0.1)
        if pending:
            why = "exited with %s" % self.proc.returncode if self.proc.poll() is not None else "not healthy in time"
            check("%s: starts" % self.name, False, "%s (%s)\n    %s" % (why, " ".join(self.cmd), self.log_tail()))
            return False
        return True

    def stop(self):
        self.end()
        with LIVE_LOCK:
            if self in LIVE:
                LIVE.remove(self)
        write_pidfile()

    def post(self, path, body, rank=0):
        status, parsed, raw = http_json(self.ports[rank], "POST", path, body)
        if status != 200 or parsed is None:
            raise RuntimeError("POST %s on rank %d: HTTP %d %s" % (path, rank, status, short(raw)))
        return parsed

    def generate(self, body, rank=0):
        return self.post("/generate", body, rank)

    def flush(self):
        status, _, raw = http_json(self.ports[0], "POST", "/flush_cache", {})
        if status != 200:
            raise RuntimeError("POST /flush_cache: HTTP %d %s" % (status, short(raw)))

    def server_info(self, rank=0):
        status, info, raw = http_json(self.ports[rank], "GET", "/server_info", timeout=10)
        if status != 200 or not isinstance(info, dict):
            raise RuntimeError("GET /server_info: HTTP %d %s" % (status, short(raw)))
        return info


def stop_all():
    with LIVE_LOCK:
        servers = list(LIVE)
    for s in servers:
        s.stop()


def concurrently(jobs):
    """jobs: [(delay s, fn)]; each in its own thread after its delay. Results (or the exception
    each raised) in job order."""
    out = [None] * len(jobs)

    def one(i, delay, fn):
        if delay:
            time.sleep(delay)
        try:
            out[i] = fn()
        except Exception as e:  # reported by the caller's comparison
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, d, f), daemon=True) for i, (d, f) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 30)
    return out


# ---------------------------------------------------------------------------------------------
# Exact comparison


def logprob_values(entries):
    """The logprob column of [[logprob, id, text], ...] (None where the server wrote null)."""
    return [e[0] for e in entries]


def fingerprint(ans):
    """Everything a deterministic answer fixes: ids and every logprob, exactly."""
    if isinstance(ans, Exception):
        return ("error", str(ans))
    mi = ans.get("meta_info", {})

    def tops(key):  # [[logprob, id, text] x N] or null per position
        return tuple(tuple(tuple(e[:2]) for e in row) if row else None for row in mi.get(key, []) or [])

    return (tuple(ans.get("output_ids", [])),
            tuple(tuple(e[:2]) for e in mi.get("output_token_logprobs", []) or []),
            tuple(tuple(e[:2]) for e in mi.get("input_token_logprobs", []) or []),
            tops("output_top_logprobs"), tops("input_top_logprobs"))


def first_diffs(a, b, n=3):
    """Where fingerprints a and b differ: the first n positions of each part, as text."""
    if isinstance(a, tuple) and a and a[0] == "error" or isinstance(b, tuple) and b and b[0] == "error":
        return "%s vs %s" % (short(a, 200), short(b, 200))
    out = []
    for part, x, y in zip(("output_ids", "output logprobs", "input logprobs", "output top logprobs",
                           "input top logprobs"), a, b):
        if x == y:
            continue
        if len(x) != len(y):
            out.append("%s: %d vs %d entries" % (part, len(x), len(y)))
            continue
        d = [(i, x[i], y[i]) for i in range(len(x)) if x[i] != y[i]]
        out.append("%s differ at %d positions, first %s" % (part, len(d), d[:n]))
    return "; ".join(out)


def same(name, answers, ref=None, detail=""):
    """One check: every answer's fingerprint equals ref's (or the first answer's)."""
    fps = [fingerprint(a) for a in answers]
    want = fingerprint(ref) if ref is not None else fps[0]
    bad = [(i, fp) for i, fp in enumerate(fps) if fp != want]
    if bad:
        i, fp = bad[0]
        return check(name, False, "%d of %d differ; answer %d: %s" % (len(bad), len(fps), i, first_diffs(want, fp)))
    n_lp = len(want[1]) + len(want[2]) if want and want[0] != "error" else 0
    return check(name, True, "%d answers, %d logprobs each%s" % (len(fps), n_lp, ", " + detail if detail else ""))


def ids(rng, n):
    return [rng.randrange(3, EOS) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Groups


def group_flags():
    s = Server("without the flag", flags=())
    try:
        if s.start():
            v = s.server_info().get("enable_deterministic_inference")
            check("/server_info without the flag: enable_deterministic_inference false", v is False, repr(v))
    finally:
        s.stop()


def case_server_info(s):
    v = s.server_info().get("enable_deterministic_inference")
    check("%s: /server_info says enable_deterministic_inference true" % s.name, v is True, repr(v))


def case_batch(s, sizes=(1, 2, 4, 8, 16, 32), label="batch"):
    rng = random.Random(9001)
    prompt = ids(rng, 45)
    req = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
           "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    answers = []
    sizes = list(sizes)
    for n in sizes:
        body = dict(req, input_ids=[list(prompt) for _ in range(n)])
        out = s.generate(body)
        answers += out if isinstance(out, list) else [out]
    s.flush()
    answers += concurrently([(0, lambda: s.generate(dict(req, input_ids=prompt))) for _ in range(max(sizes))])
    fps = {fingerprint(a) for a in answers}
    name = "%s: one prompt at temperature 0 in batches of %d..%d" % (label, min(sizes), max(sizes))
    detail = "%d answers in batches of %s and %d concurrent requests" % (len(answers), sizes, max(sizes))
    if len(fps) == 1:
        check(name + ": one unique output, identical logprobs and top-3 logprobs", True,
              detail + ", %d logprobs each" % (len(answers[0]["meta_info"]["input_token_logprobs"]) + 32))
    else:
        same(name + ": one unique output (%d unique)" % len(fps), answers)


MATCH_LENGTHS = [1, 3, 7, 12, 20, 33, 50, 64, 90, 128, 160, 200, 256, 300, 380, 440]
MATCH_NEW = 64


def case_match(s, lengths=MATCH_LENGTHS, label="match"):
    rng = random.Random(4711)
    prompts = [ids(rng, n) for n in lengths]
    gen = concurrently([(0, (lambda p=p, i=i: s.generate({
        "input_ids": p, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "sampling_seed": 1000 + i, "max_new_tokens": MATCH_NEW,
                            "ignore_eos": True}})))
        for i, p in enumerate(prompts)])
    failed = [g for g in gen if isinstance(g, Exception)]
    if failed:
        check("%s: %d generations answer" % (label, len(prompts)), False, short(failed[0]))
        return
    replay = concurrently([(0, (lambda p=p, g=g: s.generate({
        "input_ids": p + g["output_ids"], "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0}})))
        for p, g in zip(prompts, gen)])
    problems = []
    n_eq = 0
    for p, g, r in zip(prompts, gen, replay):
        if isinstance(r, Exception):
            problems.append("%d ids: replay failed: %s" % (len(p), r))
            continue
        out = logprob_values(g["meta_info"]["output_token_logprobs"])
        inp = logprob_values(r["meta_info"]["input_token_logprobs"])
        if len(out) != MATCH_NEW or len(inp) != len(p) + MATCH_NEW:
            problems.append("%d ids: %d output and %d input logprobs" % (len(p), len(out), len(inp)))
            continue
        tail = inp[-MATCH_NEW:]
        if tail != out:
            d = [(i, tail[i], out[i]) for i in range(MATCH_NEW) if tail[i] != out[i]]
            problems.append("%d ids: %d of %d differ, first (position, input, output) %s"
                            % (len(p), len(d), MATCH_NEW, d[:3]))
        else:
            n_eq += MATCH_NEW
    check("%s: %d prompts of %d..%d ids, %d sampled tokens replayed as input: input logprobs == output"
          " logprobs (KL 0)" % (label, len(prompts), min(lengths), max(lengths), MATCH_NEW),
          not problems, "%d pairs equal" % n_eq if not problems else "; ".join(problems[:4]))


def load_requests(rng, n):
    """n bodies for the background load: prompts of 5..200 ids, greedy and sampled."""
    out = []
    for i in range(n):
        sp = {"max_new_tokens": rng.randrange(4, 24), "ignore_eos": True}
        if i % 2:
            sp.update(temperature=0.7, sampling_seed=rng.randrange(1 << 30))
        else:
            sp.update(temperature=0)
        out.append({"input_ids": ids(rng, rng.randrange(5, 200)), "sampling_params": sp})
    return out


def case_sample(s):
    rng = random.Random(31337)
    prompt = ids(rng, 70)
    seeded = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
              "sampling_params": {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "sampling_seed": 123456789,
                                  "max_new_tokens": 48, "ignore_eos": True}}
    unseeded = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}}
    explicit42 = json.loads(json.dumps(unseeded))
    explicit42["sampling_params"]["sampling_seed"] = 42
    openai = {"model": "x", "prompt": prompt, "max_tokens": 32, "temperature": 0.8, "seed": 77, "logprobs": 1}
    noise = load_requests(rng, 24)

    def openai_fp(a):
        if isinstance(a, Exception):
            return ("error", str(a))
        c = a["choices"][0]
        return (c["text"], tuple(c["logprobs"]["token_logprobs"]), tuple(c["logprobs"]["tokens"]))

    openai["model"] = s.server_info()["served_model_name"]
    alone = {k: [] for k in ("seeded", "unseeded", "openai")}
    loaded = {k: [] for k in alone}
    for _ in range(2):
        alone["seeded"].append(s.generate(seeded))
        alone["unseeded"].append(s.generate(unseeded))
        alone["openai"].append(s.post("/v1/completions", openai))
    for _ in range(2):
        jobs = [(0.02 * i, (lambda b=b: s.generate(b))) for i, b in enumerate(noise)]
        jobs += [(0.1, lambda: s.generate(seeded)), (0.2, lambda: s.generate(unseeded)),
                 (0.3, lambda: s.post("/v1/completions", openai))]
        out = concurrently(jobs)
        loaded["seeded"].append(out[-3])
        loaded["unseeded"].append(out[-2])
        loaded["openai"].append(out[-1])
    same("sample: seeded request (temperature 0.9, top_p, top_k) twice alone and twice under load",
         alone["seeded"] + loaded["seeded"])
    same("sample: unseeded request twice alone and twice under load (the mode's fixed seed)",
         alone["unseeded"] + loaded["unseeded"])
    same("sample: the unseeded request equals sampling_seed 42", [s.generate(explicit42)], alone["unseeded"][0])
    fps = [openai_fp(a) for a in alone["openai"] + loaded["openai"]]
    check("sample: /v1/completions with seed twice alone and twice under load", len(set(fps)) == 1,
          "%d answers" % len(fps) if len(set(fps)) == 1 else "%d unique: %s" % (len(set(fps)), short(fps, 600)))
    differs = fingerprint(alone["seeded"][0])[0] != fingerprint(s.generate(dict(
        seeded, sampling_params=dict(seeded["sampling_params"], sampling_seed=987654321))))[0]
    check("sample: another seed gives other tokens (the seed is used)", differs)


def case_cache(s):
    rng = random.Random(2718)
    prefix = ids(rng, 320)
    prompt = prefix + ids(rng, 13)
    other = prefix + ids(rng, 29)
    start = 300

    def body(p, start_len, sampled):
        sp = {"max_new_tokens": 16, "ignore_eos": True}
        sp.update({"temperature": 0.8, "sampling_seed": 5} if sampled else {"temperature": 0})
        return {"input_ids": p, "return_logprob": True, "logprob_start_len": start_len, "sampling_params": sp}

    for sampled in (False, True):
        kind = "sampled" if sampled else "greedy"
        runs, cached = [], []

        def run(p=prompt, start_len=start):
            a = s.generate(body(p, start_len, sampled))
            cached.append(a["meta_info"]["cached_tokens"])
            return a

        s.flush()
        runs.append(run())                # uncached
        runs.append(run())                # cached by its own first run
        s.flush()
        s.generate(body(other, -1, sampled))  # another request warms the shared 320-id prefix
        runs.append(run())
        s.flush()
        runs.append(run())                # uncached again
        full = s.generate(body(prompt, 0, sampled))  # scored from 0: nothing can come from the cache
        ok_cache = cached[0] == 0 and cached[1] >= 256 and cached[2] >= 256 and cached[3] == 0
        check("cache (%s): cached_tokens uncached, cached, cached by a shared prefix, after flush" % kind,
              ok_cache, "cached_tokens %s" % cached)
        same("cache (%s): the same logprobs from position %d uncached, cached, and after /flush_cache"
             % (kind, start), runs, detail="cached_tokens %s" % cached)
        fa, fr = fingerprint(full), fingerprint(runs[0])
        ok = fa[0] == fr[0] and fa[1] == fr[1] and fa[2][start:] == fr[2]
        check("cache (%s): scored from position 0 (never cached), the same logprobs from %d on" % (kind, start),
              ok, "" if ok else first_diffs((fr[0], fr[1], fa[2][:start] + fr[2]), fa))
    # KV written by decode steps, read back by a later prefill
    g = s.generate(body(prompt, -1, True) | {"sampling_params": {"temperature": 1.0, "sampling_seed": 8,
                                                                  "max_new_tokens": 48, "ignore_eos": True}})
    full = prompt + g["output_ids"]
    n_scored = 16
    r = s.generate({"input_ids": full, "return_logprob": True, "logprob_start_len": len(full) - n_scored,
                    "sampling_params": {"max_new_tokens": 0}})
    inp = logprob_values(r["meta_info"]["input_token_logprobs"])
    out = logprob_values(g["meta_info"]["output_token_logprobs"])
    ok = inp[1:] == out[-n_scored + 1:] and r["meta_info"]["cached_tokens"] > len(prompt)
    check("cache: a generation replayed over the KV its decode steps cached: input logprobs == output logprobs",
          ok, "cached_tokens %d of %d, %d logprobs" % (r["meta_info"]["cached_tokens"], len(full), n_scored - 1)
          if ok else "cached %d; input %s; output %s" % (r["meta_info"]["cached_tokens"], inp[1:4], out[-n_scored + 1:][:3]))


def case_cli(s):
    """`moeserve generate --enable-deterministic-inference` (one process, one request) gives the
    server's bits, greedy and sampled."""
    rng = random.Random(77)
    prompt = ids(rng, 57)
    for temp, seed in ((0, 0), (0.9, 31)):
        cmd = [BIN, "generate", "--model-path", MODEL, "--input-ids", ",".join(map(str, prompt)),
               "--max-new-tokens", "20", "--ignore-eos", "--return-logprob", "--logprob-start-len", "0",
               "--temperature", str(temp), "--seed", str(seed), FLAG] + DEVICE_FLAGS
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120)
        try:
            cli = json.loads(p.stdout.decode())
        except ValueError:
            check("cli: generate %s answers JSON" % FLAG, False, short((p.stdout + p.stderr).decode("utf-8", "replace")))
            continue
        body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"temperature": temp, "sampling_seed": seed, "max_new_tokens": 20,
                                    "ignore_eos": True}}
        same("cli: generate %s at temperature %g equals the server" % (FLAG, temp), [s.generate(body)], cli)


def mixed_requests(seed, n):
    """n varied requests: prompts of 1..300 ids (a third extend one of four shared prefixes),
    greedy or sampled with a seed, some scoring part of the prompt."""
    rng = random.Random(seed)
    prefixes = [ids(rng, rng.randrange(40, 200)) for _ in range(4)]
    reqs = []
    for i in range(n):
        if i % 3 == 0:
            p = rng.choice(prefixes) + ids(rng, rng.randrange(1, 60))
        else:
            p = ids(rng, rng.choice([1, 2, 5, rng.randrange(1, 300)]))
        sp = {"max_new_tokens": rng.randrange(1, 20), "ignore_eos": rng.random() < 0.8}
        if rng.random() < 0.5:
            sp["temperature"] = 0
        else:
            sp.update(temperature=rng.choice([0.5, 1.0, 1.3]), sampling_seed=rng.randrange(1 << 40))
            if rng.random() < 0.5:
                sp["top_p"] = 0.8
        if rng.random() < 0.2:
            sp.update(rng.choice([{"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.3}]))
        body = {"input_ids": p, "sampling_params": sp, "return_logprob": True}
        if rng.random() < 0.3:
            body["logprob_start_len"] = rng.randrange(0, len(p))
        if rng.random() < 0.2:
            body["top_logprobs_num"] = rng.choice([1, 5])
        reqs.append(body)
    return reqs


LOAD_WINDOW = 1.5  # seconds the 200 arrivals spread over: about a third of their solo run time


def case_load(s):
    reqs = mixed_requests(424242, 200)
    t0 = time.time()
    solo = []
    for b in reqs:
        try:
            solo.append(s.generate(b))
        except Exception as e:
            solo.append(e)
    t_solo = time.time() - t0
    rng = random.Random(99)
    arrivals = sorted(rng.uniform(0, LOAD_WINDOW) for _ in reqs)
    order = list(range(len(reqs)))
    rng.shuffle(order)
    t0 = time.time()
    out = concurrently([(arrivals[k], (lambda b=reqs[i]: s.generate(b))) for k, i in enumerate(order)])
    t_load = time.time() - t0
    loaded = [None] * len(reqs)
    for k, i in enumerate(order):
        loaded[i] = out[k]
    bad = [i for i in range(len(reqs)) if fingerprint(loaded[i]) != fingerprint(solo[i])
           or isinstance(solo[i], Exception)]
    check("load: 200 requests with random arrival times each equal their solo run",
          not bad, "solo %.1f s, under load %.1f s" % (t_solo, t_load) if not bad else
          "%d differ; request %d (%d ids): %s" % (len(bad), bad[0], len(reqs[bad[0]]["input_ids"]),
                                                  first_diffs(fingerprint(solo[bad[0]]), fingerprint(loaded[bad[0]]))))


def rank_requests():
    """The requests every rank group is compared on: prompts of 1..300 ids, greedy and sampled,
    scoring their prompts from 0."""
    rng = random.Random(55)
    reqs = []
    for i, n in enumerate([1, 6, 23, 64, 131, 200, 300, 17, 45, 90]):
        sp = {"max_new_tokens": 12, "ignore_eos": True}
        sp.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "sampling_seed": 600 + i})
        reqs.append({"input_ids": ids(rng, n), "return_logprob": True, "logprob_start_len": 0, "sampling_params": sp})
    return reqs


RANK_REF = []


def case_rank_reference(s):
    RANK_REF[:] = [s.generate(b) for b in rank_requests()]


def group_ranks():
    if MPIRUN is None:
        print("skip ranks: mpirun not found (apt-get install openmpi-bin)", flush=True)
        return
    if not RANK_REF:
        check("ranks: the single-process reference exists", False, "the main group did not make it")
        return
    reqs = rank_requests()
    # np 1 and 2 cut prompts into small prefill chunks (a 300-id prompt takes 19 steps at 16),
    # np 1 with pages of 8; np 3 balances: everything is sent to rank 0 and relayed. np 4 and 8
    # (issue 11's rank counts, here on the CPU: the test checkpoint's 8 experts two and one a rank)
    # take requests on every port, np 8 with chunks of 32.
    setups = {1: ["--no-load-balance", "--chunked-prefill-size", "16", "--page-size", "8"],
              2: ["--no-load-balance", "--chunked-prefill-size", "48"],
              3: [],
              4: ["--no-load-balance"],
              8: ["--no-load-balance", "--chunked-prefill-size", "32"]}
    for np in (1, 2, 3, 4, 8):
        s = Server("np %d %s" % (np, " ".join(setups[np]) or "balanced"), np=np, flags=[FLAG] + setups[np],
                   threads=1)
        spread = np if setups[np] else 1  # ports the requests are sent to
        try:
            if not s.start():
                continue
            case_server_info(s)
            jobs = [(0, (lambda b=b, r=i % spread: s.generate(b, rank=r))) for i, b in enumerate(reqs)]
            out = concurrently(jobs)
            bad = [i for i in range(len(reqs)) if fingerprint(out[i]) != fingerprint(RANK_REF[i])]
            check("ranks: %s, %d requests at once: bit-identical to one process" % (s.name, len(reqs)),
                  not bad, "" if not bad else "%d differ; request %d: %s" %
                  (len(bad), bad[0], first_diffs(fingerprint(RANK_REF[bad[0]]), fingerprint(out[bad[0]]))))
            rng = random.Random(np)
            plan = [(rng.randrange(len(reqs)), rng.randrange(spread), round(rng.uniform(0, 1.5), 3)) for _ in range(24)]
            out = concurrently([(d, (lambda b=reqs[i], r=r: s.generate(b, rank=r))) for i, r, d in plan])
            bad = [k for k, (i, _, _) in enumerate(plan) if fingerprint(out[k]) != fingerprint(RANK_REF[i])]
            check("ranks: %s, 24 staggered arrivals: bit-identical to one process" % s.name,
                  not bad, "" if not bad else "%d differ; request %d: %s" %
                  (len(bad), plan[bad[0]][0], first_diffs(fingerprint(RANK_REF[plan[bad[0]][0]]), fingerprint(out[bad[0]]))))
        except Exception as e:
            check("ranks: %s runs" % s.name, False, "%s: %s\n    %s" % (type(e).__name__, e, s.log_tail()))
        finally:
            s.stop()


def metric(s, name):
    status, _, raw = http_json(s.ports[0], "GET", "/metrics", timeout=10)
    m = re.search(r"^%s(?:\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), raw, re.M)
    return float(m.group(1)) if status == 200 and m else None


def group_tight():
    """A KV pool of 640 tokens (a little more than one 512-token context): 40 requests of 20..150
    prompt ids and 40..80 outputs, sent at once, keep running out of pages, so requests are
    preempted and recomputed (prompt + outputs so far through prefill) while others decode. Each
    answer must still equal the same request's solo run on that server."""
    rng = random.Random(6060)
    reqs = []
    for i in range(40):
        sp = {"max_new_tokens": rng.randrange(40, 80), "ignore_eos": True}
        sp.update({"temperature": 0} if i % 2 else {"temperature": 1.0, "sampling_seed": rng.randrange(1 << 30)})
        body = {"input_ids": ids(rng, rng.randrange(20, 150)), "return_logprob": True, "sampling_params": sp}
        if i % 3 == 0:
            body["logprob_start_len"] = 0
        reqs.append(body)
    s = Server("tight", flags=[FLAG, "--max-total-tokens", "640", "--enable-metrics"])
    try:
        if not s.start():
            return
        solo = [s.generate(b) for b in reqs]
        before = metric(s, "moeserve:num_preemptions_total") or 0
        t0 = time.time()
        out = concurrently([(0, (lambda b=b: s.generate(b))) for b in reqs])
        took = time.time() - t0
        after = metric(s, "moeserve:num_preemptions_total")
        pre = after - before if after is not None else None
        bad = [i for i in range(len(reqs)) if fingerprint(out[i]) != fingerprint(solo[i])]
        check("tight: %d requests at once in a 640-token KV pool, preempted and recomputed, each equal their solo"
              " run" % len(reqs), not bad and pre is not None and pre > 0,
              "%d preemptions, %.1f s" % (pre, took) if not bad and pre else
              "%s preemptions; %d differ%s" % (pre, len(bad), "; request %d: %s" % (bad[0], first_diffs(
                  fingerprint(solo[bad[0]]), fingerprint(out[bad[0]]))) if bad else ""))
    finally:
        s.stop()


def group_quant():
    """The block-FP8 and NVFP4 checkpoints (experts quantized, activations quantized per token on
    their way in): batch invariance and the input/output match; FP8 also under mpirun -np 2."""
    for fmt in ("fp8", "nvfp4"):
        model = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe-" + fmt)
        s = Server(fmt, model=model)
        ref = []
        reqs = rank_requests()[:6]
        try:
            if not s.start():
                continue
            case_batch(s, sizes=(1, 4, 16), label="%s batch" % fmt)
            case_match(s, lengths=[5, 64, 200, 400], label="%s match" % fmt)
            ref = [s.generate(b) for b in reqs]
        except Exception as e:
            check("%s runs" % fmt, False, "%s: %s\n    %s" % (type(e).__name__, e, s.log_tail()))
        finally:
            s.stop()
        if fmt != "fp8" or not ref or MPIRUN is None:
            continue
        if DEVICE_FLAGS:
            print("fp8 np 2: left out with DET_TEST_DEVICE_FLAGS (several ranks on one device)", flush=True)
            continue
        g = Server("fp8 np 2", np=2, flags=[FLAG, "--no-load-balance"], threads=1, model=model)
        try:
            if not g.start():
                continue
            out = concurrently([(0, (lambda b=b, r=i % 2: g.generate(b, rank=r))) for i, b in enumerate(reqs)])
            bad = [i for i in range(len(reqs)) if fingerprint(out[i]) != fingerprint(ref[i])]
            check("fp8: np 2, %d requests spread over the ranks: bit-identical to one process" % len(reqs), not bad,
                  "" if not bad else "%d differ; request %d: %s" % (len(bad), bad[0], first_diffs(
                      fingerprint(ref[bad[0]]), fingerprint(out[bad[0]]))))
        except Exception as e:
            check("fp8 np 2 runs", False, "%s: %s\n    %s" % (type(e).__name__, e, g.log_tail()))
        finally:
            g.stop()


MAIN_CASES = {"batch": case_batch, "match": case_match, "sample": case_sample, "cache": case_cache,
              "cli": case_cli, "load": case_load}


def group_main(names):
    s = Server("deterministic")
    try:
        if not s.start():
            return
        case_server_info(s)
        for name in names:
            try:
                MAIN_CASES[name](s)
            except Exception as e:
                check("%s runs" % name, False, "%s: %s\n    %s" % (type(e).__name__, e, s.log_tail()))
        case_rank_reference(s)
    finally:
        s.stop()


def main(argv):
    known = ["flags"] + list(MAIN_CASES) + ["tight", "ranks", "quant"]
    groups = [a for a in argv if not a.startswith("-")] or known
    unknown = [g for g in groups if g not in known]
    if unknown:
        print("unknown groups %s; known: %s" % (unknown, " ".join(known)))
        return 2
    if not os.access(BIN, os.X_OK):
        check("binary %s exists" % BIN, False, "build it first (make)")
        print("%d passed, %d failed" % (R.passed, R.failed))
        return 1
    t0 = time.time()
    try:
        if "flags" in groups:
            group_flags()
        group_main([g for g in groups if g in MAIN_CASES])
        if "tight" in groups:
            group_tight()
        if "ranks" in groups and DEVICE_FLAGS:
            print("ranks: left out with DET_TEST_DEVICE_FLAGS (several ranks on one device)", flush=True)
        elif "ranks" in groups:
            group_ranks()
        if "quant" in groups:
            group_quant()
    finally:
        stop_all()
    print("total %.1f s" % (time.time() - t0), flush=True)
    print("%d passed, %d failed" % (R.passed, R.failed), flush=True)
    return 0 if R.failed == 0 else 1


def on_signal(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sys.exit(main(sys.argv[1:]))
