"""One notation: no doc, docstring, comment or lesson text uses an alias that docs/notation.md forbids.

Scanned: README.md, docs/*.md, experiments/**/*.md, and the strings and comments of every Python file
of mpi_tp/, experiments/ and tests/ (the lessons' printouts and the figures' labels are strings); not the
raw records of experiments/*/results/.

The forbidden aliases are the table at the end of docs/notation.md (pattern, what to write instead,
an example the pattern must catch), so the glossary and the check cannot drift apart.

One symbol, one meaning: the glossary's symbol tables give each symbol one row (and each flag one
symbol), and no markdown page defines a size otherwise (`W = T D P`, `N = cp ranks`, `(N, the cp size`,
`--cp N`: class Definitions). The code's docstrings are not held to that yet: some keep local letters
(FlashAttention's D = rowsum(dout * out) beside the variable D, M and R for the rows an all-to-all sends
and receives, `mpi-tp explain --layer cp`'s N).
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



# One symbol, one meaning: the glossary's tables define each symbol once, and no page defines one otherwise.

GROUPS = {"tp": "T", "cp": "Z", "pp": "P", "dp": "D", "ep": "ep", "edp": "edp"}   # a group's name -> its size
FILLER = {"the", "a", "an", "number", "of", "all", "one", "each", "its", "this"}
OPERATOR = re.compile(r"[-+/*()^]|x|ceil|max|min")


def glossary(text: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """symbol -> [(meaning, in the code), ...]: one entry per row of notation.md's symbol tables (those headed
    `| symbol |`), a row "K, O" giving both; two entries are a symbol defined twice."""
    text = NOTATION.read_text() if text is None else text
    out: dict[str, list[tuple[str, str]]] = {}
    in_table = False
    for line in text.split("## Forbidden aliases", 1)[0].splitlines():
        cells = _cells(line) if line.startswith("|") else []
        in_table = bool(cells) and (in_table or cells[0] == "symbol")
        if in_table and cells[0] != "symbol" and not set(cells[0]) <= set("-: "):
            for symbol in re.split(r",\s*", cells[0]):
                if symbol and "..." not in symbol:
                    out.setdefault(symbol, []).append((cells[1], cells[2] if len(cells) > 2 else ""))
    return out


def flags(code: str) -> list[str]:
    return re.findall(r"`(--[a-z0-9-]+)`", code)


def defined_twice(table: dict[str, list[tuple[str, str]]]) -> list[str]:
    """Symbols with two rows, and flags that the code column gives to two symbols."""
    found = [f"{s} is defined {len(rows)} times: " + " / ".join(m for m, _ in rows)
             for s, rows in table.items() if len(rows) > 1]
    owner: dict[str, str] = {}
    for symbol, rows in table.items():
        for flag in flags(" ".join(code for _, code in rows)):
            if owner.setdefault(flag, symbol) != symbol:
                found.append(f"{flag} is the code of both {owner[flag]} and {symbol}")
    return found


class Definitions:
    """What notation.md says each size is (its symbols that start with a capital letter, and hs, ep, edp), and
    the three ways a page can define one otherwise:
    - `X = formula`, where notation.md gives X a formula and this one has other letters (W = T D P);
    - `X = words` or `(X, the words`, whose first word the glossary's row never uses (N = cp ranks);
    - `--flag X`, a flag that the glossary gives to another symbol (`--cp N`).
    A value (`N = 4096`, `T = {T}`, a quoted literal) defines nothing."""

    def __init__(self, text: str | None = None):
        table = glossary(text)
        self.meaning = {s: " ".join(f"{m} {c}" for m, c in rows) for s, rows in table.items()}
        self.symbols = [s for s in table if s[0].isupper() or s in ("hs", "ep", "edp")]
        self.flag_owner = {f: s for s, rows in table.items() for f in flags(" ".join(c for _, c in rows))}
        self.formulas = {s: [self.formula(rhs) for rhs in re.findall(rf"(?<![\w.]){re.escape(s)} = ([^,;(]+)",
                                                                      self.meaning[s])] for s in self.symbols}
        alt = "|".join(re.escape(s) for s in sorted(self.symbols, key=len, reverse=True))
        self.equation = re.compile(rf"(?<![\w.`'/\[-])({alt}) = (?!=)([^,;:\]]*)")
        self.apposition = re.compile(rf"(?:^|\(|; )({alt}), the ([A-Za-z][\w-]*)")
        self.flag = re.compile(rf"(--[a-z0-9-]+)[ =]({alt})\b")

    def formula(self, rhs: str) -> list[str]:
        """The letters of the formula that starts `rhs`, in order, up to its first plain word: "B S rows" -> B, S;
        "(S/N) C" -> S, N, C; operators and numbers left out, so that "B*S" and "B S" are one formula."""
        letters = []
        for tok in re.findall(r"[A-Za-z_]+|[0-9.]+|[^\sA-Za-z0-9_.]", rhs):
            if tok in self.meaning and tok not in ("x",):
                letters.append(tok)
            elif not (OPERATOR.fullmatch(tok) or tok[0].isdigit() or tok == "."):
                break
        return letters

    def _words(self, symbol: str) -> set[str]:
        meaning = self.meaning[symbol]                     # the row's meaning and its code column
        words = {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z-]*", meaning)}
        words |= {g for g, size in GROUPS.items() if re.search(rf"(?<![\w.]){re.escape(size)}(?![\w.])", meaning)}
        return words | {w[:-2] for w in words if w.endswith("es")} | {w[:-1] for w in words if w.endswith("s")}

    def _other_word(self, symbol: str, word: str) -> bool:
        word = word.lower()
        return not {word, word.removesuffix("s")} & self._words(symbol)

    def misuses(self, line: str) -> list[str]:
        found = []
        for m in self.equation.finditer(line):
            symbol, rhs = m.group(1), m.group(2).strip()
            if not rhs or rhs[0] in "0123456789-({'\"`" or re.match(r"[A-Z_]{2,}\b", rhs):
                continue                                  # a value or a constant's name, not a definition
            letters = self.formula(rhs)
            if not letters:
                words = [w for w in re.findall(r"[A-Za-z][A-Za-z-]*", rhs) if w.lower() not in FILLER]
                if words and self._other_word(symbol, words[0]):
                    found.append(m.group(0).strip())
            elif self.formulas[symbol] and sorted(letters) not in map(sorted, self.formulas[symbol]):
                found.append(m.group(0).strip())
        for m in self.apposition.finditer(line):
            if self._other_word(m.group(1), m.group(2)):
                found.append(m.group(0).lstrip("(; "))
        for m in self.flag.finditer(line):
            owner = self.flag_owner.get(m.group(1))
            if owner and owner != m.group(2):
                found.append(f"{m.group(0)} ({m.group(1)} is {owner})")
        return found


def misuses(paths, definitions: Definitions) -> list[str]:
    found = []
    for path in paths:
        for line_no, line in prose(path):
            for what in definitions.misuses(line):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                symbol = re.match(r"(?:--[a-z0-9-]+ )?(\w+)", what).group(1)
                found.append(f"{where}:{line_no}: '{what}', but in notation.md {symbol} is: "
                             f"{definitions.meaning.get(symbol, '?')[:90]}")
    return found


def test_the_glossary_defines_each_symbol_once():
    assert not defined_twice(glossary())


def test_no_page_defines_a_symbol_otherwise():
    """Each page says what notation.md says: `W = ...`, `(N, the ...`, `--cp X` as the glossary has them (the
    markdown pages; the code's docstrings still hold local letters, see the module's docstring)."""
    pages = [p for p in documents() if p.suffix == ".md"]
    found = misuses(pages, Definitions())
    assert not found, f"{len(found)} symbols defined otherwise than in docs/notation.md:\n" + "\n".join(found[:60])


OLD_GLOSSARY = """## Sizes of the model

