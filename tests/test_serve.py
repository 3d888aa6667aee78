"""`mpi-tp serve` end to end: a real 2-rank MPI job answering a real HTTP client, against the serial model.

The job tests start their own mpiexec, so they run in the one-rank pass only (no mpi marker).
A checkpoint trained for 2 steps is still nearly random, so its greedy text depends on the prompt.
"""
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_cli import MPIEXEC, clean_env

from mpi_tp.inference.generate import Request
from mpi_tp.inference.api import BadRequest, TextOut, parse_completion

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
BLOCK = 32
MPI_TP = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mpi_tp"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "run"
    r = subprocess.run(MPI_TP + ["train", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
                                 str(BLOCK), "--batch-size", "4", "--steps", "2", "--eval-batches", "1",
                                 "--eval-every", "100", "--sample-len", "0", "--dtype", "float64", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 0, r.stderr
    return str(out / "checkpoints")


@pytest.fixture(scope="module")
def serial(checkpoint):
    from mpi4py import MPI

    from mpi_tp.commands.tools import load_model
    return load_model(checkpoint, MPI.COMM_SELF, "float64")[0]


def expected(model, body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a request, from generate on the serial model, alone."""
    from mpi_tp.inference.generate import generate
    stop = body.get("stop", "").encode()
    req = Request(body["prompt"].encode(), max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0),
                  top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0), seed=body.get("seed", 0), stop=stop)
    out = generate(model, [req])[0]
    stopped = bool(stop) and out.endswith(stop)
    return (out[:-len(stop)] if stopped else out).decode("utf-8", "replace"), "stop" if stopped else "length", len(out)


class Server:
    """`mpiexec -n 2 ... serve --port 0`, its address read from the line it prints."""

    def __init__(self, checkpoint, folder, *flags):
        self.out, self.err = folder / "serve.out", folder / "serve.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(MPI_TP + ["serve", "--checkpoint", checkpoint, "--port", "0", "--dtype",
                                                   "float64", *flags], stdout=out, stderr=err,
                                         env=clean_env(), start_new_session=True)
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
        """SIGTERM to mpiexec (it forwards the signal to every rank); the job's exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"no exit within {timeout} s of SIGTERM:\n{self.stderr()}")

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


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # a long batch wait: the concurrent requests below surely meet in one batch (it starts when 4 are in)
    s = Server(checkpoint, tmp_path_factory.mktemp("server"), "--max-batch", "4", "--batch-wait-ms", "1500")
    yield s
    status = s.stop()
    assert status == 0 and "Traceback" not in s.stderr(), s.stderr()


def text_of(events) -> tuple[str, dict]:
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(e["choices"][0]["text"] for e in events[:-1]), events[-2]


@needs_mpiexec
def test_concurrent_requests_are_batched_and_right(server, serial):
    status, health = server.call("/health")
    assert status == 200 and health["status"] == "ok" and health["tp"] == 2 and health["block_size"] == BLOCK
    greedy = expected(serial, {"prompt": "hello", "max_tokens": 12, "temperature": 0})[0]
    stop = next((greedy[i:i + 2] for i in range(1, 10) if greedy[i:i + 2].isascii() and greedy[i:i + 2].isprintable()),
                None)
    assert stop, f"no printable pair in {greedy!r} to stop at: try another prompt"
    bodies = [{"prompt": "The ", "max_tokens": 12, "temperature": 0},
              {"prompt": "hello", "max_tokens": 12, "temperature": 0, "stop": stop},
              {"prompt": "import", "max_tokens": 12, "temperature": 0.9, "seed": 7, "top_k": 50, "top_p": 0.95},
              {"prompt": "import", "max_tokens": 12, "temperature": 0.9, "seed": 7, "top_k": 50, "top_p": 0.95,
               "stream": True}]
    answers, start = [None] * len(bodies), threading.Barrier(len(bodies))

    def ask(i):
        start.wait()
        answers[i] = list(server.stream(bodies[i])) if bodies[i].get("stream") else server.call("/v1/completions", bodies[i])
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for body, answer in zip(bodies[:3], answers):
        text, reason, n = expected(serial, body)
        status, got = answer
        assert status == 200, got
        assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
        assert got["choices"][0]["text"] == text and got["choices"][0]["finish_reason"] == reason, (body, got, text)
        assert got["usage"] == {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                "total_tokens": len(body["prompt"]) + n}
    assert answers[1][1]["choices"][0]["finish_reason"] == "stop"        # the stop sequence was met, and cut
    assert len({a[1]["choices"][0]["text"] for a in answers[:3]}) == 3   # three different texts: no mix-up
    streamed, last = text_of(answers[3])
    assert streamed == answers[2][1]["choices"][0]["text"] and last["usage"] == answers[2][1]["usage"]
    assert len(answers[3]) > 3                                           # in pieces, not in one go
    health = server.call("/health")[1]
    assert health["largest_batch"] > 1 and health["requests_served"] == 4, health


@needs_mpiexec
def test_a_burst_of_connections_is_all_answered(server):
    """128 clients at once, more than a default listen backlog (5) holds: none is reset, all answered."""
    statuses = [None] * 128

    def ask(i):
        try:
            statuses[i] = server.call("/v1/completions", {"prompt": f"{i} ", "max_tokens": 2, "seed": i})[0]
        except OSError as e:
            statuses[i] = repr(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(statuses))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses == [200] * len(statuses), [s for s in statuses if s != 200][:3]


@needs_mpiexec
def test_bad_requests_get_400_and_the_server_goes_on(server, serial):
    served = server.call("/health")[1]["requests_served"]
    for raw, says in [(b"{bad", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                      (json.dumps({"prompt": "x", "max_tokens": "5"}).encode(), "max_tokens must be an integer"),
                      (json.dumps({"prompt": "a" * (BLOCK + 1)}).encode(), f"1 to {BLOCK} bytes"),
                      (json.dumps({"prompt": ""}).encode(), f"1 to {BLOCK} bytes"),
                      (json.dumps({"max_tokens": 4}).encode(), "prompt is required"),
                      (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature")]:
        status, got = server.call("/v1/completions", raw=raw)
        assert status == 400 and says in got["error"]["message"], (raw, status, got)
        assert got["error"]["type"] == "invalid_request_error"
    assert server.call("/nowhere")[0] == 404
    assert server.call("/v1/completions")[0] == 405                      # GET
    status, got = server.call("/v1/completions", raw=json.dumps({"prompt": "x" * (8 << 20)}).encode())
    assert status == 413 and "at most" in got["error"]["message"]       # (urllib sends it all, then reads)
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(1 << 30))                       # announced, never sent
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    body = {"prompt": "def ", "max_tokens": 8, "temperature": 0}
    status, got = server.call("/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == expected(serial, body)[0]
    assert server.call("/v1/models")[1]["data"][0]["id"] == got["model"]
    assert server.call("/health")[1]["requests_served"] == served + 1
    assert "Traceback" not in server.stderr()


@needs_mpiexec
def test_sigterm_finishes_the_batch_in_flight_and_exits_0(checkpoint, tmp_path):
    s = Server(checkpoint, tmp_path, "--batch-wait-ms", "1000")
    try:
        events = s.stream({"prompt": "The ", "max_tokens": 400, "temperature": 0})    # sent; waits for more
        deadline = time.monotonic() + 30
        while s.call("/health")[1]["in_progress"] != 1:
            assert time.monotonic() < deadline, "the request was not taken"
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)              # while its batch waits for company: it still runs
        first = next(events)
        status, health = s.call("/health")              # answers while the batch computes ...
        assert status == 503 and health["status"] == "stopping" and health["requests_served"] == 0, health
        status, got = s.call("/v1/completions", {"prompt": "The ", "max_tokens": 4})
        assert status == 503 and "shutting down" in got["error"]["message"]     # ... takes nothing new ...
        rest = [first] + list(events)
        assert rest[-1] == "[DONE]" and rest[-2]["usage"]["completion_tokens"] == 400   # ... finishes this one
        assert s.proc.wait(timeout=30) == 0
    finally:
        s.kill()
    err = s.stderr()
    assert "Traceback" not in err and "SIGTERM: stopping" in err and "stopped after 1 request(s)" in err, err


def test_text_pieces_join_into_the_whole_text():
    whole = "é€😀 ok".encode()
    t = TextOut(b"")
    pieces = [t.add(b) for b in whole] + [t.finish()]
    assert "".join(pieces) == whole.decode() and "\ufffd" not in "".join(pieces)   # no character torn apart
    rng = random.Random(0)
    for _ in range(200):                                                 # any bytes, any stop: as one decode
        out = bytes(rng.choice(b"ab\n\xc3\xa9\xe2\x82\xac\xff") for _ in range(rng.randint(1, 30)))
        stop = bytes(rng.choice(b"ab\n\xc3") for _ in range(rng.randint(0, 3)))
        t, pieces = TextOut(stop), []
        for i, b in enumerate(out):
            pieces.append(t.add(b))
            if t.stopped:
                out = out[:i + 1]                                        # generate stops there too
                break
        pieces.append(t.finish())
        cut = out[:-len(stop)] if stop and out.endswith(stop) else out
        assert "".join(pieces) == cut.decode("utf-8", "replace") and t.stopped == (cut != out), (out, stop)


def test_parse_completion_defaults_and_errors():
    req, stream = parse_completion(b'{"prompt": "h\\u00e9", "stop": ["\\n"]}', BLOCK)
    assert (req.prompt, req.stop, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, stream) == \
           ("hé".encode(), b"\n", 64, 1.0, 1.0, 0, 0, False)
    for body, says in [('{"prompt": "x", "stream": 1}', "stream must be true or false"),
                       ('{"prompt": "x", "max_tokens": true}', "max_tokens must be an integer"),
                       ('{"prompt": "x", "seed": -1}', "seed must be a non-negative integer"),
                       ('{"prompt": "x", "stop": ["a", "b"]}', "one stop sequence"),
                       ('{"prompt": "\\ud800"}', "valid Unicode"),
                       ('{"prompt": ["x"]}', "prompt must be a string"),
                       ('{"prompt": "x", "top_p": 0}', "top_p"),
                       ('{"prompt": "x", "max_tokens": 4097}', "max_tokens must be at most 4096"),
                       ('"x"', "JSON object"), ("[" * 100000, "not valid JSON")]:
        with pytest.raises(BadRequest, match=re.escape(says)):
            parse_completion(body.encode(), BLOCK)
