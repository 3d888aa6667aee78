"""Rotary embeddings stretched past the length a model was trained at: the rope_scaling types of transformers
(`rope_scaling` in a config.json of transformers 4, `rope_parameters` in 5) that change the frequencies alone.

Legend: inv_freq_j = theta^(-2j/hs), j < hs/2, each pair's angle per position (mpi_tp.model.rope); wavelen_j =
2 pi / inv_freq_j, the positions one turn takes; L0 = original_max_position_embeddings.

    linear   inv_freq / factor                          every pair turns factor times slower (positions / factor)
    llama3   wavelen < L0 / high_freq_factor:  inv_freq           (fast pairs: kept)
             wavelen > L0 / low_freq_factor:   inv_freq / factor  (slow pairs: stretched)
             between: (1 - a) inv_freq / factor + a inv_freq,  a = (L0 / wavelen - low) / (high - low)

The frequencies are computed where the angles are (mpi_tp.core.kernels_llama.scaled_inv_freq); this module
checks a configuration's scaling. Llama 3.1, 3.2 and 3.3 use llama3 (factor 8 or 32, low 1, high 4, L0 8192); their attention is not rescaled
(attention_factor 1). "dynamic" (NTK) recomputes theta from the longest sequence a forward has seen, so a
token's angles depend on what was decoded before it: refused for now, as every other type, by name.
"""
from __future__ import annotations

import math



class RopeScalingError(ValueError):
    """A rope_scaling mpi_tp does not compute (GPTConfig.validate says it as a ConfigError)."""

ROPE_TYPES = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")}


def check_rope_scaling(scaling) -> dict | None:
    """The scaling as mpi_tp keeps it ({"rope_type", and the type's numbers}), or None for none; one
    RopeScalingError naming what is not supported."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise RopeScalingError(f"rope_scaling {scaling!r}: expected an object with a rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise RopeScalingError(f"rope_scaling rope_type {kind!r} is not supported (mpi_tp computes "
                          f"{', '.join(ROPE_TYPES)}; 'dynamic' makes a token's angles depend on the sequence "
                          "decoded before it, and is not in yet)")
    out = {"rope_type": kind}
    for key in ROPE_TYPES[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise RopeScalingError(f"rope_scaling {kind}: {key} = {value!r} must be a finite number > 0")
        out[key] = float(value) if key != "original_max_position_embeddings" else int(value)
    extra = scaling.get("attention_factor")
    if extra not in (None, 1, 1.0):
        raise RopeScalingError(f"rope_scaling {kind}: attention_factor = {extra!r} is not supported (mpi_tp scales "
                          "attention by 1/sqrt(head size) alone)")
    if kind == "llama3" and not out["low_freq_factor"] < out["high_freq_factor"]:
        raise RopeScalingError("rope_scaling llama3: low_freq_factor must be below high_freq_factor")
    return out
