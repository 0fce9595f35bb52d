"""`clover info`: parameter counts and memory figures, computed from the config (clover/sizes.py).

`--plan train|serve --gpus N --gpu-mem G`: the per-GPU memory of training under FSDP2 or of
serving with --tp / --ep (default: --ep N) across N GPUs, and whether it fits (docs/distributed.md)."""

from __future__ import annotations

from ..distributed.flags import add_parallel_flags
from . import UserError, print_json
from .options import add_threads_arg


def register(sub) -> None:
    p = sub.add_parser("info", help="parameter counts and memory plan of a preset or a checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a built-in preset (default: clover-35b-a3b; also the public families': "
                     "sdar-1.7b, sdar-30b-a3b, llada2-mini, fast-dllm-v2-7b, ...)")
    src.add_argument("--model", help="a checkpoint folder with config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads_arg(p)
    p.add_argument("--quant", choices=["int4"], help="add the memory plan of a quantised deployment")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="int4 group size (default 128)")
    p.add_argument("--context", type=int, help="tokens of KV cache in the plan (default: the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once in the plan (default 1)")
    p.add_argument("--quantize-head", action="store_true", help="plan with lm_head in int4 too")
    p.add_argument("--gpu-memory", "--gpu-mem", type=float, default=None,
                   help="GPU memory in GiB to plan for (default 16 for --quant, 80 for --plan)")
    p.add_argument("--plan", choices=["train", "serve"], help="per-GPU memory plan across --gpus GPUs")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the plan (default 1)")
    p.add_argument("--seq-len", type=int, default=4096, help="train plan: tokens per row (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1, help="train plan: rows per GPU per micro-batch (default 1)")
    p.add_argument("--train-block", type=int, default=32, help="train plan: diffusion block size (default 32)")
    p.add_argument("--no-recompute", action="store_true", help="train plan: keep every layer's activations")
    add_parallel_flags(p)
    p.set_defaults(func=run)


def load_config(args):
    """(name, config): a folder's CloverConfig (checked, so transformers loads), or a preset's
    torch-free view (clover.presets): `clover info --preset ...` (and its --json / --plan train)
    answers without torch or transformers."""
    if args.model:
        from ..models import CloverConfig
        from ..utils.checkpoint import read_config

        read_config(args.model)  # not JSON, or not a Clover config: one line naming the file
        return args.model, CloverConfig.from_pretrained(args.model)
    from ..presets import PRESETS, light_preset

    name = args.preset or "clover-35b-a3b"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    if args.quant:  # the int4 plan asks the quantiser which modules of a (meta-device) model it replaces
        from ..models import preset_config

        return name, preset_config(name)
    return name, light_preset(name)


def run(args) -> int:
    from ..sizes import model_stats

    target = _family_target(args)
    if target is not None:
        return _family_info(args, *target)
    name, config = load_config(args)
    stats = {"model": name, **model_stats(config)}
    if args.plan:
        return _parallel_plan(args, name, config, stats)
    plan = _quant_plan(args, config)
    if plan is not None:
        stats["quant_plan"] = plan
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
    if plan is not None:
        print(f"int4 plan (group {plan['group_size']}, {plan['bits_per_quantized_weight']:.2f} bits per quantised "
              f"weight, context {plan['context']:,}, batch {plan['batch']}):")
        print(f"  int4 weights        {plan['int4_weight_bytes'] / gib:>15.2f} GiB  ({plan['int4_params']:,} params; "
              f"routed experts {plan['routed_expert_bytes'] / gib:.2f} GiB)")
        print(f"  bf16 weights        {plan['bf16_weight_bytes'] / gib:>15.2f} GiB  ({plan['bf16_params']:,} params: "
              f"embeddings, head, router, norms)")
        print(f"  KV cache            {plan['kv_cache_bytes'] / gib:>15.2f} GiB")
        print(f"  GDN state           {plan['gdn_state_bytes'] / gib:>15.2f} GiB")
        print(f"  runtime overhead    {plan['runtime_overhead_bytes'] / gib:>15.2f} GiB  ({plan['runtime_overhead_note']})")
        print(f"  total               {plan['total_bytes'] / gib:>15.2f} GiB  "
              f"({plan['weight_ratio_vs_bf16']:.3f}x the bf16 weights for the weights)")
        print(f"  fits in {plan['budget_bytes'] / gib:.0f} GiB? {plan['answer'].replace(' per GPU', '')}")
    return 0


def _quant_plan(args, config):
    if not getattr(args, "quant", None):
        for flag in ("context", "quantize_head"):
            if getattr(args, flag, None):
                raise UserError(f"--{flag.replace('_', '-')} needs --quant int4")
        return None
    from ..sizes import int4_memory_plan

    if args.gpu_memory is None:
        args.gpu_memory = 16.0
    if args.context is not None and args.context < 1:
        raise UserError(f"--context must be >= 1, got {args.context}")
    if args.batch < 1:
        raise UserError(f"--batch must be >= 1, got {args.batch}")
    if args.gpu_memory <= 0:
        raise UserError(f"--gpu-memory must be > 0 GiB, got {args.gpu_memory}")
    if args.quantize_head and config.tie_word_embeddings:
        raise UserError("--quantize-head needs an untied lm_head")
    try:
        return int4_memory_plan(config, args.group_size, args.context, args.quantize_head,
                                int(args.gpu_memory * 1024**3), args.batch)
    except ValueError as e:
        raise UserError(str(e)) from None


def _parallel_plan(args, name, config, stats) -> int:
    from ..sizes import serve_memory_plan, train_memory_plan

    if args.quant:
        raise UserError("--plan and --quant are separate plans: give one")
    for flag, value in (("gpus", args.gpus), ("batch", args.batch), ("seq-len", args.seq_len),
                        ("micro-batch", args.micro_batch), ("train-block", args.train_block)):
        if value < 1:
            raise UserError(f"--{flag} must be >= 1, got {value}")
    if args.context is not None and args.context < 1:
        raise UserError(f"--context must be >= 1, got {args.context}")
    gib = 1024**3
    budget = args.gpu_memory if args.gpu_memory is not None else 80.0
    if budget <= 0:
        raise UserError(f"--gpu-mem must be > 0 GiB, got {budget}")
    try:
        if args.plan == "train":
            if args.tp != 1 or args.ep != 1:
                raise UserError("the train plan is FSDP2 over --gpus (no --tp / --ep)")
            plan = train_memory_plan(config, args.gpus, int(budget * gib), args.seq_len, args.micro_batch,
                                     args.train_block, not args.no_recompute)
        else:
            ep = None if args.tp == 1 and args.ep == 1 else args.ep
            plan = serve_memory_plan(config, args.gpus, int(budget * gib), args.context, args.batch, args.tp, ep)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json({"model": name, **plan})
        return 0
    print(f"{name}: {args.plan} plan, {plan['parallel']} ({plan['total_params']:,} params, "
          f"{plan['params_per_rank']:,} per GPU)")
    rows = (["weight_bytes", "grad_bytes", "optimizer_bytes", "gathered_bytes", "activation_bytes", "logits_bytes"]
            if args.plan == "train" else ["weight_bytes", "kv_cache_bytes", "gdn_state_bytes", "logits_bytes"])
    notes = {"weight_bytes": "fp32 master shard" if args.plan == "train" else "bf16 shard",
             "grad_bytes": "fp32 shard", "optimizer_bytes": "AdamW moments, fp32 shard",
             "gathered_bytes": "bf16 params of 2 layers + root, fp32 grads of 1 layer + root",
             "activation_bytes": (f"{plan.get('micro_batch')} x {plan.get('seq_len')} tokens, "
                                  f"{'with' if plan.get('recompute') else 'without'} recomputation"),
             "kv_cache_bytes": f"{plan.get('batch')} x {plan.get('context', 0):,} tokens",
             "gdn_state_bytes": f"{plan.get('batch')} sequences", "logits_bytes": "one head output"}
    for key in rows + ["runtime_overhead_bytes", "total_bytes"]:
        label = key.removesuffix("_bytes").replace("_", " ")
        print(f"  {label:<18} {plan[key] / gib:>9.2f} GiB  {notes.get(key, '')}")
    print(f"  fits? {plan['answer'].replace(' per GPU', '')}")
    return 0


# ------------------------------------------------------------------------------------------------
# Public block-diffusion families (clover/models/families.py)
# ------------------------------------------------------------------------------------------------
def _family_target(args):
    """(name, family, config, folder) when --model is a family's folder or --preset a family preset."""
    from ..presets import FAMILY_PRESETS
    from ..utils.checkpoint import read_config

    if args.model and read_config(args.model, clover=False).get("model_type") == "clover" or \
            not args.model and args.preset not in FAMILY_PRESETS:
        return None  # a Clover model or preset: no import of the families (clover.models loads torch)
    from ..models.families import family_of, is_family_folder, read_family_config

    if args.model and is_family_folder(args.model):
        try:
            fam, config = read_family_config(args.model)
        except ValueError as e:
            raise UserError(str(e)) from None
        return args.model, fam, config, args.model
    if args.preset in FAMILY_PRESETS:
        values = FAMILY_PRESETS[args.preset]
        fam = family_of(values)
        return args.preset, fam, fam.config_class().from_dict(values), None
    return None


def _family_info(args, name, fam, config, folder) -> int:
    from ..models.families import family_settings
    from ..sizes import GIB, family_memory_plan, family_stats

    if args.quant or args.plan:
        raise UserError(f"--quant / --plan are Clover-model plans; {fam.title} has the bf16 plan only")
    if (args.context is not None and args.context < 1) or args.batch < 1:
        raise UserError("--context and --batch must be >= 1")
    cls = fam.model_class()
    settings = family_settings(folder, cls, config)
    budget = args.gpu_memory if args.gpu_memory is not None else 16.0
    if budget <= 0:
        raise UserError(f"--gpu-memory must be > 0 GiB, got {budget}")
    plan = family_memory_plan(config, settings["block_size"], args.context, args.batch, int(budget * GIB))
    info = {"model": name, "family": fam.name, "architecture": fam.architectures[0], **family_stats(config),
            "block_size": settings["block_size"], "mask_token_id": settings["mask_token_id"],
            "threshold": settings["threshold"], "shift": cls.shift, "block_align": cls.block_align,
            "modes": list(cls.modes), "memory_plan": plan}
    if args.json:
        print_json(info)
        return 0
    print(f"{name}: {fam.title}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}")
    print(f"  total params        {info['total_params']:>18,}  (non-embedding {info['non_embedding_params']:,})")
    print(f"  active params/token {info['active_params']:>18,}")
    print(f"  bf16 weights        {info['bf16_weight_bytes'] / GIB:>15.2f} GiB")
    print(f"  KV cache            {info['kv_bytes_per_token']:>15,} B/token (bf16)")
    print(f"  decoding            block {info['block_size']} ({cls.block_align} positions), mask id "
          f"{info['mask_token_id']}, threshold {info['threshold']}, "
          f"{'shift (logits at i predict i+1)' if cls.shift else 'no shift (logits at a mask predict it)'}")
    print(f"  modes               {', '.join(cls.modes)}")
    print(f"  memory plan         {plan['total_bytes'] / GIB:.2f} GiB at {plan['context']:,} tokens x {plan['batch']} "
          f"(weights {plan['weight_bytes'] / GIB:.2f}, KV {plan['kv_cache_bytes'] / GIB:.2f}); {plan['answer'].replace(' per GPU', '')}")
    return 0
