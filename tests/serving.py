"""What the serving tests share: a small checkpoint, the serial model's answers, and a real server.

A server is `mpiexec -n 2 ... serve --port 0` with its address read from the line it prints. The module
fixtures serving_checkpoint and serving_serial (tests/conftest.py) are train_checkpoint's and serial_model's.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from jobs import MPIEXEC, STOP, clean_env

from mpi_tp.inference.generate import Request

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
BLOCK = 32
MPI_TP = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mpi_tp"]


def train_checkpoint(folder) -> str:
    """A checkpoint trained for 2 steps (still nearly random: its greedy text depends on the prompt)."""
    out = folder / "run"
    r = subprocess.run(MPI_TP + ["train", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
                                 str(BLOCK), "--batch-size", "4", "--steps", "2", "--eval-batches", "1",
                                 "--eval-every", "100", "--sample-len", "0", "--dtype", "float64", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 0, r.stderr
    return str(out / "checkpoints")


def serial_model(checkpoint):
    """The checkpoint's model on this process alone (float64): what each request gets alone."""
    from mpi4py import MPI

    from mpi_tp.checkpoint.model import load_model
    return load_model(checkpoint, MPI.COMM_SELF, "float64")[0]


def expected(model, body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a request, from generate on the serial model, alone."""
    from mpi_tp.inference.generate import generate
    stops = body.get("stop", [])
    stop = tuple(x.encode() for x in ([stops] if isinstance(stops, str) else stops))
    req = Request(body["prompt"].encode(), max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0),
                  top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0), seed=body.get("seed", 0), stop=stop)
    out = generate(model, [req])[0]
    cut = max((len(x) for x in stop if out.endswith(x)), default=0)
    return out[:len(out) - cut].decode("utf-8", "replace"), "stop" if cut else "length", len(out)


def module_server(checkpoint, folder, *flags, env=None):
    """A test module's Server, for its fixture to `yield from`: stopped when the module's tests are done,
    and then it must exit 0 without a traceback."""
    s = Server(checkpoint, folder, *flags, env=env)
    yield s
    status = s.stop()
    assert status == 0 and "Traceback" not in s.stderr(), s.stderr()


class Server:
    """`mpiexec -n 2 ... serve --port 0`, its address read from the line it prints."""

    def __init__(self, checkpoint, folder, *flags, env=None):
        self.out, self.err = folder / "serve.out", folder / "serve.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(MPI_TP + ["serve", "--checkpoint", checkpoint, "--port", "0", "--dtype",
                                                   "float64", *flags], stdout=out, stderr=err,
                                         env=clean_env() | (env or {}), start_new_session=True)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"^serving .+ on http://([\d.]+):(\d+) \(tp=2\)$", self.stdout(), re.M)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the server did not start:\n{self.stderr()}")
            time.sleep(0.05)
        self.host, self.port = m.group(1), int(m.group(2))

    def stdout(self):
        return self.out.read_text()

    def stderr(self):
        return self.err.read_text()

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout=30) -> int:
        """The stop signal to mpiexec, which forwards it to every rank (SIGTERM; SIGUSR1 under Open MPI:
        test_cli.STOP); the job's exit status."""
        self.proc.send_signal(STOP)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"no exit within {timeout} s of {STOP.name}:\n{self.stderr()}")

    def call(self, path, body=None, raw=None, method=None):
        """(status, JSON answer) of one request."""
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.host}:{self.port}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, body):
        """Send a streamed completion now; its events, to read one by one: JSON (the last one: "[DONE]")."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))

        def events():
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
            for line in r:
                if line.startswith(b"data: "):
                    data = line[6:].strip()
                    yield "[DONE]" if data == b"[DONE]" else json.loads(data)
            conn.close()
        return events()



    def metrics(self) -> dict:
        """GET /metrics parsed: {'name{labels}': value}, every sample line of the Prometheus text."""
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics", timeout=60) as r:
            assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain; version=0.0.4")
            text = r.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def wait_for(self, what, timeout=30):
        """Poll until what() is true (the metrics move between decode steps)."""
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"not within {timeout} s: {self.metrics()}"
            time.sleep(0.02)

    def raw(self, data: bytes, timeout=30) -> bytes:
        """Send raw bytes on a new connection; everything the server answers until it closes."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            return got

    def open_stream(self, body) -> socket.socket:
        """A streamed completion on a raw socket, its headers and first event read: the caller closes it."""
        data = json.dumps({**body, "stream": True}).encode()
        s = socket.create_connection((self.host, self.port), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        got = b""
        while b"\n\ndata: " not in got or not got.endswith(b"\n\n"):
            chunk = s.recv(4096)
            assert chunk, f"closed before the first event: {got!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.0 200") and b"text/event-stream" in got, got[:200]
        return s
