#!/usr/bin/env python3
"""End-to-end tests of `moeserve serve`: start the real binary, talk real HTTP.

Covers the wire formats of ../shared/notes/api.md (SGLang native /generate and the OpenAI-compatible
/v1 endpoints) and the "Must show" list of issue 3: logprobs equal to the CLI's, batch and prefix
cache invariance, 32 concurrent well-formed streams, every bad-input case answered with a 4xx JSON
error while the server goes on serving, client disconnects, metrics.

Standard library only. Run from anywhere: `python3 tests/test_http.py [-v] [GROUP...]`, where the
groups are the servers started (main, noradix, apikey, context, body, tight, queue, tokfree, weights,
dummy). tokfree and dummy cover --skip-tokenizer-init: token ids in and out, on the test model
and on a folder that holds only config.json (--load-format dummy), driven by moeserve-bench too.
The binary is ${BUILD:-build}/moeserve. Each check prints "FAIL name: detail" when it fails (-v
prints passes too); the last line is "N passed, M failed". Exit status 0 only when nothing
failed.

Several servers are started one after the other, each on a free port, each killed at the end of
its group whatever happens.
"""
import http.client
import json
import math
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "moeserve")
MODEL = "models/tiny-qwen3-moe"
with open(os.path.join(ROOT, MODEL, "config.json")) as _f:
    _CONFIG = json.load(_f)
VOCAB = _CONFIG["vocab_size"]
MAX_POS = _CONFIG["max_position_embeddings"]
STARTUP_TIMEOUT = 60.0
LOGPROB_TOL = 1e-4  # issue 3: the same within 1e-4 alone / in a batch / from the cache

VERBOSE = False


# ---------------------------------------------------------------------------------------------
# Results


class Results:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.lock = threading.Lock()

    def check(self, name, ok, detail=""):
        with self.lock:
            if ok:
                self.passed += 1
                if VERBOSE:
                    print("ok   %s" % name, flush=True)
            else:
                self.failed += 1
                detail = str(detail)
                if len(detail) > 600:
                    detail = detail[:600] + "..."
                print("FAIL %s: %s" % (name, detail), flush=True)
        return ok

    def summary(self):
        return "%d passed, %d failed" % (self.passed, self.failed)


R = Results()


def check(name, ok, detail=""):
    return R.check(name, ok, detail)


def short(obj, n=300):
    s = obj if isinstance(obj, str) else json.dumps(obj) if not isinstance(obj, bytes) else repr(obj)
    return s if len(s) <= n else s[:n] + "..."


# ---------------------------------------------------------------------------------------------
# HTTP


class Reply:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-case names
        self.body = body

    def json(self):
        try:
            return json.loads(self.body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None

    def __repr__(self):
        return "HTTP %d %s" % (self.status, short(self.body.decode("utf-8", "replace")))


def http_request(port, method, path, body=None, headers=None, timeout=120):
    """One request on a fresh connection. body: bytes as is, anything else as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = dict(headers or {})
        if body is not None and not isinstance(body, (bytes, bytearray)):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    finally:
        conn.close()


def free_port():
    return harness.free_port_block(1)


class Server:
    """A `moeserve serve` process on a free port; its output goes to a temporary log file."""

    def __init__(self, name, flags=(), api_key=None, model=MODEL):
        self.name = name
        self.model = model
        self.flags = list(flags)
        self.api_key = api_key
        self.port = None
        self.proc = None
        self.log = None

    def headers(self, extra=None):
        h = {}
        if self.api_key:
            h["Authorization"] = "Bearer " + self.api_key
        h.update(extra or {})
        return h

    def start(self):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="moeserve-%s-" % self.name, suffix=".log", delete=False)
        cmd = [BIN, "serve", "--model-path", self.model, "--host", "127.0.0.1", "--port", str(self.port)] + self.flags
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + STARTUP_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                r = http_request(self.port, "GET", "/health", headers=self.headers(), timeout=5)
                if r.status == 200:
                    return True
            except harness.NOT_READY:
                pass
            time.sleep(0.1)
        return False

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n=15):
        try:
            with open(self.log.name, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
            return "\n    ".join(lines[-n:])
        except OSError:
            return ""

    def log_from(self, marker):
        """The log from the first line holding marker to the end (a sanitizer's report at exit)."""
        tail = self.log_tail(1 << 30).split("\n    ")
        at = next((i for i, line in enumerate(tail) if marker in line), 0)
        return "\n    ".join(tail[at:])

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    # requests with this server's key
    def get(self, path, headers=None, timeout=120):
        return http_request(self.port, "GET", path, headers=self.headers(headers), timeout=timeout)

    def post(self, path, body, headers=None, timeout=120):
        return http_request(self.port, "POST", path, body=body, headers=self.headers(headers), timeout=timeout)

    def post_stream(self, path, body, timeout=120):
        """POST with stream true; returns (Reply with the whole raw body, event list or error)."""
        r = self.post(path, body, timeout=timeout)
        return r, parse_sse(r.body)


def parse_sse(raw):
    """Strictly parse `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`.
    Returns (events, error): events are the decoded JSON objects; error is None or why the stream
    is malformed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], "not UTF-8: %s" % e
    if not text.endswith("\n\n"):
        return [], "does not end with a blank line: %r" % text[-80:]
    parts = text[:-2].split("\n\n")
    events = []
    for i, p in enumerate(parts):
        if not p.startswith("data: "):
            return events, "event %d does not start with 'data: ': %r" % (i, p[:80])
        payload = p[6:]
        if payload == "[DONE]":
            if i != len(parts) - 1:
                return events, "[DONE] is event %d of %d" % (i, len(parts))
            return events, None
        if "\n" in payload:
            return events, "event %d spans lines: %r" % (i, payload[:80])
        try:
            events.append(json.loads(payload))
        except ValueError as e:
            return events, "event %d is not JSON (%s): %r" % (i, e, payload[:80])
    return events, "no data: [DONE] at the end"


# ---------------------------------------------------------------------------------------------
# Helpers over the API


def gen(srv, payload, timeout=120):
    return srv.post("/generate", payload, timeout=timeout)


def gen_ok(srv, name, payload):
    """POST /generate, check 200 + JSON; returns the parsed body or None."""
    r = gen(srv, payload)
    body = r.json()
    if not check(name + ": HTTP 200 with JSON", r.status == 200 and body is not None, "%r for %s" % (r, short(payload))):
        return None
    return body


def prompt_ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def f32(x):
    return None if x is None else struct.pack("<f", x)


def logprob_values(entries):
    return [e[0] for e in entries]


def max_abs_diff(a, b):
    """Largest |a_i - b_i| over two lists of floats-or-None (None must face None)."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return math.inf
            continue
        worst = max(worst, abs(x - y))
    return worst


def same_bits(a, b):
    """First index where two float lists differ as float32, or -1."""
    if len(a) != len(b):
        return min(len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        if f32(x) != f32(y):
            return i
    return -1


def cli_generate(args, model=MODEL):
    cmd = [BIN, "generate", "--model-path", model] + args
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(cmd), p.returncode, p.stderr.decode()[-300:]))
    return json.loads(p.stdout)


def cli_tokenize(text, add_special=True):
    cmd = [BIN, "tokenize", "--model-path", MODEL] + (["--add-special-tokens"] if add_special else [])
    p = subprocess.run(cmd, cwd=ROOT, input=text.encode(), capture_output=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(cmd), p.returncode, p.stderr.decode()[-300:]))
    return json.loads(p.stdout)


def metrics_types(text):
    """{metric name: type} from the # TYPE lines of Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"#\s*TYPE\s+(\S+)\s+(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def metrics_samples(text):
    """[(name, labels, value)] of the sample lines."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+-?\d+)?\s*$", line)
        if m:
            try:
                out.append((m.group(1), m.group(2) or "", float(m.group(3))))
            except ValueError:
                pass
    return out


def find_metric(types, kind, *words):
    """First metric of this type whose name contains any of the words."""
    for name, t in types.items():
        if t == kind and any(w in name.lower() for w in words):
            return name
    return None


def metric_value(samples, name):
    for n, _, v in samples:
        if n == name:
            return v
    return None


def queue_counts(srv):
    """(running, waiting) from /metrics, or None when metrics are off."""
    r = srv.get("/metrics", timeout=10)
    if r.status != 200:
        return None
    text = r.body.decode("utf-8", "replace")
    types = metrics_types(text)
    samples = metrics_samples(text)
    run = find_metric(types, "gauge", "running")
    wait = find_metric(types, "gauge", "waiting", "queue")
    if run is None:
        return None
    return metric_value(samples, run), (metric_value(samples, wait) if wait else 0.0)


def health_ok(srv, after):
    try:
        r = srv.get("/health", timeout=10)
        ok = r.status == 200
        detail = repr(r)
    except OSError as e:
        ok, detail = False, "%s (server %s)" % (e, "alive" if srv.alive() else "dead: " + srv.log_tail())
    return check("still serving after %s" % after, ok, detail)


# ---------------------------------------------------------------------------------------------
# Tests on the main server (radix cache on, --enable-metrics)


def test_health_and_info(srv):
    r = srv.get("/health")
    check("GET /health 200", r.status == 200, r)
    r = srv.get("/health_generate")
    check("GET /health_generate 200", r.status == 200, r)
    for path in ("/get_model_info", "/model_info"):
        r = srv.get(path)
        b = r.json()
        ok = r.status == 200 and isinstance(b, dict)
        ok = ok and isinstance(b.get("model_path"), str) and isinstance(b.get("tokenizer_path"), str)
        ok = ok and b.get("is_generation") is True
        check("GET %s shape (model_path, tokenizer_path, is_generation)" % path, ok, r)
        if ok:
            tp = b["tokenizer_path"]
            tp_abs = tp if os.path.isabs(tp) else os.path.join(ROOT, tp)
            check("%s tokenizer_path is a folder with tokenizer.json" % path,
                  os.path.isfile(os.path.join(tp_abs, "tokenizer.json")), tp)
    for path in ("/get_server_info", "/server_info"):
        r = srv.get(path)
        b = r.json()
        ok = r.status == 200 and isinstance(b, dict)
        states = b.get("internal_states") if ok else None
        ok = ok and isinstance(states, list) and len(states) > 0 and isinstance(states[0], dict)
        ok = ok and isinstance(states[0].get("last_gen_throughput"), (int, float))
        check("GET %s internal_states[0].last_gen_throughput" % path, ok, r)
        check("GET %s kv_cache_dtype float32 (the default)" % path,
              isinstance(b, dict) and b.get("kv_cache_dtype") == "float32", short(b))
        check("GET %s no CUDA graphs on the CPU (cuda_graph_max_bs 0, disable_cuda_graph)" % path,
              isinstance(b, dict) and b.get("cuda_graph_max_bs") == 0
              and b.get("disable_cuda_graph") is True, short(b))
        check("GET %s has disable_radix_cache false" % path,
              isinstance(b, dict) and b.get("disable_radix_cache") is False, short(b))
    r = srv.get("/v1/models")
    b = r.json()
    ok = r.status == 200 and isinstance(b, dict) and b.get("object") == "list"
    data = b.get("data") if ok else None
    ok = ok and isinstance(data, list) and len(data) >= 1
    if ok:
        m = data[0]
        ok = (isinstance(m.get("id"), str) and m.get("object") == "model" and isinstance(m.get("created"), int)
              and isinstance(m.get("owned_by"), str) and isinstance(m.get("root"), str)
              and m.get("max_model_len") == MAX_POS)
    check("GET /v1/models shape (id, object, created, owned_by, root, max_model_len %d)" % MAX_POS, ok, r)


