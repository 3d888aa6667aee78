"""What the serving experiments share: a 2-rank `mpi-tp serve` started and always stopped, a checkpoint
trained when none is given, streamed requests timed on the client, /metrics read, the run's stamp.

Used by experiments/serving/serve_load.py (load, static against continuous batching) and
experiments/serving/serve_hostile.py (the hostile mix).
"""
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

from mpi_tp.core.mpi_library import child_job_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAIN = ["--steps", "40", "--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--block-size", "128",
         "--batch-size", "8", "--sample-len", "0", "--eval-every", "1000", "--save-every", "40"]
SERVING = re.compile(r"^serving .+ on http://\[?([^\s\]]+)\]?:(\d+) \(tp=\d+\)$", re.MULTILINE)
REQUEST_TIMEOUT = 60.0                 # seconds any one socket operation of a client may take


def mpi_tp_command(ranks=2):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [mpiexec or sys.exit("no mpiexec on PATH (pip install mpich)"), "-n", str(ranks), sys.executable,
            "-m", "mpi4py", "-m", "mpi_tp"]


def child_env():
    """This checkout's mpi_tp, one thread per rank, none of a parent MPI job's variables."""
    env = child_job_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    return env


def train(folder):
    out = os.path.join(folder, "run")
    print(f"training a small model into {out} ...", flush=True)
    subprocess.run(mpi_tp_command() + ["train", *TRAIN, "--out", out], cwd=ROOT, env=child_env(), check=True,
                   stdout=subprocess.DEVNULL, timeout=900)
    return os.path.join(out, "checkpoints")


def serve_options():
    """The options `mpi-tp serve --help` lists (--batching, --max-queue ... where the server has them)."""
    h = subprocess.run([sys.executable, "-m", "mpi_tp", "serve", "--help"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120, check=False).stdout
    return set(re.findall(r"--[a-z][a-z-]+", h))


def stamp():
    """The machine (mpi_tp.core.runtime.machine_text, in a child: no MPI here) and the last commit of mpi_tp/."""
    code = "from mpi_tp.core.runtime import machine_text; print(machine_text())"
    machine = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                             text=True, timeout=120, check=False).stdout.strip()
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, check=False).stdout.strip()
    commit = (git("log", "-1", "--format=%h", "--", "mpi_tp") or "?") + ("+dirty" if git("status", "--porcelain",
                                                                                        "--", "mpi_tp") else "")
    return {"machine": machine or "?", "commit": commit,
            "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def proc_children():
    kids = defaultdict(list)
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{d}/stat") as f:
            kids[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(d))
    return kids


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Server:
    """One `mpiexec -n 2 ... serve --port 0` job: its address, its ranks' RSS, a stop that always ends it
    (env: the job's environment, default child_env())."""

    def __init__(self, checkpoint, flags, logs, start_timeout=180.0, env=None):
        self.flags, self.ranks = list(flags), []
        fd, self.log = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=logs)
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(mpi_tp_command() + ["serve", "--checkpoint", checkpoint, "--port", "0",
                                                             *self.flags], stdout=subprocess.PIPE, stderr=log,
                                         cwd=ROOT, env=env or child_env(), start_new_session=True, text=True)
        lines, reader = [], threading.Thread(target=lambda: lines.extend(self.proc.stdout), daemon=True)
        reader.start()                 # reads stdout to its end: the server's later lines never block it
        deadline = time.monotonic() + start_timeout
        while not (m := SERVING.search("".join(lines))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start ({' '.join(self.flags)}):\n{self.log_tail()}")
            time.sleep(0.05)
        self.host, self.port = m.group(1), int(m.group(2))
        self.ranks = self.serve_ranks()

    def serve_ranks(self):
        kids, found, todo = proc_children(), [], [self.proc.pid]
        while todo:
            for p in kids[todo.pop()]:
                todo.append(p)
                with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read()
                    if b"mpi_tp" in cmd and b"serve" in cmd:
                        found.append(p)
        return sorted(found)

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, n=15):
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def rss(self):
        """MiB: every rank's VmRSS and peak (VmHWM) from /proc, and rank 0's own count from /metrics (or None)."""
        out = {"rss_mib": None, "hwm_mib": None, "metrics_rss_mib": None}
        with contextlib.suppress(OSError, StopIteration):
            out["rss_mib"] = round(sum(status_kib(p, "VmRSS") for p in self.ranks) / 1024, 1)
            out["hwm_mib"] = round(sum(status_kib(p, "VmHWM") for p in self.ranks) / 1024, 1)
        m = metrics(self)
        if m and "process_resident_memory_bytes" in m:
            out["metrics_rss_mib"] = round(m["process_resident_memory_bytes"] / 2**20, 1)
        return out

    def stop(self, timeout=30.0):
        """SIGUSR1 to mpiexec, which MPICH's and Open MPI's both forward to every rank (Open MPI's would end
        the ranks itself on a SIGTERM: mpi_tp.core.runtime.STOP_SIGNALS); SIGKILL to its process group and
        ranks after timeout."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for p in self.ranks:           # a rank its mpiexec left behind (checked by its command line: a pid is reused)
            with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                if b"mpi_tp" in f.read():
                    os.kill(p, signal.SIGKILL)
        return self.proc.returncode


def get(server, path, timeout=10.0):
    """(status, headers, body) of one GET."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def metrics(server):
    """GET /metrics as {'name{labels}': value}, or None where the server has no /metrics."""
    try:
        status, _, body = get(server, "/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    out = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if m := re.match(r"([A-Za-z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)", line):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = float(m.group(2))
    return out


def stream_one(server, body, timeout=REQUEST_TIMEOUT):
    """Send one streamed completion, read it to its end: status, TTFT and per-token latency in ms, tokens."""
    r = {"status": None, "ttft_ms": None, "tpot_ms": None, "tokens": 0}
    conn, resp, times, done = http.client.HTTPConnection(server.host, server.port, timeout=timeout), None, [], False
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            r["retry_after"] = resp.getheader("Retry-After")
            return r
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            if (data := line[6:].strip()) == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if event["choices"][0].get("text"):
                times.append(time.perf_counter())
            if "usage" in event:
                r["tokens"] = event["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        r["status"], r["error"] = r["status"] or type(e).__name__, type(e).__name__
    finally:
        if resp is not None:
            resp.close()               # Connection: close: the response holds the socket
        conn.close()
    if r["status"] == 200 and not done:
        r["status"] = "incomplete"
    if times:
        r["ttft_ms"] = 1e3 * (times[0] - t0)
    if len(times) > 1 and r["tokens"] > 1:
        r["tpot_ms"] = 1e3 * (times[-1] - times[0]) / (r["tokens"] - 1)
    return r
