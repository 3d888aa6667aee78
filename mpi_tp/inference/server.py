"""Serving a model over HTTP (`mpi-tp serve`): OpenAI-style completions, batched, over the TP group.

Rank 0 answers HTTP; every rank computes. Handler threads check a request in full (JSON,
types, Request.check) before queueing it, so nothing invalid reaches a collective. Rank 0's
main thread alone calls MPI: it takes the first queued request, waits up to batch_wait_ms
for more (up to max_batch), broadcasts the batch (JSON, no pickle: its length as an int64,
then its bytes as uint8) and every rank calls generate(); on rank 0, on_token feeds each
request's queue, which its handler thread reads to stream the text or to answer at the end.
SIGTERM / SIGINT (mpiexec forwards them to every rank): rank 0 refuses new requests (503),
finishes the batch in flight, answers the queued ones 503, broadcasts "stop" and closes;
the other ranks only note the signal and leave on "stop"; all exit 0. docs/inference.md.

Standard library only (http.server, json, threading, queue, codecs): the server is
a thin layer over one collective loop; it installs wherever mpi_tp does (cluster
nodes without internet access included), and a framework's event loop or worker
processes would fight the one rule that matters here: one thread calls MPI.
"""
from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup
from mpi_tp.inference.decode import Decoder
from mpi_tp.inference.api import BadRequest, TextOut, parse_completion
from mpi_tp.inference.generate import Request, generate

MAX_BODY = 1 << 20                     # bytes of JSON a request may send (413 above)
DONE, CLOSED = "done", "closed"        # a job's last item: generated in full / shut down before it began


class Stop:
    """SIGTERM / SIGINT noted in a flag, nothing else (the handler runs between two bytecodes of the main thread)."""
    requested = None

    def install(self) -> Stop:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: setattr(self, "requested", signal.Signals(signum).name))
        return self


def broadcast_command(comm, command: dict | None = None) -> dict:
    """Rank 0's command on every rank (rank 0 too: everyone runs what came over the wire)."""
    data = json.dumps(command).encode() if comm.Get_rank() == 0 else b""
    n = numpy.array([len(data)], dtype=numpy.int64)
    req = comm.Ibcast(n, root=0)
    while not req.Test():              # an idle rank sleeps here instead of spinning in MPI's progress loop
        time.sleep(0.002)
    buf = numpy.frombuffer(data, dtype=numpy.uint8).copy() if data else numpy.empty(int(n[0]), numpy.uint8)
    comm.Bcast(buf, root=0)
    return json.loads(buf.tobytes())


def _wire(r: Request) -> dict:         # bytes as latin-1 strings: every byte round-trips exactly
    return {**vars(r), "prompt": r.prompt.decode("latin-1"), "stop": r.stop.decode("latin-1")}


def _unwire(d: dict) -> Request:
    return Request(**{**d, "prompt": d["prompt"].encode("latin-1"), "stop": d["stop"].encode("latin-1")})


def follow(model, comm) -> None:
    """Ranks other than 0: run each batch rank 0 broadcasts, until it says stop."""
    while (cmd := broadcast_command(comm))["cmd"] != "stop":
        generate(model, [_unwire(d) for d in cmd["requests"]])


class Job:
    def __init__(self, request: Request, stream: bool):
        self.request, self.stream, self.items = request, stream, queue.SimpleQueue()   # bytes, then DONE/CLOSED


class Server:
    """Rank 0: the queue of checked requests, the batching loop, and what /health reports."""

    def __init__(self, model, comm, name: str, max_batch: int, batch_wait_ms: float, stop: Stop):
        self.model, self.comm, self.name, self.stop = model, comm, name, stop
        self.max_batch, self.wait, self.created = max_batch, batch_wait_ms / 1000, int(time.time())
        self.jobs, self.lock, self.accepting, self.active = queue.Queue(), threading.Lock(), True, 0
        self.idle = threading.Condition(self.lock)
        self.stats = {"requests_served": 0, "batches": 0, "largest_batch": 0}

    def submit(self, job: Job) -> bool:
        with self.lock:
            if self.accepting and not self.stop.requested:
                self.active += 1
                self.jobs.put(job)
                return True
        return False

    def answered(self) -> None:
        with self.lock:
            self.active -= 1
            self.idle.notify_all()

    def health(self) -> tuple[int, dict]:
        up = self.accepting and not self.stop.requested
        return 200 if up else 503, {"status": "ok" if up else "stopping", "tp": self.comm.Get_size(),
                                    "model": self.name, "block_size": self.model.cfg.block_size,
                                    "in_progress": self.active, **self.stats}

    def run(self) -> None:
        """Batches until a signal; then the queued requests get 503 and the other ranks "stop"."""
        while not self.stop.requested:
            try:
                batch = [self.jobs.get(timeout=0.1)]
            except queue.Empty:
                continue
            deadline = time.monotonic() + self.wait
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self.compute(batch)
        log(f"{self.stop.requested}: stopping (no new requests; the batch in flight was finished)")
        with self.lock:
            self.accepting = False
        broadcast_command(self.comm, {"cmd": "stop"})
        while not self.jobs.empty():
            self.jobs.get_nowait().items.put(CLOSED)
        with self.idle:                       # the last answers written before the process ends
            self.idle.wait_for(lambda: self.active == 0, timeout=10)

    def compute(self, batch: list[Job]) -> None:
        t0 = time.perf_counter()
        cmd = broadcast_command(self.comm, {"cmd": "generate", "requests": [_wire(j.request) for j in batch]})
        out = generate(self.model, [_unwire(d) for d in cmd["requests"]],
                       on_token=lambda i, byte: batch[i].items.put(byte))
        for j in batch:
            j.items.put(DONE)
        s, dt, tokens = self.stats, time.perf_counter() - t0, sum(len(o) for o in out)
        s.update(requests_served=s["requests_served"] + len(batch), batches=s["batches"] + 1,
                 largest_batch=max(s["largest_batch"], len(batch)))
        log(f"batch {s['batches']}: {len(batch)} request(s), {tokens} tokens in {dt:.2f} s")


