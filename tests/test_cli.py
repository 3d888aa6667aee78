"""The mpi-tp command end to end, launched with mpiexec: training, clear errors, no hangs.

These tests start their own MPI jobs, so they run in the one-rank pass only
(they carry no mpi marker; the multi-rank passes select -m mpi).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from jobs import (  # noqa: F401
    LEARN,
    MPIEXEC,
    OPEN_MPI,
    STOP,
    TINY,
    clean_env,
    mpirun,
    run_job,
    train_layouts,
)

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


@pytest.mark.launcher
def test_train_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = mpirun(2, "train", *TINY, *LEARN, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("step 200/200") == 1                   # progress from rank 0 only
    assert "--- sample ---" in r.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["layout"] == {"world": 2, "tp": 2, "pp": 1, "dp": 1}
    assert len(run["data"]["sha256"]) == 64
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "loss" in l]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, "the loss did not fall"
    # below the byte-frequency model, with margin: a model that learned nothing (~5.5) or only byte
    # frequencies (the unigram entropy) fails
    assert run["final_val_loss"] < run["unigram_entropy"] - 0.2, (run["final_val_loss"], run["unigram_entropy"])
    assert json.loads((out / "config.json").read_text())["n_head"] == 3
    assert run["communication"]["train_steps"]["tp/all_reduce"]["calls"] > 0
    assert run["environment"]["gemm"] in ("mkl", "numpy")             # what multiplied, what kept memory
    assert ("mpi-tp" in run["environment"]["malloc"] or os.environ.get("MPI_TP_MALLOC") == "system"
            or any(k.startswith("MALLOC_") for k in os.environ))


def test_config_file_and_override(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 8, "steps": 3,
                               "batch_size": 2, "sample_len": 0, "eval_batches": 1}))
    out = tmp_path / "run"
    r = mpirun(1, "train", "--config", str(cfg), "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["steps"] == 2 and resolved["n_embd"] == 8


@pytest.mark.parametrize("args,message", [
    (["--n-head", "3", "--n-embd", "16"], "must divide n_embd"),
    (["--n-head", "1", "--n-embd", "16"], "exceeds n_head"),
    (["--tp", "3"], "needs 3 MPI ranks but the job has 2"),
    (["--data", "/nonexistent/file.txt"], "not found"),
    (["--steps", "0"], "steps must be at least 1"),
    (["--micro-batches", "0"], "micro_batches must be at least 1"),
    (["--pp", "3"], "needs 3 MPI ranks but the job has 2"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "3"],
     "multiple of the 2 pipeline stages"),
    (["--pp", "2", "--virtual-stages", "2"], "needs --schedule interleaved"),
    (["--block-size", "100000", "--data", "__SMALL__"], "block"),
    (["--backend", "cupy"], "--backend cupy needs CuPy"),
])
def test_errors_are_one_clear_message(tmp_path, args, message):
    if "cupy" in args and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: --backend cupy is not an error")
    small = tmp_path / "small.txt"
    small.write_text("hello world " * 20)
    args = [str(small) if a == "__SMALL__" else a for a in args]
    r = mpirun(2, "train", "--out", str(tmp_path / "o"), *args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("mpi-tp: error:") == 1, r.stderr     # one message, from one rank
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_micro_batches_end_to_end(tmp_path):
    """--dp 2 --micro-batches 2 --batch-size 2 trains on the same 8 sequences per step as --tp 2
    --batch-size 8: the same losses (float64, dropout on), in the run record's global batch."""
    common = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--steps", "3",
              "--dtype", "float64", "--dropout", "0.1", "--log-every", "1", "--eval-every", "100",
              "--eval-batches", "1", "--sample-len", "0"]
    runs = {}
    for name, layout in (("one", ["--tp", "2", "--batch-size", "8"]),
                         ("micro", ["--dp", "2", "--micro-batches", "2", "--batch-size", "2"])):
        r = mpirun(2, "train", *common, *layout, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        runs[name] = [json.loads(l)["loss"] for l in open(tmp_path / name / "metrics.jsonl") if '"loss"' in l]
    assert len(runs["one"]) == 3 and max(abs(a - b) for a, b in zip(runs["one"], runs["micro"])) < 1e-9, runs


@pytest.mark.launcher
def test_pipeline_end_to_end(tmp_path):
    """--pp 2 (1F1B, 2 micro-batches, 3 blocks on 2 stages) trains what --tp 2 trains: the same losses,
    and checkpoints holding the same tensors, optimizer state included (float64, dropout on)."""
    common = ["--n-layer", "3", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--steps", "3",
              "--dtype", "float64", "--dropout", "0.1", "--log-every", "1", "--eval-every", "2",
              "--eval-batches", "1", "--sample-len", "8", "--batch-size", "2", "--micro-batches", "2"]
    runs, tensors = train_layouts(tmp_path, common, {"tp": ["--tp", "2"], "pp": ["--pp", "2", "--schedule", "1f1b"]},
                                  step=3)
    assert runs["pp"]["layout"] == {"world": 2, "tp": 1, "pp": 2, "dp": 1}
    assert abs(runs["pp"]["final_val_loss"] - runs["tp"]["final_val_loss"]) < 1e-9
    assert runs["pp"]["sample"] == runs["tp"]["sample"]
    assert tensors["pp"].keys() == tensors["tp"].keys()
    worst = max(float(abs(tensors["pp"][n] - tensors["tp"][n]).max()) for n in tensors["tp"])
    assert worst < 1e-12, worst


def test_trace_of_a_pipelined_run(tmp_path):
    """--trace: one process per rank in the Chrome trace format; each stage's forward and backward
    actions (4 micro-batches x 2 steps), and send events whose bytes are the activations'."""
    out, trace = tmp_path / "run", tmp_path / "trace.json"
    r = mpirun(2, "train", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
               "--steps", "2", "--batch-size", "1", "--micro-batches", "4", "--pp", "2", "--eval-batches", "1",
               "--sample-len", "0", "--out", str(out), "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    events = json.load(open(trace))["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}
    for rank in (0, 1):
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        assert [e["args"]["micro"] for e in mine if e["name"] == "F"][:4] == [0, 1, 2, 3]
        assert sum(e["name"] == "B" for e in mine) == 8 and all(e["dur"] >= 0 for e in mine)
        assert any(e["name"] == "optimizer" for e in mine)
    sent = sum(e["args"]["bytes"] for e in events if e["name"] == "pp/send" and e["pid"] == 0)
    # 8 training activations + 4 evaluation ones (a validation batch is a global batch, in the step's 4
    # micro-batches), each (1, 16, 16) float32
    assert sent == (8 + 4) * 1 * 16 * 16 * 4


@pytest.mark.parametrize("nodes,ranks,pin", [(1, 2, []), (2, 4, ["--pp", "2"])])
def test_plan_emits_a_config_that_trains(tmp_path, nodes, ranks, pin):
    """mpi-tp plan --emit-config for this machine (calibrated, 2 ranks a node) at 2 and 4 ranks; the
    file trains unchanged under mpiexec with that many ranks, in the layout the plan chose."""
    machine = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "planner",
                           "results", "machine_2ranks.json")
    config = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "plan", "--machine", machine, "--nodes", str(nodes),
                        "--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--global-batch", "8",
                        "--vocab", "256", *pin, "--emit-config", str(config)],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 0, r.stderr
    chosen = json.load(open(config))
    assert chosen["tp"] * chosen["pp"] * chosen["dp"] == ranks and (not pin or chosen["pp"] == 2)
    r = mpirun(ranks, "train", "--config", str(config), "--steps", "2", "--eval-batches", "1", "--sample-len", "0",
               "--out", str(tmp_path / "run"), timeout=180)
    assert r.returncode == 0, r.stderr
    run = json.load(open(tmp_path / "run" / "run.json"))
    assert run["layout"] == {"world": ranks, "tp": chosen["tp"], "pp": chosen["pp"], "dp": chosen["dp"]}
    assert run["config"]["micro_batches"] == chosen["micro_batches"]


