"""16-bit inference (issue 37): the KV-cached decoder, generate and eval at bf16, against the uncached bf16
forward and the serial bf16 model, and --precision's loading and refusals.

    python -m pytest -q --with-mpi tests/test_precision_infer.py
    mpiexec -n 3 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_precision_infer.py

The tolerances come from the format. bf16 keeps 8 significant bits: one unit in the last place (ulp) is
2^-8 of a value's scale. A forward pass rounds the residual stream to bf16 once after the embedding, after
each of the 2L residual additions, after the final norm and at the logits: 2L + 3 roundings, each within
half an ulp. Two computations that round in other places (the decoder's one-row GEMMs, another tensor-parallel
size, whose all-reduce adds T rounded partial sums) each stay within (2L + 3)/2 ulps of the exact value where
the layers do not amplify errors (these do not: measured below), so their logits differ by at most
BOUND = (2L + 3) ulps of the logits' largest magnitude: 7 at L = 2. Measured at 1-3 ranks on the models
here: at most 2.0 between tp sizes. The cached decoder against the uncached forward at the same size runs
the same kernels (the prefill is the training attention kernel, a step its one-query form), so their fp32
sums differ only where a BLAS sums another shape in another order, and a 16-bit result differs only where
such a difference crosses a rounding boundary: rare. Asserted: at least 75% of the steps bit for bit (the
rest within BOUND); measured 100% at bf16 and fp16 at 1-3 ranks, where the decoder that computed its scores
and softmax in the 16-bit format (before this change) had 0% (bf16) and 1-16% (fp16) at 1-2 ranks, 1.4-1.8
ulps off.
The cross-entropy moves by at most twice the largest logit change
(log-sum-exp is 1-Lipschitz in the largest coordinate), so eval's losses are compared within 2 BOUND.
"""
import ml_dtypes
import numpy
import pytest
from decoding import full_last, join_step_leave
from mpi4py import MPI

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.checkpoint.model import load_model
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import all_true
from mpi_tp.inference.decode import Decoder, window
from mpi_tp.inference.evaluate import evaluate_file
from mpi_tp.inference.generate import Request, generate
from mpi_tp.inference.kv_cache import KVCache
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

BF16 = numpy.dtype(ml_dtypes.bfloat16)
ULP = 2.0**-8                      # bf16's spacing relative to a value's scale (7 fraction bits)
ULPS = {"bfloat16": ULP, "float16": 2.0**-11}     # (fp16: 10 fraction bits)
GPT2 = GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=5, n_embd=20)       # uneven at 2, 3, 4
LLAMA = GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=6, n_embd=24, arch="llama", n_kv_head=3,
                  intermediate_size=40)
MOE = GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=5, n_embd=20, moe_experts=4, moe_top_k=2)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "moe": MOE}
PLAN = {0: [[1, 2, 3, 4, 5]], 2: [[6], [7, 8]], 9: [[9, 9, 9]], 11: [list(range(12))], 20: [[3]]}
LEAVING = {6: [0], 10: [1, 2], 19: [0]}             # rows join, leave and slide past block_size (12)


def bound(cfg: GPTConfig, logits) -> float:
    """(2L + 3) bf16 ulps of the logits' largest magnitude (the module docstring)."""
    return (2 * cfg.n_layer + 3) * ULP * float(numpy.abs(numpy.asarray(logits, dtype=numpy.float64)).max())


def build(cfg, world, seed=3, dtype="bfloat16"):
    topo = Topology.create(world, tp=world.Get_size())
    return GPT(cfg, topo, dtype=dtype, seed=seed).eval(), topo


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("dtype", list(ULPS))
def test_the_cache_holds_16_bit_keys_and_values(world, arch, dtype):
    cfg = CONFIGS[arch]
    model, topo = build(cfg, world, dtype=dtype)
    dec = Decoder(model, 3)
    dec.prefill([[1, 2, 3], [4]])
    wide = KVCache(GPT(cfg, topo, dtype="float32", seed=3).eval(), 3)
    assert all(a.dtype == model.dtype and a.dtype.itemsize == 2 for a in dec.cache.k + dec.cache.v)
    assert dec.cache.nbytes == KVCache.bytes_for(model, 3) == wide.nbytes // 2 > 0        # half fp32's bytes
    assert float(numpy.abs(dec.cache.k[0][1, :, 0].astype(numpy.float32)).max()) > 0      # the prefill wrote it
    topo.free()


