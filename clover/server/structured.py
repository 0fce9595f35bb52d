"""Structured replies: OpenAI `response_format` (json_schema, json_object) and forced tool calls
(tool_choice "required" / a named function), valid for their schema or refused (`clover.structured`).

The schema is normalised, then infilled when the infiller can lay it out (the fixed text - keys,
braces, quotes, the call's `<tool_call>` frame - as known tokens, the values denoised: about one
forward per value), else decoded left to right under its grammar (xgrammar). A schema nothing can
honour is a 400 naming the keyword and its path. The reply's `clover.structured` says which method
ran and whether the returned text itself validates (`valid`). A document is never cut: when even the
schema's smallest valid document cannot fit max_tokens the request is refused before decoding (400
naming max_tokens and the tokens it needs), and when the model's tries do not end within it the
smallest valid document is returned; a complete document the final check rejects is never returned
(500).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import partial

from ..structured import (BudgetTooSmall, JsonResult, Refused, Skeleton, Unsupported, check_budget, check_grammar,
                          is_json_object, normalize, skeleton, smallest_document)
from ..structured.generate import infill_json_task
from ..structured.grammar import exact, grammar_json_task
from ..structured import check as check_schema
from ..settings import absolute_blocks, eos_ids
from ..chat import CALL_CLOSE, CALL_END, CALL_HEAD, CALL_OPEN, TURN_ENDS, new_call_id
from ..engine.family_grammar import choose_token_task
from ..engine.infill import Context, Row, Slot, denoise_task, pieces, sample_option_task
from ..engine.sampling import Draw
from ..engine.slots import drive
from .protocol import APIError, ToolPlan, forced_name

SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass
class FormatPlan:
    """A request's response_format: its schema, normalised ({"type": "json_object"} for json_object),
    the skeleton to infill, or None and the reason when it takes the grammar path."""
    schema: dict
    skeleton: Skeleton | None
    reason: str | None = None


def _plan(schema, param: str, what: str) -> FormatPlan:
    """Normalise and lay out a schema; APIError(400) naming the keyword and path when refused."""
    try:
        target = normalize(schema)
        check_schema(target)
    except Refused as e:
        raise APIError(400, f"{what}: {e}", param=param, code="unsupported_schema")
    except ValueError as e:
        raise APIError(400, f"{what}: {e}", param=param)
    try:
        return FormatPlan(target, skeleton(target))
    except Unsupported as e:
        return FormatPlan(target, None, f"grammar path: {e}")
    except ValueError as e:
        raise APIError(400, f"{what}: {e}", param=param)


def format_plan(response_format) -> FormatPlan | None:
    """None for no / "text" format; APIError(400) for a malformed one or a schema that is invalid or
    cannot be honoured."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return FormatPlan({"type": "json_object"}, None, "json_object: any JSON object (grammar path)")
    if kind != "json_schema":
        raise APIError(400, 'response_format.type must be "text", "json_object" or "json_schema"',
                       param="response_format")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", param=SCHEMA_PARAM)
    return _plan(schema, SCHEMA_PARAM, "response_format.json_schema.schema")


class Progress:
    """A structured reply's text so far, for its stream: the content, or each tool call (id, name)
    and its arguments. The task (on the scheduler's thread) opens a part and hands each attempt's
    reader to `watch`; the stream (on the event loop) calls `read`. What one attempt read may be
    replaced by a later one (a retry, the grammar path after the infill): `Sent` notices."""

    def __init__(self):
        self.parts: list[list] = []  # [call id | None, name | None, reader]

    def open(self, call_id: str | None = None, name: str | None = None):
        """A new part (the content, or a call once its name is chosen); returns its `watch`."""
        part = [call_id, name, str]
        self.parts.append(part)
        return partial(part.__setitem__, 2)

    def read(self) -> list[tuple]:
        """(call id, name, text so far) of each part, a half UTF-8 character held back."""
        out = []
        for call_id, name, reader in list(self.parts):
            try:
                text = reader()
            except Exception:  # noqa: BLE001 - read while the scheduler's thread changes it: next time
                return out
            out.append((call_id, name, text.rstrip("\ufffd")))
        return out


