"""Sharded HDF5 checkpoints: `write` saves (each rank its shard, then an index), `read` finds, checks and
loads them at any layout; `format` holds what both halves agree on. docs/checkpoints.md has the format.
`hf` reads and writes Hugging Face model folders (config.json + safetensors) the same way; `model` rebuilds
a saved model (either kind) at tensor-parallel size = world size, with its tokenizer
(load_model, model_tokenizer)."""
from mpi_tp.checkpoint.format import FORMAT, VERSION, CheckpointError, complete_steps, shard_name, step_dir_name
from mpi_tp.checkpoint.read import (Checkpoint, check_model_config, load_into, open_checkpoint, resolve,
                                   restore_rng, rng_state)
from mpi_tp.checkpoint.write import save

__all__ = ["FORMAT", "VERSION", "Checkpoint", "CheckpointError", "check_model_config", "complete_steps",
           "load_into", "open_checkpoint", "resolve", "restore_rng", "rng_state", "save", "shard_name",
           "step_dir_name"]
