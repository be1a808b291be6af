#!/usr/bin/env bash
# Several parts of scripts/gpu_suite.sh one after another, detached from the device call that starts them, so that
# a chain longer than one 10-minute call runs while later calls poll it (an idle machine is given back after
# 30 s: poll back to back). Each part's output goes to $CHAIN/<n>-<part>/ and its log to $CHAIN/<n>-<part>.log;
# $CHAIN/ALLDONE appears when the last part has ended; `wait` polls and packs $CHAIN into $OUT/chain.tgz.
#
#   scripts/gpu_chain.sh start "check-none" "grpo-65k-attn 36" "qlora-sft-untiled"   # then, in the same call:
#   (start --beside-check PART...: both no-argument main jobs run in the foreground beside the chain, to $OUT/check,
#    then the offloading, FP8 and generate tests on CUDA)
#   scripts/gpu_chain.sh wait 540                                                    # and in each later call
#
# A part is a gpu_suite.sh part with its arguments in one word ("grpo-65k-attn 36"); "check-none" runs
# scripts/gpu_check.sh none -- (both no-argument main jobs). CHAIN defaults to /tmp/chain.
set -uo pipefail
cd "$(dirname "$0")/.."
export CHAIN=${CHAIN:-/tmp/chain}
OUT=${OUT:-/tmp/swiftune_out}

case "${1:?start PART... | wait SECONDS}" in
  start)
    shift
    beside_check=0
    if [ "${1:-}" = "--beside-check" ]; then beside_check=1; shift; fi
    [ $# -gt 0 ] || { echo "gpu_chain.sh start: name at least one part" >&2; exit 2; }
    if [ -d "$CHAIN" ] && [ ! -f "$CHAIN/ALLDONE" ]; then
      echo "gpu_chain.sh: a chain is still running in $CHAIN (no ALLDONE): poll it with 'wait'" >&2; exit 2
    fi
    rm -rf "$CHAIN" && mkdir -p "$CHAIN"
    printf '%s\n' "$@" > "$CHAIN/parts.txt"
    # the parts run from their own copy of the tree: every device call replaces the working tree's files and
    # carried folders, and a part whose working directory or imports were under them failed mid-run (Unsloth's
    # anchor, run in .shared/, lost its working directory: "FileNotFoundError" in inspect.getabsfile)
    rm -rf "$CHAIN.tree" && mkdir -p "$CHAIN.tree"
    tar cf - --exclude=./.git . | tar xf - -C "$CHAIN.tree"
    cd "$CHAIN.tree"
    setsid nohup bash -c '
      n=0
      while IFS= read -r part; do
        n=$((n + 1)); name="$n-${part%% *}"; start=$(date +%s)
        if [ "$part" = check-none ]; then
          OUT="$CHAIN/$name" scripts/gpu_check.sh none -- > "$CHAIN/$name.log" 2>&1
        else
          # shellcheck disable=SC2086  # the part and its arguments are one word on purpose
          OUT="$CHAIN/$name" scripts/gpu_suite.sh $part > "$CHAIN/$name.log" 2>&1
        fi
        echo "$name: exit $? in $(( $(date +%s) - start )) s" >> "$CHAIN/status.txt"
      done < "$CHAIN/parts.txt"
      touch "$CHAIN/ALLDONE"' > "$CHAIN/chain.log" 2>&1 < /dev/null &
    echo "chain started in $CHAIN: $*"
    if [ $beside_check = 1 ]; then
      # both no-argument main jobs in the foreground, beside the chain, from a copy of the tree without the
      # wheels (the chain's first part installs them into /tmp/site; a second install there could race it)
      sleep 40
      rm -rf /tmp/chk && mkdir -p /tmp/chk
      tar cf - --exclude=./.whl --exclude=./.shared --exclude=./.git . | tar xf - -C /tmp/chk
      (cd /tmp/chk && PYTHONPATH=/tmp/site OUT="$OUT/check" scripts/gpu_check.sh none --)
      # then the CUDA tests of the offloaded checkpointing, FP8 and swiftune generate (small: beside a trial capped
      # at its GPU budget), cut at 240 s so that the call ends within its 10 minutes
      (cd /tmp/chk && PYTHONPATH="$PWD/src:$PWD:/tmp/site" timeout -s INT 240 python3 -m pytest -rf \
        tests/test_checkpointing.py tests/test_attention_outputs.py tests/test_fp8.py tests/test_generate_cli.py \
        -p no:cacheprovider -p no:warnings 2>&1 | tail -15 | tee "$OUT/check/beside_tests.txt")
    fi ;;
  wait)
    [ -d "$CHAIN" ] || { echo "gpu_chain.sh: no chain in $CHAIN (a fresh machine? start it again)" >&2; exit 3; }
    limit=${2:-540}
    for _ in $(seq $((limit / 10))); do [ -f "$CHAIN/ALLDONE" ] && break; sleep 10; done
    cat "$CHAIN/status.txt" 2>/dev/null
    [ -f "$CHAIN/ALLDONE" ] && echo "ALLDONE" || echo "still running: $(ls "$CHAIN" | grep -c '^[0-9][0-9]*-.*\.log$') parts started"
    mkdir -p "$OUT" && tar czf "$OUT/chain.tgz" -C "$(dirname "$CHAIN")" "$(basename "$CHAIN")" ;;
  *)
    echo "gpu_chain.sh: start PART... | wait SECONDS" >&2; exit 2 ;;
esac
