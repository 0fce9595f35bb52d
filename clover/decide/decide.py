"""Joint decision mode: answer slots laid out after [material, Q1..Qk] and denoised together.

Layout (one row = one group of <= 8 questions, rendered exactly as the default model's training
data, `clover.data.tasks.group_prompt` / `group_as_example`):

    prompt  = "<material> Q1: ... Qk: ...\\n"                      (prefilled, committed)
    region  = "A1:" [slot 1] " A2:" [slot 2] ... " Ak:" [slot k]     (draft window(s))

Scaffold tokens ("A1:", " A2:", ...) are known tokens inside the draft window; a slot is `width`
masked positions, width = the longest allowed answer in tokens. Token shift: the window is
[x_{n-1}, region[0..m-2]] and column j predicts region[j].

Every forward scores every open slot from the same logits:
* options (and boolean = ["yes", "no"], integer = every number of <= max_tokens digits): option o
  with tokens o_1..o_L scores  sum_i log p(o_i at slot position i) + [L < width] log p(end at L),
  where `end` is the first token of the next scaffold (EOS after the last slot). The slot's
  confidence is the softmax of these scores over the options (the probability of the answer when
  the slot can only hold one of them), so the slot can never hold anything else.
* text: the argmax token at each slot position, cut at the first end marker / EOS; confidence =
  the product of those token probabilities.
Then, like `low_confidence`, every open slot whose confidence is above the threshold is committed,
or the single most confident one if none is: a group of k slots takes at most k forwards per window.
A committed slot is re-laid out at its answer's own length (the scaffold after it moves left), so
the next forward sees exactly the training rendering of the answers decided so far.

Regions longer than `block_size` are cut between slots into several windows, denoised one after
another (a finished window is committed to the cache in the next window's first forward, as the
engine does); slots in later windows see earlier ones' answers.

`independent` mode is the same machinery with one question per row. Rows whose windows have the
same sizes share forwards (left-padded prompts); as slots commit at different steps, windows of one
batch may differ in length and the shorter ones are right-padded with masks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

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


# ---- tokens -----------------------------------------------------------------------------------------
_PIECES: dict[int, tuple[object, dict]] = {}  # id(tokenizer) -> (tokenizer, {answer text: token ids})


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _pieces(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each answer as it tokenizes after a scaffold ('A1: Paris' -> ids of ' Paris')."""
    entry = _PIECES.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _PIECES[id(tokenizer)] = (tokenizer, {})
    cache = entry[1]
    todo = [t for t in dict.fromkeys(texts) if t not in cache]
    if todo:
        head = _ids(tokenizer, "A1:")
        for t, ids in zip(todo, tokenizer(["A1: " + t for t in todo], add_special_tokens=False).input_ids):
            cache[t] = ids[len(head):] if ids[: len(head)] == head and len(ids) > len(head) else _ids(tokenizer, " " + t)
    return [cache[t] for t in texts]


class _Slot:
    """One answer slot: its scaffold ("A2:"), allowed answers or free text, and, once committed, its tokens."""

    def __init__(self, question: Question, number: int, end: int, tokenizer, eos: set[int]):
        self.q, self.end, self.eos = question, end, eos
        self.scaffold = _ids(tokenizer, f"A{number}:" if number == 1 else f" A{number}:")
        self.tokens: list[int] | None = None
        self.value, self.confidence = None, 0.0
        if question.type == "text":
            self.choices, self.width = None, question.max_tokens
            self.tokenizer = tokenizer
            return
        if question.type == "integer":
            texts = [str(v) for v in range(10 ** question.max_tokens)]
            self.values = list(range(10 ** question.max_tokens))
        else:
            texts = list(question.options)
            self.values = [t == "yes" for t in texts] if question.type == "boolean" else texts
        pieces = _pieces(tokenizer, texts)
        self.choices = pieces
        self.width = max(map(len, pieces))
        lengths = torch.tensor([len(p) for p in pieces])
        grid = torch.full((len(pieces), self.width), end, dtype=torch.long)  # option tokens, end marker after
        for i, p in enumerate(pieces):
            grid[i, : len(p)] = torch.tensor(p)
        cols = torch.arange(self.width)[None, :]
        self.grid, self.lengths = grid, lengths
        self.weight = (cols < lengths[:, None]) | (cols == lengths[:, None])  # the tokens + the end marker if it fits

    @property
    def open(self) -> bool:
        return self.tokens is None

    @property
    def length(self) -> int:
        return self.width if self.tokens is None else len(self.tokens)

    def propose(self, logp: torch.Tensor, offset: int):
        """(tokens, value, confidence) from the log-probs [m, V] of the region's positions."""
        lp = logp[offset: offset + self.width]  # [width, V]
        if self.choices is None:
            best = lp.argmax(-1).tolist()
            tokens, total = [], 0.0
            for i, t in enumerate(best):
                total += float(lp[i, t])
                if t == self.end or t in self.eos:
                    break
                tokens.append(t)
            return tokens, self.tokenizer.decode(tokens, skip_special_tokens=True).strip(), float(torch.tensor(total).exp())
        picked = lp.gather(1, self.grid.to(lp.device).T).T  # [options, width]: log p(option token i at i)
        scores = (picked * self.weight.to(lp.device)).sum(1)
        probs = torch.softmax(scores, 0)
        i = int(probs.argmax())
        return self.choices[i], self.values[i], float(probs[i])

    def commit(self, tokens, value, confidence) -> None:
        self.tokens, self.value, self.confidence = list(tokens), value, confidence


