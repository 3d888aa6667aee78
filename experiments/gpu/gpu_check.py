"""The GPU check: what a GPU must show about the CuPy path, in one command, in under ten minutes.

    bash experiments/gpu/gpu_check.sh [--out DIR]        on a machine with an NVIDIA GPU (pip install -e .[gpu,test])
    python experiments/gpu/gpu_check.py --standin        the same checks on the host stand-in for CuPy (a dry run)

1. The machine: GPU, CUDA, CuPy, MPI and mpi4py versions, and what MPI says about CUDA support.
2. Every test that uses real CuPy (tests/test_gpu.py, the kernels' and the segment sum's CuPy tests) at
   1 rank, and tests/test_gpu.py at 2 and 4 ranks sharing the GPU. A test skipped for want of CuPy or a
   GPU is a failure here.
3. Training on the GPU against NumPy (float64, dropout on, 6 steps of AdamW) at 2 ranks: TP with SP,
   DP with the overlapped all-reduce, ZeRO-1, a 1F1B pipeline, experts over ep 2: losses and the
   final checkpoint (weights and AdamW moments) to 1e-8 relative. Then each layout pre-empted at
   step 3 (SIGTERM) and resumed: its final checkpoint bit for bit the uninterrupted GPU run's.
4. bench on the GPU at 1 and 2 ranks (training steps, cached decoding, experts), figures kept.
5. Greedy decoding (generate) at 1 and 2 ranks and a 2-rank server: the NumPy model's text.
Checks at 2 or more ranks run twice, MPI_TP_CUDA_AWARE=0 (every buffer staged through host memory)
and =1 (device buffers to MPI): the second only where the MPI library says it is CUDA-aware
(it crashes otherwise); the report says which.

Writes OUT/report.md (a table: check, result, seconds, what was compared), OUT/report.json and a log
per check under OUT/logs; prints a line per check as it goes; exits 1 if any check failed. With
--standin every check runs on mpi_tp.core.standin instead (the CuPy-only kernel tests are left
out: they import CuPy themselves): what that proves and what it cannot, docs/clusters.md.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import h5py
import numpy
from gpu_check_runner import ROOT, Check, must, write_report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serving"))
from serve_harness import Server  # noqa: E402  (experiments/serving/serve_harness.py)

MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "32", "--batch-size", "4",
         "--dtype", "float64", "--dropout", "0.1", "--steps", "6", "--save-every", "3", "--log-every", "1",
         "--eval-every", "100", "--sample-len", "0", "--seed", "3"]
LAYOUTS = {"tp2-sp": ["--tp", "2", "--sequence-parallel"], "dp2-overlap": ["--dp", "2"],
           "dp2-zero1": ["--dp", "2", "--zero", "1"], "pp2-1f1b": ["--pp", "2", "--micro-batches", "2"],
           "moe-ep2": ["--dp", "2", "--ep", "2", "--moe-experts", "4", "--moe-top-k", "2"]}
TOLERANCE = 1e-8


def machine(c: Check) -> dict:
    """Versions and devices, asked of a 1-rank Python under the check's own environment."""
    probe = ("import json, numpy, mpi4py; from mpi4py import MPI; from mpi_tp.core import backend;"
             "from mpi_tp.core.gpu import cuda_aware_mpi; from mpi_tp.core.mpi_library import library_version;"
             "backend.use('cupy'); import cupy;"
             "rt = cupy.cuda.runtime; p = rt.getDeviceProperties(0);"
             "print(json.dumps({'gpu': p['name'].decode() if isinstance(p['name'], bytes) else str(p['name']),"
             "'gpus': rt.getDeviceCount(), 'gpu_memory_gib': round(p['totalGlobalMem'] / 2**30, 1),"
             "'cuda_runtime': rt.runtimeGetVersion(), 'cuda_driver': rt.driverGetVersion(),"
             "'cupy': cupy.__version__, 'numpy': numpy.__version__, 'mpi4py': mpi4py.__version__,"
             "'mpi': library_version(), 'mpi_cuda_aware': cuda_aware_mpi()}))")
    rc, text = c.run("machine", 1, ["-c", probe], c.env(aware=None))
    must(rc, text, "CuPy on this machine")
    info = json.loads(text.strip().splitlines()[-1])
    info["standin"] = c.standin
    return info


