"""Every command in README.md's code blocks, as a new user types it on a fresh clone: the cheap ones
run as written (exit 0), the ones that need the user's own files or data that `make model` builds
end in their one helpful line (exit 2), and the rest (long benchmarks, servers, interactive, builds)
are named here with the test that covers them. A command added to the README without an entry here
fails the test, so the README cannot drift from what the CLI does.

Commands run in-process (`clover.cli.main`) in a scratch folder that sees the repository's
`clover/` and `recipes/` (so relative paths resolve as in a clone, and nothing lands in the tree);
`runs/` is absent there, as on a fresh clone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from clover.cli import main

ROOT = Path(__file__).resolve().parents[1]

RUN = "runs as written"
# prefix of the command -> RUN, ("error", what its one line must say), or ("elsewhere", why / which test)
EXPECTED = {
    "make demo": ("elsewhere", "installs; .ci/run runs it"),
    "make test": ("elsewhere", "the test suite itself"),
    "make distill": ("elsewhere", "trains for its time budget; tests/test_distill.py, tests/test_recipe.py"),
    "make llamacpp": ("elsewhere", "builds llama.cpp from PyPI's sdist; tests/test_llamacpp*.py"),
    'clover generate --prompt "What is 47+385?" --json': RUN,
    'clover generate --prompt "What is 47+385?" --mode ar': RUN,
    'clover generate --prompt "What is 47+385?" --mode self_spec': RUN,
    'clover generate --prompt "ROMEO:" --mode self_spec --draft lookup': RUN,
    'clover generate --prompt "What is 47+385?" --chat --think --show': RUN,
    "clover chat": ("elsewhere", "interactive; tests/test_chat.py"),
    "clover serve": ("elsewhere", "a server; tests/test_server*.py"),
    "clover info --preset clover-35b-a3b --json": RUN,
    "clover info --preset clover-35b-a3b --plan train": RUN,
    "clover convert QWEN3_NEXT_DIR OUT_DIR": ("error", "QWEN3_NEXT_DIR: no config.json (not a model folder)"),
    "clover train --config recipes/default/bd.toml": ("error", "`make model`"),
    "clover quantize MODEL_DIR OUT_DIR": ("error", "MODEL_DIR: no config.json (not a model folder)"),
    "clover decide --material m.txt": ("error", "m.txt"),
    'clover generate --prompt "Ann is 34." --json-schema person.json': ("error", "person.json: no such schema file"),
    "clover eval --tasks clover_suite": ("elsewhere", "lm-eval over the suite, minutes; tests/test_eval.py"),
    "clover bench": ("elsewhere", "benchmarks, minutes; tests/test_*bench*.py"),
    "clover tune": ("elsewhere", "decodes 280 prompts per setting; tests/test_tune.py"),
    'clover generate --prompt "What is 47+385?" --block-size auto --runner compiled':
        ("elsewhere", "compiles for minutes on a CPU; tests/test_runner_compiled.py"),
    'clover generate --prompt "What is 47+385?" --runner compiled --linear-dtype bfloat16':
        ("elsewhere", "compiles for minutes on a CPU; tests/test_runner_compiled.py"),
    "clover export-gguf clover/assets/default model.gguf --outtype q8_0": RUN,
    'clover generate --prompt "What is 47+385?" --backend llamacpp': ("build", "no llama.cpp build"),
    "clover train --nproc-per-node 2": ("elsewhere", "tests/test_distributed_train.py and the launcher's test in "
                                        "tests/test_cli_errors.py; its data: `make model`"),
    "clover generate --nproc-per-node 2 --tp 2": ("elsewhere", "tests/test_distributed_infer.py"),
}


def readme_commands() -> list[str]:
    """The command lines of README.md's bash blocks, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def expectation(command: str):
    matches = [key for key in EXPECTED if command.startswith(key)]
    assert matches, f"README command not classified in tests/test_readme_commands.py: {command}"
    return EXPECTED[max(matches, key=len)]


def test_every_readme_command_is_classified():
    commands = readme_commands()
    assert len(commands) >= 20
    for command in commands:
        expectation(command)


@pytest.fixture
def clone(tmp_path, monkeypatch):
    """A scratch working folder that looks like a fresh clone (no runs/)."""
    for name in ("clover", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cheap(kind) -> list[str]:
    """The README commands of one kind (unclassified ones fail test_every_readme_command_is_classified)."""
    out = []
    for command in readme_commands():
        keys = [key for key in EXPECTED if command.startswith(key)]
        want = EXPECTED[max(keys, key=len)] if keys else None
        if want == kind or isinstance(want, tuple) and want[0] == kind:
            out.append(command)
    return out


@pytest.mark.parametrize("command", _cheap(RUN) + _cheap("error") + _cheap("build"))
def test_readme_command(command, clone, capsys):
    argv = shlex.split(command)
    assert argv[0] == "clover"
    want = expectation(command)
    if want[0] == "build":
        from clover.backends.llamacpp import find_build

        if find_build(variant="clover") is not None:
            pytest.skip("a llama.cpp build is here: tests/test_llamacpp_diffusion.py runs it")
        want = ("error", want[1])
    code = main(argv[1:])
    err = capsys.readouterr().err
    if want == RUN:
        assert code == 0, err
    else:
        lines = [line for line in err.strip().splitlines() if line]
        assert code == 2 and len(lines) == 1 and want[1] in lines[0], err
