"""collective_setup: errors raised on purpose become one agreed UserError on every rank; bugs keep
their own type (and, under `mpi-tp`, their traceback)."""
import errno

import pytest

from mpi_tp.checkpoint import CheckpointError
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup
from mpi_tp.model.config import ConfigError
from mpi_tp.parallel.topology import TopologyError
from mpi_tp.training.data import DataError

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("kind", [UserError, ConfigError, TopologyError, DataError, CheckpointError])
def test_deliberate_errors_are_agreed_on_every_rank(world, kind):
    last = world.Get_size() - 1

    def setup():
        if world.Get_rank() == last:
            raise kind("the message that says what to do")
        return "fine"
    with pytest.raises(UserError) as info:
        collective_setup(setup, comm=world)
    prefix = f"(rank {last}) " if last else ""
    assert str(info.value) == prefix + "the message that says what to do" and info.value.status == 2


def test_status_travels_with_the_error(world):
    with pytest.raises(UserError) as info:
        collective_setup(lambda: (_ for _ in ()).throw(UserError("stop", status=3)), comm=world)
    assert info.value.status == 3


@pytest.mark.parametrize("bug", [OSError(errno.EIO, "input/output error"), ValueError("a bug's message"),
                                 KeyError("x")])
def test_other_errors_are_not_swallowed(bug):
    """A ValueError or OSError that nobody raised on purpose is a bug: it keeps its type (and traceback)."""
    def setup():
        raise bug
    with pytest.raises(type(bug)):
        collective_setup(setup)      # COMM_WORLD; raised before any collective, so safe on one rank


MALLOC_PROBE = """
import ctypes, sys
import mpi_tp.commands.cli                       # what `mpi-tp` imports before it runs a command
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(1 << 20)                         # 1 MiB: above glibc's default mmap threshold (128 KiB)
mmapped = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2   # IS_MMAPPED bit
sys.exit(0 if mmapped else 1)
"""


def test_importing_the_command_leaves_malloc_alone():
    """mpi_tp must not change the allocator of the whole process (MPI's own buffers included).

    glibc serves a 1 MiB malloc from a fresh mmap unless someone raised its mmap
    threshold; the threshold is pinned at glibc's default (GLIBC_TUNABLES) so that
    glibc's own adaptive raise cannot blur the check. Users who want freed memory
    kept set MALLOC_MMAP_THRESHOLD_ themselves (docs/performance.md).
    """
    import platform
    import subprocess
    import sys
    if platform.system() != "Linux" or "glibc" not in " ".join(platform.libc_ver()):
        pytest.skip("the probe reads glibc's chunk header")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("MALLOC_", "PMI", "HYDRA"))}
    env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=131072"
    r = subprocess.run([sys.executable, "-c", MALLOC_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"a 1 MiB malloc came from the heap: mpi_tp changed malloc's thresholds {r.stderr}"


KEEP_PROBE = """
import ctypes, json, sys
from mpi_tp.core.runtime import keep_freed_memory
said = keep_freed_memory()                       # what train and bench call when they start
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(16 << 20)                        # 16 MiB: mmapped under glibc's thresholds, kept under ours
mmapped = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2
print(json.dumps({"said": said, "mmapped": bool(mmapped)}))
"""


@pytest.mark.parametrize("extra, kept", [({}, True), ({"MPI_TP_MALLOC": "system"}, False),
                                         ({"MALLOC_TOP_PAD_": "0"}, False)])
def test_the_training_commands_keep_freed_memory_unless_the_user_chose(extra, kept):
    """keep_freed_memory (train and bench) raises glibc's thresholds, so a 16 MiB array's pages stay mapped
    from step to step, and says so; MPI_TP_MALLOC=system, or any MALLOC_* of the user's, leaves glibc alone."""
    import json
    import os
    import platform
    import subprocess
    import sys
    if platform.system() != "Linux" or "glibc" not in " ".join(platform.libc_ver()):
        pytest.skip("the probe reads glibc's chunk header")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "PMI", "HYDRA"))}
    r = subprocess.run([sys.executable, "-c", KEEP_PROBE], env={**env, **extra}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mmapped"] is not kept
    assert ("mpi-tp" in out["said"]) is kept and (out["said"] == {"MALLOC_TOP_PAD_": "0"}) is ("MALLOC_TOP_PAD_" in extra)
