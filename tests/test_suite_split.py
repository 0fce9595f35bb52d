"""The suite's split: `make test` runs every test but those marked `compiled` or `slow`
(tests/conftest.py), `make test-compiled` and `make test-slow` run those, and CI runs all three, so no
test is left out of CI; the names that conftest marks exist (a renamed test would otherwise fall
silently into the default run)."""

import ast
import re
from pathlib import Path

import pytest
from conftest import COMPILED, SLOW

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.mark.parametrize("marked", [COMPILED, SLOW], ids=["compiled", "slow"])
def test_every_test_conftest_marks_exists(marked):
    for module, names in marked.items():
        path = TESTS / module
        assert path.exists(), f"conftest names {module}, which is gone"
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert names is None or names <= defined, f"{module} has no {sorted(names - defined)}"


def test_make_test_compiled_and_slow_split_the_suite_and_ci_runs_all_three():
    make = ROOT.joinpath("Makefile").read_text()
    default = re.search(r"^test: .*\n\t(.+)$", make, re.M).group(1)
    compiled = re.search(r"^test-compiled: .*\n\t(.+)$", make, re.M).group(1)
    slow = re.search(r"^test-slow: .*\n\t(.+)$", make, re.M).group(1)
    assert default.endswith('pytest -q -x -m "not compiled and not slow"')
    assert compiled.endswith("pytest -q -x -m compiled") and slow.endswith('pytest -q -x -m "slow and not compiled"')
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert {"make test", "make test-compiled", "make test-slow"} <= set(ci)


def test_the_compiled_cases_of_a_parametrized_test_are_the_marked_ones(pytester):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".ini", pytest="[pytest]\nmarkers =\n    compiled: test")
    pytester.makepyfile(test_ops="""
import pytest

@pytest.mark.parametrize("n,compiled", [(1, False), (2, True)])
def test_local_window_attention_matches_naive_same_window_mask(n, compiled):
    pass

def test_gathered_experts_compiled_match_naive():
    pass

def test_other():
    pass
""")
    result = pytester.runpytest_subprocess("-m", "compiled", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, deselected=2)
    result = pytester.runpytest_subprocess("-m", "not compiled", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, deselected=2)
