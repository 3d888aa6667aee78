"""The GPU path (CuPy): equivalence with the NumPy model, host staging and CUDA-aware MPI detection.

Skips without CuPy or a GPU. experiments/gpu/gpu_check.sh runs this file under mpiexec with
several ranks sharing one GPU, with host staging and (when the MPI library supports it)
with device buffers handed to MPI directly. With MPI_TP_CUPY_STANDIN=1 it runs on the host
stand-in for CuPy instead (mpi_tp.core.standin; tests/run.sh's stand-in passes), and never skips.
"""
import os

import numpy as np
import pytest
import steps as steps_helper

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
    if os.environ.get("MPI_TP_CUPY_STANDIN") != "1":       # the stand-in needs neither CuPy nor a GPU
        cupy = pytest.importorskip("cupy")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                pytest.skip("no GPU")
        except cupy.cuda.runtime.CUDARuntimeError:
            pytest.skip("no usable GPU")
    backend.use("cupy", world)
    import cupy
    yield cupy
    backend.use("numpy")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_on_gpu_equals_numpy(world, gpu, arch):
    llama = dict(arch="llama", n_kv_head=1, intermediate_size=44) if arch == "llama" else {}   # kv replicated
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20, dropout=0.1, **llama)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 37, (3, 8)), rng.integers(0, 37, (3, 8))) for _ in range(3)]
    results = []
    for name in ("numpy", "cupy"):
        backend.use(name, world)
        model = GPT(cfg, Topology.create(world), dtype="float64", seed=2, sequence_parallel=name == "cupy")
        opt = AdamW(model.parameters(), lr=1e-2)
        losses = steps_helper.train(model, opt, len(batches), 3, lambda k, rows: batches[k], grad_clip=0)
        results.append((losses, {p.name: gather_full(p, world) for p in model.parameters()}))
    (l_np, w_np), (l_gpu, w_gpu) = results
    assert_close(l_gpu, l_np, 1e-10, "losses, GPU vs CPU")
    for name, w in w_np.items():
        if not name.endswith("attn/k/bias"):
            assert_close(w_gpu[name], w, 1e-9, f"{name}, GPU vs CPU")


def test_collectives_with_device_buffers(world, gpu):
    """Each collective the model uses, on CuPy arrays (uneven shares), equals its NumPy closed form
    element for element (rank r contributes (r + 1) times a known array; integers, so exactly)."""
    from mpi_tp.parallel.collectives import Group
    from mpi_tp.parallel.comm_stats import CommStats
    group = Group(world.Dup(), "tp", CommStats())
    p, r = group.size, group.rank
    total = p * (p + 1) // 2                                   # sum over ranks of (r + 1)

    base = np.arange(1000, dtype=np.float64)                   # [1000]
    x = gpu.asarray(base * (r + 1))
    assert group.all_reduce(x) is x and backend.is_device_array(x)      # in place, still on the device
    assert_close(x, base * total, 0, "all_reduce on device")

    z = gpu.asarray(base * (r + 1))
    assert group.iall_reduce(z).wait() is z and backend.is_device_array(z)
    assert_close(z, base * total, 0, "iall_reduce on device")

    sizes = [1 + q % 2 for q in range(p)]                      # last-axis shares 1, 2, 1, 2, ...
    parts = [np.arange(3 * s, dtype=np.float32).reshape(3, s) + 100 * q for q, s in enumerate(sizes)]
    full = group.all_gather_last(gpu.asarray(parts[r]), sizes)           # (3, s_r) -> (3, sum(sizes))
    assert backend.is_device_array(full)
    assert_close(full, np.concatenate(parts, axis=-1), 0, "all_gather_last on device")

    rows = [2 + q % 2 for q in range(p)]                       # axis-1 shares 2, 3, 2, 3, ...
    y = np.arange(3 * sum(rows) * 4, dtype=np.float64).reshape(3, sum(rows), 4)   # [3, sum(rows), 4]
    mine = group.reduce_scatter(gpu.asarray(y * (r + 1)), rows, axis=1)  # -> (3, rows[r], 4), summed
    lo = sum(rows[:r])
    assert backend.is_device_array(mine)
    assert_close(mine, y[:, lo:lo + rows[r]] * total, 0, "reduce_scatter on device")
    group.comm.Free()
