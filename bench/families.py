"""Decoding speed of the public block-diffusion families (docs/families.md): for each family, a
small random-weight folder of the published layout and shape (written here, as the tests write
theirs; stored in bf16 as every family publishes its checkpoints, unless `--weights fp32`; both
sides load the weights as fp32 and compute in fp32), decoded greedily with the family's published
block size and threshold by

* the family's published generate algorithm (clover/models/reference_generate.py) run over
  transformers' own model loaded from the same folder (`TransformersBlockLM`: Qwen3, Qwen3-MoE,
  Qwen2); LLaDA2 has no transformers class, so its published loop (no cache: the whole prefix
  recomputed every forward, as published) runs over Clover's LLaDA2 model;
* Clover's engine, eager and compiled (the compiled runner where it runs the families; otherwise
  the row says why not), one request at a time (batch 1) and 8 requests at once (batch 8).

Every variant decodes the same 8 prompts: the loop and batch 1 one prompt after another, batch 8
all at once; tokens/s is the 8 requests' tokens over their time. (A random model fills some prompts
in a quarter of the forwards of others, so a batch-1 figure of one prompt against 8 at once compares
other work.) The batch-8 ceiling is the most batching can gain on this machine: each forward's
floor, max(weight bytes / copy bandwidth, weight FLOPs / GEMM rate) (bench/step.py's
`forward_floor`, measured here), summed over the forwards batch 1 ran (the columns the layers and
the head computed, as recorded), against the same row-forwards 8 at a time; in brackets, against the
forwards the batch-8 run ran (rows finishing apart, commit columns carried by rows with none).

Rounds are interleaved (every variant once per round, the order rotated); each figure is the median
over rounds, each ratio the ratio of medians with the range of the per-round ratios in brackets.
The head is scaled up ("confident") so several tokens fill per forward, as the tests do; Clover's
batch-1 tokens (eager and compiled) are checked equal to the loop's.

    PYTHONPATH=. python bench/families.py [--rounds 5] [--threads 1] [--new-tokens 64] [--families sdar,llada2]
    python bench/update.py families -- python bench/families.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from step import bandwidth, forward_floor, gemm_rate, weight_itemsize  # bench/step.py: the floor

VOCAB, MASK_ID, PROMPT_LEN = 4096, 4095, 32
STORED = {"bf16": torch.bfloat16, "fp32": torch.float32}  # --weights: how the folder stores them (both sides compute in fp32)
COMMON = dict(vocab_size=VOCAB, mask_token_id=MASK_ID, torch_dtype="float32", eos_token_id=2, hidden_size=256,
              intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False)
# name: (config.json beyond COMMON, transformers class of the published loop's model or None)
FAMILIES = {
    "sdar": (dict(architectures=["SDARForCausalLM"], model_type="sdar", head_dim=64, rope_theta=10000.0,
                  auto_map={"AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}), "Qwen3"),
    "sdar-moe": (dict(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", head_dim=64, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], rope_theta=10000.0,
                      auto_map={"AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"}), "Qwen3Moe"),
    "llada2": (dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", head_dim=64, num_experts=16,
                    num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=128, num_shared_experts=1,
                    first_k_dense_replace=1, partial_rotary_factor=0.5, use_bias=False, use_qkv_bias=False,
                    use_qk_norm=True, routed_scaling_factor=2.5, score_function="sigmoid", norm_topk_prob=True,
                    rope_theta=600000.0,
                    auto_map={"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}), None),
    "fast-dllm-v2": (dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=32,
                          rope_theta=10000.0, layer_types=["full_attention"] * 4,
                          auto_map={"AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"}), "Qwen2"),
}


def family_config(name: str, hidden: int) -> dict:
    """config.json of a family's bench folder at `hidden` (256: the default table): heads of 64, half
    as many K/V heads, an MLP 3x wide, experts' half as wide as the hidden size."""
    cfg = {**COMMON, **FAMILIES[name][0], "hidden_size": hidden, "intermediate_size": 3 * hidden,
           "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 128}
    if "moe_intermediate_size" in cfg:
        cfg["moe_intermediate_size"] = hidden // 2
    return cfg


def write_folder(folder: Path, cfg: dict, peak: float, seed: int = 0, stored=torch.float32) -> None:
    """Random weights under the published tensor names (a fan-in scaled normal; norms near 1), the
    head scaled by `peak`, stored in `stored` (bf16: as the families publish theirs; a router's expert
    bias stays fp32, as LLaDA2's does), and config.json."""
    from safetensors.torch import save_file

    from clover.models.families import family_of

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in family_of(cfg).config_class().from_dict(cfg).param_shapes().items():
        t = torch.randn(shape, generator=g)
        if "norm" in name and len(shape) == 1:
            t = 1 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif "embed" not in name:
            t = t / math.sqrt(shape[-1]) * (peak if "lm_head" in name else 1.0)
        state[name] = (t if name.endswith("expert_bias") else t.to(stored)).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(stored).split(".")[-1]}, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def transformers_model(folder: Path, cfg: dict, cls_name: str):
    """transformers' own causal LM on the folder (its loader maps the published names), strictly."""
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map")}
    config = getattr(transformers, cls_name + "Config")(**fields)
    config._attn_implementation = "eager"
    model, info = getattr(transformers, cls_name + "ForCausalLM").from_pretrained(
        str(folder), config=config, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SystemExit(f"transformers' {cls_name} does not load the folder: {info}")
    return model.eval()


def published_loop(name: str, model, loaded, prompt: list[int], new_tokens: int):
    """The family's published generate algorithm: (generated tokens, forwards)."""
    from clover.models import reference_generate as ref

    x, B, th = torch.tensor([prompt]), loaded.block_size, loaded.threshold
    if name == "llada2":
        out, forwards = ref.llada2_generate(model, x, MASK_ID, new_tokens, block_length=B, steps=B, threshold=th)
    elif name == "fast-dllm-v2":
        out, forwards = ref.fast_dllm_generate(model, x, MASK_ID, new_tokens, block_size=B, small_block_size=8,
                                               threshold=th)
    else:
        out, forwards = ref.sdar_generate(model, x, MASK_ID, new_tokens, block_length=B, threshold=th)
    return out[0, len(prompt):].tolist(), forwards


def engine_run(seam, cfg, prompts: list[list[int]], budget: int, record: list | None = None):
    """Clover's engine on `prompts` at once: (tokens per row, forwards of the batch, seconds). With
    `record`, each model call's (rows, columns, columns whose logits came out) is appended to it."""
    from clover.engine import Engine

    engine = Engine(seam, cfg.with_(max_new_tokens=budget))
    if record is not None:
        call = engine.runner.forward

        def recorded(ids, cache, **kw):
            logits = call(ids, cache, **kw)
            record.append((ids.shape[0], ids.shape[1], logits.shape[1]))
            return logits

        engine.runner.forward = recorded
    start = time.perf_counter()
    seqs = engine.generate(prompts)
    return [s.token_ids for s in seqs], max(s.forward_passes for s in seqs), time.perf_counter() - start


def one_at_a_time(seam, cfg, prompts: list[list[int]], budget: int, record: list | None = None):
    """`engine_run` on each prompt alone, one after another: (tokens per prompt, forwards, seconds)."""
    runs = [engine_run(seam, cfg, [p], budget, record) for p in prompts]
    return [r[0][0] for r in runs], sum(r[1] for r in runs), sum(r[2] for r in runs)


def loops(name: str, model, loaded, prompts: list[list[int]], new_tokens: int):
    """`published_loop` on each prompt, one after another: (tokens per prompt, forwards)."""
    runs = [published_loop(name, model, loaded, p, new_tokens) for p in prompts]
    return [t for t, _ in runs], sum(f for _, f in runs)


def ceiling(floor, single: list[tuple], batched: list[tuple], rows: int = 8) -> tuple[float, float]:
    """The most `rows` requests at once can gain over one at a time in aggregate tokens/s, at the
    floor (`floor(columns, kept)`: seconds of a forward): (the calls `single` of batch 1 each run by
    `rows` rows at once, the calls `batched` of the batch run as recorded). Calls: (rows, columns,
    kept columns); both runs make the same tokens."""
    alone = sum(floor(r * c, r * k) for r, c, k in single)
    together = sum(floor(rows * r * c, rows * r * k) for r, c, k in single) / rows
    return alone / together, alone / sum(floor(r * c, r * k) for r, c, k in batched)


class Family:
    """One family's folder, models and prompts; `run(variant)` times one variant once."""

    def __init__(self, name: str, root: Path, args):
        from clover.engine import DecodeConfig
        from clover.models.families import load_family
        from clover.models.family_seam import FamilySeam
        from clover.models.reference_generate import TransformersBlockLM

        hf_cls = FAMILIES[name][1]
        cfg = family_config(name, args.hidden)
        write_folder(root / name, cfg, args.peak, stored=STORED[args.weights])
        self.name, self.loaded = name, load_family(root / name, dtype=torch.float32, with_tokenizer=False)
        self.seam = FamilySeam(self.loaded)
        self.weight_mb = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters()) / 2**20
        self.loop_model = TransformersBlockLM(transformers_model(root / name, cfg, hf_cls)) if hf_cls \
            else self.loaded.model
        self.loop_over = f"transformers {hf_cls}" if hf_cls else "Clover's LLaDA2 model (no transformers class)"
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(4, VOCAB - 1, (PROMPT_LEN,), generator=g).tolist() for _ in range(8)]
        self.want, _ = loops(name, self.loop_model, self.loaded, self.prompts, args.new_tokens)
        self.budget, self.new_tokens = max(map(len, self.want)), args.new_tokens
        self.cfg = DecodeConfig(block_size=self.loaded.block_size, threshold=self.loaded.threshold)
        self.compiled_refusal, compiled = self._try_compiled() if args.compiled else ("not run (--no-compiled)", None)
        self.single, self.batched = [], []  # the model calls of batch 1 and batch 8 (`ceiling`)
        eager = one_at_a_time(self.seam, self.cfg, self.prompts, self.budget, self.single)[0]
        engine_run(self.seam, self.cfg, self.prompts, self.budget, self.batched)
        self.same = eager == self.want and compiled in (None, self.want)
        self.floor = forward_floor(self.loaded.model, weight_itemsize(self.loaded.model), args.bandwidth, args.gemm_rate)

    def _try_compiled(self) -> tuple[str | None, list[list[int]] | None]:
        """(None, its batch-1 tokens of each prompt) when the compiled runner runs this family (its
        graphs made by a first run), else (why not, None)."""
        try:
            tokens = one_at_a_time(self.seam, self.cfg.with_(runner="compiled"), self.prompts, self.budget)[0]
            engine_run(self.seam, self.cfg.with_(runner="compiled"), self.prompts, self.budget)
        except (ValueError, NotImplementedError) as e:
            return str(e).split("\n")[0], None
        return None, tokens

    def variants(self) -> list[str]:
        out = ["loop", "eager1", "eager8"]
        return out + (["compiled1", "compiled8"] if self.compiled_refusal is None else [])

    def run(self, variant: str) -> tuple[float, float]:
        """(tokens/s, tokens per forward) of one run of `variant`."""
        if variant == "loop":
            start = time.perf_counter()
            tokens, forwards = loops(self.name, self.loop_model, self.loaded, self.prompts, self.new_tokens)
            seconds = time.perf_counter() - start
            n = sum(map(len, tokens))
            return n / seconds, n / forwards
        runner, rows = variant[:-1], int(variant[-1])
        run = engine_run if rows > 1 else one_at_a_time
        tokens, forwards, seconds = run(self.seam, self.cfg.with_(runner=runner), self.prompts, self.budget)
        n = sum(map(len, tokens))
        return n / seconds, n / len(tokens) / forwards if rows > 1 else n / forwards


