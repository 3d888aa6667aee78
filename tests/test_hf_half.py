"""bf16 Hugging Face folders (issue 37): imported without widening, exported back byte for byte, computed as
transformers' own bf16 forward computes them; export --dtype; --precision's one-line refusals.

    python -m pytest -q --with-mpi tests/test_hf_half.py
    mpiexec -n 3 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_hf_half.py

The folders are transformers' GPT-2 and Llama (tests/test_hf.py's tiny random ones) saved by save_pretrained in
bfloat16. The logits bound comes from the format, as in tests/test_precision_infer.py: both forwards round
the residual stream to bf16 2L + 3 times (after the embedding, each residual addition, the final norm, the
logits), each within half an ulp (2^-9 of a value's scale), but in different places (transformers rounds
q k^T and the probabilities to bf16 too; mpi_tp keeps the attention in fp32, as its training does), so they
differ by at most (2L + 3) ulps of the logits' largest magnitude: 7 x 2^-8 at L = 2. Measured: 2.7 ulps
(GPT-2) and 2.7 (Llama) serially, at most 2.6 and 3.3 at tp 2 and 3. And mpi_tp's bf16 model is at least as accurate as transformers': against the
exact (float64) forward of the same bf16 weights its error is at most transformers' plus one ulp (measured
2.0 against 2.3).
"""
import json
import os

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from mpi4py import MPI  # noqa: E402
from test_hf import (  # noqa: E402,F401 (shared_dir: the fixture)
    IDS,
    ORACLE,
    numpy_folder,
    shared_dir,
    transformers_folder,
    write_bf16,
)

from mpi_tp import checkpoint as ck  # noqa: E402
from mpi_tp.checkpoint.hf import HFFolder  # noqa: E402
from mpi_tp.checkpoint.hf.names import hf_shapes  # noqa: E402
from mpi_tp.checkpoint.hf.write import export  # noqa: E402
from mpi_tp.checkpoint.model import load_model  # noqa: E402
from mpi_tp.commands.cli import main  # noqa: E402
from mpi_tp.commands.hf import import_folder  # noqa: E402
from mpi_tp.core.testing import all_true, from_rank0  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402

needs_oracle = pytest.mark.skipif(not ORACLE, reason="the transformers oracle is not installed "
                                  "(pip install -e '.[hf-oracle]')")
ULP = 2.0**-8                     # bf16's spacing relative to a value's scale
BF16 = np.dtype(ml_dtypes.bfloat16)
CFG = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=5, n_embd=20)     # test_hf's GPT-2 folder's