class _Row:
    def __init__(self, prompt: list[int], slots: list[_Slot], block_size: int, max_block: int):
        self.prompt, self.slots, self.forwards = prompt, slots, 0
        self.windows: list[list[_Slot]] = []  # slots packed into windows of <= block_size tokens
        size = 0
        for s in slots:
            unit = len(s.scaffold) + s.width
            if unit > max_block:
                raise ValueError(f"the answer slot of {s.q.text!r} needs {unit} tokens, more than the model's "
                                 f"largest block ({max_block}): lower max_tokens or use shorter options")
            if self.windows and size + unit <= block_size:
                self.windows[-1].append(s)
                size += unit
            else:
                self.windows.append([s])
                size = unit

    def region(self, w: int, mask: int) -> tuple[list[int], list[int]]:
        """Tokens of window w (masks in open slots) and the offset of each of its slots."""
        tokens, offsets = [], []
        for s in self.windows[w] if w < len(self.windows) else []:
            tokens += s.scaffold
            offsets.append(len(tokens))
            tokens += s.tokens if s.tokens is not None else [mask] * s.width
        return tokens, offsets


# ---- decoding ---------------------------------------------------------------------------------------
def _eos(model, tokenizer) -> list[int]:
    from ..api import eos_ids

    ids = list(eos_ids(model, tokenizer))
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token (needed after the last answer slot)")
    return ids


def _rows(model, tokenizer, material: str, questions: list[Question], mode: str, block_size: int) -> list[_Row]:
    from ..data.tasks import group_prompt

    eos = _eos(model, tokenizer)
    groups = ([questions[i: i + MAX_QUESTIONS] for i in range(0, len(questions), MAX_QUESTIONS)]
              if mode == "joint" else [[q] for q in questions])
    rows = []
    for group in groups:
        prompt = _ids(tokenizer, group_prompt(material, [q.text for q in group]))  # as training encodes text
        slots = []
        for i, q in enumerate(group):
            end = _ids(tokenizer, f" A{i + 2}:")[0] if i + 1 < len(group) else eos[0]
            slots.append(_Slot(q, i + 1, end, tokenizer, set(eos)))
        rows.append(_Row(prompt, slots, block_size, model.config.max_block_size))
    return rows


def _forward(model, cache, pending, clean_bs: int, window: torch.Tensor) -> torch.Tensor:
    ids, pad, width = window, None, window.shape[1]
    if pending is not None:
        clean, clean_pad = pending
        ids = torch.cat([clean, window], dim=1)
        if clean_pad is not None:
            pad = torch.cat([clean_pad, torch.zeros_like(window, dtype=torch.bool)], dim=1)
    return model(ids, cache=cache, block_size=width, draft_len=width, clean_block_size=clean_bs,
                 pad_mask=pad, logits_to_keep=width).logits


