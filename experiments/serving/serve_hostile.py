"""The hostile mix against `mpi-tp serve`: bad bodies, odd numbers and headers, slow and vanishing clients
(streaming or not), a burst, deadlines.

    python experiments/serving/serve_hostile.py                      # trains a small model first (about 5 s)
    python experiments/serving/serve_hostile.py --checkpoint C       # about 2 minutes

One 2-rank server (`--max-batch 4`; `--max-queue 4 --read-timeout 10` where serve has them) gets each case
in turn, then a good request (greedy, 8 tokens: 200; after the clients that left, within 2 s: their rows
must stop rather than run to their 2000 tokens) and GET /health (200). A second one, the same with
`--request-timeout 1` where serve has it, gets the cases of a server-wide deadline. A case passes when
its answer is one of the expected ones, both checks pass and the server still runs. A server that died
(or stopped answering) is reported so and restarted for the next case; every socket operation has a
timeout, so no case hangs (the clients' acts: hostile_clients.py). Writes
experiments/serving/results/serve_hostile.md (a table) and serve_hostile.jsonl (one line per case, then
one with the machine, the command, every good request answered or not, and each server's flags, RSS at
its start and end, restarts and whether it ran to the end). Also run by serve_load.py after its load part.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import serve_harness as sl
from hostile_clients import (
    abandon,
    burst,
    disconnect,
    error_of,
    post,
    raw,
    slow_sender,
)
from hostile_deadlines import deadline, outlives, queued_deadline

OUT = os.path.join(sl.HERE, "results", "serve_hostile")
GOOD = {"prompt": "The ", "max_tokens": 8, "temperature": 0}
MAX_BATCH, QUEUE, REQUEST_TIMEOUT = 4, 4, 1.0


class Case(NamedTuple):
    name: str
    sent: str
    expected: str
    act: Callable                      # server -> (answer, detail, as expected)
    good_within: float | None = None   # seconds the good request after it may take (rows it left must be freed)


def send(body, expected, length=None, extra=b""):
    """An act: these bytes on a raw socket; as expected when the status is one of `expected`."""
    def act(server):
        status, _, answer = raw(server, post(body, length, extra))
        kind, message = error_of(answer)
        if kind is None:               # not an error: the completion's text
            with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
                message = "text " + json.dumps(json.loads(answer)["choices"][0]["text"])
        return status, message if len(message) < 100 else message[:97] + "...", status in expected
    return act


def cases(has_queue, slow_seconds):
    """The first server's cases, in order."""
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    return [Case(*c) for c in [
        ("malformed JSON", '{"prompt": "a",', "400", send(b'{"prompt": "a",', {400})),
        ("a JSON array", '[{"prompt": "a"}]', "400", send(b'[{"prompt": "a"}]', {400})),
        ("prompt 3", '{"prompt": 3}', "400", send({"prompt": 3}, {400})),
        ('max_tokens "x"', '{"prompt": "a", "max_tokens": "x"}', "400",
         send({"prompt": "a", "max_tokens": "x"}, {400})),
        ('stream "yes"', '{"prompt": "a", "stream": "yes"}', "400", send({"prompt": "a", "stream": "yes"}, {400})),
        ("temperature NaN", '{"prompt":"a","temperature":NaN} (raw bytes)', "400",
         send(b'{"prompt":"a","temperature":NaN}', {400})),
        ("temperature 1e-320", "a subnormal temperature, max_tokens 4", "200 or 400",
         send({"prompt": "a", "temperature": 1e-320, "max_tokens": 4}, {200, 400})),
        ("temperature 1e308", "max_tokens 4", "200 or 400",
         send({"prompt": "a", "temperature": 1e308, "max_tokens": 4}, {200, 400})),
        ("temperature -1", '{"prompt": "a", "temperature": -1}', "400",
         send({"prompt": "a", "temperature": -1}, {400})),
        ("max_tokens 10**18", '{"prompt": "a", "max_tokens": 10**18}', "400",
         send({"prompt": "a", "max_tokens": 10**18}, {400})),
        ("2 MB body", f"Content-Length {len(big)} and the bytes", "413", send(big, {413})),
        ("Content-Length ²", "the byte 0xB2 (latin-1 '²': str.isdigit accepts it)", "400 or 411",
         send(b'{"prompt": "a"}', {400, 411}, b"\xb2")),
        ("Content-Length -5", "a 15-byte body", "400 or 411", send(b'{"prompt": "a"}', {400, 411}, b"-5")),
        ("1 MB stop", "stop: 1,000,000 x 'x', max_tokens 16", "200, 400 or 413",
         send({"prompt": "a", "max_tokens": 16, "stop": "x" * 1_000_000}, {200, 400, 413})),
        ("100 stops", "stop: a list of 100 strings", "400",
         send({"prompt": "a", "stop": [f"s{i}" for i in range(100)]}, {400})),
        ("slow sender", f"headers at 1 byte/s for up to {slow_seconds:.0f} s", "closed (or 408)",
         lambda s: slow_sender(s, slow_seconds)),
        ("disconnect mid-stream", "a 2000-token stream: 2 events read, then the socket closed",
         "running rows 0 within 5 s; the good request within 2 s (the abandoned row stops)", disconnect, 2.0),
        ("disconnects, not streamed", f"{MAX_BATCH + 2} requests for 2000 tokens each, not streamed: "
         f"{MAX_BATCH} (every row), then 2 queued; every socket closed 0.3 s later",
         f"cancelled +{MAX_BATCH + 2} and 499 +{MAX_BATCH + 2}, none refused; no row running or queued within "
         "5 s; fewer tokens in all than 2000; the good request within 2 s", lambda s: abandon(s, MAX_BATCH, 2), 2.0),
        ("deadline, not streamed", '2000 tokens, "timeout": 0.5',
         "504 of type timeout naming the 0.5 s deadline within 2.5 s; deadlines_total +1",
         lambda s: deadline(s, False, 0.5), 2.0),
        ("deadline, streamed", '2000 tokens, "timeout": 0.5, "stream": true',
         "text events, then an error event of type timeout naming the 0.5 s deadline, then [DONE], within "
         "2.5 s; deadlines_total +1", lambda s: deadline(s, True, 0.5), 2.0),
        ("deadline in the queue", f"{MAX_BATCH} requests for 2000 tokens with \"timeout\": 1.5 (every row), then "
         'one with "timeout": 0.3', "504 after 0 tokens for the queued one within 1.3 s, then 504 x "
         f"{MAX_BATCH}; deadlines_total +{MAX_BATCH + 1}", lambda s: queued_deadline(s, MAX_BATCH), 2.0),
        ("burst", f"{3 * QUEUE} requests at once, 64 tokens each (3 x max-queue {QUEUE}"
         + ("" if has_queue else ": serve has none") + ")",
         "200s and some 429s, each with Retry-After", lambda s: burst(s, 3 * QUEUE)),
    ]]

