"""Mistral (a sliding window, issue 42) against transformers: import, KV-cache decoding, export.

Random small MistralForCausalLM folders made by transformers (float64, grouped-query attention, eager attention)
with a window W = 6 shorter than a prompt and its continuation (10 + 12 positions), read at the pass's world
size (tp = world; 3: heads and widths split unevenly): the logits equal transformers' (LLAMA_TOL: its norms and
rotary angles run in float32) at lengths past the window, where a model attending to every earlier position is
off by O(0.1); greedy generation of prompts of 10, 3 and 7 tokens, batched, gives transformers' own
`generate(do_sample=False)` tokens; Qwen2 with a window in every layer too. An export of the import loads in
transformers as MistralForCausalLM with the same logits and continues the same. The cache holds W columns, not
block_size (its bytes), and rows that join, step and leave, of their own lengths, prefilled past the window
and sliding past block_size, give the model's own full forward pass (the training kernel with the window).

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_hf_mistral.py     (N = 1 .. 4)
"""
import os

import numpy as np
import pytest
from decoding import join_step_leave
from test_hf import (  # noqa: F401
    IDS,
    LLAMA_SIZES,
    LLAMA_TOL,
    assert_like_oracle,
    greedy_oracle,
    random_transformers_folder,
    loaded,
    needs_mpiexec,
    needs_oracle,
    shared_dir,
)

from mpi_tp.core.testing import all_true, assert_close, from_rank0
from mpi_tp.inference.decode import Decoder
from mpi_tp.inference.generate import Request, generate
from mpi_tp.inference.kv_cache import KVCache
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

W = 6
MODELS = {   # name: (transformers class, config overrides)
    "mistral": ("Mistral", dict(sliding_window=W)),
    "mistral-tied": ("Mistral", dict(sliding_window=W, tie_word_embeddings=True)),
    "qwen2-window": ("Qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=0)),
}
PROMPTS = [IDS[0, :10], IDS[1, :3], IDS[2, :7]]          # longer and shorter than the window
NEW = 12                                                 # 10 + 12 = 22 positions: far past W
LENGTHS = (1, 6, 7, 22, 32)


def hf_folder(path, name, seed=0):
    """A random-weight *ForCausalLM of MODELS[name] in float64 with eager attention, saved by save_pretrained."""
    kind, overrides = MODELS[name]
    return random_transformers_folder(path, kind, {**LLAMA_SIZES, **overrides}, seed, eager=True)


def oracle(folder, name):
    return greedy_oracle(hf_folder(folder, name, seed=5), PROMPTS, NEW, LENGTHS)


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_tokens_equal_transformers(world, shared_dir, name):  # noqa: F811
    folder = os.path.join(shared_dir, name)
    logits, tokens = from_rank0(lambda: oracle(folder, name), world)
    model = loaded(folder, Topology.create(world))
    assert model.cfg.sliding_window == W and model.cfg.qkv_bias == name.startswith("qwen2")
    assert_like_oracle(model, (logits, tokens), PROMPTS, NEW, f"{name} at tp={world.Get_size()}", world)


@needs_oracle
def test_the_window_binds_in_transformers(tmp_path):
    """The oracle's own check: without its window the same weights give other logits past W (so equal logits
    above say the window was applied, and applied as W positions, itself included)."""
    import torch
    import transformers
    model = hf_folder(str(tmp_path / "m"), "mistral", seed=5)
    config = transformers.MistralConfig.from_pretrained(str(tmp_path / "m"))
    for window, differs in ((None, True), (W + 1, True), (W - 1, True), (W, False)):
        config.sliding_window = window
        config._attn_implementation = "eager"
        other = transformers.MistralForCausalLM(config).double().eval()
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            a, b = (m(torch.tensor(IDS[:, :20])).logits for m in (model, other))
        assert bool((a - b).abs().max() > 1e-3) == differs, window


@needs_oracle
def test_export_loads_in_transformers_and_continues_the_same(tmp_path):
    import torch
    import transformers
    from mpi4py import MPI

    from mpi_tp.checkpoint import Checkpoint
    from mpi_tp.checkpoint.hf.write import export
    from mpi_tp.commands.hf import import_folder
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    model = hf_folder(src, "mistral", seed=6)
    with Checkpoint(import_folder(src, str(tmp_path / "imported"), MPI.COMM_SELF)) as ck:
        export(ck, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64,
                                                             attn_implementation="eager").eval()
    assert type(back) is transformers.MistralForCausalLM and back.config.sliding_window == W
    with torch.no_grad():
        want, got = (m(torch.tensor(IDS[:, :20])).logits.numpy() for m in (model, back))
    assert np.array_equal(want, got)
    (_, tokens), (_, again) = (greedy_oracle(m, PROMPTS, NEW, ()) for m in (model, back))
    assert tokens == again


@needs_oracle
@pytest.mark.parametrize("overrides, says", [
    (dict(use_sliding_window=True, sliding_window=W, max_window_layers=1), "layers \\[1\\] are sliding_attention"),
    (dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=W),
     "layers \\[1\\] are sliding_attention"),
])
def test_qwen2_windows_in_some_layers_only_are_refused_by_name(tmp_path, overrides, says):
    import transformers

    from mpi_tp.checkpoint import open_checkpoint
    from mpi_tp.core.errors import UserError
    config = transformers.Qwen2Config(**{**LLAMA_SIZES, **overrides})
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(UserError, match=says):
        open_checkpoint(str(tmp_path / "m"))


