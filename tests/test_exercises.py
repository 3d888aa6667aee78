"""`mpi-tp exercise`: every shipped broken version FAILS with its specific message, every solution
PASSES, and a different planted bug (a mutation of the solution) is caught by each checker; exercise 1's
also fails a bias shared out over the partial sums before g, whose sum is right.

The in-process tests are MPI tests (1, 2, 3 and 4 ranks): exercises 1-4, 7 and 8 need 2 or more ranks (at
T = 1 they are bad input, exit 2), exercises 5 and 6 run at any T. The command-line tests (--copy, --list,
bad input) start their own jobs and run in the one-rank pass.
"""
import argparse
import re
import sys
from pathlib import Path

import pytest
from jobs import MPIEXEC, mpirun, run_job
from test_docs import clean_env

from mpi_tp.commands.exercise import cmd_exercise
from mpi_tp.core.errors import UserError
from mpi_tp.course.registry import EXERCISES, get

MPI_TEST = pytest.mark.mpi(min_size=1)
ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "exercises.md"
# exercise: what the shipped broken version's report must say (T >= 2)
BROKEN = {
    1: ["output Y: max relative difference", "the bias is added", "gets these right: input gradient dX",
        "what enters g (the forward all-reduce) is not this rank's partial sum X_i A_i: it is X_i A_i + 1.00 b"],
    2: ["forward raised ValueError at line", "a row-split layer expects its input split by columns"],
    3: ["input gradient dX: max relative difference", "backward collectives: none",
        "gets these right: output Y, gradient of column/weight", "dX is only this rank's part"],
    4: ["\n  the rows [V_start, V_start + V_i) of the ranks are rank 0 [0,", "the split rule gives rank 0 [0,",
        "are held by no rank", "wrong vectors for token ids"],
    5: ["buffer bytes at B = 2, S = 4, C = 8, V = 37, L = 2", "you predicted 2048", "you counted one pass",
        "in 13 all-reduces"],
    6: ["one layer of ring attention, at Z = ", "messages at Z = ", "the counters of the group cp measured", "bytes sent at B = 2, H = 2, H_kv = 2, S = 13",
        "that is the plain split's work", "how many hops is that?"],
    7: ["model.layers.0.self_attn.q_proj.weight (32, 32) at H = 4, H_kv = ", "you said rows [32, 32) (nothing)",
        "this rank holds rows [", "sharing out the key/value heads leaves some ranks none",
        "key/value head 0 (a replica, also on rank"],
    8: ["ZeRO-1's bytes, at D = ", "wire bytes at fp32, ZeRO-1: num_params = ", "(2x)", "it replaces the all-reduce",
        "optimizer state bytes at fp32, ZeRO-1", "its 1/D share of each bucket only", "fp32 master copies"],
}
# exercise: what the shipped broken version's report must say at T = 1 (default: that nothing is communicated)
AT_ONE = {6: ["scores at S = 13, Z = 1, per ring step: you predicted [169], the ring computed [127]",
              "that is the plain split's work"]}
# exercise: what the broken version's report says once, not repeated (T >= 2)
ONCE = {4: ["come out as zeros", "the rows [V_start, V_start + V_i) of the ranks are"]}
# exercise: (a different bug planted in the solution: old -> new, what the report must say)
MUTATIONS = {
    1: ("        y = reduce_from_tp(y, self.group)", "        pass",
        "Y is this rank's own partial sum X_i A_i"),
    2: (("topo.tp, dtype, seed=seed)\n        self.proj = RowParallelLinear(f\"{name}/proj\", 4 * C, C, topo.tp, "
         "dtype, sizes=self.fc.sizes, seed=seed)"),
        ("topo.tp, dtype, seed=seed, gather_output=True)\n        self.proj = RowParallelLinear(f\"{name}/proj\", "
         "4 * C, C, topo.tp, dtype, seed=seed, input_is_parallel=False)"),
        "forward collectives: tp/all_gather: 1 call"),
    3: ("        self.bias.accumulate(db)\n", "", "gradient of column/bias: max relative difference"),
    4: ("local = ids - self.start", "local = ids", "wrong vectors for token ids"),
    5: ("return 2 * (T - 1) / T * buffer_bytes", "return (T - 1) / T * buffer_bytes",
        "2 (T-1)/T n wire bytes per rank"),
    6: ("    return per * (kv + kv + S)", "    return per * (kv + kv + S) * H // H_kv", "K and V have H_kv heads, not H"),
    7: ("        return 1, q.start * hs, q.stop * hs", "        return 0, q.start * hs, q.stop * hs",
        "o_proj is cut along axis 1 (columns): torch.nn.Linear stores a weight (out, in)"),
    8: ("return ring * grad_bytes + ring * param_bytes", "return 2 * ring * grad_bytes",
        "the all-gather the updated parameters (param_bytes a value)"),
}


