"""`mpi-tp plan`'s table: a readable FLOP/s unit, a legend for every column, the same legend in the docs."""
import argparse
import os

from mpi4py import MPI

from mpi_tp.planning.costmodel import Workload
from mpi_tp.planning.machines import PRESETS, Machine
from mpi_tp.planning.plan_table import LEGEND, flops_unit, legend, table
from mpi_tp.planning.planner import plan

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
    """Each header of the table is named by one LEGEND entry, in order (FLOP/s with its prefix, GB/rank
    as MB/rank under 1 GB); --legend prints them all."""
    w = Workload(4, 512, 8, 128, 16, vocab=256)
    text = table(CPU, w, 1, plan(CPU, w, 1, top=2))
    header = text.splitlines()[1]
    names = [name for name, _ in LEGEND]
    shown = {"FLOP/s": "GFLOP/s", "GB/rank": "GB/rank" if "GB/rank" in header else "MB/rank",
             "step s": "step s" if "step s" in header else "step ms"}
    at = [header.find(shown.get(name, name)) for name in names]
    assert all(i >= 0 for i in at) and at == sorted(at), (names, header)
    for name, _ in LEGEND:
        assert f"  {name} " in legend()


def test_the_docs_show_the_printed_legend():
    """docs/costmodel.md quotes `mpi-tp plan --legend` as printed, so the two cannot drift apart."""
    with open(os.path.join(ROOT, "docs", "costmodel.md")) as f:
        assert legend() in f.read()


def test_plan_command_prints_the_legend_on_request(capsys):
    from mpi_tp.commands.plan import add_parser
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    base = ["plan", "--machine", "dgx-a100", "--layers", "4", "--hidden", "512", "--heads", "8", "--seq", "128",
            "--global-batch", "16", "--top", "2"]
    for extra, expect in (([], "(mpi-tp plan --legend explains every column)"), (["--legend"], legend())):
        args = ap.parse_args(base + extra)
        assert args.run(args, MPI.COMM_SELF) == 0
        out = capsys.readouterr().out
        assert expect in out and "L=4, C=512, H=8, S=128" in out


def _plan_parser():
    from mpi_tp.commands.plan import add_parser
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    return ap


def test_legend_alone_needs_no_model(capsys):
    """`mpi-tp plan --legend` with no model prints the legend alone and exits 0."""
    args = _plan_parser().parse_args(["plan", "--legend"])
    assert args.run(args, MPI.COMM_SELF) == 0
    assert capsys.readouterr().out == legend() + "\n"


def test_without_the_model_plan_says_which_arguments_are_required(capsys):
    """Without --legend (or with only part of the model) the model's flags stay required: argparse's
    one-line error, exit status 2."""
    import pytest
    for argv, missing in ((["plan"], "--layers, --hidden, --heads, --seq, --global-batch"),
                          (["plan", "--legend", "--layers", "4", "--hidden", "512"], "--heads, --seq, --global-batch")):
        args = _plan_parser().parse_args(argv)
        with pytest.raises(SystemExit) as e:
            args.run(args, MPI.COMM_SELF)
        assert e.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].endswith(f" plan: error: the following arguments are required: "
                                                       f"{missing}"), errors


def test_small_models_print_in_millions_and_megabytes():
    from mpi_tp.planning.plan_table import memory_unit, params_text, size_text
    assert params_text(3.2e4) == "0.03M" and params_text(1.32e9) == "1.32B" and params_text(2.6e7) == "26.00M"
    assert size_text(3.1e8) == "310.0 MB" and size_text(1.52e10) == "15.2 GB"
    assert memory_unit([3e8, 9e8]) == (1e6, "MB/rank") and memory_unit([3e8, 2e9]) == (1e9, "GB/rank")
    w = Workload(2, 64, 4, 32, 8, vocab=256)
    result = plan(CPU, w, 1, top=2)
    text = table(CPU, w, 1, result)
    assert f"model {w.params / 1e6:.2f}M parameters" in text and "0.00B" not in text
    assert "MB/rank" in text.splitlines()[1] and "GB/rank" not in text
    assert " MB per rank" in result["why"]


def test_small_models_are_timed_in_milliseconds():
    """A laptop-sized model's steps take milliseconds: the table says so instead of printing 0.000."""
    from mpi_tp.planning.plan_table import time_unit
    assert time_unit([0.05, 0.002]) == (1e-3, "step ms") and time_unit([0.05, 0.2]) == (1.0, "step s")
    w = Workload(2, 64, 4, 64, 4, vocab=256)
    result = plan(CPU, w, 1, top=2)
    header, first = table(CPU, w, 1, result).splitlines()[1:3]
    t = result["ranked"][0]["time"]
    assert t["total"] < 0.1 and "step ms" in header and "step s " not in header
    assert f"{1e3 * t['total']:>8.3f} {1e3 * t['compute']:>8.3f}" in first, first
    assert f"{1e3 * t['total']:.3f} ms per step" in result["why"], result["why"]