@torch.no_grad()
def _denoise(model, rows: list[_Row], threshold: float) -> int:
    """Fill every slot of every row; returns the number of batched model calls after prefill."""
    from ..engine import DecodeConfig, Engine

    mask, device = model.config.mask_token_id, model.device
    longest = max(sum(len(s.scaffold) + s.width for s in r.slots) for r in rows)
    # the prompt's clean windows get the first draft window's size, as in training (clean and noisy
    # windows of one size); the engine validates the context length and prefills prompt[:-1]
    first = max(max(len(r.region(0, mask)[0]) for r in rows), 2)
    engine = Engine(model, DecodeConfig(block_size=first, max_new_tokens=longest + 1))
    engine.add([r.prompt for r in rows])
    cache, pending, clean_bs = engine.cache, engine.pending, engine.clean_bs
    anchors = [r.prompt[-1] for r in rows]
    calls = 0
    for w in range(max(len(r.windows) for r in rows)):
        while True:
            regions = [r.region(w, mask) for r in rows]
            work = [any(s.open for s in r.windows[w]) if w < len(r.windows) else False for r in rows]
            if not any(work):
                break
            width = max(max(len(t) for t, _ in regions), 2)
            window = torch.full((len(rows), width), mask, dtype=torch.long)
            for i, ((tokens, _), a) in enumerate(zip(regions, anchors)):
                window[i, : len(tokens)] = torch.tensor([a] + tokens[:-1]) if tokens else torch.tensor([a])
            logits = _forward(model, cache, pending, clean_bs, window.to(device)).float()
            pending, calls = None, calls + 1
            logits[..., mask] = float("-inf")
            logp = torch.log_softmax(logits, -1).cpu()  # column j predicts region position j
            for i, (row, (_, offsets)) in enumerate(zip(rows, regions)):
                if not work[i]:
                    continue
                row.forwards += 1
                proposals = [(s, s.propose(logp[i], off)) for s, off in zip(row.windows[w], offsets) if s.open]
                sure = [(s, p) for s, p in proposals if p[2] > threshold]
                for s, p in sure or [max(proposals, key=lambda sp: sp[1][2])]:
                    s.commit(*p)
        # the finished window [anchor, region[:-1]] is committed with the next forward, left-padded
        regions = [r.region(w, mask)[0] for r in rows]
        width = max(max(map(len, regions)), 1)
        clean = torch.zeros(len(rows), width, dtype=torch.long)
        pad = torch.ones(len(rows), width, dtype=torch.bool)
        for i, tokens in enumerate(regions):
            if tokens:
                clean[i, width - len(tokens):] = torch.tensor([anchors[i]] + tokens[:-1])
                pad[i, width - len(tokens):] = False
                anchors[i] = tokens[-1]
        pending = (clean.to(device), pad.to(device) if bool(pad.any()) else None)
        clean_bs = width
    return calls


def decide(model, tokenizer, material: str, questions, mode: str = "joint", threshold: float = 0.9,
           block_size: int = 32, split: bool = False) -> Decision:
    """Answer questions about `material`. Each question is {"question": str, "options": [str, ...]}
    or {"question": str, "type": "boolean" | "integer" | "text", "max_tokens": N} (or a Question).
    `joint`: all slots of a group (<= 8 questions) denoised together in one sequence; `independent`:
    one question per row, rows batched. More than 8 questions is an error unless `split` (groups of 8).
    Answers come back in question order: str (options / text), bool (boolean), int (integer)."""
    start = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if not isinstance(material, str) or not material.strip():
        raise ValueError("material is empty")
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if not 2 <= block_size <= model.config.max_block_size:
        raise ValueError(f"block_size must be in [2, {model.config.max_block_size}], got {block_size}")
    qs = parse_questions(questions, split)
    rows = _rows(model, tokenizer, material.strip(), qs, mode, block_size)
    # rows batch together when their windows have the same sizes (one block size per forward, no
    # right padding to start with), so a batched row computes what it would alone
    buckets: dict[tuple, list[_Row]] = {}
    for r in rows:
        sizes = tuple(len(r.region(w, model.config.mask_token_id)[0]) for w in range(len(r.windows)))
        buckets.setdefault(sizes, []).append(r)
    calls = sum(_denoise(model, bucket, threshold) for bucket in buckets.values())
    answers = [Answer(s.value, s.confidence) for r in rows for s in r.slots]
    return Decision(answers, sum(r.forwards for r in rows), time.perf_counter() - start, mode, calls,
                    sum(len(r.prompt) for r in rows))
