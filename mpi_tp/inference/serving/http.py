"""Rank 0's HTTP layer: each connection on a thread of its own, every request checked in full before
it is queued, and no client able to hold the server: a deadline for sending the request (headers and
body, --read-timeout), a cap on open connections (--max-connections, 503 past it), a bounded queue
(429 with Retry-After past --max-queue), a client that goes away (or a handler that fails) freeing its
row at the next decode step, streaming or not, and a deadline per request (its body's timeout, or
--request-timeout; 504, or an error event after the text streamed so far). Every failure here is this
request's: an answer (4xx, or 500 saying what failed) and a line in the log, never an exception on the
thread that calls MPI. /metrics counts completions by status and every other request apart.
"""
from __future__ import annotations

import contextlib
import json
import queue
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mpi_tp.core.failpoints import answer_error
from mpi_tp.inference.api import BadRequest, parse_chat, parse_completion
from mpi_tp.inference.serving.answer import Answer
from mpi_tp.inference.serving.scheduler import CLOSED, DONE, Failed, Job, Token, log

MAX_BODY = 1 << 20                     # bytes of JSON a request may send (413 above)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GONE = 499                             # the status counted for a client that left before its answer


class Deadline(Exception):
    """A request's time (its timeout, or --request-timeout) ran out before its answer."""


class HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on open connections and a deadline for reading each request."""
    daemon_threads, request_queue_size = True, 256          # a backlog of 5 resets bursts

    def __init__(self, address, app, max_connections: int, read_timeout: float):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.app, self.max_connections, self.read_timeout = app, max_connections, read_timeout
        self.lock, self.open, self.reading = threading.Lock(), 0, {}
        threading.Thread(target=self._reaper, daemon=True).start()

    def process_request(self, request, client_address):
        with self.lock:
            refuse = self.open >= self.max_connections
            self.open += not refuse
        if not refuse:
            return super().process_request(request, client_address)
        self.app.metrics.count("refused")
        body = json.dumps({"error": {"message": f"more than {self.max_connections} open connections; try "
                                                "again shortly", "type": "server_error"}}).encode()
        with contextlib.suppress(OSError):
            request.setblocking(False)            # the accepting thread never waits for this client
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1"
                         b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.open -= 1

    def handle_error(self, request, client_address):
        """A connection's thread ended with an exception the handler did not answer: one line, no traceback."""
        e = sys.exc_info()[1]
        log(f"error on a connection from {client_address[0]}: {type(e).__name__}: {e}")

    def watch(self, sock, reading: bool) -> None:
        """While `reading`, the connection is closed if its request is not in by the deadline."""
        with self.lock:
            if reading:
                self.reading[sock] = time.monotonic() + self.read_timeout
            else:
                self.reading.pop(sock, None)

    def _reaper(self) -> None:
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self.lock:
                late = [s for s, deadline in self.reading.items() if deadline < now]
                for s in late:
                    del self.reading[s]
            for s in late:                        # its thread's read then ends, and the thread with it
                self.app.metrics.count("read_timeouts")
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class Handler(BaseHTTPRequestHandler):
    server_version, timeout = "mpi_tp", 60     # timeout: seconds any one read or write may take

    def setup(self):
        super().setup()
        self.server.watch(self.connection, True)

    def handle(self):
        try:
            super().handle()
        except OSError:
            pass                                # the client left or was cut off (its read deadline)
        finally:
            self.server.watch(self.connection, False)

    def log_message(self, format, *args):       # quiet: the server logs what matters itself
        pass

    def do_GET(self):
        app, self.started, path = self.server.app, False, self.path.split("?", 1)[0].rstrip("/") or "/"
        routes = {"/health": ("GET", app.health), "/v1/models": ("GET", app.models),
                  "/metrics": ("GET", None), COMPLETIONS: ("POST", None), CHAT: ("POST", None)}
        model = urllib.parse.unquote(path[len("/v1/models/"):]) if path.startswith("/v1/models/") else None
        if model is not None:
            routes[path] = ("GET", lambda: app.model(model))
        # the completions counter counts completions (chat's too); the rest apart, by path (not served: "other")
        self.counted_as = None if path in (COMPLETIONS, CHAT) and self.command == "POST" else \
            "/v1/models/{id}" if model is not None else path if path in routes else "other"
        try:
            if self.command != "POST":
                self.server.watch(self.connection, False)
            if path not in routes:
                return self._error(404, f"no such path {path}: POST {COMPLETIONS}, POST {CHAT}, GET /v1/models, "
                                        "GET /v1/models/{id}, GET /health, GET /metrics")
            method, answer = routes[path]
            if self.command != method:
                return self._error(405, f"{path} takes {method}, not {self.command}", Allow=method)
            if path == "/metrics":
                return self._text(200, app.metrics_text(self.server.open))
            return self._json(*answer()) if answer else self._complete(app, path == CHAT)
        except OSError:
            pass                                # the client left, stalled or was cut off: nobody to answer
        except Exception as e:                  # a bug: said in the log and to the client; the job lives on
            log(f"error answering {self.command} {path}: {type(e).__name__}: {e}")
            if not self.started:
                with contextlib.suppress(OSError):
                    self._error(500, f"internal error ({type(e).__name__}; the server's log says more)",
                                "server_error")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _complete(self, app, chat: bool):
        n = self.headers.get("Content-Length", "")
        if not re.fullmatch(r"[0-9]{1,12}", n.strip()):            # ASCII digits: not "²", "-5" or "1e3"
            return self._error(411, "send the JSON body with a Content-Length header (a decimal byte count)")
        n = int(n)
        if n > MAX_BODY:
            left = n if n <= 16 * MAX_BODY else 0       # read it away: most clients send it all first
            while left > 0 and (got := self.rfile.read(min(left, 1 << 16))):
                left -= len(got)
            return self._error(413, f"the body has {n} bytes; at most {MAX_BODY} are accepted")
        raw = self.rfile.read(n)
        self.server.watch(self.connection, False)
        if len(raw) < n:
            return None                                  # cut off (the deadline, or the client left)
        try:
            c = parse_chat(raw, app.block_size, app.vocab_size, app.tokenizer, app.chat_template, app.name) if chat \
                else parse_completion(raw, app.block_size, app.vocab_size, app.tokenizer, app.name)
        except BadRequest as e:
            return self._error(e.status, str(e))
        if len(c.requests) > app.scheduler.max_queue:
            return self._error(400, f"{len(c.requests)} choices (prompts x n) are more than this server queues at "
                                    f"once (--max-queue {app.scheduler.max_queue}): send fewer")
        results = queue.SimpleQueue()                    # every choice's items, as (index, item)
        jobs = [Job(r, i, results, c.timeout, c.logprobs) for i, r in enumerate(c.requests)]
        said = app.scheduler.submit(jobs)
        if said == "full":
            return self._error(429, f"the queue is full ({app.scheduler.max_queue} requests wait); retry later",
                               "rate_limit_error", **{"Retry-After": 1})
        if said == "stopping":
            return self._error(503, "the server is shutting down", "server_error")
        try:
            self._answer(app, c, jobs)
        except Exception as e:                           # the client went away, or a failure here: nobody will
            for job in jobs:                             # read the rows, which leave the batch at the next step
                job.cancelled = True
            if isinstance(e, OSError):
                app.metrics.answered(GONE)
            raise
        finally:
            app.scheduler.finished()

    def _next(self, results: queue.SimpleQueue, deadline: float | None):
        """The request's next (index, item). A client gone is a ConnectionError, looked for at every item (so
        within one decode step, streaming or not) and every 0.25 s between; past the deadline
        (time.monotonic), Deadline."""
        while True:
            wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if wait <= 0:
                raise Deadline()
            try:
                item = results.get(timeout=wait)
            except queue.Empty:
                item = None
            if self._client_gone():
                raise ConnectionError("the client closed the connection")
            if item is not None:
                return item

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _answer(self, app, c, jobs: list[Job]):
        """The request's answer; past its deadline, what is said instead: a 504 before anything was sent, else an
        error event after the text streamed so far."""
        seconds = c.timeout or app.request_timeout
        self.sent = 0
        try:
            return self._generate(app, c, jobs, jobs[0].arrived + seconds if seconds else None)
        except Deadline:
            for job in jobs:
                job.cancelled = True                      # its rows leave the batch at the next decode step
            app.metrics.count("deadlines")
            why = f"the request's deadline of {seconds:g} s passed after {self.sent} tokens"
            log(why)
            if not self.started:
                return self._error(504, why, "timeout")
            self._event({"error": {"message": why, "type": "timeout"}})
            return self._event("[DONE]")

    def _generate(self, app, c, jobs: list[Job], deadline: float | None):
        out, results = Answer(c, app.name, app.tokenizer), jobs[0].items
        i, item = self._next(results, deadline)
        if item is CLOSED:
            return self._error(503, "the server shut down before this request's turn", "server_error")
        if c.stream:
            self._start(200, "text/event-stream", **{"Cache-Control": "no-cache"})
            for chunk in out.opening():
                self._event(chunk)
        while True:
            if isinstance(item, Token):
                chunk, self.sent = out.add(i, item), self.sent + 1
                answer_error(jobs[i].request.seed, len(out.choices[i].ids))
                if chunk and c.stream:
                    self._event(chunk)
            elif item is DONE:
                for chunk in out.finish(i):
                    if c.stream:
                        self._event(chunk)
                if out.live == 0:
                    break
            else:                                       # Failed on rank 0, or CLOSED (a stop began before its turn)
                why = item.message if isinstance(item, Failed) else "the server shut down before its turn"
                for job in jobs:
                    job.cancelled = True
                log(f"request {out.id} failed after {out.tokens} tokens (choice {i}): {why}")
                message = f"generation failed after {out.tokens} tokens: {why}"
                if not c.stream:
                    return self._error(500, message, "server_error")
                self._event({"error": {"message": message, "type": "server_error"}})
                return self._event("[DONE]")
            i, item = self._next(results, deadline)
        if not c.stream:
            return self._json(200, out.body())
        self._event("[DONE]")

    def _start(self, status: int, content_type: str, **headers):
        self.started = True
        self.server.app.metrics.answered(status, self.counted_as)
        self.send_response(status)
        for k, v in {"Content-Type": content_type, **headers, "Connection": "close"}.items():
            self.send_header(k, str(v))
        self.end_headers()

    def _json(self, status: int, obj: dict, **headers):
        body = json.dumps(obj).encode()
        self._start(status, "application/json", **{"Content-Length": len(body)}, **headers)
        self.wfile.write(body)

    def _text(self, status: int, text: str):
        body = text.encode()
        self._start(status, "text/plain; version=0.0.4; charset=utf-8", **{"Content-Length": len(body)})
        self.wfile.write(body)

    def _event(self, obj: dict | str):
        self.wfile.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")

    def _error(self, status: int, message: str, kind: str = "invalid_request_error", **headers):
        self.close_connection = True
        self._json(status, {"error": {"message": message, "type": kind}}, **headers)
