"""The `clover` command as a user meets it: every mistake one line on stderr with exit code 2 and
no traceback (real subprocesses); `--help` and argument errors without torch or transformers;
`import clover` light while the Auto classes still resolve; files written with the umask's mode;
--threads everywhere a model runs."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover.cli import main
from clover.utils.checkpoint import CheckpointError, load_progress, read_header
from helpers import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
ENV.pop("CLOVER_DEBUG", None)
HF_TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)


def clover_cli(*argv, stdin: bytes | None = None, env: dict | None = None) -> tuple[int, str]:
    """Run `python -m clover ARGV` as a user would: (exit code, stderr)."""
    p = subprocess.run([sys.executable, "-m", "clover", *map(str, argv)], input=stdin, capture_output=True,
                       env={**ENV, **(env or {})}, timeout=300)
    return p.returncode, p.stderr.decode("utf-8", errors="replace")


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


BREAKAGES = {
    "notjson": lambda d: (d / "config.json").write_text("{ not json"),
    "vocab": lambda d: _edit_config(d, vocab_size=200),
    "shape": lambda d: _edit_config(d, moe_intermediate_size=48),
    "llama": lambda d: _edit_config(d, model_type="llama"),
    "layers": lambda d: _edit_config(d, layer_types=["mamba"] * 4),
    "truncated": _truncate,
    "empty": lambda d: (d / "model.safetensors").write_bytes(b""),
    "random": lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
    "badtok": lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}, "added_tokens": []}'),
}


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """A good tiny Clover model, one broken copy per BREAKAGES entry, and a Qwen3-Next source for convert
    (good, truncated, empty, random bytes, config not JSON)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    root = tmp_path_factory.mktemp("fx")
    good = Path(save_tiny_model(root / "good"))
    torch.manual_seed(0)
    Qwen3NextForCausalLM(Qwen3NextConfig(**HF_TEXT)).save_pretrained(root / "hf-good")
    for name, breakage in BREAKAGES.items():
        for src, prefix in ((good, ""), (root / "hf-good", "hf-")):
            if prefix and name in ("vocab", "shape", "llama", "layers"):
                continue
            shutil.copytree(src, root / f"{prefix}{name}")
            breakage(root / f"{prefix}{name}")
    (root / "bad.txt").write_bytes(b"caf\xe9 \xff\n")
    return root


