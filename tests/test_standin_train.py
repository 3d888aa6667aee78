"""Training on the CuPy stand-in (mpi_tp.core.standin) against NumPy on the same weights, and what a step costs.

    python -m pytest -q --with-mpi tests/test_standin_train.py
    mpiexec -n 2 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_standin_train.py

Every layout trains 3 steps through the training loop's own build() and run_step() (float64,
dropout on), once on NumPy and once on the stand-in, MPI not CUDA-aware (every buffer staged
through pinned host buffers): losses and weights must agree to 1e-12 (they are bitwise equal),
and a checkpoint saved and resumed on the stand-in must equal the uninterrupted NumPy run. The
counters then hold the GPU path to budgets (issue 21's findings 2, 5, 6 and 7; each of these tests
failed, as an xfail(strict=True), until its fix landed). The slice runs at 1 and 2 ranks.
"""
import gc
import os

import h5py
import numpy
import pytest
from mpi4py import MPI

from mpi_tp import checkpoint as ck
from mpi_tp.core import backend, blas, standin
from mpi_tp.core.testing import all_true, max_rel_diff
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.fsdp import whole_params
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.build import build
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.loop import run_step, train
from mpi_tp.training.optim import AdamW

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.mpi(min_size=1)
if WORLD.Get_size() > 2:
    pytest.skip("the stand-in slice runs at 1 and 2 ranks", allow_module_level=True)
BASE = dict(n_layer=2, n_head=5, n_embd=20, block_size=8, batch_size=2, dtype="float64", dropout=0.1, steps=3,
            sample_len=0, warmup=0, lr=1e-2, bucket_mb=0.001, eval_batches=1)     # tiny buckets: several per step
MOE = dict(moe_experts=3, moe_top_k=2, moe_capacity=1.0)
LLAMA = dict(arch="llama", n_kv_head=1, intermediate_size=44)        # at tp = 2: the kv head replicated
LAYOUTS = {1: {"serial": {}, "moe": MOE, "llama": LLAMA},
           2: {"tp2-sp": dict(tp=2, sequence_parallel=True), "dp2-overlap": dict(dp=2),
               "dp2-zero1": dict(dp=2, zero=1), "dp2-zero2": dict(dp=2, zero=2), "dp2-zero3": dict(dp=2, zero=3),
               "pp2-1f1b": dict(pp=2, micro_batches=2),
               "moe-ep2": dict(dp=2, ep=2, **MOE), "llama-tp2-sp": dict(tp=2, sequence_parallel=True, **LLAMA)}
           }.get(WORLD.Get_size(), {})
STAGING = ("core/gpu.py", "parallel/buffers.py", "parallel/collectives.py")   # syncs MPI staging needs


@pytest.fixture
def out(tmp_path, monkeypatch, world):
    """A folder every rank sees (rank 0's tmp_path); the stand-in on call, staging through host buffers.
    The NumPy runs multiply with NumPy's own BLAS (MPI_TP_BLAS=numpy), as the stand-in does, so that the
    two sides do the same arithmetic and their bits can be compared (MKL, where mpi_tp.core.blas picks
    it, sums in another order)."""
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "0")
    monkeypatch.setenv("MPI_TP_BLAS", "numpy")
    monkeypatch.setattr(blas, "_mkl", None)
    yield world.bcast(str(tmp_path) if world.Get_rank() == 0 else None)
    backend.use("numpy")


def run_steps(where, name, layout, steps=3, **more):
    """(losses, this rank's weights, the counters of the last step) after `steps` training steps."""
    cfg = TrainConfig(**{**BASE, **layout, **more}, backend=name, out=os.path.join(where, f"{name}-{steps}"))
    run = build(cfg, WORLD)
    try:
        losses = []
        for step in range(1, steps + 1):
            standin.counters.reset()
            losses.append(run_step(run, step, cfg.lr)[0])
        counted = standin.counters.snapshot()
        with whole_params(run.model):           # ZeRO-3: gathered
            weights = {p.name: backend.asnumpy(p.data).copy() for p in run.model.parameters()}
        assert backend.stager().lent == 0, "a staging buffer was not given back"
        return numpy.array(losses), weights, counted
    finally:
        run.close()


