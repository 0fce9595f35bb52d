"""How many tokens per forward `self_spec` could reach on the held-out task prompts with a perfect
draft: each draft replaced by greedy `ar`'s own output at the same positions (an oracle; the verify
forwards, rollbacks and round structure are the mode's own). Prints, per block size, `self_spec`'s
tokens per forward with the model's draft and with the oracle's, and the mean answer length: the
ceiling any training of the drafter can reach with this round structure.

    PYTHONPATH=. python bench/spec_ceiling.py [--model DIR] [--per-task 0] [--block-sizes 4,8,16] [--threads 1]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def oracle_consume(consume, answers: dict, eos: int):
    """SelfSpecMode.consume with every draft it keeps (this round's, or the next one made in the
    verify forward) replaced by the rows' `ar` answers at the draft's positions."""
    import torch

    def drafts(batch, width):
        rows = []
        for seq in batch.seqs:
            out, at = answers[tuple(seq.prompt_ids)], len(seq.token_ids)
            row = out[at:at + width]
            rows.append(row + [eos] * (width - len(row)))
        return torch.tensor(rows, dtype=torch.long, device=batch.window.device)

    def patched(self, batch, logits):
        st = self.state
        drafting = st.draft is None and st.ready_draft is None
        events = consume(self, batch, logits)
        if drafting:
            st.draft = drafts(batch, self.block_size)
        elif st.ready_draft is not None:
            st.ready_draft = drafts(batch, self.block_size)
        return events

    return patched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--per-task", type=int, default=0, help="prompts per task (0: all 280)")
    ap.add_argument("--block-sizes", default="4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    import torch

    from clover.api import eos_ids, load
    from clover.engine import modes
    from clover.eval import pareto
    from clover.eval.generation import generate_until

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    eos = eos_ids(model, tokenizer)
    exs = pareto.examples(args.per_task)
    answers = {}
    with torch.inference_mode():
        for s in range(0, len(exs), args.batch):
            chunk = exs[s:s + args.batch]
            _, seqs = generate_until(model, tokenizer, [e["prompt"] + "\n" for e in chunk], [e["budget"] for e in chunk],
                                     ["\n"], "ar", 1, 0.0, eos_token_ids=eos)
            answers.update((tuple(q.prompt_ids), list(q.token_ids)) for q in seqs)
        lengths = [len(a) for a in answers.values()]
        print(f"self_spec's ceiling: {len(exs)} held-out task prompts, answers of {sum(lengths) / len(lengths):.2f} "
              f"tokens on average (ar, until the first newline or end token)\n")
        print("| block | TPF, model's draft | TPF, perfect draft | accuracy (both) |\n|---:|---:|---:|---:|")
        consume = modes.SelfSpecMode.consume
        for b in (int(x) for x in args.block_sizes.split(",")):
            model_run = pareto.evaluate(model, tokenizer, exs, "self_spec", b, 0.0, args.batch, eos)
            modes.SelfSpecMode.consume = oracle_consume(consume, answers, eos[0])
            try:
                oracle_run = pareto.evaluate(model, tokenizer, exs, "self_spec", b, 0.0, args.batch, eos)
            finally:
                modes.SelfSpecMode.consume = consume
            assert oracle_run["accuracy"] == model_run["accuracy"]  # lossless both ways: the same answers
            print(f"| {b} | {model_run['tpf']:.2f} | {oracle_run['tpf']:.2f} | {100 * model_run['accuracy']:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
