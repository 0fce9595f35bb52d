"""Shared test fixtures' builders: a character-level tokenizer (JSON punctuation and the tool-call
tokens included) with Clover's chat template and a tiny random Clover model saved next to it, so tests need no downloads."""

from __future__ import annotations

import contextlib
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from clover.chat import CHAT_TEMPLATE

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def tiny_tokenizer(vocab_size=128):
    chars = list(string.ascii_letters + string.digits + " \n.,!?:;'-()+=" + '{}[]"_<>/|')
    tokens = SPECIAL + PLAIN_ADDED + chars
    tokens += [f"<unused{i}>" for i in range(vocab_size - 1 - len(tokens))] + ["<|mask|>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[:2] + ["<|mask|>"])
    fast.add_tokens(PLAIN_ADDED)
    fast.chat_template = CHAT_TEMPLATE  # Clover's own (tools, tool calls, enable_thinking)
    return fast


def save_tiny_model(folder, seed: int = 0, peak: float = 40.0) -> str:
    """A random clover-tiny model + the char tokenizer in `folder`; the head is scaled by `peak` so
    low_confidence fills several tokens per step."""
    from clover.models import CloverForBlockDiffusion, preset_config

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = preset_config("clover-tiny", eos_token_id=tokenizer.eos_token_id)
    model = CloverForBlockDiffusion(config)
    model.lm_head.weight.data *= peak
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_model(seed: int, peak: float = 40.0, **overrides):
    """A random clover-tiny model in eval mode, head scaled by `peak` (peaked distributions, so
    thresholds like 0.5 fill several tokens per step)."""
    from clover.models import CloverForBlockDiffusion, preset_config

    torch.manual_seed(seed)
    m = CloverForBlockDiffusion(preset_config("clover-tiny", **overrides)).eval()
    m.lm_head.weight.data *= peak
    return m


def with_block_additions(m, std: float = 0.3):
    """`m` with its block additions (right conv, block calibration) moved off their zero start, so a
    clean window's width changes what it computes (a layout mistake then changes the logits)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(x in name for x in ("right_conv", "block_calibration")):
                p.normal_(0, std)
    return m


@contextlib.contextmanager
def runner_calls(runner: str):
    """While inside: (logits, logits_index) of every forward of the eager or compiled runner class."""
    from clover.engine.runner import CompiledRunner, EagerRunner

    logits, cls = [], CompiledRunner if runner == "compiled" else EagerRunner
    real = cls.forward

    def record(self, ids, cache, **kw):
        out = real(self, ids, cache, **kw)
        logits.append((out.detach().clone(), kw.get("logits_index")))
        return out

    cls.forward = record
    try:
        yield logits
    finally:
        cls.forward = real


def assert_help_and_unknown_flag(capsys, argv: list, flag: str) -> None:
    """`clover ARGV --help` exits 0 and lists `flag`; an unknown flag exits 2 with a one-line error."""
    import pytest

    from clover.cli import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0 and flag in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1


@contextlib.contextmanager
def split_over_threads(threads: int = 2):
    """torch at `threads` threads and the C++ kernels splitting every call of two or more units of
    work over them (tiled.parallel_min_work(0)), the helper threads running every unit (so a result
    that differs on a helper thread shows), all restored after."""
    from clover.ops.linear import tiled

    was_threads, was_least = torch.get_num_threads(), tiled.parallel_min_work(0)
    was_helpers = tiled.parallel_helpers_only(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(was_threads)
        tiled.parallel_min_work(was_least)
        tiled.parallel_helpers_only(was_helpers)


def int4_stored(n, k, g, seed=0):
    """A random [n, k] weight in quant/int4.py's stored format (RTN, group g)."""
    from clover.quant.int4 import quantize_rtn

    gen = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, g)


def check_int4(y, x, w, activations=None):
    """|y - x' W^T| within K + 1 fp32 roundings of the summed |products| (fp64 reference), x' = x or,
    for the int8-activation kernel, `activations(x)` (the rounded activations it multiplies, fp64)."""
    xq = x.reshape(-1, x.shape[-1]).double() if activations is None else activations(x.reshape(-1, x.shape[-1]))
    ref = xq @ w.double().T
    bound = (xq.abs() @ w.abs().double().T) * (x.shape[-1] + 1) * 2.0**-24
    err = (y.reshape(ref.shape).double() - ref).abs()
    assert (err <= bound + 1e-30).all(), err.max().item()


def prefilled_batches(model, prompts: list[list[list[int]]], width: int, spare_windows: int = 2) -> list:
    """One eager row batch per job (`prompts`: each job's rows' token ids), its rows prefilled (every
    prompt token but the last pending), room for `spare_windows` more windows of `width`."""
    from clover.engine.batch import RowBatch
    from clover.engine.runner import make_runner
    from clover.engine.sequence import sequences

    runner, out = make_runner("eager", model), []
    for rows in prompts:
        b = RowBatch.for_runner(runner, width, width, model.config.mask_token_id, "cpu", 512)
        b.join(sequences(rows, [8] * len(rows), model.config.max_position_embeddings),
               capacity=max(map(len, rows)) + spare_windows * width)
        out.append(b)
    return out