def run(capsys, world, number, **over):
    given = {"number": None if number is None else str(number), "list": False, "copy": None, "file": None,
             "solution": False}
    args = argparse.Namespace(**(given | over))
    status = cmd_exercise(args, world)
    return status, capsys.readouterr().out


@MPI_TEST
@pytest.mark.parametrize("number", [e.number for e in EXERCISES])
def test_shipped_version_fails_with_its_message_and_the_solution_passes(capsys, world, number):
    T = world.Get_size()
    if T < get(number).min_ranks:
        for solution in (False, True):
            with pytest.raises(UserError, match="needs 2 or more ranks") as e:
                run(capsys, world, number, solution=solution)
            assert e.value.status == 2
        return
    status, out = run(capsys, world, number)
    assert status == 1
    if world.Get_rank() == 0:
        assert out.rstrip().endswith("FAIL") and "hint: " in out, out
        for text in BROKEN[number] if T > 1 else AT_ONE.get(number, ["at T = 1 nothing is communicated"]):
            assert text in out, out
        for text in ONCE.get(number, []) if T > 1 else []:
            assert out.count(text) == 1, out
    else:
        assert out == ""                            # rank 0 speaks for everyone
    status, out = run(capsys, world, number, solution=True)
    assert status == 0
    if world.Get_rank() == 0:
        assert out.rstrip().endswith("PASS") and "FAIL" not in out and "hint" not in out, out


@MPI_TEST
@pytest.mark.parametrize("number", [e.number for e in EXERCISES])
def test_a_planted_bug_is_caught(capsys, world, tmp_path, number):
    ex = get(number)
    if world.Get_size() < ex.min_ranks:
        pytest.skip(f"exercise {number} needs {ex.min_ranks} or more ranks")
    old, new, message = MUTATIONS[number]
    source = Path(ex.source(solution=True)).read_text()
    assert old in source, f"the mutation of exercise {number} no longer applies"
    if number in (5, 6) and world.Get_size() == 1:        # nothing is sent at T = 1: plant another bug
        old, new, message = "        return 0\n", "        pass\n", {5: "at T = 1 nothing is communicated",
                                                                   6: "at Z = 1 the ring sends nothing"}[number]
    planted = tmp_path / f"mutant{number}.py"             # each rank its own file (tmp_path differs)
    planted.write_text(source.replace(old, new))
    status, out = run(capsys, world, number, file=str(planted))
    assert status == 1
    if world.Get_rank() == 0:
        assert message in out and out.rstrip().endswith("FAIL"), out


# exercise 1: the bias shared out over the partial sums before g. The sum comes out right (T shares of b / T,
# or b from rank 0 alone), so output and gradients equal the serial layer's; the check must still fail it,
# because the lesson's layer hands g the partial sums alone and adds b once, after the reduce.
BIAS_BEFORE_G = {
    "b / T on every rank": ("kern.linear_forward(x, self.weight.data)",
                            "kern.linear_forward(x, self.weight.data, self.bias.data / self.group.size)",
                            "every rank: what enters g (the forward all-reduce) is not this rank's partial sum "
                            "X_i A_i: it is X_i A_i + {share} b"),
    "b on rank 0 only": ("kern.linear_forward(x, self.weight.data)",
                         "kern.linear_forward(x, self.weight.data, self.bias.data if self.group.rank == 0 else None)",
                         "rank 0: what enters g (the forward all-reduce) is not this rank's partial sum X_i A_i: "
                         "it is X_i A_i + 1.00 b"),
}