GEN = ["--max-new-tokens", "4", "--block-size", "4"]
CASES = {  # id: (argv with {fx} for the fixture folder, what the one line must name)
    "config-not-json": (["generate", "--model", "{fx}/notjson", "--prompt", "ab"], "notjson/config.json: not a JSON config"),
    "vocab-mismatch": (["generate", "--model", "{fx}/vocab", "--prompt", "ab"], "vocab/config.json does not match the weights"),
    "shape-mismatch": (["generate", "--model", "{fx}/shape", "--prompt", "ab"], "experts.down_proj is [8, 64, 32] in the files"),
    "config-invalid": (["generate", "--model", "{fx}/layers", "--prompt", "ab"], "layers/config.json: CloverConfig.layer_types"),
    "model-type-llama": (["generate", "--model", "{fx}/llama", "--prompt", "ab"], "clover convert"),
    "generate-truncated": (["generate", "--model", "{fx}/truncated", "--prompt", "ab"], "truncated/model.safetensors: truncated"),
    "generate-empty": (["generate", "--model", "{fx}/empty", "--prompt", "ab"], "empty/model.safetensors: empty file"),
    "generate-random": (["generate", "--model", "{fx}/random", "--prompt", "ab"], "random/model.safetensors: not a safetensors"),
    "quantize-truncated": (["quantize", "{fx}/truncated", "{fx}/q", "--group-size", "32"], "model.safetensors: truncated"),
    "quantize-empty": (["quantize", "{fx}/empty", "{fx}/q", "--group-size", "32"], "model.safetensors: empty file"),
    "quantize-random": (["quantize", "{fx}/random", "{fx}/q", "--group-size", "32"], "model.safetensors: not a safetensors"),
    "quantize-config-not-json": (["quantize", "{fx}/notjson", "{fx}/q"], "config.json: not a JSON config"),
    "quantize-llama": (["quantize", "{fx}/llama", "{fx}/q"], "is not a Clover model"),
    "convert-truncated": (["convert", "{fx}/hf-truncated", "{fx}/c"], "hf-truncated/model.safetensors: truncated"),
    "convert-empty": (["convert", "{fx}/hf-empty", "{fx}/c"], "hf-empty/model.safetensors: empty file"),
    "convert-random": (["convert", "{fx}/hf-random", "{fx}/c"], "hf-random/model.safetensors: not a safetensors"),
    "convert-config-not-json": (["convert", "{fx}/hf-notjson", "{fx}/c"], "hf-notjson/config.json: not a JSON config"),
    "export-gguf-truncated": (["export-gguf", "{fx}/truncated", "{fx}/t.gguf"], "truncated/model.safetensors: truncated"),
    "export-gguf-llama": (["export-gguf", "{fx}/llama", "{fx}/t.gguf"], "llama/config.json: model_type 'llama' is not a Clover"),
    "export-gguf-tokenizer": (["export-gguf", "{fx}/badtok", "{fx}/t.gguf"], "badtok/tokenizer.json: not a tokenizer"),
    "generate-tokenizer": (["generate", "--model", "{fx}/badtok", "--prompt", "ab"], "badtok/tokenizer.json: not a tokenizer"),
    "convert-tokenizer": (["convert", "{fx}/hf-badtok", "{fx}/c"], "hf-badtok/tokenizer.json: not a tokenizer"),
    "device-tpu": (["generate", "--model", "{fx}/good", "--prompt", "ab", "--device", "tpu"], "--device: unknown device 'tpu'"),
    "prompt-not-utf8": (["generate", "--model", "{fx}/good", "--prompt", os.fsdecode(b"caf\xe9")], "--prompt: not UTF-8"),
    "prompt-file-not-utf8": (["generate", "--model", "{fx}/good", "--prompt-file", "{fx}/bad.txt"], "bad.txt: not UTF-8"),
    "seed-too-big": (["generate", "--model", "{fx}/good", "--prompt", "ab", "--seed", str(2**64)],
                     "--seed: must be an integer in [-9223372036854775808, 9223372036854775807]"),
    "seed-too-small": (["generate", "--model", "{fx}/good", "--prompt", "ab", "--seed", str(-(2**63) - 1)], "64-bit signed"),
    "threads-zero": (["generate", "--model", "{fx}/good", "--prompt", "ab", "--threads", "0"], "--threads: must be an integer >= 1"),
    "decide-material-not-utf8": (["decide", "--model", "{fx}/good", "--material", "{fx}/bad.txt", "--questions", "q.jsonl"],
                                 "bad.txt: not UTF-8 text (byte 0xe9 at offset 3)"),
    "decide-mode": (["decide", "--model", "{fx}/good", "--material", "{fx}/bad.txt", "--questions", "q.jsonl", "--mode", "x"],
                    "--mode must be one of joint, independent"),
}
if not torch.cuda.is_available():
    CASES["device-cuda-without-cuda"] = (["generate", "--model", "{fx}/good", "--prompt", "ab", "--device", "cuda"],
                                         "cuda: CUDA is not available")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_check_at_load_without_cuda(fx):
    """The check behind the fast one (a CUDA build of torch on a machine without a GPU gets it at load)."""
    from clover.api import resolve_device

    with pytest.raises(ValueError, match="--device cuda:1: CUDA is not available on this machine"):
        resolve_device("cuda:1")
    assert resolve_device("cpu") == "cpu" and resolve_device(None) == "cpu"


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_one_line_exit_2(fx, case):
    argv, needle = CASES[case]
    argv = [a.replace("{fx}", str(fx)) for a in argv]
    if argv[0] == "generate":
        argv += GEN
    code, err = clover_cli(*argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"clover {argv[0]}: error: ") and needle in lines[0], lines[0]
    assert not (fx / "q").exists() and not (fx / "c").exists()  # nothing half-written


