#!/usr/bin/env python3
"""End-to-end tests of the rank group: `mpirun -np N moeserve serve` against one plain process.

Every MoE layer's experts are split over the ranks and tokens travel through an all-to-all, but a
request's results must not depend on that: its input and output logprobs must equal those of one
process (within 1e-5) and its greedy (and fixed-seed sampled) tokens must be identical, whatever
rank runs it and whatever else is batched. The checks, on tests/data/tiny-qwen3-moe (8 experts,
top-2, 4 layers; 3 ranks split the experts 3,3,2):

  - np 1, 2, 3, 4 with --no-load-balance: requests spread over every rank's port, then all sent to
    the last rank (which alone counts them in /server_info); a lone request to rank 2 of 3 while
    ranks 0 and 1 are idle;
  - np 3 with balancing on: everything sent to rank 0 runs on more than one rank; 40 concurrent
    requests over the ranks; arrivals staggered in time over the ranks (prompts of 1..200 tokens,
    so the ranks forward different token counts, zero included, at every step); /abort_request
    sent to one rank ends requests running on the others (by rid through rank 0, abort_all through
    the last rank);
  - a copy of the checkpoint whose routers are all zero (every token picks experts 0 and 1, all on
    rank 0; the other ranks receive nothing) at np 2, 3, 4 against one process on the same copy;
  - --moe-a2a-backend mpi at np 2, with --tp 2 --ep-size 2 --dp 2 --enable-dp-attention;
  - --moe-a2a-combine partial at np 2 and 3 (each owner rank's weighted sum in BF16, the GPU's
    default): the same tokens as one process, logprobs within 2e-2 of its on average and not its
    bits;
  - the FP8 checkpoint at np 3 and the NVFP4 one at np 2: the tokens cross the all-to-all in the
    experts' format (fp8 / nvfp4 payload, the log says so) and every logprob equals one process's
    exactly (one process rounds the experts' input the same way);
  - /update_weights_from_disk sent to one rank of np 3 (tiny-qwen3-moe <-> its -trained copy): every
    rank then answers as one process on the new folder; a request running elsewhere finishes first;
    a folder that does not load is refused naming a rank; abort_all_requests aborts the requests
    of every rank; two updates sent to two ranks at once both succeed, one after the other;
  - rank 1 of 3 killed with SIGKILL while requests run: mpirun and every other rank exit within
    30 s, the requests in flight are answered, and the survivors say that rank 1 is gone;
  - flags: --tp 3, --ep-size 3, --dp-size 3 under np 2, --moe-a2a-combine partial with the
    deterministic mode, an unknown combine form, nccl / nvlink_one_sided refused on a machine
    without GPU, the deprecated name flashinfer.

Standard library only. Run from the repository root or anywhere:
`python3 tests/test_ep.py [GROUP...]` (groups: ref, np1, np2, np3, np4, balance, mpi, partial, quant, update,
skew, kill, kill-all, flags; the reference is made whenever a group needs it; all of them by default).
kill checks that rank 0 names the killed rank 1; kill-all wants rank 2 to name it as well (when
rank 0 has already left too, rank 2 names every rank it finds gone, rank 1 among them). The binary
is ${BUILD:-build}/moeserve, mpirun comes from PATH. Each check prints one "ok name" or
"FAIL name: detail" line; the last line is "N passed, M failed"; exit status 0 only when nothing
failed.

Every process group started (mpirun and its ranks, or the one plain process) is stopped at the
end of its case whatever happens; when $EP_TEST_PIDFILE names a file, the process-group ids and
rank pids still alive are kept listed there so that tests/ep_test.sh can kill them if this script
itself is killed.
"""
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "moeserve")
MODEL = os.path.join(ROOT, "tests", "data", "tiny-qwen3-moe")
TRAINED = MODEL + "-trained"  # the same config, other weights (/update_weights_from_disk)
MPIRUN = shutil.which("mpirun")
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
STARTUP_TIMEOUT = 60.0  # seconds for every rank's /health to say 200
REQUEST_TIMEOUT = 60.0  # seconds for one /generate
LOGPROB_TOL = 1e-5  # |logprob - single process| at every position
PARTIAL_TOL = 2e-2  # mean |logprob - single process| with --moe-a2a-combine partial: BF16's
KILL_DEADLINE = 30.0  # seconds for the ranks left to exit after one is killed
SETTLE_TIMEOUT = 10.0  # seconds for /server_info counters to catch up with finished requests
PIDFILE = os.environ.get("EP_TEST_PIDFILE")

# ---------------------------------------------------------------------------------------------
# Results


R = harness.Results(cut=900)
short = harness.short
port_free = harness.port_free
free_port_block = harness.free_port_block


def check(name, ok, detail=""):
    return R.check(name, ok, detail)


def http_json(port, method, path, body=None, timeout=REQUEST_TIMEOUT):
    return harness.http_json(port, method, path, body, timeout)


# ---------------------------------------------------------------------------------------------
# Process groups: mpirun + ranks, or one plain process

LIVE = []  # groups started and not yet stopped
LIVE_LOCK = threading.Lock()


def write_pidfile():
    if not PIDFILE:
        return
    lines = []
    with LIVE_LOCK:
        for g in LIVE:
            if g.proc is not None:
                lines.append("pgid %d" % g.proc.pid)
            for pid in g.rank_pids:
                lines.append("pid %d" % pid)
    try:
        with open(PIDFILE + ".tmp", "w") as f:
            f.write("\n".join(lines) + ("\n" if lines else ""))
        os.replace(PIDFILE + ".tmp", PIDFILE)
    except OSError:
        pass


pid_alive = harness.pid_alive