def worst(got: dict, want: dict) -> float:
    return max((max_rel_diff(got[k], want[k]) for k in want), default=0.0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_on_the_standin_equals_numpy(out, layout):
    want_losses, want, _ = run_steps(out, "numpy", LAYOUTS[layout])
    losses, got, counted = run_steps(out, "cupy", LAYOUTS[layout])
    err = max(max_rel_diff(losses, want_losses), worst(got, want))
    assert all_true(err <= 1e-12 and got.keys() == want.keys(), WORLD), f"{layout}: max relative difference {err:.2e}"
    assert counted["mpi_device_buffers"] == 0                      # every MPI buffer was staged ...
    staged = counted["pinned_allocs"] + sum(n for s, n in counted["sync_sites"].items() if s.startswith(STAGING))
    assert all_true(staged > 0, WORLD) == (WORLD.Get_size() > 1)   # ... through host buffers, when there was MPI


def saved(where: str, step: int) -> dict:
    """The model and optimizer tensors of a run's checkpoint of `step`, whole (rank 0 reads them)."""
    path = ck.resolve(os.path.join(where, "checkpoints", ck.step_dir_name(step)))
    with h5py.File(os.path.join(path, "index.h5"), "r") as f:
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) and n.startswith(("model/", "optim/"))
                else None)
        return {n: f[n][...] for n in names}


def test_checkpoint_saved_and_resumed_on_the_standin(out, monkeypatch):
    """On the stand-in, pre-empted after step 2 (SIGTERM: saved), then --resume to step 3: the uninterrupted
    NumPy run's step 3, weights and AdamW moments (ZeRO-1's shares, gathered to save, at 2 ranks)."""
    cfg = {**BASE, **(dict(dp=2, zero=1) if WORLD.Get_size() == 2 else {})}
    train(TrainConfig(**cfg, backend="numpy", out=os.path.join(out, "numpy")), WORLD)
    gpu = os.path.join(out, "cupy")
    monkeypatch.setenv("MPI_TP_FAILPOINT", "sigterm:2")
    assert train(TrainConfig(**cfg, backend="cupy", out=gpu), WORLD)["preempted_at"] == 2
    monkeypatch.delenv("MPI_TP_FAILPOINT")
    train(TrainConfig(**cfg, backend="cupy", out=gpu, resume=True), WORLD)
    bad = {}
    if WORLD.Get_rank() == 0:
        want, got = saved(os.path.join(out, "numpy"), 3), saved(gpu, 3)
        assert got.keys() == want.keys() and any(n.startswith("optim/") for n in want)
        bad = {n: max_rel_diff(got[n], want[n]) for n in want if not max_rel_diff(got[n], want[n]) <= 1e-12}
    assert all_true(not bad, WORLD), bad


def step_syncs(where, layout, n_layer) -> tuple[int, dict]:
    """Host syncs of the second training step outside MPI staging, and where they happened."""
    _, _, counted = run_steps(where, "cupy", layout, steps=2, n_layer=n_layer)
    sites = {s: n for s, n in counted["sync_sites"].items() if not s.startswith(STAGING)}
    return sum(sites.values()), sites


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_host_syncs_per_step_do_not_grow_with_the_layers(out, arch):
    """Syncs outside MPI staging at L and 2L blocks: the same count (staging syncs once per collective).
    Issue 21, finding 7: the gradient norm read one float per parameter storage back."""
    layout = {**LAYOUTS.get("tp2-sp", {}), **(LLAMA if arch == "llama" else {})}
    (few, at_l), (many, at_2l) = step_syncs(out, layout, 2), step_syncs(out, layout, 4)
    assert all_true(many == few, WORLD), f"{few} syncs at L = 2 ({at_l}), {many} at L = 4 ({at_2l})"