def pytest_check(name: str, c: Check, n: int, files: list[str], aware: str) -> str:
    rc, text = c.run(name, n, ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--with-mpi", *files],
                     c.env(aware))
    gpu_skips = [line for line in text.splitlines() if line.startswith("SKIPPED") and re.search("cupy|GPU", line)]
    assert not gpu_skips, f"tests skipped for want of CuPy or a GPU: {gpu_skips[0]}"
    must(rc, text, "pytest")
    closing = re.findall(r"^=*\s*(\d+ passed.*) in [\d.]+s", text, re.MULTILINE)
    assert closing, "no test passed"
    return closing[-1].strip("= ")


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def arrays(step: Path) -> dict:
    """Every numeric dataset of a checkpoint's files, by file and name."""
    out = {}
    def keep(file, key, obj):
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "fiu":
            out[f"{file}:{key}"] = obj[()]
    for f in sorted(step.glob("*.h5")):
        with h5py.File(f, "r") as h:
            h.visititems(lambda key, obj, file=f.name: keep(file, key, obj))
    return out


def last_step(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def train(c: Check, log: str, run: Path, layout: str, backend: str, aware: str, *more, **env) -> tuple[int, str]:
    rc, text = c.run(log, 2, ["train", *MODEL, *LAYOUTS[layout], "--backend", backend, "--out", str(run), *more],
                     c.env(aware, **env))
    return rc, text


def numpy_run(c: Check, log: str, layout: str) -> Path:
    """The layout's NumPy run (trained the first time a check asks for it)."""
    ref = c.out / "runs" / f"{layout}-numpy"
    if not (ref / "checkpoints" / "latest").exists():
        must(*train(c, log, ref, layout, "numpy", "0", "--overwrite"), "the NumPy run")
    return ref


def train_check(name: str, c: Check, layout: str, aware: str) -> str:
    ref, gpu = numpy_run(c, name, layout), c.out / "runs" / f"{layout}-cupy-aware{aware}"
    must(*train(c, name, gpu, layout, "cupy", aware, "--overwrite"), "the GPU run")
    a, b = numpy.array(losses(ref)), numpy.array(losses(gpu))
    assert a.shape == b.shape == (6,), f"losses logged: {a.shape[0]} NumPy, {b.shape[0]} GPU (6 expected)"
    loss_diff = float(numpy.max(numpy.abs(a - b) / numpy.abs(a)))
    wa, wb = arrays(last_step(ref)), arrays(last_step(gpu))
    assert wa.keys() == wb.keys(), f"checkpoint datasets differ: {sorted(wa.keys() ^ wb.keys())[:3]}"
    diffs = {k: float(numpy.max(numpy.abs(wa[k] - wb[k])) / max(float(numpy.max(numpy.abs(wa[k]))), 1e-300))
             for k in wa if wa[k].dtype.kind == "f" and wa[k].size}
    worst = max(diffs, key=diffs.get)
    assert loss_diff <= TOLERANCE and diffs[worst] <= TOLERANCE, \
        f"GPU vs NumPy: losses {loss_diff:.1e}, {worst} {diffs[worst]:.1e} (tolerance {TOLERANCE:g})"
    return f"losses {loss_diff:.1e}, checkpoint {diffs[worst]:.1e} max relative difference vs NumPy"


def resume_check(name: str, c: Check, layout: str) -> str:
    whole, cut = c.out / "runs" / f"{layout}-cupy-aware0", c.out / "runs" / f"{layout}-cupy-resumed"
    assert whole.exists(), "the uninterrupted GPU run is missing (its check failed or did not run)"
    rc, _ = train(c, name, cut, layout, "cupy", "0", "--overwrite", MPI_TP_FAILPOINT="sigterm:3")
    assert last_step(cut).name == "step-00000003", f"pre-empted at step 3, saved {last_step(cut).name} (exit {rc})"
    must(*train(c, name, cut, layout, "cupy", "0", "--resume"), "the resumed run")
    wa, wb = arrays(last_step(whole)), arrays(last_step(cut))
    same = wa.keys() == wb.keys() and all(numpy.array_equal(wa[k], wb[k]) for k in wa)
    differ = [k for k in wa if k in wb and not numpy.array_equal(wa[k], wb[k])]
    assert same, f"resumed run differs from the uninterrupted one: {differ[:3] or 'datasets'}"
    assert losses(cut)[-3:] == losses(whole)[-3:], "losses of steps 4-6 differ"
    return f"step 6 bit for bit the uninterrupted run's ({len(wa)} datasets)"


def bench_check(name: str, c: Check, n: int, aware: str, *args: str) -> str:
    figures = c.out / "bench.jsonl"
    before = len(figures.read_text().splitlines()) if figures.exists() else 0
    rc, text = c.run(name, n, ["bench", "--backend", "cupy", *args, "--json", str(figures)], c.env(aware))
    must(rc, text, "bench")
    rows = [json.loads(line) for line in figures.read_text().splitlines()[before:]]
    assert rows, "bench wrote no figures"
    speed = [f"{r['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in r else
             f"MoE step {r['moe']['step_ms']['median']:.1f} ms, dense {r['dense']['step_ms']['median']:.1f} ms"
             for r in rows]
    return ", ".join(speed) + " (bench.jsonl)"


SAMPLED = ["--temperature", "1", "--seed", "5"]     # seeded sampling reads every probability, not only the top


def text_of(c: Check, name: str, n: int, ckpt: Path, backend: str, aware: str, *how: str) -> list[str]:
    rc, text = c.run(name, n, ["generate", "--checkpoint", str(ckpt), "--max-new-tokens", "24", "--dtype",
                               "float64", "--backend", backend, *(how or ["--greedy"])], c.env(aware))
    must(rc, text, f"generate on {backend}")
    return [line for line in text.splitlines() if line.strip() and not line.startswith(("mpi_tp", "loaded"))]


def decode_check(name: str, c: Check, n: int, aware: str) -> str:
    ckpt = last_step(numpy_run(c, name, "dp2-overlap"))
    for how in ([], SAMPLED):
        want, got = text_of(c, name, 1, ckpt, "numpy", "0", *how), text_of(c, name, n, ckpt, "cupy", aware, *how)
        assert want == got, f"{' '.join(how) or 'greedy'}: GPU text {got[-1:]} differs from NumPy's {want[-1:]}"
    return f"greedy and sampled text equal to NumPy's: {got[-1][:50]!r}"


def served(c: Check, name: str, ckpt: Path, backend: str, aware: str) -> list[str]:
    """A 2-rank server's answers to a greedy and a seeded sampled request; it must stop with status 0 at the
    stop signal sent to mpiexec (SIGUSR1: serve_harness.Server.stop)."""
    server = Server(str(ckpt), ["--dtype", "float64", "--backend", backend], c.out / "logs", env=c.env(aware))
    try:
        texts = []
        for how in ({"temperature": 0}, {"temperature": 1, "seed": 5}):
            body = json.dumps({"prompt": "The ", "max_tokens": 24, **how}).encode()
            url = f"http://{server.host}:{server.port}/v1/completions"
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=120) as r:
                texts.append(json.loads(r.read())["choices"][0]["text"])
    finally:
        status = server.stop(timeout=60)
    assert status == 0, f"the {backend} server's exit status after SIGUSR1: {status}\n{server.log_tail()}"
    return texts


