"""The mutation check (tests/mutation) stays usable: every mutant still applies to today's code, and
the runner tells a caught mutant from a surviving one (one real mutant, one harmless change)."""
import importlib

from mutation import check
from mutation.mutant import AREAS, ROOT, Mutant, all_mutants


def test_every_mutant_applies_to_todays_code():
    """A mutant whose text moved or vanished is stale: it would mutate nothing (or something else)."""
    mutants = all_mutants()
    problems = [p for p in (m.problem() for m in mutants) if p]
    assert not problems, "\n".join(problems)
    assert len(mutants) >= 15
    for area in AREAS:     # every area's mutants carry its name
        assert all(m.name.startswith(f"{area}/") for m in importlib.import_module(f"mutation.{area}").MUTANTS)


def test_a_mutant_must_name_text_that_occurs_once():
    m = Mutant("x/y", "nothing", "mpi_tp/parallel/tensor_parallel.py", "return", "return", ("tests/test_comm.py",))
    assert "times in" in m.problem()
    m = Mutant("x/y", "nothing", "mpi_tp/no_such_file.py", "a", "b", ("tests/test_comm.py",))
    assert "does not exist" in m.problem()


def test_the_runner_tells_caught_from_survived():
    args = check.parser().parse_args([])
    caught = next(m for m in all_mutants() if m.name == "regions/cross-entropy-target-offset")
    assert check.judge(caught, args)["verdict"] == "caught"
    harmless = Mutant("test/comment", "a comment changes", caught.file, caught.old,
                      caught.old.rstrip() + "  # a comment ", caught.tests, caught.worlds)
    assert check.judge(harmless, args)["verdict"] == "SURVIVED"
    assert (ROOT / caught.file).read_text().count(caught.old) == 1      # the tree itself is never touched