def cached_differences(model, uncached, rng, steps=30) -> numpy.ndarray:
    """Rows of 5, 1 and 3 tokens decoded `steps` steps (sliding past block_size): each row's logits at each
    step less the uncached forward of its window (decoding.full_last), the largest per row and step."""
    S, V = model.cfg.block_size, model.cfg.vocab_size
    rows = [list(rng.integers(0, V, n)) for n in (5, 1, 3)]
    dec, diffs = Decoder(model, len(rows)), []
    logits = dec.prefill(rows)
    for _ in range(steps):
        diffs += [float(numpy.abs(logits[b] - full_last(uncached, r[-window(len(r), S):])).max())
                  for b, r in enumerate(rows)]
        nxt = rng.integers(0, V, len(rows))
        for r, i in zip(rows, nxt):
            r.append(int(i))
        logits = dec.step(nxt)
    return numpy.array(diffs)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("dtype", list(ULPS))
def test_cached_decode_equals_the_uncached_16_bit_forward(world, arch, dtype):
    """Every step's logits against the uncached forward of the same model at the same size and format: most
    bit for bit, the rest within BOUND (see the module docstring)."""
    cfg, ulp = CONFIGS[arch], ULPS[dtype]
    model, topo = build(cfg, world, dtype=dtype)
    uncached = GPT(cfg, topo, dtype=dtype, seed=3).eval()
    scale = numpy.abs(uncached.full_logits(numpy.arange(12)[None] % 37).astype(numpy.float64)).max()
    diffs = cached_differences(model, uncached, numpy.random.default_rng(1))
    exact = float((diffs == 0).mean())
    assert all_true(exact >= 0.75, world), f"{exact:.0%} of the steps bit for bit"
    assert all_true(diffs.max() <= (2 * cfg.n_layer + 3) * ulp * scale, world), diffs.max() / (ulp * scale)
    topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_decode_at_every_size_is_the_serial_bf16_models(world, arch):
    cfg = CONFIGS[arch]
    serial = GPT(cfg, Topology.serial(), dtype="bfloat16", seed=3).eval()
    model, topo = build(cfg, world)
    _, _, worst = join_step_leave(model, serial, PLAN, LEAVING, 30, numpy.random.default_rng(1))
    tol = bound(cfg, serial.full_logits(numpy.arange(12)[None] % 37))
    assert all_true(worst <= tol, world), f"{worst:.3e} > {tol:.3e}"
    topo.free()


def greedy_margins(model, prompt, n):
    """The serial greedy continuation of prompt (n tokens) and each step's margin: the top logit less the
    second (the uncached forward of the whole row)."""
    row, margins = list(prompt), []
    for _ in range(n):
        z = model.full_logits(numpy.array([row]))[0, -1].astype(numpy.float64)
        top2 = numpy.sort(z)[-2:]
        margins.append(top2[1] - top2[0])
        row.append(int(numpy.argmax(z)))
    return row[len(prompt):], margins


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_text_and_eval_loss_at_every_size(world, arch):
    """Greedy tokens equal the serial bf16 model's for as long as the serial margins exceed twice the bound
    (two logits each off by at most BOUND cannot swap): all 7 here; the eval loss within 2 BOUND."""
    cfg = CONFIGS[arch]
    serial = GPT(cfg, Topology.serial(), dtype="bfloat16", seed=5).eval()
    model, topo = build(cfg, world, seed=5)
    prompt = bytes([26, 32, 2])                       # (chosen where the margins allow all 7 tokens)
    want, margins = greedy_margins(serial, prompt, 7)
    tol = bound(cfg, serial.full_logits(numpy.array([list(prompt) + want]))[0])
    safe = next((i for i, m in enumerate(margins) if m <= 2 * tol), len(margins))
    got = list(generate(model, [Request(prompt, max_tokens=7, temperature=0)])[0])
    assert safe == 7, f"margins {margins} vs 2 x {tol:.3e}: pick another prompt"
    assert all_true(got[:safe] == want[:safe], world), (got, want, safe)
    text = numpy.random.default_rng(0).integers(0, 37, 12 * 9)
    (loss, n), (ref, _) = evaluate_file(model, text), evaluate_file(serial, text)
    assert model.dtype == BF16 and n == 8 * 12
    assert all_true(abs(loss - ref) <= 2 * tol, world), (loss, ref, tol)
    topo.free()


