"""A Hugging Face model folder read as an mpi_tp checkpoint: each rank reads only the slices it keeps.

    folder/config.json                            the model (mpi_tp.checkpoint.hf.config)
    folder/model.safetensors                      every tensor, or, sharded:
    folder/model.safetensors.index.json           {"weight_map": {tensor: file}}
    folder/model-00001-of-00003.safetensors ...

`HFFolder(path).read(name, axis, start, stop)` answers in mpi_tp's names, as
`Checkpoint.read` does, so `checkpoint.load_into` fills a model from either; the
slice comes from safetensors' `safe_open(...).get_slice`, which reads those bytes
only, so no rank ever holds a whole tensor it does not keep (a vocabulary-split
wte: its V_i rows). bfloat16 (which safetensors' NumPy reader lacks) is read
through a memory map of the same bytes as ml_dtypes' bfloat16, unchanged. No torch.

The folder's format (meta "dtypes", what eval, generate, serve and import-hf load
it as by default) is its tensors' (config.json's torch_dtype is only a hint):
bfloat16, float16, float32 or float64 when every tensor has it; the widest present
when they differ (float32 for bfloat16 beside float16), so nothing is rounded
unless --precision asks.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy

from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.checkpoint.hf.config import HFConfigError, gpt_config, read_config
from mpi_tp.checkpoint.hf.names import (
    IGNORED_SUFFIXES,
    PREFIXES,
    TIED_HEAD,
    hf_shapes,
    pieces,
    region,
)
from mpi_tp.core.precision import bfloat16

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
WIDER = ("F64", "F32")        # the format of a folder whose tensors differ: the first of these present (else F32)


def is_hf_folder(path: str) -> bool:
    """A folder with a config.json and safetensors weights, or whose config.json names a model_type (its
    weights missing or in another format: HFFolder then says so). A training run's folder has a
    config.json too, of training options, and no weights beside it."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    if os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX)):
        return True
    try:
        with open(config) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def require_safetensors() -> None:
    """One CheckpointError saying what to install when the safetensors package is absent."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError("Hugging Face folders need the safetensors package: pip install -e '.[hf]' "
                              "(or pip install safetensors)") from None


def weight_files(folder: str) -> dict[str, str]:
    """Hugging Face tensor name -> the safetensors file (a path) that holds it, per the folder's index."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {index} ({e}): it should hold a weight_map") from None
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    if os.path.isfile(os.path.join(folder, SINGLE)):
        return None                      # every tensor in model.safetensors (its keys are read on open)
    others = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".h5", ".msgpack")))
    raise CheckpointError(f"Hugging Face model {folder} has no {SINGLE} nor {INDEX}" +
                          (f" (it holds {', '.join(others)}: mpi_tp reads only safetensors; save it with "
                           "save_pretrained(..., safe_serialization=True))" if others else ""))


