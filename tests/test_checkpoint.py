"""Checkpoints in-process at the suite's world size: any-layout loading, the virtual full view,
bitwise resume, and clear collective errors for damaged or mismatched checkpoints."""
import json
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpi_tp import checkpoint as ck
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup
from mpi_tp.core.testing import all_true, gather_full, randomize
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=1)
CFG = dict(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20)   # uneven at 2, 3 and 4 ranks


@pytest.fixture
def shared_dir(world):
    """One temporary folder that every rank sees (rank 0 makes it and removes it)."""
    path = world.bcast(tempfile.mkdtemp(prefix="mpi_tp_ckpt_") if world.Get_rank() == 0 else None)
    yield path
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def batch(seed, B=3, T=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 37, (B, T)), rng.integers(0, 37, (B, T))


def trained(topo, steps=2, dropout=0.0):
    model = GPT(GPTConfig(**CFG, dropout=dropout), topo, dtype="float64", seed=5)
    randomize(model, std=0.1)
    opt = AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        model.zero_grad()
        model.forward(*batch(s))
        model.backward()
        opt.step()
    return model, opt


def meta(model, opt):
    return {"config": model.cfg.to_dict(), "optimizer_t": opt.t, "rng": ck.rng_state(model)}


def test_load_at_every_smaller_size(world, shared_dir):
    topo = Topology.create(world)
    model, opt = trained(topo)
    ck.save(shared_dir, 2, model, opt, meta(model, opt))
    x, _ = batch(9)
    # the serial reference holds the trained weights, gathered in memory (no checkpoint code), and every
    # model below starts from another seed: whatever they hold after loading came from the disk
    ref = GPT(GPTConfig(**CFG), Topology.serial(), dtype="float64", seed=998)
    trained_full = {p.name: gather_full(p, world) for p in model.parameters()}
    moments = {p.name: gather_full(type(p)(p.name, m, p.global_shape, p.axis, p.start, p.stop), world)
               for p, m in zip(opt.params, opt.state_tensors()["m"])}
    for p in ref.parameters():
        p.data[...] = trained_full[p.name]
    ref_logits = ref.forward(x)
    for k in range(1, world.Get_size() + 1):
        sub = world.Split(0 if world.Get_rank() < k else MPI.UNDEFINED, world.Get_rank())
        ok = True
        if sub != MPI.COMM_NULL:
            m = GPT(GPTConfig(**CFG), Topology.create(sub), dtype="float64", seed=999)
            o = AdamW(m.parameters())
            with ck.Checkpoint(shared_dir) as c:
                ck.load_into(c, m, o)
            assert o.t == 2
            logits = m.full_logits(x)
            ok = np.abs(logits - ref_logits).max() <= 1e-12 * np.abs(ref_logits).max()
            ok &= all(np.array_equal(p.data, trained_full[p.name][p.index()]) for p in m.parameters())
            ok &= all(np.array_equal(v, moments[p.name][p.index()])
                      for p, v in zip(o.params, o.state_tensors()["m"]))
            sub.Free()
        assert all_true(ok, world), f"loading at tp={k} differs from the serial model"


def test_virtual_view_equals_gathered_model(world, shared_dir):
    model, opt = trained(Topology.create(world))
    step_dir = ck.save(shared_dir, 7, model, opt, meta(model, opt))
    full = {p.name: gather_full(p, world) for p in model.parameters()}
    moments = {p.name: gather_full(type(p)(p.name, m, p.global_shape, p.axis, p.start, p.stop), world)
               for p, m in zip(opt.params, opt.state_tensors()["m"])}
    ok = True
    if world.Get_rank() == 0:
        with h5py.File(os.path.join(step_dir, "index.h5"), "r") as f:   # plain h5py, no mpi_tp code
            assert json.loads(f.attrs["config"])["n_head"] == 5 and int(f.attrs["format_version"]) == 1
            ok = all(np.array_equal(f["model/" + n][...], v) for n, v in full.items())
            ok &= all(np.array_equal(f["optim/m/" + n][...], v) for n, v in moments.items())
            assert f["model/h/0/attn/q/weight"].shape == (20, 20)
    assert all_true(ok, world), "the virtual datasets differ from the gathered model"