class Group(harness.Logged):
    """np ranks under mpirun (np 0: one plain `moeserve serve`, no mpirun) serving on ports
    base .. base+np-1, output (both streams) in a temporary log file. Its own session, so that one
    killpg reaches mpirun and every rank."""

    def __init__(self, name, np, model=MODEL, flags=(), mpirun_flags=()):
        self.name = name
        self.np = np
        self.n_ranks = max(np, 1)
        self.model = model
        self.flags = list(flags)
        self.mpirun_flags = list(mpirun_flags)
        self.base = None
        self.proc = None
        self.log = None
        self.rank_pids = []
        self.cmd = []
        self.n_sent = 0  # /generate requests sent to it so far

    @property
    def ports(self):
        return [self.base + r for r in range(self.n_ranks)]

    def command(self, base):
        serve = [BIN, "serve", "--model-path", self.model, "--host", "127.0.0.1", "--port", str(base),
                 "--threads", "1"] + self.flags
        if self.np == 0:
            return serve
        return [MPIRUN] + MPIRUN_FLAGS + self.mpirun_flags + ["-np", str(self.np)] + serve

    def launch(self):
        self.base = free_port_block(self.n_ranks)
        self.cmd = self.command(self.base)
        tag = re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")
        self.open_log("moeserve-ep-%s-" % tag)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        with LIVE_LOCK:
            LIVE.append(self)
        write_pidfile()

    def start(self):
        """Launch and wait until every rank answers /health with 200. False (after a FAIL line)
        when it exits or does not get there in time."""
        self.launch()
        deadline = time.time() + STARTUP_TIMEOUT
        pending = list(self.ports)
        while pending and time.time() < deadline:
            if self.proc.poll() is not None:
                break
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
            why = ("exited with %s" % self.proc.returncode) if self.proc.poll() is not None else "not healthy in time"
            check("%s: starts (%s)" % (self.name, " ".join(self.cmd[-12:])), False,
                  "%s; ports %s not ready\n    %s" % (why, pending, self.log_tail()))
            return False
        self.learn_pids()
        return True

    def learn_pids(self):
        if self.np == 0:
            self.rank_pids = [self.proc.pid]
        else:
            try:
                _, info, _ = http_json(self.base, "GET", "/server_info", timeout=10)
                self.rank_pids = [int(s["pid"]) for s in info["internal_states"] if "pid" in s]
            except (OSError, TypeError, KeyError, ValueError):
                self.rank_pids = []
        write_pidfile()

    def stop(self):
        """SIGTERM to mpirun (it passes it on to the ranks), then SIGKILL to the whole session and
        to any rank left."""
        self.end(15, self.rank_pids)
        with LIVE_LOCK:
            if self in LIVE:
                LIVE.remove(self)
        write_pidfile()

    # API
    def generate(self, rank, body, timeout=REQUEST_TIMEOUT):
        return http_json(self.ports[rank], "POST", "/generate", body, timeout=timeout)

    def server_info(self, rank=0):
        status, info, raw = http_json(self.ports[rank], "GET", "/server_info", timeout=10)
        if status != 200 or not isinstance(info, dict):
            raise RuntimeError("GET /server_info on rank %d: HTTP %d %s" % (rank, status, short(raw)))
        return info


def stop_all():
    with LIVE_LOCK:
        groups = list(LIVE)
    for g in groups:
        g.stop()


def run_group(group, cases):
    """Start group, run each case(group), stop it whatever happens."""
    try:
        if not group.start():
            return
        for case in cases:
            try:
                case(group)
            except Exception as e:  # a broken case counts as one failure, the others still run
                check("%s: %s runs" % (group.name, getattr(case, "__name__", "case")), False,
                      "%s: %s\n    %s" % (type(e).__name__, e, group.log_tail()))
    finally:
        group.stop()


# ---------------------------------------------------------------------------------------------
# Requests and the single-process reference

PROMPT_LENGTHS = [1, 6, 23, 64, 131, 200]
MAX_NEW = [16, 12, 10, 8, 8, 8]
SAMPLED_LENGTH = 37