def cut_at_stop(text: str, stops: list[str]) -> str | None:
    """The text before its first stop string, None when it has none."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else None


class Sent:
    """What a structured stream has sent: the content, or each call's id, name and arguments; `deltas`
    are the stream deltas from there to a newer view of the reply (content cut at a stop string,
    and while running the last characters that could start one held back). `broken` once a view does
    not extend what was sent (a later attempt replaced the text): then nothing more is sent."""

    def __init__(self, stops: list[str]):
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.content, self.calls, self.broken = "", [], False

    def deltas(self, view: list[tuple], final: bool = False) -> list[dict]:
        out = []
        for k, (call_id, name, text) in enumerate(view):
            if self.broken:
                break
            out += self._content(text, final) if call_id is None else self._call(k, call_id, name, text)
        if final and len(view) < len(self.calls):
            self.broken = True
        return out

    def _content(self, text: str, final: bool) -> list[dict]:
        cut = cut_at_stop(text, self.stops)
        text = cut if cut is not None else text if final or not self.hold else text[: max(len(text) - self.hold, 0)]
        if not text.startswith(self.content):
            self.broken = True
            return []
        new, self.content = text[len(self.content):], text
        return [{"content": new}] if new else []

    def _call(self, k: int, call_id: str, name: str, text: str) -> list[dict]:
        out = []
        if k == len(self.calls):
            self.calls.append([call_id, name, ""])
            out.append({"tool_calls": [{"index": k, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        if self.calls[k][:2] != [call_id, name] or not text.startswith(self.calls[k][2]):
            self.broken = True
            return out
        new, self.calls[k][2] = text[len(self.calls[k][2]):], text
        return out + ([{"tool_calls": [{"index": k, "function": {"arguments": new}}]}] if new else [])


@dataclass
class Infilled:
    """A structured reply: the content or the tool calls, its tokens, finish_reason and the verdict."""
    content: str | None
    tool_calls: list[dict]
    completion_tokens: int
    info: dict
    finish: str = "stop"
    extra_forwards: int = field(default=0, repr=False)

    def view(self) -> list[tuple]:
        """The reply as `Progress.read` gives it."""
        if self.content is not None:
            return [(None, None, self.content)]
        return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in self.tool_calls]

    def stopped(self, stops: list[str]) -> Infilled:
        """The reply with its content cut before its first stop string, as vLLM cuts guided output
        (finish_reason "stop"; the verdict says the returned text was cut)."""
        cut = cut_at_stop(self.content, stops) if self.content is not None else None
        if cut is None:
            return self
        info = self.info | {"valid": False, "note": "cut before a stop string: the text is not the whole document"}
        return replace(self, content=cut, info=info, finish="stop")


@dataclass
class Lane:
    """One task of a structured reply and the choices that show its reply: every choice (greedy: the
    reply is deterministic, copied) or one (sampled: a task, with its own draw, per choice)."""
    task: object  # engine/slots.Task
    progress: Progress | None
    choices: range | list[int]

    def chunks(self, reply, deltas: list[dict], **finish) -> list[str]:
        """Each delta as a stream chunk of each of the lane's choices."""
        return [reply.chunk(i, delta, **finish) for delta in deltas for i in self.choices]


def completion_tokens(lanes: list[Lane], dones: list[Infilled]) -> int:
    """The tokens of every choice of a reply (its lanes' replies)."""
    return sum(done.completion_tokens * len(lane.choices) for lane, done in zip(lanes, dones))


class Cut(ValueError):
    """max_tokens ran out before a valid document was complete (and no smaller one could stand in)."""

    keyword = "max_tokens"


def budget_error(e: ValueError) -> APIError:
    """A BudgetTooSmall / Cut as the 400 that names max_tokens."""
    return APIError(400, str(e), param="max_tokens", code="invalid_value")


