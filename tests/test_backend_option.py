"""--backend numpy|cupy on the commands that decode (issue 21, finding 9): generate, serve, eval,
bench --inference and bench --moe. --help lists it; numpy runs; an unknown value is argparse's error;
cupy on a machine without CuPy is one message and exit 2 on every rank, at 1 and 2 ranks, before any
checkpoint is read (the backend is chosen before any array is made).

These tests start their own MPI jobs, so they run in the one-rank pass only (no mpi marker).
"""
import importlib.util
import sys

import pytest
from jobs import MPIEXEC, OPEN_MPI, TINY, clean_env, mpirun, run_job

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
NO_CUPY = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                             reason="CuPy is installed here: --backend cupy is not an error")

COMMANDS = {   # name -> arguments before --backend (the checkpoint need not exist: the backend comes first)
    "generate": ["generate", "--checkpoint", "/nonexistent/checkpoints"],
    "serve": ["serve", "--checkpoint", "/nonexistent/checkpoints", "--port", "0"],
    "eval": ["eval", "--checkpoint", "/nonexistent/checkpoints", "--data", "/nonexistent/text.txt"],
    "bench --inference": ["bench", "--inference", "--custom", "24,3,2,16,1", "--batch", "1", "--prompt-len", "4",
                          "--new-tokens", "2", "--repeats", "1"],
    "bench --moe": ["bench", "--moe", "--custom", "16,2,1,8,1", "--moe-experts", "2", "--steps", "1",
                    "--warmup", "0"],
}


def every_rank(n, *args):
    """mpiexec -n n mpi-tp args, each rank printing its own exit status on stderr ('rank exit 2'). Open MPI's
    launcher ends the whole job at the first rank that exits non-zero, before the others print theirs: it is
    told not to (PRTE_MCA_state_base_error_non_zero_exit=0), and then exits 0 itself whatever the ranks did
    (`launcher_status`), so that the ranks' own lines say how each ended."""
    script = '"$0" -m mpi_tp "$@"; s=$?; echo "rank exit $s" >&2; exit $s'
    env = clean_env() | ({"PRTE_MCA_state_base_error_non_zero_exit": "0"} if OPEN_MPI else {})
    return run_job([MPIEXEC, "-n", str(n), "sh", "-c", script, sys.executable, *args], timeout=120, env=env)


def launcher_status(status):
    """mpiexec's exit status when every rank exits with `status` (see every_rank)."""
    return 0 if OPEN_MPI else status


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_lists_backend(name):
    from mpi_tp.commands.cli import build_parser
    args = COMMANDS[name]
    parsed = build_parser().parse_args([*args, "--backend", "cupy"])
    assert parsed.backend == "cupy" and build_parser().parse_args(args).backend == "numpy"
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[args[0]]
    assert "--backend {numpy,cupy}" in sub.format_help()


@NO_CUPY
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_cupy_without_cupy_is_one_message_and_exit_2_on_every_rank(name, n):
    r = every_rank(n, *COMMANDS[name], "--backend", "cupy")
    assert r.returncode == launcher_status(2), (r.stdout, r.stderr)
    assert r.stderr.count("rank exit 2") == n, r.stderr                 # every rank, not only rank 0
    assert r.stderr.count("mpi-tp: error:") == 1, r.stderr              # one message, from one rank
    assert "--backend cupy needs CuPy" in r.stderr and "--backend numpy" in r.stderr
    assert "Traceback" not in r.stderr and "nonexistent" not in r.stderr   # before the checkpoint or data


def test_unknown_backend_is_an_argparse_error():
    r = every_rank(2, *COMMANDS["generate"], "--backend", "torch")
    assert r.returncode == launcher_status(2) and r.stderr.count("rank exit 2") == 2
    assert r.stderr.count("invalid choice: 'torch'") == 1, r.stderr


def test_numpy_backend_runs(tmp_path):
    """generate --backend numpy writes what it writes without the option; bench --inference runs with it."""
    out = tmp_path / "run"
    r = mpirun(1, "train", *TINY, "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    args = ["generate", "--checkpoint", str(out / "checkpoints"), "--greedy", "--max-new-tokens", "8"]
    plain, numpy = mpirun(2, *args), mpirun(2, *args, "--backend", "numpy")
    assert plain.returncode == 0 and numpy.returncode == 0, plain.stderr + numpy.stderr
    assert numpy.stdout == plain.stdout and plain.stdout.startswith("The ")
    r = mpirun(2, *COMMANDS["bench --inference"], "--backend", "numpy")
    assert r.returncode == 0 and "cached decoding" in r.stdout, r.stderr