def make_requests():
    """Six greedy requests (prompts of 1..200 ids) and one sampled with a fixed seed, all asking
    for every input and output logprob. ids < 2048 (2048 is the end-of-text token; vocab 2051)."""
    rng = random.Random(20261130)
    reqs = []
    for n, m in zip(PROMPT_LENGTHS, MAX_NEW):
        ids = [rng.randrange(3, 2048) for _ in range(n)]
        reqs.append({"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                     "sampling_params": {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}})
    ids = [rng.randrange(3, 2048) for _ in range(SAMPLED_LENGTH)]
    reqs.append({"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                 "sampling_params": {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 4242,
                                     "max_new_tokens": 12, "ignore_eos": True}})
    return reqs


REQUESTS = make_requests()
REFERENCE = {}  # model path -> [answer of one process, per request]


def values(entries):
    return [e[0] for e in entries]


def compare(got, ref):
    """(max |dlogprob|, list of differences) of one /generate answer against the reference."""
    diffs = []
    worst = 0.0
    if not isinstance(got, dict) or "output_ids" not in got:
        return math.inf, ["no answer: %s" % short(got, 200)]
    if got["output_ids"] != ref["output_ids"]:
        diffs.append("output_ids %s != %s" % (got["output_ids"], ref["output_ids"]))
    for key in ("input_token_logprobs", "output_token_logprobs"):
        a = got.get("meta_info", {}).get(key)
        b = ref["meta_info"][key]
        if not isinstance(a, list) or len(a) != len(b):
            diffs.append("%s: %s entries, want %d" % (key, len(a) if isinstance(a, list) else a, len(b)))
            worst = math.inf
            continue
        if [e[1] for e in a] != [e[1] for e in b]:
            diffs.append("%s: token ids differ" % key)
        bad = []
        for i, (x, y) in enumerate(zip(values(a), values(b))):
            if x is None or y is None:
                if x is not y:
                    bad.append((i, x, y))
                    worst = math.inf
                continue
            d = abs(x - y)
            worst = max(worst, d)
            if d > LOGPROB_TOL:
                bad.append((i, x, y))
        if bad:
            diffs.append("%s: %d positions beyond %g, first %s" % (key, len(bad), LOGPROB_TOL, bad[:3]))
    return worst, diffs


def run_requests(group, plan):
    """plan: [(rank, request index, delay s)]; all started together in threads, each waiting its
    delay first. Returns [(status, body or raw text)] in plan order."""
    out = [None] * len(plan)
    group.n_sent += len(plan)

    def one(i, rank, ri, delay):
        if delay:
            time.sleep(delay)
        try:
            status, body, raw = group.generate(rank, REQUESTS[ri])
            out[i] = (status, body if body is not None else raw)
        except Exception as e:
            out[i] = (0, "%s: %s" % (type(e).__name__, e))

    threads = [threading.Thread(target=one, args=(i, r, ri, d), daemon=True) for i, (r, ri, d) in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 30)
    return [o if o is not None else (0, "no answer in time") for o in out]


def check_plan(name, group, plan, model=MODEL):
    """Run plan on group and check every answer against the single-process reference: one line."""
    ref = REFERENCE[model]
    t0 = time.time()
    answers = run_requests(group, plan)
    worst = 0.0
    problems = []
    for (rank, ri, _), (status, body) in zip(plan, answers):
        if status != 200:
            problems.append("request %d on rank %d: HTTP %d %s" % (ri, rank, status, short(body, 200)))
            worst = math.inf
            continue
        w, diffs = compare(body, ref[ri])
        worst = max(worst, w)
        if diffs:
            problems.append("request %d (%d prompt ids) on rank %d: %s"
                            % (ri, len(REQUESTS[ri]["input_ids"]), rank, "; ".join(diffs)))
    detail = "%d requests, max |dlogprob| %.3g, %.1f s" % (len(plan), worst, time.time() - t0)
    if problems:
        detail += "\n    " + "\n    ".join(problems[:5])
        if not group.alive():
            detail += "\n    group has exited:\n    " + group.log_tail()
    return check(name, not problems, detail)


def make_reference(model, label):
    """One plain process: every request alone, then all together (a batch must not change them)."""
    g = Group("ref-" + label, 0, model=model)
    try:
        if not g.start():
            return False
        ref = []
        for i, req in enumerate(REQUESTS):
            status, body, raw = g.generate(0, req)
            if status != 200 or not isinstance(body, dict):
                check("reference %s: request %d answers" % (label, i), False, "HTTP %d %s" % (status, short(raw)))
                return False
            ref.append(body)
        REFERENCE[model] = ref
        check("reference %s: one process answers the %d requests one at a time" % (label, len(ref)), True)
        check_plan("reference %s: all requests at once match them one at a time" % label, g,
                   [(0, i, 0) for i in range(len(REQUESTS))] * 2, model)
        return True
    finally:
        g.stop()


def need_reference(model, label):
    return model in REFERENCE or make_reference(model, label)


# ---------------------------------------------------------------------------------------------
# The skewed checkpoint


def copy_checkpoint(src, dst, edit):
    """Copy the checkpoint folder src to dst, each file through edit(name, bytes) -> (bytes, count)
    (the other files as they are). Returns the sum of the counts."""
    total = 0
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            blob, n = edit(name, f.read())
        total += n
        with open(os.path.join(dst, name), "wb") as f:
            f.write(blob)
    return total


def safetensors_header(blob):
    """(header as a dict, offset of the data) of a .safetensors file's bytes."""
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    return json.loads(bytes(blob[8:8 + n]).decode("utf-8")), 8 + n


def make_skewed_copy(src, dst):
    """Copy the checkpoint folder src to dst with every router (model.layers.*.mlp.gate.weight)
    set to zero: all router logits tie, so every token's top-k are the lowest expert ids. Other
    files are copied as they are. Returns the number of tensors zeroed."""
    gate = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")

    def zero_routers(name, data):
        if not name.endswith(".safetensors"):
            return data, 0
        blob = bytearray(data)
        header, base = safetensors_header(blob)
        zeroed = 0
        for key, t in header.items():
            if key == "__metadata__" or not gate.match(key):
                continue
            if t["dtype"] not in ("BF16", "F32", "F16"):
                raise RuntimeError("%s: router %s has dtype %s" % (name, key, t["dtype"]))
            begin, end = t["data_offsets"]
            # zero is all-zero bytes in BF16, F16 and F32 alike
            blob[base + begin:base + end] = bytes(end - begin)
            zeroed += 1
        return bytes(blob), zeroed

    return copy_checkpoint(src, dst, zero_routers)


def router_tensors(folder):
    """{name: (dtype, all zero)} of the routers in a checkpoint folder."""
    out = {}
    gate = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n).decode("utf-8"))
            data = f.read()
        for key, t in header.items():
            if key != "__metadata__" and gate.match(key):
                b, e = t["data_offsets"]
                out[key] = (t["dtype"], not any(data[b:e]))
    return out


# ---------------------------------------------------------------------------------------------
# Cases on a running group

STATE_KEYS = ("rank", "url", "pid", "hostname", "num_running_reqs", "num_waiting_reqs", "n_requests_done",
              "n_generated_tokens", "kv_pages_used", "kv_pages_total", "last_gen_throughput", "report_age_s")


def case_server_info(g, load_balance, backend, combine="slots"):
    """/server_info on every rank: its rank, the world, the settings and one state per rank."""
    problems = []
    for r in range(g.n_ranks):
        info = g.server_info(r)
        want = {"rank": r, "world_size": g.n_ranks, "load_balance": load_balance,
                "moe_a2a_combine": combine}
        for k, v in want.items():
            if info.get(k) != v:
                problems.append("rank %d: %s = %r, want %r" % (r, k, info.get(k), v))
        if backend is not None and info.get("moe_a2a_backend") != backend:
            problems.append("rank %d: moe_a2a_backend = %r, want %r" % (r, info.get("moe_a2a_backend"), backend))
        states = info.get("internal_states")
        if not isinstance(states, list) or len(states) != g.n_ranks:
            problems.append("rank %d: internal_states %s" % (r, short(states, 200)))
            continue
        for q, s in enumerate(states):
            missing = [k for k in STATE_KEYS if k not in s]
            if missing:
                problems.append("rank %d: internal_states[%d] lacks %s" % (r, q, missing))
            elif s["rank"] != q or not str(s["url"]).endswith(":%d" % g.ports[q]):
                problems.append("rank %d: internal_states[%d] rank %r url %r" % (r, q, s["rank"], s["url"]))
    return check("%s: /server_info on every rank (rank, world_size %d, load_balance, moe_a2a_backend, "
                 "moe_a2a_combine %s, %d states)" % (g.name, g.n_ranks, combine, g.n_ranks),
                 not problems, "; ".join(problems[:6]))