def raw_tensors(folder: str) -> dict:
    """{tensor: (safetensors dtype, shape, its bytes)} of every safetensors file in folder, read by hand
    (safetensors' NumPy reader has no BF16)."""
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with open(os.path.join(folder, file), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header, data = json.loads(f.read(n)), f.read()
        for name, t in header.items():
            if name != "__metadata__":
                begin, end = t["data_offsets"]
                out[name] = (t["dtype"], tuple(t["shape"]), data[begin:end])
    return out


def bf16_folder(path: str, arch: str):
    """transformers' tiny GPT-2 or Llama (float64 weights, test_hf) saved in bfloat16 at path; the bf16 model."""
    import torch
    model = transformers_folder(path + ".f64", arch=arch).to(torch.bfloat16)
    model.save_pretrained(path)
    return model


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_bf16_folder_imports_as_bf16_and_exports_byte_for_byte(world, shared_dir, arch):  # noqa: F811
    folder, out, back = (os.path.join(shared_dir, n) for n in ("bf16", "imported", "back"))
    from_rank0(lambda: bf16_folder(folder, arch) and None, world)
    import_folder(folder, out, world)                         # the default: the folder's format
    ok = True
    if world.Get_rank() == 0:
        with ck.Checkpoint(out) as c:
            assert c.meta["dtypes"] == "bfloat16" and {t["dtype"] for t in c.tensors.values()} == {"bfloat16"}
            assert len(c.shards) == world.Get_size()
            export(c, back)
        with open(os.path.join(back, "config.json")) as f:
            assert json.load(f)["torch_dtype"] == "bfloat16"
        theirs, ours = raw_tensors(folder), raw_tensors(back)
        assert {d for d, _, _ in theirs.values()} == {"BF16"} and set(theirs) == set(ours), set(theirs) ^ set(ours)
        ok = all(ours[name] == t for name, t in theirs.items())        # dtype, shape and bytes
    assert all_true(ok, world), "an exported tensor's bytes differ from the folder's"


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_logits_against_transformers_bf16(world, shared_dir, arch):  # noqa: F811
    folder = os.path.join(shared_dir, "bf16")
    lengths = (1, 4, 17, 32)

    def oracle():
        import torch
        model = bf16_folder(folder, arch)
        with torch.no_grad():
            return {S: model(torch.tensor(IDS[:, :S])).logits.float().numpy() for S in lengths}
    ref = from_rank0(oracle, world)
    model, c = load_model(folder, world)                       # as the folder is: bf16
    exact, _ = load_model(folder, world, "float64")            # the same bf16 weights, exactly, in float64
    assert model.dtype == BF16 and c.meta["dtypes"] == "bfloat16" and model.topo.tp.size == world.Get_size()
    worst = 0.0
    for S in lengths:
        ours, r64 = model.full_logits(IDS[:, :S]).astype(np.float64), exact.full_logits(IDS[:, :S])
        ulp = ULP * float(np.abs(r64).max())
        worst = max(worst, float(np.abs(ours - ref[S]).max()) / ulp)
        # ours may round more than transformers' serial forward: at T ranks each row-parallel layer's partial
        # sums are rounded on every rank and summed in bf16 (T - 1 roundings more): one ulp per rank allowed
        T = model.topo.tp.size
        assert np.abs(ours - r64).max() <= np.abs(ref[S] - r64).max() + T * ulp, S
    assert all_true(worst <= 2 * CFG.n_layer + 3, world), f"{worst:.2f} ulps from transformers' bf16 logits"


# ---------------------------------------------------------------- export --dtype

def imported(tmp_path, dtype=np.float32, values=None):
    """A GPT-2 folder of `dtype` written with safetensors (or `values` bf16, by hand), imported serially."""
    folder, out = str(tmp_path / "folder"), str(tmp_path / "imported")
    tensors = numpy_folder(folder, dtype=dtype)
    if values is not None:
        tensors = write_bf16(os.path.join(folder, "model.safetensors"), values)
    import_folder(folder, out, MPI.COMM_SELF)
    return out, tensors


@pytest.mark.parametrize("dtype, code", [("bfloat16", "BF16"), ("float16", "F16"), ("float64", "F64")])
def test_export_dtype_converts_each_value_once(tmp_path, dtype, code):
    """An fp32 checkpoint exported in another format: every value the nearest of that format (ties to even):
    bit for bit torch's conversion of the same fp32 values (bf16 with the oracle), NumPy's (fp16), exact (f64)."""
    out, values = imported(tmp_path)
    with ck.Checkpoint(out) as c:
        assert c.meta["dtypes"] == "float32"
        export(c, str(tmp_path / "back"), dtype=dtype)
    raw = raw_tensors(str(tmp_path / "back"))
    for name, v in values.items():
        kind, shape, data = raw[name]
        assert kind == code and shape == v.shape
        got = np.frombuffer(data, dtype=BF16 if code == "BF16" else np.dtype(dtype)).reshape(shape)
        if code == "BF16" and ORACLE:
            import torch
            want = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(got.view(np.uint16), want), name
        else:
            assert np.array_equal(got, v.astype(dtype)), name


def test_a_bf16_checkpoint_exports_widened_exactly(tmp_path):
    rng = np.random.default_rng(1)
    out, exact = imported(tmp_path, values={k: rng.standard_normal(s) for k, s in hf_shapes(CFG).items()})
    with ck.Checkpoint(out) as c:
        assert c.meta["dtypes"] == "bfloat16"
        export(c, str(tmp_path / "back"), dtype="float32")
    with HFFolder(str(tmp_path / "back")) as f:
        assert f.meta["dtypes"] == "float32"
    raw = raw_tensors(str(tmp_path / "back"))
    assert all(np.array_equal(np.frombuffer(raw[k][2], np.float32).reshape(v.shape), v) for k, v in exact.items())


# ---------------------------------------------------------------- one line each

def run_cli(capsys, *args) -> tuple[int, str]:
    """mpi-tp ARGS in this process: (exit status, stderr)."""
    try:
        status = main(list(args))
    except SystemExit as e:                   # argparse's refusals
        status = e.code
    return status, capsys.readouterr().err


def test_refusals_are_one_line(tmp_path, capsys):
    out, _ = imported(tmp_path)
    for args, says in [
        (("export", out, str(tmp_path / "x"), "--format", "hf", "--dtype", "int8"), "invalid choice: 'int8'"),
        (("export", out, str(tmp_path / "x.h5"), "--dtype", "bfloat16"), "only --format hf converts"),
        (("generate", "--checkpoint", out, "--precision", "bf16", "--dtype", "float32"),
         "argument --dtype: not allowed with argument --precision"),
        (("eval", "--checkpoint", out, "--data", "pydoc", "--precision", "fp64"), "invalid choice: 'fp64'"),
        (("import-hf", str(tmp_path / "folder"), str(tmp_path / "y"), "--precision", "int4"),
         "invalid choice: 'int4'")]:
        status, err = run_cli(capsys, *args)
        lines = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
        assert status == 2 and len(lines) == 1 and says in lines[0], (args, err)


def test_fp16_export_refuses_a_value_past_its_largest(tmp_path, capsys):
    folder = str(tmp_path / "folder")
    numpy_folder(folder, dtype=np.float32, tensors={"transformer.ln_f.bias": np.full(20, 7e4, np.float32)})
    import_folder(folder, str(tmp_path / "imported"), MPI.COMM_SELF)
    status, err = run_cli(capsys, "export", str(tmp_path / "imported"), str(tmp_path / "x"), "--format", "hf",
                          "--dtype", "float16")
    assert status == 2 and err.strip() == ("mpi-tp: error: export --dtype float16: model/ln_f/bias holds values "
                                           "past float16's largest (65504): export it as bfloat16 or float32")
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "x.tmp")
    assert run_cli(capsys, "export", str(tmp_path / "imported"), str(tmp_path / "x"), "--format", "hf",
                   "--dtype", "bfloat16")[0] == 0
