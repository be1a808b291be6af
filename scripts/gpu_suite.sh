#!/usr/bin/env bash
# The benchmark suite of docs/benchmarks.md in parts meant to fit one 10-minute device call each
# (the minutes below are estimates from the runs so far; every part stops itself before 10 min).
# Run from the repository root on the GPU machine (with .whl/ carried for the TRL / Liger baselines):
#
#   scripts/gpu_suite.sh parity-figures # detached: CUDA tests (parity, kernels, engine, attention, GRPO, checkpointing),
#                                     # both no-argument jobs, the kernel table, SFT batch 16 / 16K rows (swiftune vs
#                                     # TRL + Liger) and GRPO 2 x 65,536 (~14 min); poll with parity-figures-wait
#   scripts/gpu_suite.sh check        # CUDA tests: engine, attention, GRPO, kernels, checkpointing (~4.5 min)
#   scripts/gpu_suite.sh rollout      # engine vs generate, Qwen3-1.7B + 8B, G 8/64, N 1024, fused-layers A/B (~7 min)
#   scripts/gpu_suite.sh rollout-long # the N=8192 rows, no baselines (~6 min)
#   scripts/gpu_suite.sh grpo-e2e [MODEL] [MODE...] # one whole GRPOTrainer step (8 prompts x G=8, 4K completions): swiftune, TRL, Unsloth (or the MODEs), detached (carry .shared; at 1.7B swiftune ~2 min, TRL ~17): then grpo-e2e-wait
#   scripts/gpu_suite.sh grpo-e2e-run [MODEL] [MODE...] # the same in the foreground (for gpu_chain.sh; default swiftune and Unsloth)
#   scripts/gpu_suite.sh grpo-step    # GRPO steps, Qwen3-1.7B, G=8, 4K completions, 2nd reported (~3 min)
#   scripts/gpu_suite.sh sft-8b       # SFT batch sweep 1..32, Qwen3-8B, every mode (~9 min)
#   scripts/gpu_suite.sh sft-small    # the sweep for Qwen3-0.6B and 1.7B, batch-size modes (~8 min)
#   scripts/gpu_suite.sh sft-llama    # the sweep for the Llama-3-8B shape (~9 min)
#   scripts/gpu_suite.sh sft-unsloth [MODEL] # SFT Qwen3-8B batch 16: swiftune (+ its PEFT-LoRA A/B), TRL + Liger, Unsloth (carry .shared; ~8 min)
#   scripts/gpu_suite.sh unsloth-flow # Unsloth's SFT notebook flow through Unsloth and through swiftune, per-step losses compared (carry .shared; ~4 min)
#   scripts/gpu_suite.sh qlora-sft    # QLoRA SFT Qwen3-8B: swiftune, TRL + Liger, Unsloth --4bit, and a 24 GB budget (carry .shared; ~10 min)
#   scripts/gpu_suite.sh fp8-sft      # FP8 base weights vs bf16, Qwen3-8B SFT: swiftune batch 16 and 16K-token micro-batches, both in one call (~7 min)
#   scripts/gpu_suite.sh fp8-curves   # FP8 vs bf16 base: 200-step SFT loss curve (Qwen3-0.6B, same rows) and the built-in GRPO task's reward curve (~8 min)
#   scripts/gpu_suite.sh fp8-reward   # only fp8-curves' GRPO reward curve (~4.5 min)
#   scripts/gpu_suite.sh fp8-grpo     # GRPO's largest completion per row, Qwen3-8B, G=2, on a 24 GB budget: bf16 base, then FP8 base, each around the planner's answer (~6 min)
#   scripts/gpu_suite.sh sft-deferred # the graphed batch-16 step's device idle gaps and tok/s with the NaN/inf guards' per-step syncs vs deferred, Qwen3-8B (~8 min)
#   scripts/gpu_suite.sh fp8-graphs   # FP8 base weights with graphed decoder layers vs eager, and bf16 graphed, Qwen3-8B batch 16 (~7 min)
#   scripts/gpu_suite.sh qlora-sft-offload # QLoRA SFT batch 16: swiftune with / without the layer inputs on the host, Unsloth --4bit (carry .shared; ~9 min)
#   scripts/gpu_suite.sh qlora-rollout # the engine decoding from NF4 weights, Qwen3-8B, G 8/64, N 1024, vs generate on the same 4-bit model (~5 min)
#   scripts/gpu_suite.sh qlora-rollout-nf4 # the NF4 decode kernel: its CUDA tests, its matmul table vs bitsandbytes and its settings sweep, the engine with it vs bitsandbytes' path, Qwen3-8B, G 8/16/64 (~9 min; carry .whl with bitsandbytes)
#   scripts/gpu_suite.sh qlora-rollout-dense # the engine from NF4 weights dequantised once per call vs per step, Qwen3-8B, G 8/64 (~5 min; carry .whl)
#   scripts/gpu_suite.sh qlora-rollout-nf4-64 # the NF4 kernel to 64 rows: tests, matmul table 1-64 rows, the engine at G=32/64 bound to 64 vs 16 rows (~8 min; carry .whl)
#   scripts/gpu_suite.sh fp8-rollout  # the engine decoding from FP8 weights (weight-only kernel at <= 16 rows, _scaled_mm above) vs from bf16 in the same call, Qwen3-8B, G 8/64, N 1024; the FP8 kernels' CUDA tests and decode matmul microbenchmark first (~8 min)
#   scripts/gpu_suite.sh fp8-g64      # the G=64 decode step, Qwen3-8B: bf16, then FP8 (engine defaults, FP8 KV cache), one call (~4 min)
#   scripts/gpu_suite.sh fp8-dot      # the FP8 x FP8 decode kernel (17-64 rows): its tests compiled (Qwen3-8B projections, graph replay == eager), then the decode matmul table with its columns and sweep (~3 min)
#   scripts/gpu_suite.sh moe-rollout  # the engine on Qwen3-30B-A3B and Mixtral-8x7B, G 8/64, N 1024, against the HBM floor of the routed experts + the rest + KV, and LoRA r=16 (experts included) at G=8 on the 30B; the MoE engine's CUDA tests first (~7-8 min)
#   scripts/gpu_suite.sh gptoss-rollout # gpt-oss on the engine (sinks, sliding/full layers, YaRN): its CUDA tests, then the gpt-oss-20b shape, G 8/64, N 1024, vs the HBM floor of its routed experts + the rest + KV, and LoRA r=16 at G=8 (~6 min; apart from moe-rollout, which fills its 10-minute call)
#   scripts/gpu_suite.sh gptoss-decode # the decode kernels on gpt-oss's experts: tests compiled, one layer vs grouped GEMM, the engine's G 8/64 rows (~7 min)
#   scripts/gpu_suite.sh moe-decode-cap # the decode kernels' cap: tests compiled, Qwen3-30B-A3B G=64 at caps 16 / 64, gpt-oss-20b G=64 at its default (~7 min)
#   scripts/gpu_suite.sh qlora-grpo   # GRPO largest completion, Qwen3-8B QLoRA on an 80 GB budget, detached (~20+ min): then qlora-grpo-wait
#   scripts/gpu_suite.sh pieces-tests # the projected-pieces tests on CUDA (~1 min)
#   scripts/gpu_suite.sh offload-tests # the offloaded checkpointing's and kept attention outputs' tests on CUDA (~1-2 min)
#   scripts/gpu_suite.sh cli-fp8-tests # the FP8 and generate command tests on a GPU (~2 min)
#   scripts/gpu_suite.sh loss-tests   # the chunked losses' CUDA tests, the offloaded log-prob hidden states in pinned blocks (~1 min)
#   scripts/gpu_suite.sh qlora-grpo-at C... # the same at fixed completion lengths, in the foreground (for gpu_chain.sh; ~12-15 min near 330K)
#   scripts/gpu_suite.sh qlora-grpo-cut LAYERS GPU_GB HOST_GB C... # that trial on the first LAYERS layers, launches synchronous (a crash's repro, ~1-2 min)
#   scripts/gpu_suite.sh qlora-grpo-unshared-at C... # the same with the prompt copied before each completion (no --share-prompt)
#   scripts/gpu_suite.sh qlora-grpo-profile-at C # one shared trial with what is alive at its peak, by allocation site (~5-6 min when it fails)
#   scripts/gpu_suite.sh sft-memory   # what is alive at the peak: Qwen3-8B, batch 16 / 16K tokens (~4 min)
#   scripts/gpu_suite.sh sft-chunk    # the fused loss chunk: auto / 1,024 / 2,048 tokens, Qwen3-0.6B batch 8-32, 8B batch 16 (~5 min)
#   scripts/gpu_suite.sh sft-overhead # device time vs wall time of the Qwen3-8B step (batch 16), and the host's
#                                     # time by library in the 8B and 0.6B steps (~6 min)
#   scripts/gpu_suite.sh sft-unsloth-graphs [MODEL] # batch 16: swiftune eager + graphed, TRL + Liger, Unsloth, GPU busy of a graphed step (carry .shared; ~9.5 min)
#   scripts/gpu_suite.sh sft-graphs-memory [MODEL] # batch 16 graphed at <= Unsloth's peak: Unsloth, then swiftune graphed with 256-token loss chunks, and on an 18.4 GB budget (carry .shared; ~9 min)
#   scripts/gpu_suite.sh sft-untiled [MODEL] # batch 16 and the 16K-token row on 20.7 GB with the MLP untiled, beside Unsloth (carry .shared; ~9.5 min)
#   scripts/gpu_suite.sh sft-16k-fit [MODEL] # the 16K-token row on a 20.7 GB budget (Unsloth's packed peak), partial offload, beside Unsloth (carry .shared; ~9 min)
#   scripts/gpu_suite.sh sft-graphs   # graphed decoder layers: CUDA tests, Qwen3-8B batch 16 and 16K-token A/B (~9 min)
#   scripts/gpu_suite.sh sft-full     # full fine-tuning (no LoRA), Qwen3-0.6B, batch 16, every mode (~3 min)
#   scripts/gpu_suite.sh loss-curve   # 200 steps packed vs padded, Qwen3-0.6B (~5 min)
#   scripts/gpu_suite.sh small-rows   # loss-curve + sft-full in one call (~8 min)
#   scripts/gpu_suite.sh longctx [MODEL] # largest row that fits with offload, to 5% from the planner's answer (~3-4 min when its two trials bracket it; detached, then longctx-wait)
#   scripts/gpu_suite.sh longctx-single [MODEL] [TOKENS] # one sequence (default Llama-3-8B, 409,600), detached: then longctx-wait
#   scripts/gpu_suite.sh longctx-memory [MODEL] [TOKENS] # what is alive at the peak of a step (default 131,072 tokens, ~1 min)
#   scripts/gpu_suite.sh longctx-overhead # offload cost: GPU vs host checkpoints, 8K/32K, 3 steps (~3 min)
#   scripts/gpu_suite.sh longctx-sweep    # peak memory 8K..400K: baseline, GPU ckpt, budgeted offload (~7 min)
#   scripts/gpu_suite.sh attention    # packed attention backends at 2 x 32K / 1 x 128K: time, memory, kernel (~1 min)
#   scripts/gpu_suite.sh kernels      # kernel microbenchmarks vs eager and torch.compile (~1.5 min)
#   scripts/gpu_suite.sh verify       # check + kernels + GRPO step, fused layers off/on (~8 min)
#   scripts/gpu_suite.sh grpo-bisect  # longest completion per row, Qwen3-8B, swiftune (~9 min; resumable)
#   scripts/gpu_suite.sh grpo-bisect-base # the same for transformers, TRL, TRL + Liger (~9 min)
#   scripts/gpu_suite.sh grpo-65k     # the 2 x 65,536 comparison: TRL vs swiftune (every checkpoint on the host), 2 steps each (~6 min)
#   scripts/gpu_suite.sh grpo-65k-attn [LAYERS...] # 2 x 65,536 with the sdpa outputs kept through the recompute (0 / 36 layers), then Unsloth's anchor (carry .shared; ~12 min: through scripts/gpu_chain.sh)
#   scripts/gpu_suite.sh grpo-65k-host [MODEL] # 2 x 65,536, every layer keeping their sdpa outputs in pinned host memory, then on the GPU, Unsloth's anchor, and a device-time profile of the GPU-kept step (carry .shared; ~15 min: through scripts/gpu_chain.sh)
#   scripts/gpu_suite.sh sft-graphs-host [MODEL] # graphed batch 16 with the layer inputs on the host, beside graphed and Unsloth (~10 min)
#   scripts/gpu_suite.sh sft-graphs-host-ab [MODEL [STEPS]] # the same without Unsloth, 50 steps a mode, after the graphs' CUDA tests (~6 min)
#   scripts/gpu_suite.sh moe-sft [STEPS] [MODEL...] # SFT batch 16 on Qwen3-30B-A3B and gpt-oss-20b: swiftune, TRL padding-free, TRL + Liger (~9 min)
#   scripts/gpu_suite.sh gptoss-grpo-at GB|whole C... # swiftune's gpt-oss-20b GRPO trials at fixed completions, foreground (for gpu_chain.sh; ~7+ min a trial)
#   scripts/gpu_suite.sh gptoss-grpo-trl GB|whole # TRL's loss path on gpt-oss-20b bisected on that budget (~3 min)
#   scripts/gpu_suite.sh decode-attention-ab # the engine's decode attention, SDPA vs the split kernel, Qwen3-8B G 8/64, Qwen3-30B-A3B and gpt-oss-20b G 8, profiled, with the new kernels' CUDA tests (~10 min: through scripts/gpu_chain.sh)
#   scripts/gpu_suite.sh moe-decode-defaults # Qwen3-30B-A3B and gpt-oss-20b decode at G 8 / 64 with the engine's defaults, profiled (~4 min)
#   scripts/gpu_suite.sh fp8-stacked-ab # Qwen3-8B FP8 decode, q/k/v as one product vs three, G 8 / 64, profiled, with its CUDA tests (~6 min)
#   scripts/gpu_suite.sh fp8-stacked-gate-up-ab # Qwen3-8B FP8 decode, gate/up as one product vs two, bf16 beside, G 8 / 64, profiled, with CUDA tests (~7 min)
#   scripts/gpu_suite.sh fp8-norm-kv-ab # Qwen3-8B G=64: bf16, FP8 with / without the norms making the codes, and with the FP8 KV cache, profiled, with CUDA tests (~8 min)
#   scripts/gpu_suite.sh lora-decode-ab # Qwen3-8B FP8 runtime LoRA at G 8 / 64: the two-launch adapter product (the default) against the ops, bf16 beside (~8 min)
#   scripts/gpu_suite.sh decode-attention-tune # the split decode attention's launch settings swept at G 8 / 64, bf16 / FP8 caches, with its CUDA tests (~4 min)
#   scripts/gpu_suite.sh lora-decode-quick # the same cut to G=8 FP8 only, 512 tokens, with the kernels' CUDA tests (~4 min)
#   scripts/gpu_suite.sh fp8-kv-ab   # Qwen3-8B FP8 decode, the FP8 KV cache vs bf16 cache, bf16 beside, G 8 / 64, profiled, with CUDA tests (~8 min)
#   scripts/gpu_suite.sh moe-cap-ab # Qwen3-30B-A3B G=64: the decode kernels up to 64 tokens against the cap of 16, profiled (~4 min)
#   scripts/gpu_suite.sh moe-routing-ab # Qwen3-30B-A3B decode with torch's routing ops, the router kernel, and the route kernels too, G 8 / 64, profiled (~7 min)
#   scripts/gpu_suite.sh moe-sft-experts # moe-sft's gpt-oss-20b row with the experts adapted as well (PEFT target_parameters, every mode; ~3 min)
#   scripts/gpu_suite.sh fp8-glu-codes-ab # FP8 decode at G 8 / 64 with the MLP activation making down_proj's codes against the separate quantiser, profiled; its CUDA tests first (~5 min)
#   scripts/gpu_suite.sh grpo-65k-profile [MODEL] # the 2 x 65,536 GRPO step (inputs and kept attention outputs on the host) with its device-time profile and idle gaps (~4 min)
#   scripts/gpu_suite.sh sft-bisect [MODEL] [STEPS] # one swiftune SFT row per revision in .bisect/ (scripts/bisect_sources.sh REV...; carry .bisect), each with its time profile (~80 s a revision)
#   scripts/gpu_suite.sh gptoss-grpo [GB] # GRPO largest completion, gpt-oss-20b, G=2, 80 GB budget: TRL bisected, swiftune at the planner's answer, detached (~15-20 min): then gptoss-grpo-wait
#   scripts/gpu_suite.sh qlora-sft-untiled # QLoRA SFT batch 16, layer inputs on the host and the MLP untiled, beside Unsloth --4bit (carry .shared; ~9 min)
#   scripts/gpu_suite.sh qlora-sft-16k # QLoRA SFT 16K-token batches, inputs on the host, MLP untiled, beside Unsloth --4bit packed (carry .shared; ~7 min)
#   scripts/gpu_suite.sh qlora-grpo-unsloth [START] [SECONDS] [REPEATS] # Unsloth --4bit's largest GRPO completion on an 80 GB budget, G=2, scanned to 5% from START (carry .shared; ~9 min)
#   scripts/gpu_suite.sh qlora-grpo-unsloth-at C... # Unsloth --4bit GRPO trials at fixed completions, 80 GB budget (carry .shared)
#   scripts/gpu_suite.sh sft-deferred-busy # the graphed batch-16 step with the deferred check: profiled (with token slots), then timed with a sync each step and as one window (~11 min: through scripts/gpu_chain.sh)
#   scripts/gpu_suite.sh grpo-3x      # swiftune at 2 x 294,912 (3x TRL's 2 x 98,304), detached: poll with grpo-3x-wait (~10+ min)
#   scripts/gpu_suite.sh grpo-edge [C...] # GRPO's largest completion: the planner's answer +2% / -2.5% (or the lengths C), detached (~17+ min): then grpo-edge-wait
#   scripts/gpu_suite.sh grpo-pair C0 C1 # (kind nvidia-h200-x2) two GRPO trials side by side, one per GPU, host capped as on one H200; then grpo-pair-wait
#   scripts/gpu_suite.sh grpo-profile # device time by kind of kernel, 2 x 32,768: TRL, swiftune shared-prompt rows (sdpa), unshared rows (~4.5 min)
#   scripts/gpu_suite.sh grpo-memory  # what is alive at the peak of a GRPO step, 2 x 65,536 and 2 x 131,072 (~8 min)
#   scripts/gpu_suite.sh longctx-trl [MODEL] # TRL + Liger's largest single sequence, bisected (~9 min)
#   scripts/gpu_suite.sh vl-sft       # Qwen3-VL-8B SFT on image-text rows (448x448), batch 16: swiftune vs TRL 1.16's VLM SFTTrainer (carry .whl with TRL; ~5-8 min)
#   scripts/gpu_suite.sh vl-gpu-tests # the Qwen3-VL tests not yet run on a GPU: GRPO parity, batched rollouts, VisionFastRolloutEngine (~5 min)
#   scripts/gpu_suite.sh vl-grpo [BUDGET_GB] [ARGS...] # Qwen3-VL-8B QLoRA GRPO on image prompts, G=2: step at 2 x 32,768, then the largest completion per row on a 24 GB budget (carry .whl with bitsandbytes; ~9 min; resumable with --bisect-lo/--bisect-hi)
#
# Each part writes JSON and logs under $OUT and prints its table last; `python -m benchmarks.plots` turns
# the JSON into the PNGs of docs/plots.
set -uo pipefail
OUT=${OUT:-/tmp/swiftune_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), torch.__version__, transformers.__version__)" \
  | tee "$OUT/env.txt"

