"""`mpi-tp plan` on the inputs a new user gives it (issue 25): every bad one is one line and exit 2, an empty
search says why, any input ends (a huge batch included), every choice can be pinned, one layout can be
explained, uneven stages are searched, and groups are priced by the links their members cross."""
import subprocess
import sys

import pytest

from mpi_tp.planning.costmodel import Plan, Workload, step_time
from mpi_tp.planning.machines import PRESETS, Machine
from mpi_tp.planning.planner import candidates, plan

MODEL = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--global-batch", "8"]


def run_plan(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpi_tp", "plan", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(r, says):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and says in r.stderr, r.stderr


def test_a_machine_that_is_a_folder_or_an_empty_file_is_one_line(tmp_path):
    one_line_error(run_plan("--machine", str(tmp_path), *MODEL), "is a folder")
    empty = tmp_path / "m.json"
    empty.write_text("{}")
    one_line_error(run_plan("--machine", str(empty), *MODEL), "lacks name, ranks_per_node")
    empty.write_text("[1, 2]")
    one_line_error(run_plan("--machine", str(empty), *MODEL), "must hold a JSON object")


@pytest.mark.parametrize("flag,value,says", [("--tp", "-2", "--tp must be at least 1"),
                                             ("--tp", "0", "--tp must be at least 1"),
                                             ("--pp", "0", "--pp must be at least 1"),
                                             ("--max-tp", "0", "--max-tp must be at least 1"),
                                             ("--micro-batch", "-1", "--micro-batch must be at least 1"),
                                             ("--cp", "0", "--cp must be at least 1"),
                                             ("--hidden", "250", "--hidden 250 is not a multiple of --heads 4")])
def test_bad_numbers_are_one_line(flag, value, says):
    args = [a for a in MODEL]
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    one_line_error(run_plan(*args), says)


def test_an_empty_search_says_why(tmp_path):
    seven = tmp_path / "seven.json"
    Machine(name="seven", ranks_per_node=7, gemm_flops=1e11, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
            intra_alpha=1e-5, intra_bw=1e10, inter_alpha=1e-4, inter_bw=1e9).save(str(seven))
    r = run_plan("--machine", str(seven), *MODEL)                # 7 ranks: 4 heads, 4 layers, a batch of 8
    one_line_error(r, "no layout of 7 ranks can be expressed")
    r = run_plan(*MODEL, "--tp", "16")                          # 16 > 4 heads
    one_line_error(r, "no layout of 8 ranks can be expressed")


def test_a_huge_batch_ends():
    r = run_plan("--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--global-batch",
                 "400000000", "--top", "1", timeout=300)
    assert r.returncode == 0 and "tp" in r.stdout, r.stderr


def test_the_table_reads_well():
    r = run_plan("--machine", "dgx-a100", "--nodes", "2", "--layers", "32", "--hidden", "4096", "--heads", "32",
                 "--seq", "65536", "--global-batch", "64", "--top", "8", "--recompute", "--sp", "--zero", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header, rows = lines[1], [x for x in lines[2:] if x[:3].strip().isdigit() and x[4:6] == "tp"]
    ends = [header.index(c) + len(c) for c in ("step s", "compute", "of peak")]
    for row in rows:                                         # the columns stay under their headers
        assert all(row[e - 1] != " " and (e == len(row) or row[e] == " ") for e in ends[:2]), (header, row)
    assert "(1 ranks)" not in r.stdout


def test_every_choice_can_be_pinned():
    m, w = PRESETS["dgx-a100"], Workload(n_layer=24, n_embd=2048, n_head=16, seq=2048, global_batch=64)
    r = plan(m, w, 2, top=50, recomputes=(True,), sp=(True,), zeros=(1,), schedules=("interleaved",), virtual=2)
    assert r["all"] and all(x["layout"].recompute and x["layout"].virtual == 2 for x in r["all"])
    assert all(x["layout"].sp for x in r["all"] if x["layout"].tp > 1)
    assert all(x["layout"].zero for x in r["all"] if x["layout"].dp > 1)
    text = run_plan("--machine", "dgx-a100", "--nodes", "2", "--layers", "24", "--hidden", "2048", "--heads", "16",
                    "--seq", "2048", "--global-batch", "64", "--explain", "tp4 pp4 dp1 b1 v2 +sp +recompute")
    assert text.returncode == 0 and "tp4 pp4 dp1 b1 v2 +sp +recompute" in text.stdout and "compute" in text.stdout, \
        text.stderr
    bad = run_plan(*MODEL, "--explain", "tp3 pp1 dp1 b1")
    one_line_error(bad, "tp3 pp1 dp1 b1")


def test_explain_prints_seconds_and_the_micro_batch_count_apart():
    """--explain printed the micro-batch count with the step's parts, in seconds ("micro_batches 16 s")."""
    r = run_plan("--machine", "dgx-a100", "--layers", "24", "--hidden", "1024", "--heads", "16", "--seq", "1024",
                 "--global-batch", "64", "--explain", "tp2 pp2 dp2 b2")
    assert r.returncode == 0, r.stderr
    assert "  micro_batches 16 per replica and step\n" in r.stdout, r.stdout           # 64 / (dp 2 x b 2)
    parts = [line.split() for line in r.stdout.splitlines()[1:] if line.startswith("  ") and "memory" not in line
             and "micro_batches" not in line and "w_share" not in line and "stay" not in line]
    assert parts and all(len(p) == 3 and p[2] == "s" and float(p[1]) >= 0 for p in parts), r.stdout


def test_uneven_stages_are_searched():
    """A 70-layer model on 384 GPUs (48 DGX A100 nodes): its published layout, 4 x 12 x 8, is a candidate."""
    w = Workload(n_layer=70, n_embd=14336, n_head=112, seq=2048, global_batch=2048, vocab=250880)
    found = [lay for lay in candidates(w, 384, 8, tp_only=4, pp_only=12, micro_only=2, sp=(False,), zeros=(0,),
                                       recomputes=(True,), cp_only=1)]
    assert found and all(lay.dp == 8 for lay in found)


def test_groups_are_priced_by_the_links_they_cross():
    """tp 6 on 8-GPU nodes: some groups straddle two nodes, so every tensor-parallel collective waits on the
    network; tp 7 on single-GPU nodes likewise; tp 4 stays inside."""
    m = PRESETS["dgx-a100"]
    w = Workload(n_layer=4, n_embd=1536, n_head=12, seq=512, global_batch=48)
    t6 = step_time(m, w, Plan(tp=6, dp=4))
    t4 = step_time(m, w, Plan(tp=4, dp=6))
    inside = step_time(m, w, Plan(tp=6, dp=4), per_node=12)         # 12 GPUs a node: inside
    assert t6["links"]["tp"] == "network" and t4["links"]["tp"] == "node" and inside["links"]["tp"] == "node"
    assert t6["tp_comm"] > 2 * inside["tp_comm"]
    single = Machine(**{**m.__dict__, "ranks_per_node": 1})
    assert step_time(single, Workload(4, 1536, 14, 512, 7), Plan(tp=7))["links"]["tp"] == "network"
    text = run_plan("--machine", "dgx-a100", "--nodes", "3", "--layers", "4", "--hidden", "1536", "--heads", "12",
                    "--seq", "512", "--global-batch", "48", "--tp", "6", "--top", "1")
    assert text.returncode == 0 and "stay inside a node" not in text.stdout and "cross" in text.stdout, text.stdout


def test_experts_are_priced_and_planned(tmp_path):
    """A mixture of experts: the experts' GEMMs k times, 4 all-to-alls per MoE block and micro-batch over the
    ep group (k B S C (ep-1)/ep values from a rank), E / ep experts' parameters per rank; the planner searches
    ep with ep x etp dividing tp x cp x dp (Megatron's rule) and emits a config `mpi-tp train` accepts."""
    from mpi_tp.planning.memory import params_per_rank
    m = Machine(name="t", ranks_per_node=8, gemm_flops=1e11, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e12,
                intra_alpha=1e-5, intra_bw=1e10, inter_alpha=1e-4, inter_bw=1e9)
    w = Workload(n_layer=4, n_embd=64, n_head=4, seq=32, global_batch=8, experts=4, top_k=2, moe_every=2)
    dense = Workload(n_layer=4, n_embd=64, n_head=4, seq=32, global_batch=8)
    one, two = (step_time(m, w, Plan(dp=4, ep=e, micro_batch=2)) for e in (1, 2))
    assert one["ep_comm"] == 0 and two["ep_comm"] == pytest.approx(1 * 2 * 4 * (1e-5 + 2 * 2 * 32 * 64 * 4 / 2 / 1e10))
    assert one["compute"] > step_time(m, dense, Plan(dp=4, micro_batch=2))["compute"]      # k = 2 expert passes
    assert params_per_rank(w, Plan(dp=4, ep=2)) < params_per_rank(w, Plan(dp=4, ep=1))
    assert w.params > dense.params
    r = plan(m, w, 1, top=100)
    stage = (lambda lay: lay.tp * lay.cp * lay.dp)              # ep x etp divides a stage's ranks (expert_grid)
    assert {x["layout"].ep for x in r["all"]} >= {1, 2, 4} and \
        all(stage(x["layout"]) % (x["layout"].ep * x["layout"].expert_tp) == 0 for x in r["all"])
    out = tmp_path / "moe.json"
    text = run_plan("--machine", "dgx-a100", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128",
                    "--global-batch", "8", "--experts", "4", "--top-k", "2", "--moe-every", "2", "--ep", "2",
                    "--emit-config", str(out))
    assert text.returncode == 0 and " ep2 " in text.stdout, text.stderr
    import json
    assert json.loads(out.read_text())["ep"] == 2 and json.loads(out.read_text())["moe_experts"] == 4
    one_line_error(run_plan(*MODEL, "--ep", "2"), "--ep needs a mixture of experts")