# ---------------------------------------------------------------- the cache, against the model's own forward

S = 10
CFG = GPTConfig(vocab_size=37, block_size=S, n_layer=2, n_head=4, n_embd=16, arch="llama", n_kv_head=2,
                intermediate_size=22, sliding_window=4)


@pytest.mark.mpi(min_size=1)
def test_the_cache_holds_the_window_only(world):
    """2 L slots H_kv_i W hs values, not block_size columns; a block_size window (or none) holds S."""
    topo = Topology.create(world, tp=world.Get_size())
    for window, N in ((4, 4), (None, S), (S + 5, S)):
        cfg = GPTConfig(**{**CFG.to_dict(), "sliding_window": window})
        model = GPT(cfg, topo, dtype="float64", seed=1).eval()
        attn, dec = model.h[0].attn, Decoder(model, 3)
        assert dec.cache.k[0].shape == (3, attn.H_kv_i, N, 4)
        assert dec.cache.nbytes == KVCache.bytes_for(model, 3) == 2 * 2 * 3 * attn.H_kv_i * N * 4 * 8
    topo.free()


@pytest.mark.mpi(min_size=1)
def test_rows_of_their_own_lengths_decode_as_the_full_forward(world):
    """Rows join (prompts shorter and longer than the window, prefilled into their ring columns), step side by
    side at their own columns, leave (the last row takes the slot), and slide past block_size: each step's
    logits equal the serial model's full forward pass of the row's context (the training kernel, windowed)."""
    serial = GPT(CFG, Topology.serial(), dtype="float64", seed=3).eval()
    topo = Topology.create(world, tp=world.Get_size())
    model = GPT(CFG, topo, dtype="float64", seed=3).eval()
    plan = {0: [[1, 2, 3, 4, 5, 6, 7], [6]], 3: [[7, 8]], 8: [list(range(10))]}
    leaving = {6: [0], 12: [1]}
    dec, rows, worst = join_step_leave(model, serial, plan, leaving, 2 * S + 2, np.random.default_rng(4))
    assert max(len(r) for r in rows) > S and dec.cache.k[0].shape[2] == CFG.sliding_window
    assert all_true(worst < 1e-10, world), worst
    topo.free()


@needs_oracle
@needs_mpiexec
def test_serve_answers_a_greedy_request_with_transformers_tokens(tmp_path):
    """`mpi-tp serve` (tp 2) on a Mistral folder: a 10-byte prompt (past the window) and 12 greedy tokens."""
    from serving import Server
    folder = str(tmp_path / "mistral")
    prompt = "SLIDING WI"                              # bytes below the vocabulary's 97
    _, (want,) = greedy_oracle(hf_folder(folder, "mistral", seed=7), [np.frombuffer(prompt.encode(), np.uint8)
                                                                      .astype(np.int64)], NEW, ())
    s = Server(folder, tmp_path, "--max-batch", "2")
    try:
        status, got = s.call("/v1/completions", {"prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                                 "return_token_ids": True})
        assert status == 200, got
        assert got["choices"][0]["token_ids"] == want, (got, want)
        assert "KV cache holds" in s.stderr() + s.stdout()
    finally:
        assert s.stop() == 0


@needs_oracle
def test_mixtral_with_a_window_equals_transformers(tmp_path):
    """Mixtral's sliding_window (refused before issue 42) imports as the window: the logits past it and greedy
    tokens of prompts longer than it equal transformers'."""
    from test_hf_mixtral import eager, mixtral_folder
    folder = str(tmp_path / "mixtral")
    mixtral_folder(folder, seed=2, sliding_window=W)
    logits, tokens = greedy_oracle(eager(folder), PROMPTS, NEW, (7, 22))
    model = loaded(folder, Topology.serial())
    assert model.cfg.sliding_window == W and model.cfg.moe_experts == 4
    for S in (7, 22):
        assert_close(model.full_logits(IDS[:, :S]), logits[S], LLAMA_TOL, f"mixtral logits at S={S}")
    got = generate(model, [Request(tuple(p.tolist()), NEW, temperature=0.0) for p in PROMPTS])
    assert [list(g) for g in got] == tokens
