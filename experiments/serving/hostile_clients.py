"""What the hostile mix's clients do to `mpi-tp serve`, on raw sockets and http.client: malformed bytes,
a slow sender, clients that vanish (mid-stream, or several non-streamed ones at once), a burst past the
queue (the deadlines: hostile_deadlines.py). Each act is `server -> (answer, detail, as expected)`;
every socket operation has a timeout, so none hangs. Used by experiments/serving/serve_hostile.py.
"""
import contextlib
import http.client
import json
import select
import socket
import threading
import time
from collections import Counter

import serve_harness as sl


def post(body, length=None, extra=b""):
    """The bytes of a POST /v1/completions: body (bytes or an object as JSON), Content-Length as given or true."""
    body = body if isinstance(body, bytes) else json.dumps(body).encode()
    length = str(len(body)).encode() if length is None else length
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + length + b"\r\n" + extra + b"\r\n" + body)


def raw(server, data, timeout=30.0):
    """Send bytes, read until the server closes: (status, or 'closed' / 'timeout' / 'refused'; headers; body)."""
    got = b""
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            s.settimeout(timeout)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):    # the answer may already be there
                s.sendall(data)
            while chunk := s.recv(1 << 16):
                got += chunk
    except ConnectionRefusedError:
        return "refused", {}, ""
    except TimeoutError:
        if not got:
            return "timeout", {}, ""
    except ConnectionResetError:
        pass
    head, _, body = got.partition(b"\r\n\r\n")
    head = head.decode("latin-1").split("\r\n")
    if not got or not head[0].startswith("HTTP/"):
        return "closed", {}, ""
    return int(head[0].split()[1]), dict(h.split(": ", 1) for h in head[1:] if ": " in h), body.decode(errors="replace")


def slow_sender(server, seconds):
    """Headers one byte a second, for up to `seconds`: (what the server did, detail)."""
    data, t0 = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000, time.monotonic()
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            for i, byte in enumerate(data):
                if time.monotonic() - t0 > seconds:
                    return "open", f"still open after {i} bytes in {seconds:.0f} s", False
                if select.select([s], [], [], 0)[0]:               # the server wrote something, or closed
                    answer = s.recv(4096)
                    status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else "closed"
                    return status, f"after {i} bytes, {time.monotonic() - t0:.1f} s", status in ("closed", 408)
                s.sendall(bytes([byte]))
                time.sleep(1)
    except OSError as e:
        return "closed", f"{type(e).__name__} after {time.monotonic() - t0:.1f} s", True
    return "open", "sent the whole header", False


def running(server):
    """Rows generating now (mpi_tp_running_rows from /metrics), else requests in progress (/health), else None."""
    m = sl.metrics(server)
    if m is not None and any(k.startswith("mpi_tp_running_rows") for k in m):
        return "running_rows", sum(v for k, v in m.items() if k.startswith("mpi_tp_running_rows"))
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
        return "in_progress", json.loads(sl.get(server, "/health")[2])["in_progress"]
    return "unknown", None


def disconnect(server, tokens=2000, events=2):
    """Read `events` text events of a long streamed request, close the socket; then wait for 0 running."""
    conn, r = http.client.HTTPConnection(server.host, server.port, timeout=30), None
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "The ", "max_tokens": tokens, "stream": True}))
        r, seen = conn.getresponse(), 0
        if r.status != 200:
            return r.status, "no stream", False
        while seen < events and (line := r.readline()):
            seen += line.startswith(b"data: ")
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__, "", False
    finally:
        if r is not None:
            r.close()                  # the response holds the socket (Connection: close): this closes it
        conn.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        what, n = running(server)
        if n == 0:
            return "closed", f"{what} 0 after {time.monotonic() - t0:.1f} s", True
        time.sleep(0.2)
    return "closed", f"{what} still {n} after 5 s", False


