"""INT4 benchmark: size on disk and in memory, decode speed at batch 1, held-out loss and task
accuracy for bf16, RTN, RTN with int8 activations (the opt-in kernel "int8", ops/linear/int4_q8.py) and GPTQ. Prints a markdown section
(`bench/update.py quant -- ...` puts the command above it in BENCHMARKS.md).

    python bench/quant.py                       # the default model (clover/assets/default)
    python bench/quant.py --model DIR           # any Clover checkpoint with a tokenizer
    python bench/quant.py --random clover-small # random weights (no data: quality = agreement with bf16)

Speed: the engine's default decoding (low_confidence, block 32) at batch 1, end-of-text disabled
so every run makes the same number of tokens; models timed alternately (A B C A B C ...), medians.
Memory: bytes of the tensors the loaded model holds after a forward (int4: the CPU kernel layout).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clover.engine import DecodeConfig, Engine  # noqa: E402
from clover.models import CloverForBlockDiffusion, preset_config  # noqa: E402
from clover.quant.modules import Int4Weight, set_int4_kernel  # noqa: E402
from clover.convert.quantize import quantize_checkpoint  # noqa: E402
from clover.training.objectives import block_diffusion_loss  # noqa: E402

SCRATCH = Path("/tmp/quant_bench")


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def memory(model) -> tuple[int, int]:
    """(all tensor bytes held, bytes of the quantisable layers' weights) after the kernels are built."""
    total = quant = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, Int4Weight):
            b = m.memory_bytes()
            quant += b
            total += b - sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.qzeros))
    return total, quant


def bf16_quantisable_bytes(model) -> int:
    from clover.quant.modules import quantized_targets

    out = 0
    for _, m in quantized_targets(model):
        out += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.dim() >= 2)
    return out


INT8 = "int4 RTN, int8 act."  # the RTN folder on the int4 x int8-activation kernel


def load(folder, dtype, kernel="auto"):
    model = CloverForBlockDiffusion.from_pretrained(folder, dtype=dtype).eval()
    set_int4_kernel(model, kernel)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))  # builds the int4 kernel layout
    return model


def decode_once(model, prompt, new_tokens, block):
    eng = Engine(model, DecodeConfig(block_size=block, max_new_tokens=new_tokens, eos_token_ids=()))
    t0 = time.perf_counter()
    seq = eng.generate([prompt])[0]
    return time.perf_counter() - t0, seq


