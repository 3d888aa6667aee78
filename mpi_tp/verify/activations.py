"""Each layer's output, recorded per micro-batch, and the parallel rank's part of the serial one.

A recorder wraps the embedding's and every block's `forward` on one model (attributes of those instances
only; the model's code is unchanged) and keeps, for the step being verified, each output by (layer, the
micro-batch's first row in the global batch): the pass (mpi_tp.model.forward_pass.Pass) says which rows
and positions of the serial tensor a rank's output holds: rows [row0, row0 + B), positions this rank's
context-parallel chunks (Pass.cp) and, within them, its sequence-parallel share (Pass.sp). A recomputed
forward (--recompute full) runs the block's inner forward and is not recorded twice.
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend


def layer_names(n_layer: int) -> list[str]:
    """The layers in the order the forward pass runs them."""
    return ["embedding"] + [f"h/{i}" for i in range(n_layer)]


class Recorder:
    """The outputs of one model's layers during one step: {(layer, row0): (output on the host, pass)}."""

    def __init__(self, chunks):
        self.outputs = {}
        for chunk in chunks:
            if chunk.first:
                self._wrap(chunk.embedding, "embedding")
            for block in chunk.h:
                self._wrap(block, f"h/{block.i}")

    def _wrap(self, module, layer: str) -> None:
        inner = module.forward

        def forward(x, ps, *args, **kwargs):
            out = inner(x, ps, *args, **kwargs)
            self.outputs.setdefault((layer, ps.row0), (backend.asnumpy(out).astype(numpy.float64), ps))
            return out
        module.forward = forward

    def clear(self) -> None:
        self.outputs.clear()


def positions_of(ps) -> numpy.ndarray:
    """The global positions, in local order, of the activations a rank holds in pass ps."""
    local = ps.sp.positions if ps.sp is not None else slice(0, ps.local)
    if ps.cp is None:
        return numpy.arange(local.start, local.stop)
    return numpy.concatenate([numpy.arange(a, b) for a, b in ps.cp.global_runs(local)])


def layer_errors(parallel: Recorder, serial: Recorder, layers: list[str]) -> numpy.ndarray:
    """Per layer (in `layers` order): the largest error of this rank's outputs against the serial ones,
    max |got - want| / max |want| over its micro-batches; -1 where this rank ran no such layer."""
    errors = numpy.full(len(layers), -1.0)
    whole = {layer: out for (layer, _), (out, _) in serial.outputs.items()}      # one pass: row0 = 0
    for (layer, row0), (got, ps) in parallel.outputs.items():
        want = whole[layer][row0:row0 + got.shape[0]][:, positions_of(ps)]
        scale = float(numpy.abs(want).max()) or 1.0
        k = layers.index(layer)
        errors[k] = max(errors[k], float(numpy.abs(got - want).max()) / scale)
    return errors
