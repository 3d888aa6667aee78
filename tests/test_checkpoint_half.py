"""16-bit models in checkpoints: bf16 and fp16 parameters saved as they are (bf16 as its uint16 words, the
index naming it), the optimizer's fp32 masters and moments beside them, and both loaded bit for bit at
another tensor-parallel size (1-4 ranks save; the serial model loads)."""
import h5py
import numpy as np
import pytest
from test_checkpoint import CFG, meta, shared_dir  # noqa: F401 (the fixture)

from mpi_tp import checkpoint as ck
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_parameters_and_fp32_masters_round_trip_at_any_layout(world, shared_dir, dtype):  # noqa: F811
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    topo = Topology.create(world)
    model = GPT(GPTConfig(**CFG), topo, dtype=dt, seed=5)
    opt = AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(2):                                      # two steps: the masters move off the parameters
        x = rng.integers(0, 37, (3, 8))
        assert train_step(model, opt, x, x, slice(0, 3))[2] is None
    ck.save(shared_dir, 2, model, opt, meta(model, opt))
    serial = Topology.serial()
    ref = GPT(GPTConfig(**CFG), serial, dtype=dt, seed=0)
    ref_opt = AdamW(ref.parameters(), lr=1e-2)
    with ck.Checkpoint(shared_dir) as c:
        ck.load_into(c, ref, ref_opt)
        kind = c.tensors["model/wte"]["dtype"]
        shard = c.dir + "/" + c.shards[0]["file"]
    assert kind == ("bfloat16" if dtype == "bfloat16" else "<f2")
    with h5py.File(shard) as f:
        assert f["model/wte"].dtype == (np.uint16 if dtype == "bfloat16" else np.float16)   # 2 bytes a value
    mine, whole = opt.state_tensors(), ref_opt.state_tensors()
    assert set(mine) == {"m", "v", "master"} and all(a.dtype == np.float32 for a in whole["master"])
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        assert q.data.dtype == dt and np.array_equal(q.data[p.index()].view(np.uint16), p.data.view(np.uint16))
        for k in mine:
            assert np.array_equal(whole[k][i][p.index()], mine[k][i]), f"optim/{k}/{p.name}"
    serial.free()
    topo.free()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_16_bit_model_from_an_fp32_checkpoint_takes_its_weights_as_masters(world, shared_dir, with_optimizer):  # noqa: F811
    """A bf16 run started from an fp32 checkpoint (--init-from): the masters are the checkpoint's fp32
    weights exactly (not the bf16 parameters widened, and not this model's random start), the moments the
    checkpoint's, or fresh zeros from a checkpoint without optimizer state (an import)."""
    topo = Topology.create(world)
    model = GPT(GPTConfig(**CFG), topo, dtype="float32", seed=5)
    opt = AdamW(model.parameters(), lr=1e-2)
    x = np.random.default_rng(0).integers(0, 37, (3, 8))
    assert train_step(model, opt, x, x, slice(0, 3))[2] is None
    ck.save(shared_dir, 1, model, opt if with_optimizer else None, meta(model, opt))
    serial = Topology.serial()
    wide = GPT(GPTConfig(**CFG), serial, dtype="float32", seed=0)
    wide_opt = AdamW(wide.parameters(), lr=1e-2)
    half = GPT(GPTConfig(**CFG), serial, dtype=np.dtype(ml_dtypes.bfloat16), seed=0)
    half_opt = AdamW(half.parameters(), lr=1e-2)
    with ck.Checkpoint(shared_dir) as c:
        ck.load_into(c, wide, wide_opt)
        ck.load_into(c, half, half_opt)
    masters = half_opt.state_tensors()["master"]
    for p, w, m in zip(half.parameters(), wide.parameters(), masters):
        assert m.dtype == np.float32 and np.array_equal(m, w.data), p.name
        assert np.array_equal(p.data, w.data.astype(p.data.dtype)), p.name          # rounded once
    for kind in ("m", "v"):
        for a, b in zip(half_opt.state_tensors()[kind], wide_opt.state_tensors()[kind]):
            assert np.array_equal(a, b) and (with_optimizer or not a.any())
    assert half_opt.t == (1 if with_optimizer else 0)