# ---------------------------------------------------------------- --precision's loading

@pytest.fixture
def wide_checkpoint(world, tmp_path_factory):
    """A float64 GPT-2 checkpoint saved at this world size, two of its values set to bf16 ties' neighbours."""
    path = world.bcast(str(tmp_path_factory.mktemp("wide")) if world.Get_rank() == 0 else None)
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(GPT2, topo, dtype="float64", seed=2)
    ln = {p.name: p for p in model.parameters()}["h/0/ln_1/weight"]      # replicated: (C,) on every rank
    ln.data[:2] = [1 + 2**-8 + 2**-30, 1 + 2**-8]     # just above a tie (rounds up), on a tie (to even: down)
    ckpt_io.save(path, 0, model, None, {"config": GPT2.to_dict()})
    yield path
    topo.free()


@pytest.mark.mpi(min_size=1)
def test_a_float64_checkpoint_narrows_to_bf16_rounded_once(world, wide_checkpoint):
    """Narrowing for inference is allowed: each float64 value rounded once to the nearest bf16 (not through fp32,
    which would turn 1 + 2^-8 + 2^-30 into the tie 1 + 2^-8 and then round it down to 1)."""
    wide, _ = load_model(wide_checkpoint, world)
    narrow, ck = load_model(wide_checkpoint, world, "bfloat16")
    assert wide.dtype == numpy.float64 and narrow.dtype == BF16 and ck.meta["dtypes"] == "float64"
    ok = all(numpy.array_equal(n.data.view(numpy.uint16), w.data.astype(BF16).view(numpy.uint16))
             for n, w in zip(narrow.parameters(), wide.parameters()))
    ln = {p.name: p for p in narrow.parameters()}["h/0/ln_1/weight"].data
    assert all_true(ok, world) and ln[0] == 1 + 2**-7 and ln[1] == 1.0


@pytest.mark.mpi(min_size=1)
def test_fp16_refuses_a_weight_past_its_largest(world, tmp_path_factory):
    path = world.bcast(str(tmp_path_factory.mktemp("big")) if world.Get_rank() == 0 else None)
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(GPT2, topo, dtype="float32", seed=2)
    {p.name: p for p in model.parameters()}["ln_f/bias"].data[3] = 7e4          # > 65504
    ckpt_io.save(path, 0, model, None, {"config": GPT2.to_dict()})
    with pytest.raises(UserError, match=r"ln_f/bias holds a value that fp16 cannot hold .*--precision bf16"):
        load_model(path, world, "float16")
    half, _ = load_model(path, world, "bfloat16")                                   # bf16: fp32's range
    assert all_true({p.name: p for p in half.parameters()}["ln_f/bias"].data[3] == 70144.0, world)
    topo.free()


def test_a_mixture_of_experts_model_loads_at_16_bits(tmp_path):
    """Its router runs in fp32 at 16 bits (model/moe.py), so it decodes like the dense models above (CONFIGS'
    "moe" runs the cached-decode and tp tests)."""
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=8, moe_experts=2)
    ckpt_io.save(str(tmp_path), 0, GPT(cfg, Topology.serial(), seed=1), None, {"config": cfg.to_dict()})
    model, _ = load_model(str(tmp_path), MPI.COMM_SELF, "bfloat16")
    assert model.dtype == BF16 and model.cfg.moe_experts == 2
    model.topo.free()


def test_cupy_runs_16_bit_models_not_yet(tmp_path, monkeypatch):
    """On the CuPy stand-in (mpi_tp.core.standin: CuPy's API on NumPy), a 16-bit load is one line."""
    from mpi_tp.core import backend
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "0")
    ckpt_io.save(str(tmp_path), 0, GPT(GPT2, Topology.serial(), seed=1), None, {"config": GPT2.to_dict()})
    backend.use("cupy")
    try:
        with pytest.raises(UserError, match="--backend cupy runs fp32 and float64 models for now"):
            load_model(str(tmp_path), MPI.COMM_SELF, "bfloat16")
        assert load_model(str(tmp_path), MPI.COMM_SELF)[0].dtype == numpy.float32
    finally:
        backend.use("numpy")

