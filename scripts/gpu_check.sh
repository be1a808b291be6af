#!/usr/bin/env bash
# One call on the GPU machine: the test suite on CUDA (compiled kernels), both no-argument main jobs
# (`swiftune sft`, `swiftune grpo` on their built-in defaults), then benchmarks.
# Prints a short table last and writes logs/JSON under $OUT.
#
#   scripts/gpu_check.sh                      # everything
#   scripts/gpu_check.sh tests/test_kernels.py -- kernels losses   # chosen tests, chosen benchmarks
#
# Arguments before `--` are pytest targets (default: tests); after it, benchmark names
# (kernels, losses, sft, longctx, rollout; default: kernels).
set -uo pipefail
OUT=${OUT:-/tmp/swiftune_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Baseline packages missing on the GPU machine (trl, liger-kernel, datasets) travel as wheels
# in .whl/ (see docs/benchmarks.md); install them beside the image's packages.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

tests=(); benches=(); seen_sep=0
for a in "$@"; do
  if [ "$a" = "--" ]; then seen_sep=1; elif [ $seen_sep = 1 ]; then benches+=("$a"); else tests+=("$a"); fi
done
[ ${#tests[@]} = 0 ] && tests=(tests)
[ ${#benches[@]} = 0 ] && [ $seen_sep = 0 ] && benches=(kernels)

python3 - <<'PY' | tee "$OUT/env.txt"
import torch, transformers, triton, peft
print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__} transformers={transformers.__version__} "
      f"triton={triton.__version__} peft={peft.__version__}")
PY

summary=()
if [ "${tests[0]}" != "none" ]; then
  # SIGINT at the limit (PYTEST_LIMIT_S, default 480 s), not SIGKILL: pytest then still prints which tests failed so
  # far (-rf), and the run leaves time for the two main jobs within one 10-minute device call
  timeout -s INT "${PYTEST_LIMIT_S:-480}" python3 -m pytest "${tests[@]}" -rf --maxfail=10 -p no:cacheprovider \
    -W ignore 2>&1 | tee "$OUT/pytest.log" | grep -Ev '^[.sx]+ *\[ *[0-9]+%\]$' | tail -40
  summary+=("pytest: $(tail -1 "$OUT/pytest.log")")
fi
# The README's main jobs, exactly as a user runs them with no arguments, each in a fresh folder.
for job in sft grpo; do
  dir=$(mktemp -d)
  start=$(date +%s)
  (cd "$dir" && timeout 300 python3 -m swiftune.cli "$job") > "$OUT/main_$job.log" 2>&1
  rc=$?
  summary+=("swiftune $job (no arguments): exit $rc in $(( $(date +%s) - start )) s; $(grep -c . "$dir"/swiftune_output/"$job"/metrics.jsonl 2>/dev/null || echo 0) metric rows")
  [ $rc != 0 ] && tail -25 "$OUT/main_$job.log"
done
for b in "${benches[@]}"; do
  timeout 420 python3 -m "benchmarks.$b" --out "$OUT/$b.json" 2>&1 | tee "$OUT/bench_$b.txt" | tail -60
  summary+=("bench $b: exit ${PIPESTATUS[0]}")
done
echo "==================== summary"
cat "$OUT/env.txt"
printf '%s\n' "${summary[@]}"
for b in "${benches[@]}"; do grep -A20 "^kernel\|^tokens\|^mode" "$OUT/bench_$b.txt" 2>/dev/null | head -20; done