def _run(model, tokenizer, prompt_ids, plan: FormatPlan, threshold, block_size, max_tokens, prefix="",
         suffix="", param=SCHEMA_PARAM, watch=None, context: Context | None = None,
         draw: Draw | None = None) -> JsonResult:
    """The JSON of a plan within max_tokens: refused first (BudgetTooSmall) when even the schema's
    smallest valid document cannot fit; then infilled, or decoded under its grammar (also when the
    infill layout does not fit the context after this prompt, and when the infilled document came out
    longer than max_tokens: the grammar path's caps ladder fits the budget, and its smallest document
    stands in when no try does). `watch`: a stream's `Progress.watch`, handed each attempt's text;
    `context`: the request's committed context, which the infill starts from (`infill.Context`). `draw`
    (a sampled request): always the grammar path, every token drawn among those the grammar allows."""
    check_budget(tokenizer, plan.schema, max_tokens, prefix, suffix)
    infilled = None
    if plan.skeleton is None or draw is not None:  # compiled now, while planned off the scheduler's thread
        _check_grammar(model, tokenizer, plan, param, draw)
    else:
        try:
            infilled = yield from infill_json_task(model, tokenizer, prompt_ids, plan.skeleton, prefix=prefix,
                                                   suffix=suffix, threshold=threshold, block_size=block_size,
                                                   watch=partial(_fitting, watch, max_tokens)
                                                   if watch and exact(plan.schema) else None, context=context)
        except Unsupported:
            pass
        else:
            if infilled.valid and len(infilled.token_ids) <= max_tokens:
                return infilled
        if infilled is None:  # the layout does not fit the context: the grammar path or a 400
            _check_grammar(model, tokenizer, plan, param)
        else:
            try:
                check_grammar(model, tokenizer, plan.schema)
            except Refused:
                return _instead(tokenizer, plan, infilled, prefix, suffix, max_tokens)
    try:
        r = yield from grammar_json_task(model, tokenizer, prompt_ids, plan.schema, prefix=prefix, suffix=suffix,
                                         max_new_tokens=max_tokens, threshold=threshold, block_size=block_size,
                                         watch=watch, draw=draw)
    except Refused as e:  # e.g. no level's grammar compiled within the time budget
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None
    if infilled is not None:  # the infill's forwards were spent too
        r.forward_passes += infilled.forward_passes
        r.fallback_reason = (f"the infilled document ({len(infilled.token_ids)} tokens) was longer than "
                             f"max_tokens ({max_tokens})")
    return r


def _fitting(watch, max_tokens: int, reader, most: int) -> None:
    """An infill attempt (of an `exact` schema) is streamed only when its longest document fits max_tokens:
    a longer one may come out too long and be replaced by the grammar path's."""
    if most <= max_tokens:
        watch(reader)


def _check_grammar(model, tokenizer, plan: FormatPlan, param: str, draw: Draw | None = None) -> None:
    try:
        check_grammar(model, tokenizer, plan.schema)
    except Refused as e:
        if draw is not None and plan.skeleton is not None:  # greedy, the infiller would honour it
            raise APIError(400, f"temperature > 0 samples under the schema's grammar, which cannot honour it "
                           f"({param}: {e}); with temperature 0 it is infilled", param="temperature",
                           code="invalid_value") from None
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None


def _instead(tokenizer, plan: FormatPlan, infilled: JsonResult, prefix, suffix, max_tokens) -> JsonResult:
    """No grammar to fit the budget with: the smallest valid document in place of an infilled one that
    did not fit (or was rejected), else the infilled one (_verdict judges it)."""
    smallest = smallest_document(tokenizer, plan.schema, prefix, suffix)
    if smallest is None or len(smallest[1]) > max_tokens:
        return infilled
    text, ids = smallest
    return JsonResult(text, json.loads(text), True, infilled.method, infilled.forward_passes, 0.0,
                      token_ids=ids, note="the smallest valid document: the infilled one did not fit")


