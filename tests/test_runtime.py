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