def test_resume_is_bitwise(world, shared_dir):
    topo = Topology.create(world)

    def run(model, opt, steps):
        losses = []
        for s in steps:
            model.zero_grad()
            losses.append(model.forward(*batch(100 + s)))
            model.backward()
            opt.step()
        return losses

    a, oa = trained(topo, steps=0, dropout=0.2)
    straight = run(a, oa, range(6))
    b, ob = trained(topo, steps=0, dropout=0.2)
    first = run(b, ob, range(3))
    ck.save(shared_dir, 3, b, ob, meta(b, ob))
    c = GPT(GPTConfig(**CFG, dropout=0.2), topo, dtype="float64", seed=999)   # other init: all must come from disk
    oc = AdamW(c.parameters(), lr=1e-2)
    with ck.Checkpoint(shared_dir) as cp:
        ck.load_into(cp, c, oc)
        ck.restore_rng(cp, c)
    resumed = first + run(c, oc, range(3, 6))
    assert straight == resumed                                   # bitwise, not approximately
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), c.parameters()))


def _flip_byte_in_data(path):
    with h5py.File(path, "r") as f:
        offset = f["model/wte"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        b = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([b[0] ^ 0x10]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _set_version(path):
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 99


def _shard0(step_dir, tp):
    return os.path.join(step_dir, ck.shard_name(0, tp))


@pytest.mark.parametrize("damage,message", [
    (lambda d, tp: _flip_byte_in_data(_shard0(d, tp)), "damaged"),
    (lambda d, tp: _truncate(_shard0(d, tp)), "truncated"),
    (lambda d, tp: os.remove(_shard0(d, tp)), "missing"),
    (lambda d, tp: _set_version(os.path.join(d, "index.h5")), "format version 99"),
], ids=["bit-flip", "truncated", "missing-shard", "wrong-version"])
def test_damaged_checkpoint_is_one_clear_error(world, shared_dir, damage, message):
    model, opt = trained(Topology.create(world), steps=1)
    step_dir = ck.save(shared_dir, 1, model, opt, meta(model, opt))
    if world.Get_rank() == 0:
        damage(step_dir, world.Get_size())
    world.Barrier()
    fresh = GPT(GPTConfig(**CFG), Topology.create(world), dtype="float64")

    def load():
        with ck.Checkpoint(shared_dir) as c:
            ck.load_into(c, fresh)
    with pytest.raises(UserError, match=message):     # raised on every rank: nobody is left waiting
        collective_setup(load, comm=world)


def test_config_mismatch(world, shared_dir):
    model, opt = trained(Topology.create(world), steps=1)
    ck.save(shared_dir, 1, model, opt, meta(model, opt))
    other = GPT(GPTConfig(**dict(CFG, n_layer=1)), Topology.create(world), dtype="float64")

    def load():
        with ck.Checkpoint(shared_dir) as c:
            ck.load_into(c, other)
    with pytest.raises(UserError, match="different model .*n_layer: checkpoint 2 vs model 1"):
        collective_setup(load, comm=world)


def test_keep_deletes_only_older_complete_steps(world, shared_dir):
    model, opt = trained(Topology.create(world), steps=1)
    for step in (1, 2, 3, 4):
        ck.save(shared_dir, step, model, opt, meta(model, opt), keep=2)
    assert ck.complete_steps(shared_dir) == [3, 4]
    with open(os.path.join(shared_dir, "latest")) as f:
        assert f.read().strip() == "step-00000004"
    assert not [n for n in os.listdir(shared_dir) if n.startswith(".")]    # no temporary debris
    world.Barrier()


def test_keep_never_deletes_the_step_just_written(world, shared_dir):
    """Continuing from an earlier step into a folder that holds later ones (--init-from)."""
    model, opt = trained(Topology.create(world), steps=1)
    for step in (5, 6, 2):
        ck.save(shared_dir, step, model, opt, meta(model, opt), keep=2)
    assert ck.complete_steps(shared_dir) == [2, 6]
    with ck.Checkpoint(shared_dir) as c:
        assert c.step == 2                                   # latest names what was just saved


def test_resave_and_debris(world, shared_dir):
    model, opt = trained(Topology.create(world), steps=1)
    ck.save(shared_dir, 3, model, opt, meta(model, opt))
    if world.Get_rank() == 0:   # what a crash mid-resave leaves: the step moved aside, a stale temp folder
        os.rename(os.path.join(shared_dir, "step-00000003"), os.path.join(shared_dir, "step-00000003.old"))
        os.makedirs(os.path.join(shared_dir, ".step-00000009.tmp"))
    world.Barrier()
    ck.save(shared_dir, 4, model, opt, meta(model, opt))
    assert ck.complete_steps(shared_dir) == [3, 4]           # the moved-aside step was put back
    assert sorted(os.listdir(shared_dir)) == ["latest", "step-00000003", "step-00000004"]
    world.Barrier()                                          # everyone has looked before the next save
    ck.save(shared_dir, 4, model, opt, meta(model, opt))    # re-saving a step replaces it
    assert sorted(os.listdir(shared_dir)) == ["latest", "step-00000003", "step-00000004"]