def _verdict(r: JsonResult, max_tokens: int, extra_forwards: int = 0) -> tuple[str, str, dict]:
    """(text, finish_reason, info) of a result: a document max_tokens cut is never a reply (Cut: a 400
    naming max_tokens), nor is a complete one that fails the check (a 500)."""
    info = {"method": r.method, "valid": r.valid, "forward_passes": r.forward_passes + extra_forwards}
    if r.note:
        info["note"] = r.note
    if not r.complete or len(r.token_ids) > max_tokens:
        raise Cut(f"max_tokens ({max_tokens}) ran out before a document valid under the schema was complete: "
                  "ask for more")
    if not r.valid:
        raise APIError(500, f"no document valid under the schema was produced ({r.error})", "server_error")
    return r.text, "stop", info


def infill_format(model, tokenizer, prompt_ids: list[int], plan: FormatPlan, threshold: float,
                  block_size: int, max_tokens: int = 1 << 30, draw: Draw | None = None) -> Infilled:
    """A response_format reply, alone (`infill_format_task`: as a task the scheduler runs). `draw`
    (engine/sampling.Draw, a request with temperature > 0): sampled among the tokens the schema's grammar
    allows (the infiller's commits are greedy: a sampled reply takes the grammar path)."""
    return drive(infill_format_task(model, tokenizer, prompt_ids, plan, threshold, block_size, max_tokens,
                                    draw=draw))


def infill_format_task(model, tokenizer, prompt_ids: list[int], plan: FormatPlan, threshold: float,
                       block_size: int, max_tokens: int = 1 << 30, progress: Progress | None = None,
                       draw: Draw | None = None):
    watch = progress.open() if progress is not None else None
    try:
        r = yield from _run(model, tokenizer, prompt_ids, plan, threshold, block_size, max_tokens, watch=watch,
                            draw=draw)
        text, finish, info = _verdict(r, max_tokens)
    except (BudgetTooSmall, Cut) as e:
        raise budget_error(e) from None
    return Infilled(text, [], len(r.token_ids), info, finish)


def _function_plans(functions: list[dict], names: list[str]) -> tuple[dict[str, FormatPlan], dict[str, str]]:
    """The arguments plan of each named function, and why the others cannot be called."""
    plans, refused = {}, {}
    for f in functions:
        if f["name"] not in names:
            continue
        try:
            plans[f["name"]] = _plan(f.get("parameters") or {"type": "object", "properties": {}},
                                     "tools", f"tools: function {f['name']!r} parameters")
        except APIError as e:
            refused[f["name"]] = e.message
    return plans, refused


MAX_TOOL_CALLS = 8  # calls in one reply under tool_choice "required" with parallel_tool_calls (Settings.max_tool_calls)


def _end_of_turn(model, tokenizer) -> int:
    """The token that ends an assistant turn: the family's (chat.TURN_ENDS: <|im_end|>, LLaDA2's <|role_end|>)
    when the tokenizer has it, else its first EOS."""
    for token in TURN_ENDS:
        end = tokenizer.convert_tokens_to_ids(token)
        if isinstance(end, int) and end != tokenizer.unk_token_id and 0 <= end < model.config.vocab_size:
            return end
    return eos_ids(model, tokenizer)[0]


def another_call(model, tokenizer, context: list[int], threshold: float, block_size: int,
                 laid: Context | None = None, draw: Draw | None = None) -> tuple[bool, int]:
    """After a call (`context` ends with its `</tool_call>`): does another call follow? An options slot
    over the next token, the newline before another `<tool_call>` block or the end of the turn; the
    model's choice, (True: another, forwards), drawn with `draw` when sampled. `laid`: the request's
    committed context (`infill.Context`)."""
    newline = pieces(tokenizer, ["\n"], before=CALL_CLOSE, after=CALL_OPEN)[0][:1]
    options = newline + [_end_of_turn(model, tokenizer)]
    if draw is not None:  # one token drawn between the two, in the model's layout
        pick, forwards = yield from sample_option_task(model, context, options, draw, block_size)
        return pick == 0, forwards
    if absolute_blocks(model):  # a public family: one token in its own layout (engine/family_grammar.py)
        pick, forwards = yield from choose_token_task(model, context, options, block_size)
        return pick == 0, forwards
    slot = Slot([], [], choices=[newline, [_end_of_turn(model, tokenizer)]], values=[True, False], name="another call")
    row = Row(context, [slot], block_size, model.config.max_block_size)
    yield from denoise_task(model, [row], threshold, laid)
    return bool(slot.value), row.forwards