def done_counts(g):
    states = g.server_info(0)["internal_states"]
    return [int(s.get("n_requests_done", 0)) for s in states]


def settled_counts(g):
    """n_requests_done per rank once they account for every request sent so far (a rank counts a
    request a moment after its answer has gone, and peers' counts come with their reports), or
    whatever they are after SETTLE_TIMEOUT."""
    deadline = time.time() + SETTLE_TIMEOUT
    while True:
        now = done_counts(g)
        if sum(now) >= g.n_sent or time.time() > deadline:
            return now
        time.sleep(0.1)


def settled_deltas(g, before, expected_total):
    """Per-rank n_requests_done increases since before, once they add up to expected_total (the
    reports come with the ranks' steps) or SETTLE_TIMEOUT has passed."""
    deadline = time.time() + SETTLE_TIMEOUT
    while True:
        now = done_counts(g)
        deltas = [a - b for a, b in zip(now, before)]
        if sum(deltas) >= expected_total or time.time() > deadline:
            return deltas
        time.sleep(0.2)


def case_spread(g):
    """Each request to every rank in turn, all at once."""
    plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(max(len(REQUESTS), 2 * g.n_ranks))]
    check_plan("%s: requests spread over the %d ranks match one process" % (g.name, g.n_ranks), g, plan, g.model)


def case_all_to_last_rank(g):
    """Without balancing, everything sent to the last rank runs there and only there."""
    last = g.n_ranks - 1
    before = settled_counts(g)
    plan = [(last, i, 0) for i in range(len(REQUESTS))]
    check_plan("%s: all requests sent to rank %d match one process" % (g.name, last), g, plan, g.model)
    deltas = settled_deltas(g, before, len(plan))
    want = [len(plan) if r == last else 0 for r in range(g.n_ranks)]
    check("%s: they all ran on rank %d (n_requests_done per rank)" % (g.name, last), deltas == want,
          "increases %s, want %s" % (deltas, want))


def case_lone_rank2(g):
    """np 3, no balancing: one request to rank 2 while ranks 0 and 1 have nothing to do."""
    states = g.server_info(0)["internal_states"]
    busy = [(s["rank"], s["num_running_reqs"], s["num_waiting_reqs"]) for s in states
            if s["num_running_reqs"] or s["num_waiting_reqs"]]
    check("%s: ranks idle before the lone request" % g.name, not busy, busy)
    check_plan("%s: a request to rank 2 completes while ranks 0 and 1 are idle" % g.name, g,
               [(2, 4, 0)], g.model)


def case_balanced_from_rank0(g):
    """With balancing, requests all sent to rank 0 end up on more than one rank."""
    before = settled_counts(g)
    plan = [(0, i % len(REQUESTS), 0) for i in range(3 * len(REQUESTS))]
    check_plan("%s: all requests sent to rank 0 match one process" % g.name, g, plan, g.model)
    deltas = settled_deltas(g, before, len(plan))
    used = sum(1 for d in deltas if d > 0)
    check("%s: balancing spread them over more than one rank (n_requests_done per rank)" % g.name,
          used > 1 and sum(deltas) == len(plan), "increases %s for %d requests" % (deltas, len(plan)))


def case_40_concurrent(g):
    plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(40)]
    check_plan("%s: 40 concurrent requests over the ranks all complete and match" % g.name, g, plan, g.model)


def case_staggered(g):
    """Arrivals at different times to different ranks, prompts of 1..200 tokens: at each step the
    ranks forward different token counts (zero on some) and runtime_max changes."""
    rng = random.Random(7)
    plan = []
    for i in range(3 * len(REQUESTS)):
        plan.append((rng.randrange(g.n_ranks), rng.randrange(len(REQUESTS)), round(i * 0.04 + rng.random() * 0.05, 3)))
    check_plan("%s: staggered arrivals over the ranks match one process" % g.name, g, plan, g.model)


