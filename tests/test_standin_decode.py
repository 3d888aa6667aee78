"""KV-cache decoding (mpi_tp.inference) on the CuPy stand-in against NumPy, and its host traffic per token.

    python -m pytest -q --with-mpi tests/test_standin_decode.py
    mpiexec -n 2 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_standin_decode.py

The tensor-parallel model (T = world size, 5 heads and 37 bytes of vocabulary: uneven at 2) decodes
the same logits at every step, through a window that slides, and generates the same text, greedy and
sampled (GPT-2, Llama, and Mistral's sliding window of 3: its cache a ring, its prefill taking each
row's last columns on the device); each decoded token reads the device back once (its logits) plus, at T > 1, once for the
vocabulary split's mask, whatever the number of layers, and uploads its ids and positions only.
A prefill (and each refill of the sliding window) should not grow with the layers either: it does.
"""
import numpy
import pytest
from mpi4py import MPI

from mpi_tp.core import backend, standin
from mpi_tp.core.testing import all_true
from mpi_tp.inference.decode import Decoder
from mpi_tp.inference.generate import Request, generate
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.mpi(min_size=1)
if WORLD.Get_size() > 2:
    pytest.skip("the stand-in slice runs at 1 and 2 ranks", allow_module_level=True)
STAGING = ("core/gpu.py", "parallel/buffers.py", "parallel/collectives.py")


@pytest.fixture
def standin_env(monkeypatch):
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "0")
    yield
    backend.use("numpy")


LLAMA = dict(arch="llama", n_kv_head=1, intermediate_size=44)        # at tp = 2: the kv head replicated
ARCHS = {"gpt2": {}, "llama": LLAMA, "mistral": dict(LLAMA, sliding_window=3)}   # mistral: a ring of 3 columns


def decode(name: str, n_layer: int = 2, arch: str = "gpt2"):
    """On backend `name`: (logits of the prefill and of 14 steps, generated texts, counters of the plain
    decode steps, counters of the prefill and of the window's refills)."""
    backend.use(name, WORLD)
    cfg = GPTConfig(vocab_size=37, block_size=12, n_layer=n_layer, n_head=5, n_embd=20, **ARCHS[arch])
    model = GPT(cfg, Topology.create(WORLD, tp=WORLD.Get_size()), dtype="float64", seed=3).eval()
    dec = Decoder(model, 3)
    standin.counters.reset()
    logits = [dec.prefill([[1, 2, 3], [4], [5, 6, 7, 8]])]
    steps, refills = [], [standin.counters.snapshot()]
    rng = numpy.random.default_rng(0)
    for _ in range(14):                                  # past block_size: the window slides and refills
        standin.counters.reset()
        before = dec.cache.lengths[:3].copy()
        logits.append(dec.step(rng.integers(0, 37, 3)))
        plain = (dec.cache.lengths[:3] == before + 1).all()       # else some row's window started again
        (steps if plain else refills).append(standin.counters.snapshot())
    texts = generate(model, [Request(bytes([1, 2, 3]), max_tokens=10, temperature=0),
                             Request(bytes([2, 9]), max_tokens=8, temperature=0.9, top_p=0.9, seed=11)])
    return logits, texts, steps, refills


def traffic(counted: list) -> tuple:
    """The distinct counts of syncs and of uploads outside MPI staging, over these steps."""
    syncs = {sum(n for s, n in c["sync_sites"].items() if not s.startswith(STAGING)) for c in counted}
    uploads = {sum(n for s, n in c["upload_sites"].items() if not s.startswith(STAGING)) for c in counted}
    return syncs, uploads


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cached_decoding_on_the_standin_equals_numpy(standin_env, arch):
    want, want_text, _, _ = decode("numpy", arch=arch)
    got, text, steps, refills = decode("cupy", arch=arch)
    err = max(float(numpy.abs(g - w).max()) for g, w in zip(got, want))
    assert all(type(g) is numpy.ndarray for g in got)                 # the decoder hands back host logits
    assert len(steps) > 5 and len(refills) > 2                         # the window slid and refilled
    assert all_true(err <= 1e-12 and text == want_text, WORLD), (err, text, want_text)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_host_traffic_per_decoded_token_does_not_grow_with_the_layers(standin_env, arch):
    per_layers = {L: traffic(decode("cupy", L, arch)[2]) for L in (2, 4)}
    syncs, uploads = per_layers[2]
    ok = per_layers[4] == per_layers[2] and max(syncs) <= 1 + (WORLD.Get_size() > 1) and max(uploads) <= 2
    assert all_true(ok, WORLD), f"syncs and uploads per decoded token at L = 2 and 4: {per_layers}"


def test_host_traffic_per_prefill_does_not_grow_with_the_layers(standin_env):
    per_layers = {L: traffic(decode("cupy", L)[3]) for L in (2, 4)}
    assert all_true(per_layers[4] == per_layers[2], WORLD), f"syncs and uploads per prefill: {per_layers}"
