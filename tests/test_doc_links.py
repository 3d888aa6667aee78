"""Every link of the Markdown resolves, and every experiments/ path the project names exists.

    .venv/bin/python -m pytest -q tests/test_doc_links.py

- Links: every relative link and image, `[text](path)`, `[text](path#anchor)` and `[text](#anchor)`,
  outside code blocks and code spans, in every Markdown file of the repository (README.md, docs/,
  experiments/ and its folders' READMEs, ...: git's tracked and untracked files, ignored ones left out),
  names a file or folder that exists, and its anchor a heading of that file by GitHub's rules
  (`slug`). Web addresses and mail (any `scheme:`) are not followed.
- Paths: every `experiments/...` path named in those Markdown files and in the Python, shell and Slurm
  files of mpi_tp/, experiments/, tests/ and slurm/ (docstrings, comments, command strings, code spans
  and code blocks alike) exists. `*`, `<placeholder>` and `{...}` (an f-string's field or a brace
  list) stand for any name, and a stem for its files. experiments/*/results/ is not read: its files
  record the commands of past runs as they were typed then.

Files only, no MPI job: a second or so.
"""
from __future__ import annotations

import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
FENCE_LINE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
EXPERIMENTS_PATH = re.compile(r"(?<![\w./-])experiments/[^\s`'\"()\[\]|,;]*")
SOURCES = ("mpi_tp", "experiments", "tests", "slurm")


def repository_files(suffixes: tuple[str, ...]) -> list[Path]:
    """The repository's files with these suffixes: git's tracked and untracked ones, without the ignored
    (.venv, runs/, ...) and without those deleted from the working tree; a plain walk when git is absent."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
        paths = {ROOT / p for p in out if p}
    except (OSError, subprocess.CalledProcessError):
        paths = {p for p in ROOT.rglob("*") if not any(part.startswith(".") or part in ("runs", "out")
                                                         for part in p.relative_to(ROOT).parts)}
    return sorted(p for p in paths if p.suffix in suffixes and p.is_file())


MARKDOWN = repository_files((".md",))


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside its fenced code blocks."""
    out, fenced = [], None
    for line in text.splitlines():
        m = FENCE_LINE.match(line)
        if m and (fenced is None or m.group(1) == fenced):
            fenced = m.group(1) if fenced is None else None
        elif fenced is None:
            out.append(line)
    return out


def links(text: str) -> list[str]:
    """The targets of the links and images of a Markdown text, outside code blocks and code spans."""
    return LINK.findall(INLINE_CODE.sub("", "\n".join(prose_lines(text))))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its markup dropped (code ticks, emphasis, a link's target),
    lowercased, every character but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: its headings' slugs (a repeated one gets -1, -2, ...) and <a id>s."""
    found, seen = set(), {}
    for line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def shown(path: Path) -> str:
    """A path as messages name it: from the repository's root when it lies inside."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def broken_links(doc: Path) -> list[str]:
    """The links of `doc` that name no existing file, or a heading the file lacks."""
    broken = []
    for target in links(doc.read_text()):
        if SCHEME.match(target):
            continue                                         # http(s):, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {shown(dest)})")
    return broken


def named_paths(text: str) -> list[str]:
    """The experiments/... paths a text names, without a sentence's closing punctuation."""
    return [m.rstrip(".:") for m in EXPERIMENTS_PATH.findall(text)]


def exists(name: str) -> bool:
    """Whether a path named relative to the repository exists; *, <x> and {x} match any name, and a
    file's stem counts ("results/serve_hostile" for its .md and .jsonl)."""
    pattern = re.sub(r"<[^>]*>?|\{[^}]*\}?", "*", name).rstrip("/") or "."
    if "*" in pattern:
        return next(ROOT.glob(pattern), None) is not None
    return (ROOT / pattern).exists() or next(ROOT.glob(glob.escape(pattern) + ".*"), None) is not None


def path_sources() -> list[Path]:
    """The files whose experiments/ paths are checked: every Markdown file and the code of SOURCES (not
    this file, whose examples name missing paths on purpose), experiments' results/ folders left out."""
    code = [p for p in repository_files((".py", ".sh", ".sbatch"))
            if p.relative_to(ROOT).parts[0] in SOURCES and p != Path(__file__).resolve()]
    return [p for p in MARKDOWN + code
            if not (p.relative_to(ROOT).parts[0] == "experiments" and "results" in p.relative_to(ROOT).parts)]


def test_slug_follows_github():
    assert slug("5. Validation") == "5-validation"
    assert slug("Family by family against PyTorch (issue 26, `experiments/vs_torch/kernels_vs_torch.py`)") == \
        "family-by-family-against-pytorch-issue-26-experimentsvs_torchkernels_vs_torchpy"
    assert slug("Context parallelism: ring attention") == "context-parallelism-ring-attention"
    assert slug("Against PyTorch's KV-cached decoding") == "against-pytorchs-kv-cached-decoding"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok](there.md#a-heading) [ok](there.md#twice-1) [ok](#top) [web](https://x.y/z)\n"
                   "# Top\n[gone](missing.md) [bad anchor](there.md#nowhere)\n"
                   "`[in code](missing2.md)`\n```\n[in a block](missing3.md)\n```\n")
    assert broken_links(doc) == ["missing.md (no such file)",
                                 f"there.md#nowhere (no heading '#nowhere' in {(tmp_path / 'there.md').resolve()})"]


def test_named_paths_are_read_as_written():
    text = ("Run `python experiments/comm/comm_volume.py`; raw: experiments/comm/results/sp_overlap.jsonl.\n"
            "(experiments/memory/results/*.jsonl) f\"experiments/moe/results/{os.path.basename(x)}\" "
            "../experiments/README.md")
    assert named_paths(text) == ["experiments/comm/comm_volume.py", "experiments/comm/results/sp_overlap.jsonl",
                                 "experiments/memory/results/*.jsonl", "experiments/moe/results/{os.path.basename"]
    assert exists("experiments/comm/comm_volume.py") and exists("experiments/<concern>/README.md")
    assert not exists("experiments/comm_volume.py")


def test_the_markdown_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "experiments/README.md"} <= names and any(n.startswith("docs/") for n in names), names


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def test_named_experiments_paths_exist():
    missing = [f"{p.relative_to(ROOT)}: {name}" for p in path_sources() for name in named_paths(p.read_text())
               if not exists(name)]
    assert not missing, "experiments/ paths that do not exist:\n" + "\n".join(missing)
