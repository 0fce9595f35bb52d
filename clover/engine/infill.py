"""Infilling: known tokens (scaffold) and typed slots laid out in draft windows, denoised together.

A diffusion model need not generate text it already knows. `clover.decide` lays out answer slots
after "A1:", "A2:", ...; `clover.structured` lays out the value slots of a JSON document whose keys
and punctuation are scaffold. Both use this module:

* a **Unit** is scaffold tokens, and a **Slot** is a unit followed by `width` masked positions;
* a **Row** is a prompt (prefilled, committed) then units packed into windows of <= block_size
  tokens; windows are denoised one after another, a finished window committed to the cache in the
  first forward of the next (the engine's fused commit);
* `denoise` runs rows in lockstep: every forward each open slot proposes (tokens, value, confidence)
  from the same logits; every slot above the threshold commits, or the single most confident one if
  none is (like `low_confidence`), so a window with k slots takes at most k forwards.

Token shift (docs/architecture.md section 2): the draft window is [last known token, region[:-1]]
and column j predicts region[j]. A committed slot is re-laid out at its own length, so every
forward sees the text decided so far as it would be written.

Slots:
* options: option o with tokens o_1..o_L scores sum_i log p(o_i at i) + [L < width] log p(end at L),
  where `end` is any token that may follow the slot (`ends`: the next scaffold's first token, EOS,
  the separator or closing token of an array); the confidence is the softmax over the options, and
  the slot can never hold anything else;
* text: the best allowed token at each position, cut at the first stop (an end or EOS); a `TextRule`
  restricts the tokens and turns them into the value (and may re-tokenize it);
* gate (`Gate`): before an optional item, continue (lay out a separator) or stop (drop the units of
  the groups that follow). Scored as p(stop token) against the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..settings import DEFAULTS, absolute_blocks, check_block_size
from .batch import RowBatch, left_padded
from .constraint import Constraint
from .engine import DecodeConfig, Engine
from .family_grammar import decode_blocks_task, option_rule
from .runner import make_runner
from .sequence import sequences
from .slots import Forward, SlotJob, drive

_PIECES: dict[int, tuple[object, dict]] = {}  # id(tokenizer) -> (tokenizer, {(before, text, after): ids})
_MASKS: dict[int, tuple[object, dict]] = {}  # id(tokenizer) -> (tokenizer, {(name, size): bool mask})
_TEXTS: dict[int, tuple[object, dict]] = {}  # id(tokenizer) -> (tokenizer, {short text: ids})
CACHED = 4096  # entries a tokenizer's store keeps (a full store starts over)
SHORT = 256  # characters of the longest text `token_ids` keeps (scaffold, keys, values; not whole prompts)


def token_ids(tokenizer, text: str) -> list[int]:
    """The text's token ids (no special tokens); short texts' kept per tokenizer (the scaffold of every
    structured reply is tokenized again and again)."""
    if len(text) > SHORT:
        return tokenizer(text, add_special_tokens=False).input_ids
    cache = per_tokenizer(_TEXTS, tokenizer)
    ids = cache.get(text)
    if ids is None:
        ids = cache[text] = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    return list(ids)


def per_tokenizer(store: dict, tokenizer) -> dict:
    """The tokenizer's own dict in `store` (keyed by id, checked by identity; bounded: cleared once it
    holds CACHED entries)."""
    entry = store.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = store[id(tokenizer)] = (tokenizer, {})
    if len(entry[1]) >= CACHED:
        entry[1].clear()
    return entry[1]


def pieces(tokenizer, texts: list[str], before: str = "", after: str = "") -> list[list[int]]:
    """`in_context`, cached per tokenizer (for the texts a slot offers: options, answers)."""
    cache = per_tokenizer(_PIECES, tokenizer)
    todo = [t for t in dict.fromkeys(texts) if (before, t, after) not in cache]
    for t, ids in zip(todo, in_context(tokenizer, todo, before, after) if todo else []):
        cache[before, t, after] = ids
    return [cache[before, t, after] for t in texts]


def in_context(tokenizer, texts: list[str], before: str = "", after: str = "") -> list[list[int]]:
    """Token ids of each text as it tokenizes between `before` and `after` (the tokens the whole
    text has there: "A1:" + " Paris" -> ids of " Paris"). A text that merges with a neighbour
    across the boundary gets the tokens it has after `before` alone, or its tokens alone."""
    head, tail = token_ids(tokenizer, before), token_ids(tokenizer, after)
    both = tokenizer([before + t + after for t in texts], add_special_tokens=False).input_ids
    left = tokenizer([before + t for t in texts], add_special_tokens=False).input_ids if after else both
    out = []
    for t, ids, ids_left in zip(texts, both, left):
        cut = len(ids) - len(tail)
        if ids[: len(head)] == head and ids[cut:] == tail and cut > len(head):
            out.append(ids[len(head): cut])
        elif ids_left[: len(head)] == head and len(ids_left) > len(head):
            out.append(ids_left[len(head):])
        else:
            out.append(token_ids(tokenizer, t))
    return out


def vocab_mask(tokenizer, size: int, name: str, keep: Callable[[str], bool]) -> torch.Tensor:
    """[size] bool: the tokens whose own text `keep` accepts. Special and added tokens, tokens that
    decode to nothing or to part of a character, and ids past the tokenizer are never kept."""
    cache = per_tokenizer(_MASKS, tokenizer)
    if (name, size) not in cache:
        n = min(len(tokenizer), size)
        texts = tokenizer.batch_decode([[i] for i in range(n)], clean_up_tokenization_spaces=False)
        added = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
        mask = torch.zeros(size, dtype=torch.bool)
        mask[:n] = torch.tensor([i not in added and bool(t) and "\ufffd" not in t and keep(t)
                                 for i, t in enumerate(texts)])
        cache[name, size] = mask
    return cache[name, size]


# ---- units and slots ------------------------------------------------------------------------------
class Unit:
    """Scaffold tokens laid out in a window. `groups` name the optional parts the unit belongs to
    (a gate that stops drops every unit of the groups after it)."""

    width = 0

    def __init__(self, scaffold: list[int], groups=frozenset()):
        self.scaffold, self.groups = list(scaffold), frozenset(groups)
        self.tokens: list[int] | None = []
        self.dropped = False

    @property
    def open(self) -> bool:
        return self.tokens is None and not self.dropped

    @property
    def length(self) -> int:
        return self.width if self.tokens is None else len(self.tokens)


@dataclass
class TextRule:
    """How a text slot reads its positions: only `allowed` tokens (bool [vocab]; None = any), no
    stop before `min_tokens`; `finish(tokens) -> (tokens, value)` makes the value (and may replace
    the tokens by those of a repaired value)."""

    finish: Callable[[list[int]], tuple[list[int], object]]
    allowed: torch.Tensor | None = None
    min_tokens: int = 0


class Slot(Unit):
    """Scaffold then `width` masked positions holding one of `choices` (token lists, with their
    `values`) or, with a `text` rule, free text of at most `width` tokens. `ends`: the tokens that may
    follow the slot (scored after a short option, stopping text); `eos`: ids that also stop text."""

    def __init__(self, scaffold: list[int], ends: list[int], choices: list[list[int]] | None = None,
                 values: list | None = None, text: TextRule | None = None, width: int | None = None,
                 eos=(), name: str = "", groups=frozenset()):
        super().__init__(scaffold, groups)
        self.ends, self.eos, self.name, self.text = list(ends), set(eos), name, text
        self.tokens, self.value, self.confidence = None, None, 0.0
        self.choices, self.values = choices, values
        self._banned_by_shape: dict[tuple[int, int], torch.Tensor] = {}  # `_banned`'s masks
        if choices is None:
            self.width = width
            return
        self.width = max(map(len, choices))
        lengths = torch.tensor([len(c) for c in choices])
        # option tokens, then the end marker (column V of the log-probs, appended in propose)
        self.grid = torch.full((len(choices), self.width), -1, dtype=torch.long)
        for i, c in enumerate(choices):
            self.grid[i, : len(c)] = torch.tensor(c)
        cols = torch.arange(self.width)[None, :]
        self.weight = (cols < lengths[:, None]) | (cols == lengths[:, None])  # the tokens + the end marker if it fits

    def propose(self, logp: torch.Tensor, offset: int):
        """(tokens, value, confidence) from the log-probs [m, V] of the region's positions."""
        lp = logp[offset: offset + self.width]  # [width, V]
        if self.choices is None:
            return self._read_text(lp)
        end = torch.logsumexp(lp[:, self.ends], -1, keepdim=True)  # log p(any end token)
        grid = self.grid.to(lp.device)
        grid = torch.where(grid < 0, lp.shape[1], grid)
        picked = torch.cat([lp, end], 1).gather(1, grid.T).T  # [options, width]: log p(option token i at i)
        scores = (picked * self.weight.to(lp.device)).sum(1)
        probs = torch.softmax(scores, 0)
        i = int(probs.argmax())
        return self.choices[i], self.values[i], float(probs[i])

    def _read_text(self, lp: torch.Tensor):
        stops = set(self.ends) | self.eos
        pick = lp
        if self.text.allowed is not None or self.text.min_tokens:
            pick = lp.masked_fill(self._banned(lp.shape[0], lp.shape[1], stops).to(lp.device), float("-inf"))
        best = pick.argmax(-1)
        tokens, total = [], 0.0
        for t, p in zip(best.tolist(), lp.gather(1, best[:, None]).squeeze(1).tolist()):
            total += p
            if t in stops:
                break
            tokens.append(t)
        tokens, value = self.text.finish(tokens)
        return tokens, value, float(torch.tensor(total).exp())

    def _banned(self, rows: int, vocab: int, stops: set[int]) -> torch.Tensor:
        """[rows, vocab] bool: the tokens position i may not hold (outside the rule's `allowed`, stops
        excepted; a stop before `min_tokens`), kept per shape (the slot reads again each forward)."""
        kept = self._banned_by_shape
        if (rows, vocab) not in kept:
            stop = torch.zeros(vocab, dtype=torch.bool)
            stop[sorted(stops)] = True
            ok = (self.text.allowed if self.text.allowed is not None else ~stop) | stop
            ok = ok[None, :].expand(rows, -1).clone()
            ok[: self.text.min_tokens] &= ~stop
            kept[rows, vocab] = ~ok
        return kept[rows, vocab]

    def commit(self, tokens, value, confidence) -> None:
        self.tokens, self.value, self.confidence = list(tokens), value, confidence

    def drops(self) -> frozenset:
        """Groups whose units leave the row once this slot is committed."""
        return frozenset()