def serve_check(name: str, c: Check, aware: str) -> str:
    ckpt = last_step(numpy_run(c, name, "dp2-overlap"))
    want, got = served(c, name, ckpt, "numpy", "0"), served(c, name, ckpt, "cupy", aware)
    assert want == got, f"the GPU server answered {got}, the NumPy one {want}"
    return f"greedy and sampled answers equal to a NumPy server's; both stopped by SIGUSR1: {got[1][:30]!r}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="report folder (default gpu_check-<date-time>); must not exist")
    ap.add_argument("--standin", action="store_true", help="run on the host stand-in for CuPy (no GPU needed)")
    ap.add_argument("--only", default="", help="a regular expression: run only the checks whose name it finds")
    ap.add_argument("--budget", type=float, default=570, help="seconds; checks not started by then: NOT RUN")
    args = ap.parse_args(argv)
    try:
        re.compile(args.only)
    except re.error as e:
        ap.error(f"--only {args.only!r} is not a regular expression ({e})")
    out = args.out or ROOT / time.strftime("gpu_check-%Y%m%d-%H%M%S")
    if out.exists():
        print(f"gpu_check: {out} exists; give a new --out")
        return 2
    c = Check(out, args.standin, args.budget)
    wanted = lambda name: re.search(args.only, name) is not None
    info = {}
    try:
        info = machine(c)
        print("machine:", json.dumps(info), flush=True)
    except AssertionError as e:
        c.rows.append({"check": "machine", "result": "FAILED", "seconds": 0.0, "detail": str(e)})
        print("gpu_check: FAILED: CuPy does not start here:", e)
    modes = ["0"] + (["1"] if info.get("mpi_cuda_aware") or args.standin else [])
    checks = [("tests, 1 rank", pytest_check, 1, ["tests/test_gpu.py"] + ([] if args.standin else
               ["tests/test_kernels_more.py", "tests/test_segment.py"]), "0")]
    checks += [(f"tests, {n} ranks, aware {a}", pytest_check, n, ["tests/test_gpu.py"], a)
               for a in modes for n in (2, 4) if n == 2 or a == "0"]
    checks += [(f"train {lay}, aware {a}", train_check, lay, a) for lay in LAYOUTS for a in modes]
    checks += [(f"resume {lay}", resume_check, lay) for lay in LAYOUTS]
    checks += [("bench step, 1 rank", bench_check, 1, "0", "--shape", "c", "--steps", "5")]
    checks += [(f"bench {what}, 2 ranks, aware {a}", bench_check, 2, a, *flags) for a in modes for what, flags in
               (("step tp2", ["--shape", "c", "--steps", "5"]), ("step dp2 zero1", ["--shape", "a", "--dp", "2",
                "--zero", "1", "--steps", "5"]), ("decode", ["--inference", "--shape", "a", "--repeats", "1"]),
                ("moe", ["--moe", "--shape", "a", "--steps", "3"]))]
    checks += [("decode, 1 rank", decode_check, 1, "0")] + [(f"decode, 2 ranks, aware {a}", decode_check, 2, a)
                                                            for a in modes]
    checks += [(f"serve, 2 ranks, aware {a}", serve_check, a) for a in modes]
    for name, fn, *rest in filter(lambda check: wanted(check[0]), checks):
        if not info:
            c.rows.append({"check": name, "result": "NOT RUN", "seconds": 0.0, "detail": "CuPy does not start"})
        else:
            c.row(name, fn, *rest)
    if "1" not in modes:
        c.na("everything with aware 1", "MPI says it is not CUDA-aware (MPIX_Query_cuda_support): staged only")
    write_report(out, info, c.rows, args)
    failed = [r["check"] for r in c.rows if r["result"] in ("FAILED", "NOT RUN")]
    print(f"gpu_check: {sum(r['result'] == 'ok' for r in c.rows)} ok, {len(failed)} failed or not run"
          f"{': ' + '; '.join(failed) if failed else ''}; report {out / 'report.md'}")
    shutil.rmtree(out / "runs", ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
