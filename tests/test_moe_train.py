"""Mixture of experts end to end: `mpi-tp train` with the MoE flags at 2 and 4 ranks (experts over ep)
against the 1-rank run, MoE metrics, checkpoints saved at ep = 2 loaded at ep = 1 and tp = 2,
bitwise resume, one clear message for each bad combination; ZeRO-1 exact with experts (sharded over
edp); cached decoding of an MoE model equal to the full forward (dropless).

    python -m pytest -q --with-mpi tests/test_moe_train.py                  (CLI tests: their own jobs)
    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_moe_train.py   (N = 1 .. 4)
"""
import functools
import json
import os

import h5py
import numpy as np
import pytest
import steps as steps_helper
from jobs import MPIEXEC, mpirun

from mpi_tp import checkpoint as ck
from mpi_tp.core.testing import all_true
from mpi_tp.inference.decode import Decoder
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
GLOBAL_B, T, K, E = 8, 16, 2, 3          # global batch, block size, experts per token, experts (3: uneven at ep 2)
AUX, Z = 0.05, 0.01
MOE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", str(T), "--dtype", "float64",
       "--dropout", "0.1", "--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--sample-len", "0",
       "--moe-experts", str(E), "--moe-top-k", str(K), "--moe-capacity", "1.0", "--moe-aux-weight", str(AUX),
       "--moe-z-weight", str(Z)]
LAYOUTS = {   # the same global batch of 8 sequences
    "one": (1, ["--batch-size", "8"]),
    "dp2-ep2-micro2": (2, ["--dp", "2", "--ep", "2", "--batch-size", "2", "--micro-batches", "2"]),
    "tp2-dp2-ep2": (4, ["--tp", "2", "--dp", "2", "--ep", "2", "--batch-size", "4"]),
    "dp4-ep2-zero1": (4, ["--dp", "4", "--ep", "2", "--batch-size", "2", "--zero", "1", "--log-every", "2"]),
    # the experts' own grid: whole experts on the two tp ranks; experts with cp, each split over 2 (etp > tp)
    "tp2-etp1-ep2": (2, ["--tp", "2", "--etp", "1", "--ep", "2", "--batch-size", "8"]),
    "cp2-dp2-ep2-etp2-zero1": (4, ["--cp", "2", "--dp", "2", "--ep", "2", "--etp", "2", "--batch-size", "4",
                                   "--zero", "1"]),
}


def metrics(out):
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return [l for l in lines if "loss" in l], [l["val_loss"] for l in lines if "val_loss" in l]


def tensors(out, step=None):
    root = os.path.join(out, "checkpoints")
    path = ck.resolve(root if step is None else os.path.join(root, ck.step_dir_name(step)))
    with h5py.File(os.path.join(path, "index.h5"), "r") as f:
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) and n.startswith(("model/", "optim/"))
                else None)
        return {n: f[n][...] for n in names}