| symbol | meaning | in the code |
| --- | --- | --- |
| N | tokens a layer sees at once, N = B S (the rows of its GEMMs) | |
| R | query heads per key/value head, R = H / H_kv | `mpi_tp/model/heads.py` |

## Sizes of the layout

| symbol | meaning | in the code |
| --- | --- | --- |
| W | world size: every rank of the job, W = T D P | `comm.Get_size()` |

## Cost model

| symbol | meaning |
| --- | --- |
| R | a GEMM rate (FLOP/s) at a given number of rows |

## Forbidden aliases
"""


def test_the_checker_fails_on_a_symbol_used_two_ways(tmp_path):
    """What the pages said before cp had a letter: R twice in the glossary, N the tokens and the cp size,
    W = T D P without cp; and what they say now passes."""
    assert defined_twice(glossary(OLD_GLOSSARY)) == [(
        "R is defined 2 times: query heads per key/value head, R = H / H_kv / a GEMM rate (FLOP/s) at a given "
        "number of rows")]
    old = tmp_path / "old.md"
    old.write_text("Context parallelism (`--cp N`, Megatron's CP) splits S over N ranks.\n"
                   "Legend: N = cp ranks, r = this rank.\n"
                   "and pipeline stages, W = T D P ranks in all; (N, the cp size)\n")
    found = misuses([old], Definitions())
    assert [f.split(": ", 1)[1].split("'")[1] for f in found] == [
        "--cp N (--cp is Z)", "N = cp ranks", "W = T D P ranks in all", "N, the cp"], found
    new = tmp_path / "new.md"
    new.write_text("Context parallelism (`--cp Z`) splits S over Z ranks, N = B S tokens, W = T Z P D ranks;\n"
                   "N = 4096 rows, T = {T}, R = H / H_kv, (N, the tokens of a micro-batch).\n")
    assert misuses([new], Definitions()) == []


def test_tensor_parallelism_names_modules_that_exist():
    """The dotted names of docs/tensor_parallelism.md (`mpi_tp.parallel.topology.split_sizes`) import: the page
    once named `layers.`, `comm.` and `loss.` modules that never existed."""
    import importlib

    text = (ROOT / "docs" / "tensor_parallelism.md").read_text()
    dotted = re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)\.([A-Za-z_]+)`", text)
    assert dotted
    for module, name in dotted:
        path = module if module.startswith("mpi_tp") else f"mpi_tp.{module}"
        try:
            assert hasattr(importlib.import_module(path), name), f"{path} has no {name}"
        except ModuleNotFoundError:
            raise AssertionError(f"docs/tensor_parallelism.md names `{module}.{name}`: no module {path}") from None