class Gate(Slot):
    """Before optional item k of a list: continue (lay out `separator`, keep the item) or stop (the
    list ends: the groups in `stop_groups`, item k and every later one, are dropped). Its position is
    where the list's closing token would stand, so it is scored as p(stop) against 1 - p(stop)."""

    def __init__(self, separator: list[int], stop: int, stop_groups, name: str = "", groups=frozenset()):
        super().__init__([], [], width=max(len(separator), 1), name=name, groups=groups)
        self.separator, self.stop, self.stop_groups = list(separator), stop, frozenset(stop_groups)

    def propose(self, logp: torch.Tensor, offset: int):
        p = float(logp[offset, self.stop].exp())
        return (self.separator, True, 1.0 - p) if p < 0.5 else ([], False, p)

    def drops(self) -> frozenset:
        return self.stop_groups if self.value is False else frozenset()


def ends_after(units: list[Unit], i: int, final: list[int]) -> list[int]:
    """The tokens that may follow unit i: the next scaffold's first token, a gate's separator or
    stop token, or `final` (EOS) after the last unit."""
    if i + 1 >= len(units):
        return list(final)
    nxt = units[i + 1]
    if isinstance(nxt, Gate):
        return nxt.separator[:1] + [nxt.stop]
    return nxt.scaffold[:1] or list(final)