@MPI_TEST
@pytest.mark.parametrize("planted", list(BIAS_BEFORE_G))
def test_exercise_1_fails_a_bias_added_before_g(capsys, world, tmp_path, planted):
    T = world.Get_size()
    if T < 2:
        pytest.skip("exercise 1 needs 2 or more ranks")
    old, new, message = BIAS_BEFORE_G[planted]
    source = Path(get(1).source(solution=True)).read_text()
    assert old in source and "        y += self.bias.data" in source, "the planted bias no longer applies"
    mutant = tmp_path / "bias_before_g.py"
    mutant.write_text(source.replace(old, new).replace("        y += self.bias.data", "        pass"))
    status, out = run(capsys, world, 1, file=str(mutant))
    assert status == 1
    if world.Get_rank() == 0:
        assert message.format(share=f"{1 / T:.2f}") in out and out.rstrip().endswith("FAIL"), out
        assert "output Y" not in out.split("why:")[0], out          # the output itself is right
        assert "the output is right" in out and "adds b once, after the reduce" in out, out
        if planted == "b on rank 0 only":
            assert "rank 1: what enters g" not in out, out


@MPI_TEST
def test_a_file_without_the_function_is_bad_input(capsys, world, tmp_path):
    bad = tmp_path / "empty.py"
    bad.write_text("x = 1\n")
    with pytest.raises(UserError, match="does not define buffer_bytes, wire_bytes") as e:
        run(capsys, world, 5, file=str(bad))
    assert e.value.status == 2
    bad.write_text("def buffer_bytes(:\n")
    with pytest.raises(UserError, match="does not load: SyntaxError"):
        run(capsys, world, 5, file=str(bad))
    with pytest.raises(UserError, match="no such file"):
        run(capsys, world, 5, file=str(tmp_path / "missing.py"))


@pytest.mark.parametrize("number,message", [("9", f"no exercise 9: choose 1 to {max(e.number for e in EXERCISES)}"),
                                            ("x", "no exercise x"),
                                            (None, "give an exercise number")])
def test_bad_numbers_are_bad_input(capsys, world, number, message):
    with pytest.raises(UserError, match=message) as e:
        run(capsys, world, number)
    assert e.value.status == 2


def test_copy_writes_once_and_list_names_them(capsys, world, tmp_path):
    status, out = run(capsys, world, 3, copy=str(tmp_path / "new"))
    target = tmp_path / "new" / "exercise3.py"
    assert status == 0 and str(target) in out and "--file" in out
    assert target.read_text() == Path(get(3).source()).read_text()
    target.write_text("# my work\n")
    with pytest.raises(UserError, match="exists already: not overwriting") as e:
        run(capsys, world, 3, copy=str(tmp_path / "new"))
    assert e.value.status == 2 and target.read_text() == "# my work\n"
    status, out = run(capsys, world, None, list=True)
    assert status == 0 and all(f"{e.number}. {e.title}" in out for e in EXERCISES)


needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