def test_adamw_is_a_few_kernels_per_segment_and_no_sync(out):
    """Issue 21, finding 7: AdamW launched about 13 kernels per parameter storage; now one fused update and
    its three copies back (p, m, v), whatever the layers, and no host sync."""
    backend.use("cupy", WORLD)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20), Topology.create(WORLD),
                dtype="float64", seed=2)
    opt = AdamW(model.parameters(), lr=1e-2)
    x = numpy.random.default_rng(0).integers(0, 37, (2, 8))
    model.forward(x, x)
    model.backward()
    standin.counters.reset()
    opt.step(grad_scale=0.5)
    segments = sum(len(s.segments) for s in opt.spaces)
    per = standin.counters.kernels / segments
    assert all_true(per <= 4 and standin.counters.syncs == 0, WORLD), (per, dict(standin.counters.kernel_names))


def test_at_most_one_host_sync_per_moe_layer(out):
    """Dropless dispatch needs its counts on the host (MPI's Alltoallv takes host counts): one sync per MoE
    layer and step at most, counted in model/moe.py and parallel/expert_parallel.py at L and 2L."""
    layout = dict(MOE, moe_capacity=0.0, **(dict(dp=2, ep=2) if WORLD.Get_size() == 2 else {}))
    counts = []
    for n_layer in (2, 4):
        _, sites = step_syncs(out, layout, n_layer)
        counts.append(sum(n for s, n in sites.items() if s.startswith(("model/moe.py", "parallel/expert_parallel"))))
    assert all_true(counts[1] - counts[0] <= 2, WORLD), f"MoE syncs per step at L = 2 and 4: {counts}"


def test_a_training_step_uses_no_float_atomics(out):
    _, _, counted = run_steps(out, "cupy", LAYOUTS[sorted(LAYOUTS)[0]], steps=1)
    assert all_true(counted["atomics"] == 0, WORLD), counted["atomic_sites"]


@pytest.mark.mpi(min_size=2)
def test_starting_a_bucket_does_not_wait_for_the_gpu(out):
    """Issue 21, finding 6: the buckets' staging copies waited for the GPU inside block_done (and
    Pending.test), in the middle of the backward pass."""
    _, _, counted = run_steps(out, "cupy", LAYOUTS["dp2-overlap"], steps=1)
    waits = {s: n for s, n in counted["sync_stacks"].items()
             if "data_parallel.py:block_done" in s or "buffers.py:test" in s}
    assert all_true(not waits, WORLD), waits


def pinned_held(world, batches) -> int:
    """Pinned bytes a fresh stager holds after an MoE model's forward and backward at each batch size."""
    backend.use("cupy", world)                                    # a fresh Stager, an empty pool
    gc.collect()
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=16, moe_experts=4, moe_top_k=2)
    model = GPT(cfg, Topology.create(world, dp=world.Get_size(), ep=world.Get_size()), dtype="float64", seed=1)
    for B in batches:                                             # the all-to-alls' rows follow B and the routing
        x = numpy.random.default_rng(B).integers(0, 37, (B, 8))
        model.forward(x, x)
        model.backward()
    gc.collect()
    return standin.counters.pinned_live_bytes


@pytest.mark.mpi(min_size=2)
def test_pinned_memory_stays_bounded_under_varying_moe_shapes(out, world):
    """Issue 21, finding 2: the pool kept one pinned buffer per exact (shape, dtype), never freed. Budget:
    after batches of 1 to 12 sequences (in a shuffled order), at most twice the pinned bytes that the
    largest batch alone leaves held."""
    largest = pinned_held(world, [12])
    varied = pinned_held(world, list(numpy.random.default_rng(0).permutation(numpy.arange(1, 13))))
    assert all_true(varied <= 2 * largest, WORLD), f"{varied} pinned bytes held, {largest} for the largest batch"
