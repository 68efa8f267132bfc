"""What the Python tests that start the real binary share (tests/test_ep.py,
tests/test_determinism.py, tests/test_reliability.py): one check line per result under a lock,
with a summary; JSON over a fresh HTTP connection; a block of free ports for a rank group (rank r
on P + r); a started process with its log, and how to end it."""
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time


class Results:
    """ok / FAIL lines, counted; details longer than cut characters are shortened."""

    def __init__(self, cut=900):
        self.passed = 0
        self.failed = 0
        self.cut = cut
        self.lock = threading.Lock()

    def check(self, name, ok, detail=""):
        with self.lock:
            if ok:
                self.passed += 1
                print("ok   %s%s" % (name, " (%s)" % detail if detail else ""), flush=True)
            else:
                self.failed += 1
                detail = str(detail)
                if len(detail) > self.cut:
                    detail = detail[:self.cut] + "..."
                print("FAIL %s: %s" % (name, detail), flush=True)
        return bool(ok)

    def summary(self):
        return "%d passed, %d failed" % (self.passed, self.failed)


def short(obj, n=300):
    s = obj if isinstance(obj, str) else repr(obj)
    return s if len(s) <= n else s[:n] + "..."


# what a poll of a server not yet listening may raise
NOT_READY = (OSError, http.client.HTTPException)


def http_json(port, method, path, body=None, timeout=60.0):
    """One request on a fresh connection: (status, parsed JSON or None, raw text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read().decode("utf-8", "replace")
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        return r.status, parsed, raw
    finally:
        conn.close()


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def ephemeral_range():
    """The kernel's range of source ports for outgoing connections (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(n):
    """A base port P with P .. P+n-1 all free now (rank r listens on P + r), below the ephemeral
    range: a client polling a port in that range before the server listens can be given that
    same port as its source and connect to itself (TCP simultaneous open), then read its own
    request back as the answer."""
    lo = min(ephemeral_range()[0], 32768)
    floor = 10000 if lo > 12000 else 1024
    if lo - n <= floor:  # no room below the range: take any
        floor, lo = 20000, 60000
    rng = random.Random(os.getpid() ^ int(time.time() * 1000))
    for _ in range(200):
        base = rng.randrange(floor, lo - n)
        if all(port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of %d free ports" % n)


def pid_alive(pid):
    """True while pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2] != "Z"
    except (OSError, IndexError):
        return False


class Logged:
    """A process (self.proc) started in a session of its own, so that one killpg reaches mpirun
    and every rank, with its output in a temporary log file (self.log)."""

    proc = None
    log = None

    def open_log(self, prefix):
        self.log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
        return self.log

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log_text(self):
        try:
            with open(self.log.name, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except (OSError, AttributeError):
            return ""

    def log_tail(self, n=15):
        return "\n    ".join(self.log_text().splitlines()[-n:])

    def end(self, term_wait=15, pids=()):
        """SIGTERM first and up to term_wait s (0: none), then SIGKILL to the whole session and
        to any of pids left (ranks that left it); the log is closed and deleted."""
        if self.proc is not None:
            if term_wait and self.proc.poll() is None:
                try:
                    os.kill(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(term_wait)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.log is not None:
            self.log.close()
            try:
                os.unlink(self.log.name)
            except OSError:
                pass