@torch.no_grad()
def heldout_loss(model, rows, block, seed=0):
    """(block-diffusion loss, AR loss) over EVERY token of the rows, prompts included: the relative
    change between precisions is the point, so it is higher than RESULTS.md's answer-only loss."""
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    diff = statistics.fmean(block_diffusion_loss(model, ids[i : i + 8], mask[i : i + 8], block, generator=gen,
                                                 complementary=True)[0].item() for i in range(0, len(ids), 8))
    ar = statistics.fmean(model(ids[i : i + 8], labels=ids[i : i + 8]).loss.item() for i in range(0, len(ids), 8))
    return diff, ar


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "clover/assets/default")
    ap.add_argument("--random", metavar="PRESET", help="benchmark random weights of this preset instead")
    ap.add_argument("--data", type=Path, default=REPO / "runs/default/data",
                    help="folder with heldout.jsonl and eval_tasks.jsonl (default: the default recipe's)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--eval-per-task", type=int, default=20, help="task-accuracy prompts per task (default 20)")
    ap.add_argument("--loss-rows", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    seq_len = 256
    if args.random:
        torch.manual_seed(0)
        src = SCRATCH / "src"
        model = CloverForBlockDiffusion(preset_config(args.random))
        model.to(torch.bfloat16).save_pretrained(src)
        what = f"random `{args.random}` weights (no trained default model available)"
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size - 1
        calib_rows = torch.randint(0, vocab, (args.calib_samples, seq_len), generator=gen).tolist()
        loss_rows = torch.randint(0, vocab, (args.loss_rows, seq_len), generator=gen).tolist()
        prompts, answers, tok = [torch.randint(0, vocab, (16,), generator=gen).tolist()], None, None
        del model
    else:
        from transformers import AutoTokenizer

        from clover.data import tasks
        from clover.convert.quantize import _records, calibration_tokens

        if not (args.model / "config.json").is_file():
            print(f"bench/quant.py: no model at {args.model} (pass --model DIR or --random clover-small)", file=sys.stderr)
            return 2
        what = f"`{args.model.relative_to(REPO) if args.model.is_relative_to(REPO) else args.model}`"
        src = SCRATCH / "src"  # a bf16 copy: the baseline every ratio is taken against
        CloverForBlockDiffusion.from_pretrained(args.model, dtype=torch.bfloat16).save_pretrained(src)
        for f in args.model.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".index.json")) and f.name != "config.json":
                shutil.copy2(f, src / f.name)
        tok = AutoTokenizer.from_pretrained(src)
        cfg = CloverForBlockDiffusion.config_class.from_pretrained(src)
        heldout, eval_file = args.data / "heldout.jsonl", args.data / "eval_tasks.jsonl"
        if heldout.is_file() and eval_file.is_file():
            # held-out records: the first half gives the loss, the second half calibrates GPTQ
            records = _records(heldout)
            loss_recs, calib_recs = records[: len(records) // 2], records[len(records) // 2 :]
            evals = [json.loads(line) for line in eval_file.read_text().splitlines() if line.strip()]
            data_note = f"held-out data and task prompts from `{args.data.relative_to(REPO) if args.data.is_relative_to(REPO) else args.data}`"
        else:  # regenerate clover/data/build.py's held-out split (seed 1): eval prompts, then loss, then calibration
            held = tasks.generate_split(1, 40 * len(tasks.TASKS) + 4000)
            evals = held[: 40 * len(tasks.TASKS)]
            loss_recs = [{"text": tasks.plain_text(ex)} for ex in held[len(evals) : len(evals) + 2000]]
            calib_recs = [{"text": tasks.plain_text(ex)} for ex in held[len(evals) + 2000 :]]
            data_note = "held-out split regenerated with clover.data.tasks (seed 1)"
        per_task = {}
        evals = [ex for ex in evals if per_task.setdefault(ex["task"], []).append(ex) or len(per_task[ex["task"]]) <= args.eval_per_task]
        loss_rows = calibration_tokens(loss_recs, src, cfg, args.loss_rows, seq_len).tolist()
        calib_rows = calibration_tokens(calib_recs, src, cfg, args.calib_samples, seq_len).tolist()
        prompts = [tasks.plain_prompt(ex) for ex in evals]
        answers = [ex["answer"] for ex in evals]
        what += f"; {data_note}"
    calib = SCRATCH / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in calib_rows))

    quiet = lambda m: None  # noqa: E731
    timing = {}
    for method in ("rtn", "gptq"):
        t0 = time.perf_counter()
        summary = quantize_checkpoint(src, SCRATCH / method, group_size=args.group_size, method=method,
                                      calib=calib if method == "gptq" else None, calib_samples=args.calib_samples,
                                      calib_seq_len=seq_len, notice=quiet)
        timing[method] = (time.perf_counter() - t0, summary)

    folders = {"bf16": src, "int4 RTN": SCRATCH / "rtn", "int4 GPTQ": SCRATCH / "gptq"}
    models = {name: load(f, torch.bfloat16) for name, f in folders.items()}
    models[INT8] = load(folders["int4 RTN"], torch.bfloat16, "int8")
    models_fp32 = {"fp32": load(src, torch.float32), "int4 RTN, fp32 elsewhere": load(SCRATCH / "rtn", torch.float32)}
    bf16_q = bf16_quantisable_bytes(models["bf16"])

    # ---- speed: alternate the models, medians ------------------------------------------------
    speed_models = {"bf16": models["bf16"], "int4 RTN": models["int4 RTN"], INT8: models[INT8], **models_fp32}
    prompt = prompts[0] if tok is None else tok(prompts[0]).input_ids
    for m in speed_models.values():
        decode_once(m, prompt, 8, args.block_size)  # warm up
    runs = {k: [] for k in speed_models}
    seqs = {}
    for _ in range(args.repeats):
        for name, m in speed_models.items():
            dt, seq = decode_once(m, prompt, args.new_tokens, args.block_size)
            runs[name].append((dt, seq.forward_passes))
            seqs[name] = seq
    speed = {}
    for name, r in runs.items():
        dt = statistics.median(x[0] for x in r)
        fw = statistics.median(x[1] for x in r)
        speed[name] = (args.new_tokens / dt, fw, 1000 * dt / fw)

    # ---- quality: weights as stored, everything else in fp32 (isolates the quantisation error) ------
    quality = {}
    for name, folder in {**folders, INT8: folders["int4 RTN"]}.items():
        m = load(folder, torch.float32, "int8" if name == INT8 else "auto")
        diff, ar = heldout_loss(m, loss_rows, args.block_size)
        if answers is not None:  # as recipes/default/evaluate.py: plain prompt, first generated line
            import clover

            outs = []
            for i in range(0, len(prompts), 40):
                outs += clover.generate(m, tok, prompts[i : i + 40], max_new_tokens=48, block_size=args.block_size,
                                        threshold=0.95)
            texts = [o.text.strip().split("\n")[0].strip() for o in outs]
            acc = sum(t == a for t, a in zip(texts, answers)) / len(answers)
            gen_ids = [o.token_ids for o in outs]
        else:
            outs = Engine(m, DecodeConfig(block_size=args.block_size, max_new_tokens=args.new_tokens,
                                          eos_token_ids=())).generate(prompts)
            acc, gen_ids = None, [s.token_ids for s in outs]
        quality[name] = (diff, ar, acc, gen_ids)
        del m
    ref_ids = quality["bf16"][3]

    def agreement(ids):
        same = total = 0
        for a, b in zip(ids, ref_ids):
            total += len(b)
            same += sum(x == y for x, y in zip(a, b))
        return same / max(1, total)

    # ---- report ---------------------------------------------------------------------------------
    g = args.group_size
    print(f"### INT4 weight-only quantisation (group size {g})\n")
    kinds = {p.kind for m in models["int4 RTN"].modules() if isinstance(m, Int4Weight) for p in m._packed or ()}
    kernel = ("clover `clover_cpu::int4_linear` (fp32 activations)" if kinds == {"clover"}
              else "torch `_weight_int4pack_mm_for_cpu` (bf16 activations)")
    print(f"Model: {what}. {torch.get_num_threads()} CPU thread(s); int4 kernel: {kernel}. GPTQ calibration: {args.calib_samples} x {seq_len} "
          f"tokens{'' if args.random else ' from the held-out split'}, {timing['gptq'][0]:.1f} s to quantise "
          f"(RTN {timing['rtn'][0]:.1f} s).\n")
    q8 = {p.kind for m in models[INT8].modules() if isinstance(m, Int4Weight) for p in m._packed or ()} == {"clover_q8"}
    print(f"Column `{INT8}`: the RTN checkpoint on clover's int4 x int8-activation kernel "
          f"(`set_int4_kernel(model, \"int8\")`{'' if q8 else '; NOT built on this CPU, so the same kernel as RTN'}).\n")
    print(f"| | bf16 | int4 RTN | int4 GPTQ | {INT8} |")
    print("|---|---:|---:|---:|---:|")
    d = {k: disk_bytes(f) for k, f in folders.items()}
    print(f"| checkpoint on disk (MB) | {d['bf16'] / 1e6:.2f} | {d['int4 RTN'] / 1e6:.2f} ({d['int4 RTN'] / d['bf16']:.2f}x) "
          f"| {d['int4 GPTQ'] / 1e6:.2f} ({d['int4 GPTQ'] / d['bf16']:.2f}x) | as RTN |")
    s = timing["rtn"][1]
    print(f"| quantised layers on disk (MB) | {s['src_bytes_quantized'] / 1e6:.2f} | {s['quantized_bytes'] / 1e6:.2f} "
          f"({s['quantized_bytes'] / s['src_bytes_quantized']:.3f}x) | same | same |")
    mem = {k: memory(m) for k, m in models.items()}
    print(f"| model in memory (MB) | {mem['bf16'][0] / 1e6:.2f} | {mem['int4 RTN'][0] / 1e6:.2f} "
          f"({mem['int4 RTN'][0] / mem['bf16'][0]:.2f}x) | {mem['int4 GPTQ'][0] / 1e6:.2f} | {mem[INT8][0] / 1e6:.2f} |")
    print(f"| quantised layers in memory (MB) | {bf16_q / 1e6:.2f} | {mem['int4 RTN'][1] / 1e6:.2f} "
          f"({mem['int4 RTN'][1] / bf16_q:.3f}x) | same | {mem[INT8][1] / 1e6:.2f} |")
    print(f"| decode tok/s, batch 1 ({args.new_tokens} tokens, block {args.block_size}) | {speed['bf16'][0]:.1f} | "
          f"{speed['int4 RTN'][0]:.1f} ({speed['int4 RTN'][0] / speed['bf16'][0]:.2f}x) | same kernels as RTN | "
          f"{speed[INT8][0]:.1f} ({speed[INT8][0] / speed['bf16'][0]:.2f}x) |")
    print(f"| ms per forward (TPF) | {speed['bf16'][2]:.1f} ({args.new_tokens / speed['bf16'][1]:.2f}) | "
          f"{speed['int4 RTN'][2]:.1f} ({args.new_tokens / speed['int4 RTN'][1]:.2f}) | | "
          f"{speed[INT8][2]:.1f} ({args.new_tokens / speed[INT8][1]:.2f}) |")
    print(f"| held-out block-diffusion loss, every token (block {args.block_size}; fp32 compute) | " + " | ".join(f"{quality[k][0]:.4f}" for k in models) + " |")
    print("| held-out AR loss, every token (fp32 compute) | " + " | ".join(f"{quality[k][1]:.4f}" for k in models) + " |")
    if answers is not None:
        print(f"| task accuracy ({len(answers)} held-out prompts, greedy) | " +
              " | ".join(f"{100 * quality[k][2]:.1f}%" for k in models) + " |")
    if args.random:
        print("| (random weights: near-flat logits, so any perturbation flips the argmax; losses ~ ln(vocab)) | | | | |")
    print("| generated tokens equal to bf16's | 100% | " +
          " | ".join(f"{100 * agreement(quality[k][3]):.1f}%" for k in ("int4 RTN", "int4 GPTQ", INT8)) + " |")
    same = sum(x == y for a, b in zip(quality[INT8][3], quality["int4 RTN"][3]) for x, y in zip(a, b))
    total = sum(len(b) for b in quality["int4 RTN"][3])
    print(f"| generated tokens equal to int4 RTN's (fp32 activations) | | 100% | | "
          f"{100 * same / max(1, total):.1f}% ({same} of {total}) |")
    print("\nDecode speed by model dtype (the dtype of everything but the int4 matmuls, whose activations are "
          f"{'fp32' if kinds == {'clover'} else 'bf16'} whatever it is); `clover.load` picks fp32 on CPU:\n")
    print("| model | tok/s | ms per forward | vs bf16 | vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for name, (tps, fw, ms) in speed.items():
        print(f"| {name} | {tps:.1f} | {ms:.1f} | {tps / speed['bf16'][0]:.2f}x | {tps / speed['fp32'][0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