# ---- rows ---------------------------------------------------------------------------------------------
class Row:
    """A prompt and its units packed into windows of <= block_size tokens (a unit that does not fit
    the current window starts the next one; a unit longer than the model's largest block has the
    head of its scaffold cut into scaffold-only units of block_size)."""

    def __init__(self, prompt: list[int], units: list[Unit], block_size: int, max_block: int):
        self.prompt, self.forwards, self.max_block = list(prompt), 0, max_block
        self.lead, self.fed = 0, self.prompt  # scaffold tokens at window 0's start fed with the prompt (`lead_in`)
        self.units: list[Unit] = []
        for u in units:
            if u.width > max_block:
                raise ValueError(f"the slot {u.name} needs {u.width} tokens, more than the model's largest "
                                 f"block ({max_block}): lower max_tokens or use shorter options")
            extra = len(u.scaffold) + u.width - max_block
            if extra > 0:
                head, u.scaffold = u.scaffold[:extra], u.scaffold[extra:]
                self.units += [Unit(head[i: i + block_size], u.groups) for i in range(0, extra, block_size)]
            self.units.append(u)
        self.windows: list[list[Unit]] = []
        size = 0
        for u in self.units:
            n = len(u.scaffold) + u.width
            if self.windows and size + n <= block_size:
                self.windows[-1].append(u)
                size += n
            else:
                self.windows.append([u])
                size = n

    @property
    def slots(self) -> list[Slot]:
        return [u for u in self.units if isinstance(u, Slot)]

    def region(self, w: int, mask: int) -> tuple[list[int], list[int]]:
        """Tokens of window w (masks in open slots) and the offset of each unit's slot positions."""
        tokens, offsets = [], []
        for u in self.windows[w] if w < len(self.windows) else []:
            if not u.dropped:
                tokens += u.scaffold
            offsets.append(len(tokens))
            if not u.dropped:
                tokens += u.tokens if u.tokens is not None else [mask] * u.width
        return tokens, offsets

    def lead_in(self) -> None:
        """Feed window 0's scaffold before its first open slot with the prompt (clean, committed as the
        prompt is: `fed`) instead of in the draft window: the window holds only what is denoised from there
        on, and a later job whose prompt holds this row's text finds that scaffold already in its context."""
        units, (tokens, offsets) = self.windows[0] if self.windows else [], self.region(0, -1)
        self.lead = next((off for u, off in zip(units, offsets) if u.open), 0)
        self.fed = self.prompt + tokens[: self.lead]

    def draft(self, w: int, mask: int) -> tuple[list[int], list[int]]:
        """`region` less the scaffold fed with the prompt (`lead_in`): the tokens window w drafts."""
        tokens, offsets = self.region(w, mask)
        if w or not self.lead:
            return tokens, offsets
        return tokens[self.lead:], [off - self.lead for off in offsets]

    def absorb(self, w: int) -> None:
        """Merge window w into the next while it has nothing to denoise (scaffold only, or its slots
        dropped by a gate) and both fit in the largest block: its tokens ride in the next draft
        window instead of taking a forward of their own."""
        def size(window):
            return sum(len(u.scaffold) + u.length for u in window if not u.dropped)
        while (w + 1 < len(self.windows) and not any(u.open for u in self.windows[w])
               and size(self.windows[w]) + size(self.windows[w + 1]) <= self.max_block):
            self.windows[w: w + 2] = [self.windows[w] + self.windows[w + 1]]

    def tokens(self, mask: int) -> list[int]:
        return [t for w in range(len(self.windows)) for t in self.region(w, mask)[0]]

    def commit(self, slot: Slot, proposal) -> None:
        slot.commit(*proposal)
        gone = slot.drops()
        for u in self.units if gone else ():
            if u.groups & gone:
                u.dropped = True


