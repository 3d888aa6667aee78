"""The package's folders import only downward: the layering that README's "How it is built" shows.

    core < text < parallel < model < checkpoint < inference < training < verify < planning < course < commands

A module may import from its own folder or from any folder below it, never from
one above (so `model` cannot reach into `training`, and `core` knows nothing of
MPI groups). Imports inside functions count too. The check reads the source
(ast), so it needs no MPI and runs in a blink.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import mpi_tp

LAYERS = ["core", "text", "parallel", "model", "checkpoint", "inference", "training", "verify", "planning",
          "course", "commands"]
PACKAGE = pathlib.Path(mpi_tp.__file__).parent


def _folder_of(module: str) -> str | None:
    """The folder of mpi_tp a dotted module name lies in (None for mpi_tp itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mpi_tp" else None


def _imports(path: pathlib.Path, folder: str) -> list[tuple[int, str]]:
    """(line, module) for every mpi_tp import in the file (which lies in `folder`), relative ones resolved."""
    tree = ast.parse(path.read_text())
    here = ["mpi_tp", folder]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("mpi_tp")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("mpi_tp"):
                if module == "mpi_tp":          # from mpi_tp import checkpoint -> mpi_tp.checkpoint
                    out += [(node.lineno, f"mpi_tp.{a.name}") for a in node.names if a.name != "__version__"]
                else:
                    out.append((node.lineno, module))
    return out


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def test_every_folder_is_a_known_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"folders {sorted(folders)} vs layers {LAYERS}: add a new folder to LAYERS"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside the folders: {loose}"


def _upward(path: pathlib.Path, folder: str) -> list[str]:
    mine = LAYERS.index(folder)
    return [f"line {line}: {module}" for line, module in _imports(path, folder)
            if _folder_of(module) in LAYERS and LAYERS.index(_folder_of(module)) > mine]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_downward(path):
    folder = path.relative_to(PACKAGE).parts[0]
    upward = _upward(path, folder)
    assert not upward, f"{path.relative_to(PACKAGE)} ({folder}) imports from above: {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The contract can fail: model importing training (inside a function, or relatively) is caught."""
    probe = tmp_path / "gpt.py"
    probe.write_text((PACKAGE / "model" / "gpt.py").read_text()
                     + "\n\ndef _late():\n    from mpi_tp.training import optim  # noqa\n"
                     + "    from ..checkpoint import read  # noqa\n")
    assert [u.split(": ")[1] for u in _upward(probe, "model")] == ["mpi_tp.training", "mpi_tp.checkpoint"]


def test_gpu_stager_does_not_import_the_backend():
    """backend imports gpu (to ask about CUDA support); gpu must not import backend back."""
    imports = [m for _, m in _imports(PACKAGE / "core" / "gpu.py", "core")]
    assert not [m for m in imports if m.startswith("mpi_tp.core.backend")], imports