def ratio(a: list[float], b: list[float]) -> str:
    """median(a) / median(b) with the range of the per-round ratios."""
    per = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(a) / statistics.median(b):.2f}x [{min(per):.2f}-{max(per):.2f}]"


def measure(fam: Family, rounds: int) -> dict[str, list[tuple[float, float]]]:
    got = {v: [] for v in fam.variants()}
    for r in range(rounds):
        order = fam.variants()
        for v in order[r % len(order):] + order[: r % len(order)]:
            got[v].append(fam.run(v))
    return got


def row(fam: Family, got: dict) -> str:
    tps = {v: [t for t, _ in runs] for v, runs in got.items()}
    med = {v: statistics.median(x) for v, x in tps.items()}
    tpf = {v: statistics.median([f for _, f in runs]) for v, runs in got.items()}
    if fam.compiled_refusal is None:
        compiled = f"{med['compiled1']:.1f} ({ratio(tps['compiled1'], tps['loop'])})"
        batch8 = f"{med['compiled8']:.1f} ({ratio(tps['compiled8'], tps['compiled1'])})"
    else:
        compiled, batch8 = "not run" if "--no-compiled" in fam.compiled_refusal else "refused", "-"
    same_forwards, as_run = ceiling(fam.floor, fam.single, fam.batched)
    return (f"| {fam.name} | {fam.loop_over} | {fam.loaded.block_size} / {fam.loaded.threshold} | {med['loop']:.1f} "
            f"| {tpf['loop']:.2f} | {med['eager1']:.1f} ({ratio(tps['eager1'], tps['loop'])}) | {tpf['eager1']:.2f} | "
            f"{compiled} | {med['eager8']:.1f} ({ratio(tps['eager8'], tps['eager1'])}) | {batch8} | "
            f"{same_forwards:.2f}x [{as_run:.2f}x] | {'yes' if fam.same else 'NO'} |")