def model_name(srv):
    b = srv.get("/v1/models").json()
    try:
        return b["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return "default"


def test_logprobs_equal_cli(srv):
    ids = prompt_ids(1, 40)
    ref = cli_generate(["--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "0", "--return-logprob",
                        "--logprob-start-len", "0"])
    b = gen_ok(srv, "teacher-forced /generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                  "return_logprob": True, "logprob_start_len": 0})
    if b:
        got = b["meta_info"].get("input_token_logprobs")
        want = ref["meta_info"]["input_token_logprobs"]
        ok = isinstance(got, list) and len(got) == len(ids)
        check("teacher-forced: %d input_token_logprobs" % len(ids), ok, short(got))
        if ok:
            check("teacher-forced: token ids are the prompt", [e[1] for e in got] == ids, short(got))
            check("teacher-forced: first logprob null", got[0][0] is None, short(got[0]))
            i = same_bits(logprob_values(got), logprob_values(want))
            check("teacher-forced logprobs == CLI's, same float32 bits", i < 0,
                  "position %d: server %r, CLI %r" % (i, got[i] if i < len(got) else None,
                                                      want[i] if i < len(want) else None))
        check("teacher-forced: completion_tokens 0, output_ids []",
              b["meta_info"].get("completion_tokens") == 0 and b.get("output_ids") == [], short(b))

    # greedy generation
    ref = cli_generate(["--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "12", "--temperature", "0",
                        "--return-logprob", "--ignore-eos"])
    b = gen_ok(srv, "greedy /generate with logprobs",
               {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                "return_logprob": True})
    if b:
        check("greedy output_ids == CLI's", b.get("output_ids") == ref["output_ids"],
              "server %s, CLI %s" % (b.get("output_ids"), ref["output_ids"]))
        got = b["meta_info"].get("output_token_logprobs") or []
        want = ref["meta_info"]["output_token_logprobs"]
        i = same_bits(logprob_values(got), logprob_values(want))
        check("greedy output_token_logprobs == CLI's, same float32 bits", i < 0,
              "position %d: server %s, CLI %s" % (i, short(got), short(want)))
        check("greedy text == CLI's", b.get("text") == ref["text"], "%r vs %r" % (b.get("text"), ref["text"]))

    # logprob_start_len in the middle: covers prompt[start:], no null
    start = 25
    b = gen_ok(srv, "logprob_start_len 25", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                             "return_logprob": True, "logprob_start_len": start})
    if b:
        ref = cli_generate(["--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "0", "--return-logprob",
                            "--logprob-start-len", str(start)])
        got = b["meta_info"].get("input_token_logprobs") or []
        want = ref["meta_info"]["input_token_logprobs"]
        check("logprob_start_len 25: %d entries, same bits as CLI" % (len(ids) - start),
              len(got) == len(ids) - start and same_bits(logprob_values(got), logprob_values(want)) < 0,
              "server %s, CLI %s" % (short(got), short(want)))


def test_batch_invariance(srv):
    """The same request alone and beside 15 others (mixed lengths, some sampled) gives the same
    output ids and logprobs."""
    target = {"input_ids": prompt_ids(2, 48),
              "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
              "return_logprob": True, "logprob_start_len": 0}
    srv.post("/flush_cache", {})
    alone = gen_ok(srv, "batch invariance: alone", target)
    srv.post("/flush_cache", {})
    others = []
    for k in range(15):
        sp = {"max_new_tokens": 8 + (k * 5) % 24, "ignore_eos": True,
              "temperature": 0 if k % 3 else 1.0, "sampling_seed": k}
        others.append({"input_ids": prompt_ids(100 + k, 5 + (k * 37) % 200), "sampling_params": sp,
                       "return_logprob": k % 2 == 0})
    payloads = [target] + others
    replies = [None] * len(payloads)
    barrier = threading.Barrier(len(payloads))

    def worker(i):
        barrier.wait()
        try:
            replies[i] = gen(srv, payloads[i])
        except OSError as e:
            replies[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [i for i, r in enumerate(replies) if not isinstance(r, Reply) or r.status != 200]
    check("batch invariance: all 16 concurrent requests answered 200", not bad,
          "; ".join("#%d %r" % (i, replies[i]) for i in bad[:3]))
    if alone is None or not isinstance(replies[0], Reply) or replies[0].status != 200:
        return
    beside = replies[0].json()
    check("batch invariance: same output_ids alone and beside 15 others",
          beside["output_ids"] == alone["output_ids"], "%s vs %s" % (alone["output_ids"], beside["output_ids"]))
    for key in ("input_token_logprobs", "output_token_logprobs"):
        a = logprob_values(alone["meta_info"][key])
        b = logprob_values(beside["meta_info"][key])
        d = max_abs_diff(a, b)
        check("batch invariance: %s within %g (max diff %.3g%s)" % (key, LOGPROB_TOL, d, ", equal" if d == 0 else ""),
              d <= LOGPROB_TOL, "alone %s beside %s" % (short(a), short(b)))
    for i, r in enumerate(replies[1:], 1):
        if isinstance(r, Reply) and r.status == 200:
            b = r.json()
            want = payloads[i]["sampling_params"]["max_new_tokens"]
            if b["meta_info"]["completion_tokens"] != want:
                check("batch invariance: request #%d got its %d tokens" % (i, want), False, short(b))


def test_batching_speed(srv):
    """Continuous batching is no slower than one request after another: 8 requests at once take
    at most 1.5x (+0.5 s) the time of the same 8 sent one by one (it should be well under 1x)."""
    reqs = [{"input_ids": prompt_ids(400 + k, 40), "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                                                        "ignore_eos": True}} for k in range(8)]
    srv.post("/flush_cache", {})
    t0 = time.time()
    for q in reqs:
        gen(srv, q)
    serial = time.time() - t0
    srv.post("/flush_cache", {})
    threads = [threading.Thread(target=gen, args=(srv, q)) for q in reqs]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = time.time() - t0
    check("continuous batching: 8 concurrent requests %.2f s vs %.2f s one by one (limit 1.5x + 0.5 s)"
          % (together, serial), together <= 1.5 * serial + 0.5, "")


def test_prefix_cache(srv, shared):
    P = prompt_ids(3, 300)
    X = prompt_ids(4, 20)
    Y = prompt_ids(5, 20)
    req = {"input_ids": P + Y, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
           "return_logprob": True}
    r = srv.post("/flush_cache", {})
    check("POST /flush_cache 200", r.status == 200, r)
    cold = gen_ok(srv, "prefix cache: cold", req)
    if cold:
        check("prefix cache: cold request cached_tokens == 0", cold["meta_info"].get("cached_tokens") == 0,
              short(cold["meta_info"]))
        shared["cold_prefix_answer"] = cold
    srv.post("/flush_cache", {})
    gen_ok(srv, "prefix cache: P+X", dict(req, input_ids=P + X))
    warm = gen_ok(srv, "prefix cache: P+Y after P+X", req)
    if cold and warm:
        ct = warm["meta_info"].get("cached_tokens")
        check("prefix cache: shared prefix reported (0 < cached_tokens <= %d)" % len(P),
              isinstance(ct, int) and 0 < ct <= len(P), "cached_tokens %r" % ct)
        check("prefix cache: same output_ids from the cache", warm["output_ids"] == cold["output_ids"],
              "%s vs %s" % (cold["output_ids"], warm["output_ids"]))
        d = max_abs_diff(logprob_values(cold["meta_info"]["output_token_logprobs"]),
                         logprob_values(warm["meta_info"]["output_token_logprobs"]))
        check("prefix cache: output logprobs within %g of the uncached ones (max diff %.3g)" % (LOGPROB_TOL, d),
              d <= LOGPROB_TOL, "")
    again = gen_ok(srv, "prefix cache: same prompt twice", req)
    if again:
        ct = again["meta_info"].get("cached_tokens")
        check("prefix cache: same long prompt again has cached_tokens >= %d" % len(P),
              isinstance(ct, int) and len(P) <= ct <= len(P + Y), "cached_tokens %r" % ct)
        if cold:
            d = max_abs_diff(logprob_values(cold["meta_info"]["output_token_logprobs"]),
                             logprob_values(again["meta_info"]["output_token_logprobs"]))
            check("prefix cache: repeated prompt logprobs within %g (max diff %.3g)" % (LOGPROB_TOL, d),
                  d <= LOGPROB_TOL and again["output_ids"] == cold["output_ids"], "")

    # teacher-forced input logprobs of a cached prompt are still every position's
    tf = {"input_ids": P + Y, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    srv.post("/flush_cache", {})
    tf_cold = gen_ok(srv, "prefix cache: teacher-forced cold", tf)
    gen_ok(srv, "prefix cache: warm the cache", req)
    tf_warm = gen_ok(srv, "prefix cache: teacher-forced after caching", tf)
    if tf_cold and tf_warm:
        a = logprob_values(tf_cold["meta_info"]["input_token_logprobs"])
        b = logprob_values(tf_warm["meta_info"]["input_token_logprobs"])
        d = max_abs_diff(a, b)
        check("prefix cache: teacher-forced logprobs of a cached prompt: %d entries within %g (max diff %.3g)"
              % (len(P + Y), LOGPROB_TOL, d), len(b) == len(P + Y) and d <= LOGPROB_TOL, "")

    # n samples, and a batch of prompts sharing a long prefix, compute the shared part once: the
    # first runs its prefill, the others take its pages from the cache (same answers as alone)
    srv.post("/flush_cache", {})
    nreq = {"input_ids": P + Y, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "n": 4},
            "return_logprob": True}
    b = gen_ok(srv, "shared prefill: n = 4", nreq)
    if check("shared prefill: n = 4 answers 4", isinstance(b, list) and len(b) == 4, short(b)):
        cts = [x["meta_info"].get("cached_tokens") for x in b]
        check("shared prefill: n = 4, one computes the prompt, three take >= %d tokens of it cached (%s)" % (len(P), cts),
              sorted(cts)[0] == 0 and all(isinstance(c, int) and c >= len(P) for c in sorted(cts)[1:]), cts)
        if cold:
            check("shared prefill: n = 4 greedy samples are the uncached answer",
                  all(x["output_ids"] == cold["output_ids"] for x in b), [x["output_ids"] for x in b])
    srv.post("/flush_cache", {})
    batch = {"input_ids": [P + prompt_ids(10 + i, 20) for i in range(4)],
             "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    b = gen_ok(srv, "shared prefill: a batch of 4 sharing %d tokens" % len(P), batch)
    if check("shared prefill: the batch answers 4", isinstance(b, list) and len(b) == 4, short(b)):
        cts = [x["meta_info"].get("cached_tokens") for x in b]
        check("shared prefill: the batch's first computes the shared prefix, the others take it (%s)" % cts,
              cts[0] == 0 and all(isinstance(c, int) and len(P) - 16 < c <= len(P) for c in cts[1:]), cts)

    # flush empties it, GET and POST
    for method in ("GET", "POST"):
        gen_ok(srv, "flush: fill", req)
        r = http_request(srv.port, method, "/flush_cache", body=b"" if method == "POST" else None,
                         headers=srv.headers())
        check("%s /flush_cache 200" % method, r.status == 200, r)
        b = gen_ok(srv, "flush: after %s" % method, req)
        if b:
            check("after %s /flush_cache cached_tokens == 0" % method, b["meta_info"].get("cached_tokens") == 0,
                  short(b["meta_info"]))


def test_generate_basics(srv):
    name = "text prompt"
    b = gen_ok(srv, name, {"text": "Question: What is 2 plus 3?\nAnswer:",
                           "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    if b:
        mi = b.get("meta_info", {})
        ok = (isinstance(b.get("text"), str) and isinstance(b.get("output_ids"), list)
              and all(k in mi for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens",
                                        "cached_tokens", "e2e_latency")))
        check("/generate answer shape (text, output_ids, meta_info.*)", ok, short(b))
        check("completion_tokens == len(output_ids)", mi.get("completion_tokens") == len(b.get("output_ids", [])),
              short(b))
        ids = cli_generate(["--prompt", "Question: What is 2 plus 3?\nAnswer:", "--max-new-tokens", "0"])
        check("prompt_tokens equals the CLI's", mi.get("prompt_tokens") == ids["meta_info"]["prompt_tokens"],
              "%r vs %r" % (mi.get("prompt_tokens"), ids["meta_info"]["prompt_tokens"]))

    b = gen_ok(srv, "input_ids prompt", {"input_ids": [5, 6, 7, 8, 9],
                                         "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    if b:
        check("input_ids prompt: prompt_tokens 5", b["meta_info"].get("prompt_tokens") == 5, short(b))

    # max_new_tokens honoured
    b = gen_ok(srv, "max_new_tokens 5", {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    if b:
        check("max_new_tokens 5: finish_reason {type: length, length: 5}",
              b["meta_info"].get("finish_reason") == {"type": "length", "length": 5}
              and len(b["output_ids"]) == 5 and b["meta_info"].get("completion_tokens") == 5, short(b))

    # batch of texts -> array in order, each equal to its single answer
    texts = ["The first prompt", "A second, different prompt about apples", "3"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    singles = [gen_ok(srv, "batch single %d" % i, {"text": t, "sampling_params": sp}) for i, t in enumerate(texts)]
    r = gen(srv, {"text": texts, "sampling_params": sp})
    b = r.json()
    ok = r.status == 200 and isinstance(b, list) and len(b) == 3
    check("batch of 3 texts -> JSON array of 3", ok, r)
    if ok and all(singles):
        check("batch answers in input order, each equal to its single answer",
              [x.get("output_ids") for x in b] == [s["output_ids"] for s in singles],
              "%s vs %s" % ([x.get("output_ids") for x in b], [s["output_ids"] for s in singles]))
    r = gen(srv, {"input_ids": [[5, 6, 7], [8, 9, 10, 11]], "sampling_params": sp})
    b = r.json()
    ok = r.status == 200 and isinstance(b, list) and len(b) == 2
    check("batch of 2 input_ids lists -> JSON array of 2", ok, r)
    if ok:
        check("input_ids batch: prompt_tokens 3 then 4",
              [x["meta_info"].get("prompt_tokens") for x in b] == [3, 4], short(b))
    r = gen(srv, {"text": ["a b c", "d e f"], "sampling_params": [
        {"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 5, "ignore_eos": True}]})
    b = r.json()
    ok = r.status == 200 and isinstance(b, list) and len(b) == 2
    check("batch with one sampling_params per item -> array of 2", ok, r)
    if ok:
        check("per-item sampling_params: 3 and 5 tokens",
              [x["meta_info"].get("completion_tokens") for x in b] == [3, 5], short(b))

    # n > 1
    r = gen(srv, {"text": "Once upon a time", "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0,
                                                                 "ignore_eos": True}})
    b = r.json()
    ok = r.status == 200 and isinstance(b, list) and len(b) == 3
    check("n 3 -> array of 3 answers", ok, r)
    if ok:
        check("n 3: each has 6 output_ids", all(len(x.get("output_ids", [])) == 6 for x in b), short(b))
        check("n 3 at temperature 1: the samples differ", len({tuple(x.get("output_ids", [])) for x in b}) > 1,
              short(b))

    # unknown keys ignored, nulls = defaults
    base = {"text": "Unknown keys", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    want = gen_ok(srv, "unknown keys: baseline", base)
    b = gen_ok(srv, "unknown keys ignored", {
        "text": "Unknown keys", "lora_path": None, "custom_thing": {"a": [1, 2]}, "return_routed_experts": False,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "made_up_field": 3, "json_schema": None}})
    if want and b:
        check("unknown keys: same answer as without", b["output_ids"] == want["output_ids"], short(b))
    b = gen_ok(srv, "null sampling fields", {
        "text": "Unknown keys", "stream": None, "return_logprob": None, "logprob_start_len": None,
        "top_logprobs_num": None, "rid": None,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "top_p": None, "top_k": None, "min_p": None,
                            "stop": None, "stop_token_ids": None, "n": None, "frequency_penalty": None,
                            "presence_penalty": None, "repetition_penalty": None, "min_new_tokens": None,
                            "ignore_eos": None, "skip_special_tokens": None, "no_stop_trim": None,
                            "sampling_seed": None}})
    if want and b:
        check("null sampling fields: same answer as the defaults", b["output_ids"] == want["output_ids"], short(b))
    b = gen_ok(srv, "max_new_tokens null", {"input_ids": [5, 6, 7],
                                            "sampling_params": {"max_new_tokens": None, "ignore_eos": True}})
    if b:
        check("max_new_tokens null = default 128", b["meta_info"].get("completion_tokens") == 128,
              short(b["meta_info"]))
    b = gen_ok(srv, "no sampling_params", {"input_ids": [5, 6, 7]})
    if b:
        check("no sampling_params: default 128 tokens or an eos stop",
              b["meta_info"].get("completion_tokens") == 128
              or b["meta_info"].get("finish_reason", {}).get("type") == "stop", short(b["meta_info"]))

    # rid
    b = gen_ok(srv, "rid", {"text": "x", "rid": "my-request-17", "sampling_params": {"max_new_tokens": 1}})
    if b:
        check("rid comes back as meta_info.id", b["meta_info"].get("id") == "my-request-17", short(b["meta_info"]))


def test_stops(srv):
    base_sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompt = "Stop strings: the quick brown fox"
    full = gen_ok(srv, "stop: reference", {"text": prompt, "sampling_params": base_sp})
    if not full:
        return
    text, ids = full["text"], full["output_ids"]
    # a stop string: 3 ASCII letters found in the text from character 4 on
    m = re.search(r"[A-Za-z]{3}", text[4:])
    if check("stop: reference text has 3 ASCII letters to stop on", m is not None, repr(text)):
        stop = m.group(0)
        at = text.find(stop)
        b = gen_ok(srv, "stop string", {"text": prompt, "sampling_params": dict(base_sp, stop=stop)})
        if b:
            check("stop string %r: text trimmed before it" % stop, b["text"] == text[:at],
                  "got %r, want %r (full %r)" % (b["text"], text[:at], text))
            check("stop string: finish_reason {type: stop, matched: %r}" % stop,
                  b["meta_info"].get("finish_reason") == {"type": "stop", "matched": stop},
                  short(b["meta_info"].get("finish_reason")))
        b = gen_ok(srv, "stop list", {"text": prompt, "sampling_params": dict(base_sp, stop=["\u00a7never\u00a7", stop])})
        if b:
            check("stop list: the listed string that occurs stops it",
                  b["text"] == text[:at] and b["meta_info"].get("finish_reason") == {"type": "stop", "matched": stop},
                  short(b))
        b = gen_ok(srv, "no_stop_trim", {"text": prompt, "sampling_params": dict(base_sp, stop=stop, no_stop_trim=True)})
        if b:
            check("no_stop_trim keeps the stop string", b["text"].startswith(text[:at] + stop), short(b))
    # stop_token_ids: the first token that does not occur earlier, at index >= 3
    k = next((i for i in range(3, len(ids)) if ids[i] not in ids[:i]), None)
    if check("stop: reference has a fresh token to stop on", k is not None, ids):
        t = ids[k]
        b = gen_ok(srv, "stop_token_ids", {"text": prompt, "sampling_params": dict(base_sp, stop_token_ids=[t])})
        if b:
            check("stop_token_ids [%d]: finish_reason {type: stop, matched: %d}" % (t, t),
                  b["meta_info"].get("finish_reason") == {"type": "stop", "matched": t},
                  short(b["meta_info"].get("finish_reason")))
            out = b["output_ids"]
            check("stop_token_ids: output stops at that token", out in (ids[:k], ids[:k + 1]),
                  "got %s, reference %s" % (out, ids))


def test_sampling(srv):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234}
    a = gen_ok(srv, "seed a", {"text": "Seeded sampling", "sampling_params": sp})
    b = gen_ok(srv, "seed b", {"text": "Seeded sampling", "sampling_params": sp})
    c = gen_ok(srv, "seed c", {"text": "Seeded sampling", "sampling_params": dict(sp, sampling_seed=4321)})
    if a and b:
        check("same sampling_seed, temperature 1 -> same output", a["output_ids"] == b["output_ids"],
              "%s vs %s" % (a["output_ids"], b["output_ids"]))
    if a and c:
        check("another sampling_seed -> another output", a["output_ids"] != c["output_ids"], a["output_ids"])
    # top_k 1 is greedy
    g = gen_ok(srv, "greedy", {"text": "Seeded sampling", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                               "ignore_eos": True}})
    k1 = gen_ok(srv, "top_k 1", {"text": "Seeded sampling", "sampling_params": {"max_new_tokens": 8, "top_k": 1,
                                                                                "ignore_eos": True}})
    if g and k1:
        check("top_k 1 at temperature 1 == greedy", g["output_ids"] == k1["output_ids"], "")

    # top_logprobs_num
    n = 3
    b = gen_ok(srv, "top_logprobs_num", {"input_ids": prompt_ids(6, 10),
                                         "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                                         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": n})
    if b:
        mi = b["meta_info"]
        otl = mi.get("output_top_logprobs")
        ok = isinstance(otl, list) and len(otl) == 5 and all(isinstance(p, list) and len(p) == n for p in otl)
        check("top_logprobs_num 3: output_top_logprobs has 3 entries at each of 5 positions", ok, short(otl))
        if ok:
            sorted_ok = all(p[j][0] >= p[j + 1][0] for p in otl for j in range(n - 1))
            check("output_top_logprobs sorted, most likely first", sorted_ok, short(otl))
            first = [p[0][1] for p in otl]
            check("greedy: top-1 ids are the output ids", first == b["output_ids"], "%s vs %s" % (first, b["output_ids"]))
            otok = mi.get("output_token_logprobs") or []
            check("greedy: top-1 logprob equals the token logprob",
                  same_bits([p[0][0] for p in otl], logprob_values(otok)) < 0, short(otl))
        itl = mi.get("input_top_logprobs")
        ok = isinstance(itl, list) and len(itl) == 10
        ok = ok and all(isinstance(p, list) and len(p) == n for p in itl[1:])
        check("top_logprobs_num 3: input_top_logprobs has 3 entries at positions 1..9", ok, short(itl))
    b = gen_ok(srv, "return_text_in_logprobs", {"text": "Some text", "return_logprob": True,
                                                "return_text_in_logprobs": True,
                                                "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    if b:
        otl = b["meta_info"].get("output_token_logprobs") or []
        check("return_text_in_logprobs: entries are [logprob, id, text]",
              len(otl) == len(b["output_ids"]) and all(isinstance(e[2], str) for e in otl), short(otl))


# ---- streaming


def stream_prompt(i):
    return "Question %d: a farmer has %d hens and buys %d more. How many hens now?\nAnswer:" % (i, 3 + i, 7 * i + 1)


def stream_client_plan(i, model):
    """(path, streamed payload, non-streamed payload, include_usage or None)."""
    kind = i % 3
    toks = 10 + i % 7
    if kind == 0:
        p = {"text": stream_prompt(i), "sampling_params": {"max_new_tokens": toks, "temperature": 0}}
        return "/generate", dict(p, stream=True), p, None
    usage = (i // 3) % 2 == 0
    if kind == 1:
        p = {"model": model, "prompt": stream_prompt(i), "max_tokens": toks, "temperature": 0}
        path = "/v1/completions"
    else:
        p = {"model": model, "messages": [{"role": "user", "content": stream_prompt(i)}], "max_tokens": toks,
             "temperature": 0}
        path = "/v1/chat/completions"
    s = dict(p, stream=True)
    if usage:
        s["stream_options"] = {"include_usage": True}
    return path, s, p, usage


def check_generate_stream(tag, reply, events, err, ref):
    ok = err is None and len(events) >= 1
    if not check("%s: well-formed SSE ending with [DONE] (%s)" % (tag, reply.headers.get("content-type")),
                 ok and reply.status == 200 and reply.headers.get("content-type", "").startswith("text/event-stream"),
                 err or repr(reply)):
        return
    probs = []
    prev_text, prev_ids, prev_n = "", [], 0
    for j, e in enumerate(events):
        t, ids, mi = e.get("text"), e.get("output_ids"), e.get("meta_info") or {}
        if not isinstance(t, str) or not isinstance(ids, list):
            probs.append("chunk %d lacks text/output_ids" % j)
            break
        if not t.startswith(prev_text):
            probs.append("chunk %d text %r does not extend %r" % (j, t, prev_text))
        if ids[:len(prev_ids)] != prev_ids:
            probs.append("chunk %d output_ids %s do not extend %s" % (j, ids, prev_ids))
        n = mi.get("completion_tokens")
        if n != len(ids) or n < prev_n:
            probs.append("chunk %d completion_tokens %r, %d ids" % (j, n, len(ids)))
        if j < len(events) - 1 and mi.get("finish_reason") is not None:
            probs.append("chunk %d of %d has finish_reason" % (j, len(events)))
        prev_text, prev_ids, prev_n = t, ids, n if isinstance(n, int) else prev_n
    check("%s: chunks cumulative (text and output_ids grow by prefix)" % tag, not probs, "; ".join(probs[:3]))
    last = events[-1]
    check("%s: last chunk has finish_reason" % tag, (last.get("meta_info") or {}).get("finish_reason") is not None,
          short(last))
    if ref is not None:
        check("%s: final chunk == non-streamed answer" % tag,
              last.get("text") == ref.get("text") and last.get("output_ids") == ref.get("output_ids")
              and last["meta_info"].get("finish_reason") == ref["meta_info"].get("finish_reason"),
              "stream %s / plain %s" % (short(last), short(ref)))


def check_openai_stream(tag, reply, events, err, ref, chat, include_usage):
    ok = err is None and len(events) >= 1
    if not check("%s: well-formed SSE ending with [DONE]" % tag,
                 ok and reply.status == 200 and reply.headers.get("content-type", "").startswith("text/event-stream"),
                 err or repr(reply)):
        return
    obj = "chat.completion.chunk" if chat else "text_completion"
    probs = []
    ids = set()
    pieces, finish = [], None
    with_choices = [e for e in events if e.get("choices")]
    empty = [j for j, e in enumerate(events) if e.get("choices") == []]
    for j, e in enumerate(events):
        ids.add(e.get("id"))
        if e.get("object") != obj:
            probs.append("chunk %d object %r" % (j, e.get("object")))
        if not isinstance(e.get("created"), int) or not isinstance(e.get("model"), str):
            probs.append("chunk %d lacks created/model" % j)
    for j, e in enumerate(with_choices):
        c = e["choices"][0]
        if c.get("index") != 0:
            probs.append("choice index %r" % c.get("index"))
        if chat:
            d = c.get("delta") or {}
            if j == 0 and d.get("role") != "assistant":
                probs.append("first delta %r has no role assistant" % d)
            pieces.append(d.get("content") or "")
        else:
            if not isinstance(c.get("text"), str):
                probs.append("chunk text %r" % c.get("text"))
            pieces.append(c.get("text") or "")
        if c.get("finish_reason") is not None:
            if j != len(with_choices) - 1:
                probs.append("finish_reason before the last choices chunk")
            finish = c["finish_reason"]
    if len(ids) != 1:
        probs.append("chunk ids differ: %s" % ids)
    check("%s: chunk shapes (object %s, one id, deltas%s)" % (tag, obj, ", first role assistant" if chat else ""),
          not probs, "; ".join(probs[:3]))
    check("%s: last choices chunk has finish_reason" % tag, finish in ("stop", "length"), finish)
    if include_usage:
        ok = len(empty) == 1 and empty[0] == len(events) - 1
        u = events[-1].get("usage") if ok else None
        ok = ok and isinstance(u, dict)
        if ok and ref is not None:
            ok = u == ref.get("usage") or (u.get("prompt_tokens") == ref["usage"]["prompt_tokens"]
                                            and u.get("completion_tokens") == ref["usage"]["completion_tokens"]
                                            and u.get("total_tokens") == ref["usage"]["total_tokens"])
        check("%s: include_usage -> one usage chunk (choices []) last, usage equals the plain answer's" % tag, ok,
              "empty-choice chunks at %s of %d; last %s; plain usage %s"
              % (empty, len(events), short(events[-1]), short(ref and ref.get("usage"))))
    else:
        check("%s: no usage chunk (choices []) when not asked" % tag, not empty, "at %s" % empty)
    if ref is not None:
        c = ref["choices"][0]
        want = c["message"]["content"] if chat else c["text"]
        got = "".join(pieces)
        check("%s: deltas concatenate to the non-streamed answer" % tag, got == want and finish == c["finish_reason"],
              "stream %r (%s), plain %r (%s)" % (got, finish, want, c["finish_reason"]))


def test_streaming_32(srv):
    model = model_name(srv)
    n = 32
    plans = [stream_client_plan(i, model) for i in range(n)]
    results = [None] * n
    barrier = threading.Barrier(n)

    def worker(i):
        path, s, _, _ = plans[i]
        barrier.wait()
        try:
            results[i] = srv.post_stream(path, s)
        except OSError as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - t0
    failed = [i for i in range(n) if not isinstance(results[i], tuple)]
    check("32 concurrent streams: every connection answered (%.1f s)" % elapsed, not failed,
          "; ".join("#%d %r" % (i, results[i]) for i in failed[:3]))
    for i in range(n):
        if not isinstance(results[i], tuple):
            continue
        path, _, plain, usage = plans[i]
        r = srv.post(path, plain)
        ref = r.json() if r.status == 200 else None
        check("stream #%d %s: the non-streamed request answers 200" % (i, path), ref is not None, r)
        reply, (events, err) = results[i]
        tag = "stream #%d %s" % (i, path)
        if path == "/generate":
            check_generate_stream(tag, reply, events, err, ref)
        else:
            check_openai_stream(tag, reply, events, err, ref, path.endswith("chat/completions"), usage)


def test_stream_logprobs(srv):
    """/generate stream with return_logprob: the last chunk carries all the output logprobs."""
    p = {"input_ids": prompt_ids(7, 12), "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
         "return_logprob": True}
    plain = gen_ok(srv, "stream logprobs: plain", p)
    r, (events, err) = srv.post_stream("/generate", dict(p, stream=True))
    if plain and err is None and events:
        got = events[-1]["meta_info"].get("output_token_logprobs") or []
        check("stream logprobs: last chunk's output_token_logprobs == plain answer's",
              same_bits(logprob_values(got), logprob_values(plain["meta_info"]["output_token_logprobs"])) < 0,
              short(got))
    else:
        check("stream logprobs: well-formed stream", False, err or r)


def test_stream_stops(srv):
    """A stop string that spans two tokens: streamed text never shows a part of it that the final
    answer trims (cumulative on /generate, deltas on /v1 that add up to the non-streamed text)."""
    prompt = "Stream stops: once upon a time"
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    r, (events, err) = srv.post_stream("/generate", {"text": prompt, "sampling_params": sp, "stream": True})
    if not check("stream stops: reference stream", err is None and events, err or r):
        return
    texts = [e["text"] for e in events]
    full = texts[-1]
    stop = None
    for k in range(2, len(texts) - 1):  # last char of chunk k + first 2 of chunk k+1
        p = len(texts[k]) - 1
        cand = full[p:p + 3]
        if (len(texts[k]) > len(texts[k - 1]) and len(cand) == 3 and cand.isprintable() and "\ufffd" not in cand
                and full.find(cand) == p and len(texts[k + 1]) >= p + 3):
            stop = cand
            break
    if not check("stream stops: a stop string across a token boundary", stop is not None, texts):
        return
    want = full[:full.find(stop)]
    plain = gen_ok(srv, "stream stops: plain", {"text": prompt, "sampling_params": dict(sp, stop=stop)})
    if plain:
        check("stream stops: plain answer trimmed before %r" % stop, plain["text"] == want,
              "%r vs %r" % (plain["text"], want))
    r, (events, err) = srv.post_stream("/generate", {"text": prompt, "sampling_params": dict(sp, stop=stop),
                                                      "stream": True})
    if err is None and events:
        texts = [e["text"] for e in events]
        grows = all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        check("stream stops: /generate chunks cumulative with stop %r, last == plain" % stop,
              grows and texts[-1] == want, texts)
    else:
        check("stream stops: /generate stream well-formed", False, err or r)
    model = model_name(srv)
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    r, (events, err) = srv.post_stream("/v1/completions", dict(body, stream=True))
    if err is None:
        got = "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))
        fin = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
        check("stream stops: /v1/completions deltas add up to %r, finish_reason stop" % want,
              got == want and fin and fin[-1] == "stop", "%r, %s" % (got, fin))
    else:
        check("stream stops: /v1/completions stream well-formed", False, err or r)


def test_big_batch(srv):
    texts = ["Batch item number %d says hello" % i for i in range(24)]
    r = gen(srv, {"text": texts, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    b = r.json()
    ok = r.status == 200 and isinstance(b, list) and len(b) == len(texts)
    check("batch of 24 texts -> 24 answers", ok, r)
    if ok:
        singles = [gen(srv, {"text": texts[i], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
                   for i in (0, 11, 23)]
        check("batch of 24: items 0, 11, 23 in input order", [b[i]["output_ids"] for i in (0, 11, 23)]
              == [x["output_ids"] for x in singles], "")
    r, (events, err) = srv.post_stream("/generate", {"input_ids": [5, 6, 7], "stream": True,
                                                      "sampling_params": {"max_new_tokens": 0}})
    check("max_new_tokens 0 streamed: well-formed, ends with a finished chunk",
          err is None and events and (events[-1].get("meta_info") or {}).get("finish_reason") is not None, err or r)


# ---- OpenAI-compatible shapes


def test_openai_shapes(srv):
    model = model_name(srv)
    prompt = "Question: How many legs does a spider have?\nAnswer:"
    r = srv.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 7, "temperature": 0,
                                     "ignore_eos": True})
    b = r.json()
    ok = r.status == 200 and isinstance(b, dict)
    if ok:
        c = (b.get("choices") or [{}])[0]
        u = b.get("usage") or {}
        ok = (isinstance(b.get("id"), str) and b.get("object") == "text_completion"
              and isinstance(b.get("created"), int) and b.get("model") == model
              and c.get("index") == 0 and isinstance(c.get("text"), str) and c.get("finish_reason") == "length"
              and u.get("completion_tokens") == 7 and u.get("total_tokens") == u.get("prompt_tokens", -99) + 7)
    check("/v1/completions shape (id, object, created, model, choices, usage)", ok, r)
    native = gen_ok(srv, "completions vs /generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 7, "temperature": 0, "ignore_eos": True}, "return_logprob": True})
    if ok and native:
        check("/v1/completions text == /generate text", b["choices"][0]["text"] == native["text"],
              "%r vs %r" % (b["choices"][0]["text"], native["text"]))
        check("/v1/completions prompt_tokens == /generate's",
              b["usage"]["prompt_tokens"] == native["meta_info"]["prompt_tokens"], "")

    # prompt forms
    r = srv.post("/v1/completions", {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0})
    b = r.json()
    check("/v1/completions prompt as token ids", r.status == 200 and b and b["usage"]["prompt_tokens"] == 4, r)
    r = srv.post("/v1/completions", {"model": model, "prompt": ["first", "second prompt"], "max_tokens": 3,
                                     "temperature": 0})
    b = r.json()
    check("/v1/completions list of 2 prompts -> choices index 0 and 1",
          r.status == 200 and b and sorted(c["index"] for c in b["choices"]) == [0, 1], r)
    r = srv.post("/v1/completions", {"model": model, "prompt": "n two", "max_tokens": 3, "n": 2, "temperature": 1.0})
    b = r.json()
    check("/v1/completions n 2 -> 2 choices", r.status == 200 and b and len(b["choices"]) == 2, r)

    # logprobs
    r = srv.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 7, "temperature": 0,
                                     "ignore_eos": True, "logprobs": 2})
    b = r.json()
    ok = r.status == 200 and isinstance(b, dict)
    lp = b["choices"][0].get("logprobs") if ok else None
    ok = ok and isinstance(lp, dict)
    ok = ok and all(isinstance(lp.get(k), list) and len(lp[k]) == 7
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    check("/v1/completions logprobs 2: tokens, token_logprobs, top_logprobs, text_offset for 7 tokens", ok, r)
    if ok:
        check("/v1/completions top_logprobs: 1-2 entries per position",
              all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp["top_logprobs"]), short(lp["top_logprobs"]))
        if native:
            d = max_abs_diff(lp["token_logprobs"], logprob_values(native["meta_info"]["output_token_logprobs"]))
            check("/v1/completions token_logprobs == /generate's (max diff %.3g)" % d, d <= LOGPROB_TOL, "")

    # chat
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    r = srv.post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 6, "temperature": 0})
    b = r.json()
    ok = r.status == 200 and isinstance(b, dict)
    if ok:
        c = (b.get("choices") or [{}])[0]
        m = c.get("message") or {}
        u = b.get("usage") or {}
        ok = (isinstance(b.get("id"), str) and b.get("object") == "chat.completion"
              and isinstance(b.get("created"), int) and b.get("model") == model and c.get("index") == 0
              and m.get("role") == "assistant" and isinstance(m.get("content"), str)
              and c.get("finish_reason") in ("stop", "length")
              and u.get("total_tokens") == u.get("prompt_tokens", -99) + u.get("completion_tokens", -99))
    check("/v1/chat/completions shape (id, object, created, model, choices[message], usage)", ok, r)
    chatml = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    native = gen_ok(srv, "chat vs /generate", {"text": chatml, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    if ok and native:
        check("chat uses the model's ChatML template: prompt_tokens and text == /generate on the rendered prompt",
              b["usage"]["prompt_tokens"] == native["meta_info"]["prompt_tokens"]
              and b["choices"][0]["message"]["content"] == native["text"],
              "chat %s / native %s" % (short(b), short(native)))
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in msgs]
    r = srv.post("/v1/chat/completions", {"model": model, "messages": parts, "max_tokens": 6, "temperature": 0})
    b2 = r.json()
    check("chat content as a list of text parts (vLLM's benchmark sends it) == string content",
          r.status == 200 and native is not None and b2["choices"][0]["message"]["content"] == native["text"], r)
    base = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    r = srv.post("/v1/completions", dict(base, echo=True))
    b2 = r.json()
    check("/v1/completions echo: text starts with the prompt",
          r.status == 200 and b2["choices"][0]["text"].startswith(prompt), r)
    r1 = srv.post("/v1/completions", dict(base, max_tokens=12, temperature=1.0, seed=77)).json()
    r2 = srv.post("/v1/completions", dict(base, max_tokens=12, temperature=1.0, seed=77)).json()
    check("/v1/completions same seed, temperature 1 -> same text",
          r1 is not None and r2 is not None and r1["choices"][0]["text"] == r2["choices"][0]["text"], "%s / %s"
          % (short(r1), short(r2)))
    r = srv.post("/v1/chat/completions", {"model": model, "messages": msgs, "max_completion_tokens": 4,
                                          "temperature": 0, "ignore_eos": True})
    b = r.json()
    check("/v1/chat/completions max_completion_tokens 4", r.status == 200 and b and b["usage"]["completion_tokens"] == 4, r)
    r = srv.post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 5, "temperature": 0,
                                          "logprobs": True, "top_logprobs": 2})
    b = r.json()
    ok = r.status == 200 and isinstance(b, dict)
    content = ((b["choices"][0].get("logprobs") or {}).get("content")) if ok else None
    ok = ok and isinstance(content, list) and len(content) == b["usage"]["completion_tokens"]
    ok = ok and all(isinstance(e.get("token"), str) and isinstance(e.get("logprob"), (int, float))
                    and isinstance(e.get("top_logprobs"), list) and len(e["top_logprobs"]) == 2 for e in content)
    check("/v1/chat/completions logprobs: content[token, logprob, top_logprobs x2] per token", ok, r)


def test_keepalive_and_chunked_upload(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        statuses = []
        for k in range(3):
            body = json.dumps({"text": "keep-alive %d" % k, "sampling_params": {"max_new_tokens": 3}}).encode()
            conn.request("POST", "/generate", body=body, headers=srv.headers({"Content-Type": "application/json"}))
            r = conn.getresponse()
            r.read()
            statuses.append(r.status)
        conn.request("GET", "/health", headers=srv.headers())
        r = conn.getresponse()
        r.read()
        statuses.append(r.status)
        check("HTTP/1.1 keep-alive: 3 requests and a GET on one connection", statuses == [200] * 4, statuses)
    finally:
        conn.close()

    def chunks():
        yield b'{"text": "chunked ", "sampling_params": '
        yield b'{"max_new_tokens": 3, "temperature": 0}}'

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", "/generate", body=chunks(), encode_chunked=True,
                     headers=srv.headers({"Content-Type": "application/json"}))
        r = conn.getresponse()
        data = r.read()
        b = json.loads(data) if r.status == 200 else None
        check("request body in Transfer-Encoding: chunked", b is not None and len(b.get("output_ids", [])) == 3,
              "HTTP %d %s" % (r.status, data[:200]))
    finally:
        conn.close()


def test_logprob_match(srv):
    """api.md, deterministic inference: generate N tokens with logprobs, then teacher-force
    prompt + output; the last N input logprobs equal the output logprobs."""
    ids = prompt_ids(13, 30)
    n = 12
    g = gen_ok(srv, "logprob match: generate", {"input_ids": ids, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                    "ignore_eos": True}})
    if not g:
        return
    tf = gen_ok(srv, "logprob match: teacher-forced", {"input_ids": ids + g["output_ids"], "return_logprob": True,
                                                       "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    if not tf:
        return
    a = logprob_values(g["meta_info"]["output_token_logprobs"])
    b = logprob_values(tf["meta_info"]["input_token_logprobs"][-n:])
    d = max_abs_diff(a, b)
    check("input/output logprob match: last %d teacher-forced == generated, within %g (max diff %.3g%s)"
          % (n, LOGPROB_TOL, d, ", same bits" if same_bits(a, b) < 0 else ""), d <= LOGPROB_TOL,
          "generated %s, teacher-forced %s" % (short(a), short(b)))


def test_metric_counts(srv):
    """Counters move by what one request did: +7 generated tokens, +prompt tokens, +1 TTFT sample."""
    def snap():
        text = srv.get("/metrics").body.decode("utf-8", "replace")
        types, samples = metrics_types(text), metrics_samples(text)
        names = {"gen": find_metric(types, "counter", "generation_tokens", "generated_tokens", "output_tokens"),
                 "prompt": find_metric(types, "counter", "prompt_tokens"),
                 "ttft": find_metric(types, "histogram", "time_to_first_token", "ttft")}
        vals = {}
        for k, nme in names.items():
            if nme:
                vals[k] = metric_value(samples, nme + "_count" if k == "ttft" else nme)
        return names, vals
    def settled():  # counters may trail the answers a little: wait until two reads agree
        names, prev = snap()
        for _ in range(40):
            time.sleep(0.05)
            _, cur = snap()
            if cur == prev:
                break
            prev = cur
        return names, prev

    names, v0 = settled()
    b = gen_ok(srv, "metric counts", {"input_ids": prompt_ids(14, 11),
                                      "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}})
    _, v1 = settled()
    if not b:
        return
    for k, want in (("gen", 7), ("prompt", 11), ("ttft", 1)):
        ok = v0.get(k) is not None and v1.get(k) is not None and v1[k] - v0[k] == want
        check("/metrics %s moves by %d for one request" % (names.get(k), want), ok,
              "before %s after %s" % (v0.get(k), v1.get(k)))


# ---- metrics, disconnect


def test_metrics(srv):
    r = srv.get("/metrics")
    text = r.body.decode("utf-8", "replace")
    check("GET /metrics 200 text/plain", r.status == 200 and r.headers.get("content-type", "").startswith("text/plain"),
          repr(r))
    if r.status != 200:
        return
    bad = [line for line in text.splitlines() if line.strip() and not line.startswith("#")
           and not re.match(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?\s+\S+(\s+-?\d+)?\s*$", line)]
    check("/metrics: every sample line is Prometheus text", not bad, short(bad))
    types = metrics_types(text)
    samples = metrics_samples(text)
    for label, words in (("TTFT", ("time_to_first_token", "ttft")), ("ITL", ("inter_token", "itl"))):
        name = find_metric(types, "histogram", *words)
        ok = name is not None
        if ok:
            buckets = [s for s in samples if s[0] == name + "_bucket"]
            count = metric_value(samples, name + "_count")
            ok = any('le="+Inf"' in s[1] for s in buckets) and count is not None and count > 0
        check("/metrics: %s histogram with +Inf bucket and a count > 0 (%s)" % (label, name), ok,
              "types %s" % short(types))
    for label, words in (("running requests", ("running",)), ("waiting requests", ("waiting", "queue")),
                         ("KV pages", ("kv", "page", "token_usage"))):
        name = find_metric(types, "gauge", *words)
        check("/metrics: %s gauge (%s)" % (label, name), name is not None and metric_value(samples, name) is not None,
              short(types))
    name = find_metric(types, "counter", "generat", "completion", "output")
    check("/metrics: generated tokens counter (%s)" % name, name is not None, short(types))


def test_disconnect(srv):
    """16 streaming clients ask for 1900 tokens each, read one chunk and hang up: the server aborts
    them (running and waiting back to 0 in a few seconds; serving them out would take much
    longer) and goes on serving."""
    n = 16
    socks = []
    for i in range(n):
        body = json.dumps({"input_ids": prompt_ids(200 + i, 8), "stream": True,
                           "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 0}}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        head = ("POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: %d\r\n" % len(body))
        if srv.api_key:
            head += "Authorization: Bearer %s\r\n" % srv.api_key
        s.sendall(head.encode() + b"\r\n" + body)
        socks.append(s)
    got_chunk = 0
    for s in socks:
        buf = b""
        while b"data: " not in buf:
            d = s.recv(4096)
            if not d:
                break
            buf += d
        got_chunk += b"data: " in buf
    check("disconnect: every client got a first chunk", got_chunk == n, "%d of %d" % (got_chunk, n))
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    t0 = time.time()
    counts = None
    while time.time() - t0 < 5.0:
        counts = queue_counts(srv)
        if counts is None or counts == (0, 0):
            break
        time.sleep(0.05)
    check("disconnect: running and waiting back to 0 within 5 s (%.2f s)" % (time.time() - t0),
          counts == (0, 0), "running, waiting = %s" % (counts,))
    health_ok(srv, "16 client disconnects")
    b = gen_ok(srv, "after disconnects", {"text": "still there?", "sampling_params": {"max_new_tokens": 4}})
    check("disconnect: a new request is served", b is not None, "")


# ---- tokenizer endpoints, model retrieval, /abort_request


def test_tokenize(srv):
    """/tokenize and /detokenize (and their /v1/ forms): the ids the CLI's tokenizer gives, text back
    from them, lists answered as lists, the context length; GET /v1/models/ID."""
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "caf\u00e9 \u65e5\u672c \U0001F600", " "]
    for path in ("/tokenize", "/v1/tokenize"):
        for t in texts:
            r = srv.post(path, {"prompt": t})
            b = r.json()
            cli = cli_tokenize(t)
            check("%s %r: the CLI's ids, count, max_model_len %d" % (path, t, MAX_POS),
                  r.status == 200 and isinstance(b, dict) and b.get("tokens") == cli and b.get("count") == len(cli)
                  and b.get("max_model_len") == MAX_POS, "%r, CLI %s" % (r, cli))
        r = srv.post(path, {"prompt": texts[:2], "add_special_tokens": False})
        b = r.json()
        want = [cli_tokenize(t, False) for t in texts[:2]]
        check("%s of a list: a list of id lists and of counts" % path,
              r.status == 200 and isinstance(b, dict) and b.get("tokens") == want
              and b.get("count") == [len(w) for w in want], r)
    # the ids /generate uses for the same text
    b = gen_ok(srv, "tokenize: /generate of the same text", {"text": texts[1], "sampling_params": {"max_new_tokens": 1}})
    if b is not None:
        check("/tokenize count == /generate's prompt_tokens",
              b["meta_info"].get("prompt_tokens") == len(cli_tokenize(texts[1])), short(b["meta_info"]))
    for path in ("/detokenize", "/v1/detokenize"):
        for t in texts:
            r = srv.post(path, {"tokens": cli_tokenize(t)})
            b = r.json()
            check("%s of %r's ids gives it back" % (path, t),
                  r.status == 200 and isinstance(b, dict) and b.get("text") == t, r)
        r = srv.post(path, {"tokens": [cli_tokenize(t) for t in texts[:2]] + [[]]})
        b = r.json()
        check("%s of a list of lists: a list of texts" % path,
              r.status == 200 and isinstance(b, dict) and b.get("text") == texts[:2] + [""], r)
        r = srv.post(path, {"tokens": []})
        check("%s of []: \"\"" % path, r.status == 200 and r.json() == {"text": ""}, r)
    name = model_name(srv)
    r = srv.get("/v1/models/" + name)
    b = r.json()
    check("GET /v1/models/%s: the served model's entry" % name,
          r.status == 200 and isinstance(b, dict) and b.get("id") == name and b.get("object") == "model"
          and b.get("max_model_len") == MAX_POS, r)
    r = srv.post("/tokenize", {"prompt": "x", "model": name})
    check("/tokenize with the served model's name: 200", r.status == 200, r)


def test_logit_bias(srv):
    """logit_bias ({"token id": bias}, OpenAI's and SGLang's sampling_params'): +100 makes every token
    that one (greedy and sampled), -100 on the greedy choice moves it elsewhere; bad maps get 400."""
    ids = prompt_ids(77, 12)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    plain = gen_ok(srv, "logit_bias: plain", {"input_ids": ids, "sampling_params": sp})
    b = gen_ok(srv, "logit_bias: +100 on 42", {"input_ids": ids, "sampling_params": dict(sp, logit_bias={"42": 100})})
    check("logit_bias +100 on token 42 (greedy): every output is 42", b is not None and b["output_ids"] == [42] * 6,
          b and b["output_ids"])
    b = gen_ok(srv, "logit_bias: sampled +100", {"input_ids": ids, "sampling_params": dict(
        sp, temperature=1.0, sampling_seed=5, logit_bias={"42": 100.0})})
    check("logit_bias +100 on token 42 (sampled): every output is 42", b is not None and b["output_ids"] == [42] * 6,
          b and b["output_ids"])
    if plain:
        first = plain["output_ids"][0]
        b = gen_ok(srv, "logit_bias: -100 on the greedy token", {"input_ids": ids, "sampling_params": dict(
            sp, logit_bias={str(first): -100})})
        check("logit_bias -100 on the greedy first token %d: another one comes first" % first,
              b is not None and b["output_ids"][0] != first, b and b["output_ids"])
        b = gen_ok(srv, "logit_bias: empty", {"input_ids": ids, "sampling_params": dict(sp, logit_bias={})})
        check("logit_bias {}: the plain answer", b is not None and b["output_ids"] == plain["output_ids"], b)
        b = gen_ok(srv, "logit_bias: return_logprob", {"input_ids": ids, "return_logprob": True,
                                                       "sampling_params": dict(sp, logit_bias={"42": 100})})
        p0 = gen_ok(srv, "logit_bias: plain logprob", {"input_ids": ids + [42], "return_logprob": True,
                                                      "logprob_start_len": len(ids) - 1,
                                                      "sampling_params": {"max_new_tokens": 0}})
        if b and p0:
            lp = b["meta_info"]["output_token_logprobs"][0][0]
            ref = p0["meta_info"]["input_token_logprobs"][1][0]
            check("logit_bias: output logprobs are the model's, before the bias (%.4f vs %.4f)" % (lp, ref),
                  abs(lp - ref) <= LOGPROB_TOL, "")
    text42 = srv.post("/detokenize", {"tokens": [42] * 5}).json()["text"]
    r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                     "logit_bias": {"42": 100}})
    c = r.json()
    check("logit_bias in /v1/completions: the text of five 42s", r.status == 200 and c["choices"][0]["text"] == text42,
          r)
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                          "temperature": 0, "logit_bias": {"42": 100}})
    c = r.json()
    check("logit_bias in /v1/chat/completions: the text of five 42s",
          r.status == 200 and c["choices"][0]["message"]["content"] == text42, r)
    e = lambda *a, **k: expect_error(srv, *a, **k)
    g = lambda bias: {"input_ids": ids, "sampling_params": dict(sp, logit_bias=bias)}
    e("logit_bias a list", "POST", "/generate", g([[42, 1]]))
    e("logit_bias key not a number", "POST", "/generate", g({"abc": 1}))
    e("logit_bias key negative", "POST", "/generate", g({"-3": 1}))
    e("logit_bias value a string", "POST", "/generate", g({"5": "1"}))
    e("logit_bias value above 100", "POST", "/generate", g({"5": 100.5}))
    e("logit_bias id outside the vocabulary", "POST", "/generate", g({"99999999": 1}))
    e("logit_bias id given twice", "POST", "/generate", g({"5": 1, "05": 2}))
    e("logit_bias with 1025 entries", "POST", "/generate", g({str(i): 1 for i in range(1025)}))
    e("logit_bias in /v1/completions, above 100", "POST", "/v1/completions",
      {"prompt": ids, "max_tokens": 2, "logit_bias": {"5": -101}})


def test_tokenize_bad(srv):
    e = lambda *a, **k: expect_error(srv, *a, **k)
    e("/tokenize without prompt", "POST", "/tokenize", {"text": "hi"})
    e("/tokenize prompt a number", "POST", "/tokenize", {"prompt": 5})
    e("/tokenize prompt list with a number", "POST", "/tokenize", {"prompt": ["a", 5]})
    e("/tokenize add_special_tokens a string", "POST", "/tokenize", {"prompt": "a", "add_special_tokens": "no"})
    e("/tokenize another model", "POST", "/tokenize", {"prompt": "a", "model": "other-model"}, status=404)
    e("/tokenize malformed JSON", "POST", "/v1/tokenize", b'{"prompt": ')
    e("/tokenize by GET", "GET", "/tokenize", status=405)
    e("/detokenize without tokens", "POST", "/detokenize", {"text": "hi"})
    e("/detokenize tokens a string", "POST", "/detokenize", {"tokens": "1 2"})
    e("/detokenize id outside the vocabulary", "POST", "/detokenize", {"tokens": [1, 10 ** 7]})
    e("/detokenize negative id", "POST", "/detokenize", {"tokens": [-1]})
    e("/detokenize a fraction", "POST", "/detokenize", {"tokens": [1.5]})
    e("/detokenize a list of lists with a bad item", "POST", "/v1/detokenize", {"tokens": [[1], "x"]})
    e("/detokenize skip_special_tokens a number", "POST", "/detokenize", {"tokens": [1], "skip_special_tokens": 1})
    e("GET /v1/models/ another model", "GET", "/v1/models/other-model", status=404)
    e("POST /v1/models/ID", "POST", "/v1/models/" + model_name(srv), {}, status=405)


def long_request(srv, payload, out, key, timeout=300):
    def run():
        try:
            if payload.get("stream"):
                out[key] = srv.post_stream("/generate" if "text" in payload or "input_ids" in payload
                                           else "/v1/completions", payload, timeout=timeout)
            else:
                out[key] = srv.post("/generate", payload, timeout=timeout)
        except OSError as e:
            out[key] = e
    t = threading.Thread(target=run)
    t.start()
    return t


WEIGHTS_A = "tests/data/tiny-qwen3-moe"          # the "weights" server starts on this one
WEIGHTS_B = "tests/data/tiny-qwen3-moe-trained"  # the same config.json, other weights


def test_update_weights(srv):
    """/update_weights_from_disk as SGLang's: the served weights become another folder's (the
    answers then equal `moeserve generate` on that folder, bit for bit, also for a prompt the prefix
    cache held before); running requests finish first, or with abort_all_requests are aborted and
    answer what they have; a folder that does not load or whose config differs changes nothing."""
    ids = prompt_ids(77, 24)
    payload = {"input_ids": ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    cli = ["--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "10", "--temperature", "0",
           "--return-logprob", "--ignore-eos"]
    ref = {m: cli_generate(cli, model=m) for m in (WEIGHTS_A, WEIGHTS_B)}
    check("update weights: the two folders answer differently",
          ref[WEIGHTS_A]["output_ids"] != ref[WEIGHTS_B]["output_ids"], short(ref))

    def answers(tag, folder):
        b = gen_ok(srv, "update weights: %s" % tag, payload)
        if b:
            want = ref[folder]
            same = b["output_ids"] == want["output_ids"] and same_bits(
                logprob_values(b["meta_info"]["output_token_logprobs"]),
                logprob_values(want["meta_info"]["output_token_logprobs"])) < 0
            check("update weights: %s == `moeserve generate` on %s, same bits" % (tag, folder), same,
                  "%s against %s" % (short(b["output_ids"]), short(want["output_ids"])))

    def update_while_running(seed, n_new, body):
        """POST the update once a request of n_new tokens runs: (its answer, the update's)."""
        out = {}
        t = long_request(srv, {"input_ids": prompt_ids(seed, 6),
                               "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True, "temperature": 0}},
                         out, "run")
        check("update weights: a request of %d tokens running" % n_new, wait_running(srv, 1), queue_counts(srv))
        r = srv.post("/update_weights_from_disk", body)
        t.join(300)
        return out.get("run"), r

    answers("before", WEIGHTS_A)
    # a running request finishes first (no abort)
    run, r = update_while_running(78, 300, {"model_path": WEIGHTS_B})
    body = r.json() or {}
    check("update weights: 200, success, nothing aborted",
          r.status == 200 and body.get("success") is True and body.get("num_paused_requests") == 0, r)
    check("update weights: the running request ran to its end (length)",
          isinstance(run, Reply) and run.status == 200
          and run.json()["meta_info"].get("finish_reason", {}).get("type") == "length", run)
    answers("after the update", WEIGHTS_B)
    info = srv.get("/get_model_info").json() or {}
    check("update weights: /get_model_info names the new folder", info.get("model_path") == WEIGHTS_B, info)

    # refused: nothing changes
    for body, status, words in (({"model_path": "models/tiny-qwen3-moe"}, 400, "hidden_size differs"),
                                ({"model_path": "tests/data/tiny-qwen3-moe-fp8"}, 400, "quantization_config"),
                                ({"model_path": "/no/such/folder"}, 400, "config.json"),
                                ({}, 400, "model_path"),
                                ({"model_path": 7}, 400, "model_path"),
                                ({"model_path": WEIGHTS_A, "load_format": "dummy"}, 400, "load_format"),
                                ({"model_path": WEIGHTS_A, "abort_all_requests": "yes"}, 400, "abort_all_requests")):
        r = srv.post("/update_weights_from_disk", body)
        b = r.json() or {}
        msg = b.get("message") or (b.get("error") or {}).get("message") or ""
        check("update weights %s: %d naming %r" % (json.dumps(body), status, words),
              r.status == status and words in msg and b.get("success") is not True, r)
    answers("after refused updates", WEIGHTS_B)

    # abort_all_requests: the running request answers what it has
    run, r = update_while_running(79, 500, {"model_path": WEIGHTS_A, "abort_all_requests": True})
    body = r.json() or {}
    check("update weights with abort_all_requests: 200, success, 1 request aborted",
          r.status == 200 and body.get("success") is True and body.get("num_paused_requests") == 1, r)
    ok = isinstance(run, Reply) and run.status == 200
    if check("update weights: the aborted request answers 200", ok, run):
        m = run.json()["meta_info"]
        check("update weights: finish_reason abort by /update_weights_from_disk, fewer than 500 tokens",
              m.get("finish_reason") == {"type": "abort", "message": "aborted by /update_weights_from_disk"}
              and m.get("completion_tokens", 500) < 500, short(m))
    answers("back on the first folder", WEIGHTS_A)


def wait_running(srv, n, limit=30.0):
    t0 = time.time()
    while time.time() - t0 < limit:
        c = queue_counts(srv)
        if c is not None and c[0] + c[1] >= n:
            return True
        time.sleep(0.05)
    return False


def test_abort_request(srv):
    """/abort_request as SGLang's: by rid (also the n samples of a prompt's rid), abort_all; the
    aborted requests answer 200 with what they generated and finish_reason abort, the others run on;
    a rid that names nothing, or none at all, changes nothing."""
    long_sp = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}
    out = {}
    ts = [long_request(srv, {"input_ids": prompt_ids(901, 6), "rid": "abort-me", "sampling_params": long_sp}, out, "one"),
          long_request(srv, {"input_ids": prompt_ids(902, 6), "rid": "abort-n",
                             "sampling_params": dict(long_sp, n=2)}, out, "n"),
          long_request(srv, {"input_ids": prompt_ids(903, 6), "rid": "keep-me",
                             "sampling_params": dict(long_sp, max_new_tokens=60)}, out, "keep")]
    check("abort: 4 requests running", wait_running(srv, 4), queue_counts(srv))
    time.sleep(0.3)
    for body in ({"rid": "nobody"}, {}, {"rid": None, "abort_all": False}):
        r = srv.post("/abort_request", body)
        check("/abort_request %s: 200, empty" % json.dumps(body), r.status == 200 and r.body == b"", r)
    r = srv.post("/abort_request", {"rid": "abort-me"})
    check("/abort_request by rid: 200", r.status == 200, r)
    r = srv.post("/abort_request", {"rid": "abort-n"})
    check("/abort_request by the rid of n = 2: 200", r.status == 200, r)
    for t in ts:
        t.join(300)
    a, n, k = (out.get(x) for x in ("one", "n", "keep"))
    ok_a = isinstance(a, Reply) and a.status == 200 and isinstance(a.json(), dict)
    if check("abort by rid: HTTP 200 with the answer", ok_a, a):
        m = a.json()["meta_info"]
        check("abort by rid: finish_reason abort, 'aborted by /abort_request', the tokens so far",
              m.get("finish_reason") == {"type": "abort", "message": "aborted by /abort_request"}
              and m.get("completion_tokens", 1500) < 1500 and len(a.json()["output_ids"]) == m["completion_tokens"],
              short(m))
    ok_n = isinstance(n, Reply) and n.status == 200 and isinstance(n.json(), list) and len(n.json()) == 2
    if check("abort of n = 2 by their rid: HTTP 200 with both answers", ok_n, n):
        fr = [x["meta_info"].get("finish_reason", {}).get("type") for x in n.json()]
        check("abort of n = 2: both finish_reason abort", fr == ["abort", "abort"], fr)
    ok_k = isinstance(k, Reply) and k.status == 200 and isinstance(k.json(), dict)
    check("abort: the request not named ran to its end (length, 60 tokens)",
          ok_k and k.json()["meta_info"].get("finish_reason") == {"type": "length", "length": 60}, k)

    # abort_all: a streaming /generate and a streaming /v1/completions
    out = {}
    ts = [long_request(srv, {"input_ids": prompt_ids(904, 6), "stream": True, "sampling_params": long_sp}, out, "gen"),
          long_request(srv, {"prompt": prompt_ids(905, 6), "max_tokens": 1500, "ignore_eos": True,
                             "temperature": 0, "stream": True}, out, "oai")]
    check("abort_all: 2 streams running", wait_running(srv, 2), queue_counts(srv))
    time.sleep(0.3)
    r = srv.post("/abort_request", {"abort_all": True})
    check("/abort_request abort_all: 200", r.status == 200, r)
    for t in ts:
        t.join(300)
    g, o = out.get("gen"), out.get("oai")
    ok = isinstance(g, tuple) and g[0].status == 200 and g[1][1] is None and g[1][0]
    if check("abort_all: the /generate stream ends well formed", ok, g):
        last = g[1][0][-1]["meta_info"]
        check("abort_all: its last chunk says abort, with fewer than 1500 tokens",
              last.get("finish_reason", {}).get("type") == "abort" and last.get("completion_tokens", 0) < 1500, short(last))
    ok = isinstance(o, tuple) and o[0].status == 200 and o[1][1] is None and o[1][0]
    if check("abort_all: the /v1/completions stream ends well formed", ok, o):
        check("abort_all: its last choice's finish_reason is abort",
              o[1][0][-1]["choices"][0].get("finish_reason") == "abort", short(o[1][0][-1]))
    t0 = time.time()
    while time.time() - t0 < 5 and queue_counts(srv) != (0, 0):
        time.sleep(0.05)
    check("abort_all: nothing left running or waiting", queue_counts(srv) == (0, 0), queue_counts(srv))
    e = lambda *a, **k: expect_error(srv, *a, **k)
    e("/abort_request rid a number", "POST", "/abort_request", {"rid": 5})
    e("/abort_request abort_all a string", "POST", "/abort_request", {"abort_all": "yes"})
    e("/abort_request not an object", "POST", "/abort_request", b'["x"]')
    e("/abort_request by GET", "GET", "/abort_request", status=405)
    b = gen_ok(srv, "after the aborts", {"text": "still there?", "sampling_params": {"max_new_tokens": 4}})
    check("abort: a new request is served to its end", b is not None and b["meta_info"]["completion_tokens"] == 4, b)


# ---- bad input


def expect_error(srv, name, method, path, body=None, status=400, headers=None):
    """One bad-input test: the status, a JSON {"error": {"message": str}} body, then /health 200."""
    try:
        r = http_request(srv.port, method, path, body=body, headers=headers if headers is not None else srv.headers())
    except OSError as e:
        check("bad input %s: answered" % name, False, "%s (server %s)" % (e, "alive" if srv.alive() else "dead"))
        health_ok(srv, name)
        return
    b = r.json()
    msg = b.get("error", {}).get("message") if isinstance(b, dict) and isinstance(b.get("error"), dict) else None
    check("bad input %s: HTTP %d with {\"error\": {\"message\": ...}}" % (name, status),
          r.status == status and isinstance(msg, str) and msg != "", r)
    health_ok(srv, name)


def test_bad_input(srv):
    sp = {"max_new_tokens": 4}
    e = lambda *a, **k: expect_error(srv, *a, **k)
    e("malformed JSON", "POST", "/generate", b'{"text": "hi", "sampling_params": {')
    e("body not a JSON object", "POST", "/generate", b'[1, 2, 3]')
    e("wrong type: max_new_tokens \"ten\"", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}})
    e("wrong type: text 42", "POST", "/generate", {"text": 42, "sampling_params": sp})
    e("wrong type: input_ids of strings", "POST", "/generate", {"input_ids": ["a", "b"], "sampling_params": sp})
    e("wrong type: sampling_params a string", "POST", "/generate", {"text": "hi", "sampling_params": "greedy"})
    e("both text and input_ids", "POST", "/generate", {"text": "hi", "input_ids": [1, 2], "sampling_params": sp})
    e("neither text nor input_ids", "POST", "/generate", {"sampling_params": sp})
    e("empty prompt text \"\"", "POST", "/generate", {"text": "", "sampling_params": sp})
    e("empty prompt input_ids []", "POST", "/generate", {"input_ids": [], "sampling_params": sp})
    e("token id %d = vocab size" % VOCAB, "POST", "/generate", {"input_ids": [1, VOCAB], "sampling_params": sp})
    e("token id -1", "POST", "/generate", {"input_ids": [1, -1], "sampling_params": sp})
    e("token id 2^40", "POST", "/generate", {"input_ids": [1, 2 ** 40], "sampling_params": sp})
    e("negative max_new_tokens", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}})
    e("top_p 0", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "top_p": 0}})
    e("top_p 1.5", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "top_p": 1.5}})
    e("negative temperature", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": -0.5}})
    e("repetition_penalty 0", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "repetition_penalty": 0}})
    e("frequency_penalty 2.5", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "frequency_penalty": 2.5}})
    e("presence_penalty -3", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "presence_penalty": -3}})
    e("min_p 1.5", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "min_p": 1.5}})
    e("n 0", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "n": 0}})
    e("temperature NaN (bare NaN is not JSON)", "POST", "/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}')
    e("prompt of %d tokens > context %d" % (MAX_POS + 50, MAX_POS), "POST", "/generate",
      {"input_ids": prompt_ids(9, MAX_POS + 50), "sampling_params": sp})
    e("unknown path", "GET", "/no/such/path", status=404)
    e("unknown POST path", "POST", "/v1/nothing", {"x": 1}, status=404)
    e("wrong method GET /generate", "GET", "/generate", status=405)
    e("wrong method GET /v1/completions", "GET", "/v1/completions", status=405)
    e("wrong method DELETE /health", "DELETE", "/health", status=405)
    # batch with one bad item: the whole request is refused
    e("batch with an out-of-vocabulary item", "POST", "/generate", {"input_ids": [[1, 2], [1, VOCAB + 5]], "sampling_params": sp})
    # OpenAI endpoints
    model = model_name(srv)
    e("/v1/completions malformed JSON", "POST", "/v1/completions", b'{"prompt": ')
    e("/v1/completions no prompt", "POST", "/v1/completions", {"model": model, "max_tokens": 4})
    e("/v1/completions negative max_tokens", "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -3})
    e("/v1/completions top_p 1.5", "POST", "/v1/completions", {"model": model, "prompt": "hi", "top_p": 1.5})
    e("/v1/chat/completions no messages", "POST", "/v1/chat/completions", {"model": model, "max_tokens": 4})
    e("/v1/chat/completions empty messages", "POST", "/v1/chat/completions", {"model": model, "messages": []})
    e("/v1/completions unknown model", "POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, status=404)
    e("/v1/chat/completions messages not a list", "POST", "/v1/chat/completions", {"model": model, "messages": "hi"})
    e("/v1/chat/completions negative temperature", "POST", "/v1/chat/completions",
      {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    # garbage the server must survive (status < 500 not required of raw garbage; survival is)
    for name, raw in (("garbage request line", b"HELLO\r\n\r\n"),
                      ("deeply nested JSON", None),
                      ("invalid UTF-8 in a JSON string", None)):
        try:
            if raw is not None:
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                s.sendall(raw)
                try:
                    s.recv(4096)
                except OSError:
                    pass
                s.close()
                check("survives %s" % name, True)
            elif name.startswith("deeply"):
                r = srv.post("/generate", b"[" * 100000)
                check("%s: 4xx" % name, 400 <= r.status < 500, r)
            else:
                r = srv.post("/generate", b'{"text": "\xff\xfe bad", "sampling_params": {"max_new_tokens": 2}}')
                check("%s: 200 or 400" % name, r.status in (200, 400), r)
        except OSError as ex:
            check("%s: answered" % name, False, ex)
        health_ok(srv, name)


# ---------------------------------------------------------------------------------------------
# Other servers


def test_noradix(srv, shared):
    for path in ("/get_server_info", "/server_info"):
        b = srv.get(path).json()
        check("--disable-radix-cache: %s disable_radix_cache true" % path,
              isinstance(b, dict) and b.get("disable_radix_cache") is True, short(b))
    P = prompt_ids(3, 300)
    Y = prompt_ids(5, 20)
    req = {"input_ids": P + Y, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
           "return_logprob": True}
    a = gen_ok(srv, "--disable-radix-cache first", req)
    b = gen_ok(srv, "--disable-radix-cache second", req)
    if a and b:
        check("--disable-radix-cache: same long prompt twice, cached_tokens 0 both times",
              a["meta_info"].get("cached_tokens") == 0 and b["meta_info"].get("cached_tokens") == 0,
              "%r, %r" % (a["meta_info"].get("cached_tokens"), b["meta_info"].get("cached_tokens")))
        cold = shared.get("cold_prefix_answer")
        if cold:
            d = max_abs_diff(logprob_values(cold["meta_info"]["output_token_logprobs"]),
                             logprob_values(b["meta_info"]["output_token_logprobs"]))
            check("--disable-radix-cache: same answer and logprobs as the radix server (max diff %.3g)" % d,
                  d <= LOGPROB_TOL and b["output_ids"] == cold["output_ids"], "")
    r = srv.get("/metrics")
    check("/metrics without --enable-metrics: 404", r.status == 404, r)


def test_apikey(srv):
    body = {"text": "key?", "sampling_params": {"max_new_tokens": 2}}
    expect_error(srv, "API key missing", "POST", "/generate", body, status=401, headers={})
    expect_error(srv, "API key wrong", "POST", "/generate", body, status=401, headers={"Authorization": "Bearer wrong"})
    expect_error(srv, "API key missing on /v1/completions", "POST", "/v1/completions",
                 {"prompt": "key?", "max_tokens": 2}, status=401, headers={})
    expect_error(srv, "API key missing on /v1/models", "GET", "/v1/models", status=401, headers={})
    r = srv.post("/generate", body)
    check("API key right: /generate 200", r.status == 200, r)
    r = srv.post("/v1/completions", {"model": model_name(srv), "prompt": "key?", "max_tokens": 2})
    check("API key right: /v1/completions 200", r.status == 200, r)


def test_context(srv):
    # this server also keeps its KV cache in BF16
    info = srv.get("/server_info").json() or {}
    check("--kv-cache-dtype bfloat16: /server_info kv_cache_dtype bfloat16",
          info.get("kv_cache_dtype") == "bfloat16", info.get("kv_cache_dtype"))
    r = srv.get("/v1/models")
    b = r.json()
    check("--context-length 64: /v1/models max_model_len 64",
          r.status == 200 and b and b["data"][0].get("max_model_len") == 64, r)
    gen_ok(srv, "--context-length 64: short prompt", {"input_ids": prompt_ids(10, 10),
                                                          "sampling_params": {"max_new_tokens": 8}})
    expect_error(srv, "prompt of 100 tokens > --context-length 64", "POST", "/generate",
                 {"input_ids": prompt_ids(11, 100), "sampling_params": {"max_new_tokens": 4}})
    expect_error(srv, "prompt 10 + max_new_tokens 100 > --context-length 64", "POST", "/generate",
                 {"input_ids": prompt_ids(16, 10), "sampling_params": {"max_new_tokens": 100}})
    expect_error(srv, "text prompt > --context-length 64", "POST", "/generate",
                 {"text": "many words " * 80, "sampling_params": {"max_new_tokens": 4}})
    expect_error(srv, "/v1/completions prompt > --context-length 64", "POST", "/v1/completions",
                 {"prompt": prompt_ids(12, 100), "max_tokens": 4})


def test_body_limit(srv):
    gen_ok(srv, "--max-body-bytes 4096: small request", {"text": "small", "sampling_params": {"max_new_tokens": 2}})
    big = {"text": "x" * 10240, "sampling_params": {"max_new_tokens": 2}}
    expect_error(srv, "oversized body (10 KB > --max-body-bytes 4096)", "POST", "/generate", big, status=413)
    expect_error(srv, "oversized /v1/completions body", "POST", "/v1/completions",
                 {"prompt": "y" * 10240, "max_tokens": 2}, status=413)

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"text": "'
        for _ in range(10):
            yield b"z" * 1024
        yield b'", "sampling_params": {"max_new_tokens": 2}}'

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", "/generate", body=chunks(), encode_chunked=True, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        check("bad input oversized chunked body (10 KB, no Content-Length): HTTP 413", r.status == 413,
              "HTTP %d %s" % (r.status, data[:200]))
    except OSError as ex:
        check("bad input oversized chunked body: answered", False, ex)
    finally:
        conn.close()
    health_ok(srv, "oversized chunked body")


def test_tight(srv):
    """KV cache of 1024 tokens, 6 running at most, 32-token prefill chunks: 10 requests of 40 + 150
    tokens at once must wait, be preempted and recomputed, and still give exactly the CLI's tokens
    (logprobs within 1e-4)."""
    reqs = [{"input_ids": prompt_ids(300 + k, 40), "return_logprob": True,
             "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}} for k in range(10)]
    refs = [cli_generate(["--input-ids", ",".join(map(str, q["input_ids"])), "--max-new-tokens", "150",
                          "--temperature", "0", "--ignore-eos", "--return-logprob"]) for q in reqs]
    replies = [None] * len(reqs)
    done = threading.Event()
    peak = [0.0]

    def watch():
        while not done.is_set():
            c = queue_counts(srv)
            if c and c[0] is not None:
                peak[0] = max(peak[0], c[0])
            time.sleep(0.02)

    def worker(i):
        try:
            replies[i] = gen(srv, reqs[i])
        except OSError as e:
            replies[i] = e

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    w.join()
    for i, r in enumerate(replies):
        b = r.json() if isinstance(r, Reply) and r.status == 200 else None
        if not check("tight KV: request %d answered 200" % i, b is not None, r):
            continue
        check("tight KV: request %d output == CLI's (150 tokens)" % i, b["output_ids"] == refs[i]["output_ids"],
              "server %s / CLI %s" % (short(b["output_ids"], 120), short(refs[i]["output_ids"], 120)))
        d = max_abs_diff(logprob_values(b["meta_info"]["output_token_logprobs"]),
                         logprob_values(refs[i]["meta_info"]["output_token_logprobs"]))
        check("tight KV: request %d logprobs within %g of the CLI's (max diff %.3g)" % (i, LOGPROB_TOL, d),
              d <= LOGPROB_TOL, "")
    check("tight KV: running gauge never above --max-running-requests 6 (peak %g)" % peak[0], peak[0] <= 6, "")
    text = srv.get("/metrics").body.decode("utf-8", "replace")
    name = find_metric(metrics_types(text), "counter", "preempt")
    if name:
        v = metric_value(metrics_samples(text), name)
        check("tight KV: preemption exercised (%s = %s)" % (name, v), v is not None and v > 0, "")

    # chunked prefill (32 tokens a step) scores a 300-token prompt as the CLI does
    ids = prompt_ids(15, 300)
    b = gen_ok(srv, "chunked prefill teacher-forced", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                                        "sampling_params": {"max_new_tokens": 0}})
    ref = cli_generate(["--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "0", "--return-logprob",
                        "--logprob-start-len", "0"])
    if b:
        a = logprob_values(b["meta_info"]["input_token_logprobs"])
        c = logprob_values(ref["meta_info"]["input_token_logprobs"])
        d = max_abs_diff(a, c)
        check("chunked prefill: 300 teacher-forced logprobs within %g of the CLI's (max diff %.3g%s)"
              % (LOGPROB_TOL, d, ", same bits" if same_bits(a, c) < 0 else ""), d <= LOGPROB_TOL, "")


def open_raw(srv, path, obj):
    """Send a POST on a raw socket and return the socket (nothing read)."""
    body = json.dumps(obj).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(body)) + body)
    return s


def reset(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_abort_queued(srv):
    """--max-running-requests 1: /abort_request of a request still waiting answers it at once (no
    tokens), while the one running goes on until it is aborted too."""
    long_sp = {"max_new_tokens": 1900, "ignore_eos": True}
    out = {}
    ta = long_request(srv, {"input_ids": [5, 6, 7], "rid": "q-run", "sampling_params": long_sp}, out, "run")
    check("abort queued: the first request runs", wait_running(srv, 1), queue_counts(srv))
    tb = long_request(srv, {"input_ids": [5, 6, 8], "rid": "q-wait", "sampling_params": long_sp}, out, "wait")
    check("abort queued: the second one waits", wait_running(srv, 2), queue_counts(srv))
    r = srv.post("/abort_request", {"rid": "q-wait"})
    tb.join(30)
    b = out.get("wait")
    ok = isinstance(b, Reply) and b.status == 200 and isinstance(b.json(), dict)
    check("abort queued: the waiting request answers 200, finish_reason abort, no tokens",
          r.status == 200 and ok and b.json()["meta_info"].get("finish_reason", {}).get("type") == "abort"
          and b.json()["meta_info"].get("completion_tokens") == 0, b)
    t0 = time.time()
    while time.time() - t0 < 5 and queue_counts(srv) != (1, 0):  # the counts trail a step
        time.sleep(0.02)
    check("abort queued: the running one still runs", ta.is_alive() and queue_counts(srv) == (1, 0), queue_counts(srv))
    srv.post("/abort_request", {"rid": "q-run"})
    ta.join(60)
    a = out.get("run")
    check("abort queued: then the running one is aborted too",
          isinstance(a, Reply) and a.status == 200
          and (a.json() or {}).get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", a)


def test_queued_disconnect(srv):
    """--max-running-requests 1: four long streams queue one behind the other; three clients
    (streaming and not) wait behind them and hang up before they are admitted. Their requests
    leave the queue at once, long before they could have been served."""
    long_req = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    blockers = [open_raw(srv, "/generate", long_req) for _ in range(4)]
    deadline = time.time() + 10
    c = None
    while time.time() < deadline:
        c = queue_counts(srv)
        if c and c[0] == 1 and c[1] >= 3:
            break
        time.sleep(0.02)
    leavers = [open_raw(srv, "/generate", long_req),
               open_raw(srv, "/generate", dict(long_req, stream=False)),
               open_raw(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1900, "stream": True,
                                                 "ignore_eos": True})]
    while time.time() < deadline:
        c = queue_counts(srv)
        if c and c[1] >= 6:
            break
        time.sleep(0.02)
    if not check("queued disconnect: 1 running, the others waiting before the hang-up", c is not None and c[0] == 1
                 and c[1] >= 5, "running, waiting = %s" % (c,)):
        for s in blockers + leavers:
            reset(s)
        return
    before = c[1]
    for s in leavers:
        reset(s)
    t0 = time.time()
    while time.time() - t0 < 2.0:
        c = queue_counts(srv)
        if c and c[1] <= before - 3:
            break
        time.sleep(0.02)
    check("queued disconnect: 3 queued clients gone -> waiting %g -> %s within 2 s (%.2f s)"
          % (before, c and c[1], time.time() - t0), c is not None and c[1] <= before - 3, "")
    for s in blockers:
        reset(s)
    t0 = time.time()
    while time.time() - t0 < 5.0:
        c = queue_counts(srv)
        if c == (0, 0):
            break
        time.sleep(0.05)
    check("queued disconnect: all clients gone -> running and waiting 0 within 5 s", c == (0, 0), c)
    health_ok(srv, "queued disconnects")


def test_queue_limit(srv):
    """--max-running-requests 1 --max-queued-requests 2: one long request runs, two wait; the
    next ones get 503 with Retry-After and a JSON error at once (/generate and
    /v1/completions), the admitted ones all finish, and once the queue drains a request is
    served again."""
    long_req = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    held = [None] * 3

    def run(i):
        try:
            held[i] = http_request(srv.port, "POST", "/generate", long_req,
                                   timeout=120 * float(os.environ.get("MOESERVE_TEST_TIME_SCALE", "1")))
        except OSError as ex:
            held[i] = ex

    threads = []
    for i in range(3):  # one by one, so that the first runs and the other two wait
        t = threading.Thread(target=run, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.time() + 10
        while time.time() < deadline:
            c = queue_counts(srv)
            if c and c[0] + c[1] >= i + 1:
                break
            time.sleep(0.02)
    c = queue_counts(srv)
    check("queue limit: 1 running and 2 waiting before the overflow", c == (1, 2), "running, waiting = %s" % (c,))
    over = [http_request(srv.port, "POST", "/generate", long_req),
            http_request(srv.port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}),
            http_request(srv.port, "POST", "/generate", {"input_ids": [[5, 6], [7, 8]],
                                                         "sampling_params": {"max_new_tokens": 2}})]
    for name, r in zip(["/generate", "/v1/completions", "/generate batch of 2"], over):
        j = r.json()
        check("queue limit: %s over the limit gets 503 with Retry-After and a message" % name,
              r.status == 503 and r.headers.get("retry-after") == "1" and isinstance(j, dict)
              and "queue" in str(j.get("error", {}).get("message", "")), r)
    for t in threads:  # make asan sets MOESERVE_TEST_TIME_SCALE: 3000 tokens take longer there
        t.join(timeout=120 * float(os.environ.get("MOESERVE_TEST_TIME_SCALE", "1")))
    ok = all(isinstance(h, Reply) and h.status == 200 and len((h.json() or {}).get("output_ids", [])) == 1000
             for h in held)
    check("queue limit: the 3 admitted requests finish with their 1000 tokens", ok, held)
    info = http_request(srv.port, "GET", "/server_info").json() or {}
    check("queue limit: /server_info reports max_queued_requests 2", info.get("max_queued_requests") == 2, info.get("max_queued_requests"))
    gen_ok(srv, "queue limit: served again once the queue drained", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})


def test_shutdown_in_flight(srv):
    """SIGTERM with a stream in flight: the client's stream ends (no hang) and the server exits."""
    body = json.dumps({"input_ids": [5, 6, 7], "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    buf = b""
    while b"data: " not in buf:
        d = s.recv(4096)
        if not d:
            break
        buf += d
    srv.proc.terminate()
    ended = False
    try:
        while True:
            d = s.recv(65536)
            if not d:
                ended = True
                break
            buf += d
            if buf.endswith(b"data: [DONE]\n\n") or buf.endswith(b"0\r\n\r\n"):
                ended = True
                break
    except OSError:
        ended = True
    s.close()
    check("SIGTERM with a stream in flight: the client's stream ends", ended, buf[-200:])
    try:
        rc = srv.proc.wait(10)
        check("SIGTERM with a stream in flight: server exits within 10 s with status 0", rc == 0, "status %s" % rc)
    except subprocess.TimeoutExpired:
        check("SIGTERM with a stream in flight: server exits within 10 s", False, srv.log_tail())


# ---------------------------------------------------------------------------------------------
# --skip-tokenizer-init: token ids in, token ids out (SGLang's flag)


def tokfree_lp_diff(name, a, b, key):
    """Logprob entries of a (no tokenizer) against b (with one): the same ids, no text, values
    within LOGPROB_TOL. Rows of top logprobs (lists of entries, or None) are compared entry by entry."""
    ea, eb = a["meta_info"].get(key), b["meta_info"].get(key)
    if not check("%s: %s present in both" % (name, key), isinstance(ea, list) and isinstance(eb, list), (short(a), short(b))):
        return
    flat_a, flat_b = [], []
    for ra, rb in zip(ea, eb):
        if key.endswith("top_logprobs"):
            if ra is None or rb is None:
                flat_a.append(ra)
                flat_b.append(rb)
                continue
            flat_a.extend(ra)
            flat_b.extend(rb)
        else:
            flat_a.append(ra)
            flat_b.append(rb)
    ok = len(ea) == len(eb) and len(flat_a) == len(flat_b)
    ok = ok and all((x is None) == (y is None) for x, y in zip(flat_a, flat_b))
    pairs = [(x, y) for x, y in zip(flat_a, flat_b) if x is not None]
    ok = ok and all(x[1] == y[1] and x[2] is None for x, y in pairs)
    diff = max_abs_diff([x[0] for x, _ in pairs], [y[0] for _, y in pairs]) if ok else math.inf
    check("%s: %s has the same token ids, null texts, values within %g (%g)" % (name, key, LOGPROB_TOL, diff),
          ok and diff <= LOGPROB_TOL, "%s vs %s" % (short(ea), short(eb)))


def tokfree_same_answer(name, a, b):
    """An answer of the server without tokenizer (a) against the usual server's (b)."""
    check("%s: no text key, as SGLang's token-id answers" % name, "text" not in a, short(a))
    check("%s: the same output_ids as the usual server" % name, a.get("output_ids") == b.get("output_ids"),
          "%s vs %s" % (a.get("output_ids"), b.get("output_ids")))
    ma, mb = a.get("meta_info", {}), b.get("meta_info", {})
    for k in ("prompt_tokens", "completion_tokens", "finish_reason"):
        check("%s: meta_info.%s as the usual server's" % (name, k), k in ma and ma.get(k) == mb.get(k),
              "%r vs %r" % (ma.get(k), mb.get(k)))
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
        if key in mb:
            tokfree_lp_diff(name, a, b, key)


def test_tokfree(srv):
    ref = Server("tokfree-ref")
    try:
        if not check("tokfree: the usual server (with tokenizer) starts", ref.start(), ref.log_tail()):
            return
        for path in ("/server_info", "/get_server_info"):
            a, b = srv.get(path).json(), ref.get(path).json()
            check("tokfree: %s says skip_tokenizer_init true (false on the usual server)" % path,
                  isinstance(a, dict) and a.get("skip_tokenizer_init") is True and isinstance(b, dict)
                  and b.get("skip_tokenizer_init") is False, "%s | %s" % (short(a), short(b)))

        # input_ids alone, then with logprobs, as a batch, with stop_token_ids, sampled with a seed
        prompts = [prompt_ids(700 + i, n) for i, n in enumerate((5, 17, 40))]
        ref_out = []
        for i, ids in enumerate(prompts):
            payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12},
                       "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
            a = gen_ok(srv, "tokfree input_ids %d" % i, payload)
            b = gen_ok(ref, "tokfree usual input_ids %d" % i, payload)
            ref_out.append(b["output_ids"] if b else None)
            if a is not None and b is not None:
                tokfree_same_answer("tokfree input_ids %d (logprobs)" % i, a, b)
        batch = {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        a, b = gen_ok(srv, "tokfree batch", batch), gen_ok(ref, "tokfree usual batch", batch)
        if check("tokfree batch: a list of 3 answers", isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 3,
                 short(a)):
            for i in range(3):
                tokfree_same_answer("tokfree batch item %d" % i, a[i], b[i])
        if ref_out[1]:
            stop = ref_out[1][3]
            payload = {"input_ids": prompts[1],
                       "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop]}}
            a, b = gen_ok(srv, "tokfree stop_token_ids", payload), gen_ok(ref, "tokfree usual stop_token_ids", payload)
            if a is not None and b is not None:
                tokfree_same_answer("tokfree stop_token_ids", a, b)
                fr = a["meta_info"].get("finish_reason") or {}
                check("tokfree stop_token_ids: finish_reason stop, matched %d" % stop,
                      fr.get("type") == "stop" and fr.get("matched") == stop, short(a))
        payload = {"input_ids": prompts[0], "sampling_params": {"temperature": 0.8, "max_new_tokens": 10, "n": 2,
                                                                "sampling_seed": 11}}
        a, b = gen_ok(srv, "tokfree n=2 seeded", payload), gen_ok(ref, "tokfree usual n=2 seeded", payload)
        if check("tokfree n=2 seeded: two answers each", isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2,
                 short(a)):
            for i in range(2):
                tokfree_same_answer("tokfree n=2 seeded item %d" % i, a[i], b[i])

        # streaming: every chunk carries the (cumulative) output_ids, the last one all of them
        payload = {"input_ids": prompts[2], "sampling_params": {"temperature": 0, "max_new_tokens": 12}, "stream": True}
        r, (events, err) = srv.post_stream("/generate", payload)
        ok = r.status == 200 and err is None and len(events) >= 2
        if check("tokfree stream: 200, well-formed events ending with [DONE]", ok, "%r %s" % (r, err)):
            ids = [e.get("output_ids") for e in events]
            check("tokfree stream: no chunk has a text key", all("text" not in e for e in events), short(events[0]))
            check("tokfree stream: output_ids grow chunk by chunk, completion_tokens counts them",
                  all(isinstance(x, list) for x in ids)
                  and all(len(ids[k]) > len(ids[k - 1]) and ids[k][:len(ids[k - 1])] == ids[k - 1] for k in range(1, len(ids)))
                  and all(e["meta_info"]["completion_tokens"] == len(e["output_ids"]) for e in events), short(ids))
            check("tokfree stream: the last chunk's output_ids are the usual server's", ids[-1] == ref_out[2],
                  "%s vs %s" % (ids[-1], ref_out[2]))
            check("tokfree stream: finish_reason only on the last chunk",
                  all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
                  and events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}, short(events[-1]))

        # text, stop strings and chat need the tokenizer: 400, and the server goes on
        r = gen(srv, {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
        body = r.json() or {}
        msg = (body.get("error") or {}).get("message", "")
        check("tokfree: a text prompt gets 400 naming --skip-tokenizer-init", r.status == 400 and "--skip-tokenizer-init" in msg
              and "input_ids" in msg, r)
        e = lambda *a, **k: expect_error(srv, *a, **k)
        e("tokfree text batch", "POST", "/generate", {"text": ["a", "b"]})
        e("tokfree stop string", "POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"stop": "x"}})
        e("tokfree stop list", "POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"stop": ["x", "y"]}})
        e("tokfree chat", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        e("tokfree completions text prompt", "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        e("tokfree completions list of texts", "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
        e("tokfree completions stop", "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "stop": ["\n"]})
        e("tokfree /tokenize", "POST", "/tokenize", {"prompt": "Hello"})
        e("tokfree /detokenize", "POST", "/v1/detokenize", {"tokens": [5, 6]})

        # /v1/completions with token-id prompts: empty text, usage, logprobs named by token id
        r = srv.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                         "echo": True})
        body = r.json()
        ok = r.status == 200 and isinstance(body, dict) and len(body.get("choices", [])) == 1
        if check("tokfree completions, ids prompt: 200 with one choice", ok, r):
            c = body["choices"][0]
            check("tokfree completions: empty text, finish_reason length", c.get("text") == "" and c.get("finish_reason") == "length",
                  short(c))
            check("tokfree completions: usage", body.get("usage") == {"prompt_tokens": 5, "completion_tokens": 6,
                                                                      "total_tokens": 11}, short(body.get("usage")))
            want = ["token_id:%d" % t for t in prompts[0] + (ref_out[0] or [])[:6]]
            lp = c.get("logprobs") or {}
            check("tokfree completions: logprob tokens are token_id:N of the prompt and the usual output",
                  lp.get("tokens") == want and lp.get("text_offset") == [0] * len(want), short(lp))
        r = srv.post("/v1/completions", {"prompt": [prompts[0], prompts[1]], "max_tokens": 4, "temperature": 0})
        body = r.json()
        ok = r.status == 200 and isinstance(body, dict) and len(body.get("choices", [])) == 2
        if check("tokfree completions, list of id lists: 200 with two choices", ok, r):
            check("tokfree completions (2 prompts): empty texts and usage",
                  all(c.get("text") == "" for c in body["choices"])
                  and body.get("usage") == {"prompt_tokens": 22, "completion_tokens": 8, "total_tokens": 30}, short(body))
        r, (events, err) = srv.post_stream("/v1/completions", {"prompt": prompts[1], "max_tokens": 5, "temperature": 0,
                                                               "stream": True, "stream_options": {"include_usage": True}})
        ok = r.status == 200 and err is None and len(events) >= 2
        if check("tokfree completions stream: 200, well-formed", ok, "%r %s" % (r, err)):
            texts = [c.get("text") for e in events for c in e.get("choices", [])]
            # tokens made between two of the server's polls share a chunk (a loaded machine sends
            # fewer than five): at least one chunk with a choice, then the usage
            check("tokfree completions stream: empty texts, chunks with choices, the usage last",
                  all(t == "" for t in texts) and len(texts) >= 1
                  and events[-1].get("usage") == {"prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22},
                  short(events))
        r = srv.get("/health_generate")
        check("tokfree: /health_generate 200", r.status == 200, r)
        r = srv.get("/metrics")
        check("tokfree: /metrics 200", r.status == 200, r)
    finally:
        ref.stop()


def test_dummy_refuses(folder):
    """serve --load-format dummy on a folder without tokenizer, without --skip-tokenizer-init: start-up stops
    with a message naming the missing file and the flag."""
    cmd = [BIN, "serve", "--model-path", folder, "--load-format", "dummy", "--port", "0"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        check("dummy without --skip-tokenizer-init: refuses to start", False, "still running after 60 s")
        return
    err = err.decode("utf-8", "replace")
    check("dummy without --skip-tokenizer-init: exits non-zero naming %s/tokenizer.json and the flag" % folder,
          p.returncode != 0 and os.path.join(folder, "tokenizer.json") in err and "--skip-tokenizer-init" in err,
          "exit %s: %s" % (p.returncode, err.strip()))


def test_dummy_update_weights(srv):
    """/update_weights_from_disk on a server of dummy weights loads the folder's own (from disk,
    as the name says), not dummy weights again. The folder: WEIGHTS_A's config.json and weights
    without its generation_config.json, so that its config equals the served one."""
    payload = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    with tempfile.TemporaryDirectory(prefix="moeserve-weights-") as folder:
        for f in os.listdir(os.path.join(ROOT, WEIGHTS_A)):
            if f == "config.json" or "safetensors" in f:
                os.symlink(os.path.join(ROOT, WEIGHTS_A, f), os.path.join(folder, f))
        r = srv.post("/update_weights_from_disk", {"model_path": folder})
        check("dummy: update_weights_from_disk to %s's weights: 200, success" % WEIGHTS_A,
              r.status == 200 and (r.json() or {}).get("success") is True, r)
        b = gen_ok(srv, "dummy, after the update", payload)
        want = cli_generate(["--input-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--temperature", "0"],
                            model=folder)
    check("dummy: after the update, the ids of `moeserve generate` on those weights",
          b is not None and b.get("output_ids") == want["output_ids"],
          "%s vs %s" % (b and b.get("output_ids"), want["output_ids"]))


def test_dummy(srv, folder):
    info = srv.get("/server_info").json() or {}
    check("dummy: /server_info says skip_tokenizer_init true, load_format dummy",
          info.get("skip_tokenizer_init") is True and info.get("load_format") == "dummy", short(info))
    payload = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    a, b = gen_ok(srv, "dummy input_ids", payload), gen_ok(srv, "dummy input_ids again", payload)
    if a is None or b is None:
        return
    vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    ids = a.get("output_ids")
    check("dummy: 6 output ids inside the vocabulary, no text key",
          isinstance(ids, list) and len(ids) == 6 and all(0 <= t < vocab for t in ids) and "text" not in a, short(a))
    check("dummy: the same ids twice (weights seeded by name)", ids == b.get("output_ids"), "%s vs %s" % (ids, b.get("output_ids")))
    # the CLI builds the same dummy model from the same config.json
    cmd = [BIN, "generate", "--model-path", "tests/data/tiny-qwen3-moe", "--load-format", "dummy",
           "--input-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--temperature", "0"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120)
    cli = json.loads(p.stdout) if p.returncode == 0 else {}
    check("dummy: the same ids as `moeserve generate --load-format dummy`", cli.get("output_ids") == ids,
          "%s vs %s (%s)" % (ids, cli.get("output_ids"), p.stderr.decode()[-200:]))
    expect_error(srv, "dummy text prompt", "POST", "/generate", {"text": "Hello"})
    r = srv.post("/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0})
    body = r.json() or {}
    check("dummy: /v1/completions with token ids answers empty text and usage",
          r.status == 200 and [c.get("text") for c in body.get("choices", [])] == [""]
          and body.get("usage", {}).get("completion_tokens") == 3, r)

    # the benchmark client over HTTP: random token ids, every request successful
    bench = os.path.join(ROOT, BUILD, "moeserve-bench")
    if not check("dummy: %s is built" % bench, os.access(bench, os.X_OK), "build it first (make)"):
        return
    for backend in ("sglang", "openai"):
        cmd = [bench, "serving", "--url", "http://127.0.0.1:%d" % srv.port, "--backend", backend,
               "--dataset", "random-ids", "--vocab-size", str(vocab), "--num-prompts", "8",
               "--random-input-len", "24", "--random-output-len", "8", "--random-range-ratio", "0.5",
               "--warmup-requests", "1", "--disable-progress"]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            check("dummy: moeserve-bench serving --backend %s ends within 120 s" % backend, False, " ".join(cmd))
            continue
        out = p.stdout.decode("utf-8", "replace")
        ok = (p.returncode == 0 and re.search(r"^Successful requests:\s+8\s*$", out, re.M)
              and re.search(r"^Failed requests:\s+0\s*$", out, re.M))
        check("dummy: moeserve-bench serving --backend %s --dataset random-ids: 8 of 8 successful" % backend, ok,
              "exit %d: %s %s" % (p.returncode, out[-400:], p.stderr.decode()[-300:]))
        if backend == "sglang":  # token ids without text still time the first token and the gaps
            ttft = re.search(r"^Mean TTFT \(ms\):\s+([0-9.]+)\s*$", out, re.M)
            itl = re.search(r"^Mean ITL \(ms\):\s+([0-9.]+)\s*$", out, re.M)
            check("dummy: moeserve-bench times TTFT and ITL from output_ids chunks (no text)",
                  bool(ttft and itl and float(ttft.group(1)) > 0 and float(itl.group(1)) > 0),
                  out[-600:])


# ---------------------------------------------------------------------------------------------


def run_test(fn, *args):
    try:
        fn(*args)
    except Exception as ex:  # one test's crash is one failure; the rest still run
        tb = traceback.format_exc().strip().splitlines()
        check("%s raised" % fn.__name__, False, "%s: %s | %s" % (type(ex).__name__, ex, " / ".join(tb[-3:])))


def with_server(srv, tests):
    try:
        ok = srv.start()
        if not check("server %s starts (%s)" % (srv.name, " ".join(srv.flags) or "default flags"), ok,
                     "exit %s; log:\n    %s" % (srv.proc.poll() if srv.proc else None, srv.log_tail())):
            return
        for fn, args in tests:
            if fn is test_shutdown_in_flight:
                run_test(fn, srv, *args)
                return
            t0 = time.time()
            run_test(fn, srv, *args)
            if VERBOSE:
                print("     %s: %.1f s" % (fn.__name__, time.time() - t0), flush=True)
            if not srv.alive():
                check("server %s alive after %s" % (srv.name, fn.__name__), False, srv.log_tail())
                return
        if check("server %s alive at the end" % srv.name, srv.alive(), srv.log_tail()):
            srv.proc.terminate()
            try:
                rc = srv.proc.wait(10)
                if not check("server %s exits on SIGTERM within 10 s with status 0" % srv.name, rc == 0,
                             "status %s; log:\n    %s" % (rc, srv.log_tail(8))):
                    print("     the server's log from its stop on:\n    %s" % srv.log_from("SIGTERM"), flush=True)
            except subprocess.TimeoutExpired:
                check("server %s exits on SIGTERM within 10 s" % srv.name, False, srv.log_tail())
    finally:
        srv.stop()


def main(argv):
    global VERBOSE
    args = [a for a in argv if a != "-v"]
    VERBOSE = len(args) != len(argv)
    groups = set(args) or {"main", "noradix", "apikey", "context", "body", "tight", "queue", "tokfree", "dummy",
                           "weights"}
    if not os.access(BIN, os.X_OK):
        check("binary %s exists" % BIN, False, "build it first (make)")
        print(R.summary())
        return 1
    shared = {}
    t0 = time.time()
    if "main" in groups:
        with_server(Server("main", ["--enable-metrics"]), [
            (test_health_and_info, ()),
            (test_logprobs_equal_cli, ()),
            (test_generate_basics, ()),
            (test_stops, ()),
            (test_sampling, ()),
            (test_openai_shapes, ()),
            (test_batch_invariance, ()),
            (test_batching_speed, ()),
            (test_prefix_cache, (shared,)),
            (test_streaming_32, ()),
            (test_stream_logprobs, ()),
            (test_stream_stops, ()),
            (test_big_batch, ()),
            (test_keepalive_and_chunked_upload, ()),
            (test_logprob_match, ()),
            (test_metrics, ()),
            (test_metric_counts, ()),
            (test_bad_input, ()),
            (test_tokenize, ()),
            (test_tokenize_bad, ()),
            (test_logit_bias, ()),
            (test_abort_request, ()),
            (test_disconnect, ()),
        ])
    if "noradix" in groups:
        with_server(Server("noradix", ["--disable-radix-cache"]), [(test_noradix, (shared,))])
    if "apikey" in groups:
        with_server(Server("apikey", ["--api-key", "sesame"], api_key="sesame"), [(test_apikey, ())])
    if "context" in groups:
        with_server(Server("context", ["--context-length", "64", "--kv-cache-dtype", "bfloat16"]),
                    [(test_context, ())])
    if "body" in groups:
        with_server(Server("body", ["--max-body-bytes", "4096"]), [(test_body_limit, ())])
    if "tight" in groups:
        with_server(Server("tight", ["--enable-metrics", "--max-total-tokens", "1024", "--context-length", "512",
                                     "--max-running-requests", "6", "--chunked-prefill-size", "32"]),
                    [(test_tight, ()), (test_shutdown_in_flight, ())])
    if "queue" in groups:
        with_server(Server("queue", ["--enable-metrics", "--max-running-requests", "1"]),
                    [(test_abort_queued, ()), (test_queued_disconnect, ())])
        with_server(Server("queuelimit", ["--enable-metrics", "--max-running-requests", "1", "--max-queued-requests", "2"]),
                    [(test_queue_limit, ())])
    if "tokfree" in groups:
        with_server(Server("tokfree", ["--skip-tokenizer-init", "--enable-metrics"]), [(test_tokfree, ())])
    if "weights" in groups:
        with_server(Server("weights", ["--enable-metrics"], model=WEIGHTS_A), [(test_update_weights, ())])
    if "dummy" in groups:
        # a folder like config/models/*: config.json alone
        with tempfile.TemporaryDirectory(prefix="moeserve-config-only-") as folder:
            shutil.copy(os.path.join(ROOT, "tests/data/tiny-qwen3-moe/config.json"), folder)
            test_dummy_refuses(folder)
            with_server(Server("dummy", ["--load-format", "dummy", "--skip-tokenizer-init"], model=folder),
                        [(test_dummy, (folder,)), (test_dummy_update_weights, ())])
    if VERBOSE:
        print("total %.1f s" % (time.time() - t0))
    print(R.summary())
    return 0 if R.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
