"""`clover info`: parameter counts and memory figures, computed on the meta device."""

from __future__ import annotations

from pathlib import Path

from . import UserError, print_json


def register(sub) -> None:
    p = sub.add_parser("info", help="parameter counts and memory plan of a preset or a checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a built-in preset (default: clover-35b-a3b)")
    src.add_argument("--model", help="a checkpoint folder with config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def load_config(args):
    from ..models import CloverConfig, PRESETS, preset_config

    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: no config.json (not a checkpoint folder)")
        return args.model, CloverConfig.from_pretrained(path)
    name = args.preset or "clover-35b-a3b"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return name, preset_config(name)


def run(args) -> int:
    from ..models.stats import model_stats

    name, config = load_config(args)
    stats = {"model": name, **model_stats(config)}
    if args.json:
        print_json(stats)
        return 0
    gib = 1024**3
    print(f"{name}: {config.num_hidden_layers} layers ({stats['layers']['linear_attention']} GDN, "
          f"{stats['layers']['full_attention']} attention), hidden {config.hidden_size}, "
          f"{config.num_experts} experts top-{config.num_experts_per_tok}, vocab {config.vocab_size}")
    print(f"  total params        {stats['total_params']:>18,}  (backbone {stats['backbone_params']:,} "
          f"+ diffusion extras {stats['diffusion_extra_params']:,})")
    print(f"  active params/token {stats['active_params']:>18,}")
    print(f"  bf16 weights        {stats['bf16_weight_bytes'] / gib:>15.2f} GiB")
    print(f"  KV cache            {stats['kv_bytes_per_token']:>15,} B/token (bf16)")
    print(f"  GDN state           {stats['gdn_state_bytes']:>15,} B/sequence")
    return 0
