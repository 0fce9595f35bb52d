"""Write the default model's results (recipes/default/RESULTS.md and the model card
clover/assets/default/README.md) from the shipped model's recipe.json (every stage's summary and data
stats: it is the provenance, and a machine without the runs/ folder still has it), recipe.toml's focus
rounds (what each round changed) and runs/default/eval.json.

    python recipes/default/report.py [--run runs/default]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from clover.data.build import focus_name, recorded_rounds

ROOT = Path(__file__).resolve().parents[2]


def pct(x) -> str:
    return f"{100 * x:.1f}%"


def _focus_mix(prov: dict, rounds: list[dict], i: int) -> str:
    """What focus round i trained on: its data stats (recipe.json) and its keys in recipe.toml."""
    data = prov.get(f"{focus_name(i)}_data", {})
    parts = ["short tasks"] + [what for key, what in (("fresh_decision_groups", "fresh decision groups"),
                                                     ("fresh_tool_dialogues", "fresh tool dialogues")) if data.get(key)]
    cfg = rounds[i - 1] if i <= len(rounds) else {}
    knobs = [fmt.format(cfg[key]) for key, fmt in (("suffix_frac", "{:.0%} of windows suffix-masked"),
                                                   ("conf_weight", "confidence term {:g}"),
                                                   ("chat_eos_pad", "chat records padded with {} end-of-text"))
             if cfg.get(key)]
    return ", ".join([" + ".join(parts + ["replay"])] + knobs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=str(ROOT / "runs" / "default"))
    args = ap.parse_args(argv)
    run = Path(args.run)
    prov = json.loads((ROOT / "clover" / "assets" / "default" / "recipe.json").read_text())
    rounds = tomllib.loads((ROOT / "recipes" / "default" / "recipe.toml").read_text())["focus"]["rounds"]
    names = [("ar", "AR (`ar.toml`)"), ("bd", "block diffusion (`bd.toml`)")]
    names += [(focus_name(i), f"focus round {i}: {_focus_mix(prov, rounds, i)} (`focus.toml`)")
              for i in range(1, recorded_rounds(prov) + 1)]
    merge = prov.get("distill_merge", 1.0)
    names.append(("distill", "self-distillation on the model's own greedy answers (`distill.toml`, `make distill`)"
                  + (f"; exported as teacher + {merge:g} x (student - teacher), `recipe.toml [distill] merge`"
                     if merge != 1.0 else "")))
    stages = [(name, prov[f"{key}_stage"]) for key, name in names if f"{key}_stage" in prov]
    ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else None
    cfg = json.loads((ROOT / "clover" / "assets" / "default" / "config.json").read_text())
    lines = ["# Default model: results", "",
             "Produced by `make model` (recipes/default); every figure below names its command.", "",
             "## Model", "",
             f"Clover, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
             f"({', '.join(cfg['layer_types'])}), {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} "
             f"+ shared expert, vocab {cfg['vocab_size']}, bf16 safetensors in `clover/assets/default/`.", "",
             "## Training (`make model`)", "",
             "| stage | steps | tokens | wall s | tokens/s | held-out AR loss | held-out BD loss (block 32) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, st in stages:
        bd_loss = f"{st['eval_bd32_loss']:.3f}" if "eval_bd32_loss" in st else "-"
        lines.append(f"| {name} | {st['step']} | {st['tokens']:,} | {st['elapsed_s']:.0f} | {st['tokens_per_s']:.0f} | "
                     f"{st.get('eval_ar_loss', float('nan')):.3f} | {bd_loss} |")
    lines += ["", "Held-out losses: per-token cross-entropy (nats) on the first rows of `heldout.jsonl` "
              "(synthetic tasks, prompts excluded from the loss in chat records); the BD loss is the "
              "masked-diffusion ELBO at block 32 with a fixed noise seed. Training tokens/s count each "
              "clean token once (the [x_t ; x_0] pass is twice as long).", ""]
    notes = [f"{name.split(':')[0]}: {st['eval_note']}." for name, st in stages if "eval_note" in st]
    notes += [f"focus round {c['after_round'] + 1} on: `make_model.py --continue` from the model shipped after round "
              f"{c['after_round']}: {c['init']}, started {c['started']}." for c in prov.get("continued", [])]
    lines += notes + ([""] if notes else [])
    if ev:
        hl = ev.get("heldout_loss")
        lines += ["## Evaluation", "", f"Command: `{ev['command']}`", ""]
        if hl:
            bdkey = f"bd{ev['block_size']}"
            lines += [f"Held-out loss of the shipped bf16 model ({hl['rows']} rows x {hl['seq_len']} tokens): "
                      f"AR {hl['ar']:.3f}, block diffusion (block {ev['block_size']}) {hl[bdkey]:.3f}.", ""]
        tasks = sorted(ev["ar"]["per_task"])
        lines += ["| decoding | accuracy | tokens / forward | filled in order | " + " | ".join(tasks) + " |",
                  "|---|---:|---:|---:|" + "---:|" * len(tasks)]
        for key, name in (("low_confidence", f"low_confidence (threshold {ev['threshold']}, block {ev['block_size']})"),
                          ("ar", "ar (same model, block size 1)")):
            r = ev[key]
            order = pct(r["filled_in_order"]) if "filled_in_order" in r else "-"
            lines.append(f"| {name} | {pct(r['accuracy'])} | {r['tokens_per_forward']:.2f} | {order} | "
                         + " | ".join(pct(r["per_task"].get(t, 0)) for t in tasks) + " |")
        if "group_questions" in ev["ar"]:
            lines += ["", f"Decision groups, share of single questions right: low_confidence "
                      f"{pct(ev['low_confidence'].get('group_questions', 0))}, ar {pct(ev['ar']['group_questions'])}."]
        lines += ["", f"Gap (ar - low_confidence): {ev['accuracy_gap_points']:.1f} points; "
                  f"{ev['low_confidence']['n']} held-out prompts. Filled in order: share of generated tokens "
                  "with no earlier position of their block still masked when they were filled.", "",
                  "Thinking (chat format, addition and subtraction, low_confidence):", "",
                  "| enable_thinking | accuracy | generated tokens | tokens / forward |", "|---|---:|---:|---:|"]
        for key, name in (("chat_no_think", "false"), ("chat_think", "true")):
            r = ev[key]
            lines.append(f"| {name} | {pct(r['accuracy'])} | {r['generated_tokens']} | {r['tokens_per_forward']:.2f} |")
        lines.append("")
    lines += ["## Training step speed", "", "`bench/train.py` vs transformers' `Qwen3NextForCausalLM`: BENCHMARKS.md, "
              "section `train` (generated with its command).", ""]
    text = "\n".join(lines)
    (ROOT / "recipes" / "default" / "RESULTS.md").write_text(text)
    card = ROOT / "clover" / "assets" / "default" / "README.md"
    card.write_text("# Clover default model\n\nA tiny block-diffusion Clover model made by `make model` "
                    "(recipes/default). It is a demo of the system, not a useful language model.\n\n"
                    + text.split("\n", 2)[2])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
