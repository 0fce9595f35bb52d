"""The import shape of clover/, read from the source (ast, every import, also those inside functions):
no circle between modules, no circle between the packages named below, and no import from a higher
layer into a lower one (cli -> server / eval -> engine -> models -> ops)."""

import ast
from functools import cache
from pathlib import Path

import clover

ROOT = Path(clover.__file__).parent
# lower number = lower layer; a module may import its own layer or lower ones only
LAYERS = {"chat": 0, "ops": 0, "quant": 1, "models": 2, "compile": 3, "engine": 3, "convert": 3, "api": 4, "decision": 4, "structured": 4,
          "server": 4, "eval": 4, "benchmarks": 4, "cli": 5}
KNOWN_PACKAGE_CYCLES: list[list[str]] = []  # none: the test fails as soon as one appears


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("clover",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The clover modules `name` imports (a `from pkg import x` names pkg.x when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import clover.x.y` of a name inside a module
                t = t.rpartition(".")[0]
            if t.startswith("clover") and t != name:
                found.add(t)
    return found


@cache
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(g):
        if v not in index:
            visit(v)
    return out


def package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_walker_sees_imports():
    g = graph()
    assert "clover.ops.moe" in g["clover.models.modeling_clover"]  # from ..ops.moe import ...
    assert "clover.engine.runner" in g["clover.engine.engine"]  # from .runner import ...
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_in_a_circle():
    assert cycles(graph()) == []


def test_no_package_imports_in_a_circle():
    packages: dict[str, set[str]] = {}
    for a, targets in graph().items():
        if (pa := package(a)) is not None:
            packages.setdefault(pa, set()).update(pb for b in targets if (pb := package(b)) not in (None, pa))
    assert cycles(packages) == KNOWN_PACKAGE_CYCLES


def test_no_import_from_a_higher_layer_into_a_lower_one():
    bad = []
    for a, targets in graph().items():
        la = LAYERS.get(package(a))
        for b in targets:
            lb = LAYERS.get(package(b))
            if la is not None and lb is not None and lb > la:
                bad.append(f"{a} -> {b}")
    assert bad == []


def test_user_error_has_one_home():
    from clover.cli import UserError as cli_user_error
    from clover.errors import UserError

    assert cli_user_error is UserError
    assert "clover.cli" not in graph()["clover.api"]