def case_kill_rank1(g, every_survivor):
    """SIGKILL rank 1: mpirun and the other ranks exit within KILL_DEADLINE, rank 0 (and with
    every_survivor rank 2 too) naming rank 1 in its own output (lines tagged [job,rank] by mpirun
    --tag-output). Rank 2 may instead name rank 0 when rank 0 has already left by the time it
    looks (its check names the lowest rank gone), hence the choice."""
    states = g.server_info(0)["internal_states"]
    pids = [int(s["pid"]) for s in states]
    if not check("%s: rank pids known" % g.name, len(pids) == 3 and all(pid_alive(p) for p in pids), pids):
        return
    # requests in flight when it dies (one streamed, one not, on each survivor's port) must be
    # answered, with their result or an error, not left hanging
    answers = {}
    long_req = {"input_ids": list(range(5, 105)), "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                                       "ignore_eos": True}}

    def in_flight(rank, stream):
        try:
            status, body, raw = g.generate(rank, dict(long_req, stream=stream), timeout=KILL_DEADLINE + 5)
            answers[(rank, stream)] = (status, raw)
        except Exception as e:
            answers[(rank, stream)] = (0, "%s: %s" % (type(e).__name__, e))

    threads = [threading.Thread(target=in_flight, args=(r, st), daemon=True) for r in (0, 2) for st in (False, True)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.time()
    survivors = [pids[0], pids[2]]
    while time.time() - t0 < KILL_DEADLINE and (g.alive() or any(pid_alive(p) for p in survivors)):
        time.sleep(0.1)
    took = time.time() - t0
    left = [p for p in survivors if pid_alive(p)]
    check("%s: ranks 0 and 2 exit within %g s of rank 1's SIGKILL" % (g.name, KILL_DEADLINE), not left,
          "%.1f s" % took if not left else "%.1f s; still alive: %s\n    %s" % (took, left, g.log_tail()))
    check("%s: mpirun exits within %g s, non-zero" % (g.name, KILL_DEADLINE),
          not g.alive() and g.proc.returncode != 0, "%.1f s, exit %s" % (took, g.proc.poll()))
    for t in threads:
        t.join(max(0.1, KILL_DEADLINE + 10 - (time.time() - t0)))
    bad = []
    for key in sorted(answers) + [k for k in [(r, st) for r in (0, 2) for st in (False, True)] if k not in answers]:
        status, raw = answers.get(key, (0, "no answer"))
        finished = status == 200 and ('"finish_reason":{"type"' in raw.replace(" ", ""))
        errored = status >= 400 or (status == 200 and '"error"' in raw)
        if not (finished or errored):
            bad.append("rank %d %s: HTTP %d %s" % (key[0], "stream" if key[1] else "whole", status, short(raw[-200:], 200)))
    summary = ", ".join("rank %d %s: %d" % (k[0], "stream" if k[1] else "whole", v[0]) for k, v in sorted(answers.items()))
    check("%s: requests in flight are answered (result or error), none left hanging" % g.name, not bad,
          summary if not bad else "; ".join(bad))
    text = g.log_text()
    # "rank 1 (pid P) has exited", or any line naming rank 1 or its pid as gone
    lost = re.compile(r"(\brank 1\b|\bpid %d\b).*\b(exited|gone|lost|did not answer|died|dead|killed)\b" % pids[1],
                      re.I)
    for r in ((0, 2) if every_survivor else (0,)):
        # mpirun --tag-output's "[job,rank]<stderr>:" or the log prefix "[time LEVEL rank R ...]"
        tag = re.compile(r"^(\[\d+,%d\]<std(out|err)>:|\[[^\]]*\brank %d\b[^\]]*\])" % (r, r))
        lines = [ln for ln in text.splitlines() if tag.match(ln) and lost.search(ln)]
        said = [ln for ln in text.splitlines() if tag.match(ln) and re.search(r"exited|ERROR|WARN|gone", ln)]
        check("%s: rank %d says rank 1 is gone" % (g.name, r), bool(lines),
              lines[0] if lines else "no line from rank %d matches %s; what it said:\n    %s\n  log:\n    %s"
              % (r, lost.pattern, "\n    ".join(said) or "nothing", g.log_tail(12)))
    mp = [ln for ln in text.splitlines() if not ln.startswith("[") and re.search(r"rank 1\b", ln)]
    check("%s: mpirun reports rank 1" % g.name, bool(mp), mp[0] if mp else "no untagged line names rank 1")


# ---------------------------------------------------------------------------------------------
# Start-up failures


def start_fails(name, np, flags, must_match, timeout=60):
    """The command must exit non-zero, before serving, with output matching every regex."""
    g = Group(name, np, flags=flags)
    try:
        g.launch()
        try:
            g.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            check("%s: start-up fails" % name, False, "still running after %d s\n    %s" % (timeout, g.log_tail()))
            return None
        text = g.log_text()
        ok = g.proc.returncode != 0 and "serving on" not in text
        missing = [p for p in must_match if not re.search(p, text, re.I | re.M)]
        good = ok and not missing
        said = [ln.strip() for ln in text.splitlines() if re.search(must_match[0], ln, re.I)]
        check("%s: start-up fails with a message matching %s" % (name, " and ".join(must_match)), good,
              "exit %s: %s" % (g.proc.returncode, short(said[0], 200)) if good and said else
              "exit %s, unmatched %s\n    %s" % (g.proc.returncode, missing, g.log_tail()))
        return text
    finally:
        g.stop()


def gpu_present():
    """A GPU this process could use (then nccl / nvlink may rightly start)."""
    if os.path.exists("/dev/nvidia0"):
        return True
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "GPU " in out


def test_flags():
    start_fails("np 2 --tp 3", 2, ["--tp", "3"], [r"--tp\b"])
    start_fails("np 2 --ep-size 3", 2, ["--ep-size", "3"], [r"--ep(-size)?\b"])
    start_fails("np 2 --dp-size 3 --enable-dp-attention", 2, ["--dp-size", "3", "--enable-dp-attention"],
                [r"--dp(-size)?\b"])
    start_fails("np 2 --moe-a2a-combine partial --enable-deterministic-inference", 2,
                ["--moe-a2a-combine", "partial", "--enable-deterministic-inference"],
                [r"--moe-a2a-combine partial", r"deterministic"])
    start_fails("np 2 --moe-a2a-combine sum", 2, ["--moe-a2a-combine", "sum"],
                [r"--moe-a2a-combine", r"auto, slots, partial"])
    if gpu_present():
        print("skip: the refusals of nccl / nvlink_one_sided without a GPU (this machine has one)", flush=True)
        return
    start_fails("np 2 --moe-a2a-backend nccl (no GPU)", 2, ["--moe-a2a-backend", "nccl"], [r"nccl", r"cuda|gpu"])
    start_fails("np 2 --moe-a2a-backend flashinfer_nvlink_one_sided (no GPU)", 2,
                ["--moe-a2a-backend", "flashinfer_nvlink_one_sided"], [r"nvlink", r"cuda|gpu"])
    start_fails("np 2 --moe-a2a-backend flashinfer (no GPU)", 2, ["--moe-a2a-backend", "flashinfer"],
                [r"flashinfer.*deprecat|deprecat.*flashinfer", r"nvlink", r"cuda|gpu"])


# ---------------------------------------------------------------------------------------------


def section_np(np):
    """np ranks without balancing: each request runs where it is sent."""
    g = Group("np %d --no-load-balance" % np, np, flags=["--no-load-balance"])
    cases = [lambda g: case_server_info(g, False, "none" if g.n_ranks == 1 else "shm")]
    if np == 3:
        cases.append(case_lone_rank2)
    cases += [case_spread, case_all_to_last_rank]
    run_group(g, cases)


def case_abort_request(g):
    """/abort_request reaches every rank: long requests all sent to rank 0 are balanced over the
    ranks, aborted by rid through rank 0 (each answers 200 with finish_reason abort); then abort_all
    sent to the last rank ends requests that run on every rank."""
    def long_body(i, rid):
        body = {"input_ids": [5 + i, 6, 7], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        if rid:
            body["rid"] = rid
        return body

    def send(plan):
        out = [None] * len(plan)

        def run(k, port, body):
            try:
                out[k] = http_json(port, "POST", "/generate", body)
            except Exception as e:  # noqa: BLE001 (a failed request is reported below)
                out[k] = (0, str(e))
        ts = [threading.Thread(target=run, args=(k, g.ports[r], b)) for k, (r, b) in enumerate(plan)]
        for t in ts:
            t.start()
        return ts, out

    def busy_ranks():
        states = g.server_info(0)["internal_states"]
        return sum(1 for s in states if s["num_running_reqs"] or s["num_waiting_reqs"])

    def in_flight():  # the requests running or waiting on every rank
        return sum(s["num_running_reqs"] + s["num_waiting_reqs"]
                   for s in g.server_info(0)["internal_states"])

    def wait_busy(n, reqs=0):  # the ranks seen busy at once, as soon as n are and reqs requests
        deadline = time.time() + 30  # are in the ranks (or after 30 s)
        seen = busy_ranks()
        while time.time() < deadline and (seen < n or in_flight() < reqs):
            time.sleep(0.05)
            seen = busy_ranks()
        return seen

    def all_aborted(out):
        bad = [o for o in out if not (isinstance(o, tuple) and o[0] == 200 and isinstance(o[1], dict)
                                      and (o[1]["meta_info"].get("finish_reason") or {}).get("type") == "abort"
                                      and o[1]["meta_info"]["completion_tokens"] < 500)]
        return not bad, short(bad, 300)

    before = settled_counts(g)
    n = 2 * g.n_ranks
    ts, out = send([(0, long_body(i, "ep-abort-%d" % i)) for i in range(n)])
    spread = wait_busy(2, n)
    for i in range(n):
        http_json(g.ports[0], "POST", "/abort_request", {"rid": "ep-abort-%d" % i})
    for t in ts:
        t.join(REQUEST_TIMEOUT)
    ok, detail = all_aborted(out)
    check("%s: %d requests sent to rank 0, balanced over %d ranks, all aborted by rid through rank 0"
          % (g.name, n, spread), spread >= 2 and ok, detail)
    g.n_sent += n
    deltas = settled_deltas(g, before, n)
    check("%s: the aborted requests ran on more than one rank (n_requests_done per rank)" % g.name,
          sum(1 for d in deltas if d > 0) > 1, "increases %s" % deltas)

    ts, out = send([(r % g.n_ranks, long_body(r, None)) for r in range(n)])
    # abort_all ends the requests a rank holds when it comes; one still on its way to its rank
    # would run to its end, so every request is in a rank first
    busy = wait_busy(2, n)
    st = http_json(g.ports[-1], "POST", "/abort_request", {"abort_all": True})[0]
    for t in ts:
        t.join(REQUEST_TIMEOUT)
    ok, detail = all_aborted(out)
    check("%s: abort_all sent to rank %d ends the %d requests running on %d ranks"
          % (g.name, g.n_ranks - 1, n, busy), st == 200 and busy >= 2 and ok, detail)
    g.n_sent += n


def case_update_weights(g):
    """/update_weights_from_disk sent to one rank changes every rank's weights together: each rank
    loads its share of the experts, then all swap. A request running on another rank finishes
    first; afterwards requests spread over the ranks equal one process on the new folder; a folder
    that does not load is refused with a 400 that names a rank, and the weights stay; with
    abort_all_requests the requests running on every rank are aborted, and switching back gives
    one process's answers on the first folder again."""
    def update(rank, body):
        return http_json(g.ports[rank], "POST", "/update_weights_from_disk", body, timeout=REQUEST_TIMEOUT)

    def ok_update(st, body):
        return st == 200 and isinstance(body, dict) and body.get("success") is True

    out = {}
    long_req = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}

    def run_long():
        out["long"] = http_json(g.ports[2], "POST", "/generate", long_req)
    t = threading.Thread(target=run_long)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and not g.server_info(2)["internal_states"][2]["num_running_reqs"]:
        time.sleep(0.02)
    st, body, raw = update(1, {"model_path": TRAINED})
    t.join(REQUEST_TIMEOUT)
    lst, lbody = out.get("long", (0, None))[:2]
    finished = (lst == 200 and isinstance(lbody, dict)
                and (lbody["meta_info"].get("finish_reason") or {}).get("type") == "length")
    check("%s: update through rank 1 succeeds while rank 2 runs a request, which finishes" % g.name,
          ok_update(st, body) and finished, "update HTTP %d %s; request HTTP %d %s"
          % (st, short(raw), lst, short(lbody, 200)))
    g.n_sent += 1
    plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(2 * len(REQUESTS))]
    check_plan("%s: after the update every rank answers as one process on the new folder" % g.name,
               g, plan, TRAINED)
    paths = [(http_json(port, "GET", "/get_model_info", timeout=10)[1] or {}).get("model_path")
             for port in g.ports]
    check("%s: /get_model_info names the new folder on every rank" % g.name,
          all(p and os.path.samefile(p, TRAINED) for p in paths), paths)

    st, body, raw = update(2, {"model_path": os.path.join(ROOT, "tests", "data", "no-such-folder")})
    msg = body.get("message", "") if isinstance(body, dict) else raw
    check("%s: a folder that does not load is refused with a 400 naming a rank" % g.name,
          st == 400 and isinstance(body, dict) and body.get("success") is False
          and re.search(r"rank \d", msg) and "no-such-folder" in msg, "HTTP %d %s" % (st, short(raw)))
    check_plan("%s: after the refusal the new folder's weights still serve" % g.name, g,
               [(r, 0, 0) for r in range(g.n_ranks)], TRAINED)

    long_all = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    res = [None] * g.n_ranks

    def run_one(r):
        res[r] = http_json(g.ports[r], "POST", "/generate", long_all)
    ts = [threading.Thread(target=run_one, args=(r,)) for r in range(g.n_ranks)]
    for th in ts:
        th.start()
    deadline = time.time() + 30
    while time.time() < deadline:
        states = g.server_info(0)["internal_states"]
        if all(s["num_running_reqs"] for s in states):
            break
        time.sleep(0.02)
    st, body, raw = update(0, {"model_path": MODEL, "abort_all_requests": True})
    for th in ts:
        th.join(REQUEST_TIMEOUT)
    aborted = [isinstance(o, tuple) and o[0] == 200 and isinstance(o[1], dict)
               and (o[1]["meta_info"].get("finish_reason") or {}).get("type") == "abort"
               and o[1]["meta_info"]["completion_tokens"] < 500 for o in res]
    check("%s: abort_all_requests through rank 0 aborts the requests running on every rank" % g.name,
          ok_update(st, body) and all(aborted), "update HTTP %d %s; aborted %s" % (st, short(raw), aborted))
    g.n_sent += g.n_ranks
    check_plan("%s: switched back, every rank answers as one process on the first folder" % g.name,
               g, plan, MODEL)

    both = [None, None]

    def run_update(k, rank, folder):
        both[k] = update(rank, {"model_path": folder})
    ts = [threading.Thread(target=run_update, args=(0, 2, TRAINED)),
          threading.Thread(target=run_update, args=(1, 1, MODEL))]
    for th in ts:
        th.start()
    for th in ts:
        th.join(REQUEST_TIMEOUT)
    check("%s: updates sent to ranks 2 and 1 at once both succeed, one after the other" % g.name,
          all(b and ok_update(b[0], b[1]) for b in both), short(both, 300))
    # which went last depends on which rank's request met a step first: either folder, but the
    # same on every rank
    answers = run_requests(g, plan)
    match = {}
    for folder in (TRAINED, MODEL):
        match[folder] = all(st == 200 and not compare(body, REFERENCE[folder][ri])[1]
                            for (_, ri, _), (st, body) in zip(plan, answers))
    check("%s: then every rank answers as one process on the same one of the two folders" % g.name,
          match[TRAINED] != match[MODEL], "matches %s" % {os.path.basename(k): v for k, v in match.items()})


def make_copy_without_expert(src, dst, expert):
    """Copy the checkpoint folder src to dst with expert `expert`'s down_proj renamed in every layer
    (to a name of the same length, so the header keeps its size): its config is the served one's,
    its tensors are not all there. Returns the number of tensors renamed."""
    old = (".mlp.experts.%d.down_proj.weight" % expert).encode()
    new = (".mlp.experts.%d.down_proj.wxight" % expert).encode()

    def rename(name, blob):
        if name.endswith(".safetensors"):
            _, base = safetensors_header(blob)
            header = blob[8:base]
            return blob[:8] + header.replace(old, new) + blob[base:], header.count(old)
        if name.endswith(".index.json"):
            return blob.replace(old, new), 0
        return blob, 0

    return copy_checkpoint(src, dst, rename)


def case_update_missing_tensor(g, broken):
    """A folder of the served config with an expert's tensor missing (every rank checks the whole
    checkpoint, so each refuses it): the answer names a rank and the tensor, nothing is swapped,
    and every rank keeps answering as one process on the served folder."""
    st, body, raw = http_json(g.ports[0], "POST", "/update_weights_from_disk", {"model_path": broken},
                              timeout=REQUEST_TIMEOUT)
    msg = body.get("message", "") if isinstance(body, dict) else raw
    check("%s: a folder missing one expert's tensor is refused, naming a rank and the tensor" % g.name,
          st == 400 and isinstance(body, dict) and body.get("success") is False
          and re.match(r"rank \d: ", msg) and "experts.7.down_proj" in msg, "HTTP %d %s" % (st, short(raw)))
    plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(2 * len(REQUESTS))]
    check_plan("%s: after it every rank still answers as one process on the served folder" % g.name,
               g, plan, MODEL)