def test_non_utf8_standard_input_is_one_line(fx):
    code, err = clover_cli("generate", "--model", fx / "good", "--prompt-file", "-", *GEN, stdin=b"\xff\xfe")
    assert code == 2 and err.strip() == "clover generate: error: standard input: not UTF-8 text (byte 0xff at offset 0)"


def test_checkpoint_checks_read_only_headers(fx):
    """The same checks as a library: CheckpointError (a ValueError), and a good file passes."""
    assert read_header(fx / "good" / "model.safetensors")["lm_head.weight"] == ("F32", (128, 64))
    for name in ("truncated", "empty", "random"):
        with pytest.raises(CheckpointError, match=f"{name}/model.safetensors"):
            read_header(fx / name / "model.safetensors")
    import clover

    with pytest.raises(ValueError, match="is not a Clover model"):
        clover.load(fx / "llama", device="cpu")


# ---- fast help, light import ------------------------------------------------------------------------
LIGHT = """
import sys
from clover.cli import main
for argv in {argvs!r}:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code in (0, 2), (argv, code)
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(heavy)
"""


def test_help_and_argument_errors_import_no_torch(fx):
    from clover.cli import build_parser

    subcommands = sorted(build_parser()._subparsers._group_actions[0].choices)  # every registered one
    assert {"generate", "serve", "train", "info"} <= set(subcommands)
    argvs = [["--help"], *([name, "--help"] for name in subcommands),
             ["train", "--lr", "x"], ["train", "--objective", "xx", "--train-files", "a", "--tokenizer", "t"],
             ["train", "--config", str(fx / "missing.toml")], ["info", "--preset", "clover-35b-a3b"], ["info", "--json"],
             ["info", "--plan", "train", "--gpus", "8", "--json"], ["info", "--preset", "nope"], ["serve", "--device", "tpu"], ["serve", "--threads", "0"],
             ["generate", "--seed", "x"], ["generate", "--device", "tpu"], ["generate", "--device", "cuda"],
             ["generate", "--model", str(fx / "truncated"), "--prompt", "a"],
             ["generate", "--model", str(fx / "good"), "--prompt-file", str(fx / "bad.txt")],
             ["convert", str(fx / "hf-random"), str(fx / "c")], ["quantize", str(fx / "llama"), str(fx / "q")]]
    p = subprocess.run([sys.executable, "-c", LIGHT.format(argvs=argvs)], capture_output=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip().splitlines()[-1] == "[]"


AUTO = """
import sys
import clover
assert "torch" not in sys.modules and "transformers" not in sys.modules
import clover.decision
assert callable(clover.decide) and clover.decide.__name__ == "decide"  # the function, as documented
assert "low_confidence" in clover.engine.MODES and clover.api.DEFAULT_MODEL  # submodules as attributes, as before
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
print(type(AutoConfig.from_pretrained({d!r})).__name__, type(AutoModelForCausalLM.from_pretrained({d!r})).__name__,
      type(AutoModel.from_pretrained({d!r})).__name__, clover.CloverConfig.__name__)
"""


@pytest.mark.parametrize("transformers_first", [False, True])
def test_import_clover_is_light_and_registers_auto_classes(fx, transformers_first):
    code = AUTO.format(d=str(fx / "good"))
    if transformers_first:
        code = code.replace('assert "torch" not in sys.modules and "transformers" not in sys.modules', "")
        code = "import transformers\n" + code
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().split() == ["CloverConfig", "CloverForBlockDiffusion", "CloverModel", "CloverConfig"]


def test_mode_help_names_every_engine_mode():
    from clover.cli.options import MODE_HELP
    from clover.engine import MODES

    assert sorted(m.strip() for m in MODE_HELP.replace(" (default)", "").replace(" or ", ", ").split(",")) == sorted(MODES)


def test_runner_choices_are_the_engine_runners():
    from clover.cli.options import RUNNER_CHOICES
    from clover.engine.runner import RUNNERS

    assert tuple(RUNNER_CHOICES) == tuple(RUNNERS)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "x", "--runner", "compiled", "--backend", "llamacpp"], "needs --backend torch"),
    (["serve", "--runner", "compiled", "--backend", "llamacpp"], "needs --backend torch"),
    (["serve", "--runner", "compiled", "--tp", "2"], "not with --tp / --ep"),
    (["generate", "--prompt", "x", "--runner", "compiled", "--ep", "2"], "not with --tp / --ep"),
])
def test_compiled_runner_with_another_back_end_is_one_line(capsys, argv, needle):
    """The compiled runner compiles the PyTorch model's steps in one process: with the llama.cpp back end
    it was a traceback, and under --tp / --ep it would bypass the ranks' shards."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err


# ---- threads, wait policy, progress bar --------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "decide", "quantize", "convert", "info", "eval", "tune", "serve"])
def test_every_model_command_takes_threads(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--threads N" in capsys.readouterr().out


def test_threads_flag_and_passive_waits(fx, capsys, monkeypatch):
    from clover.cli.options import setup_process

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        code = main(["generate", "--model", str(fx / "good"), "--prompt", "ab", *GEN, "--threads", "2", "--json"])
        assert code == 0 and torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        assert "Loading weights" not in capsys.readouterr().err  # stderr is no terminal here
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice wins
    setup_process(type("A", (), {"threads": None})())
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("command", ["generate", "chat", "decide", "tune", "serve", "bench decode"])
def test_model_commands_take_the_linear_dtype(command, capsys):
    from clover.cli.options import LINEAR_DTYPES
    from clover.ops.linear import tiled

    assert LINEAR_DTYPES == tiled.LINEAR_DTYPES
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    assert "--linear-dtype {float32,bfloat16}" in capsys.readouterr().out


def test_linear_dtype_flag_turns_bf16_activations_on_and_keys_tuned_settings(fx, capsys, monkeypatch):
    """--linear-dtype bfloat16 asks the tiled kernels for bf16 activations (ops/linear/tiled.py), for
    this process and the ones it starts (CLOVER_LINEAR_DTYPE); a tuned setting is then keyed apart.
    A bad value is argparse's one line, exit 2."""
    from clover.engine.tuning import machine_key
    from clover.ops.linear import tiled

    monkeypatch.delenv("CLOVER_LINEAR_DTYPE", raising=False)  # restored after the test
    plain = machine_key("cpu")
    try:
        code = main(["generate", "--model", str(fx / "good"), "--prompt", "ab", *GEN, "--linear-dtype", "bfloat16",
                     "--json"])
        assert code == 0 and tiled.bf16_activations() and os.environ["CLOVER_LINEAR_DTYPE"] == "bfloat16"
        assert machine_key("cpu") == plain + "|linear=bfloat16"
    finally:
        tiled.use_bf16_activations(False)
    assert machine_key("cpu") == plain
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "ab", "--linear-dtype", "int8"])
    assert e.value.code == 2 and "--linear-dtype: invalid choice" in capsys.readouterr().err


