"""Infill rows (engine/infill.py: a prompt, then scaffold units and typed slots) for the public
families (SDAR, LLaDA2: no shift; Fast-dLLM v2: shift; blocks at absolute positions): the joint
decision mode (decision/decide.py) on a family's model.

Clover's infill lays a row's units out in windows right after the prompt (token shift, relative
blocks) and fills its slots in any order, each scored whole. A family's blocks sit at absolute
positions, so a slot may straddle two blocks, and a block sees only finished blocks before it.
Here the row's region is decoded in the family's own blocks, left to right, under a constraint
that allows exactly the region's texts (`Region`): a scaffold's tokens are forced, an options
slot may hold only one of its options (a trie of their tokens, closed by the slot's end marker:
the next scaffold's first token, or EOS after the last slot), a text slot any token up to its
width, closed by its end marker (so an EOS never ends the row before its last slot). The block decoder (engine/family_grammar.py) fills a
confident left prefix of each block's masks per forward (forced tokens always ride along), so all
of a row's answers come from one decoding in which later answers see the earlier ones. A slot's
confidence is the product of the probabilities, among the tokens allowed there, of the tokens
chosen for it (its end marker included where ending was a choice). Options are chosen token by
token (greedy on the trie), not scored whole.
"""

from __future__ import annotations

import torch

from .constraint import Constraint
from .family_grammar import decode_blocks_task
from .infill import Gate, Row, Slot, Unit


class Region:
    """The tokens a row's region may hold next, unit after unit; a slot's answer as it is written."""

    def __init__(self, units: list[Unit], vocab: int, mask: int, stops: set[int]):
        if any(isinstance(u, Gate) for u in units):
            raise ValueError("a family's infill rows have no optional parts (gates)")
        self.units, self.vocab, self.mask, self.stops = units, vocab, mask, stops
        self.i, self.k, self.got, self.p = 0, 0, [], 1.0  # unit, scaffold position, slot tokens, their probability
        self.last: torch.Tensor | None = None
        self.tries = [_trie(u.choices) if isinstance(u, Slot) and u.choices is not None else None for u in units]

    @property
    def unit(self) -> Unit | None:
        return self.units[self.i] if self.i < len(self.units) else None

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next."""
        u, ok = self.unit, torch.zeros(self.vocab, dtype=torch.bool)
        if u is None:
            ok[sorted(self.stops)] = True
        elif self.k < len(u.scaffold):
            ok[u.scaffold[self.k]] = True
        elif self.tries[self.i] is not None:
            nexts, done = self.tries[self.i].get(tuple(self.got), (set(), False))
            ok[sorted(nexts | (set(u.ends) if done else set()))] = True
        else:  # text: its allowed tokens up to its width, then (after its least) an end marker
            if len(self.got) < u.width:
                ok[:] = True if u.text.allowed is None else u.text.allowed[: self.vocab]
                ok[self.mask] = False
            ok[u.ends] = len(self.got) >= u.text.min_tokens
        return ok

    def allow(self, logits: torch.Tensor) -> None:
        """`Constraint.allow`: masks `logits` [1, V] in place to the tokens allowed next."""
        logits[:, ~self.allowed().to(logits.device)] = float("-inf")
        self.last = logits

    def accept(self, t: int) -> bool:
        """`Constraint.accept`: advances by `t`; False once the region is complete."""
        u = self.unit
        if u is None:
            return False
        if self.k < len(u.scaffold):
            self.k += 1
            return self._after_scaffold()
        if self.last is not None:
            self.p *= float(torch.softmax(self.last.float(), -1)[0, t])
        if self._ends(u, t):
            self._commit(u)
            self.i += 1
            if self.unit is None or t in self.stops:
                return False
            self.k = int(self.unit.scaffold[:1] == [t])  # an end marker is the next scaffold's first token
            return self._after_scaffold()
        self.got.append(t)
        return True

    def _after_scaffold(self) -> bool:
        """A scaffold-only unit is done with its last token."""
        u = self.unit
        while u is not None and not isinstance(u, Slot) and self.k >= len(u.scaffold):
            self.i, self.k = self.i + 1, 0
            u = self.unit
        return True

    def _ends(self, u: Slot, t: int) -> bool:
        if self.tries[self.i] is not None:
            return t in u.ends and self.tries[self.i].get(tuple(self.got), (set(), False))[1]
        return t in u.ends

    def _commit(self, u: Slot) -> None:
        if u.choices is not None:
            value = u.values[u.choices.index(self.got)]
            tokens = self.got
        else:
            tokens, value = u.text.finish(self.got)
        u.commit(tokens, value, self.p)
        self.got, self.p = [], 1.0


def _trie(choices: list[list[int]]) -> dict[tuple, tuple[set[int], bool]]:
    """prefix -> (the tokens that continue it to some option, whether it is an option itself)."""
    trie: dict[tuple, tuple[set[int], bool]] = {}
    for c in choices:
        for n in range(len(c) + 1):
            nexts, done = trie.setdefault(tuple(c[:n]), (set(), False))
            if n < len(c):
                nexts.add(c[n])
            else:
                trie[tuple(c)] = (nexts, True)
    return trie


def infill_blocks_task(model, row: Row, eos: set[int], threshold: float | None = None,
                       block_size: int | None = None):
    """`yield from` in a task: fill every slot of `row` in the family's blocks (one job of the slot
    mode); returns the forwards it took (also added to `row.forwards`). `threshold` and `block_size`
    default to the family's published ones."""
    units = [u for u in row.units if u.scaffold or isinstance(u, Slot)]
    region = Region(units, model.config.vocab_size, model.config.mask_token_id, set(eos))
    budget = sum(len(u.scaffold) + u.width for u in units) + 1
    rule = Constraint(region.allow, region.accept, set(eos), None, None, 0, budget, model.config.mask_token_id)
    _, _, forwards = yield from decode_blocks_task(model, row.prompt, rule, threshold, block_size)
    row.forwards += forwards
    return forwards
