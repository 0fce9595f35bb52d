"""`clover bench decode --workload long`: tokens/s of the lossless and parallel decoders against `ar`
on long outputs, where prefill does not dominate. Prompts: the first --prompt-tokens tokens of
passages of the plays the default model's data holds out (clover/data/build.py: every 10th play);
each row decodes exactly --max-new-tokens tokens (EOS ignored: the model keeps going). Every setting
runs at every thread count of --thread-counts, all of them interleaved round by round in one
process (clover/utils/timing.py's rule), so load hits them alike; each setting's figure is the median
over rounds, its spread the lowest and highest round, its ratio to `ar` (same threads) the ratio
of medians, with the lowest and highest of the per-round ratios."""

from __future__ import annotations

import statistics
import sys
import time

from ..errors import UserError
from .report import markdown_table, write_json

PASSAGE = 10  # the passages taken from each held-out play start here (past the title and cast list)


def long_prompts(tokenizer, prompts: int, prompt_tokens: int) -> list[list[int]]:
    """`prompts` prompts of `prompt_tokens` tokens each, cycling over the held-out plays' passages."""
    from ..api import encode
    from ..data import shakespeare

    try:
        plays = shakespeare.plays()
    except FileNotFoundError as e:
        raise UserError(f"--workload long: {e}") from None
    names = sorted(plays)
    held = [names[i] for i in range(0, len(names), 10)]  # as clover/data/build.py holds them out
    passages = {n: [p for p in shakespeare.passages(plays[n])[PASSAGE:] if len(encode(tokenizer, p)) >= prompt_tokens]
                for n in held}
    out = []
    for i in range(prompts):
        play = passages[held[i % len(held)]]
        out.append(encode(tokenizer, play[(i // len(held)) % len(play)])[:prompt_tokens])
    return out


def settings():
    """The decoders compared: ar, self_spec at block 8 (lossless: its diffusion draft, and the lookup
    draft, also at block 16: a lookup draft costs no forward, so a longer one pays where the output
    repeats its context) and low_confidence at block 8 / 0.95 (the most accurate parallel setting,
    BENCHMARKS `pareto`)."""
    from ..engine import DecodeConfig

    return {"ar": DecodeConfig(mode="ar", block_size=1),
            "self_spec 8": DecodeConfig(mode="self_spec", block_size=8),
            "self_spec lookup 8": DecodeConfig(mode="self_spec", block_size=8, draft="lookup"),
            "self_spec lookup 16": DecodeConfig(mode="self_spec", block_size=16, draft="lookup"),
            "low_confidence 8 / 0.95": DecodeConfig(block_size=8, threshold=0.95)}


def run(args, model, tokenizer) -> int:
    import torch
    from tqdm import tqdm

    counts = thread_counts(args.thread_counts)
    jobs = long_prompts(tokenizer, args.prompts, args.prompt_tokens)
    configs = settings()
    runs = {(t, name): [] for t in counts for name in configs}  # (threads, setting) -> per round (s, tokens, forwards)
    outputs = {}  # setting -> token ids of every prompt (the same every round and thread count: greedy)

    def go(threads, name):
        torch.set_num_threads(threads)
        cfg = configs[name].with_(max_new_tokens=args.max_new_tokens, ignore_eos=True, runner=args.runner)
        start, tokens, forwards, ids = time.perf_counter(), 0, 0, []
        for prompt in jobs:
            seq = Engine(model, cfg).generate([prompt])[0]
            tokens, forwards = tokens + len(seq.token_ids), forwards + seq.forward_passes
            ids.append(seq.token_ids)
        outputs[name] = ids
        return time.perf_counter() - start, tokens, forwards

    from ..engine import Engine

    bar = tqdm(total=(1 + args.repeats) * len(runs), desc="bench decode long", file=sys.stderr, leave=False)
    with torch.inference_mode():
        for r in range(1 + args.repeats):  # round 0 warms up (compiles every shape): not timed
            for key in runs:
                result = go(*key)
                bar.update()
                if r:
                    runs[key].append(result)
    bar.close()
    results = summarize(runs, configs, outputs)
    print(f"Decode speed on long outputs: default model, {len(jobs)} prompts of {args.prompt_tokens} tokens "
          f"(held-out play passages), {args.max_new_tokens} new tokens each (EOS ignored), one prompt at a time, "
          f"greedy, {args.runner} runner, {model.device} {str(model.dtype).removeprefix('torch.')}; median of "
          f"{args.repeats} rounds, every setting at every thread count interleaved in each round (after one "
          "warm-up round); in brackets the lowest and highest round.\n")
    print(markdown_table(["setting", "= ar", "tokens", "forwards", "TPF"] + [
        f"{col} ({t}t)" for t in counts for col in ("ms / forward", "tokens/s", "vs ar", "TPF for 1.3x ar",
                                                    "tokens/s at ar's step")], table(results, counts)))
    print("\n= ar: every output byte-identical to ar's. (Nt): at N threads. vs ar: ratio of the medians (same "
          "threads), in brackets the lowest and highest ratio of one round's figures. TPF for 1.3x ar: the tokens "
          "per forward the setting needs, at its measured time per forward, for 1.3x ar's tokens/s. tokens/s at "
          "ar's step: the floor a setting's forwards would give if each cost one ar step (ar's ms / forward).")
    write_json(args, dict(workload="long", prompts=len(jobs), prompt_tokens=args.prompt_tokens,
                          max_new_tokens=args.max_new_tokens, runner=args.runner, thread_counts=counts,
                          rounds=args.repeats, results=results))
    return 0


def summarize(runs: dict, configs: dict, outputs: dict) -> list[dict]:
    """The JSON record of every (threads, setting) from its rounds' (s, tokens, forwards)."""
    results = []
    for (threads, name), rounds in runs.items():
        ar = runs[(threads, "ar")]
        _, tokens, forwards = rounds[-1]
        rates = [n / s for s, n, _ in rounds]
        ratios = [(n / s) / (an / a) for (s, n, _), (a, an, _) in zip(rounds, ar)]
        rate, ar_rate = statistics.median(rates), statistics.median(an / a for a, an, _ in ar)
        ms = 1e3 * statistics.median(s for s, _, _ in rounds) / forwards
        ar_ms = 1e3 * statistics.median(a for a, _, _ in ar) / ar[-1][2]
        results.append(dict(threads=threads, setting=name, mode=configs[name].mode, block_size=configs[name].block_size,
                            draft=configs[name].draft, identical_to_ar=outputs[name] == outputs["ar"], tokens=tokens,
                            forwards=forwards, tpf=tokens / forwards, ms_per_forward=ms, tokens_per_second=rate,
                            low=min(rates), high=max(rates), vs_ar=rate / ar_rate, vs_ar_low=min(ratios),
                            vs_ar_high=max(ratios), tpf_for_1_3x=1.3 * ms / ar_ms,
                            at_ar_step=tokens / (forwards * ar_ms / 1e3)))
    return results


def table(results: list[dict], counts: list[int]) -> list[list]:
    """One row a setting, its figures at each thread count side by side."""
    by = {(r["threads"], r["setting"]): r for r in results}
    rows = []
    for name in dict.fromkeys(r["setting"] for r in results):
        first = by[(counts[0], name)]
        row = [name, "yes" if first["identical_to_ar"] else "no", first["tokens"], first["forwards"], f"{first['tpf']:.2f}"]
        for t in counts:
            r = by[(t, name)]
            row += [f"{r['ms_per_forward']:.2f}", f"{r['tokens_per_second']:.0f} ({r['low']:.0f}-{r['high']:.0f})",
                    f"{r['vs_ar']:.2f}x ({r['vs_ar_low']:.2f}-{r['vs_ar_high']:.2f})",
                    "-" if name == "ar" else f"{r['tpf_for_1_3x']:.2f}", f"{r['at_ar_step']:.0f}"]
        rows.append(row)
    return rows


def thread_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--thread-counts: a comma list of thread counts >= 1, got {text!r}")
    return counts
