"""`mpi-tp serve` end to end: a real 2-rank MPI job answering a real HTTP client, against the serial model.

The job tests start their own mpiexec, so they run in the one-rank pass only (no mpi marker).
A checkpoint trained for 2 steps is still nearly random, so its greedy text depends on the prompt.
"""
import http.client
import json
import random
import re
import threading
import time

import pytest
from jobs import STOP
from serving import (
    BLOCK,
    Server,
    expected,
    module_server,
    needs_mpiexec,
)

from mpi_tp.inference.api import BadRequest, TextOut, parse_completion


@pytest.fixture(scope="module")
def server(serving_checkpoint, tmp_path_factory):
    # a long batch wait: the concurrent requests below surely meet in one batch (it starts when 4 are in)
    yield from module_server(serving_checkpoint, tmp_path_factory.mktemp("server"), "--max-batch", "4",
                             "--batch-wait-ms", "1500", "--max-queue", "256")


def text_of(events) -> tuple[str, dict]:
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(e["choices"][0]["text"] for e in events[:-1]), events[-2]


@needs_mpiexec
def test_concurrent_requests_are_batched_and_right(server, serving_serial):
    status, health = server.call("/health")
    assert status == 200 and health["status"] == "ok" and health["tp"] == 2 and health["block_size"] == BLOCK
    greedy = expected(serving_serial, {"prompt": "hello", "max_tokens": 12, "temperature": 0})[0]
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
        text, reason, n = expected(serving_serial, body)
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
def test_bad_requests_get_400_and_the_server_goes_on(server, serving_serial):
    served = server.call("/health")[1]["requests_served"]
    for raw, says in [(b"{bad", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                      (json.dumps({"prompt": "x", "max_tokens": "5"}).encode(), "max_tokens must be an integer"),
                      (json.dumps({"prompt": "a" * (BLOCK + 1)}).encode(), f"1 to {BLOCK} tokens"),
                      (json.dumps({"prompt": ""}).encode(), f"1 to {BLOCK} tokens"),
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
    assert status == 200 and got["choices"][0]["text"] == expected(serving_serial, body)[0]
    assert server.call("/v1/models")[1]["data"][0]["id"] == got["model"]
    assert server.call("/health")[1]["requests_served"] == served + 1
    assert "Traceback" not in server.stderr()


@needs_mpiexec
@pytest.mark.launcher
def test_the_stop_signal_finishes_the_batch_in_flight_and_exits_0(serving_checkpoint, tmp_path):
    s = Server(serving_checkpoint, tmp_path, "--batch-wait-ms", "1000")
    try:
        events = s.stream({"prompt": "The ", "max_tokens": 400, "temperature": 0})    # sent; waits for more
        deadline = time.monotonic() + 30
        while s.call("/health")[1]["in_progress"] != 1:
            assert time.monotonic() < deadline, "the request was not taken"
            time.sleep(0.01)
        s.proc.send_signal(STOP)                        # while its batch waits for company: it still runs
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
    assert "Traceback" not in err and f"{STOP.name}: stopping" in err and "stopped after 1 request(s)" in err, err


def test_text_pieces_join_into_the_whole_text():
    whole = "é€😀 ok".encode()
    t = TextOut(b"")
    pieces = [t.add(bytes([b])) for b in whole] + [t.finish()]
    assert "".join(pieces) == whole.decode() and "\ufffd" not in "".join(pieces)   # no character torn apart
    rng = random.Random(0)
    for _ in range(200):                                                 # any bytes, any stop: as one decode
        out = bytes(rng.choice(b"ab\n\xc3\xa9\xe2\x82\xac\xff") for _ in range(rng.randint(1, 30)))
        stop = tuple(bytes(rng.choice(b"ab\n\xc3") for _ in range(rng.randint(1, 3)))
                     for _ in range(rng.randint(0, 3)))              # up to three stop sequences
        t, pieces = TextOut(stop), []
        for i, b in enumerate(out):
            pieces.append(t.add(bytes([b])))
            if t.stopped:
                out = out[:i + 1]                                        # generate stops there too
                break
        pieces.append(t.finish())
        ended = [len(s) for s in stop if out.endswith(s)]
        cut = out[:-max(ended)] if ended else out                        # the one that began first is cut
        assert "".join(pieces) == cut.decode("utf-8", "replace") and t.stopped == (cut != out), (out, stop)
        cuts = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, 3))) if len(out) > 1 else []
        t = TextOut(stop)                                                # a token's text: several bytes at once
        chunked = [t.add(out[a:b]) for a, b in zip([0] + cuts, cuts + [len(out)])] + [t.finish()]
        assert "".join(chunked) == "".join(pieces) and t.stopped == (cut != out), (out, stop, cuts)


def test_parse_completion_defaults_and_errors():
    c = parse_completion(b'{"prompt": "h\\u00e9", "stop": ["\\n"], "seed": 0}', BLOCK)
    (req,) = c.requests
    assert (req.prompt, req.stop, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, c.stream, c.timeout) == \
           ("hé".encode(), (b"\n",), 64, 1.0, 1.0, 0, 0, False, 0.0)
    assert parse_completion(b'{"prompt": "x", "timeout": 2.5}', BLOCK).timeout == 2.5
    assert parse_completion(rb'{"prompt": "x", "stop": ["ab", "\u00e9"]}', BLOCK).requests[0].stop == (b"ab", "é".encode())
    for body, says in [('{"prompt": "x", "stream": 1}', "stream must be true or false"),
                       ('{"prompt": "x", "max_tokens": true}', "max_tokens must be an integer"),
                       ('{"prompt": "x", "seed": -1}', "seed must be an integer from 0 to 2^64 - 1"),
                       ('{"prompt": "x", "timeout": -1}', "timeout must be a number of seconds > 0"),
                       ('{"prompt": "x", "timeout": "1"}', "timeout must be a number of seconds"),
                       ('{"prompt": "x", "seed": 18446744073709551616}', "seed must be an integer from 0"),
                       ('{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "at most 4 non-empty strings"),
                       ('{"prompt": "x", "stop": [""]}', "at most 4 non-empty strings"),
                       ('{"prompt": "x", "stop": [3]}', "at most 4 non-empty strings"),
                       ('{"prompt": "x", "stop": "%s"}' % ("a" * 65), "at most 64 bytes"),
                       ('{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
                       ('{"prompt": "x", "top_p": Infinity}', "Infinity is not a JSON number"),
                       ('{"prompt": "x", "temperature": 1e308}', "temperature must be a number from 0 to 100"),
                       ('{"prompt": "x", "max_tokens": 1000000000000000000}', "max_tokens must be at most"),
                       ('{"prompt": "\\ud800"}', "valid Unicode"),
                       ('{"prompt": [["x"]]}', "prompt must be a string"),
                       ('{"prompt": "x", "top_p": 0}', "top_p"),
                       ('{"prompt": "x", "max_tokens": 4097}', "max_tokens must be at most 4096"),
                       ('"x"', "JSON object"), ("[" * 100000, "not valid JSON")]:
        with pytest.raises(BadRequest, match=re.escape(says)):
            parse_completion(body.encode(), BLOCK)