class _Terminal:
    def isatty(self):
        return True


def test_loading_bar_only_on_a_terminal_for_long_loads(fx):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    with load_progress(fx / "good", stream=_Terminal()) as shown:  # 1.2 MB: too small to show
        assert not shown and not hf_logging.is_progress_bar_enabled()
    with load_progress(fx / "good", stream=_Terminal(), min_bytes=1000) as shown:
        assert shown and hf_logging.is_progress_bar_enabled()
    with load_progress(fx / "good", stream=sys.stderr, min_bytes=0) as shown:  # captured: no terminal
        assert not shown
    assert hf_logging.is_progress_bar_enabled() == was


# ---- file modes ----------------------------------------------------------------------------------------
def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_convert_and_quantize_write_the_umask_mode(fx, tmp_path, capsys, umask_022):
    assert main(["convert", str(fx / "hf-good"), str(tmp_path / "c"), "--json"]) == 0
    assert main(["quantize", str(fx / "good"), str(tmp_path / "q"), "--group-size", "32", "--json"]) == 0
    for out in ("c", "q"):
        modes = _modes(tmp_path / out)
        assert any(name.endswith(".safetensors") for name in modes)
        assert set(modes.values()) == {0o644}, (out, {k: oct(v) for k, v in modes.items()})
    os.umask(0o027)  # follows the umask, not a fixed 0644
    assert main(["convert", str(fx / "hf-good"), str(tmp_path / "c"), "--force", "--json"]) == 0
    assert set(_modes(tmp_path / "c").values()) == {0o640}


