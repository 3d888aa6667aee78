"""Sampling from a tensor-parallel model gives the serial model's text, also under sequence parallelism
with more ranks than context bytes (some ranks then hold no position at all), and the serial model's text
is the one its seed draws (a reference built from full_logits and a generator of that seed)."""
import numpy
import pytest
from decoding import full_last

from mpi_tp.core.testing import all_true
from mpi_tp.inference.generate import Request, choose
from mpi_tp.inference.sampling import sample
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=4, n_embd=16)


def drawn(model, prompt: bytes, n_new: int, seed: int) -> bytes:
    """The reference: n_new bytes at temperature 1, each from the full forward pass of the context (cropped
    to block_size) by a generator seeded with seed; an empty prompt starts from a newline, as sample's does."""
    rng, tokens = numpy.random.default_rng(seed), list(prompt) or [ord("\n")]
    for _ in range(n_new):
        tokens.append(choose(full_last(model, tokens), Request(b"x", temperature=1.0), rng))
    return bytes(tokens)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("prompt", [b"", b"\x05", b"\x01\x02\x03\x04\x05\x06\x07\x08\x09"])
def test_sample_equals_serial(world, sequence_parallel, prompt):
    serial = GPT(CFG, Topology.serial(), dtype="float64", seed=4)
    want = sample(serial, prompt, 6, temperature=1.0, seed=2)
    assert want == drawn(serial, prompt, 6, seed=2) != drawn(serial, prompt, 6, seed=3)
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(CFG, topo, dtype="float64", seed=4, sequence_parallel=sequence_parallel)
    got = sample(model, prompt, 6, temperature=1.0, seed=2)
    assert all_true(got == want, world), (got, want)
    topo.free()