def section_update(tmp):
    if not need_reference(TRAINED, "trained"):
        return
    broken = os.path.join(tmp, "tiny-qwen3-moe-trained-without-expert-7")
    n = make_copy_without_expert(TRAINED, broken, 7)
    check("copy without expert 7: its down_proj renamed in every layer (%d tensors)" % n, n > 0)
    run_group(Group("np 3 update", 3, flags=["--no-load-balance"]),
              [lambda g: case_update_missing_tensor(g, broken), case_update_weights])


def section_balance():
    run_group(Group("np 3 balanced", 3), [
        lambda g: case_server_info(g, True, "shm"),
        case_balanced_from_rank0, case_40_concurrent, case_staggered, case_abort_request])


def section_mpi():
    """The mpi transport, and SGLang's size flags given as the world size."""
    flags = ["--moe-a2a-backend", "mpi", "--tp", "2", "--ep-size", "2", "--dp", "2", "--enable-dp-attention"]
    run_group(Group("np 2 mpi backend, --tp 2 --ep-size 2 --dp 2", 2, flags=flags), [
        lambda g: case_server_info(g, True, "mpi"), case_spread, case_staggered])


def section_quant():
    """Quantized experts: the dispatch sends their format, and one process gives the same bits."""
    for fmt, np in (("fp8", 3), ("nvfp4", 2)):
        model = MODEL + "-" + fmt
        if not need_reference(model, fmt):
            continue

        def exact(g, fmt=fmt):
            plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(len(REQUESTS))]
            answers = run_requests(g, plan)
            worst = max((compare(body, REFERENCE[g.model][ri])[0] if status == 200 else math.inf)
                        for (_, ri, _), (status, body) in zip(plan, answers))
            check("%s: logprobs over the %d ranks equal one process's exactly" % (g.name, g.n_ranks),
                  worst == 0.0, "max |dlogprob| %.3g" % worst)
            said = "(%s tokens)" % fmt in g.log_text()
            check("%s: tokens cross the all-to-all as %s" % (g.name, fmt), said,
                  "" if said else g.log_tail())

        run_group(Group("np %d %s" % (np, fmt), np, model=model, flags=["--no-load-balance"]), [exact])