# ---- denoising ------------------------------------------------------------------------------------------
def denoise(model, rows: list[Row], threshold: float) -> int:
    """Fill every slot of every row; returns the number of batched model calls after prefill.
    `row.forwards` counts the calls each row took part in. Alone; `denoise_task` is the same as a
    step of a task (engine/slots.py), which the server's scheduler batches with other requests' jobs."""
    return drive(denoise_task(model, rows, threshold))


class Context:
    """A request's context as its jobs have committed it so far (the tokens, and a one-row cache holding
    them), so that it is laid out once. A job of one row whose prompt extends these tokens starts from a
    copy of the cache and prefills only what its prompt adds, in clean windows of its own first width
    anchored at the addition's end; after its first forward its cache (its whole prompt committed but
    the last token) is kept for the next job. The context is so laid out segment after segment, each
    in the width of the job that first fed it; a job whose prompt does not extend it prefills whole.
    With `width`, every segment, and every window a job finishes, is committed in clean windows of that
    width instead (1: causally, so concurrent requests whose prompts begin alike share that beginning
    whatever their lengths, `slots.share_prefixes`, and jobs whose finished windows differ in length
    still share forwards). Only the request's own jobs read it (one after another). A causal context (width
    1) also keeps where a job ended (`close`): its prompt and the windows it committed after it, laid out as a
    prefill of them would be, so the next job whose prompt extends those feeds only what follows them."""

    def __init__(self, width: int | None = None):
        self.tokens: list[int] = []
        self.cache, self.width = None, width
        self.live: RowBatch | None = None  # the job whose cache `cache` is, while it may still write it
        self.ended: tuple[list[int], object] | None = None  # (tokens, cache) where the last job ended (`close`)

    def start(self, rows: list[Row]) -> tuple[object, int] | None:
        """Where a job of `rows` starts (`RowBatch.join`'s `start`, which copies it): the cache and the
        count of its prompt's tokens it holds, or None (a whole prefill)."""
        if self.ended is not None and self.extends(rows, self.ended[0]):
            return self.ended[1], len(self.ended[0])
        if self.cache is None or not self.extends(rows):
            return None
        return self.cache, len(self.tokens)

    def extends(self, rows: list[Row], tokens: list[int] | None = None) -> bool:
        """Whether a job of `rows` can start after these tokens (or `tokens`): one row whose prefill begins
        with them."""
        tokens = self.tokens if tokens is None else tokens
        n = len(tokens)
        return len(rows) == 1 and len(rows[0].fed) > n and rows[0].fed[:n] == tokens

    def keep(self, batch: RowBatch, rows: list[Row]) -> None:
        """After a job's first forward: its cache holds its prompt's prefill (unless the forward committed
        more: a window with nothing to denoise); kept: the job's cache itself, copied only if the job runs
        another forward (`hold`), which would write it."""
        tokens = batch.layout.prefilled(rows[0].fed, batch.clean_block_size)
        if len(rows) == 1 and int(batch.cache.lens[0]) == len(tokens):
            self.tokens, self.cache, self.live, self.ended = tokens, batch.cache, batch, None

    def close(self, batch: RowBatch, rows: list[Row], committed: list[int]) -> None:
        """After a job's last forward, of a causal context: the job's cache (which no forward writes again)
        holds its prompt's prefill then `committed`, the finished windows' clean tokens its later forwards
        committed one by one (in windows of one token, as a prefill of them); kept as where the next job may
        start. Nothing kept for a job of several rows or one that committed no window."""
        if self.width != 1 or len(rows) != 1 or not committed:
            return
        tokens = batch.layout.prefilled(rows[0].fed, batch.clean_block_size) + committed
        if int(batch.cache.lens[0]) == len(tokens):
            self.ended, self.live = (tokens, batch.cache), None

    def hold(self) -> None:
        """Before the job that kept the context runs another forward: the context gets a copy of its own
        (a job that ran its forward alone writes its cache in place)."""
        if self.live is not None and self.live.cache is self.cache:
            self.cache = self.cache.copy_rows()
        self.live = None