class HFFolder:
    """A Hugging Face GPT-2 or Llama folder (Mistral, Qwen2, or Mixtral: its experts one tensor each, or fused),
    opened and checked (names, shapes, dtypes: every tensor the model needs is there, nothing is left that mpi_tp
    would not use); reads like a Checkpoint.

    meta: {"config": the GPTConfig as a dict, "dtypes": the folder's format (folder_dtype), "source": where it
    came from}; step 0; no optimizer state.
    """

    has_optimizer = False
    step = 0

    def __init__(self, path: str):
        self.dir = os.path.normpath(path)
        self._stack = contextlib.ExitStack()
        self._open = {}
        self.hf_config = read_config(path)
        self.cfg = gpt_config(self.hf_config, self.dir)
        require_safetensors()
        files = weight_files(path)
        if files is None:
            single = os.path.join(path, SINGLE)
            files = {name: single for name in self._file(single).keys()}
        self.files = files
        self.prefix = self._prefix()
        # a Mixtral saved as transformers 5 holds it in memory (save_original_format=False): its experts fused
        self.fused = bool(self.cfg.moe_experts) and any(n.endswith(".mlp.experts.gate_up_proj") for n in files)
        self.pieces = pieces(self.cfg, self.prefix, self.fused)
        self.dtypes = self._check()
        self.meta = {"config": self.cfg.to_dict(), "dtypes": folder_dtype(self.dtypes.values()),
                     "source": {"format": "huggingface", "path": os.path.abspath(path),
                                "model_type": self.hf_config.get("model_type")}}

    # ------------------------------------------------------------ opening and checking

    def _file(self, path: str):
        if path not in self._open:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing (the folder's {INDEX} names it)")
            try:
                from safetensors import safe_open
                self._open[path] = self._stack.enter_context(safe_open(path, framework="np"))
            except Exception as e:  # noqa: BLE001 (safetensors raises its own types for a damaged file)
                raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e}): not a safetensors "
                                      "file, or damaged") from None
        return self._open[path]

    def _prefix(self) -> str:
        prefixes, table = PREFIXES[self.cfg.arch]
        for prefix in prefixes:
            if f"{prefix}{table}" in self.files:
                return prefix
        raise HFConfigError(f"Hugging Face model {self.dir} has no {prefixes[0]}{table} (nor {table}): not a "
                            f"{self.hf_config.get('model_type')} checkpoint")

    def _check(self) -> dict[str, str]:
        """{tensor: safetensors dtype}; one HFConfigError for a missing, unexpected or misshapen tensor."""
        want = hf_shapes(self.cfg, self.prefix, self.fused)
        missing = sorted(set(want) - set(self.files))
        if missing:
            raise HFConfigError(f"Hugging Face model {self.dir} lacks {missing[0]}"
                                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                                "its config.json describes a bigger model than its weights")
        extra = sorted(n for n in set(self.files) - set(want)
                       if n != TIED_HEAD and not n.endswith(IGNORED_SUFFIXES[self.cfg.arch]))
        if extra:
            raise HFConfigError(f"Hugging Face model {self.dir} holds {extra[0]}"
                                f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which mpi_tp's "
                                f"{self.cfg.arch} model has no place for: not supported")
        dtypes, self.shapes = {}, want
        for name, shape in want.items():
            s = self._file(self.files[name]).get_slice(name)
            got, dtype = tuple(s.get_shape()), s.get_dtype()
            if got != shape:
                raise HFConfigError(f"Hugging Face model {self.dir}: {name} is {got}, but its config.json "
                                    f"makes it {shape}")
            if dtype not in DTYPES:
                raise HFConfigError(f"Hugging Face model {self.dir}: {name} is {dtype}; mpi_tp reads "
                                    f"{', '.join(DTYPES)}")
            dtypes[name] = dtype
        return dtypes

    def tokenizer(self):
        """The folder's tokenizer.json (and its eos ids) if it has one, else bytes (mpi_tp.text.tokenizer)."""
        from mpi_tp.text.tokenizer import load_tokenizer
        has = os.path.isfile(os.path.join(self.dir, "tokenizer.json"))
        return load_tokenizer(self.dir if has else "bytes")

    # ------------------------------------------------------------ reading, as Checkpoint does

    def read(self, name: str, axis=None, start: int = 0, stop: int | None = None):
        """mpi_tp tensor `name` ("model/h/0/attn/q/weight"), whole, or its slice [start, stop) along `axis`
        (a rank's shard): only those bytes are read from the safetensors file."""
        group, _, param = name.partition("/")
        if group != "model":
            raise CheckpointError(f"{name}: Hugging Face model {self.dir} holds no optimizer state (only the "
                                  "model's weights)")
        piece = self.pieces.get(param)
        if piece is None:
            raise CheckpointError(f"Hugging Face model {self.dir} has no tensor for {param!r}: the model "
                                  "loading it is not the one its config.json describes")
        idx = region(piece, len(self.shapes[piece.tensor]), axis, start, stop if stop is not None else 0)
        values = self._slice(piece.tensor, idx)
        return numpy.ascontiguousarray(values.T if piece.transposed else values)

    def _slice(self, tensor: str, idx: tuple):
        path = self.files[tensor]
        if self.dtypes[tensor] == "BF16":
            return _bf16_slice(path, tensor, idx)
        return self._file(path).get_slice(tensor)[idx]

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def folder_dtype(dtypes) -> str:
    """The format of a folder whose tensors have these safetensors dtypes: theirs if they agree, else the widest
    (every 16-bit value is an fp32 value: nothing is rounded)."""
    kinds = set(dtypes)
    if len(kinds) == 1:
        return DTYPES[kinds.pop()]
    return DTYPES[next((k for k in WIDER if k in kinds), "F32")]


def _bf16_slice(path: str, tensor: str, idx: tuple):
    """A bfloat16 tensor's slice, its 16-bit words as they are (ml_dtypes' bfloat16), from a memory map of the
    file: only the pages of the slice are read."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    begin = header[tensor]["data_offsets"][0]
    shape = tuple(header[tensor]["shape"])
    raw = numpy.memmap(path, dtype="<u2", mode="r", offset=8 + n + begin, shape=shape)
    return numpy.array(raw[idx], dtype=numpy.uint16).view(bfloat16())
