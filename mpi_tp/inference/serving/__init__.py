"""Serving a model over HTTP (`mpi-tp serve`), split by concern (docs/inference.md#serving):

    protocol.py    the command rank 0 broadcasts each decode step, and the batch every rank runs
    scheduler.py   rank 0: admission (a bounded queue), continuous or static batching, cancellation
    http.py        rank 0's HTTP layer: requests checked in full, deadlines, a cap on connections
    answer.py      OpenAI's answers (completions, chat, streamed chunks, logprobs), built as tokens come
    metrics.py     GET /metrics in the Prometheus text format
    server.py      serve(): the pieces put together, start and stop
"""