def denoise_task(model, rows: list[Row], threshold: float, context: Context | None = None):
    """`calls = yield from denoise_task(...)` in a task: one job of the slot mode (engine/slots.py);
    `context`: the request's (`Context`), which the job starts from and extends."""
    if not any(u.open for r in rows for u in r.units):
        return 0  # all scaffold: nothing to ask the model
    return (yield SlotJob(partial(_start_denoise, model, rows, threshold, context)))


def _start_denoise(model, rows: list[Row], threshold: float, context: Context | None = None, runner: str = "eager",
                   defer: bool = False):
    mask = model.config.mask_token_id
    if context is not None and context.width:  # a request of several jobs: scaffold rides with the prompt
        for r in rows:
            r.lead_in()
    longest = max(sum(len(u.scaffold) + u.width for u in r.units) for r in rows)
    # the prompt's clean windows get the first draft window's size, as in training (clean and noisy
    # windows of one size), or the request context's width; the row batch prefills prompt[:-1] (what
    # the context does not hold), its last chunk with the first window
    first = max(max(len(r.draft(0, mask)[0]) for r in rows), 2)
    check_block_size(first, model)
    seqs = sequences([r.fed for r in rows], [longest + 1] * len(rows), model.config.max_position_embeddings)
    clean = context.width if context is not None and context.width else first
    batch = RowBatch.for_runner(make_runner(runner, model, defer=defer), first, clean, mask, model.device,
                                DEFAULTS.prefill_chunk)
    batch.join(seqs, capacity=max(len(r.fed) for r in rows) + longest + 1 + first,
               start=context.start(rows) if context is not None else None)
    return batch, _denoise_steps(batch, rows, threshold, mask, context)


