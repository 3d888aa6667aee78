"""Rotary embeddings stretched past the length a model was trained at: the rope_scaling types of transformers
(`rope_scaling` in a config.json of transformers 4, `rope_parameters` in 5) that change the frequencies alone.

Legend: inv_freq_j = theta^(-2j/hs), j < hs/2, each pair's angle per position (mpi_tp.model.rope); wavelen_j =
2 pi / inv_freq_j, the positions one turn takes; L0 = original_max_position_embeddings; L = the length of the
sequence an angle is made for, never below L0: L = max(S, L0).

    linear   inv_freq / factor                          every pair turns factor times slower (positions / factor)
    llama3   wavelen < L0 / high_freq_factor:  inv_freq           (fast pairs: kept)
             wavelen > L0 / low_freq_factor:   inv_freq / factor  (slow pairs: stretched)
             between: (1 - a) inv_freq / factor + a inv_freq,  a = (L0 / wavelen - low) / (high - low)
    dynamic  theta' = theta ((factor L / L0) - (factor - 1)) ^ (hs / (hs - 2)),  inv_freq_j = theta'^(-2j/hs)
             (NTK-aware: the base grows with the sequence; L <= L0 gives theta itself, the default rope)

The frequencies are computed where the angles are (mpi_tp.core.kernels_llama.rope_tables); this module
checks a configuration's scaling. Llama 3.1, 3.2 and 3.3 use llama3 (factor 8 or 32, low 1, high 4, L0 8192); their
attention is not rescaled (attention_factor 1). Any other type (yarn, longrope, ...) is refused by name.

dynamic, as transformers computes it (modeling_rope_utils: _compute_dynamic_ntk_parameters, dynamic_rope_update),
depends on the length S of the sequence, so a position's angle is not one number for ever:
- a forward over positions 0 ... S-1 (training, a prompt's prefill) rotates all of them with L = max(S, L0); under
  context parallelism S is the whole sequence's, not a rank's chunk;
- a cached decode step at position p rotates the new q and k with L = max(p + 1, L0), and the cached keys keep the
  rotations they were made with (so a decoded sequence is not rotated as one forward over it would be);
- L0 is transformers' max_position_embeddings (a Hugging Face import takes it from there, and an export writes
  it back there); a model of mpi_tp's own takes block_size unless original_max_position_embeddings is given.
transformers' rotary module keeps one state for the whole batch: the longest length seen so far (max position + 1
over every row), reset only by a forward shorter than L0. mpi_tp keeps none: every row is rotated for its own
length (its prompt in prefill, its position in a step), so a row computes the same in any batch. A single row
from a fresh start (one generate call) gets transformers' numbers; rows of different lengths batched together, or
a second call after a longer one, get transformers' numbers for each row alone, where transformers uses the
batch's (or the earlier call's) longest length.
"""
from __future__ import annotations

import math



class RopeScalingError(ValueError):
    """A rope_scaling mpi_tp does not compute (GPTConfig.validate says it as a ConfigError)."""

ROPE_TYPES = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"),
              "dynamic": ("factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling, block_size: int | None = None) -> dict | None:
    """The scaling as mpi_tp keeps it ({"rope_type", and the type's numbers}), or None for none; one
    RopeScalingError naming what is not supported. dynamic without original_max_position_embeddings takes
    block_size (transformers' max_position_embeddings) when it is given."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise RopeScalingError(f"rope_scaling {scaling!r}: expected an object with a rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise RopeScalingError(f"rope_scaling rope_type {kind!r} is not supported (mpi_tp computes "
                          f"{', '.join(ROPE_TYPES)})")
    out = {"rope_type": kind}
    if kind == "dynamic" and scaling.get("original_max_position_embeddings") is None and block_size is not None:
        scaling = {**scaling, "original_max_position_embeddings": block_size}
    for key in ROPE_TYPES[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise RopeScalingError(f"rope_scaling {kind}: {key} = {value!r} must be a finite number > 0")
        if key == "original_max_position_embeddings" and value != int(value):
            raise RopeScalingError(f"rope_scaling {kind}: {key} = {value!r} must be a whole number of positions")
        out[key] = float(value) if key != "original_max_position_embeddings" else int(value)
    extra = scaling.get("attention_factor")
    if extra not in (None, 1, 1.0):
        raise RopeScalingError(f"rope_scaling {kind}: attention_factor = {extra!r} is not supported (mpi_tp scales "
                          "attention by 1/sqrt(head size) alone)")
    if kind == "llama3" and not out["low_freq_factor"] < out["high_freq_factor"]:
        raise RopeScalingError("rope_scaling llama3: low_freq_factor must be below high_freq_factor")
    return out
