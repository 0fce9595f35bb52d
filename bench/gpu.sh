#!/usr/bin/env bash
# One prepared run for a CUDA machine (one H200 is the likely kind), under 8 minutes:
#   1. the CUDA tests (tests/test_cuda.py: eager CUDA == CPU, compiled CUDA graphs == eager with no
#      recompilation, int4 CUDA kernel == reference; tests/test_distributed_cuda.py skips below 2 GPUs);
#   2. the default model's step times on the GPU, eager vs compiled (mode="reduce-overhead": CUDA graphs);
#   3. the clover-35b-a3b dims with random bf16 weights: AR step and 32-token block step, eager and
#      compiled, and the tokens/s they project at TPF tokens per forward against the announced 515 tok/s.
#   4. (only when STEPS names it: its time on a GPU is unmeasured) `clover tune --dry-run` on the
#      held-out task prompts: low_confidence tokens/s against ar on this GPU, eager and compiled, the
#      ratio issue #24 asks for (>= 1.3x), blocked on CPUs where a block step costs 1.8-2.5x an AR step.
# It prints one table at the end to paste into BENCHMARKS.md (with the commands above it).
#
#   bash bench/gpu.sh            # on the GPU machine: steps tests,small,big
#   STEPS=tune bash bench/gpu.sh # step 4 alone (a second call: the device time per call is limited)
#   bash bench/gpu.sh --dry-run  # every step at toy sizes on the CPU (checks the script itself)
#
# TPF (tokens per forward of low_confidence at block 32) defaults to 1.53, the measured figure in
# BENCHMARKS.md for the default model; set TPF=... for a trained model's own figure.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TPF=${TPF:-1.53}
OUT=${OUT:-$(mktemp -d)}
if [[ "${1:-}" == "--dry-run" ]]; then
  DEV=cpu; DTYPE=float32; PRESET=clover-tiny; SMALL_SIZES=1,4; BIG_SIZES=1,8; REPEATS=2; RUNNERS=eager
  TESTS="tests/test_cuda.py"; STEPS=${STEPS:-tests,small,big,tune}
  TUNE="--sizes 4 --thresholds 0.8 --per-task 1 --rounds 1"
else
  DEV=cuda; DTYPE=bfloat16; PRESET=clover-35b-a3b; SMALL_SIZES=1,8,16,32; BIG_SIZES=1,32; REPEATS=20
  RUNNERS=eager,compiled; TESTS="tests/test_cuda.py tests/test_distributed_cuda.py"; STEPS=${STEPS:-tests,small,big}
  TUNE="--sizes 4,8,32 --thresholds 0.8,0.95 --per-task 10 --rounds 2"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore
status=0

step() { [[ ",$STEPS," == *",$1,"* ]]; }

if step tests; then
  echo "== 1. CUDA tests"
  timeout 240 $PY -m pytest -q $TESTS 2>&1 | tail -5 | tee "$OUT/tests.txt" || status=1
fi

if step small; then
  echo "== 2. default model, fp32, eager vs compiled"
  timeout 150 $PY bench/step.py --device "$DEV" --sizes "$SMALL_SIZES" --repeats "$REPEATS" --runners "$RUNNERS" \
    > "$OUT/small.md" 2>"$OUT/small.err" || { status=1; tail -5 "$OUT/small.err"; }
  cat "$OUT/small.md"
fi

if step big; then
  for runner in ${RUNNERS//,/ }; do  # one process each: a compile that runs out of time keeps eager's figures
    echo "== 3. $PRESET dims, random $DTYPE weights, $runner"
    timeout 150 $PY bench/step.py --device "$DEV" --dtype "$DTYPE" --preset "$PRESET" --sizes "$BIG_SIZES" \
      --repeats "$REPEATS" --runners "$runner" > "$OUT/big-$runner.md" 2>"$OUT/big-$runner.err" \
      || { status=1; tail -5 "$OUT/big-$runner.err"; }
    cat "$OUT/big-$runner.md"
  done
fi

if step tune; then
  for runner in ${RUNNERS//,/ }; do  # eager first: a compiled run that runs out of time keeps eager's curve
    echo "== 4. default model, task prompts, low_confidence vs ar, $runner: clover tune --dry-run $TUNE"
    timeout 240 $PY -m clover tune --device "$DEV" --runner "$runner" $TUNE --dry-run > "$OUT/tune-$runner.md" \
      2>"$OUT/tune-$runner.err" || { status=1; tail -5 "$OUT/tune-$runner.err"; }
    cat "$OUT/tune-$runner.md"
  done
fi

echo "== table (paste into BENCHMARKS.md)"
$PY - "$OUT" "$TPF" "$PRESET" "$BIG_SIZES" "$RUNNERS" "$STEPS" <<'EOF'
import pathlib, sys
out, tpf, preset, sizes = pathlib.Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
runners, steps = sys.argv[5].split(","), sys.argv[6].split(",")
print(f"tests: {(out / 'tests.txt').read_text().strip().splitlines()[-1] if (out / 'tests.txt').exists() else 'not run'}\n")
names = (["small"] if "small" in steps else []) + [f"{s}-{r}" for s in ("big", "tune") if s in steps for r in runners]
for name in names:
    text = (out / f"{name}.md").read_text() if (out / f"{name}.md").exists() else ""
    if name.startswith("tune"):  # clover tune's own lines: the machine, ar's rate, the curve, the pick
        print(f"{name}:\n\n{text}" if text else f"{name}: no output\n")
        continue
    rows = [line for line in text.splitlines() if line.startswith("|")]
    print(text.splitlines()[0] if text else f"{name}: no output", "\n")
    print("\n".join(rows) + "\n")
    if name.startswith("big") and rows:
        print(f"| {preset} projected tok/s (batch 1, TPF {tpf} at block {sizes[-1]}; AR at TPF 1) | AR | block |")
        print("|---|---:|---:|")
        for line in rows[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] == name[4:]:
                ar, block = float(cells[1]), float(cells[-1])
                print(f"| {cells[0]} | {1e3 / ar:.0f} | {tpf * 1e3 / block:.0f} (announced: 515 on H200) |")
EOF
exit $status