def _denoise_steps(batch, rows: list[Row], threshold: float, mask: int, context: Context | None = None):
    """The rows in lockstep, window after window: yields the forwards it needs, returns the count.
    Each forward is [pending clean segment ; draft window]; a finished window becomes the pending
    segment, one clean block of its own width (left-padded across rows; or in clean windows of the
    context's width, when it has one). After the first forward the prompt is committed: `context`
    keeps it."""
    anchors = [r.fed[-1] for r in rows]
    calls, w, committed, pending_row = 0, -1, [], []  # row 0's clean tokens committed after its prompt, and pending
    while (w := w + 1) < max(len(r.windows) for r in rows):
        if not any(u.open for r in rows for later in r.windows[w:] for u in later):
            break  # the rest is scaffold: nothing left to denoise or to commit for
        for r in rows:
            r.absorb(w)
        if not any(r.region(w, mask)[0] for r in rows):
            continue  # every unit of this window was dropped
        while True:
            regions = [r.draft(w, mask) for r in rows]
            work = [any(u.open for u in r.windows[w]) if w < len(r.windows) else False for r in rows]
            if not any(work):
                break
            width = max(max(len(t) for t, _ in regions), 2)
            window = torch.full((len(rows), width), mask, dtype=torch.long)
            for i, ((tokens, _), a) in enumerate(zip(regions, anchors)):
                window[i, : len(tokens)] = torch.tensor([a] + tokens[:-1]) if tokens else torch.tensor([a])
            if context is not None:
                context.hold()
            logits = (yield Forward(window.to(batch.device), width, width, width)).float()
            if calls == 0 and context is not None:
                context.keep(batch, rows)
            calls, committed, pending_row = calls + 1, committed + pending_row, []
            logits[..., mask] = float("-inf")
            logp = torch.log_softmax(logits, -1).cpu()  # column j predicts region position j
            for i, (row, (_, offsets)) in enumerate(zip(rows, regions)):
                if work[i]:
                    row.forwards += 1
                    _commit_sure(row, w, offsets, logp[i], threshold)
        if batch.pending is not None:  # nothing to denoise here and too long to absorb: commit the previous window alone
            if context is not None:
                context.hold()
            yield Forward(batch.window[:, :0], 0, 1)
            if calls == 0 and context is not None:
                context.keep(batch, rows)
            calls, committed, pending_row = calls + 1, committed + pending_row, []
            for r in rows:
                r.forwards += 1
        pending, width, pending_row = _finished_window(rows, w, mask, anchors, batch.device)
        batch.commit_next(pending, context.width if context is not None and context.width else width)
    if context is not None:
        context.close(batch, rows, committed)
    return calls


def _commit_sure(row: Row, w: int, offsets: list[int], logp: torch.Tensor, threshold: float) -> None:
    """Every open slot of window w above the threshold commits, or the most confident one."""
    proposals = [(s, s.propose(logp, off)) for s, off in zip(row.windows[w], offsets) if s.open]
    sure = [(s, p) for s, p in proposals if p[2] > threshold]
    for s, p in sure or [max(proposals, key=lambda sp: sp[1][2])]:
        row.commit(s, p)