def train(out, layout, *extra):
    n, flags = LAYOUTS[layout]
    r = mpirun(n, "train", *MOE, *flags, *extra, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 1-rank run: 3 steps, checkpoint at 2 and 3."""
    out = tmp_path_factory.mktemp("moe") / "one"
    train(out, "one", "--steps", "3", "--save-every", "2", "--keep", "0")
    return out


def check_moe_fields(steps):
    for s in steps:
        assert abs(s["loss"] - (s["cross_entropy"] + AUX * s["aux_loss"] + Z * s["z_loss"])) < 1e-12, s
        assert [m["block"] for m in s["moe"]] == [0, 1]
        for m in s["moe"]:
            assert len(m["tokens_per_expert"]) == E
            assert sum(m["tokens_per_expert"]) + m["dropped"] == GLOBAL_B * T * K, m     # every assignment once
            assert m["imbalance"] == pytest.approx(max(m["tokens_per_expert"]) * E / sum(m["tokens_per_expert"]))
    assert sum(m["dropped"] for s in steps for m in s["moe"]) > 0, "nothing dropped: capacity untested"


@cli
@pytest.mark.parametrize("layout", ["dp2-ep2-micro2", "tp2-dp2-ep2", "dp4-ep2-zero1", "tp2-etp1-ep2",
                                    "cp2-dp2-ep2-etp2-zero1"])
def test_train_equals_one_rank(tmp_path, reference, layout):
    """Losses and their parts, routing (tokens per expert, drops), gradient norms and the saved weights and
    AdamW moments (every expert, from every ep rank's shards) equal the 1-rank run's (float64)."""
    r = train(tmp_path / layout, layout, "--steps", "3")
    assert "imbalance" in r.stdout and "dropped" in r.stdout and " ce " in r.stdout
    run = json.load(open(tmp_path / layout / "run.json"))
    assert run["layout"]["ep"] == 2
    (got, _), (want, _) = metrics(tmp_path / layout), metrics(reference)   # (validation: batches of batch_size)
    check_moe_fields(want)
    check_moe_fields(got)
    assert len(want) == 3 and [g["step"] for g in got] == ([2, 3] if "--log-every" in LAYOUTS[layout][1] else [1, 2, 3])
    done = 0
    for g in got:               # a logged step: the means over the steps since the last one, its own routing
        window, done = want[done:g["step"]], g["step"]
        for key in ("loss", "cross_entropy", "aux_loss", "z_loss"):
            w = sum(s[key] for s in window) / len(window)
            assert abs(g[key] - w) <= 1e-10 * abs(w), (layout, g["step"], key, g[key], w)
        w = window[-1]
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-10 * w["grad_norm"]
        assert g["moe"] == [{**m, "imbalance": pytest.approx(m["imbalance"])} for m in w["moe"]], (layout, g["step"])
    mine, ref = tensors(tmp_path / layout), tensors(reference)
    assert "model/h/1/moe/experts/2/proj/weight" in ref and "optim/v/h/0/moe/experts/1/fc/weight" in ref
    assert mine.keys() == ref.keys()
    bad = {n: float(abs(mine[n] - ref[n]).max()) for n in ref if not abs(mine[n] - ref[n]).max() < 1e-10}
    assert not bad, bad                     # NaN (a tensor no shard wrote) fails too


@cli
def test_checkpoint_at_ep2_resumes_bitwise_and_loads_elsewhere(tmp_path, reference):
    """Saved at dp = 2, ep = 2: resume bitwise; continue at 1 rank (ep = 1, AdamW state of every expert)
    as the uninterrupted 1-rank run; eval equal at tp = 1 and 2; generate, inspect and export work."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, "dp2-ep2-micro2", "--steps", "3", "--save-every", "2", "--keep", "0")
    train(b, "dp2-ep2-micro2", "--steps", "2")
    r = train(b, "dp2-ep2-micro2", "--steps", "3", "--resume")
    assert "continuing from" in r.stdout
    (sa, va), (sb, vb) = metrics(a), metrics(b)
    drop = ("step_s", "tokens_per_s", "comm_s", "elapsed_s")
    assert [{k: v for k, v in s.items() if k not in drop} for s in sa] == \
        [{k: v for k, v in s.items() if k not in drop} for s in sb] and va[-1] == vb[-1]   # bit for bit
    wa, wb = tensors(a), tensors(b)
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    shards = sorted(f for f in os.listdir(a / "checkpoints" / "step-00000002") if f.startswith("shard"))
    assert shards == ["shard-00-of-02.h5", "shard-01-of-02.h5"]          # one per ep rank
    # ep = 2 -> ep = 1 at one rank, with the optimizer state
    c = tmp_path / "c"
    train(c, "one", "--steps", "3", "--init-from", str(a / "checkpoints" / "step-00000002"))
    (sc, _), (sr, _) = metrics(c), metrics(reference)
    assert [s["step"] for s in sc] == [3] and abs(sc[0]["loss"] - sr[-1]["loss"]) < 1e-10 * sr[-1]["loss"]
    wc, wr = tensors(c), tensors(reference)
    assert max(float(abs(wc[n] - wr[n]).max()) for n in wr) < 1e-10
    # eval at tp = 1 and tp = 2 (ep = 1), generate at tp = 2
    root = str(a / "checkpoints")
    text = tmp_path / "eval.txt"
    text.write_bytes(open(__file__, "rb").read())
    got = []
    for n in (1, 2):
        r = mpirun(n, "eval", "--checkpoint", root, "--data", str(text), "--json")
        assert r.returncode == 0, r.stderr
        got.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert got[1]["tp"] == 2 and abs(got[0]["loss"] - got[1]["loss"]) < 1e-10 * got[0]["loss"]
    r = mpirun(2, "generate", "--checkpoint", root, "--greedy", "--max-new-tokens", "12", "--prompt", "The ",
               "--prompt", "x")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2
    r = mpirun(1, "inspect", root)
    assert r.returncode == 0 and "integrity: OK" in r.stdout and "moe/experts/2/fc/weight" in r.stdout, r.stdout
    r = mpirun(1, "export", root, str(tmp_path / "full.npz"), "--optimizer")
    assert r.returncode == 0, r.stderr
    full = np.load(tmp_path / "full.npz")
    for name in ("model/h/0/moe/router/weight", "model/h/1/moe/experts/2/fc/bias", "optim/m/h/1/moe/experts/2/fc/bias"):
        assert np.array_equal(full[name], wa[name]) and np.isfinite(full[name]).all()


@cli
def test_the_expert_bias_is_saved_and_resumed_bitwise(tmp_path):
    """--moe-bias-rate on one rank (the loads summed over replicas: tests/test_moe.py): the checkpoint holds
    each MoE block's bias (moved: not zero), a run resumed from step 2 equals the straight one bit for bit, and the bias is read back and
    steers the routing: evaluated with its biases deleted (as a checkpoint saved before they existed, which
    still loads, biases zero) the same checkpoint gives another loss. (A rate this large, 0.5 against sigmoid
    scores in (0, 1), makes the bias decide the choices; the sign steps of a small one can cancel out.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    rate = ["--moe-router", "sigmoid", "--moe-bias-rate", "0.5", "--moe-shared-experts", "1"]
    train(a, "one", *rate, "--steps", "3")                  # an odd number of +-rate steps: no bias back at 0
    train(b, "one", *rate, "--steps", "2")
    train(b, "one", *rate, "--steps", "3", "--resume")
    drop = ("step_s", "tokens_per_s", "comm_s", "elapsed_s")
    (sa, va), (sb, vb) = metrics(a), metrics(b)
    assert [{k: v for k, v in s.items() if k not in drop} for s in sa] == \
        [{k: v for k, v in s.items() if k not in drop} for s in sb] and va[-1] == vb[-1]
    wa, wb = tensors(a), tensors(b)
    biases = [n for n in wa if n.endswith("router/expert_bias")]
    assert len(biases) == 2 and all(np.abs(wa[n]).max() > 0 and np.array_equal(wa[n], wb[n]) for n in biases)

    def evaluate():
        r = mpirun(1, "eval", "--checkpoint", str(a / "checkpoints"), "--data", "pydoc", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])["loss"]
    with_bias = evaluate()
    with h5py.File(os.path.join(ck.resolve(str(a / "checkpoints")), "index.h5"), "r+") as f:
        layout = json.loads(f["meta/layout"][()])                   # as saved before the bias existed
        layout["tensors"] = {n: t for n, t in layout["tensors"].items() if n not in biases}
        del f["meta/layout"]
        f["meta/layout"] = json.dumps(layout)
        for n in biases:
            del f[n]
    assert evaluate() != with_bias


@cli
def test_dense_and_moe_checkpoints_do_not_mix(tmp_path, reference):
    """A dense checkpoint (one without moe_* keys, as saved before MoE) into an MoE model, and the reverse:
    one message at the configuration check. (The dense run's metrics hold no MoE field.)"""
    dense = tmp_path / "dense"
    plain = MOE[:MOE.index("--moe-experts")]
    r = mpirun(1, "train", *plain, "--batch-size", "8", "--steps", "1", "--out", str(dense))
    assert r.returncode == 0, r.stderr
    assert "imbalance" not in r.stdout
    steps, _ = metrics(dense)
    assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "comm_s", "elapsed_s"}
    with h5py.File(os.path.join(ck.resolve(str(dense / "checkpoints")), "index.h5"), "r+") as f:
        config = json.loads(f.attrs["config"])          # as saved before mixture of experts: no moe_* keys
        f.attrs["config"] = json.dumps({k: v for k, v in config.items() if not k.startswith("moe_")})
    r = mpirun(1, "eval", "--checkpoint", str(dense / "checkpoints"), "--data", "pydoc", "--json")
    assert r.returncode == 0, r.stderr                  # an old checkpoint still loads
    into_moe = "a dense checkpoint into a mixture-of-experts model"
    into_dense = "a mixture-of-experts checkpoint into a dense model"
    for args, message in (([*MOE, "--init-from", str(dense / "checkpoints")], into_moe),
                          ([*plain, "--moe-experts", "0", "--init-from", str(reference / "checkpoints")], into_dense)):
        r = mpirun(2, "train", *args, "--steps", "4", "--out", str(tmp_path / "x"), timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.count("mpi-tp: error:") == 1 and message in r.stderr and "moe_experts" in r.stderr
        assert "Traceback" not in r.stderr


@cli
@pytest.mark.parametrize("args,message", [
    (["--dp", "2", "--ep", "2"], "--ep 2 needs a mixture-of-experts model"),
    (["--moe-top-k", "2"], "--moe-top-k set on a dense model"),
    (["--moe-experts", "1", "--dp", "2", "--ep", "2"], "--ep 2 exceeds --moe-experts 1"),
    (["--moe-experts", "4", "--ep", "2"], "--ep 2 x --etp 2 = 4 must divide tp x cp x dp = 2"),
    (["--moe-experts", "4", "--dp", "2", "--etp", "4"], "--ep 1 x --etp 4 = 4 must divide tp x cp x dp = 2"),
    (["--dp", "2", "--etp", "2"], "--etp 2 needs a mixture-of-experts model"),
    (["--moe-experts", "4", "--etp", "-1"], "--etp must be at least 1 (or 0: --tp's), got -1"),
    (["--moe-experts", "4", "--dp", "2", "--ep", "0"], "--ep must be at least 1"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "moe_top_k = 5 must be an integer in [1, moe_experts = 4]"),
    (["--moe-experts", "4", "--moe-capacity", "-1"], "moe_capacity must be a finite number >= 0"),
    (["--moe-experts", "4", "--moe-every", "3"], "moe_every = 3 must be in [1, n_layer = 2]"),
])
def test_bad_combinations_are_one_clear_message(tmp_path, args, message):
    r = mpirun(2, "train", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
               "--out", str(tmp_path / "o"), *args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("mpi-tp: error:") == 1, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- in-process, at every world size

CFG = dict(vocab_size=37, block_size=12, n_layer=2, n_head=4, n_embd=16, moe_experts=4, moe_top_k=2,
           moe_aux_weight=0.05, moe_z_weight=0.01)


@pytest.mark.mpi(min_size=1)
def test_zero1_with_experts_is_exact(world):
    """The distributed optimizer (dense buckets shared out over dp, each expert's over edp) at every dp x ep
    of the world: after 3 AdamW steps the weights and the gathered optimizer state equal the unsharded
    optimizer's (to 1e-12: a reduce-scatter may add the replicas' gradients in another order than an
    all-reduce), and each rank keeps 1/edp of an expert's state, 1/dp of the rest."""
    n = world.Get_size()
    for ep in (e for e in (1, 2, 3, 4) if n % e == 0):
        cfg = GPTConfig(**CFG, moe_capacity=1.0)
        topo = Topology.create(world, tp=1, dp=n, ep=ep)
        runs = []
        for zero in (False, True):
            model = GPT(cfg, topo, dtype="float64", seed=4)
            reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=zero)
            opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
            batch = functools.partial(steps_helper.global_batch, S=12)
            steps_helper.train(model, opt, 3, 2, batch, reducer=reducer, grad_clip=0.5)
            kept = [not p.name.endswith("attn/k/bias") for p in model.parameters()]   # exact gradient 0: noise
            runs.append(([p.data.copy() for p in model.parameters()], opt.state_tensors(),
                         sum(a.size for a in opt.state["m"])))
        (w0, s0, n0), (w1, s1, n1) = runs

        def close(a, b):
            return float(np.abs(a - b).max()) <= 1e-12 * max(float(np.abs(a).max()), 1e-30)
        same = all(close(a, b) for a, b, k in zip(w0, w1, kept) if k) and \
            all(close(a, b) for s in s0 for a, b, k in zip(s0[s], s1[s], kept) if k)
        experts = sum(p.data.size for p in model.parameters() if getattr(p, "expert", None) is not None)
        same &= n1 == pytest.approx((n0 - experts) / n + experts * ep / n, abs=2 * len(reducer.buckets))
        assert all_true(same, world), f"ZeRO-1 differs from the unsharded optimizer at dp={n} ep={ep}"
        topo.free()


@pytest.mark.mpi(min_size=1)
def test_cached_decoding_of_moe_equals_full_forward(world):
    """tp = world size, ep = 1: every decode step's logits equal the full forward of the row's context,
    run dropless (GPT.moe_dropless); with its capacity the full forward drops and differs."""
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(GPTConfig(**CFG, moe_capacity=0.5), topo, dtype="float64", seed=3).eval()
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 37, n)) for n in (5, 1, 3)]          # left padding: 0, 4 and 2 columns
    dec = Decoder(model, len(rows))
    logits = dec.prefill(rows)
    worst, differs = 0.0, False
    for _ in range(6):
        for b, row in enumerate(rows):
            with model.moe_dropless():
                full = model.full_logits(np.array([row]))[0, -1]
            worst = max(worst, float(np.abs(logits[b] - full).max()))
            differs |= bool(np.abs(model.full_logits(np.array([row]))[0, -1] - full).max() > 1e-6)
        nxt = rng.integers(0, 37, len(rows))
        for row, i in zip(rows, nxt):
            row.append(int(i))
        logits = dec.step(nxt)
    assert all(not m.dropless for m in model.moe_layers())              # the switch is only inside
    assert all_true(worst < 1e-10, world), worst
    assert all_true(differs, world), "the capacity dropped nothing: the dropless switch is untested"
    topo.free()