def test_bad_option_and_config_file(tmp_path):
    r = mpirun(2, "train", "--n-layer", "two", timeout=60)
    assert r.returncode == 2 and r.stderr.count("invalid int value") == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"n_layers": 3}')
    r = mpirun(2, "train", "--config", str(bad), timeout=60)
    assert r.returncode == 2 and "unknown option(s) n_layers" in r.stderr


@pytest.mark.launcher
def test_crash_on_one_rank_aborts_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective: the job must end, not hang."""
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        from mpi_tp.core.runtime import install_abort_hook
        install_abort_hook()
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise RuntimeError("boom on rank 1")
        MPI.COMM_WORLD.Barrier()          # would wait forever without the abort
    """))
    r = run_job([MPIEXEC, "-n", "2", sys.executable, str(script)], timeout=60)
    assert r.returncode != 0
    assert "[rank 1]" in r.stderr and "boom on rank 1" in r.stderr
    assert r.stderr.count("RuntimeError: boom on rank 1") == 1     # shown once


def test_separate_programs_are_refused(tmp_path):
    """A launcher that starts N one-rank programs (srun --mpi=none) is caught, not trained N times."""
    env = clean_env()
    env.update(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2")
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "train", "--steps", "1"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and "separate programs" in r.stderr


def test_bench_reports(tmp_path):
    out = tmp_path / "bench.jsonl"
    r = mpirun(2, "bench", "--custom", "32,2,1,16,2", "--steps", "2", "--warmup", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["tp"] == 2 and row["model_gflop_per_step"] > 0 and row["gemm_peak_gflops_per_rank"] > 0
    L, B, S, C = 1, 2, 16, 32
    assert row["comm_bytes_per_step"] == ((4 * L + 2) * B * S * C + 3 * B * S) * 4 + 8   # docs' closed form
    assert {"bare", "mpi_tp"} <= set(row["allreduce_BSC_ms"])
    r = mpirun(2, "bench", "--custom", "32,3,1,16,2", timeout=60)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1


@pytest.mark.launcher
def test_bench_pipeline_reports(tmp_path):
    """bench --pp 2: the bubble next to its formula, the bytes sent between stages equal to
    p2p_formula (M activations of B S C float32 one way from stage 0), each stage's time blocked in receives."""
    out = tmp_path / "bench.jsonl"
    r = mpirun(2, "bench", "--pp", "2", "--micro-batches", "4", "--custom", "32,2,2,16,2", "--steps", "2",
               "--warmup", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text().splitlines()[-1])
    assert (row["pp"], row["tp"], row["micro_batches"], row["schedule"]) == (2, 1, 4, "1f1b")
    assert row["bubble"]["formula"] == 0.25 and row["bubble"]["measured"] > 0
    assert row["p2p_bytes_per_step"]["measured"] == row["p2p_bytes_per_step"]["formula"] == 4 * 2 * 16 * 32 * 4
    assert row["receives_posted_ahead"] == 2 and len(row["receive_wait_ms_per_stage"]) == 2   # the engine's default
    r = mpirun(2, "bench", "--pp", "2", "--custom", "32,2,1,16,2", timeout=60)        # 1 layer, 2 stages
    assert r.returncode == 2 and "cannot fill 2 stages" in r.stderr


def test_presets_are_valid(tmp_path):
    """Every preset in experiments/training/configs loads and validates at the world size it names."""
    import argparse

    from mpi_tp.training.config_sources import add_arguments, resolve
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "training",
                          "configs")
    presets = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    assert presets
    for name in presets:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = resolve(parser.parse_args(["--config", os.path.join(folder, name)]))
        cfg.validate((cfg.tp or 1) * cfg.dp)


def _subcommands() -> list[str]:
    """Every subcommand the parser knows, so that a new command is covered without editing this file."""
    from mpi_tp.commands.cli import build_parser
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def test_the_subcommands_are_found():
    assert {"train", "explain", "exercise", "plan"} <= set(_subcommands())


@pytest.mark.parametrize("command", _subcommands())
def test_every_command_has_help(command):
    """argparse formats help lazily: a '%' in one option's text breaks only --help (it did, once)."""
    r = subprocess.run([sys.executable, "-m", "mpi_tp", command, "--help"], capture_output=True, text=True,
                       timeout=60, env=clean_env())
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
