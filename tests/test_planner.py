"""`mpi-tp plan`'s table: a readable FLOP/s unit, a legend for every column, the same legend in the docs."""
import argparse
import os

from mpi4py import MPI

from mpi_tp.planning.costmodel import Workload
from mpi_tp.planning.machines import PRESETS, Machine
from mpi_tp.planning.planner import LEGEND, flops_unit, legend, plan, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = Machine(name="cpu", ranks_per_node=2, gemm_flops=8e10, elem_rate=3e8, mem_bw=8e9, mem_bytes=1e10,
              intra_alpha=5e-6, intra_bw=3e9, inter_alpha=5e-6, inter_bw=3e9)


def test_flops_unit_keeps_numbers_readable():
    assert flops_unit([1.4e14, 2e13]) == (1e12, "TFLOP/s")
    assert flops_unit([4e10]) == (1e9, "GFLOP/s")
    assert flops_unit([1e9]) == (1e9, "GFLOP/s")
    assert flops_unit([3e8]) == (1e6, "MFLOP/s")
    assert flops_unit([]) == (1e6, "MFLOP/s")


def _header(m, w, nodes):
    text = table(m, w, nodes, plan(m, w, nodes, top=3))
    return text.splitlines()[1].split()


def test_cpu_plans_in_gflops_and_gpus_in_tflops():
    w = Workload(4, 512, 8, 128, 16, vocab=256)
    cpu = _header(CPU, w, 1)
    assert "GFLOP/s" in cpu and "TFLOP/s" not in cpu
    big = Workload(24, 2048, 16, 1024, 64, vocab=51200)
    assert "TFLOP/s" in _header(PRESETS["dgx-a100"], big, 1)


def test_every_column_has_a_legend_line():
    """Each header of the table is named by one LEGEND entry, in order; --legend prints them all."""
    w = Workload(4, 512, 8, 128, 16, vocab=256)
    text = table(CPU, w, 1, plan(CPU, w, 1, top=2))
    header = text.splitlines()[1]
    names = [name for name, _ in LEGEND]
    at = [header.find(name if name != "FLOP/s" else "GFLOP/s") for name in names]
    assert all(i >= 0 for i in at) and at == sorted(at), (names, header)
    for name, _ in LEGEND:
        assert f"  {name} " in legend()


def test_the_docs_show_the_printed_legend():
    """docs/costmodel.md quotes `mpi-tp plan --legend` as printed, so the two cannot drift apart."""
    with open(os.path.join(ROOT, "docs", "costmodel.md")) as f:
        assert legend() in f.read()


def test_plan_command_prints_the_legend_on_request(capsys):
    from mpi_tp.planning.planner import add_parser
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    base = ["plan", "--machine", "dgx-a100", "--layers", "4", "--hidden", "512", "--heads", "8", "--seq", "128",
            "--global-batch", "16", "--top", "2"]
    for extra, expect in (([], "(mpi-tp plan --legend explains every column)"), (["--legend"], legend())):
        args = ap.parse_args(base + extra)
        assert args.run(args, MPI.COMM_SELF) == 0
        out = capsys.readouterr().out
        assert expect in out and "L=4, C=512, H=8, S=128" in out