run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.txt, stop at SECONDS
  local name=$1 limit=$2; shift 2
  # warnings dropped, but not pytest's summary line ("N passed, M warnings")
  timeout "$limit" "$@" 2>&1 | awk '!/[Ww][Aa][Rr][Nn]/ || /passed|failed|error/' | tee "$OUT/$name.txt" | tail -30
  echo "== $name: exit ${PIPESTATUS[0]}"
}

detach() {  # detach NAME COMMAND...: run in the background, outliving this call; output in /tmp/NAME.log
  local name=$1; shift
  rm -f "/tmp/$name.json" "/tmp/$name.rows.jsonl"  # a warm machine keeps /tmp: wait_for must not find the previous run's result
  setsid nohup "$@" > "/tmp/$name.log" 2>&1 < /dev/null &
}

wait_for() {  # wait_for NAME TRIES LINES [DONE]: until /tmp/NAME.json (or the file DONE) exists (10 s a try), then
  # the log's last LINES lines, and NAME's files to $OUT
  local name=$1 tries=$2 lines=$3 done=${4:-/tmp/$1.json}
  for _ in $(seq "$tries"); do [ -f "$done" ] && break; sleep 10; done
  tail -"$lines" "/tmp/$name.log"; cp /tmp/"$name".* "$OUT/" 2>/dev/null
}

rollout_g64_bf16_fp8() {  # issue 26's G=64 decode step, Qwen3-8B: bf16, then FP8 (engine defaults, FP8 KV cache)
  run rollout_g64_bf16 110 python3 -m benchmarks.rollout --model qwen3-8b --rows 64 --new-tokens 1024 \
    --no-baselines --no-checks --time-budget 95 --out "$OUT/rollout_g64_bf16.json"
  run rollout_g64_fp8 120 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 --new-tokens 1024 \
    --no-baselines --no-checks --kv-cache-dtype fp8 --time-budget 105 --out "$OUT/rollout_g64_fp8.json"
}

