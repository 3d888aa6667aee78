"""Hugging Face model folders (config.json + safetensors): read as a checkpoint at any layout (`read`),
written from one (`write`); `config` maps config.json to GPTConfig, `names` the tensors to mpi_tp's,
`mixtral` says which mixtures of experts export can write as Mixtral.
Needs the safetensors package (the `hf` extra), not torch."""
from mpi_tp.checkpoint.hf.config import HFConfigError, gpt_config, hf_config
from mpi_tp.checkpoint.hf.read import HFFolder, is_hf_folder
from mpi_tp.checkpoint.hf.write import export

__all__ = ["HFConfigError", "HFFolder", "export", "gpt_config", "hf_config", "is_hf_folder"]