def _finished_window(rows: list[Row], w: int, mask: int, anchors: list[int], device):
    """The finished window [anchor, region[:-1]] of every row, left-padded: the pending segment
    committed with the next forward, its clean window size (its width), and the first row's clean tokens.
    Moves the anchors."""
    regions = [r.draft(w, mask)[0] for r in rows]
    clean = [[a] + tokens[:-1] if tokens else [] for a, tokens in zip(anchors, regions)]
    for i, tokens in enumerate(regions):
        anchors[i] = tokens[-1] if tokens else anchors[i]
    return left_padded(clean, device), max(map(len, regions)), clean[0]


# ---- constrained left-to-right decoding (the grammar path) ------------------------------------------------
def decode_constrained(model, prompt: list[int], allow: Callable[[torch.Tensor], None], accept: Callable[[int], bool],
                       stops: set[int], max_new_tokens: int, generator: torch.Generator | None = None,
                       closers: Callable[[list[int]], list[int]] | None = None,
                       wrap_up: int = 0) -> tuple[list[int], bool, int]:
    """The engine's `ar` mode with a grammar as its token hook (`Constraint`): `allow(logits [1, V])`
    masks, in place, the tokens a grammar forbids and `accept(token)` advances it (False: the grammar
    is done or broken): greedy, or sampled at temperature 1 with `generator`. Returns (tokens without
    the stop token, ended with a stop token or the grammar's end, forwards). In the last `wrap_up`
    tokens of the budget the first of `closers(tokens so far)` (e.g. a closing quote, brackets, EOS)
    the grammar allows is taken before the model's choice, so a document is likelier to close within
    the budget. Alone; `decode_constrained_task` is the same as a step of a task (engine/slots.py)."""
    return drive(decode_constrained_task(model, prompt, allow, accept, stops, max_new_tokens, generator, closers,
                                         wrap_up))


def decode_constrained_task(model, prompt, allow, accept, stops, max_new_tokens, generator=None, closers=None,
                            wrap_up=0, threshold=None, block_size=None, params=None):
    """`yield from` in a task: `decode_constrained`'s one job. A public family decodes in its own
    blocks (`block_size`, `threshold`: None for the family's published ones); Clover's `ar` ignores them.
    `params` (SamplingParams): how `generator` draws among the allowed tokens (None: at temperature 1)."""
    if max_new_tokens < 1:
        return [], False, 0
    rule = Constraint(allow, accept, stops, generator, closers, wrap_up, max_new_tokens, model.config.mask_token_id,
                      params)
    return (yield from rule_task(model, prompt, rule, threshold, block_size))


def rule_task(model, prompt: list[int], rule: Constraint, threshold=None, block_size=None):
    """`yield from` in a task: decode `rule` after `prompt` in the model's layout (`ar` with the rule as
    its token hook; a public family's blocks, engine/family_grammar.py); (tokens, complete, forwards)."""
    if absolute_blocks(model):
        return (yield from decode_blocks_task(model, prompt, rule, threshold, block_size))

    def start(runner: str = "eager", defer: bool = False):
        config = DecodeConfig(mode="ar", block_size=1, max_new_tokens=rule.max_new_tokens + 1, runner=runner)
        engine = Engine(model, config, defer_compile=defer, hook=rule)
        engine.add([prompt])
        return engine.batch, _constrained(engine, rule)

    return (yield SlotJob(start))


def sample_option_task(model, prompt: list[int], options: list[int], draw, block_size: int | None = None):
    """`yield from` in a task: one of the single tokens `options` after `prompt`, drawn with `draw`
    (engine/sampling.Draw) from the model's distribution over them, in its layout: (index, forwards)."""
    tokens, _, forwards = yield from rule_task(model, prompt, option_rule(model, options, draw), None, block_size)
    return options.index(tokens[0]), forwards


def _constrained(engine: Engine, rule: Constraint):
    yield from engine.steps()
    return rule.tokens, rule.complete, rule.forwards