def _one_call(model, tokenizer, context: list[int], plans: dict[str, FormatPlan], lead: str, threshold: float,
              block_size: int, room: int, opened=None, laid: Context | None = None, draw: Draw | None = None):
    """One call after `context` (`lead` before its frame: the newline between calls): the function (an
    options slot over the callable names when there are several), then its own arguments schema
    (`opened(name)`, when given, is told the name once chosen and returns the arguments' watch).
    `laid`: the request's committed context (`infill.Context`), which both infills start from. `draw`
    (sampled): the name and the arguments sampled under their grammars.
    (name, result, arguments text, finish_reason, verdict)."""
    forwards = 0
    if len(plans) > 1:
        names = {"enum": list(plans)}
        if absolute_blocks(model) or draw is not None:  # the grammar path (a public family's: in its own layout)
            pick = yield from grammar_json_task(model, tokenizer, context, names, prefix=lead + CALL_HEAD,
                                                suffix=', "arguments":', max_new_tokens=room, threshold=threshold,
                                                block_size=block_size, draw=draw)
        else:
            pick = yield from infill_json_task(model, tokenizer, context, names, prefix=lead + CALL_HEAD,
                                               suffix=', "arguments":', threshold=threshold, block_size=block_size,
                                               context=laid)
        name, forwards = pick.value, pick.forward_passes
    else:
        name = next(iter(plans))
    head = lead + CALL_HEAD + json.dumps(name) + ', "arguments": '
    r = yield from _run(model, tokenizer, context, plans[name], threshold, block_size, room, prefix=head,
                        suffix=CALL_END, param="tools", watch=opened(name) if opened is not None else None,
                        context=laid, draw=draw)
    text, finish, info = _verdict(r, room, forwards)
    return name, r, text, finish, info


def infill_tool_call(model, tokenizer, prompt_ids: list[int], tools: ToolPlan, threshold: float,
                     block_size: int, max_tokens: int = 1 << 30, max_calls: int = MAX_TOOL_CALLS,
                     draw: Draw | None = None) -> Infilled:
    """Forced calls: the function (an options slot over the allowed names whose arguments schema can
    be honoured, under "required" with several tools), then its own arguments schema inside the fixed
    call frame (infilled, or decoded under its grammar). The other tools' schemas never matter.
    A named function or parallel_tool_calls=false: exactly one call. "required" with
    parallel_tool_calls: at least one; after each the model decides whether another follows
    (`another_call`), up to `max_calls`; a later call cut by max_tokens or the context is left out
    (finish "length"), so every returned call is complete and valid.
    APIError(400) when the named function's schema (or, under "required", every one) is refused.
    `draw` (sampled): the function, its arguments and whether another call follows drawn under their
    grammars (the grammar path, as a sampled response_format reply).
    Alone; `infill_tool_call_task` is the same as a task the scheduler runs."""
    return drive(infill_tool_call_task(model, tokenizer, prompt_ids, tools, threshold, block_size, max_tokens,
                                       max_calls, draw=draw))


def _callable(model, tokenizer, tools: ToolPlan) -> dict[str, FormatPlan]:
    """The arguments plan of each function the reply may call; APIError(400) when none can be."""
    name = forced_name(tools.choice, tools.functions)
    names = [name] if name is not None else [f["name"] for f in tools.functions]
    plans, refused = _function_plans(tools.functions, names)
    for n in names:  # the grammar path's own check, before any work
        if n in plans and plans[n].skeleton is None:
            try:
                check_grammar(model, tokenizer, plans[n].schema)
            except Refused as e:
                refused[n] = f"tools: function {n!r} parameters: {e}"
                del plans[n]
    if not plans:
        why = "; ".join(refused.values())
        raise APIError(400, why if name else f"no tool can be called: {why}", param="tools",
                       code="unsupported_schema")
    return plans


