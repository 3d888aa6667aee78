"""The layout rule, written once (mpi_tp.parallel.layout): resolve, check, describe, and the same one-line
error from `mpi-tp train`, `mpi-tp bench` and `mpi-tp plan`."""
import json
import subprocess
import sys

import pytest
from jobs import MPIEXEC, clean_env

from mpi_tp.parallel.layout import RULE, Layout, TopologyError
from mpi_tp.planning.costmodel import Plan
from mpi_tp.training.config import TrainConfig


def test_resolve_gives_tp_or_dp_the_rest():
    assert Layout.resolve(8, pp=2, dp=2) == Layout(tp=2, pp=2, dp=2)
    assert Layout.resolve(8, tp=2, cp=2, dp=0) == Layout(tp=2, cp=2, dp=2)
    assert Layout.resolve(12, tp=0, cp=3, pp=1, dp=2).tp == 2
    assert Layout.resolve(1).ranks == 1


@pytest.mark.parametrize("world,sizes,needs", [(6, dict(tp=4), 4), (4, dict(tp=2, cp=3), 6), (2, dict(pp=3), 3),
                                               (4, dict(pp=3), 3), (5, dict(tp=0, dp=2), 4)])
def test_a_world_that_does_not_fit_names_the_rule(world, sizes, needs):
    with pytest.raises(TopologyError) as e:
        Layout.resolve(world, **sizes)
    text = str(e.value)
    assert f"needs {needs} MPI ranks but the job has {world}" in text and RULE in text and "\n" not in text


def test_check_names_every_broken_rule_once():
    wrong = Layout(tp=2, dp=3, ep=2).problems(world=4)
    assert len(wrong) == 2 and "needs 6 MPI ranks" in wrong[0] and "--ep 2 x --etp 2 = 4 must divide tp x cp x dp = 6" in wrong[1]
    with pytest.raises(TopologyError, match="at least 1"):
        Layout(tp=0).check()
    assert Layout(tp=2, dp=2, ep=2).check(4).ranks == 4


def test_describe_is_one_set_of_words():
    assert Layout(tp=2).describe() == "tp2 pp1 dp1"
    assert Layout(tp=2, cp=2, pp=2, dp=4, ep=2, virtual=2, sp=True, zero=1).describe() == \
        "tp2 cp2 pp2 dp4 ep2 v2 +sp +zero1"
    plan = Plan(tp=4, pp=12, dp=8, micro_batch=2, virtual=2, sp=True, zero=1, recompute=True)
    assert plan.describe() == "tp4 pp12 dp8 b2 v2 +sp +zero1 +recompute"            # the planner's table
    assert plan.describe().startswith(" ".join(plan.words()))
    assert Layout(tp=2, cp=2, dp=2).to_dict() == {"world": 8, "tp": 2, "pp": 1, "dp": 2, "cp": 2}


def test_training_config_resolves_its_layout():
    cfg = TrainConfig(pp=2, dp=2, virtual_stages=2, schedule="interleaved", sequence_parallel=True, n_layer=4,
                      micro_batches=2)
    assert cfg.layout(8) == Layout(tp=2, pp=2, dp=2, virtual=2, sp=True)
    with pytest.raises(TopologyError, match="needs 4 MPI ranks but the job has 6"):
        TrainConfig(tp=4).validate(6)


MACHINE = {"gemm_flops": 1e12, "peak_flops": 2e12, "elem_rate": 1e10, "mem_bw": 1e11, "mem_bytes": 8e10,
           "intra_alpha": 1e-6, "intra_bw": 1e10, "inter_alpha": 1e-5, "inter_bw": 1e9}


@pytest.mark.launcher
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
@pytest.mark.parametrize("world,pins", [(6, ["--tp", "4"]), (4, ["--tp", "2", "--cp", "3"])])
def test_train_bench_and_plan_say_the_same_line(tmp_path, world, pins):
    """The issue's two bad layouts: one line, word for word the same from the three commands."""
    machine = tmp_path / "m.json"
    machine.write_text(json.dumps({"name": f"{world} a node", "ranks_per_node": world, **MACHINE}))
    env = clean_env()
    mpi = [MPIEXEC, "-n", str(world), sys.executable, "-m", "mpi_tp"]
    runs = {"train": mpi + ["train", "--out", str(tmp_path / "o"), *pins], "bench": mpi + ["bench", *pins],
            "plan": [sys.executable, "-m", "mpi_tp", "plan", "--machine", str(machine), "--layers", "4", "--hidden",
                     "256", "--heads", "4", "--seq", "128", "--global-batch", "24", *pins]}
    lines = {}
    for name, cmd in runs.items():
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        mine = [x for x in r.stderr.splitlines() if x.startswith("mpi-tp: error:")]
        assert r.returncode == 2 and len(mine) == 1, (name, r.stdout, r.stderr)
        lines[name] = mine[0]
    assert len(set(lines.values())) == 1, lines
    assert RULE in lines["train"] and "Traceback" not in lines["train"]
