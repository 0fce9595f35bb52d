"""The decoding core stays readable: no function over ~80 lines in the engine (row batch, modes,
runner, infiller) or the server (assembly, routes, scheduler, shapes)."""

import ast
from pathlib import Path

import clover

ROOT = Path(clover.__file__).parent
CORE = ("engine", "server")
LIMIT = 80


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
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 81 + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path, LIMIT) == [f"{tmp_path.name}/m.py:1 f (82 lines)"]


def test_no_function_over_80_lines_in_the_core():
    assert [f for package in CORE for f in long_functions(ROOT / package, LIMIT)] == []