part=${1:?"which part? see the header of $0"}
case "$part" in
  parity-figures)
    detach parity_figures bash -c '
      set -x
      OUT=/tmp/pf scripts/gpu_check.sh tests/test_gradient_parity.py tests/test_training_parity.py tests/test_kernels.py \
        tests/test_engine.py tests/test_attention.py tests/test_grpo.py tests/test_checkpointing.py tests/test_grpo_parity.py \
        -k "gpu or cuda or thirty or flex or add_rms or decode_qkv or derived or skips" -- kernels > /tmp/pf_check.log 2>&1
      timeout 400 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
        --modes swiftune swiftune_budget trl_liger --out /tmp/pf/sft_qwen3-8b_b16.json > /tmp/pf_sft.log 2>&1
      timeout 300 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
        --share-prompt --swiftune-checkpointing offload_all --completion-lengths 65536 --fixed-only --trial-repeats 2 \
        --time-budget 280 --out /tmp/pf/grpo_65k_swiftune.json > /tmp/pf_grpo.log 2>&1
      echo "{}" > /tmp/parity_figures.json'
    wait_for parity_figures 50 5; cp /tmp/pf_*.log "$OUT/" 2>/dev/null; cp /tmp/pf/*.json /tmp/pf/*.log "$OUT/" 2>/dev/null
    tail -15 /tmp/pf_check.log ;;
  parity-figures-wait)
    wait_for parity_figures 54 5; cp /tmp/pf_*.log "$OUT/" 2>/dev/null; cp /tmp/pf/*.json /tmp/pf/*.log "$OUT/" 2>/dev/null
    tail -15 /tmp/pf_check.log; tail -20 /tmp/pf_sft.log; tail -12 /tmp/pf_grpo.log ;;
  check)
    run pytest 300 python3 -m pytest tests/test_engine.py tests/test_attention.py tests/test_grpo.py tests/test_kernels.py \
      tests/test_checkpointing.py -k "cuda or gpu or flex or auto or add_rms or decode_qkv or derived or skips" \
      -p no:cacheprovider ;;
  rollout)
    run rollout 560 python3 -m benchmarks.rollout --model qwen3-1.7b qwen3-8b --new-tokens 1024 --ab-fused-rows 8 \
      --time-budget 500 --out "$OUT/rollout.json" ;;
  rollout-long)
    run rollout_long 560 python3 -m benchmarks.rollout --model qwen3-1.7b qwen3-8b --new-tokens 8192 \
      --no-baselines --no-checks --lora-rows --time-budget 500 --out "$OUT/rollout_long.json" ;;
  grpo-e2e)  # what a GRPO user waits for, each tool in its own process, 2 steps, the 2nd reported; detached.
    # Usage: grpo-e2e [MODEL] [MODE...] (default qwen3-1.7b, all three tools; TRL's two steps take ~15 min at 1.7B)
    model=${2:-qwen3-1.7b}
    modes=("${@:3}"); [ ${#modes[@]} -gt 0 ] || modes=(swiftune trl unsloth)
    detach grpo_e2e python3 -m benchmarks.grpo_e2e --model "$model" --modes "${modes[@]}" --shared .shared \
      --out /tmp/grpo_e2e.json
    wait_for grpo_e2e 54 12 /tmp/grpo_e2e.rows.jsonl ;;  # its JSON is rewritten after every tool; the rows come last
  grpo-e2e-wait)
    wait_for grpo_e2e 56 12 /tmp/grpo_e2e.rows.jsonl ;;
  grpo-e2e-run)  # grpo-e2e in the foreground, for gpu_chain.sh: grpo-e2e-run MODEL MODE... (swiftune ~2 min at 1.7B,
    # Unsloth's two steps ~16 min, stopped at 25 min)
    model=${2:-qwen3-1.7b}
    modes=("${@:3}"); [ ${#modes[@]} -gt 0 ] || modes=(swiftune unsloth)
    run grpo_e2e 1500 python3 -m benchmarks.grpo_e2e --model "$model" --modes "${modes[@]}" --shared .shared \
      --out "$OUT/grpo_e2e.json" ;;
  grpo-e2e-unsloth-probe)  # Unsloth's GRPOTrainer on a short workload (2 prompts x G=8, 512-token completions, one
    # step) with synchronous launches, so that a device-side assertion's traceback names the statement that
    # launched it (its 4,096-token run ended on a gather index out of bounds after ~8 min; ~3 min)
    run grpo_e2e_unsloth_probe 280 env CUDA_LAUNCH_BLOCKING=1 python3 -m benchmarks.grpo_e2e --model qwen3-1.7b \
      --modes unsloth --prompts 2 --completion-tokens 512 --steps 1 --shared .shared \
      --out "$OUT/grpo_e2e_unsloth_probe.json" ;;
  grpo-step)
    run grpo_step 400 python3 -m benchmarks.grpo --completion-tokens 4096 --steps 2 --out "$OUT/grpo_step.json" ;;
  sft-8b)
    run sft_8b 570 python3 -m benchmarks.sft --model qwen3-8b --batch 1 2 4 8 16 32 --steps 10 --warmup 3 \
      --out "$OUT/sft_qwen3-8b.json" ;;
  sft-small)  # the four batch-size modes (all six modes do not fit 280 s per model)
    for m in 0.6b 1.7b; do
      run "sft_${m/./}" 280 python3 -m benchmarks.sft --model "qwen3-$m" --batch 1 2 4 8 16 32 --steps 10 --warmup 3 \
        --modes hf_padded trl_padding_free trl_liger swiftune --out "$OUT/sft_qwen3-$m.json"
    done ;;
  sft-llama)
    run sft_llama 570 python3 -m benchmarks.sft --model llama3-8b --batch 1 2 4 8 16 32 --steps 10 --warmup 3 \
      --out "$OUT/sft_llama3-8b.json" ;;
  sft-unsloth)  # SFT Qwen3-8B batch 16 side by side in one call: swiftune (fused LoRA linears, and PEFT's LoRA
    # forwards as its A/B), TRL + Liger, Unsloth padding-free and packed (carry .shared: a copy of the shared
    # folder with Unsloth's wheels), then the device-busy share of swiftune's step; sft-unsloth llama3-8b: that shape
    model=${2:-qwen3-8b}
    run sft_b16 300 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --modes swiftune swiftune_peft_lora swiftune_offload trl_liger --out "$OUT/sft_b16_$model.json"
    run unsloth_sft 330 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 \
      --out "$OUT/unsloth_sft_$model.json"
    run sft_busy 150 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 6 --warmup 3 --time-profile \
      --modes swiftune --out "$OUT/sft_busy_$model.json" ;;
  sft-untiled)  # issue 23's rows at <= Unsloth's memory with the MLP untiled (offloading tiles it; a batch of short rows
    # needs no tiles): batch 16 with every layer input on the host, and the 16K-token step on a 20.7 GB GPU with
    # the automatic budget (only what does not fit goes to the host), tiled beside untiled, then Unsloth
    # padding-free and packed in its own process, one call (carry .shared; ~9.5 min)
    model=${2:-qwen3-8b}
    run sft_b16_untiled 150 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --modes swiftune_offload_untiled --out "$OUT/sft_b16_untiled_$model.json"
    run sft_16k_fit_untiled 190 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --gpu-budget-gb 20.7 --modes swiftune_budget_fit_untiled swiftune_budget_fit \
      --out "$OUT/sft_16k_fit_untiled_$model.json"
    run unsloth_sft 230 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 --steps 12 \
      --out "$OUT/unsloth_sft_$model.json" ;;
  sft-16k-fit)  # the 16K-token row at no more than Unsloth's packed peak (19.3 GiB = 20.7 GB): offloaded
    # checkpointing with its automatic GPU budget on a 20.7 GB GPU (only what does not fit goes to the host), beside
    # the unconstrained 16K row and Unsloth's packed row (carry .shared). The automatic-budget row ran 5-8% slower
    # than the budget-0 row with the same plan in two calls, each time as the first process: the order is
    # reversed here to tell an order effect from a cost of the automatic budget
    model=${2:-qwen3-8b}
    run sft_16k_fit 200 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --gpu-budget-gb 20.7 --modes swiftune_budget_offload swiftune_budget_fit --out "$OUT/sft_16k_fit_$model.json"
    run sft_16k 120 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --modes swiftune_budget --out "$OUT/sft_16k_$model.json"
    # only Unsloth's packed row (the one this row is set against): its padding-free row first left the packed
    # one past the part's limit
    run unsloth_sft 230 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 --steps 12 \
      --modes unsloth_packed --out "$OUT/unsloth_sft_packed_$model.json" ;;
  sft-unsloth-graphs)  # the batch-16 row with graphed layers side by side with Unsloth and TRL + Liger in one call:
    # swiftune eager and graphed (warm-up long enough to capture most of the run's token buckets; the steady-state
    # figure counts the timed steps that captured nothing; the last warm-up step's device time against its wall
    # time: GPU busy), TRL + Liger, Unsloth padding-free and packed (carry .shared)
    model=${2:-qwen3-8b}
    run sft_graphs 240 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 70 --warmup 30 --time-profile \
      --modes swiftune swiftune_graphs --out "$OUT/sft_graphs_b16_$model.json"
    run sft_trl 90 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 10 --warmup 3 \
      --modes trl_liger --out "$OUT/sft_trl_b16_$model.json"
    run unsloth_sft 230 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 --steps 12 \
      --out "$OUT/unsloth_sft_$model.json" ;;
  sft-graphs-memory)  # the graphed batch-16 row at no more than Unsloth's peak (issue 23: >= 8,000 tok/s at <= its
    # memory): Unsloth padding-free first (its peak, this call), then swiftune graphed with the deferred check and the
    # loss in 256-token chunks (the automatic chunk takes 1,024 on a free GPU), then the same on a GPU emulated at
    # Unsloth's 2026-12-02 peak, 18.4 GB (carry .shared; ~9 min)
    model=${2:-qwen3-8b}
    run unsloth_sft 230 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 --steps 12 \
      --out "$OUT/unsloth_sft_$model.json"
    run sft_graphs_chunk256 200 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --logit-chunk-tokens 256 --modes swiftune_graphs \
      --out "$OUT/sft_graphs_chunk256_$model.json"
    run sft_graphs_18gb 200 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --gpu-budget-gb 18.4 --modes swiftune_graphs \
      --out "$OUT/sft_graphs_18gb_$model.json" ;;
  sft-graphs-host)  # issue 23's batch-16 memory: the graphed layers with their inputs in pinned host memory
    # (SFTConfig(cuda_graph_layers=True, activation_offloading=True)) beside the graphed row and Unsloth, the
    # deferred check and 256-token loss chunks as sft-graphs-memory; then the graphs' CUDA tests (~10 min)
    model=${2:-qwen3-8b}
    run unsloth_sft 230 python3 -m benchmarks.unsloth_sft --shared .shared --model "$model" --batch 16 --steps 12 \
      --out "$OUT/unsloth_sft_$model.json"
    run sft_graphs_host 300 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --logit-chunk-tokens 256 --modes swiftune_graphs swiftune_host_graphs \
      --out "$OUT/sft_graphs_host_$model.json"
    run graphs_tests 60 python3 -m pytest -q tests/test_layer_graphs.py -k cuda -p no:cacheprovider ;;
  sft-graphs-host-ab)  # sft-graphs-host without Unsloth, in one call: the graphs' CUDA tests, then graphed against
    # graphed with the inputs on the host, each in its own process, 50 steps after 25 (~6 min)
    model=${2:-qwen3-8b} steps=${3:-50}
    run graphs_tests 60 python3 -m pytest -q tests/test_layer_graphs.py -k cuda -p no:cacheprovider
    run sft_graphs_host_ab 360 python3 -m benchmarks.sft --model "$model" --batch 16 --steps "$steps" \
      --warmup $((steps / 2)) \
      --deferred-nonfinite-check --logit-chunk-tokens 256 --modes swiftune_graphs swiftune_host_graphs \
      --out "$OUT/sft_graphs_host_ab_$model.json" ;;
  sft-graphs-profile)  # what is alive at the peak of the graphed batch-16 step against the eager one (issue 23: the
    # graphed row's 20.6 GB against eager's 19.4 and Unsloth's 18.4): the last warm-up step of each profiled, the
    # run's peak beside it (~4 min)
    model=${2:-qwen3-8b}
    run sft_graphs_profile 240 python3 -m benchmarks.sft --model "$model" --batch 16 --steps 8 --warmup 6 \
      --deferred-nonfinite-check --memory-profile --modes swiftune swiftune_graphs \
      --out "$OUT/sft_graphs_profile_$model.json" ;;
  unsloth-flow)  # tests/compat/test_unsloth_flow.py: Unsloth's SFT notebook (tiny Qwen3 / Llama, 16-bit and 4-bit)
    # through Unsloth and through swiftune, each in its own process; Unsloth's wheels (carry .shared) go to
    # /tmp/site-unsloth, where the test looks for them (~4 min)
    [ -f /tmp/site-unsloth/unsloth/__init__.py ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/site-unsloth .shared/wheels/unsloth/*.whl
    run unsloth_flow 290 python3 -m pytest -rs tests/compat/test_unsloth_flow.py -p no:cacheprovider ;;
  qlora-sft)  # QLoRA (NF4 base) SFT Qwen3-8B side by side: swiftune batch 16 and 16K-token micro-batches, TRL +
    # Liger, Unsloth --4bit; then the 16K-token step on a 24 GB budget (carry .shared)
    # swiftune_offload: batch 16 with the layer inputs on the host, for the "at <= Unsloth's memory" half of the row
    run qlora_sft 330 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 --load-in-4bit \
      --modes swiftune swiftune_offload swiftune_budget trl_liger --out "$OUT/qlora_sft.json"
    run unsloth_qlora 300 python3 -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16 --4bit \
      --out "$OUT/unsloth_qlora_sft.json"
    run qlora_24gb 150 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 6 --warmup 2 --load-in-4bit \
      --gpu-budget-gb 24 --modes swiftune_budget swiftune_budget_offload --out "$OUT/qlora_sft_24gb.json" ;;
  fp8-sft)  # FP8 (e4m3, per-row scales, torch._scaled_mm) base weights against swiftune's own bf16 on the same
    # shapes: batch 16 and 16K-token micro-batches, Qwen3-8B, LoRA r=16; the fp8 CUDA tests first (~7 min)
    run fp8_tests 90 python3 -m pytest tests/test_fp8.py -p no:cacheprovider -k "cuda or scaled_mm"
    run fp8_sft_bf16 240 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
      --modes swiftune swiftune_budget --out "$OUT/fp8_sft_bf16.json"
    run fp8_sft 240 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 --load-in-fp8 \
      --modes swiftune swiftune_budget --out "$OUT/fp8_sft.json" ;;
  fp8-sft-16k)  # issue 26's 16K-token row alone (FP8 against swiftune's own bf16, one call): the FP8 step now
    # quantises each layer's input once for q/k/v and once for gate/up (4 quantise launches a layer's forward, was 7)
    run fp8_sft_16k_bf16 200 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
      --modes swiftune_budget --out "$OUT/fp8_sft_16k_bf16.json"
    run fp8_sft_16k 200 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 --load-in-fp8 \
      --modes swiftune_budget --out "$OUT/fp8_sft_16k.json" ;;
  fp8-curves|fp8-reward)  # issue 26's accuracy figures: the SFT loss curve on an FP8 base vs the bf16 base (same
    # rows, same adapters' initialisation, 200 steps; not in fp8-reward) and the GRPO reward of the built-in task,
    # FP8 vs bf16, 100 steps each
    [ "$part" = fp8-curves ] && run loss_curve_fp8 300 python3 -m benchmarks.loss_curve --compare fp8 \
      --out "$OUT/loss_curve_fp8.json"
    run reward_curve_fp8 280 python3 -m benchmarks.reward_curve --out "$OUT/reward_curve_fp8.json" ;;
  fp8-grpo)  # issue 26's "GRPO largest completion per row vs bf16": Qwen3-8B, G=2, prompt 256 shared, LoRA r=16, on
    # a 24 GB budget (where the base weights' 16.4 vs 8.2 GB matter most), bf16 then FP8, each measured 2% above and
    # 2.5% below the planner's answer (growable segments in both, as the CLI sets them)
    for w in bf16 fp8; do
      flags=(); [ "$w" = fp8 ] && flags=(--load-in-fp8)
      run "grpo_edge_24gb_$w" 280 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.grpo \
        --bisect-completion --model qwen3-8b --bisect-modes swiftune --share-prompt "${flags[@]}" --gpu-budget-gb 24 \
        --completion-from-planner --time-budget 240 --out "$OUT/grpo_edge_24gb_$w.json"
    done ;;
  fp8-graphs)  # FP8 base weights with graphed decoder layers (the batch-16 step is host-bound): FP8 eager and graphed,
    # then bf16 graphed, Qwen3-8B batch 16, in one call (warm-up long enough to capture the token buckets; ~7 min)
    run fp8_graphs_b16 260 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --load-in-fp8 \
      --modes swiftune swiftune_graphs --out "$OUT/fp8_graphs_qwen3-8b_b16.json"
    run bf16_graphs_b16 170 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --modes swiftune_graphs --out "$OUT/bf16_graphs_qwen3-8b_b16.json" ;;
  sft-memory)  # the allocation sites alive at the peak of a step, per mode (batch 16 and 16K-token micro-batches)
    run sft_memory 420 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 5 --warmup 3 --memory-profile \
      --modes trl_liger swiftune swiftune_budget swiftune_budget_offload --out "$OUT/sft_memory_qwen3-8b.json" ;;
  sft-chunk)  # peak memory vs speed of the fused loss's chunk on the small shapes (auto = no flag, in the
    # same call: capped at 1,024 tokens); then the Qwen3-8B shape at batch 16
    for c in auto 1024 2048; do
      run "sft_chunk_06b_$c" 120 python3 -m benchmarks.sft --model qwen3-0.6b --batch 8 16 32 --steps 10 --warmup 3 \
        --modes swiftune $([ "$c" != auto ] && echo --logit-chunk-tokens "$c") --out "$OUT/sft_chunk_06b_$c.json"
    done
    for c in auto 1024; do
      run "sft_chunk_8b_$c" 100 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
        --modes swiftune $([ "$c" != auto ] && echo --logit-chunk-tokens "$c") --out "$OUT/sft_chunk_8b_$c.json"
    done ;;
  sft-overhead)  # is a step bound by the GPU or by the host? The 8B step at batch 16 is as slow as at
    # batch 1: device time by kind vs
    # wall time of the 8B step, then what the host does in each
    run sft_overhead_qwen3-8b 200 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 6 --warmup 3 \
      --time-profile --modes swiftune trl_liger --out "$OUT/sft_overhead_qwen3-8b.json"
    for m in qwen3-8b qwen3-0.6b; do  # cProfile of one step: own time by library and function
      run "sft_host_$m" 150 python3 -m benchmarks.sft --model "$m" --batch 16 --steps 6 --warmup 3 \
        --host-profile --modes swiftune trl_liger --out "$OUT/sft_host_$m.json"
    done ;;
  sft-graphs)  # CUDA-graphed decoder layers (SFTConfig.cuda_graph_layers): their CUDA tests (real captures against
    # the unpatched model per document), then the Qwen3-8B step A/B in one call: batch 16 (warm-up long enough to
    # capture the run's token buckets) and 16K-token micro-batches, each mode in its own process
    run layer_graphs_tests 150 python3 -m pytest -rf tests/test_layer_graphs.py -k cuda -p no:cacheprovider
    run sft_graphs_b16 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --modes swiftune swiftune_graphs --out "$OUT/sft_graphs_qwen3-8b_b16.json"
    run sft_graphs_16k 170 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 22 --warmup 8 \
      --modes swiftune_budget swiftune_budget_graphs --out "$OUT/sft_graphs_qwen3-8b_16k.json" ;;
  sft-deferred)  # issue 23's busy share: where the graphed batch-16 step's device idles (--time-profile's gaps, each
    # charged to the host wait that opened it), with the NaN/inf guards' per-step syncs and with them deferred
    # (SFTConfig.deferred_nonfinite_check); then both unprofiled for tok/s, each mode in its own process
    run sft_deferred_tests 60 python3 -m pytest -rf tests/test_run_safety.py -k "deferred or nan_" -p no:cacheprovider
    run sft_sync_profile 200 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 34 --warmup 30 \
      --time-profile --modes swiftune_graphs --out "$OUT/sft_graphs_sync_profile.json"
    run sft_deferred_profile 200 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 34 --warmup 30 \
      --time-profile --deferred-nonfinite-check --modes swiftune_graphs --out "$OUT/sft_graphs_deferred_profile.json"
    run sft_sync 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --modes swiftune_graphs --out "$OUT/sft_graphs_sync.json"
    run sft_deferred 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --modes swiftune_graphs --out "$OUT/sft_graphs_deferred.json" ;;
  sft-deferred-busy)  # sft-deferred's deferred half only (~7 min): the profiled step now records its token slots,
    # so the busy share of the unprofiled steps (device ms per token x their steady tok/s) comes with it; the 60th
    # step is profiled, where a new token bucket (a graph capture, which leaves that share blank) is rarer than at the 30th
    run sft_deferred_profile 220 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 64 --warmup 60 \
      --time-profile --deferred-nonfinite-check --modes swiftune_graphs --out "$OUT/sft_graphs_deferred_profile.json"
    run sft_deferred 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --modes swiftune_graphs --out "$OUT/sft_graphs_deferred.json"
    # the same 40 timed steps as one window, synchronised at its ends only (the host prepares a step while the
    # device runs the one before, as in training): tok/s against the per-step-synchronised run's, same steps
    run sft_deferred_ends 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 \
      --deferred-nonfinite-check --step-sync ends --modes swiftune_graphs --out "$OUT/sft_graphs_deferred_ends.json" ;;
  fp8-g64)  # the FP8 decode step at G=64 only (shared activation quantisation for q/k/v and gate/up) against bf16
    run fp8_g64_bf16 100 python3 -m benchmarks.rollout --model qwen3-8b --rows 64 --new-tokens 1024 --no-baselines \
      --no-checks --lora-rows --time-budget 80 --out "$OUT/rollout_g64_bf16.json"
    run fp8_g64 110 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --time-budget 90 --out "$OUT/rollout_g64_fp8.json"
    # then the decode matmul table, which now also times q/k/v and gate/up stacked into one product each (~1 min):
    # whether stacking them would speed the FP8 decode step (its k/v products run at 12-13% of copy bandwidth)
    run fp8_matmul_kernels 150 python3 -m benchmarks.kernels --fp8-matmul --out "$OUT/kernels_fp8_matmul.json" ;;
  sft-full)
    run sft_full 200 python3 -m benchmarks.sft --model qwen3-0.6b --batch 16 --full --steps 10 --warmup 3 \
      --out "$OUT/sft_qwen3-0.6b_full.json" ;;
  loss-curve)
    run loss_curve 380 python3 -m benchmarks.loss_curve --out "$OUT/loss_curve.json" ;;
  longctx)  # largest fitting row with offload within 5%, from the planner's answer -2.5% / +2%; detached
    # (a fitting trial near 900K tokens takes ~2.5-3.5 min; one the host cannot hold fails at once): poll with
    # longctx-wait in the next call
    model=${2:-qwen3-8b}
    detach longctx_bisect python3 -m benchmarks.longctx --model "$model" --modes offload --tokens-from-planner \
      --doc-tokens 8192 --bisect offload --bisect-tol 0.05 --time-budget 900 --out /tmp/longctx_bisect.json
    wait_for longctx_bisect 56 12 ;;
  longctx-single)  # one causal sequence of TOKENS (default 409,600) with offload, detached (a step is ~8-13 min:
    # quadratic attention); poll with longctx-wait
    model=${2:-llama3-8b}; tokens=${3:-409600}
    detach longctx_bisect python3 -m benchmarks.longctx --model "$model" --modes offload --tokens "$tokens" \
      --doc-tokens 0 --repeats 1 --time-budget 5000 --out /tmp/longctx_bisect.json
    wait_for longctx_bisect 56 12 ;;
  longctx-wait)
    wait_for longctx_bisect 56 16 ;;
  vl-sft)  # issue 28's SFT target: image-text rows, batch 16, tok/s (text + image tokens) and peak memory, each mode in
    # its own process
    run vl_sft 530 python3 -m benchmarks.vl sft --model qwen3-vl-8b --batch 16 --steps 10 --warmup 3 \
      --mode-timeout 255 --out "$OUT/vl_sft_qwen3-vl-8b.json" ;;
  vl-gpu-tests)  # issue 28's tests that have not run on a GPU: GRPO parity on image prompts (compiled kernels, packed
    # and shared-prompt attention, fp32 / bf16), batched rollouts vs transformers, VisionFastRolloutEngine (~5 min)
    run vl_gpu_tests 540 python3 -m pytest -rf -p no:cacheprovider tests/test_qwen3_vl_grpo.py \
      tests/test_vl_rollout_batched.py tests/test_vl_fast_rollout.py ;;
  vl-grpo)  # issue 28's GRPO target: QLoRA, one 448x448 image + 256 prompt tokens, G=2, largest completion per row
    # on a BUDGET_GB (24) GPU; the random checkpoint stays in /tmp/vl8b_ckpt for the next call on a warm machine
    budget=${2:-24}
    # growable CUDA segments, as `swiftune grpo` sets them (57,344 -> 65,536 per row on 24 GB: docs/memory.md)
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run vl_grpo 540 python3 -m benchmarks.vl grpo --model qwen3-vl-8b --load-in-4bit --gpu-budget-gb "$budget" \
      --completion-lengths 32768 --bisect-start 65536 --time-budget 470 --checkpoint /tmp/vl8b_ckpt "${@:3}" \
      --out "$OUT/vl_grpo_qwen3-vl-8b_${budget}gb.json" ;;
  grpo-bisect)  # swiftune as GRPOTrainer runs it (shared prompt: sdpa for long completions, flex for short): 2 x 65,536 first, then upwards
    run grpo_bisect 570 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --completion-lengths 65536 --bisect-start 131072 --time-budget 520 \
      --out "$OUT/grpo_bisect.json" ;;
  grpo-bisect-base)  # the baselines: transformers full logits, TRL 1.16's loss path, TRL + Liger
    run grpo_bisect_base 570 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b \
      --bisect-modes hf_full_logits trl_grpo trl_liger --completion-lengths 65536 --time-budget 520 \
      --out "$OUT/grpo_bisect_base.json" ;;
  grpo-65k)  # the half-memory / 1.1x-time targets: steady-state steps (the 2nd of 2), TRL's loss path first
    run grpo_65k_trl 200 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes trl_grpo \
      --completion-lengths 65536 --fixed-only --trial-repeats 2 --time-budget 190 --out "$OUT/grpo_65k_trl.json"
    run grpo_65k_swiftune 200 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --swiftune-checkpointing offload_all --completion-lengths 65536 --fixed-only --trial-repeats 2 \
      --time-budget 190 --out "$OUT/grpo_65k_swiftune.json"
    run grpo_32k_profile 130 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --swiftune-checkpointing offload_all --completion-lengths 32768 --fixed-only \
      --profile-completion 32768 --time-budget 120 --out "$OUT/grpo_32k_profile.json" ;;
  grpo-65k-attn)  # issue 23's GRPO row with the attention outputs kept through the recompute: swiftune at 2 x 65,536,
    # every layer input on the host, without and with all 36 layers keeping their sdpa outputs (+38.6 GB on the
    # GPU: the row stays under Unsloth's 66.5 GiB), then Unsloth's anchor in its own process, one call (carry .shared);
    # the kept outputs' tests first (their CUDA case: bit-identical to the recompute, and the unpatched model's)
    run attention_outputs_tests 120 python3 -m pytest tests/test_attention_outputs.py -p no:cacheprovider
    layers=("${@:2}"); [ ${#layers[@]} = 0 ] && layers=(0 36)
    for kept in "${layers[@]}"; do
      run "grpo_65k_attn$kept" 200 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes \
        swiftune --share-prompt --swiftune-checkpointing offload_all --attention-output-layers "$kept" \
        --completion-lengths 65536 --fixed-only --trial-repeats 2 --time-budget 190 --out "$OUT/grpo_65k_attn$kept.json"
    done
    # (Unsloth's process: 36 s of import, the model's load and compile, then a first and a second 65,536 call: a
    # 200 s limit stopped it during its first call)
    [ -d .shared ] && run unsloth_grpo_65k 420 python3 -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b \
      --completion-lengths 65536 --repeats 2 --time-budget 280 --model-dir /tmp/ck8b --out "$OUT/unsloth_grpo_65k.json" ;;
  grpo-65k-host)  # issue 23's GRPO row at half of Unsloth's GPU memory: every layer input and every layer's kept sdpa
    # outputs in pinned host memory (~86 GB pinned in all), then the outputs on the GPU (+38.6 GB) as the same
    # call's baseline, Unsloth's anchor, and where the GPU-kept step's device time goes (its own process: the
    # profiler's step is not the timed one); the kept outputs' CUDA tests first (on host: bit-identical to the
    # recompute). [MODEL]: qwen3-8b (default) or llama3-8b (the Llama row)
    model=${2:-qwen3-8b}
    layers=$(python3 -c "from benchmarks.workload import shape_of; print(shape_of('$model')['num_hidden_layers'])")
    run attention_outputs_tests 150 python3 -m pytest tests/test_attention_outputs.py -p no:cacheprovider
    run "grpo_65k_attn${layers}_host_$model" 230 python3 -m benchmarks.grpo --bisect-completion --model "$model" \
      --bisect-modes swiftune --share-prompt --swiftune-checkpointing offload_all --attention-output-layers "$layers" \
      --attention-outputs-on-host --completion-lengths 65536 --fixed-only --trial-repeats 2 --time-budget 220 \
      --out "$OUT/grpo_65k_attn${layers}_host_$model.json"
    run "grpo_65k_attn${layers}_$model" 200 python3 -m benchmarks.grpo --bisect-completion --model "$model" \
      --bisect-modes swiftune --share-prompt --swiftune-checkpointing offload_all --attention-output-layers "$layers" \
      --completion-lengths 65536 --fixed-only --trial-repeats 2 --time-budget 190 \
      --out "$OUT/grpo_65k_attn${layers}_$model.json"
    [ -d .shared ] && run "unsloth_grpo_65k_$model" 420 python3 -m benchmarks.unsloth_grpo --shared .shared \
      --model "$model" --completion-lengths 65536 --repeats 2 --time-budget 280 --model-dir "/tmp/ck_$model" \
      --out "$OUT/unsloth_grpo_65k_$model.json"
    run "grpo_65k_attn${layers}_profile_$model" 160 python3 -m benchmarks.grpo --bisect-completion --model "$model" \
      --bisect-modes swiftune --share-prompt --swiftune-checkpointing offload_all --attention-output-layers "$layers" \
      --completion-lengths 65536 --fixed-only --profile-completion 65536 --time-budget 150 \
      --out "$OUT/grpo_65k_attn${layers}_profile_$model.json" ;;
  grpo-65k-profile)  # where the 2 x 65,536 step's device time goes and where the device idles (issue 23's 1.2x
    # Unsloth: 29.03 s on the H200 against 26.3 asked; the attention's products at sdpa's rate take about 16.9 s of
    # it): the outputs kept in pinned host memory, which fits an 80 GB card, one warm-up step then the profiled one
    # (~4 min). [MODEL]: qwen3-8b (default) or llama3-8b
    model=${2:-qwen3-8b}
    layers=$(python3 -c "from benchmarks.workload import shape_of; print(shape_of('$model')['num_hidden_layers'])")
    run "grpo_65k_profile_$model" 280 python3 -m benchmarks.grpo --bisect-completion --model "$model" \
      --bisect-modes swiftune --share-prompt --swiftune-checkpointing offload_all --attention-output-layers "$layers" \
      --attention-outputs-on-host --completion-lengths 65536 --fixed-only --trial-repeats 2 \
      --profile-completion 65536 --time-budget 270 --out "$OUT/grpo_65k_profile_$model.json" ;;
  qlora-sft-untiled)  # the batch-16 QLoRA row at <= Unsloth --4bit's peak: every layer input on the host with the
    # MLP untiled (a batch of short rows needs no tiles), against Unsloth --4bit in its own process, one call (carry
    # .shared and .whl; ~9 min)
    run qlora_sft_untiled 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
      --load-in-4bit --modes swiftune_offload_untiled swiftune --out "$OUT/qlora_sft_untiled.json"
    run unsloth_qlora 300 python3 -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16 --4bit \
      --modes unsloth --out "$OUT/unsloth_qlora_sft.json" ;;
  qlora-sft-16k)  # the QLoRA 16K-token row beside Unsloth --4bit's packed rows (16 x 1,024) in one call: swiftune with
    # every layer input on the host and the MLP untiled, then Unsloth in its own process (carry .shared and .whl; ~7 min)
    run qlora_sft_16k 250 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 --load-in-4bit \
      --modes swiftune_budget_offload_untiled --out "$OUT/qlora_sft_16k.json"
    run unsloth_qlora_packed 300 python3 -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16 --4bit \
      --modes unsloth_packed --out "$OUT/unsloth_qlora_packed.json" ;;
  qlora-grpo-unsloth)  # issue 24's "Unsloth's own largest on the same budget": Unsloth --4bit, G=2, prompt 256, on an
    # 80 GB budget, doubling from START (default 65,536) then bisected to 5% (carry .shared; ~8-9 min). On an H200
    # its 420 s ran out after the 65,536 trial; on an H100 80GB 86,016 and 90,112 fitted, 94,208 failed (each length
    # through qlora-grpo-unsloth-at, which runs in well under a call).
    # Usage: qlora-grpo-unsloth [START] [SECONDS] [REPEATS]  (SECONDS > 420 only as a gpu_chain.sh part: detached)
    budget=${3:-420}
    run unsloth_qlora_grpo $((budget + 140)) python3 -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b \
      --4bit --gpu-budget-gb 80 --scan --scan-start "${2:-65536}" --repeats "${4:-2}" --time-budget "$budget" \
      --model-dir /tmp/ck8b --out "$OUT/unsloth_qlora_grpo_80gb.json" ;;
  qlora-grpo-unsloth-at)  # Unsloth --4bit's GRPO trials at fixed completion lengths (as qlora-grpo-unsloth, one call
    # each, no scan): the 5% bracket around its largest fit when the scan's time runs out. Usage: qlora-grpo-unsloth-at C...
    run unsloth_qlora_grpo_at 580 python3 -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b --4bit \
      --gpu-budget-gb 80 --completion-lengths "${@:2}" --repeats 1 --time-budget 540 --model-dir /tmp/ck8b \
      --out "$OUT/unsloth_qlora_grpo_at_80gb.json" ;;
  qlora-sft-offload)  # the batch-16 QLoRA row at <= Unsloth --4bit's peak (8.3 GB): swiftune with and without the layer
    # inputs on the host, then Unsloth --4bit in its own process, one call (carry .shared and .whl; ~9 min)
    run qlora_sft_offload 300 python3 -m benchmarks.sft --model qwen3-8b --batch 16 --steps 10 --warmup 3 \
      --load-in-4bit --modes swiftune swiftune_offload --out "$OUT/qlora_sft_offload.json"
    run unsloth_qlora 300 python3 -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16 --4bit \
      --out "$OUT/unsloth_qlora_sft.json" ;;
  moe-sft)  # issue 25's SFT row: batch 16 on the reference lengths, LoRA r=16 on every linear and the experts,
    # swiftune against TRL 1.16 padding-free and TRL + Liger (where Liger covers the family), each in its own
    # process; moe-sft [STEPS] MODEL...: those shapes (default Qwen3-30B-A3B then gpt-oss-20b, ~4-5 min a shape),
    # STEPS steps of which 3 warm up (default 8: five timed steps vary by up to 7% between runs of one revision)
    steps=8; [[ "${2:-}" =~ ^[0-9]+$ ]] && { steps=$2; shift; }
    models=("${@:2}"); [ ${#models[@]} = 0 ] && models=(qwen3-30b-a3b gpt-oss-20b)
    for model in "${models[@]}"; do
      run "moe_sft_$model" $((200 + 12 * steps)) python3 -m benchmarks.sft --model "$model" --batch 16 --steps "$steps" --warmup 3 \
        --modes swiftune trl_padding_free trl_liger --out "$OUT/moe_sft_$model.json"
    done ;;
  sft-bisect)  # one SFT row per revision in .bisect/ (scripts/bisect_sources.sh; carry ".bisect"), each its own process
    # with that revision's swiftune ahead of the tree's, then the same with the last warm-up step's device time by
    # kind of kernel: sft-bisect MODEL [STEPS] (default gpt-oss-20b, 8 steps after 3; ~80 s a revision)
    model=${2:-gpt-oss-20b} steps=${3:-8}
    [ -f .bisect/revisions.txt ] || { echo "sft-bisect: no .bisect/ (scripts/bisect_sources.sh REV..., carry .bisect)"; exit 2; }
    # a revision may be named twice (first and last: torch.compile's cache on the machine warms after the first)
    n=0
    while read -r rev _; do
      n=$((n + 1))
      PYTHONPATH="$PWD/.bisect/$rev:$PYTHONPATH" python3 -c "import swiftune; print('$rev:', swiftune.__file__)"
      PYTHONPATH="$PWD/.bisect/$rev:$PYTHONPATH" run "sft_bisect_${n}_$rev" 240 python3 -m benchmarks.sft \
        --model "$model" --batch 16 --steps "$steps" --warmup 3 --modes swiftune --time-profile \
        --out "$OUT/sft_bisect_${model}_${n}_$rev.json"
    done < .bisect/revisions.txt
    python3 - "$OUT" "$model" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/sft_bisect_{sys.argv[2]}_*.json")):
    for r in json.load(open(path)):
        print(path.rsplit("/", 1)[1], *(f"{k}={r.get(k)}" for k in ("tokens_per_s", "peak_gb", "compiled_frames",
              "compiled_frames_timed", "slowest_step_s", "error")))
PY
    ;;
  moe-sft-experts)  # moe-sft's gpt-oss-20b row with its experts adapted too (PEFT's target_parameters beside
    # all-linear, in every mode: all-linear alone reaches only gpt-oss's attention projections; ~3 min)
    run moe_sft_experts_gpt-oss-20b 290 python3 -m benchmarks.sft --model gpt-oss-20b --batch 16 --steps 8 --warmup 3 \
      --modes swiftune trl_padding_free trl_liger --lora-target-parameters mlp.experts.gate_up_proj \
      mlp.experts.down_proj --out "$OUT/moe_sft_experts_gpt-oss-20b.json" ;;
  gptoss-grpo)  # issue 25's GRPO row: gpt-oss-20b, G=2, shared 256-token prompt, LoRA r=16, on an 80 GB budget
    # (gptoss-grpo GB: another): TRL's loss path bisected to 5%, then swiftune 2% above and 2.5% below the
    # planner's answer (flex attention with the sinks); detached (~15-20 min), poll with gptoss-grpo-wait
    gb=${2:-80}
    grpo=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.grpo --bisect-completion
      --model gpt-oss-20b --share-prompt --gpu-budget-gb "$gb")
    detach gptoss_grpo bash -c "${grpo[*]} --bisect-modes trl_grpo --time-budget 500 --out /tmp/gptoss_grpo_trl.json;
      ${grpo[*]} --bisect-modes swiftune --completion-from-planner --time-budget 700 --out /tmp/gptoss_grpo.json"
    wait_for gptoss_grpo 54 12 ;;
  gptoss-grpo-at)  # gptoss-grpo's swiftune trials at fixed completion lengths, in the foreground (for gpu_chain.sh):
    # gptoss-grpo-at GB C...: on a GB budget, or on the whole GPU with GB "whole" (then the host's memory, which
    # holds the offloaded checkpoints, is the limit; a trial near 213K took ~7 min on an H100, attention is
    # quadratic in the full layers); gptoss-grpo-trl GB: TRL's loss path bisected on the same budget (~3 min)
    gb=$2; budget=(); [ "$gb" = whole ] || budget=(--gpu-budget-gb "$gb")
    run "gptoss_grpo_at_$gb" 3000 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.grpo \
      --bisect-completion --model gpt-oss-20b --share-prompt "${budget[@]}" --bisect-modes swiftune \
      --completion-lengths "${@:3}" --fixed-only --time-budget 2900 --out "$OUT/gptoss_grpo_at_$gb.json" ;;
  gptoss-grpo-at-profiled)  # one gptoss-grpo-at trial whose allocator history is recorded: what is alive at its
    # peak, by allocation site (the memory planner plans gpt-oss's layer working set ~30% above what the trials
    # measured): gptoss-grpo-at-profiled GB C (~10 min near 250K)
    gb=$2; budget=(); [ "$gb" = whole ] || budget=(--gpu-budget-gb "$gb")
    run "gptoss_grpo_profiled_$gb" 3000 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m \
      benchmarks.grpo --bisect-completion --model gpt-oss-20b --share-prompt "${budget[@]}" --bisect-modes swiftune \
      --completion-lengths "$3" --memory-profile-completion "$3" --fixed-only --time-budget 2900 \
      --out "$OUT/gptoss_grpo_profiled_$gb.json" ;;
  gptoss-grpo-trl)
    gb=$2; budget=(); [ "$gb" = whole ] || budget=(--gpu-budget-gb "$gb")
    run "gptoss_grpo_trl_$gb" 600 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.grpo \
      --bisect-completion --model gpt-oss-20b --share-prompt "${budget[@]}" --bisect-modes trl_grpo \
      --time-budget 500 --out "$OUT/gptoss_grpo_trl_$gb.json" ;;
  gptoss-grpo-wait)
    wait_for gptoss_grpo 56 12; cp /tmp/gptoss_grpo_trl.json "$OUT/" 2>/dev/null ;;
  grpo-3x)  # one trial at 2 x 294,912 in the background (quadratic attention: ~8-10 min); grpo-3x-wait polls
    detach grpo_3x python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --completion-lengths 294912 --fixed-only --time-budget 1500 --out /tmp/grpo_3x.json
    wait_for grpo_3x 54 5 ;;  # done within the call if the trial is; else grpo-3x-wait
  grpo-3x-wait)
    wait_for grpo_3x 55 12 ;;
  grpo-edge)  # GRPO's largest completion per row, bracketed around the planner's answer (+2% first: a row the
    # host cannot hold fails at once; then -2.5%; 2 x 380,928 took 17 min): detached, poll with grpo-edge-wait.
    # grpo-edge C...: these completion lengths instead of the planner's bracket
    if [ $# -gt 1 ]; then lengths=(--completion-lengths "${@:2}" --fixed-only); else lengths=(--completion-from-planner); fi
    detach grpo_edge python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt "${lengths[@]}" --time-budget 2700 --out /tmp/grpo_edge.json
    wait_for grpo_edge 54 8 ;;
  qlora-rollout)  # decode step against the HBM floor of the 4-bit weights + KV cache (the NF4 kernel at 2-16 rows, bitsandbytes above)
    run qlora_rollout 560 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 8 64 --new-tokens 1024 \
      --no-checks --lora-rows 8 --time-budget 480 --out "$OUT/rollout_nf4.json" ;;
  qlora-rollout-nf4)  # the NF4 decode kernel: its tests compiled, then the engine with it and without (bitsandbytes'
    # dequantise-then-multiply) on the same 4-bit model in one call, G 8/16 (the kernel's rows) and 64 (~8 min)
    run nf4_tests 120 python3 -m pytest -rf -p no:cacheprovider tests/test_nf4_matmul.py
    run nf4_matmul_kernels 200 python3 -m benchmarks.kernels --nf4-matmul --out "$OUT/kernels_nf4_matmul.json"
    run nf4_rollout_kernel 240 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --nf4-decode-kernel \
      --rows 8 16 64 --new-tokens 1024 --no-baselines --lora-rows 8 --time-budget 200 --out "$OUT/rollout_nf4_kernel.json"
    run nf4_rollout_bnb 200 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --no-nf4-decode-kernel --rows 8 16 \
      --new-tokens 1024 --no-baselines --no-checks --time-budget 160 --out "$OUT/rollout_nf4_bnb.json" ;;
  qlora-rollout-dense)  # the engine decoding from NF4 weights dequantised once per call (FastRolloutEngine(nf4_dense=...),
    # on by default where the copy fits a quarter of the free memory) against the per-step paths (the NF4 kernel to
    # 16 rows, bitsandbytes above), Qwen3-8B, G 8/64, N 1024, one call; the engine's checks against generate on the
    # dense run (~5 min)
    run nf4_rollout_dense 250 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 8 64 \
      --nf4-dense on --new-tokens 1024 --no-baselines --lora-rows 8 --time-budget 220 --out "$OUT/rollout_nf4_dense.json"
    run nf4_rollout_per_step 200 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 8 64 \
      --nf4-dense off --new-tokens 1024 --no-baselines --no-checks --time-budget 170 \
      --out "$OUT/rollout_nf4_per_step.json" ;;
  qlora-rollout-nf4-64)  # the NF4 kernel above 16 rows (FastRolloutEngine(nf4_decode_max_rows=64)): its tests
    # compiled, its matmul table at 1-64 rows against bitsandbytes, then the engine at G=32/64 bound to 64 rows
    # against the default bound of 16 (bitsandbytes' dequantise-then-multiply above it), Qwen3-8B, N 1024 (~8 min)
    run nf4_tests 120 python3 -m pytest -rf -p no:cacheprovider tests/test_nf4_matmul.py
    run nf4_matmul_kernels 150 python3 -m benchmarks.kernels --nf4-matmul --out "$OUT/kernels_nf4_matmul_64.json"
    for rows in 64 16; do  # the engine's checks (its tokens against generate's) at 64 only
      checks=(); [ "$rows" = 16 ] && checks=(--no-checks)
      run "nf4_rollout_max$rows" 170 python3 -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 32 64 \
        --nf4-decode-max-rows "$rows" --new-tokens 1024 --no-baselines --lora-rows "${checks[@]}" --time-budget 150 \
        --out "$OUT/rollout_nf4_max$rows.json"
    done ;;
  fp8-dot)  # fp8_dot_matmul: every test of its file compiled (small shapes with the FP8 tensor cores' slack, the
    # Qwen3-8B projections at 17 and 64 rows, graph replay == eager), then the decode matmul table (weight-only,
    # dot, _scaled_mm, bf16 at M 1/8/32/64, the dot sweep at 64, one decoder layer's total per M)
    run fp8_dot_tests 240 python3 -m pytest tests/test_fp8_dot.py -p no:cacheprovider
    run fp8_matmul_kernels 150 python3 -m benchmarks.kernels --fp8-matmul --out "$OUT/kernels_fp8_matmul.json" ;;
  fp8-rollout)  # decode step against the HBM floor of the e4m3 weights + float32 scales + KV cache, and swiftune's
    # own bf16 engine on the same shape, G and N in the same call (no generate baselines: the rollout part has them);
    # the FP8 run checks graph replay == eager through the quantise kernel and the weight-only decode kernel;
    # first those kernels' CUDA tests and the decode matmul microbenchmark (weight-only vs _scaled_mm vs bf16, ~1 min)
    run fp8_quant_tests 90 python3 -m pytest tests/test_fp8_quant.py tests/test_fp8_matmul.py -p no:cacheprovider \
      -k "not formula"
    run fp8_matmul_kernels 90 python3 -m benchmarks.kernels --fp8-matmul --out "$OUT/kernels_fp8_matmul.json"
    run fp8_rollout_bf16 200 python3 -m benchmarks.rollout --model qwen3-8b --rows 8 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --time-budget 170 --out "$OUT/rollout_fp8_bf16.json"
    run fp8_rollout 300 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 --new-tokens 1024 \
      --no-baselines --lora-rows 8 --time-budget 270 --out "$OUT/rollout_fp8.json" ;;
  moe-rollout)  # MoE decode (experts routed on the device inside the CUDA graph): graph replay == eager in bf16 and
    # fp32 greedy == generate first; then the decode step against the HBM floor of the experts the G rows route to
    # (measured per step) + attention and other weights + KV cache; transformers' generate (dynamic cache) over 16 steps
    run moe_rollout_tests 120 python3 -m pytest tests/test_moe_rollout.py -k cuda -p no:cacheprovider
    run moe_rollout 380 python3 -m benchmarks.rollout --model qwen3-30b-a3b mixtral-8x7b --rows 8 64 --new-tokens 1024 \
      --baseline-kinds dynamic --baseline-steps 16 --lora-rows 8 --time-budget 300 --out "$OUT/rollout_moe.json" ;;
  moe-rollout-profile)  # issue 25's decode target (within 3x the HBM floor): Qwen3-30B-A3B's engine at G 8 and 64, then
    # 256 more tokens under torch.profiler: device time per decode step by kernel, and launches a step (~3 min)
    run rollout_moe_profile 280 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --profile-steps 256 --time-budget 200 --out "$OUT/rollout_moe_profile.json" ;;
  moe-routing-ab)  # the MoE routing kernels against torch's ops, Qwen3-30B-A3B at G 8 and 64, each profiled for 256
    # more tokens, in one call: torch's ops, the router top-k kernel (the default), and with the route kernels too
    # (the sort and combine above the decode kernels' cap) (~7 min)
    for routing in no-fused-routing fused-routing route-kernels; do
      flags=(--moe-fused-routing --no-moe-route-kernels)
      [ "$routing" = no-fused-routing ] && flags=(--no-moe-fused-routing --no-moe-route-kernels)
      [ "$routing" = route-kernels ] && flags=(--moe-fused-routing --moe-route-kernels)
      run "rollout_moe_$routing" 200 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 \
        --new-tokens 1024 --no-baselines --no-checks --lora-rows --profile-steps 256 "${flags[@]}" \
        --decode-attention sdpa --time-budget 150 \
        --out "$OUT/rollout_moe_$routing.json"
    done ;;
  decode-attention-ab)  # the split decode attention (flash-decoding) against SDPA in the engine, one call: its and
    # the MoE routing kernels' CUDA tests, then Qwen3-8B at G 8 / 64, Qwen3-30B-A3B and gpt-oss-20b (sinks) at G 8,
    # each attention in its own run, profiled for 256 more tokens (~10 min: through scripts/gpu_chain.sh)
    run decode_kernel_tests 150 python3 -m pytest -p no:cacheprovider tests/test_decode_attention_kernel.py \
      tests/test_moe_route_kernel.py tests/test_moe_router_kernel.py
    for attention in sdpa split; do
      for shape in "qwen3-8b 8 64" "qwen3-30b-a3b 8" "gpt-oss-20b 8"; do  # a model, then its G values
        read -r model rows <<< "$shape"
        # shellcheck disable=SC2086  # $rows: one G or several
        run "rollout_attention_${attention}_$model" 150 python3 -m benchmarks.rollout --model "$model" --rows $rows \
          --new-tokens 1024 --no-baselines --no-checks --lora-rows --profile-steps 256 --decode-attention "$attention" \
          --no-moe-route-kernels --time-budget 120 --out "$OUT/rollout_attention_${attention}_$model.json"
      done
    done ;;
  moe-decode-defaults)  # the MoE decode rows with the engine's defaults (router and route kernels, split decode
    # attention), Qwen3-30B-A3B and gpt-oss-20b at G 8 / 64, then each profiled for 256 more tokens (~4 min)
    for model in qwen3-30b-a3b gpt-oss-20b; do
      run "rollout_${model}_defaults" 200 python3 -m benchmarks.rollout --model "$model" --rows 8 64 --new-tokens 1024 \
        --no-baselines --no-checks --lora-rows --profile-steps 256 --time-budget 150 \
        --out "$OUT/rollout_${model}_defaults.json"
    done ;;
  fp8-stacked-ab)  # FP8 decode with q/k/v as one product over their adjacent codes against three, Qwen3-8B at G 8 /
    # 64, one call, each profiled for 256 more tokens; the stacked path's tests on CUDA first (~6 min)
    run fp8_stacked_tests 200 python3 -m pytest tests/test_fp8_stacked_qkv.py -p no:cacheprovider
    for stacked in no-stacked stacked; do
      flags=(--no-fp8-stacked-qkv --no-fp8-stacked-gate-up)
      [ "$stacked" = stacked ] && flags=(--fp8-stacked-qkv --no-fp8-stacked-gate-up)
      run "rollout_fp8_$stacked" 150 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 \
        --new-tokens 1024 --no-baselines --no-checks --lora-rows --profile-steps 256 "${flags[@]}" --time-budget 130 \
        --out "$OUT/rollout_fp8_$stacked.json"
    done ;;
  fp8-stacked-gate-up-ab)  # FP8 decode with gate/up as one product too (the activation reading its halves in
    # place) against q/k/v alone (the default), and bf16 beside them: Qwen3-8B at G 8 / 64, one call, the FP8 runs
    # profiled for 256 more tokens; the stacked paths' and the GLU kernel's tests on CUDA first (~7 min)
    run fp8_stacked_gate_up_tests 200 python3 -m pytest tests/test_fp8_stacked_qkv.py tests/test_glu_rows.py \
      tests/test_decode_attention_kernel.py -p no:cacheprovider
    run rollout_fp8_bf16 130 python3 -m benchmarks.rollout --model qwen3-8b --rows 8 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --time-budget 110 --out "$OUT/rollout_fp8_bf16.json"
    for stacked in qkv gate-up; do
      flags=(--fp8-stacked-qkv --no-fp8-stacked-gate-up)
      [ "$stacked" = gate-up ] && flags=(--fp8-stacked-qkv --fp8-stacked-gate-up)
      run "rollout_fp8_stacked_$stacked" 150 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 \
        --new-tokens 1024 --no-baselines --no-checks --lora-rows --profile-steps 256 "${flags[@]}" --time-budget 130 \
        --out "$OUT/rollout_fp8_stacked_$stacked.json"
    done ;;
  fp8-kv-ab)  # the FP8 KV cache (FastRolloutEngine(kv_cache_dtype="fp8"), e4m3 codes with a float32 scale per slot and
    # head) against the bf16 cache, Qwen3-8B on FP8 weights at G 8 / 64, bf16 weights beside them, one call, the FP8
    # runs profiled for 256 more tokens; the cache's and the split attention's tests on CUDA first (~8 min)
    run fp8_kv_tests 200 python3 -m pytest tests/test_kv_cache_fp8.py tests/test_decode_attention_kernel.py \
      -p no:cacheprovider
    run rollout_kv_bf16 130 python3 -m benchmarks.rollout --model qwen3-8b --rows 8 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --time-budget 110 --out "$OUT/rollout_kv_bf16.json"
    for kv in auto fp8; do
      run "rollout_fp8_kv_$kv" 150 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 \
        --new-tokens 1024 --no-baselines --no-checks --lora-rows --profile-steps 256 --kv-cache-dtype "$kv" \
        --time-budget 130 --out "$OUT/rollout_fp8_kv_$kv.json"
    done ;;
  fp8-norm-kv-ab)  # #26's G=64 step, one call: bf16 weights; FP8 weights with the separate quantise launch
    # (--no-fp8-norm-codes), with the norms making the codes (the default), and with those and the FP8 KV cache; the
    # FP8 runs profiled for 256 more tokens; the norm kernel's, the FP8 cache's and the split attention's tests on
    # CUDA first (~8 min)
    run fp8_norm_kv_tests 200 python3 -m pytest tests/test_fp8_norm_codes.py tests/test_kv_cache_fp8.py \
      tests/test_decode_attention_kernel.py tests/test_fp8_lora_shared_quant.py "tests/test_kernels.py::test_add_rms_norm_fp8_is_add_rms_norm_then_the_rowwise_quantiser" \
      -p no:cacheprovider
    run rollout_g64_bf16 110 python3 -m benchmarks.rollout --model qwen3-8b --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --time-budget 95 --out "$OUT/rollout_g64_bf16.json"
    for variant in no-norm-codes norm-codes norm-codes-kv-fp8; do
      flags=(--fp8-norm-codes --kv-cache-dtype auto)
      [ "$variant" = no-norm-codes ] && flags=(--no-fp8-norm-codes --kv-cache-dtype auto)
      [ "$variant" = norm-codes-kv-fp8 ] && flags=(--fp8-norm-codes --kv-cache-dtype fp8)
      run "rollout_g64_fp8_$variant" 120 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 \
        --new-tokens 1024 --no-baselines --no-checks --profile-steps 256 "${flags[@]}" --time-budget 105 \
        --out "$OUT/rollout_g64_fp8_$variant.json"
    done ;;
  fp8-g64-kv)  # fp8-norm-kv-ab cut to its two ends (~4 min): #26's G=64 step, bf16 weights and cache against the FP8
    # defaults (norm-made codes) with the FP8 KV cache, no profile, no tests
    run rollout_g64_bf16 110 python3 -m benchmarks.rollout --model qwen3-8b --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --time-budget 95 --out "$OUT/rollout_g64_bf16.json"
    run rollout_g64_fp8_norm-codes-kv-fp8 120 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 \
      --new-tokens 1024 --no-baselines --no-checks --fp8-norm-codes --kv-cache-dtype fp8 --time-budget 105 \
      --out "$OUT/rollout_g64_fp8_norm-codes-kv-fp8.json" ;;
  fp8-reduce-tests)  # the FP8 decode kernels' CUDA tests (the split-K reduction in the product's own launch: 200
    # back-to-back calls per Qwen3-8B projection equal the second launch's bits; graph replays; ~1-2 min)
    run fp8_reduce_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_dot.py tests/test_fp8_matmul.py \
      -k cuda ;;
  fp8-g64-reduce-ab)  # #26's G=64 step: bf16, FP8 with the second reduce launch (the default), FP8 with the split
    # K reduced in each product's own launch (--fp8-reduce-in-launch), one call, after the kernels' CUDA tests (~7 min)
    run fp8_reduce_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_dot.py tests/test_fp8_matmul.py \
      -k cuda
    rollout_g64_bf16_fp8
    run rollout_g64_fp8_in-launch 120 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 \
      --new-tokens 1024 --no-baselines --no-checks --kv-cache-dtype fp8 --fp8-reduce-in-launch --time-budget 105 \
      --out "$OUT/rollout_g64_fp8_in-launch.json" ;;
  fp8-g64)  # #26's G=64 step: bf16, then FP8 with the engine's defaults and the FP8 KV cache, one call (~4 min)
    rollout_g64_bf16_fp8 ;;
  fp8-dot-sweep)  # #26's G=64 products: the FP8 x FP8 kernel's tile overrides with x's codes given, as the decode
    # step runs them, per Qwen3-8B projection (and q/k/v, gate/up stacked) against bf16 (~2 min)
    run kernels_fp8_matmul 240 python3 -m benchmarks.kernels --fp8-matmul --out "$OUT/kernels_fp8_matmul.json" ;;
  fp8-glu-codes-ab)  # #26's G=64 FP8 step with the MLP's activation kernel making down_proj's codes (glu_fp8) against
    # the separate quantise launch, the engine's other defaults (norm codes, FP8 KV cache) in both, each profiled for
    # 256 more tokens; the kernel's and the engine's CUDA tests first (~5 min)
    run glu_fp8_tests 150 python3 -m pytest -q tests/test_kernels.py -k glu_fp8 tests/test_fp8_norm_codes.py \
      -p no:cacheprovider
    for variant in no-glu-codes glu-codes; do
      flag=--fp8-glu-codes; [ "$variant" = no-glu-codes ] && flag=--no-fp8-glu-codes
      run "rollout_g64_fp8_$variant" 130 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 \
        --new-tokens 1024 --no-baselines --no-checks --profile-steps 256 --kv-cache-dtype fp8 "$flag" \
        --time-budget 115 --out "$OUT/rollout_g64_fp8_$variant.json"
    done ;;
  lora-decode-ab)  # runtime LoRA (r=16, every linear layer; FP8 bases are never merged) on Qwen3-8B FP8 at G 8 / 64:
    # each adapter's product in two launches (FastRolloutEngine(lora_decode_kernel=True), the CUDA default) against two matmuls and
    # their casts, one call, bf16 (runtime and merged adapters) beside; the kernel's tests on CUDA first (~8 min)
    run lora_decode_tests 200 python3 -m pytest tests/test_lora_decode_kernel.py tests/test_fp8_lora_shared_quant.py \
      -p no:cacheprovider
    run rollout_lora_bf16 150 python3 -m benchmarks.rollout --model qwen3-8b --rows 8 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows 8 64 --time-budget 130 --out "$OUT/rollout_lora_bf16.json"
    for kernel in no-lora-decode-kernel lora-decode-kernel; do
      run "rollout_lora_fp8_$kernel" 150 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 \
        --new-tokens 1024 --no-baselines --no-checks --lora-rows 8 64 "--$kernel" --time-budget 130 \
        --out "$OUT/rollout_lora_fp8_$kernel.json"
    done ;;
  decode-attention-tune)  # the split decode attention's launch settings swept (tile, warps, stages, chunks) at G 8 / 64,
    # 256-2048 slots, bf16 and FP8 caches, with its CUDA tests (the one-chunk path writes without the merge) (~4 min)
    run decode_attention_tests 120 python3 -m pytest tests/test_decode_attention_kernel.py -p no:cacheprovider
    run decode_attention_tune 240 python3 -m benchmarks.tune_decode_attention --out "$OUT/tune_decode_attention.json" ;;
  lora-decode-quick)  # lora-decode-ab cut to fit a few minutes: the CUDA tests of the LoRA decode kernel, the FP8 KV cache,
    # the norm-made codes and flex attention in head groups, then FP8 runtime LoRA at G=8 with and without the
    # kernel, 512 tokens (~4 min)
    run lora_quick_tests 150 python3 -m pytest tests/test_lora_decode_kernel.py tests/test_kv_cache_fp8.py \
      tests/test_fp8_norm_codes.py tests/test_flex_head_groups.py -p no:cacheprovider
    for kernel in no-lora-decode-kernel lora-decode-kernel; do
      run "rollout_lora_fp8_$kernel" 80 python3 -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 \
        --new-tokens 512 --no-baselines --no-checks --lora-rows 8 "--$kernel" --time-budget 70 \
        --out "$OUT/rollout_lora_fp8_$kernel.json"
    done ;;
  moe-cap-ab)  # Qwen3-30B-A3B's G=64 step with the decode kernels up to 64 tokens (64/64/4 tiles above 16 rows, the
    # layer sweep's best) against the default cap of 16 (grouped GEMM), one call (~4 min)
    for cap in 16 64; do
      run "rollout_moe_cap$cap" 150 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 64 --new-tokens 1024 \
        --no-baselines --no-checks --lora-rows --profile-steps 256 --moe-decode-max-tokens "$cap" --no-moe-route-kernels \
        --decode-attention sdpa --time-budget 120 \
        --out "$OUT/rollout_moe_cap$cap.json"
    done ;;
  moe-decode)  # the routed experts' fused decode kernels (swiftune.kernels.moe_decode): their tests compiled (30B-A3B
    # expert sizes, graph replay == eager, the engine's captured decode vs generate), the MoE engine's CUDA tests (its
    # bf16 graph case now runs the kernels), then one 30B-A3B layer at T 8/64: kernel vs grouped_mm vs HBM floor (~4 min)
    run moe_decode_tests 200 python3 -m pytest tests/test_moe_decode_kernel.py -p no:cacheprovider
    run moe_rollout_tests 120 python3 -m pytest tests/test_moe_rollout.py -k cuda -p no:cacheprovider
    run moe_decode 120 python3 -m benchmarks.moe_decode --out "$OUT/moe_decode.json" ;;
  gptoss-rollout)  # gpt-oss on the engine (attention sinks in the prefill and decode attention, sliding and full layers,
    # YaRN, biased experts routed on the device inside the graph): graph replay == eager in bf16, fp32 greedy == generate;
    # then moe-rollout's measurement on the gpt-oss-20b shape (generate: transformers' eager attention, dynamic cache)
    run gptoss_rollout_tests 150 python3 -m pytest tests/test_gptoss_rollout.py -k cuda -p no:cacheprovider
    run gptoss_rollout 380 python3 -m benchmarks.rollout --model gpt-oss-20b --rows 8 64 --new-tokens 1024 \
      --baseline-kinds dynamic --baseline-steps 16 --lora-rows 8 --time-budget 300 --out "$OUT/rollout_gptoss.json" ;;
  gptoss-decode)  # the decode kernels on gpt-oss's expert layout (one contiguous tile of interleaved gate/up
    # columns): their tests compiled, one layer of gpt-oss-20b's experts kernel vs grouped GEMM, then the engine's
    # G 8/64 rows against the HBM floor (no generate baselines: gptoss-rollout has them), then G=64 with the kernels
    # up to 64 tokens (~8 min)
    run moe_decode_tests 150 python3 -m pytest tests/test_moe_decode_kernel.py -p no:cacheprovider
    run moe_decode_gptoss 120 python3 -m benchmarks.moe_decode --model gpt-oss-20b --tokens 8,16,64 \
      --out "$OUT/moe_decode_gptoss.json"
    run gptoss_engine 230 python3 -m benchmarks.rollout --model gpt-oss-20b --rows 8 64 --new-tokens 1024 \
      --no-baselines --time-budget 180 --out "$OUT/rollout_gptoss_kernel.json"
    # A/B in the same call: the decode kernels up to 64 tokens (the G=64 step off the grouped GEMM)
    run gptoss_engine_cap64 150 python3 -m benchmarks.rollout --model gpt-oss-20b --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --moe-decode-max-tokens 64 --time-budget 100 \
      --out "$OUT/rollout_gptoss_kernel_cap64.json" ;;
  moe-decode-cap)  # the decode kernels' token cap: their tests compiled, then the engine at G=64 on Qwen3-30B-A3B
    # at its default cap of 16 (the grouped GEMM) and at 64, and gpt-oss-20b at its default of 64 (~7 min)
    run moe_decode_tests 120 python3 -m pytest tests/test_moe_decode_kernel.py -p no:cacheprovider
    run qwen3_moe_cap16 110 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --moe-decode-max-tokens 16 --time-budget 80 --out "$OUT/rollout_qwen3_moe_cap16.json"
    run qwen3_moe_cap64 110 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 64 --new-tokens 1024 \
      --no-baselines --lora-rows --moe-decode-max-tokens 64 --time-budget 80 --out "$OUT/rollout_qwen3_moe_cap64.json"
    run gptoss_cap64 110 python3 -m benchmarks.rollout --model gpt-oss-20b --rows 64 --new-tokens 1024 \
      --no-baselines --no-checks --lora-rows --time-budget 80 --out "$OUT/rollout_gptoss_cap64.json" ;;
  qlora-grpo)  # GRPO's largest completion per row, Qwen3-8B QLoRA (NF4 base), G=2, prompt 256, on an 80 GB budget,
    # bracketed around the planner's answer: detached, poll with qlora-grpo-wait
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      detach qlora_grpo python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --load-in-4bit --gpu-budget-gb 80 --completion-from-planner --time-budget 2700 \
      --out /tmp/qlora_grpo.json
    wait_for qlora_grpo 54 8 ;;
  pieces-tests)  # per-document sdpa outputs projected one by one (swiftune.attention.pieces): its tests on CUDA
    # (the CPU parity cases, one saved attention output fewer per layer in bf16, the kernels' contiguous [L, H, D]
    # output at the 8B shape) (~1 min)
    run attention_pieces_tests 150 python3 -m pytest -rf tests/test_attention_pieces.py -p no:cacheprovider ;;
  offload-tests)  # the offloaded checkpointing on CUDA (side-stream copies to pinned pages and back, kept attention
    # outputs on the GPU and in host pages): its tests, before a long chain that rests on them (~1-2 min)
    run offload_tests 200 python3 -m pytest -rf tests/test_checkpointing.py tests/test_attention_outputs.py \
      -p no:cacheprovider ;;
  cli-fp8-tests)  # the FP8 tests (scaled_mm, saving, the decode) and swiftune generate's (greedy log-probs, chat and
    # plain prompts' stops, against transformers' generate) on a GPU (~2 min)
    run cli_fp8_tests 200 python3 -m pytest -rf tests/test_fp8.py tests/test_generate_cli.py -p no:cacheprovider ;;
  loss-tests)  # the chunked losses on CUDA: the log-prob loss with its hidden states offloaded in pinned row blocks
    # (read back across block edges), the real offload path bitwise against no offload, bf16 against references (~1 min)
    run loss_tests 150 python3 -m pytest -rf tests/test_losses.py -k cuda -p no:cacheprovider ;;
  qlora-grpo-at)  # GRPO trials at fixed completion lengths, Qwen3-8B QLoRA (NF4 base), G=2, prompt 256, on an 80 GB
    # budget, in the foreground (for scripts/gpu_chain.sh, which is already detached; a trial near 2 x 330K takes
    # ~12-15 min). Usage: qlora-grpo-at COMPLETION...
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run qlora_grpo_at 1500 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --load-in-4bit --gpu-budget-gb 80 --completion-lengths "${@:2}" --fixed-only --time-budget 1450 \
      --out "$OUT/qlora_grpo_at.json" ;;
  qlora-grpo-cut)  # the qlora-grpo-at trial on the Qwen3-8B shape cut to its first LAYERS decoder layers, every
    # kernel launch synchronous (CUDA_LAUNCH_BLOCKING=1: an asynchronous CUDA error is raised at the call that
    # caused it), on GPU_GB of GPU and HOST_GB of host memory for the offloaded layer inputs (a small HOST_GB makes
    # layers derive their inputs): a repro of a full trial's failure in ~1-2 min.
    # Usage: qlora-grpo-cut LAYERS GPU_GB HOST_GB COMPLETION...
    CUDA_LAUNCH_BLOCKING=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run qlora_grpo_cut 560 python3 -m benchmarks.grpo --bisect-completion --model "qwen3-8b:layers=$2" \
      --bisect-modes swiftune --share-prompt --load-in-4bit --gpu-budget-gb "$3" --host-budget-gb "$4" \
      --completion-lengths "${@:5}" --fixed-only --time-budget 520 --out "$OUT/qlora_grpo_cut.json" ;;
  qlora-grpo-unshared-at)  # the same trials with each completion after its own copy of the prompt (as TRL and
    # Unsloth lay rows out): no per-completion prompt q/k/v copies in sdpa. Usage: qlora-grpo-unshared-at COMPLETION...
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run qlora_grpo_unshared_at 1500 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b \
      --bisect-modes swiftune --load-in-4bit --gpu-budget-gb 80 --completion-lengths "${@:2}" --fixed-only \
      --time-budget 1450 --out "$OUT/qlora_grpo_unshared_at.json" ;;
  qlora-grpo-profile-at)  # one shared-prompt QLoRA trial (as qlora-grpo-at) with the allocator's history recorded: the
    # blocks alive at the step's peak by the line that allocated them, kept when the trial runs out of memory too
    # (benchmarks/memory_profile.py; recording slows the step). Usage: qlora-grpo-profile-at COMPLETION
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run qlora_grpo_profile_at 1500 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b \
      --bisect-modes swiftune --share-prompt --load-in-4bit --gpu-budget-gb 80 --completion-lengths "$2" \
      --memory-profile-completion "$2" --fixed-only --time-budget 1450 --out "$OUT/qlora_grpo_profile_at.json" ;;
  qlora-grpo-wait)
    wait_for qlora_grpo 56 8 ;;
  grpo-edge-wait)
    wait_for grpo_edge 56 8 ;;
  grpo-pair)  # two GRPO trials side by side on a two-GPU host (kind nvidia-h200-x2), one per GPU, each capped at
    # the pinned host memory a one-H200 machine offers (119.5 GB, as the 2 x 294,912 trial saw) with a small
    # margin so that the two fit the larger host together; detached (a trial near 2 x 400K takes ~15-18 min):
    # poll with grpo-pair-wait. Usage: grpo-pair COMPLETION_GPU0 COMPLETION_GPU1
    for i in 0 1; do
      c=${2:?"two completion lengths"}; [ "$i" = 1 ] && c=${3:?"two completion lengths"}
      detach "grpo_pair_$i" env CUDA_VISIBLE_DEVICES=$i python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b \
        --bisect-modes swiftune --share-prompt --completion-lengths "$c" --fixed-only --time-budget 3000 \
        --host-budget-gb 119.5 --host-margin-gb 4 --out "/tmp/grpo_pair_$i.json"
    done
    sleep 60; free -g; nvidia-smi --query-gpu=index,memory.used --format=csv; tail -n 3 /tmp/grpo_pair_*.log ;;
  grpo-pair-wait)
    wait_for grpo_pair_0 54 8; wait_for grpo_pair_1 2 8 ;;
  grpo-memory)  # what is alive at the peak of a GRPO step: every checkpoint on the host at 2 x 65,536, the
    # automatic budget at 2 x 131,072 (the planner overestimated the 2 x 294,912 step by ~25%)
    run grpo_memory_65k 200 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --swiftune-checkpointing offload_all --completion-lengths 65536 --fixed-only \
      --memory-profile-completion 65536 --time-budget 190 --out "$OUT/grpo_memory_65k.json"
    run grpo_memory_131k 300 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \
      --share-prompt --completion-lengths 131072 --fixed-only --memory-profile-completion 131072 \
      --time-budget 290 --out "$OUT/grpo_memory_131k.json" ;;
  grpo-profile)  # where the time of one policy step goes: TRL's loss path vs swiftune's (shared-prompt and unshared rows)
    run grpo_profile 170 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes trl_grpo \
      swiftune --share-prompt --completion-lengths 32768 --fixed-only --profile-completion 32768 --time-budget 150 \
      --out "$OUT/grpo_profile.json"
    run grpo_profile_varlen 100 python3 -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes \
      swiftune --completion-lengths 32768 --fixed-only --profile-completion 32768 --time-budget 85 \
      --out "$OUT/grpo_profile_varlen.json" ;;
  longctx-trl)  # TRL + Liger's largest single sequence (quadratic attention: a trial at 256K takes minutes)
    model=${2:-qwen3-8b}
    # two quick rows, then trials around where the line through them fills the GPU, then bisection to 5%
    run "longctx_trl_$model" 570 python3 -m benchmarks.longctx --model "$model" --modes trl_liger \
      --tokens 32768 65536 --bracket-from-fit --doc-tokens 0 --bisect trl_liger --bisect-granularity 8192 \
      --bisect-tol 0.05 --time-budget 520 --out "$OUT/longctx_trl_$model.json" ;;
  longctx-memory)  # what is alive at the peak of a long step (default 131,072 tokens: every layer input on the
    # GPU). TOKENS larger (e.g. 524288: inputs on the host too) for the rows where the planner over-reserves
    model=${2:-llama3-8b}; tokens=${3:-131072}
    run "longctx_memory_$model" 420 python3 -m benchmarks.longctx --model "$model" --modes offload --tokens "$tokens" \
      --doc-tokens 8192 --memory-profile --time-budget 400 --out "$OUT/longctx_memory_$model.json" ;;
  longctx-overhead)
    run longctx_overhead 180 python3 -m benchmarks.longctx --modes ckpt offload_all --tokens 8192 32768 \
      --doc-tokens 8192 --repeats 3 --time-budget 140 --out "$OUT/longctx_overhead.json" ;;
  longctx-sweep)
    run longctx_sweep 560 python3 -m benchmarks.longctx --modes baseline ckpt offload \
      --tokens 8192 32768 65536 131072 262144 409600 --ckpt-max-tokens 409600 --doc-tokens 8192 \
      --time-budget 470 --out "$OUT/longctx_sweep.json" ;;
  attention)
    run attention 150 python3 -m benchmarks.attention_backends --out "$OUT/attention.json" ;;
  kernels)
    run kernels 120 python3 -m benchmarks.kernels --out "$OUT/kernels.json" ;;
  small-rows)  # the two small-model figures in one call
    "$0" loss-curve
    "$0" sft-full ;;
  verify)  # CUDA tests, kernel table, the GRPO step with and without the engine's fused layers
    "$0" check
    "$0" kernels
    run grpo_step_unfused 120 python3 -m benchmarks.grpo --completion-tokens 4096 --steps 2 --no-fused-layers \
      --out "$OUT/grpo_step_unfused.json"
    run grpo_step 120 python3 -m benchmarks.grpo --completion-tokens 4096 --steps 2 --out "$OUT/grpo_step.json" ;;
  multi-gpu-resume)  # (kind nvidia-h200-x2) FSDP2 through the Trainer, full FT: checkpoints of 2 GPUs resumed on
    # 1 and back equal the uninterrupted runs (tests/test_distributed_resume.py; three torchrun launches, ~2-3 min)
    run multi_gpu_resume 300 python3 -m pytest -rs -s tests/test_distributed_resume.py -p no:cacheprovider \
      -k fsdp2_checkpoints ;;
  decode-kernels)  # the MoE and FP8 decode kernels in one call: the MoE decode kernels' compiled tests with the engine
    # and GRPO cases of MoE / gpt-oss / VL fixed on 2026-12-02, one 30B-A3B layer (kernel vs grouped_mm vs HBM floor),
    # the engine on Qwen3-30B-A3B with the kernels (G 8/64, N 1024, no baselines: moe-rollout's table has them), then
    # the FP8 x FP8 decode kernel's tests and the decode matmul table (~9.5 min; pytest stops itself with SIGINT)
    run recheck_tests 175 timeout -s INT 170 python3 -m pytest -rf -p no:cacheprovider tests/test_moe_decode_kernel.py \
      tests/test_moe_rollout.py::test_grpo_step_on_the_fast_engine_with_moe tests/test_gptoss_rollout.py \
      "tests/test_moe_rollout.py::test_cuda_graph_decode_equals_eager_bf16" \
      tests/test_vl_fast_rollout.py::test_cuda_graph_replay_equals_eager_and_transformers tests/test_vl_moe_grpo_router.py \
      tests/test_cli_errors.py::test_unknown_option_from_the_real_entry_point_exits_2_without_traceback \
      tests/test_cli_errors.py::test_other_libraries_info_logs_stay_quiet
    run moe_decode 80 python3 -m benchmarks.moe_decode --out "$OUT/moe_decode.json"
    run moe_rollout_kernel 150 python3 -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 --new-tokens 1024 \
      --no-baselines --lora-rows --time-budget 125 --out "$OUT/rollout_moe_kernel.json"
    run fp8_dot_tests 75 timeout -s INT 70 python3 -m pytest -rf tests/test_fp8_dot.py -p no:cacheprovider
    run fp8_matmul_kernels 100 python3 -m benchmarks.kernels --fp8-matmul --out "$OUT/kernels_fp8_matmul.json" ;;
  per-rank-memory)  # (kind nvidia-h200-x2) each rank's pinned host budget is the host's over its 2 ranks and the GPU
    # reserve counts FSDP2's local shards (tests/test_per_rank_memory.py: one NCCL and one gloo torchrun launch, ~1 min)
    run per_rank_memory 180 python3 -m pytest -rs -s tests/test_per_rank_memory.py -p no:cacheprovider ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