def timed_cases():
    """The cases of a server started with --request-timeout (REQUEST_TIMEOUT seconds)."""
    t = f"{REQUEST_TIMEOUT:g}"
    return [
        Case("--request-timeout, not streamed", "2000 tokens, no timeout field",
             f"504 of type timeout naming the server's {t} s deadline; deadlines_total +1",
             lambda s: deadline(s, False, None, expect=REQUEST_TIMEOUT), 2.0),
        Case("--request-timeout, streamed", "2000 tokens streamed, no timeout field",
             f"text events, then an error event of type timeout naming the {t} s deadline, then [DONE]",
             lambda s: deadline(s, True, None, expect=REQUEST_TIMEOUT), 2.0),
        Case("a body's timeout over it", '2000 tokens, "timeout": 60', "200 with all 2000 tokens (past "
             f"the server's {t} s)", lambda s: outlives(s, 60)),
    ]


def after(server):
    """The good request and /health: (good status, its seconds, health status)."""
    t0 = time.perf_counter()
    good = sl.stream_one(server, {**GOOD, "stream": True}, timeout=60)
    seconds = time.perf_counter() - t0
    try:
        health = sl.get(server, "/health")[0]
    except (OSError, http.client.HTTPException) as e:
        health = type(e).__name__
    return good["status"], round(seconds, 2), health


def run(checkpoint, options, logs, slow_seconds=20.0, out=OUT):
    """Every case against its server (the --request-timeout ones against a second), then the report."""
    flags = ["--max-batch", str(MAX_BATCH)] + (["--max-queue", str(QUEUE)] if "--max-queue" in options else [])
    flags += ["--read-timeout", "10"] if "--read-timeout" in options else []     # the slow sender outlasts it
    head, rows = {**sl.stamp(), "servers": []}, []
    rows += run_server(checkpoint, flags, cases("--max-queue" in options, slow_seconds), logs, head["servers"])
    if "--request-timeout" in options:
        timed = flags + ["--request-timeout", f"{REQUEST_TIMEOUT:g}"]
        rows += run_server(checkpoint, timed, timed_cases(), logs, head["servers"])
    else:
        rows += [{"case": c.name, "sent": c.sent, "expected": c.expected, "got": "not run",
                  "detail": "serve has no --request-timeout", "pass": False} for c in timed_cases()]
    head["good"] = [sum(r.get("good") == 200 for r in rows), sum("good" in r for r in rows)]
    head["alive"] = all(s["restarts"] == 0 and s["alive_at_end"] for s in head["servers"])
    write(rows, head, out)
    return rows