def burst(server, n):
    """n non-streamed requests at once: ('200 x a, 429 x b', detail on Retry-After)."""
    results, gate = [None] * n, threading.Barrier(n)

    def one(i):
        gate.wait()
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "The ", "max_tokens": 64, "seed": i}))
            r = conn.getresponse()
            r.read()
            results[i] = (r.status, r.getheader("Retry-After"))
        except (OSError, http.client.HTTPException) as e:
            results[i] = (type(e).__name__, None)
        finally:
            conn.close()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    count = Counter(str(r[0]) if r else "no answer" for r in results)
    retry = sorted({str(r[1]) for r in results if r and r[0] == 429})
    ok = count["429"] > 0 and set(count) <= {"200", "429"} and "None" not in retry
    return ", ".join(f"{k} x {v}" for k, v in sorted(count.items())), f"Retry-After: {', '.join(retry) or '-'}", ok


COUNTERS = {"cancelled": "mpi_tp_cancelled_total", "deadlines": "mpi_tp_deadlines_total",
            "tokens": "mpi_tp_tokens_generated_total", "499": 'mpi_tp_requests_total{status="499"}',
            "504": 'mpi_tp_requests_total{status="504"}', "429": 'mpi_tp_requests_total{status="429"}'}


def counters(server):
    """The server's counters that these cases move ({} where it has no /metrics)."""
    m = sl.metrics(server) or {}
    return {k: m.get(name, 0) for k, name in COUNTERS.items()} if m else {}


def settle(server, seconds=5.0):
    """Wait for no row running and none queued: (seconds it took or None, rows, queued) from /metrics."""
    t0, rows, queued = time.monotonic(), None, None
    while time.monotonic() - t0 < seconds:
        m = sl.metrics(server) or {}
        rows, queued = m.get("mpi_tp_running_rows"), m.get("mpi_tp_queue_depth")
        if rows == 0 and queued == 0:
            return round(time.monotonic() - t0, 1), rows, queued
        time.sleep(0.1)
    return None, rows, queued


def error_of(body):
    """(type, message) of a JSON error body, else (None, the start of the body)."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        e = json.loads(body)["error"]
        return e["type"], e["message"]
    return None, body[:97]


def abandon(server, rows, queued, tokens=2000, after_s=0.3):
    """`rows` non-streamed requests for `tokens` tokens (every row), then `queued` more once those run (sent
    with them, a few would be refused: the queue's bound counts requests about to join free rows); every
    socket closed `after_s` s later, nothing read. Then no row may run or wait, each request must count as
    cancelled (and 499), none refused, and all together must have made fewer tokens than one would alone."""
    before, socks, n = counters(server), [], rows + queued
    if not before:
        return "no /metrics", "", False

    def gauges():
        m = sl.metrics(server) or {}
        return m.get("mpi_tp_running_rows", -1), m.get("mpi_tp_queue_depth", -1)

    def until(what, seconds=5.0):
        t0 = time.monotonic()
        while not what(*gauges()) and time.monotonic() - t0 < seconds:
            time.sleep(0.02)
    try:
        for i in range(n):
            socks.append(socket.create_connection((server.host, server.port), timeout=5))
            socks[-1].sendall(post({"prompt": "The ", "max_tokens": tokens, "seed": i}))
            if i == rows - 1:
                until(lambda r, q: r == rows)
        until(lambda r, q: q == queued)
        time.sleep(after_s)
        busy = "{:.0f} running and {:.0f} queued at the close".format(*gauges())
    finally:
        for s in socks:
            s.close()
    took, r, q = settle(server)
    delta = {k: v - before[k] for k, v in counters(server).items()}
    freed = f"0 and 0 after {took} s" if took is not None else f"still {r:.0f} running, {q:.0f} queued after 5 s"
    detail = f"{busy}; {freed}; {delta['tokens']:.0f} tokens in all (to the end: {n * tokens})"
    ok = took is not None and delta["cancelled"] == n and delta["499"] == n and delta["tokens"] < tokens
    got = f"cancelled +{delta['cancelled']:.0f}, 499 +{delta['499']:.0f}, 429 +{delta['429']:.0f}"
    return got, detail, ok and delta["429"] == 0
