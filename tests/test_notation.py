"""One notation: no doc, docstring, comment or lesson text uses an alias that docs/notation.md forbids.

Scanned: README.md, docs/*.md, experiments/**/*.md, and the strings and comments of every Python file
of mpi_tp/, experiments/ and tests/ (the lessons' printouts and the figures' labels are strings); not the
raw records of experiments/*/results/.

The forbidden aliases are the table at the end of docs/notation.md (pattern, what to write instead,
an example the pattern must catch), so the glossary and the check cannot drift apart.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTATION = ROOT / "docs" / "notation.md"


def _cells(row: str) -> list[str]:
    """The cells of one markdown table row; `\\|` is a pipe inside a cell."""
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def forbidden(text: str | None = None) -> list[tuple[re.Pattern, str, str]]:
    """(pattern, write instead, example) for every row of notation.md's "Forbidden aliases" table."""
    text = NOTATION.read_text() if text is None else text
    section = text.split("## Forbidden aliases", 1)[1]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    out = []
    for row in rows:
        pattern, instead, example = _cells(row)
        out.append((re.compile(pattern.strip("`")), instead, example))
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader sees: a markdown file whole, a Python file's strings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for k, line in enumerate(tok.string.splitlines()):
                out.append((tok.start[0] + k, line))
    return out


def documents() -> list[Path]:
    experiments = [p for p in sorted((ROOT / "experiments").rglob("*")) if "results" not in p.parts]
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *[p for p in experiments if p.suffix == ".md"]]
    code = [*sorted((ROOT / "mpi_tp").rglob("*.py")), *[p for p in experiments if p.suffix == ".py"],
            *sorted((ROOT / "tests").glob("*.py"))]
    return [p for p in docs if p != NOTATION] + [p for p in code if p != Path(__file__).resolve()]


def violations(paths, rules) -> list[str]:
    found = []
    for path in paths:
        for line_no, line in prose(path):
            for pattern, instead, _ in rules:
                m = pattern.search(line)
                if m:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{line_no}: '{m.group(0)}' -> write {instead}")
    return found


def test_the_glossary_has_rules_and_each_catches_its_example():
    rules = forbidden()
    assert len(rules) >= 8
    for pattern, instead, example in rules:
        assert pattern.search(example), f"the pattern {pattern.pattern!r} misses its own example {example!r}"


def test_no_doc_or_docstring_uses_a_forbidden_alias():
    found = violations(documents(), forbidden())
    assert not found, f"{len(found)} uses of notation that docs/notation.md forbids:\n" + "\n".join(found[:60])


def test_the_checker_fails_on_a_planted_alias(tmp_path):
    """Plant each example in a doc and in a docstring: the checker must report every one."""
    rules = forbidden()
    doc, code = tmp_path / "planted.md", tmp_path / "planted.py"
    doc.write_text("# A page\n\n" + "\n".join(f"Here {ex}." for _, _, ex in rules) + "\n")
    code.write_text('"""A module."""\n\n\ndef f():\n    """Rank 0 holds ' + rules[0][2] + '."""\n    return 1  # fine\n')
    assert len(violations([doc], rules)) >= len(rules)
    assert len(violations([code], rules)) == 1
    clean = tmp_path / "clean.py"
    clean.write_text('x = 1  # the head size hs = C / H; rank i holds A_i of A = [A_0 | ... | A_{T-1}]\n')
    assert violations([clean], rules) == []
