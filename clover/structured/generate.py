"""Schema-guided JSON: the schema normalised (`normalize`), its skeleton's scaffold laid out as known
tokens and its slots denoised by `clover.engine.infill`; a schema the infiller cannot lay out is
decoded left to right under a grammar mask (`grammar`); one nothing can honour is `Refused`.

    out = clover.generate_json(model, tokenizer, "Describe Ann as JSON.", schema)
    out.value, out.valid, out.method, out.forward_passes

`infill_json` is the entry point for callers that hold the prompt as token ids and want fixed text
around the JSON (a forced tool call: prefix '<tool_call>\\n{"name": "add", "arguments": ', suffix
'}\\n</tool_call>'); it raises `Unsupported` instead of taking the grammar path.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from decimal import ROUND_HALF_EVEN, Decimal
from functools import partial

from ..engine.infill import (Gate, Row, Slot, TextRule, Unit, denoise_task, ends_after, pieces,
                             token_ids, vocab_mask)
from ..engine.sampling import Draw
from ..engine.slots import drive
from ..settings import INFILL_THRESHOLD, absolute_blocks, check_block_size, check_threshold, decode_config, infill_settings
from . import schema as sk
from .grammar import grammar_json
from .normalize import normalize
from .result import JsonResult, check_output, is_json_object, validate  # noqa: F401 - re-exported

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?")


def generate_json(model, tokenizer, prompt, schema: dict, chat: bool = False, threshold: float | None = None,
                  block_size: int | None = None, max_string_tokens: int = 16, max_new_tokens: int = 256,
                  method: str = "auto", draw: Draw | None = None) -> JsonResult:
    """A JSON value for `prompt` (a string, or chat messages) that follows `schema`: the schema is
    normalised, then infilled when the infiller can lay it out (clover.structured.schema), else (and
    for {"type": "json_object"}) decoded under its grammar (clover.structured.grammar) within
    `max_new_tokens`; `Refused` (a ValueError) for a schema nothing can honour. A string slot holds
    at most `max_string_tokens` tokens (and maxLength characters). `method="free"` takes
    unconstrained generation instead (the schema still checked first), to compare with. `threshold`
    and `block_size` default to INFILL_THRESHOLD and 32, for a public family to its published ones.
    `draw` (engine/sampling.Draw: temperature > 0): sampled under the grammar (the infiller is greedy)."""
    from ..chat import encode

    threshold, block_size = infill_settings(model, threshold, block_size)

    start = time.perf_counter()
    if method not in ("auto", "free", "grammar"):
        raise ValueError(f'method must be "auto", "grammar" or "free", got {method!r}')
    if draw is not None and method == "free":
        raise ValueError("a draw samples under the grammar: not with method='free'")
    if is_json_object(schema):
        reason, target = "json_object: any JSON object", schema
    else:
        target = normalize(schema)
        sk.check(target)
        reason = None
    if method == "free":
        return _free(model, tokenizer, prompt, target, "method='free': free generation asked for", chat,
                     threshold, block_size, max_new_tokens, start)
    ids = encode(tokenizer, prompt, chat)
    if reason is None and draw is not None:
        reason = "sampled: the grammar path"
    if reason is None and method == "auto":
        try:
            out = infill_json(model, tokenizer, ids, sk.skeleton(target), threshold=threshold, block_size=block_size,
                              max_string_tokens=max_string_tokens)
            out.seconds = time.perf_counter() - start
            return out
        except sk.Unsupported as e:
            reason = str(e)
    out = grammar_json(model, tokenizer, ids, target, max_new_tokens=max_new_tokens, threshold=threshold,
                       block_size=block_size, draw=draw)
    out.fallback_reason = reason if method == "auto" else "method='grammar' asked for"
    out.seconds = time.perf_counter() - start
    return out


def infill_json(model, tokenizer, prompt_ids: list[int], schema, prefix: str = "", suffix: str = "",
                threshold: float = INFILL_THRESHOLD, block_size: int = 32, max_string_tokens: int = 16) -> JsonResult:
    """Infill the JSON of `schema` (a dict, normalised here, or a `Skeleton` of a normalised one)
    after `prompt_ids`, between the fixed texts `prefix` and `suffix` (tokenized together with the
    JSON's scaffold). ValueError for a bad schema or argument, `Unsupported` for a schema the
    infiller cannot lay out (no grammar path here). `infill_json_task`: the same as a task
    (engine/slots.py: `yield from` it), whose job the server batches with other requests'."""
    return drive(infill_json_task(model, tokenizer, prompt_ids, schema, prefix, suffix, threshold, block_size,
                                  max_string_tokens))


def infill_json_task(model, tokenizer, prompt_ids: list[int], schema, prefix: str = "", suffix: str = "",
                     threshold: float = INFILL_THRESHOLD, block_size: int = 32, max_string_tokens: int = 16,
                     watch=None, context=None):
    """`infill_json` as a task; `watch`, when given, is handed a function that reads the document's
    text so far (`_settled`: up to its first open slot, for a stream) and the most tokens the
    document can take (the layout's); `context`: the request's committed context (`infill.Context`),
    which the job starts from and extends."""
    start = time.perf_counter()
    skel = schema if isinstance(schema, sk.Skeleton) else sk.skeleton(normalize(schema))
    if absolute_blocks(model):  # slots are laid out as Clover's windows: a family takes the grammar path
        raise sk.Unsupported("this model keeps its blocks at absolute positions (a public family): its JSON is "
                             "decoded under the schema's grammar in its own block layout")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    check_threshold(threshold)
    check_block_size(block_size, model, low=2)
    if max_string_tokens < 1:
        raise ValueError(f"max_string_tokens must be >= 1, got {max_string_tokens}")
    parts = _framed(skel.parts, prefix, suffix)
    units, slots = _Layout(model, tokenizer, parts, min(max_string_tokens, block_size)).build()
    row = Row(prompt_ids, units, block_size, model.config.max_block_size)
    need = len(prompt_ids) + sum(len(u.scaffold) + u.width for u in row.units) + 1
    if need > model.config.max_position_embeddings:
        raise sk.Unsupported(f"the layout needs {need} tokens with the prompt, more than the model's context "
                             f"({model.config.max_position_embeddings})")
    if watch is not None:
        watch(partial(_settled, parts, slots, prefix, suffix), need - len(prompt_ids) - 1)
    yield from denoise_task(model, [row], threshold, context)
    full = _render(parts, slots)
    text = full[len(prefix): len(full) - len(suffix)]
    value = json.loads(text)
    valid, error = validate(skel.schema, value)
    return JsonResult(text, value, valid, "infill", row.forwards, time.perf_counter() - start, None, error,
                      row.tokens(model.config.mask_token_id))


# ---- skeleton -> infill units ----------------------------------------------------------------------
def _framed(parts: list, prefix: str, suffix: str) -> list:
    """The parts with `prefix` and `suffix` merged into the document's first and last scaffold texts
    (so they tokenize together with it)."""
    parts = list(parts)
    if prefix and isinstance(parts[0], sk.Text):
        parts[0] = replace(parts[0], text=prefix + parts[0].text)
    elif prefix:
        parts.insert(0, sk.Text(prefix))
    if suffix and isinstance(parts[-1], sk.Text):
        parts[-1] = replace(parts[-1], text=parts[-1].text + suffix)
    elif suffix:
        parts.append(sk.Text(suffix))
    return parts


class _Layout:
    """Infill units of skeleton parts: a scaffold text rides with the slot after it (same groups),
    else it is a unit of its own; slot tokens are those the whole text has there (infill.pieces)."""

    def __init__(self, model, tokenizer, parts: list, string_tokens: int):
        from ..settings import eos_ids

        self.model, self.tok, self.parts, self.string_tokens = model, tokenizer, parts, string_tokens
        self.eos = list(eos_ids(model, tokenizer))
        if not self.eos:
            raise ValueError("the tokenizer and model define no EOS token (needed after the JSON)")
        self.text_ids = {i: token_ids(tokenizer, p.text) for i, p in enumerate(parts) if isinstance(p, sk.Text)}

    def build(self) -> tuple[list[Unit], dict[int, Slot]]:
        """The units in order and the infill slot of each slot part (by part index)."""
        units, slots, held = [], {}, None
        for i, p in enumerate(self.parts):
            if isinstance(p, sk.Text):
                nxt = self.parts[i + 1] if i + 1 < len(self.parts) else None
                if isinstance(nxt, (sk.Options, sk.String, sk.Number)) and nxt.groups == p.groups:
                    held = i
                else:
                    units.append(Unit(self.text_ids[i], p.groups))
                continue
            scaffold = self.text_ids[held] if held is not None else []
            slots[i] = self.slot(i, p, scaffold)
            units.append(slots[i])
            held = None
        for i, u in enumerate(units):
            if isinstance(u, Slot) and not isinstance(u, Gate):
                u.ends = ends_after(units, i, self.eos)
        return units, slots

    def context(self, i: int) -> tuple[str, str]:
        """The scaffold texts right before and after part i (what its tokens are cut from)."""
        before = self.parts[i - 1] if i else None
        after = self.parts[i + 1] if i + 1 < len(self.parts) else None
        return (before.text if isinstance(before, sk.Text) else "", after.text if isinstance(after, sk.Text) else "")

    def slot(self, i: int, p, scaffold: list[int]) -> Slot:
        before, after = self.context(i)
        if isinstance(p, sk.Gate):
            close = next(j for j, q in enumerate(self.parts) if isinstance(q, sk.Text) and p.list_id in q.closes)
            separator = token_ids(self.tok, p.separator) if p.separator else []
            return Gate(separator, self.text_ids[close][0], p.stop_groups, p.path, p.groups)
        if isinstance(p, sk.Options):
            choices = pieces(self.tok, list(p.options), before, after)
            width = max(map(len, choices))
            if width > self.model.config.max_block_size:
                raise sk.Unsupported(f"{p.path}: an option of {width} tokens is longer than the model's largest block")
            return Slot(scaffold, [], choices=choices, values=list(p.options), eos=self.eos, name=p.path, groups=p.groups)
        vocab = self.model.config.vocab_size

        def encode(text: str) -> list[int]:  # the whole text's tokens, whatever tokens the model chose
            return list(pieces(self.tok, [text], before, after)[0])

        def decode(tokens: list[int]) -> str:
            return self.tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        if isinstance(p, sk.String):
            width = min(p.max_length or self.string_tokens, self.string_tokens)
            if p.min_length > width:
                raise sk.Unsupported(f"{p.path}: minLength {p.min_length} is more than the slot's {width} tokens")

            def finish(tokens):
                value = json.dumps(decode(tokens)[: p.max_length], ensure_ascii=False)[1:-1]  # a valid string body
                return encode(value), value

            allowed = vocab_mask(self.tok, vocab, "json string", _string_safe)
            rule = TextRule(finish, allowed, p.min_length)
        else:
            def finish(tokens):
                value = _number(decode(tokens), p)
                return encode(value), value

            chars = set(" -0123456789" + ("." if p.decimals else ""))
            allowed = vocab_mask(self.tok, vocab, f"json number {p.decimals > 0}", lambda t: set(t) <= chars)
            rule, width = TextRule(finish, allowed, 1), p.width
        return Slot(scaffold, [], text=rule, width=width, eos=self.eos, name=p.path, groups=p.groups)


def _string_safe(text: str) -> bool:
    """Text a JSON string may hold as it is: no quote, backslash or control character."""
    return not any(c in '"\\' or ord(c) < 0x20 for c in text)


def _number(text: str, p: sk.Number) -> str:
    """The number the slot wrote, kept as written when it is a JSON number within the bounds, else
    rounded to p.decimals and clamped (0 when it wrote no digit); always after p.sep."""
    m = _NUMBER.search(text)
    written = Decimal(m.group()) if m else Decimal(0)
    value = min(max(written.quantize(Decimal(1).scaleb(-p.decimals), ROUND_HALF_EVEN), p.low), p.high)
    if m and value == written and _JSON_NUMBER.fullmatch(m.group()):
        return p.sep + m.group()
    return p.sep + format(value.normalize(), "f")


def _render(parts: list, slots: dict[int, Slot], settled: bool = False) -> str:
    """The document: scaffold and slot texts of every part no stopped gate dropped (`settled`: only
    up to the first slot not committed yet, the text no later commit changes)."""
    gone = frozenset().union(*(s.drops() for s in list(slots.values())))
    out = []
    for i, p in enumerate(parts):
        if p.groups & gone:
            continue
        if settled and not isinstance(p, sk.Text) and slots[i].tokens is None:
            break
        if isinstance(p, sk.Text):
            out.append(p.text)
        elif isinstance(p, sk.Gate):
            out.append(p.separator if slots[i].value else "")
        else:
            out.append(slots[i].value)
    return "".join(out)


def _settled(parts: list, slots: dict[int, Slot], prefix: str, suffix: str) -> str:
    """The document's text that no later commit changes, without the prefix (and the suffix once
    every slot is committed)."""
    text = _render(parts, slots, settled=True)[len(prefix):]
    if suffix and not any(s.open for s in list(slots.values())):
        text = text[: len(text) - len(suffix)]
    return text


def _free(model, tokenizer, prompt, schema, reason, chat, threshold, block_size, max_new_tokens, start):
    """Unconstrained generation (the engine with this model's decoding settings), checked after."""
    from ..chat import encode
    from ..engine import Engine

    cfg = decode_config(model, tokenizer, max_new_tokens=max_new_tokens, block_size=block_size, threshold=threshold)
    seq = Engine(model, cfg).generate([encode(tokenizer, prompt, chat)])[0]
    text, value, valid, error = check_output(schema, tokenizer.decode(seq.token_ids, skip_special_tokens=True))
    return JsonResult(text, value, valid, "free", seq.forward_passes, time.perf_counter() - start, reason, error,
                      seq.token_ids, complete=seq.finish_reason != "length")