class _Shown:
    """A reply's calls as its stream sees them (`Progress` parts, in call order): a call is shown once a
    try of it streams (only a try nothing can cut or reject, which is kept) or once it is kept, never
    before, so a call left out (max_tokens, the context) was never sent."""

    def __init__(self, progress: Progress | None):
        self.progress, self.open = progress, {}

    def opener(self, call_id: str):
        """`_one_call`'s `opened`: the arguments' watch, which shows the call on its first reader."""
        if self.progress is None:
            return None
        return lambda name: partial(self._watch, call_id, name)

    def _watch(self, call_id: str, name: str, reader) -> None:
        if call_id not in self.open:
            self.open[call_id] = self.progress.open(call_id, name)
        self.open[call_id](reader)

    def kept(self, call_id: str, name: str, text: str) -> None:
        if self.progress is not None:
            self._watch(call_id, name, lambda: text)


@dataclass
class _Calls:
    """The calls of one reply so far."""
    context: list[int]
    calls: list[dict] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    used: int = 0
    extra: int = 0  # forwards of the another-call decisions
    finish: str = "tool_calls"
    note: str | None = None

    def reply(self) -> Infilled:
        infos = self.infos
        methods = sorted({i["method"] for i in infos})
        info = {"method": methods[0] if len(methods) == 1 else "+".join(methods),
                "valid": all(i["valid"] for i in infos),
                "forward_passes": sum(i["forward_passes"] for i in infos) + self.extra, "calls": infos}
        if "error" in infos[-1]:
            info["error"] = infos[-1]["error"]
        if self.note:
            info["note"] = self.note
        return Infilled(None, self.calls, self.used, info, "tool_calls" if self.finish == "stop" else self.finish)


def infill_tool_call_task(model, tokenizer, prompt_ids: list[int], tools: ToolPlan, threshold: float,
                          block_size: int, max_tokens: int = 1 << 30, max_calls: int = MAX_TOOL_CALLS,
                          progress: Progress | None = None, draw: Draw | None = None):
    plans = _callable(model, tokenizer, tools)
    cap = max_calls if tools.parallel and tools.choice == "required" else 1
    ctx = model.config.max_position_embeddings
    # its context laid out once: causally when several jobs may run (other requests' share its beginning)
    out, shown, laid = _Calls(list(prompt_ids)), _Shown(progress), Context(1 if cap > 1 or len(plans) > 1 else None)
    while True:
        room, n, call_id = min(max_tokens - out.used, ctx - len(out.context)), len(out.calls) + 1, new_call_id()
        if out.calls and room < 1:
            out.finish, out.note = "length", f"call {n} left out: max_tokens ({max_tokens}) or the context ran out"
            break
        try:
            name, r, text, done, info = yield from _one_call(
                model, tokenizer, out.context, plans, "\n" if out.calls else "", threshold, block_size, room,
                shown.opener(call_id), laid, draw)
        except (Unsupported, ValueError) as e:  # a later call the context or max_tokens cannot hold
            if not out.calls:
                raise budget_error(e) if isinstance(e, (BudgetTooSmall, Cut)) else e
            out.finish, out.note = "length", f"call {n} left out: {e}"
            break
        if done != "stop" and out.calls:  # a later call cut by the budget: left out, the reply ends here
            out.finish, out.note = "length", (f"call {n} left out: the {room} tokens left of max_tokens "
                                              f"({max_tokens}) ran out before it was complete")
            break
        out.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": text}})
        shown.kept(call_id, name, text)
        out.infos.append({"name": name} | info)
        out.used += min(len(r.token_ids), room)
        out.context += r.token_ids
        if done != "stop":
            out.finish = done
            break
        if len(out.calls) >= cap:
            break
        more, forwards = yield from another_call(model, tokenizer, out.context, threshold, block_size, laid, draw)
        out.extra += forwards
        if not more:
            break
    return out.reply()


__all__ = ["MAX_TOOL_CALLS", "FormatPlan", "Infilled", "Lane", "Progress", "Sent", "another_call", "format_plan",
           "infill_format", "infill_format_task",
           "infill_tool_call", "infill_tool_call_task", "is_json_object"]