def test_train_and_save_pretrained_write_the_umask_mode(tmp_path, umask_022):
    from clover.data.tokenizer import train_tokenizer
    from clover.training import Trainer, TrainConfig

    texts = [f"abc {i} def {i * 7}" for i in range(40)]
    train_tokenizer(texts, 300, tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    cfg = TrainConfig(objective="ar", tokenizer=str(tmp_path / "tok"), preset="clover-tiny",
                      train_files=[str(tmp_path / "train.jsonl")], out_dir=str(tmp_path / "run"), seq_len=16,
                      batch_size=2, max_steps=2, warmup_steps=1, log_every=1, eval_every=0, ckpt_every=2, progress=False)
    Trainer(cfg).fit()
    modes = _modes(tmp_path / "run")
    assert "final/model.safetensors" in modes and any(k.startswith("checkpoints/") for k in modes)
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--threads", "0"], ["--threads", "x"]])
def test_serve_device_and_threads_flags_are_generates(capsys, argv):
    """serve takes the shared --device / --threads (clover/cli/options.py): the same check, the same line."""
    errs = []
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit) as e:
            main([command, *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
        errs.append(err.removeprefix(f"clover {command}: "))
    assert errs[0] == errs[1]


# ---- issue 53 (training and CLI): each a real subprocess, rc 2, one stderr line, no traceback -----------
def one_line(code: int, err: str, command: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"clover {command}: error: ") and needle in lines[0], lines[0]


def test_llamacpp_build_is_checked_first_and_a_wrong_path_is_named(fx, tmp_path):
    """No build: said before the model is read. A CLOVER_LLAMACPP that does not exist, or is not a
    build, gets its own message (not the no-build one)."""
    from clover.backends.llamacpp import find_build

    gen = ["generate", "--model", fx / "good", "--prompt", "ab", "--backend", "llamacpp", *GEN]
    code, err = clover_cli(*gen, env={"CLOVER_LLAMACPP": str(tmp_path / "nowhere")})
    one_line(code, err, "generate", f"CLOVER_LLAMACPP {tmp_path / 'nowhere'}: no such folder")
    code, err = clover_cli(*gen, env={"CLOVER_LLAMACPP": str(tmp_path)})
    one_line(code, err, "generate", f"CLOVER_LLAMACPP {tmp_path}: not a llama.cpp build with the clover variant")
    code, err = clover_cli("export-gguf", fx / "good", tmp_path / "q.gguf", "--outtype", "q4_k", "--llamacpp", tmp_path / "x")
    one_line(code, err, "export-gguf", f"--llamacpp {tmp_path / 'x'}: no such folder")
    if find_build() is None and find_build(variant="clover") is None:
        code, err = clover_cli(*gen)  # the model folder is whole: this error comes from the build check
        one_line(code, err, "generate", "no llama.cpp build with the clover variant: run `make llamacpp`")
        code, err = clover_cli("export-gguf", fx / "truncated", tmp_path / "q.gguf", "--outtype", "q4_k")
        one_line(code, err, "export-gguf", "truncated/model.safetensors: truncated")  # the folder first, then the build
        code, err = clover_cli("export-gguf", fx / "good", tmp_path / "q.gguf", "--outtype", "q4_k")
        one_line(code, err, "export-gguf", "no llama.cpp build: run `make llamacpp`")
    assert not list(tmp_path.glob("*.gguf"))


def test_broken_tune_cache_is_named(fx, tmp_path):
    cache = tmp_path / "clover" / "tune.json"
    cache.parent.mkdir()
    for text in ('{"a": ', '{"a": [1]}'):
        cache.write_text(text)
        code, err = clover_cli("generate", "--model", fx / "good", "--prompt", "ab", "--max-new-tokens", "4",
                               "--block-size", "auto", env={"XDG_CACHE_HOME": str(tmp_path)})
        one_line(code, err, "generate", f"{cache}: not a tune cache")


def test_show_writes_no_control_codes_into_a_file(fx, capsys):
    assert main(["generate", "--model", str(fx / "good"), "--prompt", "ab", "--show", *GEN]) == 0  # stdout: not a tty
    out, err = capsys.readouterr()
    assert "\x1b" not in out and out.strip() and "--show needs a terminal" in err


def test_ctrl_c_after_the_command_finished_keeps_its_exit_status(tmp_path):
    """The work is done and written: a Ctrl-C while the interpreter tears down is not a signal exit."""
    script = ("import os, signal, sys\n"
              "sys.argv = ['clover', 'info', '--preset', 'clover-tiny', '--json']\n"
              "from clover.cli import main\n"
              "rc = main()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "sys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, env=ENV, timeout=300)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    assert json.loads(p.stdout)


def test_git_hash_for_lm_eval_is_quiet_outside_a_repository(tmp_path, monkeypatch, capfd):
    from clover.cli.eval import quiet_git_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert quiet_git_hash() is None
    assert capfd.readouterr().err == ""


def _train_toml(tmp_path) -> Path:
    from clover.data.tokenizer import train_tokenizer

    texts = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(10)]
    (tmp_path / "train.txt").write_text("\n\n\n".join(texts))
    train_tokenizer(texts, 300, tmp_path / "tok")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'objective = "ar"\ntokenizer = "{tmp_path / "tok"}"\npreset = "clover-tiny"\n'
                   f'model_overrides = {{ vocab_size = 300 }}\ntrain_files = ["{tmp_path / "train.txt"}"]\n'
                   f'out_dir = "{tmp_path / "run"}"\nseq_len = 16\nbatch_size = 2\nwarmup_steps = 1\nthreads = 1\n'
                   f"max_steps = 4\nckpt_every = 2\nprogress = false\neval_every = 0\n")
    return cfg