@needs_mpiexec
def test_command_line_statuses(tmp_path):
    (tmp_path / "mine.py").write_text("x = 1\n")
    r = mpirun(2, "exercise", "1", timeout=60)
    assert r.returncode == 1 and r.stdout.count("exercise 1:") == 1 and "FAIL" in r.stdout, r.stderr
    for args, message in ((["9"], "no exercise 9"), (["5", "--file", "/nonexistent/exercise5.py"], "no such file"),
                          (["5", "--file", str(tmp_path / "mine.py")], "does not define buffer_bytes, wire_bytes"),
                          (["1"], "exercise 1 needs 2 or more ranks")):
        r = mpirun(1, "exercise", *args, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr


def doc_commands() -> list[tuple[str, bool]]:
    """(command, expected to FAIL) for each line of the ```bash blocks of docs/exercises.md."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                out.append((line.split("#", 1)[0].strip(), "# expected to FAIL" in line))
    return out


def test_the_doc_has_commands_for_every_exercise():
    commands = " ".join(c for c, _ in doc_commands())
    for e in EXERCISES:
        assert f"exercise {e.number} --copy" in commands and f"exercise {e.number} --solution" in commands


@needs_mpiexec
def test_a_rank_that_raises_alone_aborts_instead_of_hanging(tmp_path):
    """A student's forward that raises on rank 0 only leaves rank 1 waiting in g's all-reduce: the watchdog
    aborts the job with a message after MPI_TP_EXERCISE_TIMEOUT seconds (without it, the job hangs)."""
    student = tmp_path / "rank0_raises.py"
    student.write_text("from mpi_tp.course.solutions.ex1_row_bias import RowLinear as _Right\n\n\n"
                       "class RowLinear(_Right):\n    def forward(self, x):\n        if self.group.rank == 0:\n"
                       "            raise RuntimeError('only rank 0 fails')\n        return super().forward(x)\n")
    env = clean_env() | {"MPI_TP_EXERCISE_TIMEOUT": "5"}
    r = run_job([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi_tp", "exercise", "1", "--file", str(student)],
                timeout=90, env=env)
    assert r.returncode != 0 and "the ranks are out of step" in r.stderr, (r.returncode, r.stderr[-2000:])


# exercise 7: other bugs planted in the solution's shard, each with what the report must say and the world sizes at
# which it shows (the query heads shared out evenly, ignoring their key/value head, are right except at T = 2, where
# H = 6 over H_kv = 3 gives 4 + 2 query heads, not 3 + 3).
EX7_PLANTED = {
    "q heads split evenly": ("        return range(kv.start * R, kv.stop * R), kv", "        return range(*share(H, T, rank)), kv",
                             [("q_proj.weight (48, 48) at H = 6, H_kv = 3: you said rows [0, 24) (query heads 0-2), "
                               "this rank holds rows [0, 32) (query heads 0-3)"),
                              "H_kv = 3 >= T = 2: the key/value heads are shared out"], (2,)),
    "vocabulary rows even": ("        return (0, *share(shape[0], T, rank))\n    return None",
                             "        return 0, rank * (shape[0] // T), (rank + 1) * (shape[0] // T)\n    return None",
                             ["model.embed_tokens.weight (37, 32)", "embed_tokens: 37 rows over T = ",
                              "split_sizes gives the first n % T ranks one more"], (2, 3, 4)),
    "norms not whole": ("    return None                                           # the norms", "    return 0",
                        ["returned 0: give (axis, start, stop), three ints, or None (the whole tensor)"], (2, 3, 4)),
    "raises on rank 1 alone": ('    part = name.split(".")[-2]',
                               ('    if rank == 1 and H_kv == 1:\n        raise RuntimeError("rank 1 alone")\n'
                                '    part = name.split(".")[-2]'),
                               ["rank 1: shard('model.embed_tokens.weight', (37, 32), 4, 1,", "raised RuntimeError"],
                               (2, 3, 4)),       # and the other ranks stop with it: no model built by some ranks only
}


@MPI_TEST
@pytest.mark.parametrize("planted", list(EX7_PLANTED))
def test_exercise_7_catches_other_bugs(capsys, world, tmp_path, planted):
    old, new, messages, sizes = EX7_PLANTED[planted]
    if world.Get_size() not in sizes:
        pytest.skip(f"'{planted}' shows at T in {sizes}")
    source = Path(get(7).source(solution=True)).read_text()
    assert source.count(old) == 1, f"the planted bug '{planted}' no longer applies"
    mutant = tmp_path / "planted7.py"
    mutant.write_text(source.replace(old, new))
    status, out = run(capsys, world, 7, file=str(mutant))
    assert status == 1
    if world.Get_rank() == 0:
        assert out.rstrip().endswith("FAIL") and all(m in out for m in messages), out
