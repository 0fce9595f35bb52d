"""`clover decide`: answer up to 8 linked questions about one material in one denoising process
(joint mode) or one by one (independent). Questions: a JSONL file, one per line:
{"question": ..., "options": [...]} or {"question": ..., "type": "boolean"|"integer"|"text", "max_tokens": N}."""

from __future__ import annotations

import json
from pathlib import Path

from ..settings import INFILL_THRESHOLD, check_threshold
from . import UserError, print_json
from .options import add_model_args, utf8


def register(sub) -> None:
    p = sub.add_parser("decide", help="answer linked questions about a material (joint decision mode)")
    add_model_args(p)
    p.add_argument("--material", required=True, metavar="FILE", help="a text file: the material the questions are about")
    p.add_argument("--questions", required=True, metavar="FILE.jsonl", help="one question per line (JSON)")
    p.add_argument("--mode", default="joint", help="joint (default) or independent")
    p.add_argument("--threshold", type=float, metavar="T",
                   help=f"commit every slot whose confidence is > T per forward (default {INFILL_THRESHOLD}; a "
                   "public family: its published threshold)")
    p.add_argument("--block-size", type=int, metavar="B", help="max tokens per answer window (default 32; a public "
                   "family: its published block size)")
    p.add_argument("--split", action="store_true", help="more than 8 questions: answer them in groups of 8")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def read_questions(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: no such questions file")
    questions = []
    for n, line in enumerate(utf8(file.read_bytes(), str(file)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            questions.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{file}:{n}: not JSON ({e.msg})") from None
    return questions


def run(args) -> int:
    from ..api import load
    from ..decision import MODES, decide, parse_questions

    if args.mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, got {args.mode!r}")
    material_file = Path(args.material)
    if not material_file.is_file():
        raise UserError(f"{material_file}: no such material file")
    material = utf8(material_file.read_bytes(), str(material_file))
    if not material.strip():
        raise UserError(f"{material_file}: material is empty")
    questions = read_questions(args.questions)
    parse_questions(questions, args.split)  # every mistake reported before the model loads
    try:
        if args.threshold is not None:
            check_threshold(args.threshold)
    except ValueError as e:
        raise UserError(f"--{e}") from None
    if args.block_size is not None and args.block_size < 2:  # its top is the model's largest block, known once loaded
        raise UserError(f"--block-size must be >= 2 (an answer window holds a scaffold token and a slot), got "
                        f"{args.block_size}")
    model, tokenizer = load(args.model, args.device)
    result = decide(model, tokenizer, material, questions, mode=args.mode, threshold=args.threshold,
                    block_size=args.block_size, split=args.split)
    if args.json:
        print_json(result.to_dict())
        return 0
    for i, (q, a) in enumerate(zip(questions, result.answers), 1):
        answer = ("yes" if a.answer else "no") if isinstance(a.answer, bool) else a.answer
        print(f"A{i}: {answer}  ({a.confidence:.2f})  {q['question']}")
    print(f"[{args.mode}: {result.forward_passes} forward passes, {result.seconds:.2f} s]")
    return 0
