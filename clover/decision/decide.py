"""Joint decision mode: answer slots laid out after [material, Q1..Qk] and denoised together.

Layout (one row = one group of <= 8 questions, rendered exactly as the default model's training
data, `clover.data.tasks.group_prompt` / `group_as_example`):

    prompt  = "<material> Q1: ... Qk: ...\\n"                      (prefilled, committed)
    region  = "A1:" [slot 1] " A2:" [slot 2] ... " Ak:" [slot k]     (draft window(s))

Scaffold tokens ("A1:", " A2:", ...) are known tokens inside the draft window; a slot is `width`
masked positions, width = the longest allowed answer in tokens. The slots, their scoring and the
denoising loop are `clover.engine.infill`'s:
* options (and boolean = ["yes", "no"], integer = every number of <= max_tokens digits) are scored
  per option, with the end marker = the first token of the next scaffold (EOS after the last slot);
  the slot's confidence is the softmax over its options, so it can never hold anything else;
* text: the argmax token at each position, cut at the first end marker / EOS.
Every slot above the threshold commits per forward, or the most confident one: a group of k slots
takes at most k forwards per window. A committed slot is re-laid out at its answer's own length, so
the next forward sees exactly the training rendering of the answers decided so far. Regions longer
than `block_size` are cut between slots into several windows, denoised one after another.

`independent` mode is the same machinery with one question per row. Rows whose windows have the
same sizes share forwards (left-padded prompts); as slots commit at different steps, windows of one
batch may differ in length and the shorter ones are right-padded with masks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ..settings import absolute_blocks, check_block_size, check_threshold, infill_settings
from ..engine.family_infill import infill_blocks_task
from ..engine.infill import Row, Slot, TextRule, denoise_task, pieces, token_ids
from ..engine.slots import drive

MAX_QUESTIONS = 8
MODES = ("joint", "independent")
TYPES = ("options", "boolean", "integer", "text")
MAX_INTEGER_DIGITS = 4  # integer slots enumerate every number of up to this many digits
DEFAULT_MAX_TOKENS = {"integer": 3, "text": 16}


# ---- questions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    text: str
    type: str = "options"  # options | boolean | integer | text
    options: tuple[str, ...] = ()
    max_tokens: int | None = None  # integer: max digits; text: max tokens


def parse_question(q, index: int = 0) -> Question:
    """A Question from a Question or a dict {"question", "options"} / {"question", "type", "max_tokens"}."""
    where = f"question {index + 1}"
    if isinstance(q, Question):
        q = {"question": q.text, "type": q.type, "options": list(q.options) if q.type == "options" else None,
             "max_tokens": q.max_tokens}
    if not isinstance(q, dict):
        raise ValueError(f"{where}: expected an object with 'question' and 'options' or 'type', got {type(q).__name__}")
    unknown = sorted(set(q) - {"question", "options", "type", "max_tokens"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    text = q.get("question")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    options, kind, max_tokens = q.get("options"), q.get("type"), q.get("max_tokens")
    if options is not None:
        if kind not in (None, "options"):
            raise ValueError(f"{where}: give either 'options' or type {kind!r}, not both")
        if not isinstance(options, (list, tuple)) or not options:
            raise ValueError(f"{where}: 'options' must be a non-empty list of strings")
        for j, o in enumerate(options):
            if not isinstance(o, str):
                raise ValueError(f"{where}: option {j + 1} is not a string ({o!r})")
            if not o.strip():
                raise ValueError(f"{where}: option {j + 1} is an empty string")
        if len(set(options)) != len(options):
            raise ValueError(f"{where}: options must be distinct")
        if max_tokens is not None:
            raise ValueError(f"{where}: 'max_tokens' is for integer and text answers, not options")
        return Question(text, "options", tuple(options))
    if kind is None:
        raise ValueError(f"{where}: give 'options' (a list) or a 'type' (boolean, integer or text)")
    if kind not in TYPES[1:]:
        raise ValueError(f"{where}: unknown answer type {kind!r} (known: boolean, integer, text, or an 'options' list)")
    if kind == "boolean":
        if max_tokens is not None:
            raise ValueError(f"{where}: 'max_tokens' is for integer and text answers, not boolean")
        return Question(text, "boolean", ("yes", "no"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[kind]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    if kind == "integer" and max_tokens > MAX_INTEGER_DIGITS:
        raise ValueError(f"{where}: integer answers have at most {MAX_INTEGER_DIGITS} digits (max_tokens), got {max_tokens}")
    return Question(text, kind, (), max_tokens)


def parse_questions(questions, split: bool = False) -> list[Question]:
    if isinstance(questions, (str, dict)) or not isinstance(questions, (list, tuple)):
        raise ValueError("questions must be a list")
    if not questions:
        raise ValueError("no questions")
    if len(questions) > MAX_QUESTIONS and not split:
        raise ValueError(f"{len(questions)} questions: at most {MAX_QUESTIONS} per group "
                         f"(ask to split them into groups of {MAX_QUESTIONS}: split=True / --split)")
    return [parse_question(q, i) for i, q in enumerate(questions)]


# ---- results --------------------------------------------------------------------------------------
@dataclass
class Answer:
    answer: str | int | bool | None
    confidence: float


@dataclass
class Decision:
    answers: list[Answer]
    forward_passes: int  # per-row decoding forwards summed over rows (prefill not counted, as in the engine)
    seconds: float
    mode: str = "joint"
    model_calls: int = 0  # batched model calls after prefill (rows share them)
    prompt_tokens: int = 0  # prompt tokens prefilled, summed over rows (independent reads the material k times)

    def to_dict(self) -> dict:
        return {"answers": [asdict(a) for a in self.answers], "forward_passes": self.forward_passes,
                "seconds": self.seconds}


# ---- slots (clover.engine.infill lays them out and denoises them) ------------------------------------
def _pieces(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each answer as it tokenizes after a scaffold ('A1: Paris' -> ids of ' Paris')."""
    return pieces(tokenizer, [" " + t for t in texts], before="A1:")