def section_partial():
    """The partial combine (each owner rank's weighted sum in BF16): the same greedy and seeded
    tokens as one process, logprobs within BF16's tolerance of its on average, and not its bits
    (the partials are in use). The average, not every position: this trained checkpoint on random
    ids has input logprobs down to -26, where a BF16 rounding in each layer's expert sum moves a
    logprob by up to about 0.9 (worst position at np 3; the median moves 0.006). The partial
    sums' arithmetic is checked bit for bit by tests/test_a2a.c."""
    def close(g):
        plan = [(i % g.n_ranks, i % len(REQUESTS), 0) for i in range(len(REQUESTS))]
        answers = run_requests(g, plan)
        diffs, problems = [], []
        for (rank, ri, _), (status, body) in zip(plan, answers):
            ref = REFERENCE[MODEL][ri]
            if status != 200 or body.get("output_ids") != ref["output_ids"]:
                problems.append("request %d on rank %d: %s" % (ri, rank, short(body, 200)))
                continue
            for key in ("input_token_logprobs", "output_token_logprobs"):
                pairs = zip(values(body["meta_info"][key]), values(ref["meta_info"][key]))
                diffs += [abs(x - y) for x, y in pairs if x is not None and y is not None]
        mean = sum(diffs) / len(diffs) if diffs else math.inf
        worst = max(diffs) if diffs else math.inf
        check("%s: greedy and seeded tokens equal one process's, mean |dlogprob| within %g"
              % (g.name, PARTIAL_TOL), not problems and mean <= PARTIAL_TOL,
              "mean %.3g, max %.3g over %d positions%s"
              % (mean, worst, len(diffs), "; " + "; ".join(problems[:3]) if problems else ""))
        check("%s: the partial sums are in use (logprobs are not one process's bits)" % g.name,
              0 < worst < math.inf)
        said = "partial combine" in g.log_text()
        check("%s: the log names the partial combine" % g.name, said, "" if said else g.log_tail())

    for np in (2, 3):
        run_group(Group("np %d partial combine" % np, np,
                        flags=["--no-load-balance", "--moe-a2a-combine", "partial"]),
                  [lambda g: case_server_info(g, False, "shm", "partial"), close])