def refused(fams: list[Family]) -> str:
    why = sorted({f.compiled_refusal for f in fams if f.compiled_refusal})
    return f" Compiled runner: {'; '.join(why)}." if why else ""


def weights(fams: list[Family]) -> str:
    sizes = sorted(f.weight_mb for f in fams)
    return f"{sizes[0]:.0f}" if sizes[-1] - sizes[0] < 0.5 else f"{sizes[0]:.0f}-{sizes[-1]:.0f}"


def wide_note(fams: list[Family]) -> str:
    return (f" Why this width: at hidden 256 a step's weights (a few MiB) stay in the CPU's caches and its "
            f"linears run at their compute peak from one row on, so 8 rows cost about 8 rows' compute; here "
            f"they ({weights(fams)} MiB) are read from memory every step, once for all the batch's rows.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request (to whole blocks, as the loops)")
    p.add_argument("--peak", type=float, default=15.0, help="head scale: how confident the random model is")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 128; the other dims follow it)")
    p.add_argument("--weights", choices=sorted(STORED), default="bf16",
                   help="how the folder stores the weights (bf16: as every family publishes its checkpoints; fp32: "
                        "random values bf16 cannot hold); both sides load them as fp32 and compute in fp32")
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="eager only (no compiling)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    args = p.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or args.rounds < 1 or args.threads < 1 or args.hidden < 128 or args.hidden % 128:
        print(f"bench/families.py: unknown families {unknown} (known: {', '.join(FAMILIES)})" if unknown
              else "bench/families.py: --rounds and --threads must be >= 1, --hidden a multiple of 128",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    args.bandwidth, args.gemm_rate = bandwidth(), gemm_rate()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        fams = [Family(n, Path(tmp), args) for n in names]
        rows = [row(f, measure(f, args.rounds)) for f in fams]
    load = f"{load:.1f}-{os.getloadavg()[0]:.1f}"
    h = args.hidden
    print(f"Public families, random weights of the published layout (hidden {h}, 4 layers, {h // 64} heads / "
          f"{h // 128} KV, vocab {VOCAB}; MoE: 16 experts, top 4; weights {weights(fams)} MiB fp32 in memory, "
          f"stored {args.weights}{' as the families publish theirs' if args.weights == 'bf16' else ''}; "
          "both sides compute in fp32), "
          f"greedy, {PROMPT_LEN}-token prompts, "
          f"{args.new_tokens} new tokens per request (to whole blocks), head x{args.peak}; cpu, {args.threads} "
          f"thread(s), load average {load} (a shared machine); median of {args.rounds} interleaved rounds. "
          "x: ratio of medians [range of per-round ratios]. Every variant decodes the same 8 prompts: the loop and "
          "batch 1 one request after another, batch 8 all at once (aggregate tokens/s), against batch 1 on the "
          "same runner. Targets: compiled >= 5x the published loop at batch 1; batch 8 >= 3x batch 1. b8/b1 "
          f"ceiling: at the floor of each forward (max(weight bytes / {args.bandwidth / 1e9:.1f} GB/s copy "
          f"bandwidth, weight FLOPs / {args.gemm_rate / 1e9:.0f} GFLOP/s GEMM), measured), batch 1's forwards "
          "run 8 rows at once [the batch-8 run's forwards]. Same tokens: Clover's batch-1 tokens (eager and "
          "compiled) equal the loop's for every prompt. docs/families.md." + refused(fams)
          + (wide_note(fams) if h > 256 else ""))
    print()
    print("| family | published loop over | block / threshold | loop tok/s | loop TPF | eager b1 tok/s (vs loop) "
          "| eager TPF | compiled b1 tok/s (vs loop) | eager b8 tok/s (vs b1) | compiled b8 tok/s (vs b1) "
          "| b8/b1 ceiling | same tokens as the loop |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
