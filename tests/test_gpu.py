"""The GPU path (CuPy): equivalence with the NumPy model, host staging and CUDA-aware MPI detection.

Skips without CuPy or a GPU. experiments/gpu_check.sh runs this file under mpiexec with
several ranks sharing one GPU, with host staging and (when the MPI library supports it)
with device buffers handed to MPI directly.
"""
import numpy as np
import pytest

from mpi_tp.core import backend
from mpi_tp.core.gpu import cuda_aware_mpi
from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=1)


def test_cuda_awareness_query_answers():
    assert isinstance(cuda_aware_mpi(), bool)      # never raises, whatever the MPI library


@pytest.fixture
def gpu(world):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no usable GPU")
    backend.use("cupy", world)
    yield cupy
    backend.use("numpy")


def test_model_on_gpu_equals_numpy(world, gpu):
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20, dropout=0.1)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 37, (3, 8)), rng.integers(0, 37, (3, 8))) for _ in range(3)]
    results = []
    for name in ("numpy", "cupy"):
        backend.use(name, world)
        model = GPT(cfg, Topology.create(world), dtype="float64", seed=2, sequence_parallel=name == "cupy")
        opt = AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in batches:
            model.zero_grad()
            losses.append(model.forward(x, y))
            model.backward()
            opt.step()
        results.append((np.array(losses), {p.name: gather_full(p, world) for p in model.parameters()}))
    (l_np, w_np), (l_gpu, w_gpu) = results
    assert_close(l_gpu, l_np, 1e-10, "losses, GPU vs CPU")
    for name, w in w_np.items():
        if not name.endswith("attn/k/bias"):
            assert_close(w_gpu[name], w, 1e-9, f"{name}, GPU vs CPU")


def test_collectives_with_device_buffers(world, gpu):
    from mpi_tp.parallel.collectives import CommStats, Group
    group = Group(world.Dup(), "tp", CommStats())
    x = gpu.full(1000, float(group.rank + 1))
    group.all_reduce(x)
    assert float(x[0]) == group.size * (group.size + 1) / 2
    sizes = [2] * group.size
    y = gpu.arange(6, dtype=gpu.float32).reshape(3, 2) + group.rank
    full = group.all_gather_last(y, sizes)
    assert full.shape == (3, 2 * group.size) and backend.is_device_array(full)