def section_skew(tmp):
    skew = os.path.join(tmp, "tiny-qwen3-moe-skewed")
    n = make_skewed_copy(MODEL, skew)
    routers = router_tensors(skew)
    ok = n > 0 and n == len(routers) and all(z for _, z in routers.values())
    check("skewed copy: every router zero (%d tensors, %s)" % (n, ",".join(sorted({d for d, _ in routers.values()}))),
          ok, "" if ok else routers)
    if not need_reference(skew, "skewed"):
        return
    if MODEL in REFERENCE:
        same = [a["output_ids"] == b["output_ids"] for a, b in zip(REFERENCE[MODEL], REFERENCE[skew])]
        check("skewed copy: routing changes the greedy outputs", not all(same), same)
    for np in (2, 3, 4):
        run_group(Group("np %d skewed" % np, np, model=skew, flags=["--no-load-balance"]),
                  [case_spread, case_staggered])


def section_kill(every_survivor):
    run_group(Group("np 3 kill", 3, flags=["--dist-timeout", "20"], mpirun_flags=["--tag-output"]),
              [lambda g: case_kill_rank1(g, every_survivor)])


def run_section(name, fn, *args):
    """A section that breaks counts one failure; the next one still runs."""
    try:
        fn(*args)
    except Exception as e:
        check("%s runs" % name, False, "%s: %s" % (type(e).__name__, e))
    finally:
        stop_all()


def main(argv):
    all_groups = ["ref", "np1", "np2", "np3", "np4", "balance", "mpi", "partial", "quant", "update", "skew",
                  "kill", "kill-all", "flags"]
    default = list(all_groups)
    groups = [a for a in argv if not a.startswith("-")] or default
    unknown = [a for a in groups if a not in all_groups]
    if unknown:
        print("unknown groups %s; known: %s" % (unknown, " ".join(all_groups)))
        return 2
    if not os.access(BIN, os.X_OK):
        check("binary %s exists" % BIN, False, "build it first (make)")
        print(R.summary())
        return 1
    if MPIRUN is None:
        check("mpirun found", False, "install openmpi-bin")
        print(R.summary())
        return 1
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="moeserve-ep-")
    try:
        if any(g in groups for g in ("ref", "np1", "np2", "np3", "np4", "balance", "mpi", "partial", "update")):
            run_section("reference", need_reference, MODEL, "tiny-qwen3-moe")
            if MODEL not in REFERENCE:
                groups = [g for g in groups if g in ("skew", "kill", "kill-all", "flags")]
        for np in (1, 2, 3, 4):
            if "np%d" % np in groups:
                run_section("np %d" % np, section_np, np)
        if "balance" in groups:
            run_section("balance", section_balance)
        if "mpi" in groups:
            run_section("mpi", section_mpi)
        if "partial" in groups:
            run_section("partial", section_partial)
        if "quant" in groups:
            run_section("quant", section_quant)
        if "update" in groups:
            run_section("update", section_update, tmp)
        if "skew" in groups:
            run_section("skew", section_skew, tmp)
        if "kill" in groups or "kill-all" in groups:
            run_section("kill", section_kill, "kill-all" in groups)
        if "flags" in groups:
            run_section("flags", test_flags)
    finally:
        stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    print("total %.1f s" % (time.time() - t0), flush=True)
    print(R.summary(), flush=True)
    return 0 if R.failed == 0 else 1


def on_signal(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sys.exit(main(sys.argv[1:]))