def test_resume_flags_are_not_ignored(tmp_path):
    """`--resume --max-steps N` stops at N (not the checkpoint's plan), or says why it cannot."""
    cfg = _train_toml(tmp_path)
    run = [sys.executable, "-m", "clover", "train", "--config", str(cfg)]
    p = subprocess.run(run + ["--max-steps", "2"], capture_output=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(run + ["--resume", "--max-steps", "3"], capture_output=True, env=ENV, timeout=300)
    assert p.returncode == 0 and json.loads(p.stdout)["step"] == 3, p.stderr
    code, err = clover_cli("train", "--config", cfg, "--resume", "--max-steps", "1")
    one_line(code, err, "train", "--resume: max_steps 1 is before checkpoint step_000003's step 3")
    code, err = clover_cli("train", "--config", cfg, "--resume", "--seed", "5")
    one_line(code, err, "train", "--resume: seed cannot change on resume")
    code, err = clover_cli("train", "--config", cfg)
    one_line(code, err, "train", "holds checkpoints of an earlier run (step_000003): pass --resume")


def test_user_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Each rank checks the same arguments: rank 0 alone says it, before torch loads (so before any
    model or process group), and every rank exits 2. What torchrun itself prints about a failed
    worker, and its own exit status, are torchrun's."""
    cfg = _train_toml(tmp_path)
    for argv, line in ((["generate", "--tp", "2", "--runner", "compiled", "--prompt", "ab"],
                        "clover generate: error: --runner compiled runs in one process: not with --tp / --ep"),
                       (["train", "--config", str(cfg), "--resume"],
                        f"clover train: error: --resume: no checkpoint in {tmp_path / 'run' / 'checkpoints'}")):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m", "clover", *argv], capture_output=True, text=True, env=ENV, timeout=300)
        ours = [x for x in p.stderr.splitlines() if x.startswith(f"clover {argv[0]}")]
        assert ours == [line], p.stderr
        assert "exitcode  : 2" in p.stderr, p.stderr  # torchrun's report: the worker's status
        assert "clover/" not in "".join(x for x in p.stderr.splitlines() if x.strip().startswith("File "))


def test_user_error_under_the_clover_launcher_is_one_line_and_exit_2(tmp_path):
    """`--nproc-per-node 2` starts the ranks as torchrun does; a mistake every rank finds is then the one
    line of rank 0 and exit code 2, with no launcher report or traceback after it."""
    cfg = _train_toml(tmp_path)
    for argv, line in ((["generate", "--nproc-per-node", "2", "--tp", "2", "--runner", "compiled", "--prompt", "ab"],
                        "clover generate: error: --runner compiled runs in one process: not with --tp / --ep"),
                       (["train", "--nproc-per-node=2", "--config", str(cfg), "--resume"],
                        f"clover train: error: --resume: no checkpoint in {tmp_path / 'run' / 'checkpoints'}")):
        code, err = clover_cli(*argv)
        assert code == 2 and err.strip().splitlines() == [line], err
    assert clover_cli("train", "--nproc-per-node", "0", "--config", cfg) == (
        2, "clover train: error: --nproc-per-node must be >= 1, got 0\n")
    p = subprocess.run([sys.executable, "-m", "clover", "train", "--nproc-per-node", "2", "--config", str(cfg),
                        "--max-steps", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr  # a run that works: both ranks trained, nothing else said
    assert '"world_size": 2' in p.stdout and (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


def test_the_launcher_drops_only_its_own_flag():
    from clover.distributed.launch import without_flag

    assert without_flag(["train", "--nproc-per-node", "2", "--config", "c.toml"]) == ["train", "--config", "c.toml"]
    assert without_flag(["train", "--nproc-per-node=4", "--lr", "2"]) == ["train", "--lr", "2"]


def test_compile_time_is_announced_on_a_terminal_and_kept_out_of_the_speed():
    import io

    from clover.cli.generate import COMPILING, speed_text, without_compile_time
    from clover.utils.compile_watch import CompileWatch

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    torch._dynamo.reset()
    for stream, told in ((Terminal(), True), (io.StringIO(), False)):
        f = torch.compile(lambda x: x * 2 + 1, backend="eager")
        with CompileWatch(COMPILING, stream) as watch:  # three steps
            f(torch.ones(3))
            watch.mark()
            f(torch.ones(3))  # compiled already: no second notice, and not a compile step
            watch.mark()
            f(torch.ones(5, 2))  # a new shape compiles again
        assert stream.getvalue() == (COMPILING + "\n" if told else "")
        assert len(watch.intervals) == 2 and watch.total() > 0
        (a, b), (c, d) = watch.intervals
        assert a < b < c < d
        torch._dynamo.reset()
    from clover.api import Generation

    watch = CompileWatch()
    watch.intervals = [(10.0, 14.0), (19.0, 30.0)]  # steps that compiled: 4 s, and 1 s of the row's last 10 s
    watch.plain_steps = 3
    r = Generation("x", [1] * 12, "length", 12, 1.0, 10.0, 1.2)
    fixed, compile_s = without_compile_time(r, watch, start=10.0)
    assert compile_s == pytest.approx(5.0) and fixed.tokens_per_second == pytest.approx(12 / 5.0)
    assert without_compile_time(r, CompileWatch(), start=10.0) == (r, 0.0)
    watch.plain_steps = 0  # every step compiled: no decode speed to report
    fixed, compile_s = without_compile_time(r, watch, start=10.0)
    assert fixed.tokens_per_second is None and "not measured" in speed_text(None, compile_s)
    assert speed_text(2.4, 5.0) == "2.4 tokens/s (5.0 s compiling not counted)" and speed_text(3.0, 0.0) == "3.0 tokens/s"
