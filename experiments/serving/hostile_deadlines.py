"""The hostile mix's deadline cases against `mpi-tp serve`: requests that outlive their body's timeout or the
server's --request-timeout, streamed, not streamed or still in the queue, and one whose own timeout
outlasts the server's. Each act is `server -> (answer, detail, as expected)`, as in hostile_clients.py;
each checks the answer, the time it came, deadlines_total and that no row is left running.
"""
import contextlib
import http.client
import json
import threading
import time
from collections import Counter

from hostile_clients import counters, error_of, post, raw, settle


def deadline(server, stream, timeout=None, tokens=2000, expect=None):
    """A request for `tokens` tokens with the body's timeout (None: the field left out, the server's
    --request-timeout applies; expect: the deadline that must apply, default timeout). Non-streamed:
    a 504 of type timeout naming the deadline; streamed: text events, then an error event of type timeout
    and [DONE]; either within 2 s of the deadline, counted once in deadlines_total, its row freed."""
    expect = expect or timeout
    body = {"prompt": "The ", "max_tokens": tokens, "stream": stream, **({"timeout": timeout} if timeout else {})}
    before, t0 = counters(server), time.monotonic()
    if stream:
        events = stream_events(server, body)
        texts = sum(isinstance(e, dict) and bool(e.get("choices", [{}])[0].get("text")) for e in events)
        last = events[-2] if len(events) > 1 and isinstance(events[-2], dict) else {}
        kind, message = (last.get("error") or {}).get("type"), (last.get("error") or {}).get("message", "")
        done = events[-1:] == ["[DONE]"]
        got = f"{texts} text events, then " + (f"an error event ({kind})" if kind else "no error event") \
            + (", [DONE]" if done else ", no [DONE]")
        ok = texts > 0 and kind == "timeout" and done
    else:
        got, _, answer = raw(server, post(body), timeout=60)
        kind, message = error_of(answer)
        ok = got == 504 and kind == "timeout"
    seconds = time.monotonic() - t0
    took, _, _ = settle(server)
    delta = {k: v - before.get(k, 0) for k, v in counters(server).items()}
    ok = ok and f"deadline of {expect:g} s" in message and seconds < expect + 2 and took is not None
    ok = ok and delta.get("deadlines") == 1
    detail = (f"{message!r} after {seconds:.2f} s; {delta.get('tokens', 0):.0f} tokens; "
              + counted(delta))
    return got, detail, ok


def counted(delta):
    """How /metrics counted deadlines, flagging those counted as cancelled too (the client stayed to read)."""
    d, c = delta.get("deadlines", 0), delta.get("cancelled", 0)
    return f"deadlines_total +{d:.0f}, cancelled_total +{c:.0f}" + (" (counted as cancelled too, though the "
                                                                     "client stayed)" if c else "")


def stream_events(server, body):
    """Every event of one streamed completion, parsed ('[DONE]' as is); [] if it did not answer 200."""
    conn, r, events = http.client.HTTPConnection(server.host, server.port, timeout=60), None, []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        while r.status == 200 and (line := r.readline()):
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append(data if data == "[DONE]" else json.loads(data))
    except (OSError, http.client.HTTPException, ValueError) as e:
        events.append(f"{type(e).__name__}")
    finally:
        if r is not None:
            r.close()
        conn.close()
    return events


def outlives(server, timeout, tokens=2000):
    """A non-streamed request whose body's timeout (longer than the server's) lets it finish: 200, all tokens."""
    t0 = time.monotonic()
    status, _, answer = raw(server, post({"prompt": "The ", "max_tokens": tokens, "timeout": timeout}), timeout=90)
    with contextlib.suppress(ValueError, KeyError, TypeError):
        n = json.loads(answer)["usage"]["completion_tokens"]
        return status, f"{n} tokens in {time.monotonic() - t0:.2f} s", status == 200 and n == tokens
    return status, error_of(answer)[1], False


def queued_deadline(server, n, timeout=0.3, fill_timeout=1.5, tokens=2000):
    """n requests (one per row) with the body's timeout fill_timeout, then one more with `timeout` that can
    only wait in the queue: its 504 must come after about `timeout` s, naming 0 tokens; the n then end by
    theirs (504 each); deadlines_total +n+1 and nothing left running or queued."""
    before, answers = counters(server), [None] * (n + 1)

    def one(i, seconds):
        body = {"prompt": "The ", "max_tokens": tokens, "timeout": seconds, "seed": i}
        answers[i] = raw(server, post(body), timeout=60), time.monotonic()
    threads = [threading.Thread(target=one, args=(i, fill_timeout), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.2)                    # the n have their rows by now
    t0 = time.monotonic()
    one(n, timeout)
    for t in threads:
        t.join(60)
    (status, _, body), seconds = answers[n][0], answers[n][1] - t0
    kind, message = error_of(body)
    rows = Counter(str(a[0][0]) if a else "no answer" for a in answers[:n])
    took, _, _ = settle(server)
    delta = {k: v - before.get(k, 0) for k, v in counters(server).items()}
    ok = status == 504 and kind == "timeout" and "after 0 tokens" in message and seconds < timeout + 1
    ok = ok and rows == {"504": n} and delta.get("deadlines") == n + 1 and took is not None
    got = f"{status}; the {n} running: " + ", ".join(f"{k} x {v}" for k, v in sorted(rows.items()))
    return got, f"{message!r} after {seconds:.2f} s; " + counted(delta), ok
