"""The decoding core stays readable: no function over 60 lines in the engine (row batch, modes,
runner and its compile machinery, infiller, slot jobs) or the server (assembly, routes, scheduler, shapes)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import clover

ROOT = Path(clover.__file__).parent
CORE = ("engine", "server")
LIMIT = 60


def long_functions(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_check_sees_long_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 61 + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path, LIMIT) == [f"{tmp_path.name}/m.py:1 f (62 lines)"]


def test_no_function_over_60_lines_in_the_core():
    assert [f for package in CORE for f in long_functions(ROOT / package, LIMIT)] == []


# Figures belong in BENCHMARKS.md and commit messages, not in comments or docstrings: a timing, a
# speed ratio or a story of what the code did before goes stale the day the code changes.
UNIT = r"(?:ms|us|µs|ns|GB/s|GFLOP/s|tok/s|tokens/s)"
FIGURE = re.compile(
    r"\d(?:\.\d+)?\s?" + UNIT + r"(?![\w/])"  # 3.2 ms, 40 us, 300 tok/s
    r"|\d(?:\.\d+)?\s(?:s|sec|seconds)\b|\d\.\d+s\b"  # ~30 s, 0.5 seconds, 1.5s; not "400s" (status codes)
    r"|\d(?:\.\d+)?x(?![\w.])"  # 1.46x, 2-3x (a ratio); not 0x1f nor a 4 x 16 tile
    r"|~\s?\d+(?:\.\d+)?\s?%|\d(?:\.\d+)?\s?% (?:faster|slower)"  # ~40%, 10% faster; not "75% of the budget"
    r"|\b(?:previously|formerly|Before these)\b"  # history
)


def comment_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line in `source`."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def figures_in_comments(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(skip):
            continue
        out += [f"{path.relative_to(root.parent)}:{n}: {line.strip()}" for n, line in comment_lines(path.read_text())
                if FIGURE.search(line)]
    return out


def test_the_check_sees_figures_and_history_but_not_shapes(tmp_path):
    (tmp_path / "m.py").write_text(
        '"""Fast path.\n\nBefore these tiles it ran plain loops."""\n'
        "x = 1  # ~0.4 ms a step\n"
        "# a 4 x 16 tile over 0x1f rows, 75% of the budget, int4 x2\n"
        "y = 2  # took 0.5 seconds, not a 400s reply\n"
        "def f():\n    '''2.5x faster than torch'''\n")
    found = figures_in_comments(tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == [f"{tmp_path.name}/m.py:{n}" for n in (4, 6, 3, 8)]
    assert figures_in_comments(tmp_path, skip=("m.py",)) == []


def test_no_timing_ratio_or_history_in_comments():
    assert figures_in_comments(ROOT) == []


# The runner and the compile machinery behind it: shorter functions still, and no process-wide
# mutable state in the runner (what is compiled for a model lives in its compile.CompileState).
RUNNER = (ROOT / "engine" / "runner.py", ROOT / "compile")
RUNNER_LIMIT = 60
MUTABLE = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
           "local", "deque", "Counter"}


def module_state(path: Path) -> list[str]:
    """Module-level names bound to a mutable container, and module-level statements that are neither
    definitions, imports, constants nor the docstring (e.g. a loop registering hooks at import)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if [getattr(t, "id", None) for t in targets] == ["__all__"]:
                continue
            value = node.value
            call = value.func if isinstance(value, ast.Call) else None
            name = call.attr if isinstance(call, ast.Attribute) else call.id if isinstance(call, ast.Name) else None
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or name in MUTABLE:
                out.append(f"{path.name}:{node.lineno} mutable module state")
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
                out.append(f"{path.name}:{node.lineno} statement run at import")
    return out


def test_the_state_check_sees_registries_and_import_time_code(tmp_path):
    (tmp_path / "m.py").write_text('"""doc"""\nimport weakref\nN = 3\nNAMES = ("a",)\nseen = {}\n'
                                   'cache = weakref.WeakKeyDictionary()\nfor f in ():\n    f(1)\n')
    assert module_state(tmp_path / "m.py") == ["m.py:5 mutable module state", "m.py:6 mutable module state",
                                               "m.py:7 statement run at import"]


def test_no_function_over_60_lines_in_the_runner_and_compile_package():
    found = []
    for path in RUNNER:
        if path.is_dir():
            found += long_functions(path, RUNNER_LIMIT)
        else:
            found += [f for f in long_functions(path.parent, RUNNER_LIMIT) if f.startswith(f"engine/{path.name}:")]
    assert found == []


def test_the_runner_holds_no_module_level_state():
    assert module_state(ROOT / "engine" / "runner.py") == []
    # the compile package: one registry, model -> its CompileState
    found = [f for path in sorted((ROOT / "compile").glob("*.py")) for f in module_state(path)]
    assert found == [f"state.py:{_line_of(ROOT / 'compile' / 'state.py', '_states')} mutable module state"]


def _line_of(path: Path, name: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(f"{name}:"))


def test_no_eval_and_no_process_wide_module_hooks():
    """Nothing in clover/ builds code with eval or hooks every nn.Module of the process."""
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                builtin_eval = isinstance(f, ast.Name) and f.id == "eval"
                assert not builtin_eval and not name.startswith("register_module_"), f"{path}:{node.lineno} {name}"