def run_server(checkpoint, flags, its_cases, logs, servers):
    """One server through its cases (restarted after a case it did not live through): the table's rows.
    Appends the server's flags, RSS at its start and end, restarts and end to `servers`."""
    server, rows = sl.Server(checkpoint, flags, logs), []
    servers.append(info := {"flags": flags, "rss_start": server.rss(), "restarts": 0})
    try:
        for case in its_cases:
            row = {"case": case.name, "sent": case.sent, "expected": case.expected}
            if server is None:
                rows.append({**row, "got": "not run", "pass": False})
                continue
            try:
                got, detail, ok = case.act(server)
            except Exception as e:  # noqa: BLE001 -- a fault of this script: said in the table, and the next case still runs
                got, detail, ok = "client error", f"{type(e).__name__}: {e}", False
            good, seconds, health = after(server)
            if health != 200:          # a job that is going down: let mpiexec finish, then say which
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.proc.wait(timeout=5)
            state = "up" if server.alive() and health == 200 else "died" if not server.alive() else "not answering"
            ok = ok and good == 200 and health == 200 and state == "up"
            if case.good_within is not None:       # ~0.05 s alone; behind a row run to 2000 tokens 3-8 s here
                ok = ok and seconds < case.good_within
            rows.append({**row, "got": got, "detail": detail, "good": good, "good_s": seconds, "health": health,
                         "server": state, "pass": bool(ok)})
            print(f"{'ok  ' if ok else 'FAIL'} {case.name}: {got} {detail} | good {good} in {seconds} s, "
                  f"/health {health}, server {state}", flush=True)
            if got == 500:             # the server's own word on it
                said = [line for line in server.log_tail(20).splitlines() if "error answering" in line]
                rows[-1]["detail"] += f" (log: {said[-1].split('error answering ', 1)[1]})" if said else ""
            if state != "up":          # the log's last error line in the table, the server's last lines in the JSON
                rows[-1]["log"] = server.log_tail(6)
                errors = [line for line in rows[-1]["log"].splitlines() if "Error" in line or "Abort" in line]
                rows[-1]["detail"] = "; ".join(filter(None, [detail, errors[0].strip() if errors else ""]))
                server.stop()
                server, info["restarts"] = None, info["restarts"] + 1
                print("restarting the server", flush=True)
                with contextlib.suppress(RuntimeError):
                    server = sl.Server(checkpoint, flags, logs)
    finally:
        info.update(rss_end=server.rss() if server else None, alive_at_end=bool(server and server.alive()))
        info["exit"] = server.stop() if server else None
    return rows


def write(rows, head, out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".jsonl", "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
        f.write(json.dumps({"summary": True, **head}) + "\n")

    def mib(r):
        return f"{r['rss_mib']} MiB (peak {r['hwm_mib']})" if r else "-"

    def server(i, s):
        return (f"server {i + 1}: `mpiexec -n 2 ... serve --port 0 {' '.join(s['flags'])}`; RSS of both ranks at "
                f"the start {mib(s['rss_start'])}, at the end {mib(s['rss_end'])}"
                + (f" (of the one started last: {s['restarts']} restart(s))" if s["restarts"] else "")
                + f"; {'alive at the end' if s['alive_at_end'] else 'not alive at the end'}, exit {s['exit']}  ")
    passed, (good, asked) = sum(r["pass"] for r in rows), head["good"]
    lines = [f"# mpi-tp serve: the hostile mix\n\n{head['machine']}; mpi_tp at {head['commit']}; {head['time']}  ",
             f"`{head['command']}`  ", *(server(i, s) for i, s in enumerate(head["servers"])), "",
             "After each case: a good request (streamed, greedy, 8 tokens: 200; within 2 s after the cases whose"
             " clients left or whose deadline passed) and GET /health (200); a server that died is restarted for the"
             " next case. The --request-timeout cases ran against server 2.\n",
             f"{passed} of {len(rows)} cases pass. Every good request answered: "
             f"{'yes' if good == asked else 'no'} ({good} of {asked}). The job alive through every case and at "
             f"the end: {'yes' if head['alive'] else 'no'}.\n",
             "| case | sent | expected | got | detail | then: good request | /health | server | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["case"], r["sent"], r["expected"], r["got"], r.get("detail", ""),
                 f"{r['good']} in {r['good_s']} s" if "good" in r else "", r.get("health", ""),
                 r.get("server", ""), "pass" if r["pass"] else "not run" if r["got"] == "not run" else "**FAIL**"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}.md and .jsonl: {passed} of {len(rows)} cases pass; good requests {good} of {asked}; "
          f"job alive: {head['alive']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a saved model (default: train a small one into a temporary folder)")
    ap.add_argument("--slow-seconds", type=float, default=20, help="the slow sender's bound (default 20)")
    ap.add_argument("--out", default=OUT,
                    help="path without .md / .jsonl (default experiments/serving/results/serve_hostile)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM"))
    with tempfile.TemporaryDirectory(prefix="serve_hostile-") as tmp:
        run(args.checkpoint or sl.train(tmp), sl.serve_options(), tmp, args.slow_seconds, args.out)


if __name__ == "__main__":
    main()
