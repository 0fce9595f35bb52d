"""`clover generate`: prompts through the decoding engine; plain text, `--json`, or a live view of
the denoising (`--show`), and optionally a picture of the fill order (`--trajectory-out`).
`--json-schema FILE`: a JSON value following the schema, by infilling (docs/structured.md); a public family
decodes it under the schema's grammar in its own block layout (docs/families.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..distributed.flags import add_launch_flag, add_parallel_flags
from . import UserError, print_json
from .options import add_generation_args, add_model_args, check_runner, decode_config, utf8

STEP_COLOURS = (34, 36, 32, 33, 35, 31, 94, 96, 92, 93, 95, 91)  # ANSI: one per denoising step, cycling


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (block diffusion by default)")
    add_model_args(p)
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", metavar="F",
                   help="a file whose whole text is the prompt, trailing newline kept (the task prompts are "
                        "trained as 'prompt\\n' + answer); - reads standard input")
    add_generation_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list for several prompts)")
    p.add_argument("--show", action="store_true", help="animate the denoising in the terminal")
    p.add_argument("--trajectory-out", metavar="FILE", help="picture of the fill order (.html or .png)")
    p.add_argument("--json-schema", metavar="FILE",
                   help="write JSON that follows this schema (keys laid out, values infilled; see docs/structured.md)")
    add_parallel_flags(p)
    add_launch_flag(p)
    p.add_argument("--backend", choices=["torch", "llamacpp"], default="torch",
                   help="llamacpp: run the model in the patched llama.cpp build (make llamacpp; docs/llamacpp.md)")
    p.add_argument("--gguf", metavar="FILE", help="--backend llamacpp: the model's exported GGUF (default: export "
                   "the model folder to a temporary f32 file)")
    p.set_defaults(func=run)


def read_prompts(args) -> list[str]:
    if bool(args.prompt) == bool(args.prompt_file):
        raise UserError("give either --prompt TEXT or --prompt-file F")
    if args.prompt_file == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        return [utf8(stdin.read(), "standard input") if stdin else sys.stdin.read()]
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"{path}: no such prompt file")
        return [utf8(path.read_bytes(), str(path))]
    for p in args.prompt:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise UserError(f"--prompt: not UTF-8 text (byte 0x{ord(p[e.start]) & 0xFF:02x} at character {e.start})") from None
    return args.prompt


class LiveView:
    """`--show`: redraws the first running row after every step: finished text, then the current
    block with masks (░) and each filled token coloured by the step that filled it."""

    def __init__(self, tokenizer, delay: float = 0.03):
        self.tokenizer, self.delay = tokenizer, delay

    def __call__(self, engine, events) -> None:
        if not engine.seqs:
            return
        seq = engine.seqs[0]
        done = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        block = "".join("\u2591" if t is None else f"\x1b[{STEP_COLOURS[s % len(STEP_COLOURS)]}m"
                        f"{self.tokenizer.decode([t])}\x1b[0m" for t, s in engine.block_view(0))
        sys.stdout.write(f"\x1b[2J\x1b[H{done}{block}\n\x1b[2m[block {seq.blocks}, {seq.forward_passes} forwards]\x1b[0m\n")
        sys.stdout.flush()
        time.sleep(self.delay)


def read_schema(path: str) -> dict:
    """The schema in a file, checked before any model loads (a bad one is a one-line error)."""
    from ..structured import check, is_json_object

    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: no such schema file")
    try:
        schema = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not JSON ({getattr(e, 'msg', e)})") from None
    if not is_json_object(schema):
        try:
            check(schema)
        except ValueError as e:
            raise UserError(f"{file}: {e}") from None
    return schema


def run_schema(args) -> int:
    from ..api import model_folder
    from ..engine.sampling import Draw
    from ..structured import generate_json

    schema = read_schema(args.json_schema)
    prompts = read_prompts(args)
    model_folder(args.model)
    cfg = decode_config(args)
    for flag, given in (("--show", args.show), ("--trajectory-out", args.trajectory_out), ("--think", args.think),
                        ("--mode", cfg.mode != "low_confidence")):
        if given:
            raise UserError(f"{flag} does not apply to --json-schema")
    model, tokenizer = load_model(args, len(prompts))  # the torch back end (--backend checked by run)
    draw = Draw.of(cfg.sampling)  # --temperature > 0: sampled under the schema's grammar, one generator for all
    results = [generate_json(model, tokenizer, p, schema, chat=args.chat, threshold=cfg.threshold,
                             block_size=cfg.block_size, max_new_tokens=cfg.max_new_tokens, draw=draw) for p in prompts]
    if args.json:
        dicts = [r.to_dict() for r in results]
        print_json(dicts[0] if len(dicts) == 1 else dicts)
        return 0
    for r in results:
        print(r.text)
        why = f", fallback: {r.fallback_reason}" if r.fallback_reason else ""
        print(f"[{r.method}{why}; {r.forward_passes} forwards, {r.seconds:.2f} s, "
              f"{'valid' if r.valid else 'not valid: ' + str(r.error)}]", file=sys.stderr)
    return 0


def check_backend(args) -> None:
    """--backend llamacpp: its build is there (torch-free; before any model is read or exported)."""
    if getattr(args, "backend", "torch") != "llamacpp":
        return
    from ..backends.llamacpp import LlamaCppError, require_build

    try:
        require_build(variant="clover")
    except LlamaCppError as e:
        raise UserError(str(e)) from None


def load_model(args, rows: int):
    """(model, tokenizer): PyTorch (sharded under torchrun with --tp / --ep), or the llama.cpp
    model behind the same interface."""
    if getattr(args, "backend", "torch") != "llamacpp":
        from ..distributed.parallel import load as load_sharded  # imports torch: after the light checks
        from ..utils.startup import prepare

        model, tokenizer = load_sharded(args)  # clover.load in one process
        prepare(model)  # the C++ CPU kernels (with a word) and int4 packing now: not in the first decode or request
        return model, tokenizer
    from ..backends.llamacpp import LlamaCppError
    from ..backends.llamacpp.model import load_llamacpp

    try:
        return load_llamacpp(args.model, args.gguf, max_rows=rows, threads=getattr(args, "threads", None) or 1)
    except LlamaCppError as e:
        raise UserError(str(e)) from None


def run(args) -> int:
    from tqdm import tqdm

    check_runner(args, args.runner)  # before torch loads (under torchrun: before the process group starts)
    if args.json_schema:
        if args.backend != "torch":
            raise UserError("--json-schema runs on the PyTorch back end only")
        return run_schema(args)
    if args.gguf and args.backend != "llamacpp":
        raise UserError("--gguf needs --backend llamacpp")

    from ..api import generate, model_folder

    prompts = read_prompts(args)
    model_folder(args.model)  # a bad model folder: one line, before torch is imported
    check_backend(args)

    from ..engine.trajectory import FORMATS, write_trajectory

    cfg = decode_config(args)
    if args.trajectory_out and Path(args.trajectory_out).suffix.lower() not in FORMATS:
        raise UserError(f"--trajectory-out: {args.trajectory_out} must end in {' or '.join(FORMATS)}")
    if args.show and not sys.stdout.isatty():  # the live view is terminal control codes: none into a file or pipe
        print("clover generate: --show needs a terminal (standard output is redirected): printing the result only",
              file=sys.stderr)
        args.show = False
    model, tokenizer = load_model(args, len(prompts))
    from ..utils.compile_watch import CompileWatch

    notice = COMPILING if cfg.runner == "compiled" else None  # said on a terminal: a first compile takes minutes
    with tqdm(total=len(prompts) * cfg.max_new_tokens, unit="tok", desc="generate", leave=False,
              disable=True if args.show else None, file=sys.stderr) as bar, CompileWatch(notice) as watch:
        show = LiveView(tokenizer) if args.show else (lambda engine, events: bar.update(sum(len(t) for _, t in events)))

        def progress(engine, events):
            watch.mark()  # a step ended: its time is compile time if it compiled
            show(engine, events)

        start = watch.mark()  # the rows start here
        results = generate(model, tokenizer, prompts, cfg, chat=args.chat or args.think, think=args.think,
                           trajectory=bool(args.trajectory_out), on_step=progress)
    results = [without_compile_time(r, watch, start) for r in results]
    if args.trajectory_out:
        first = results[0][0]
        pieces = [tokenizer.decode([t]) for t in first.token_ids]
        write_trajectory(args.trajectory_out, pieces, first.trajectory, f"clover generate --mode {cfg.mode}")
    if args.json:
        dicts = [{**r.to_dict(token_ids=False, trajectory=False), "tokens_per_second": r.tokens_per_second,
                  "compile_seconds": c} for r, c in results]
        print_json(dicts[0] if len(dicts) == 1 else dicts)
        return 0
    for r, compile_s in results:
        if r.reasoning is not None:
            print(f"\x1b[2m{r.reasoning}\x1b[0m\n" if sys.stdout.isatty() else f"[thinking]\n{r.reasoning}\n[answer]")
        print(r.text)
        print(f"[{len(r.token_ids)} tokens, {r.forward_passes} forwards, {r.tokens_per_forward:.2f} tokens/forward, "
              f"{speed_text(r.tokens_per_second, compile_s)}, finish: {r.finish_reason}]", file=sys.stderr)
    return 0


COMPILING = "clover generate: compiling (first use of this shape)..."


def speed_text(tokens_per_second: float | None, compile_s: float) -> str:
    if tokens_per_second is None:
        return f"tokens/s not measured: every step compiled ({compile_s:.1f} s; a second run of these shapes shows it)"
    return f"{tokens_per_second:.1f} tokens/s" + (f" ({compile_s:.1f} s compiling not counted)" if compile_s else "")


def without_compile_time(result, watch, start: float):
    """(result, compile seconds): tokens_per_second over the row's time less the steps that compiled
    (`watch`; rows start together, at `start`), None where every step compiled (no decode to time)."""
    import dataclasses

    compile_s = watch.seconds_within(start, start + result.seconds)
    if not compile_s:
        return result, 0.0
    decode_s = result.seconds - compile_s
    speed = len(result.token_ids) / decode_s if watch.plain_steps and decode_s > 0 else None
    return dataclasses.replace(result, tokens_per_second=speed), round(compile_s, 3)
