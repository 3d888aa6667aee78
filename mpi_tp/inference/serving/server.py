"""serve(): a model behind the completions and chat completions APIs, every rank of the tensor-parallel group computing.

Rank 0 listens (http.py), queues and schedules (scheduler.py) and broadcasts one command per decode
step (protocol.py); the other ranks follow those commands. SIGTERM / SIGUSR1 / SIGINT (MPICH's mpiexec
forwards them to every rank; Open MPI's forwards SIGUSR1, and ends the job itself on the others) are
noted in a flag: rank 0 stops taking requests, answers the queued ones 503, finishes
the running rows, says "stop", and every rank exits 0 (the others never die inside a collective).
"""
from __future__ import annotations

import signal
import threading
import time

from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import STOP_SIGNALS, collective_setup
from mpi_tp.inference.decode import Decoder
from mpi_tp.inference.kv_cache import KVCache
from mpi_tp.inference.serving.http import HTTPServer
from mpi_tp.inference.serving.metrics import Metrics
from mpi_tp.inference.serving.protocol import follow
from mpi_tp.inference.serving.scheduler import Scheduler, log
from mpi_tp.text.tokenizer import ByteTokenizer


class Stop:
    """SIGTERM / SIGUSR1 / SIGINT noted in a flag, nothing else (the handler runs between two bytecodes of the
    main thread). SIGUSR1: what Open MPI's mpiexec forwards without ending the job (runtime.STOP_SIGNALS)."""
    requested = None

    def install(self) -> Stop:
        for s in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(s, lambda signum, frame: setattr(self, "requested", signal.Signals(signum).name))
        return self


class App:
    """What the HTTP threads see of the server: the scheduler, the metrics, the model's name (what requests'
    `model` must say) and its chat template (None: chat requests are refused)."""

    def __init__(self, model, comm, name: str, scheduler: Scheduler, metrics: Metrics, stop: Stop,
                 chat_template=None):
        self.name, self.chat_template = name, chat_template
        self.block_size, self.tp, self.created = model.cfg.block_size, comm.Get_size(), int(time.time())
        self.vocab_size, self.tokenizer = model.cfg.vocab_size, scheduler.tokenizer
        self.scheduler, self.metrics, self.stop = scheduler, metrics, stop

    def health(self) -> tuple[int, dict]:
        s = self.scheduler
        up = s.accepting and not self.stop.requested
        return 200 if up else 503, {"status": "ok" if up else "stopping", "tp": self.tp, "model": self.name,
                                    "block_size": self.block_size, "tokenizer": self.tokenizer.kind,
                                    "in_progress": s.active, **s.gauges(),
                                    "batching": s.batching, **s.stats}

    def models(self) -> tuple[int, dict]:
        return 200, {"object": "list", "data": [self.model(self.name)[1]]}

    def model(self, ident: str) -> tuple[int, dict]:
        """GET /v1/models/{ident}: the served model, or 404."""
        if ident != self.name:
            return 404, {"error": {"message": f"no model {ident!r} here: this server serves {self.name!r}",
                                   "type": "invalid_request_error", "code": "model_not_found"}}
        return 200, {"id": self.name, "object": "model", "created": self.created, "owned_by": "mpi_tp",
                     "block_size": self.block_size, "chat": self.chat_template is not None}

    def metrics_text(self, open_connections: int) -> str:
        return self.metrics.render({**self.scheduler.gauges(), "open_connections": open_connections})


def serve(model, comm, name: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          batch_wait_ms: float = 20.0, stop: Stop | None = None, batching: str = "continuous",
          max_queue: int = 64, max_connections: int = 256, read_timeout: float = 30.0, tokenizer=None,
          request_timeout: float = 0.0, chat_template=None) -> int:
    """Serve until SIGTERM / SIGINT; collective over comm (the model's tensor-parallel group).
    name: the model's, as requests name it; tokenizer: the prompts' and answers' (default bytes:
    mpi_tp.text.tokenizer); chat_template: a mpi_tp.text.chat.ChatTemplate (None: no chat)."""
    stop = stop or Stop().install()
    collective_setup(Decoder, model, 1, comm=comm)     # a model the decoder cannot run: say so now
    metrics = Metrics()
    scheduler = Scheduler(model, comm, metrics, stop, max_batch, max_queue, batching, batch_wait_ms,
                          tokenizer or ByteTokenizer())
    app = App(model, comm, name, scheduler, metrics, stop, chat_template)
    app.request_timeout = request_timeout      # seconds a request may take unless it says (0: no limit)

    def bind():
        if comm.Get_rank() != 0:
            return None
        try:
            return HTTPServer((host, port), app, max_connections, read_timeout)
        except OSError as e:
            raise UserError(f"serve: cannot listen on {host}:{port} ({e.strerror or e})") from None
    httpd = collective_setup(bind, comm=comm)
    if comm.Get_rank() != 0:
        follow(model, comm, max_batch)
        return 0
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    where = f"[{host}]" if ":" in host else host
    print(f"serving {name} on http://{where}:{httpd.server_address[1]} (tp={comm.Get_size()})", flush=True)
    log(f"{batching} batching of up to {max_batch} rows; at most {max_queue} waiting, {max_connections} "
        f"connections, {read_timeout:g} s to send a request")
    log(f"{model.dtype.name} weights; the KV cache holds {KVCache.bytes_for(model, max_batch) / 2**20:.2f} MiB per "
        f"rank ({model.dtype.itemsize} bytes a value)")
    scheduler.run()
    log(f"{stop.requested}: stopped after {scheduler.stats['requests_served']} request(s) in "
        f"{scheduler.stats['steps']} step(s)")
    httpd.shutdown()
    httpd.server_close()
    return 0