def log(message: str) -> None:
    print(f"mpi-tp serve: {message}", file=sys.stderr, flush=True)


class Handler(BaseHTTPRequestHandler):
    server_version, timeout = "mpi_tp", 60     # timeout: seconds a client may take to send its request

    def log_message(self, format, *args):       # quiet: one line per batch instead (Server.compute)
        pass

    def do_GET(self):
        app, self.started, path = self.server.app, False, self.path.split("?", 1)[0].rstrip("/") or "/"
        models = {"object": "list", "data": [{"id": app.name, "object": "model", "created": app.created}]}
        routes = {"/health": ("GET", app.health), "/v1/models": ("GET", lambda: (200, models)),
                  "/v1/completions": ("POST", None)}
        try:
            if path not in routes:
                return self._error(404, f"no such path {path}: POST /v1/completions, GET /v1/models, GET /health")
            method, answer = routes[path]
            if self.command != method:
                return self._error(405, f"{path} takes {method}, not {self.command}", Allow=method)
            return self._json(*answer()) if answer else self._complete(app)
        except (ConnectionError, socket.timeout):
            pass                                # the client left (or stalled): nobody to answer
        except Exception as e:                  # a bug: said in the log, not to the client; the job lives on
            log(f"error answering {self.command} {path}: {type(e).__name__}: {e}")
            if not self.started:
                with contextlib.suppress(OSError):
                    self._error(500, "internal error (the server's log says more)", "server_error")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _complete(self, app: Server):
        n = self.headers.get("Content-Length", "")
        if not n.strip().isdigit():
            return self._error(411, "send the JSON body with a Content-Length header")
        if int(n) > MAX_BODY:
            left = int(n) if int(n) <= 16 * MAX_BODY else 0     # read it away: most clients send it all first
            while left > 0 and (got := self.rfile.read(min(left, 1 << 16))):
                left -= len(got)
            return self._error(413, f"the body has {int(n)} bytes; at most {MAX_BODY} are accepted")
        try:
            job = Job(*parse_completion(self.rfile.read(int(n)), app.model.cfg.block_size))
        except BadRequest as e:
            return self._error(400, str(e))
        if not app.submit(job):
            return self._error(503, "the server is shutting down", "server_error")
        try:
            self._answer(app, job)
        finally:
            app.answered()

    def _answer(self, app: Server, job: Job):
        item = job.items.get()
        if item is CLOSED:
            return self._error(503, "the server shut down before this request's turn", "server_error")
        cid, created, n = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), 0
        text, pieces = TextOut(job.request.stop), []

        def chunk(piece: str, reason=None) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": app.name,
                    "choices": [{"index": 0, "text": piece, "finish_reason": reason}]}
        if job.stream:
            self._start(200, "text/event-stream", **{"Cache-Control": "no-cache"})
        while item is not DONE:
            n, piece = n + 1, text.add(item)
            if piece and job.stream:
                self._event(chunk(piece))
            pieces.append(piece)
            item = job.items.get()
        pieces.append(text.finish())
        p, reason = len(job.request.prompt), "stop" if text.stopped else "length"
        usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        if not job.stream:
            return self._json(200, {**chunk("".join(pieces), reason), "usage": usage})
        if pieces[-1]:
            self._event(chunk(pieces[-1]))
        self._event({**chunk("", reason), "usage": usage})
        self._event("[DONE]")

    def _start(self, status: int, content_type: str, **headers):
        self.started = True
        self.send_response(status)
        for k, v in {"Content-Type": content_type, **headers, "Connection": "close"}.items():
            self.send_header(k, str(v))
        self.end_headers()

    def _json(self, status: int, obj: dict, **headers):
        body = json.dumps(obj).encode()
        self._start(status, "application/json", **{"Content-Length": len(body)}, **headers)
        self.wfile.write(body)

    def _event(self, obj: dict | str):
        self.wfile.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")

    def _error(self, status: int, message: str, kind: str = "invalid_request_error", **headers):
        self.close_connection = True
        self._json(status, {"error": {"message": message, "type": kind}}, **headers)


def serve(model, comm, name: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          batch_wait_ms: float = 20.0, stop: Stop | None = None) -> int:
    """Serve until SIGTERM / SIGINT; collective over comm (the model's tensor-parallel group)."""
    stop = stop or Stop().install()
    collective_setup(Decoder, model, 1, comm=comm)     # a model the decoder cannot run: say so now

    def bind():
        if comm.Get_rank() != 0:
            return None
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET       # a backlog of 5 resets bursts
            kind = type("HTTPServer", (ThreadingHTTPServer,), {"address_family": family, "request_queue_size": 256})
            return kind((host, port), Handler)
        except OSError as e:
            raise UserError(f"serve: cannot listen on {host}:{port} ({e.strerror or e})") from None
    httpd = collective_setup(bind, comm=comm)
    if comm.Get_rank() != 0:
        follow(model, comm)
        return 0
    app = Server(model, comm, name, max_batch, batch_wait_ms, stop)
    httpd.app, httpd.daemon_threads = app, True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    where = f"[{host}]" if ":" in host else host
    print(f"serving {name} on http://{where}:{httpd.server_address[1]} (tp={comm.Get_size()})", flush=True)
    app.run()
    httpd.shutdown()
    httpd.server_close()
    log(f"stopped after {app.stats['requests_served']} request(s) in {app.stats['batches']} batch(es)")
    return 0
