"""No import circles in mpi_tp/: every module's imports, those inside functions included, form a graph
without a cycle (a lazy import inside a function hides a circle from Python, not from a reader)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mpi_tp"


def modules() -> dict:
    """{dotted name: (path, is a package)} of every module under mpi_tp/."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(mods: dict) -> dict:
    """{module: the mpi_tp modules it imports}, resolving relative imports and `from package import module`."""
    edges = {}
    for name, (path, package) in mods.items():
        here = name.split(".") if package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    found.add(t)
        edges[name] = found
    return edges


def cycle(edges: dict) -> list:
    """One cycle of the graph as a list of modules, or [] (depth-first search, colours)."""
    state, path = {}, []

    def visit(v):
        state[v] = "open"
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        path.pop()
        return []

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_the_checker_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_mpi_tp():
    mods = modules()
    edges = imports(mods)
    assert len(mods) > 100 and sum(map(len, edges.values())) > 400          # it read the package
    assert edges["mpi_tp.training.step"] >= {"mpi_tp.parallel.finalize", "mpi_tp.parallel.pipeline.stage"}
    found = cycle(edges)
    assert not found, "import circle: " + " -> ".join(found)