class _Slot(Slot):
    """One answer slot: its scaffold ("A2:"), allowed answers or free text, and, once committed, its tokens."""

    def __init__(self, question: Question, number: int, end: int, tokenizer, eos: set[int]):
        self.q, self.end = question, end
        scaffold = token_ids(tokenizer, f"A{number}:" if number == 1 else f" A{number}:")
        if question.type == "text":
            def finish(tokens):
                return tokens, tokenizer.decode(tokens, skip_special_tokens=True).strip()
            super().__init__(scaffold, [end], text=TextRule(finish), width=question.max_tokens, eos=eos,
                             name=repr(question.text))
            return
        if question.type == "integer":
            values = list(range(10 ** question.max_tokens))
            texts = [str(v) for v in values]
        else:
            texts = list(question.options)
            values = [t == "yes" for t in texts] if question.type == "boolean" else texts
        super().__init__(scaffold, [end], choices=_pieces(tokenizer, texts), values=values, eos=eos,
                         name=repr(question.text))


def _eos(model, tokenizer) -> list[int]:
    from ..settings import eos_ids

    ids = list(eos_ids(model, tokenizer))
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token (needed after the last answer slot)")
    return ids


def _rows(model, tokenizer, material: str, questions: list[Question], mode: str, block_size: int) -> list[Row]:
    from ..data.tasks import group_prompt

    eos = _eos(model, tokenizer)
    groups = ([questions[i: i + MAX_QUESTIONS] for i in range(0, len(questions), MAX_QUESTIONS)]
              if mode == "joint" else [[q] for q in questions])
    rows = []
    for group in groups:
        prompt = token_ids(tokenizer, group_prompt(material, [q.text for q in group]))  # as training encodes text
        slots = []
        for i, q in enumerate(group):
            end = token_ids(tokenizer, f" A{i + 2}:")[0] if i + 1 < len(group) else eos[0]
            slots.append(_Slot(q, i + 1, end, tokenizer, set(eos)))
        rows.append(Row(prompt, slots, block_size, model.config.max_block_size))
    return rows


def decide(model, tokenizer, material: str, questions, mode: str = "joint", threshold: float | None = None,
           block_size: int | None = None, split: bool = False) -> Decision:
    """Answer questions about `material`. Each question is {"question": str, "options": [str, ...]}
    or {"question": str, "type": "boolean" | "integer" | "text", "max_tokens": N} (or a Question).
    `joint`: all slots of a group (<= 8 questions) denoised together in one sequence; `independent`:
    one question per row, rows batched. More than 8 questions is an error unless `split` (groups of 8).
    Answers come back in question order: str (options / text), bool (boolean), int (integer).
    `threshold` and `block_size` default to INFILL_THRESHOLD and 32; a public family (SDAR, LLaDA2,
    Fast-dLLM v2) decodes each row's answers in its own blocks, left to right under the rows' options
    (engine/family_infill.py), at its published block size and threshold unless given.
    `decide_task`: the same as a task (engine/slots.py), whose jobs the server batches."""
    return drive(decide_task(model, tokenizer, material, questions, mode, threshold, block_size, split))


def decide_task(model, tokenizer, material: str, questions, mode: str = "joint", threshold: float | None = None,
                block_size: int | None = None, split: bool = False):
    start = time.perf_counter()
    family = absolute_blocks(model)
    threshold, block_size = infill_settings(model, threshold, block_size)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if not isinstance(material, str) or not material.strip():
        raise ValueError("material is empty")
    if threshold is not None:
        check_threshold(threshold)
    if block_size is not None:
        check_block_size(block_size, model, low=2)
    qs = parse_questions(questions, split)
    rows = _rows(model, tokenizer, material.strip(), qs, mode, block_size or model.config.block_size)
    if family:  # its own blocks, row after row
        calls = 0
        for r in rows:
            calls += yield from infill_blocks_task(model, r, set(_eos(model, tokenizer)), threshold, block_size)
    else:
        calls = yield from _denoise_buckets(model, rows, threshold)
    answers = [Answer(s.value, s.confidence) for r in rows for s in r.slots]
    return Decision(answers, sum(r.forwards for r in rows), time.perf_counter() - start, mode, calls,
                    sum(len(r.prompt) for r in rows))


def _denoise_buckets(model, rows: list[Row], threshold: float):
    """Clover's rows denoised together; returns the batched model calls. Rows batch when their windows
    have the same sizes (one block size per forward, no right padding to start with), so a batched
    row computes what it would alone."""
    buckets: dict[tuple, list[Row]] = {}
    for r in rows:
        sizes = tuple(len(r.region(w, model.config.mask_token_id)[0]) for w in range(len(r.windows)))
        buckets.setdefault(sizes, []).append(r)
    calls = 0
    for bucket in buckets.values():
        calls += yield from denoise_task(model, bucket, threshold)
    return calls
