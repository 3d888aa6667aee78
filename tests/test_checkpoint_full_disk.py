"""A disk that fills up during a checkpoint save: one message that says what to do, the half-written
`.step-N.tmp` removed, the previous checkpoint untouched and still named by `latest`, and every rank
stopping (exit status 2 under `mpi-tp train`), with no hang and no wall of h5py tracebacks.

The fault is made two ways. The failpoints `save-enospc` (the last tensor-parallel rank's shard write
fails; the other shards are written) and `save-enospc-index` (rank 0's index write fails) raise ENOSPC
at an exact place, in-process at the suite's world size and through `mpi-tp train`. A real small
tmpfs fills up for real; mounting one needs root, so those tests skip, saying why, where it is refused.
"""
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest
from jobs import MPIEXEC, clean_env, run_job
from mpi4py import MPI
from test_checkpoint import CFG, meta, shared_dir, trained  # noqa: F401  (shared_dir is a fixture)
from test_checkpoint_cli import TINY

from mpi_tp import checkpoint as ck
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


# ---------------------------------------------------------------- a small real filesystem

def _mount(size: int):
    """(folder, None) with a tmpfs of `size` bytes mounted on it, or (None, why not)."""
    if shutil.which("mount") is None:
        return None, "no mount command on PATH"
    path = tempfile.mkdtemp(prefix="mpi_tp_full_disk_")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(path)
        return None, (f"cannot mount a tmpfs here (mounting needs root or CAP_SYS_ADMIN): "
                      f"{r.stderr.strip() or 'mount exited ' + str(r.returncode)}")
    return path, None


def resize(path: str, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", path], check=True)


@contextlib.contextmanager
def shared_tmpfs(comm, size: int):
    """A tmpfs every rank of comm sees: rank 0 mounts it and always unmounts it; all ranks skip if it cannot."""
    path, why = _mount(size) if comm.Get_rank() == 0 else (None, None)
    path, why = comm.bcast((path, why))
    if why:
        pytest.skip(why)
    try:
        yield path
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            if subprocess.run(["umount", path]).returncode != 0:     # busy: detach it now, free it later
                subprocess.run(["umount", "--lazy", path], check=True)
            os.rmdir(path)


# ---------------------------------------------------------------- what must hold after the failure

def assert_previous_kept(root: str, step: int, comm=None, model=None) -> None:
    """Only `latest` and the previous step remain, `latest` names it, and it loads (into `model`'s layout)."""
    assert sorted(os.listdir(root)) == ["latest", ck.step_dir_name(step)]    # no .step-N.tmp, no step-N
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == ck.step_dir_name(step)
    with ck.Checkpoint(root) as c:
        assert c.step == step
        if model is None:
            assert c.verify() == []
        else:
            fresh = GPT(GPTConfig(**CFG), Topology.create(comm), dtype="float64", seed=999)
            ck.load_into(c, fresh)
            assert all(np.array_equal(p.data, q.data) for p, q in zip(model.parameters(), fresh.parameters()))


def assert_one_clean_message(err: str, root: str) -> None:
    """Exactly one error line, naming the folder, the bytes and the way out; nothing from h5py."""
    assert err.count("mpi-tp: error:") == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert root in err and "bytes" in err and "--out" in err and "--keep" in err, err


# ---------------------------------------------------------------- in-process, at every world size

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("point", ["save-enospc", "save-enospc-index"])
def test_full_disk_fails_the_save_on_every_rank(world, shared_dir, monkeypatch, capfd, point):  # noqa: F811
    model, opt = trained(Topology.create(world), steps=1)
    ck.save(shared_dir, 1, model, opt, meta(model, opt))
    monkeypatch.setenv("MPI_TP_FAILPOINT", f"{point}:2")
    unraisable = []                                     # errors h5py can only print, from __dealloc__
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ck.CheckpointError) as e:        # on every rank: nobody is left waiting
        ck.save(shared_dir, 2, model, opt, meta(model, opt))
    message = str(e.value)
    assert shared_dir in message and "bytes" in message and "--out" in message, message
    if point == "save-enospc":                          # the last rank failed alone; its message is the one
        last = world.Get_size() - 1
        assert f"writing {ck.shard_name(last, world.Get_size())} failed" in message, message
        assert message.startswith(f"(rank {last}) ") == (last > 0), message
    else:
        assert message.startswith("not enough disk space") and "writing index.h5 failed" in message, message
    assert e.value.status == 2
    assert_previous_kept(shared_dir, 1, world, model)
    assert unraisable == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.mpi(min_size=1)
def test_real_disk_fills_during_the_write(world, monkeypatch, capfd):
    """A tmpfs with room for one checkpoint, not two. The check before writing is told that the disk
    is roomy (as when another job fills it after the check), so the shard writes themselves fail."""
    model, opt = trained(Topology.create(world), steps=1)
    with shared_tmpfs(world, 16 << 20) as mnt:
        root = os.path.join(mnt, "checkpoints")
        ck.save(root, 1, model, opt, meta(model, opt))
        world.Barrier()
        if world.Get_rank() == 0:
            used = shutil.disk_usage(mnt).used
            resize(mnt, used + used // 2)               # half a checkpoint free
        world.Barrier()
        roomy = types.SimpleNamespace(total=1 << 40, used=0, free=1 << 40)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: roomy)
        unraisable = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        with pytest.raises(ck.CheckpointError, match="not enough disk space") as e:
            ck.save(root, 2, model, opt, meta(model, opt))
        assert root in str(e.value) and "(writing shard-" in str(e.value)
        monkeypatch.undo()
        assert_previous_kept(root, 1, world, model)
        assert unraisable == []
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Exception ignored" not in err, err


# ---------------------------------------------------------------- through mpi-tp train (one-rank pass)

def train(*args, failpoint=None, timeout=120):
    env = clean_env()
    if failpoint:
        env["MPI_TP_FAILPOINT"] = failpoint
    return run_job([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi_tp", "train", *TINY, *args], timeout, env)


@needs_mpiexec
@pytest.mark.parametrize("point", ["save-enospc:4", "save-enospc-index:4"])
def test_train_stops_with_one_message(tmp_path, point):
    out = str(tmp_path / "run")
    r = train("--steps", "4", "--save-every", "2", "--out", out, failpoint=point)
    assert r.returncode == 2, (r.stdout, r.stderr)      # mpiexec's status: 2 on every rank
    root = os.path.join(out, "checkpoints")
    assert_one_clean_message(r.stderr, root)
    assert_previous_kept(root, 2)


@needs_mpiexec
def test_train_on_a_small_real_disk(tmp_path):
    """A tmpfs that holds the run and its step-2 checkpoint with half a checkpoint to spare: the
    save at step 4 does not fit."""
    with shared_tmpfs(MPI.COMM_SELF, 16 << 20) as mnt:
        out = os.path.join(mnt, "run")
        r = train("--steps", "2", "--out", out)
        assert r.returncode == 0, r.stderr
        root = os.path.join(out, "checkpoints")
        used = shutil.disk_usage(mnt).used
        checkpoint = sum(os.path.getsize(os.path.join(dirpath, n))
                         for dirpath, _, names in os.walk(os.path.join(root, ck.step_dir_name(2))) for n in names)
        resize(mnt, used + checkpoint // 2)
        r = train("--steps", "4", "--save-every", "2", "--out", out, "--resume")
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert_one_clean_message(r.stderr, root)
        assert_previous_kept(root, 2)
