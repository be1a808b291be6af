"""The published figures: which raw JSON under ``docs/results/`` each comes from, the command that
measured it (as ``python -m benchmarks.NAME``), its date and the versions of the machine.

``python -m benchmarks.results import`` turns this list into ``docs/results/results.jsonl``;
``python -m benchmarks.report`` renders that file's tables into ``docs/benchmarks.md``. A new
figure is a new entry here (or a replaced ``file``/``command``/``date``) and a line in CHANGELOG.md.

``before_qk_fix``: measured before the fix that gave Qwen3 / Gemma 3 ``q_proj``, ``k_proj``,
``q_norm`` and ``k_norm`` their gradients, and not measured again: swiftune's rows of such a figure
carry ``settings["before_qk_fix"]`` and are marked in the tables (an upper bound on speed).
"""

from __future__ import annotations

BASE = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0", "peft": "0.21.0"}
WITH_TRL = {**BASE, "trl": "1.16.0", "liger": "0.8.5"}
WITH_UNSLOTH = {**BASE, "unsloth": "2026.10.9"}

SFT = "python -m benchmarks.sft --steps 10 --warmup 3"
GRPO_65K_ATTN = ("python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune --share-prompt "
                 "--swiftune-checkpointing offload_all --attention-output-layers")
UNSLOTH_SFT = "python -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16"
GRAPHED_B16 = "python -m benchmarks.sft --model qwen3-8b --batch 16"
GPTOSS_ENGINE = ("python -m benchmarks.rollout --model gpt-oss-20b --rows 8 64 --new-tokens 1024 --no-baselines "
                 "--time-budget 180 --out rollout_gptoss_kernel.json")
GRPO_24GB = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.grpo --bisect-completion "
             "--model qwen3-8b --bisect-modes swiftune --share-prompt --gpu-budget-gb 24")
QLORA_GRPO_AT = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.grpo --bisect-completion "
                 "--model qwen3-8b --bisect-modes swiftune --share-prompt --load-in-4bit --gpu-budget-gb 80 "
                 "--completion-lengths")
UNSLOTH_QLORA_GRPO = ("python -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b --4bit --gpu-budget-gb 80 "
                      "--model-dir /tmp/ck8b")
QLORA_GRPO_80GB = "2026-12-06/qlora_grpo_80gb_side_by_side_qwen3-8b_h100.json"
QLORA_GRPO_MERGE = ("python -m benchmarks.merge_bisect --out qlora_grpo_80gb.json qlora_grpo_at.json:swiftune "
                    "qlora_grpo_at_354816.json:swiftune=+swiftune unsloth_at_86016.json:unsloth "
                    "unsloth_at_94208.json:unsloth=+unsloth")
MOE_SFT = "python -m benchmarks.sft --model"
GPTOSS_GRPO = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.grpo --bisect-completion "
               "--model gpt-oss-20b --share-prompt --gpu-budget-gb 80")
GPTOSS_GRPO_80GB = "2026-12-07/grpo_gptoss_80gb_gpt-oss-20b_272k_h100.json"
GPTOSS_GRPO_MERGE = ("python -m benchmarks.merge_bisect --out grpo_gptoss_80gb.json gptoss_grpo.json:swiftune "
                     "gptoss_grpo_at_80.json:swiftune=+swiftune gptoss_grpo_at_80_235008.json:swiftune=+swiftune "
                     "gptoss_grpo_at_80_246784.json:swiftune=+swiftune gptoss_grpo_at_80_259072.json:swiftune=+swiftune "
                     "gptoss_grpo_trl.json:trl_grpo && python -m benchmarks.merge_bisect --out grpo_gptoss_80gb_272k.json "
                     "grpo_gptoss_80gb.json:swiftune,trl_grpo gptoss_grpo_at_80_272128.json:swiftune=+swiftune")
VL_GRPO_24GB = "python -m benchmarks.vl grpo --model qwen3-vl-8b --load-in-4bit --gpu-budget-gb 24 --checkpoint /tmp/vl8b_ckpt"


def _modes(*modes):
    return lambda row: row.mode in modes


def _moe_routing(file: str, label: str, flags: str) -> dict:
    """A ``rollout_moe`` file of the 2026-12-06 routing A/B (one H100 80GB, one call): Qwen3-30B-A3B, G 8 and 64,
    the routing options ``flags``, profiled for 256 more tokens."""
    return dict(figure="rollout_moe", file=f"2026-12-06/{file}", date="2026-12-06", versions=BASE,
                gpu="NVIDIA H100 80GB HBM3",
                settings={"experts": f"decode kernels <= 16 tokens (G=64: grouped GEMM), {label}, routing A/B call"},
                command="python -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 --new-tokens 1024 "
                        f"--no-baselines --no-checks --lora-rows --profile-steps 256 {flags} --decode-attention sdpa "
                        "--time-budget 150 "
                        f"--out {file.removesuffix('_h100.json')}.json")


def _moe_sft(file: str, model: str, out: str, extra: str = "", date: str = "2026-12-06", call: str = "",
             steps: int = 8) -> dict:
    """A ``sft_moe_b16`` file (one H100 80GB): batch 16, swiftune, TRL and TRL + Liger, each mode in its own
    process; ``extra``: more options of the command, ending in a space; ``call``: a later call's label."""
    return dict(figure="sft_moe_b16", file=f"{date}/{file}", date=date, versions=WITH_TRL,
                gpu="NVIDIA H100 80GB HBM3", **({"settings": {"call": call}} if call else {}),
                command=f"{MOE_SFT} {model} --batch 16 --steps {steps} --warmup 3 --modes swiftune trl_padding_free "
                        f"trl_liger {extra}--out {out}")


def _not_rows(rows: int):
    """Every row of a rollout figure's file but those of ``rows`` sequences (measured again later)."""
    return lambda row: row.settings.get("rows") != rows


FIGURES: list[dict] = [
    dict(figure="kernels", file="kernels_h200.json", date="2026-11-30", versions=BASE,
         command="python -m benchmarks.kernels --out kernels.json"),
    dict(figure="sft_qwen3-8b_b16", file="2026-12-01/sft_qwen3-8b_b16_fused_lora_h200.json", date="2026-12-01",
         versions=WITH_TRL,
         command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune swiftune_peft_lora trl_liger "
                 "--out sft_b16.json"),
    dict(figure="sft_qwen3-8b_b16", file="2026-12-01/unsloth_sft_qwen3-8b_b16_h200.json", date="2026-12-01",
         versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --out unsloth_sft.json"),
    dict(figure="sft_qwen3-8b_b16", file="2026-12-01/sft_qwen3-8b_b16_after_qk_fix_h200.json", date="2026-12-01",
         versions=WITH_TRL, keep=_modes("swiftune_budget"),
         command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune swiftune_budget trl_liger "
                 "--out sft_qwen3-8b_b16.json"),
    dict(figure="sft_qwen3-8b_b16", file="2026-12-01/sft_qwen3-8b_b16_after_qk_fix_h200.json", date="2026-12-01",
         versions=WITH_TRL, keep=_modes("hf_padded"),
         command=f"{SFT} --model qwen3-8b --batch 16 --modes hf_padded --out sft_hf.json"),
    dict(figure="sft_qwen3-8b_b16", file="2026-12-01/sft_qwen3-8b_16k_offload_after_qk_fix_h200.json",
         date="2026-12-01", versions=WITH_TRL,
         command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune_budget_offload --out sft_16k.json"),
    dict(figure="sft_graphs_qwen3-8b", file="2026-12-02/sft_graphs_qwen3-8b_b16_h200.json", date="2026-12-02",
         versions=BASE,
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --modes swiftune "
                 "swiftune_graphs --out sft_graphs_b16.json"),
    dict(figure="sft_graphs_qwen3-8b", file="2026-12-02/sft_graphs_qwen3-8b_16k_h200.json", date="2026-12-02",
         versions=BASE,
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 22 --warmup 8 --modes swiftune_budget "
                 "swiftune_budget_graphs --out sft_graphs_16k.json"),
    # one device call: swiftune eager and graphed, TRL + Liger, Unsloth (its padding-free row; the process reached
    # its 230 s limit before the packed mode, so the file holds the row it printed, copied from the call's log)
    dict(figure="sft_graphs_side_by_side_qwen3-8b", file="2026-12-02/sft_graphs_side_by_side_qwen3-8b_b16_h200.json",
         date="2026-12-02", versions=BASE,
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --time-profile "
                 "--modes swiftune swiftune_graphs --out sft_graphs_b16.json"),
    dict(figure="sft_graphs_side_by_side_qwen3-8b", file="2026-12-02/sft_trl_liger_side_by_side_qwen3-8b_b16_h200.json",
         date="2026-12-02", versions=WITH_TRL,
         command=f"{SFT} --model qwen3-8b --batch 16 --modes trl_liger --out sft_trl_b16.json"),
    dict(figure="sft_graphs_side_by_side_qwen3-8b",
         file="2026-12-02/unsloth_sft_side_by_side_qwen3-8b_b16_from_log_h200.json", date="2026-12-02",
         versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --steps 12 "
                 "--out unsloth_sft.json"),
    # session 21, one device call: the same row after the graphed layers' gradient buffers became one set per
    # layer (shared by every token bucket), beside TRL + Liger and Unsloth (padding-free and packed)
    dict(figure="sft_graphs_shared_buffers_qwen3-8b",
         file="2026-12-02/sft_graphs_shared_buffers_qwen3-8b_b16_h200.json", date="2026-12-02", versions=BASE,
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --time-profile "
                 "--modes swiftune swiftune_graphs --out sft_graphs_b16.json"),
    dict(figure="sft_graphs_shared_buffers_qwen3-8b",
         file="2026-12-02/sft_trl_liger_shared_buffers_call_qwen3-8b_b16_h200.json", date="2026-12-02",
         versions=WITH_TRL, command=f"{SFT} --model qwen3-8b --batch 16 --modes trl_liger --out sft_trl_b16.json"),
    dict(figure="sft_graphs_shared_buffers_qwen3-8b",
         file="2026-12-02/unsloth_sft_shared_buffers_call_qwen3-8b_b16_h200.json", date="2026-12-02",
         versions=WITH_UNSLOTH, command=f"{UNSLOTH_SFT} --steps 12 --out unsloth_sft.json"),
    # one H100 80GB call (scripts/gpu_suite.sh sft-graphs-memory): Unsloth padding-free and packed, then the graphed
    # row with the NaN/inf check deferred and the loss in 256-token chunks (its try on an 18.4 GB budget ran out of
    # memory: raw sft_graphs_18gb_qwen3-8b_s48_h100.json, no rows)
    dict(figure="sft_graphs_memory_qwen3-8b", file="2026-12-06/sft_graphs_chunk256_qwen3-8b_s48_h100.json",
         date="2026-12-06", versions=BASE, gpu="NVIDIA H100 80GB HBM3",
         command=f"{GRAPHED_B16} --steps 70 --warmup 30 --deferred-nonfinite-check --logit-chunk-tokens 256 "
                 "--modes swiftune_graphs --out sft_graphs_chunk256.json"),
    dict(figure="sft_graphs_memory_qwen3-8b", file="2026-12-06/unsloth_sft_qwen3-8b_s48_h100.json",
         date="2026-12-06", versions=WITH_UNSLOTH, gpu="NVIDIA H100 80GB HBM3",
         command=f"{UNSLOTH_SFT} --steps 12 --out unsloth_sft.json"),
    # three calls on one warm H100 80GB: the graphed batch-16 step against itself with the layer inputs in pinned host
    # buffers (SFTConfig(cuda_graph_layers=True, activation_offloading=True)), 12 and 36 steps, each mode its own
    # process; then the host-input row alone at the settings of sft_graphs_memory_qwen3-8b (70 steps after 30)
    *[dict(figure="sft_graphs_host_qwen3-8b", file=f"2026-12-07/{out}_h100.json", date="2026-12-07", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           command=f"{GRAPHED_B16} --steps {steps} --warmup {warmup} --deferred-nonfinite-check "
                   f"--logit-chunk-tokens 256 --modes {modes} --out {out}.json")
      for out, steps, warmup, modes in (
          ("sft_graphs_host_ab_qwen3-8b_s12", 12, 6, "swiftune_graphs swiftune_host_graphs"),
          ("sft_graphs_host_ab_qwen3-8b_s36", 36, 18, "swiftune_graphs swiftune_host_graphs"),
          ("sft_host_graphs_qwen3-8b_s70", 70, 30, "swiftune_host_graphs"))],
    # three calls on one warm H100 80GB (2026-12-07, later): A, scripts/gpu_suite.sh sft-graphs-host (Unsloth padding-free
    # and packed, 12 steps; then the graphed row with its inputs on the GPU and on the host, 70 steps after 30); B,
    # Unsloth padding-free again and the host-input row over 200 steps after 100; C, Unsloth padding-free over 66 steps
    *[dict(figure="sft_graphs_host_unsloth_qwen3-8b", file=f"2026-12-07/{file}_h100.json", date="2026-12-07",
           versions=versions, gpu="NVIDIA H100 80GB HBM3", settings={"call": call, "run_steps": run_steps},
           command=command)
      for file, call, run_steps, versions, command in (
          ("unsloth_sft_host_call_qwen3-8b_s12", "A", 12, WITH_UNSLOTH, f"{UNSLOTH_SFT} --steps 12 --out unsloth_sft.json"),
          ("sft_graphs_host_call_qwen3-8b_s70", "A", 70, BASE,
           f"{GRAPHED_B16} --steps 70 --warmup 30 --deferred-nonfinite-check --logit-chunk-tokens 256 "
           "--modes swiftune_graphs swiftune_host_graphs --out sft_graphs_host.json"),
          ("unsloth_sft_host_call2_qwen3-8b_s12", "B", 12, WITH_UNSLOTH,
           f"{UNSLOTH_SFT} --steps 12 --modes unsloth --out unsloth_sft_long.json"),
          ("sft_host_graphs_qwen3-8b_s200", "B", 200, BASE,
           f"{GRAPHED_B16} --steps 200 --warmup 100 --deferred-nonfinite-check --logit-chunk-tokens 256 "
           "--modes swiftune_host_graphs --out sft_graphs_host_long.json"),
          ("unsloth_sft_qwen3-8b_s70", "C", 66, WITH_UNSLOTH,
           f"{UNSLOTH_SFT} --steps 66 --warmup 4 --modes unsloth --out unsloth_sft_66.json"))],
    # one device call (scripts/gpu_suite.sh sft-deferred): the graphed batch-16 step with the NaN/inf guards' host
    # waits and with the check deferred, each profiled once and timed over 70 steps, every run its own process
    *[dict(figure="sft_deferred_check_qwen3-8b", file=f"2026-12-05/{out}_qwen3-8b_b16_h200.json",
           date="2026-12-05", versions=BASE,
           command=f"{GRAPHED_B16} --steps {steps} --warmup 30{flags} --modes swiftune_graphs --out {out}.json")
      for out, steps, flags in (("sft_graphs_sync_profile", 34, " --time-profile"),
                                ("sft_graphs_deferred_profile", 34,
                                 " --time-profile --deferred-nonfinite-check"),
                                ("sft_graphs_sync", 70, ""),
                                ("sft_graphs_deferred", 70, " --deferred-nonfinite-check"))],
    # one device call: the 16K-token row on a 20.7 GB GPU (Unsloth's packed peak) beside the unconstrained row
    # and Unsloth's rows (the automatic-budget mode ran out of memory: its row is in the raw file, not here)
    dict(figure="sft_16k_fit_qwen3-8b", file="2026-12-02/sft_16k_fit_qwen3-8b_h200.json", date="2026-12-02",
         versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --gpu-budget-gb 20.7 --modes swiftune_budget_fit "
                 "swiftune_budget_offload --out sft_16k_fit.json"),
    dict(figure="sft_16k_fit_qwen3-8b", file="2026-12-02/sft_16k_unconstrained_qwen3-8b_h200.json", date="2026-12-02",
         versions=BASE, command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune_budget --out sft_16k.json"),
    dict(figure="sft_16k_fit_qwen3-8b", file="2026-12-02/unsloth_sft_16k_fit_call_qwen3-8b_h200.json",
         date="2026-12-02", versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --steps 12 "
                 "--out unsloth_sft.json"),
    # a second device call of the same row: the automatic budget after the memory-fraction fix (it kept no
    # layer input on the GPU: the margin is larger than what the 20.7 GB leave), beside Unsloth's packed row only
    dict(figure="sft_16k_fit_second_call_qwen3-8b", file="2026-12-02/sft_16k_fit_second_call_qwen3-8b_h200.json",
         date="2026-12-02", versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --gpu-budget-gb 20.7 --modes swiftune_budget_fit "
                 "swiftune_budget_offload --out sft_16k_fit.json"),
    dict(figure="sft_16k_fit_second_call_qwen3-8b",
         file="2026-12-02/unsloth_sft_packed_16k_fit_second_call_qwen3-8b_h200.json", date="2026-12-02",
         versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --steps 12 "
                 "--modes unsloth_packed --out unsloth_sft_packed.json"),
    dict(figure="sft_sweep_qwen3-8b", file="2026-12-01/sft_qwen3-8b_sweep_h200.json", date="2026-12-01",
         versions=WITH_TRL, command=f"{SFT} --model qwen3-8b --batch 1 2 4 8 16 32 --out sft_qwen3-8b.json"),
    dict(figure="qlora_sft_qwen3-8b", file="2026-12-01/qlora_sft_qwen3-8b_b16_h200.json", date="2026-12-01",
         versions=WITH_TRL,
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-4bit --modes swiftune swiftune_budget trl_liger "
                 "--out qlora_sft.json"),
    dict(figure="qlora_sft_qwen3-8b", file="2026-12-01/unsloth_qlora_sft_qwen3-8b_b16_h200.json", date="2026-12-01",
         versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --4bit "
                 "--out unsloth_qlora_sft.json"),
    dict(figure="qlora_sft_qwen3-8b", file="2026-12-01/qlora_sft_qwen3-8b_16k_24gb_h200.json", date="2026-12-01",
         versions=BASE,
         command="python -m benchmarks.sft --steps 6 --warmup 2 --model qwen3-8b --batch 16 --load-in-4bit "
                 "--gpu-budget-gb 24 --modes swiftune_budget swiftune_budget_offload --out qlora_sft_24gb.json"),
    # QLoRA batch 16 at <= Unsloth --4bit's peak: every layer input on the host (one call: the tiled MLP that
    # offloading switches on, then untiled in a second call, each beside Unsloth)
    dict(figure="qlora_sft_offload_qwen3-8b", file="2026-12-03/qlora_sft_offload_qwen3-8b_b16_s26_h200.json",
         date="2026-12-03", versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-4bit --modes swiftune swiftune_offload "
                 "--out qlora_sft_offload.json"),
    dict(figure="qlora_sft_offload_qwen3-8b", file="2026-12-03/unsloth_qlora_sft_offload_call_s26_h200.json",
         date="2026-12-03", versions=WITH_UNSLOTH, command=f"{UNSLOTH_SFT} --4bit --out unsloth_qlora_sft.json"),
    dict(figure="qlora_sft_untiled_qwen3-8b", file="2026-12-03/qlora_sft_untiled_qwen3-8b_b16_s26_h200.json",
         date="2026-12-03", versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-4bit --modes swiftune_offload_untiled "
                 "--out qlora_sft_untiled.json"),
    dict(figure="qlora_sft_untiled_qwen3-8b", file="2026-12-03/unsloth_qlora_sft_untiled_call_s26_h200.json",
         date="2026-12-03", versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --4bit --modes unsloth --out unsloth_qlora_sft.json"),
    dict(figure="qlora_sft_16k_untiled_qwen3-8b", file="2026-12-03/qlora_sft_16k_untiled_qwen3-8b_s26_h200.json",
         date="2026-12-03", versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-4bit --modes swiftune_budget_offload_untiled "
                 "swiftune_budget_offload --out qlora_sft_16k_untiled.json"),
    # 2026-12-04, one device call (gpu_suite qlora-sft-16k): the 16K-token row, every layer input on the host and
    # the MLP untiled, beside Unsloth --4bit's packed rows (16 x 1,024) in its own process
    dict(figure="qlora_sft_16k_unsloth_qwen3-8b", file="2026-12-04/qlora_sft_16k_qwen3-8b_s28_h200.json",
         date="2026-12-04", versions=BASE,
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-4bit --modes swiftune_budget_offload_untiled "
                 "--out qlora_sft_16k.json"),
    dict(figure="qlora_sft_16k_unsloth_qwen3-8b", file="2026-12-04/unsloth_qlora_packed_16k_call_s28_h200.json",
         date="2026-12-04", versions=WITH_UNSLOTH,
         command=f"{UNSLOTH_SFT} --4bit --modes unsloth_packed --out unsloth_qlora_packed.json"),
    dict(figure="sft_sweep_llama3-8b", file="sft_llama3-8b_sweep_h200.json", date="2026-11-30", versions=WITH_TRL,
         command=f"{SFT} --model llama3-8b --batch 1 2 4 8 16 32 --out sft_llama3-8b.json"),
    dict(figure="sft_sweep_qwen3-1.7b", file="2026-12-01/sft_qwen3-1.7b_sweep_h200.json", date="2026-12-01",
         versions=WITH_TRL,
         command=f"{SFT} --model qwen3-1.7b --batch 1 2 4 8 16 32 --modes hf_padded trl_padding_free trl_liger "
                 "swiftune --out sft_qwen3-1.7b.json"),
    dict(figure="sft_sweep_qwen3-0.6b", file="2026-12-01/sft_qwen3-0.6b_sweep_h200.json", date="2026-12-01",
         versions=WITH_TRL,
         command=f"{SFT} --model qwen3-0.6b --batch 1 2 4 8 16 32 --modes hf_padded trl_padding_free trl_liger "
                 "swiftune --out sft_qwen3-0.6b.json"),
    dict(figure="sft_full_qwen3-0.6b", file="2026-12-01/sft_qwen3-0.6b_full_h200.json", date="2026-12-01",
         versions=WITH_TRL, command=f"{SFT} --model qwen3-0.6b --batch 16 --full --out sft_qwen3-0.6b_full.json"),
    dict(figure="loss_curve", file="2026-12-01/loss_curve_after_qk_fix_h200.json", date="2026-12-01", versions=BASE,
         command="python -m benchmarks.loss_curve --out loss_curve.json"),
    dict(figure="grpo_65k", file="grpo_65k_trl_h200.json", date="2026-11-30", versions=WITH_TRL,
         command="python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes trl_grpo "
                 "--completion-lengths 65536 --fixed-only --trial-repeats 2 --time-budget 190 --out grpo_65k_trl.json"),
    dict(figure="grpo_65k", file="2026-12-01/grpo_65k_swiftune_after_qk_fix_h200.json", date="2026-12-01",
         versions=BASE,
         command="python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune --share-prompt "
                 "--swiftune-checkpointing offload_all --completion-lengths 65536 --fixed-only --trial-repeats 2 "
                 "--time-budget 480 --out grpo_65k_swiftune.json"),
    # issue 23's GRPO row with the attention outputs kept through the recompute (0 and 36 layers: two calls)
    dict(figure="grpo_65k_attn", file="2026-12-03/grpo_65k_attn0_s25_h200.json", date="2026-12-03", versions=BASE,
         command="python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune --share-prompt "
                 "--swiftune-checkpointing offload_all --attention-output-layers 0 --completion-lengths 65536 "
                 "--fixed-only --trial-repeats 2 --time-budget 190 --out grpo_65k_attn0.json"),
    dict(figure="grpo_65k_attn", file="2026-12-03/grpo_65k_attn36_s26_h200.json", date="2026-12-03", versions=BASE,
         command="python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune --share-prompt "
                 "--swiftune-checkpointing offload_all --attention-output-layers 36 --completion-lengths 65536 "
                 "--fixed-only --trial-repeats 2 --time-budget 190 --out grpo_65k_attn36.json"),
    dict(figure="grpo_largest", file="grpo_figure3_qwen3-8b_h200.json", date="2026-11-30", versions=WITH_TRL,
         keep=_modes("hf_full_logits", "trl_grpo", "trl_liger"),
         command="python -m benchmarks.merge_bisect --out docs/results/grpo_figure3_qwen3-8b_h200.json "
                 "docs/results/grpo_bisect_qwen3-8b_h200.json:hf_full_logits,trl_grpo,trl_liger "
                 "docs/results/grpo_edge_qwen3-8b_h200.json:swiftune "
                 "docs/results/grpo_edge_planner_qwen3-8b_h200.json:swiftune=+swiftune "
                 "docs/results/grpo_65k_swiftune_h200.json:swiftune=swiftune_offload_all"),
    # the fit measured again after the q/k fix; the first failure (2 x 398,848) is the 2026-11-30 run's refusal
    # before any step (its offloaded checkpoints need 236.8 GB of pinned host memory), arithmetic the fix
    # does not change; the trial JSON was written from its log (the second length outlived the session)
    dict(figure="grpo_largest", file="2026-12-01/grpo_largest_swiftune_after_qk_fix_h200.json", date="2026-12-01",
         versions=BASE, keep=_modes("swiftune"),
         command="python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune "
                 "--share-prompt --completion-lengths 380928 398848 --fixed-only --time-budget 2700 "
                 "--out grpo_edge.json && python -m benchmarks.merge_bisect --out "
                 "docs/results/2026-12-01/grpo_largest_swiftune_after_qk_fix_h200.json "
                 "docs/results/2026-12-01/grpo_edge_380928_after_qk_fix_h200.json:swiftune "
                 "docs/results/grpo_edge_planner_qwen3-8b_h200.json:swiftune=+swiftune "
                 "docs/results/2026-12-01/grpo_65k_swiftune_after_qk_fix_h200.json:swiftune=swiftune_offload_all"),
    dict(figure="grpo_step", file="2026-12-01/grpo_step_after_qk_fix_h200.json", date="2026-12-01", versions=BASE,
         command="python -m benchmarks.grpo --completion-tokens 4096 --steps 2 --out grpo.json"),
    # 2026-12-04, one detached run (gpu_suite grpo-e2e qwen3-1.7b): each tool in its own process, one after the
    # other; the third tool's (Unsloth) process was stopped for device time, so its row is not here
    dict(figure="grpo_e2e_qwen3-1.7b", file="2026-12-04/grpo_e2e_qwen3-1.7b_s30_h200.json", date="2026-12-04",
         versions={**BASE, "trl": "1.16.0"},
         command="python -m benchmarks.grpo_e2e --model qwen3-1.7b --modes swiftune trl unsloth --shared .shared "
                 "--out /tmp/grpo_e2e.json"),
    dict(figure="longctx_sweep_qwen3-8b", file="2026-12-01/longctx_qwen3-8b_sweep_after_qk_fix_h200.json",
         date="2026-12-01", versions=BASE,
         command="python -m benchmarks.longctx --modes baseline ckpt offload --tokens 8192 32768 65536 131072 "
                 "262144 409600 --ckpt-max-tokens 409600 --doc-tokens 8192 --time-budget 470 --out longctx_sweep.json"),
    dict(figure="longctx_sweep_qwen3-8b", file="2026-12-02/longctx_qwen3-8b_400k_single_after_qk_fix_h200.json",
         date="2026-12-02", versions=BASE, settings={"run": "one sequence"},
         command="python -m benchmarks.longctx --model qwen3-8b --modes offload --tokens 409600 --doc-tokens 0 "
                 "--repeats 1 --time-budget 5000 --out longctx_bisect.json"),
    dict(figure="longctx_largest", file="longctx_trl_llama3-8b_h200.json", date="2026-11-30", versions=WITH_TRL,
         command="python -m benchmarks.longctx --model llama3-8b --modes trl_liger --tokens 32768 65536 "
                 "--bracket-from-fit --doc-tokens 0 --bisect trl_liger --bisect-granularity 8192 --bisect-tol 0.05 "
                 "--time-budget 520 --out longctx_trl_llama3-8b.json"),
    dict(figure="longctx_largest", file="longctx_bisect_llama3-8b_sdpa_h200.json", date="2026-11-30", versions=BASE,
         command="python -m benchmarks.longctx --model llama3-8b --modes offload --tokens-from-planner "
                 "--doc-tokens 8192 --bisect offload --bisect-tol 0.05 --time-budget 900 --out longctx_bisect.json"),
    dict(figure="longctx_largest", file="longctx_llama3-8b_400k_single_h200.json", date="2026-11-30", versions=BASE,
         command="python -m benchmarks.longctx --model llama3-8b --modes offload --tokens 409600 --doc-tokens 0 "
                 "--repeats 1 --time-budget 5000 --out longctx_llama3-8b_400k_single.json"),
    dict(figure="longctx_largest", file="longctx_trl_qwen3-8b_h200.json", date="2026-11-30", versions=WITH_TRL,
         command="python -m benchmarks.longctx --model qwen3-8b --modes trl_liger --tokens 32768 65536 "
                 "--bracket-from-fit --doc-tokens 0 --bisect trl_liger --bisect-granularity 8192 --bisect-tol 0.05 "
                 "--time-budget 520 --out longctx_trl_qwen3-8b.json"),
    dict(figure="longctx_largest", file="2026-12-01/longctx_bisect_qwen3-8b_h200.json", date="2026-12-01",
         versions=BASE,
         command="python -m benchmarks.longctx --model qwen3-8b --modes offload --tokens-from-planner "
                 "--doc-tokens 8192 --bisect offload --bisect-tol 0.05 --time-budget 520 --out longctx_bisect.json"),
    dict(figure="longctx_largest", file="2026-12-02/longctx_qwen3-8b_400k_single_after_qk_fix_h200.json",
         date="2026-12-02", versions=BASE,
         command="python -m benchmarks.longctx --model qwen3-8b --modes offload --tokens 409600 --doc-tokens 0 "
                 "--repeats 1 --time-budget 5000 --out longctx_bisect.json"),
    dict(figure="rollout", file="rollout_h200.json", date="2026-11-30", versions=BASE,
         command="python -m benchmarks.rollout --merge docs/results/rollout_1024_h200.json "
                 "docs/results/rollout_8192_h200.json --out docs/results/rollout_h200.json"),
    dict(figure="rollout_fp8", file="2026-12-02/rollout_fp8_bf16_h200.json", date="2026-12-02", versions=BASE,
         keep=_not_rows(64),
         command="python -m benchmarks.rollout --model qwen3-8b --rows 8 64 --new-tokens 1024 --no-baselines "
                 "--no-checks --lora-rows --time-budget 170 --out rollout_fp8_bf16.json"),
    dict(figure="rollout_fp8", file="2026-12-02/rollout_fp8_h200.json", date="2026-12-02", versions=BASE,
         keep=_not_rows(64),
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 64 --new-tokens 1024 "
                 "--no-baselines --lora-rows 8 --time-budget 270 --out rollout_fp8.json"),
    # G=64 again, later the same day: FP8 x FP8 kernel at 17-64 rows, one activation quantisation per shared input
    dict(figure="rollout_fp8", file="2026-12-02/rollout_g64_bf16_shared_quant_h200.json", date="2026-12-02",
         versions=BASE,
         command="python -m benchmarks.rollout --model qwen3-8b --rows 64 --new-tokens 1024 --no-baselines "
                 "--no-checks --lora-rows --time-budget 80 --out rollout_g64_bf16.json"),
    dict(figure="rollout_fp8", file="2026-12-02/rollout_g64_fp8_shared_quant_h200.json", date="2026-12-02",
         versions=BASE,
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 64 --new-tokens 1024 "
                 "--no-baselines --no-checks --lora-rows --time-budget 90 --out rollout_g64_fp8.json"),
    # 2026-12-06, one H100 80GB (the H200 could not be started), three calls: q/k/v as one FP8 decode product over
    # their adjacent codes against three (scripts/gpu_suite.sh fp8-stacked-ab; one product is the engine's default
    # since), then bf16 beside the one product at G=64 and at G=8, each pair in one call; "x bf16" pairs a call's rows
    *(dict(figure="rollout_fp8", file=f"2026-12-06/{file}_h100.json", date="2026-12-06", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3", settings={"call": call, **({"qkv": qkv} if qkv else {})},
           command=f"python -m benchmarks.rollout --model qwen3-8b {flags}--rows {rows} --new-tokens 1024 "
                   f"--no-baselines --no-checks --lora-rows {extra}--time-budget {budget} --out {file}.json")
      for file, call, qkv, flags, rows, extra, budget in (
          ("rollout_fp8_no-stacked", "H100, q/k/v A/B", "three products", "--load-in-fp8 ", "8 64",
           "--profile-steps 256 --no-fp8-stacked-qkv ", 130),
          ("rollout_fp8_stacked", "H100, q/k/v A/B", "one product", "--load-in-fp8 ", "8 64",
           "--profile-steps 256 --fp8-stacked-qkv ", 130),
          ("rollout_g64_bf16_s44", "H100, G=64", "", "", "64", "", 80),
          ("rollout_g64_fp8_stacked", "H100, G=64", "one product", "--load-in-fp8 ", "64", "--fp8-stacked-qkv ", 90),
          ("rollout_g8_bf16_s44", "H100, G=8", "", "", "8", "", 80),
          ("rollout_g8_fp8_stacked", "H100, G=8", "one product", "--load-in-fp8 ", "8", "--fp8-stacked-qkv ", 90))),
    # a later H100 80GB call (scripts/gpu_suite.sh fp8-stacked-gate-up-ab): bf16, then FP8 with q/k/v as one product,
    # then gate/up as one product too (the engine's default since), the split decode attention reading only the
    # tiles with visible slots in all three
    *(dict(figure="rollout_fp8", file=f"2026-12-06/{file}_s45_h100.json", date="2026-12-06", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           settings={"call": "H100, gate/up A/B", **({"qkv": "one product", "gate_up": gate_up} if gate_up else {})},
           command=f"python -m benchmarks.rollout --model qwen3-8b {flags}--rows 8 64 --new-tokens 1024 "
                   f"--no-baselines --no-checks --lora-rows {extra}--time-budget {budget} --out {out}.json")
      for file, out, gate_up, flags, extra, budget in (
          ("rollout_fp8_bf16", "rollout_fp8_bf16", "", "", "", 110),
          ("rollout_fp8_stacked_qkv", "rollout_fp8_stacked_qkv", "one each", "--load-in-fp8 ",
           "--profile-steps 256 --fp8-stacked-qkv --no-fp8-stacked-gate-up ", 130),
          ("rollout_fp8_stacked_gate-up", "rollout_fp8_stacked_gate-up", "one product", "--load-in-fp8 ",
           "--profile-steps 256 --fp8-stacked-qkv --fp8-stacked-gate-up ", 130))),
    # a later H100 80GB call at G=64 (scripts/gpu_suite.sh fp8-norm-kv-ab): bf16, then FP8 with the q/k/v and gate/up
    # input codes from a separate quantise launch, from the residual add + norm kernel (the engine's default since),
    # and with those and the FP8 KV cache
    *(dict(figure="rollout_fp8", file=f"2026-12-06/{file}_s46_h100.json", date="2026-12-06", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           settings={"call": "H100, input codes / KV cache A/B",
                     **({"qkv": "one product", "gate_up": "one product", "codes": codes} if codes else {})},
           command=f"python -m benchmarks.rollout --model qwen3-8b {flags}--rows 64 --new-tokens 1024 "
                   f"--no-baselines --no-checks {extra}--time-budget {budget} --out {file}.json")
      for file, codes, flags, extra, budget in (
          ("rollout_g64_bf16", "", "", "", 95),
          ("rollout_g64_fp8_no-norm-codes", "a separate launch", "--load-in-fp8 ",
           "--profile-steps 256 --no-fp8-norm-codes --kv-cache-dtype auto ", 105),
          ("rollout_g64_fp8_norm-codes", "the norm kernel's", "--load-in-fp8 ",
           "--profile-steps 256 --fp8-norm-codes --kv-cache-dtype auto ", 105),
          ("rollout_g64_fp8_norm-codes-kv-fp8", "the norm kernel's", "--load-in-fp8 ",
           "--profile-steps 256 --fp8-norm-codes --kv-cache-dtype fp8 ", 105))),
    # a later H100 80GB call (scripts/gpu_suite.sh lora-decode-quick): FP8 runtime LoRA at G=8, 512 tokens, each
    # adapter's product from the torch ops, then from the two-launch kernel (the engine's default since); the
    # adapter-free row once, from the kernel's run (the same engine and settings in both)
    *(dict(figure="rollout_fp8", file=f"2026-12-06/rollout_lora_g8_fp8_{file}_s48_h100.json", date="2026-12-06",
           versions=BASE, gpu="NVIDIA H100 80GB HBM3", keep=keep,
           settings={"call": "H100, LoRA product A/B", "qkv": "one product", "gate_up": "one product",
                     "codes": "the norm kernel's", "lora_product": product},
           command="python -m benchmarks.rollout --model qwen3-8b --load-in-fp8 --rows 8 --new-tokens 512 "
                   f"--no-baselines --no-checks --lora-rows 8 --{flag} --time-budget 70 --out rollout_lora_fp8_{flag}.json")
      for file, product, flag, keep in (
          ("ops", "the torch ops", "no-lora-decode-kernel", _modes("fast_engine_lora")),
          ("two-launch-kernel", "the two-launch kernel", "lora-decode-kernel", None))),
    # a later H100 80GB call at G=64 (scripts/gpu_suite.sh fp8-g64-reduce-ab): bf16, then FP8 (the engine's defaults:
    # stacked q/k/v and gate/up, the norm kernel's codes, FP8 KV cache) with a split K's partial sums added by a
    # second launch (the default), then by each tile's last program in the product's own launch
    *(dict(figure="rollout_fp8", file=f"2026-12-07/{file}_s57_h100.json", date="2026-12-07", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           settings={"call": "H100, split-K reduce A/B",
                     **({"qkv": "one product", "gate_up": "one product", "codes": "the norm kernel's",
                         "split_k_reduce": reduce} if reduce else {})},
           command=f"python -m benchmarks.rollout --model qwen3-8b {flags}--rows 64 --new-tokens 1024 "
                   f"--no-baselines --no-checks {extra}--time-budget {budget} --out {out}.json")
      for file, out, reduce, flags, extra, budget in (
          ("rollout_g64_bf16", "rollout_g64_bf16", "", "", "", 95),
          ("rollout_g64_fp8_second-launch", "rollout_g64_fp8", "a second launch", "--load-in-fp8 ",
           "--kv-cache-dtype fp8 ", 105),
          ("rollout_g64_fp8_in-launch", "rollout_g64_fp8_in-launch", "in the product's launch", "--load-in-fp8 ",
           "--kv-cache-dtype fp8 --fp8-reduce-in-launch ", 105))),
    dict(figure="rollout_moe", file="2026-12-02/rollout_moe_h200.json", date="2026-12-02", versions=BASE,
         settings={"experts": "grouped GEMM"},
         command="python -m benchmarks.rollout --model qwen3-30b-a3b mixtral-8x7b --rows 8 64 --new-tokens 1024 "
                 "--baseline-kinds dynamic --baseline-steps 16 --lora-rows 8 --time-budget 300 --out rollout_moe.json"),
    # the decode kernels' run: its G=8 row only (the layer sends them at most 16 tokens since; its G=64 row,
    # the kernels at 64 tokens, is in the raw file and CHANGELOG.md)
    dict(figure="rollout_moe", file="2026-12-02/rollout_moe_decode_kernels_h200.json", date="2026-12-02",
         versions=BASE, settings={"experts": "decode kernels"}, keep=lambda r: r.settings.get("rows") == 8,
         command="python -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 --new-tokens 1024 --no-baselines "
                 "--lora-rows --time-budget 125 --out rollout_moe_kernel.json"),
    dict(figure="rollout_moe", file="2026-12-02/rollout_gptoss_h200.json", date="2026-12-02", versions=BASE,
         settings={"experts": "kernels <= 16 tokens, strided gate/up loads"},
         command="python -m benchmarks.rollout --model gpt-oss-20b --rows 8 64 --new-tokens 1024 --baseline-kinds "
                 "dynamic --baseline-steps 16 --lora-rows 8 --time-budget 300 --out rollout_gptoss.json"),
    # session 20: the decode kernels read gpt-oss's interleaved gate/up columns as one contiguous tile (the G=8
    # step; G=64 keeps the grouped GEMM, measured again); no generate baselines in this call
    dict(figure="rollout_moe", file="2026-12-02/rollout_gptoss_contiguous_tile_h200.json", date="2026-12-02",
         versions=BASE, settings={"experts": "kernels <= 16 tokens, one gate/up tile"},
         command=GPTOSS_ENGINE),
    # session 21, one device call: gpt-oss-20b's G=64 step with the decode kernels up to 64 tokens (64-row
    # tiles, 64 columns, depth 64, 4 warps) against the grouped GEMM (the cap of 16), same call
    dict(figure="rollout_moe", file="2026-12-02/rollout_gptoss_cap_ab_cap16_h200.json", date="2026-12-02",
         versions=BASE, settings={"experts": "kernels <= 16 tokens (G=64: grouped GEMM), A/B call"},
         keep=lambda r: r.settings.get("rows") == 64,
         command=GPTOSS_ENGINE),
    dict(figure="rollout_moe", file="2026-12-02/rollout_gptoss_cap_ab_cap64_h200.json", date="2026-12-02",
         versions=BASE, settings={"experts": "kernels <= 64 tokens, A/B call"},
         command="python -m benchmarks.rollout --model gpt-oss-20b --rows 64 --new-tokens 1024 --no-baselines "
                 "--no-checks --moe-decode-max-tokens 64 --time-budget 100 --out rollout_gptoss_kernel_cap64.json"),
    # 2026-12-06, one H100 80GB (the H200 could not be started): Qwen3-30B-A3B with the routers' softmax / top-k /
    # renormalisation in one Triton launch (swiftune.kernels.moe_router); the floor is this card's (its copy
    # bandwidth, 2.99 TB/s); then 256 more tokens profiled (raw JSON: fast.profile)
    dict(figure="rollout_moe", file="2026-12-06/rollout_moe_router_profile_h100.json", date="2026-12-06",
         versions=BASE, gpu="NVIDIA H100 80GB HBM3",
         settings={"experts": "decode kernels <= 16 tokens (G=64: grouped GEMM), router top-k kernel"},
         command="python -m benchmarks.rollout --model qwen3-30b-a3b --rows 8 64 --new-tokens 1024 --no-baselines "
                 "--no-checks --profile-steps 256 --time-budget 200 --out rollout_moe_profile.json"),
    # 2026-12-06, another H100 80GB, one detached chain (scripts/gpu_suite.sh moe-routing-ab, then moe-cap-ab):
    # Qwen3-30B-A3B with torch's routing ops, with the router top-k kernel, and with the route kernels too (the
    # grouped-GEMM path's sort and combine in one launch each: the default since); then the G=64 step with the
    # decode kernels up to 64 tokens against the cap of 16 (route kernels off, as then)
    *(_moe_routing(f"rollout_moe_{name}_h100.json", label, flags) for name, label, flags in (
        ("no-fused-routing", "torch's routing ops", "--no-moe-fused-routing --no-moe-route-kernels"),
        ("fused-routing", "router top-k kernel", "--moe-fused-routing --no-moe-route-kernels"),
        ("route-kernels", "router top-k + route kernels", "--moe-fused-routing --moe-route-kernels"))),
    *(dict(figure="rollout_moe", file=f"2026-12-06/rollout_moe_cap{cap}_h100.json", date="2026-12-06",
           versions=BASE, gpu="NVIDIA H100 80GB HBM3",
           settings={"experts": f"decode kernels <= {cap} tokens, router top-k kernel, cap A/B call"},
           command="python -m benchmarks.rollout --model qwen3-30b-a3b --rows 64 --new-tokens 1024 --no-baselines "
                   f"--no-checks --lora-rows --profile-steps 256 --moe-decode-max-tokens {cap} --no-moe-route-kernels "
                   f"--decode-attention sdpa --time-budget 120 --out rollout_moe_cap{cap}.json")
      for cap in (16, 64)),
    # later the same day, the same H100 (two calls after the chain): the engine's defaults since, together: the
    # router top-k and route kernels, the split decode attention (decode kernels up to 16 tokens, 64 on gpt-oss)
    *(dict(figure="rollout_moe", file=f"2026-12-06/{file}_h100.json", date="2026-12-06", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           settings={"experts": "router top-k + route kernels, split decode attention (the defaults)"},
           command=f"python -m benchmarks.rollout --model {model} --rows 8 64 --new-tokens 1024 --no-baselines "
                   f"--no-checks --lora-rows --time-budget {budget} --out {file}.json")
      for file, model, budget in (("rollout_moe_defaults", "qwen3-30b-a3b", 110),
                                  ("rollout_gptoss_defaults", "gpt-oss-20b", 70))),
    # a later session the same day, another H100 80GB (scripts/gpu_suite.sh moe-decode-defaults): the defaults
    # again, now with the route kernels' sort in two launches (a count per block of assignments, then each block
    # placed), each shape profiled for 256 more tokens
    *(dict(figure="rollout_moe", file=f"2026-12-06/{file}_sort2_h100.json", date="2026-12-06", versions=BASE,
           gpu="NVIDIA H100 80GB HBM3",
           settings={"experts": "router top-k + route kernels (two-launch sort), split decode attention "
                                "(the defaults)"},
           command=f"python -m benchmarks.rollout --model {model} --rows 8 64 --new-tokens 1024 --no-baselines "
                   f"--no-checks --lora-rows --profile-steps 256 --time-budget 150 --out rollout_{model}_defaults.json")
      for file, model in (("rollout_moe_defaults", "qwen3-30b-a3b"), ("rollout_gptoss_defaults", "gpt-oss-20b"))),
    # the same chain, first part (scripts/gpu_suite.sh decode-attention-ab): the decode step's attention through
    # SDPA and through the split kernel (swiftune.kernels.decode_attention; "auto", the default since, takes it
    # on CUDA), each shape and attention its own run, route kernels off (as then; they touch no timed MoE step
    # here: G=8 runs the decode kernels)
    *(dict(figure="rollout_decode_attention", file=f"2026-12-06/rollout_attention_{attention}_{model}_h100.json",
           date="2026-12-06", versions=BASE, gpu="NVIDIA H100 80GB HBM3", settings={"decode_attention": attention},
           command=f"python -m benchmarks.rollout --model {model} --rows {rows} --new-tokens 1024 --no-baselines "
                   f"--no-checks --lora-rows --profile-steps 256 --decode-attention {attention} --no-moe-route-kernels "
                   f"--time-budget 120 --out rollout_attention_{attention}_{model}.json")
      for model, rows in (("qwen3-8b", "8 64"), ("qwen3-30b-a3b", "8"), ("gpt-oss-20b", "8"))
      for attention in ("sdpa", "split")),
    # session 22, one device call: the engine decoding from NF4 (bitsandbytes) weights, LoRA r=16 at run time at
    # G=8, beside transformers' generate on the same 4-bit model
    dict(figure="rollout_nf4", file="2026-12-03/rollout_nf4_qwen3-8b_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "bitsandbytes"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --no-nf4-decode-kernel --rows 8 64 "
                 "--new-tokens 1024 --no-checks --lora-rows 8 --time-budget 480 --out rollout_nf4.json"),
    # session 25, one device call: the engine with swiftune's NF4 decode kernel (2-16 rows; G=64 stays on
    # bitsandbytes), then with bitsandbytes' path only, G 8/16 (the kernel's CUDA tests and its matmul table first)
    dict(figure="rollout_nf4", file="2026-12-03/rollout_nf4_kernel_s25_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "swiftune kernel (2-16 rows)"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --nf4-decode-kernel --rows 8 16 64 "
                 "--new-tokens 1024 --no-baselines --lora-rows 8 --time-budget 200 --out rollout_nf4_kernel.json"),
    dict(figure="rollout_nf4", file="2026-12-03/rollout_nf4_bnb_s25_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "bitsandbytes, same call"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --no-nf4-decode-kernel --rows 8 16 "
                 "--new-tokens 1024 --no-baselines --no-checks --time-budget 160 --out rollout_nf4_bnb.json"),
    # session 27, one device call: G=64 with the NF4 kernel bound to 64 rows, then to its default 16 (bitsandbytes'
    # dequantise-then-multiply above it)
    dict(figure="rollout_nf4", file="2026-12-03/rollout_nf4_g64_max64_s27_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "swiftune kernel bound to 64 rows"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 64 --nf4-decode-max-rows 64 "
                 "--new-tokens 1024 --no-baselines --no-checks --time-budget 80 --out rollout_nf4_g64_max64.json"),
    dict(figure="rollout_nf4", file="2026-12-03/rollout_nf4_g64_max16_s27_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "bitsandbytes above 16 rows, same call"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 64 --nf4-decode-max-rows 16 "
                 "--new-tokens 1024 --no-baselines --no-checks --time-budget 80 --out rollout_nf4_g64_max16.json"),
    # 2026-12-04, one device call (gpu_suite qlora-rollout-dense): every NF4 layer dequantised once per generate call
    # into a bf16 copy (nf4_dense on), then the per-step paths (the NF4 kernel to 16 rows, bitsandbytes above)
    dict(figure="rollout_nf4", file="2026-12-04/rollout_nf4_dense_s28_h200.json", date="2026-12-04",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "bf16 copy dequantised once a generate call"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 8 64 --nf4-dense on "
                 "--new-tokens 1024 --no-baselines --lora-rows 8 --time-budget 220 --out rollout_nf4_dense.json"),
    dict(figure="rollout_nf4", file="2026-12-04/rollout_nf4_per_step_s28_h200.json", date="2026-12-04",
         versions=BASE, settings={"weights": "nf4", "nf4_matmul": "per step (kernel to 16 rows), same call"},
         command="python -m benchmarks.rollout --model qwen3-8b --load-in-4bit --rows 8 64 --nf4-dense off "
                 "--new-tokens 1024 --no-baselines --no-checks --time-budget 170 --out rollout_nf4_per_step.json"),
    # session 22, the same device call as rollout_nf4: Qwen3-VL-8B SFT on image-text rows, swiftune vs TRL 1.16
    dict(figure="vl_sft_qwen3-vl-8b", file="2026-12-03/vl_sft_qwen3-vl-8b_b16_h200.json", date="2026-12-03",
         versions={**BASE, "trl": "1.16.0"},
         command="python -m benchmarks.vl sft --model qwen3-vl-8b --batch 16 --steps 10 --warmup 3 --mode-timeout 255 "
                 "--out vl_sft_qwen3-vl-8b.json"),
    # session 22, two device calls of the same search on a 24 GB budget: PyTorch's default allocator, then growable
    # segments (what `swiftune grpo` now asks for), resumed from the first call's bracket
    dict(figure="vl_grpo_qwen3-vl-8b_24gb", file="2026-12-03/vl_grpo_qwen3-vl-8b_24gb_default_allocator_h200.json",
         date="2026-12-03", versions=BASE,
         settings={"allocator": "default", "load_in_4bit": True, "gpu_budget_gb": 24.0},
         command=f"{VL_GRPO_24GB} --completion-lengths 32768 --bisect-start 65536 --time-budget 470 "
                 "--out vl_grpo_qwen3-vl-8b_24gb.json"),
    dict(figure="vl_grpo_qwen3-vl-8b_24gb", file="2026-12-03/vl_grpo_qwen3-vl-8b_24gb_expandable_h200.json",
         date="2026-12-03", versions=BASE,
         settings={"allocator": "expandable_segments:True", "load_in_4bit": True, "gpu_budget_gb": 24.0},
         command=f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True {VL_GRPO_24GB} --bisect-lo 57344 --bisect-hi 73728 "
                 "--time-budget 380 --out vl_grpo_24gb_expandable.json"),
    # session 23, one device call: Qwen3-8B LoRA SFT on FP8 base weights against swiftune's own bf16 base, batch 16
    # and 16K-token micro-batches, then the 200-step loss curve of both bases on the same rows
    dict(figure="fp8_sft_qwen3-8b", file="2026-12-03/fp8_sft_qwen3-8b_bf16_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "bf16"},
         command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune swiftune_budget --out fp8_sft_bf16.json"),
    dict(figure="fp8_sft_qwen3-8b", file="2026-12-03/fp8_sft_qwen3-8b_fp8_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "fp8"},
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-fp8 --modes swiftune swiftune_budget --out fp8_sft.json"),
    # one device call: the 16K-token row again after the FP8 projections began sharing their input's quantisation
    dict(figure="fp8_sft_16k_shared_qwen3-8b", file="2026-12-05/fp8_sft_16k_qwen3-8b_bf16_h200.json",
         date="2026-12-05", versions=BASE, settings={"weights": "bf16"},
         command=f"{SFT} --model qwen3-8b --batch 16 --modes swiftune_budget --out fp8_sft_16k_bf16.json"),
    dict(figure="fp8_sft_16k_shared_qwen3-8b", file="2026-12-05/fp8_sft_16k_qwen3-8b_fp8_h200.json",
         date="2026-12-05", versions=BASE, settings={"weights": "fp8"},
         command=f"{SFT} --model qwen3-8b --batch 16 --load-in-fp8 --modes swiftune_budget --out fp8_sft_16k.json"),
    # the same two commands on an H100 80GB (scripts/gpu_suite.sh fp8-sft-16k, one call, 2026-12-06)
    *(dict(figure="fp8_sft_16k_h100_qwen3-8b", file=f"2026-12-06/fp8_sft_16k{suffix}_s45_h100.json",
           date="2026-12-06", versions=BASE, gpu="NVIDIA H100 80GB HBM3", settings={"weights": weights},
           command=f"{SFT} --model qwen3-8b --batch 16 {flag}--modes swiftune_budget --out fp8_sft_16k{suffix}.json")
      for suffix, weights, flag in (("_bf16", "bf16", ""), ("", "fp8", "--load-in-fp8 "))),
    dict(figure="loss_curve_fp8", file="2026-12-03/loss_curve_fp8_qwen3-0.6b_h200.json", date="2026-12-03",
         versions=BASE, command="python -m benchmarks.loss_curve --compare fp8 --out loss_curve_fp8.json"),
    # session 24, one device call: FP8 eager and graphed, then bf16 graphed, Qwen3-8B batch 16, 40 timed steps
    dict(figure="fp8_graphs_qwen3-8b", file="2026-12-03/fp8_graphs_qwen3-8b_b16_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "fp8"},
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --load-in-fp8 "
                 "--modes swiftune swiftune_graphs --out fp8_graphs_qwen3-8b_b16.json"),
    dict(figure="fp8_graphs_qwen3-8b", file="2026-12-03/bf16_graphs_qwen3-8b_b16_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "bf16"},
         command="python -m benchmarks.sft --model qwen3-8b --batch 16 --steps 70 --warmup 30 --modes swiftune_graphs "
                 "--out bf16_graphs_qwen3-8b_b16.json"),
    # session 24: the GRPO reward curve of the built-in task, FP8 base against bf16 base (its JSON this time)
    dict(figure="reward_curve_fp8", file="2026-12-03/reward_curve_fp8_h200.json", date="2026-12-03",
         versions=BASE, command="python -m benchmarks.reward_curve --out reward_curve_fp8.json"),
    # session 25: GRPO's largest completion per row on a 24 GB budget, bf16 against FP8 base weights, each around
    # the planner's answer (one device call), then upwards until a length failed (two more calls); trials joined
    dict(figure="grpo_fp8_24gb_qwen3-8b", file="2026-12-03/grpo_fp8_24gb_bf16_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "bf16", "gpu_budget_gb": 24.0},
         command=f"{GRPO_24GB} --completion-from-planner --time-budget 240 --out grpo_edge_24gb_bf16.json && "
                 f"{GRPO_24GB} --completion-lengths 26368 27648 29184 --fixed-only --time-budget 230 "
                 "--out grpo_edge_24gb_bf16_up.json && "
                 f"{GRPO_24GB} --completion-lengths 30720 32256 33792 35328 --fixed-only --time-budget 260 "
                 "--out grpo_edge_24gb_bf16_up2.json && python -m benchmarks.merge_bisect --out grpo_fp8_24gb_bf16.json "
                 "grpo_edge_24gb_bf16.json:swiftune grpo_edge_24gb_bf16_up.json:swiftune=+swiftune "
                 "grpo_edge_24gb_bf16_up2.json:swiftune=+swiftune"),
    dict(figure="grpo_fp8_24gb_qwen3-8b", file="2026-12-03/grpo_fp8_24gb_fp8_h200.json", date="2026-12-03",
         versions=BASE, settings={"weights": "fp8", "gpu_budget_gb": 24.0},
         command=f"{GRPO_24GB} --load-in-fp8 --completion-from-planner --time-budget 240 --out grpo_edge_24gb_fp8.json && "
                 f"{GRPO_24GB} --load-in-fp8 --completion-lengths 58368 61184 64000 --fixed-only --time-budget 230 "
                 "--out grpo_edge_24gb_fp8_up.json && python -m benchmarks.merge_bisect --out grpo_fp8_24gb_fp8.json "
                 "grpo_edge_24gb_fp8.json:swiftune grpo_edge_24gb_fp8_up.json:swiftune=+swiftune"),
    dict(figure="attention_backends", file="2026-12-01/attention_backends_h200.json", date="2026-12-01", versions=BASE,
         command="python -m benchmarks.attention_backends --out attention.json"),
    # QLoRA GRPO's largest completion per row on an 80 GB budget (80e9 bytes for both tools), swiftune and Unsloth
    # --4bit in one detached chain on one H100 80GB (a real 80 GB card: Unsloth sizes its loss chunks and buffers by
    # the card's free memory, which an emulated budget on a larger card does not lower); swiftune's first failure
    # from the same 80e9-byte cap on an H200 (swiftune sizes itself by the cap: its peak at 337,920 was the same to
    # the byte on both cards). Unsloth's bracket from two H100 calls: 86,016 and 90,112 fitted in one process
    # (2026-12-05, before benchmarks/capped_card.py: Unsloth saw the card's own free memory, under the same 80e9-byte
    # allocator cap); 94,208 failed in a fresh process (2026-12-06, through capped_card: the card reported as 80e9
    # bytes), as did 100,352 and 110,592 each in its own, and as 94,208 had on an H200 that reported 139 GiB free
    dict(figure="qlora_grpo_80gb_qwen3-8b", file=QLORA_GRPO_80GB, date="2026-12-06", versions=BASE,
         gpu="NVIDIA H100 80GB HBM3 and, for swiftune's first failure, NVIDIA H200", keep=_modes("swiftune"),
         command=f"{QLORA_GRPO_AT} 337920 --fixed-only --time-budget 1450 --out qlora_grpo_at.json && "
                 f"{QLORA_GRPO_AT} 354816 --fixed-only --time-budget 1450 --out qlora_grpo_at_354816.json && "
                 f"{QLORA_GRPO_MERGE}"),
    dict(figure="qlora_grpo_80gb_qwen3-8b", file=QLORA_GRPO_80GB, date="2026-12-06", versions=WITH_UNSLOTH,
         gpu="NVIDIA H100 80GB HBM3", keep=_modes("unsloth"),
         command=f"{UNSLOTH_QLORA_GRPO} --completion-lengths 86016 90112 --repeats 1 --time-budget 540 "
                 f"--out unsloth_at_86016.json && {UNSLOTH_QLORA_GRPO} --completion-lengths 94208 --repeats 1 "
                 f"--time-budget 540 --out unsloth_at_94208.json && {QLORA_GRPO_MERGE}"),
    # 2026-12-06, one H100 80GB (the H200 could not be started): issue 25's MoE rows. SFT: one detached chain, each
    # mode in its own process (gpu_suite.sh moe-sft); LoRA r=16 on PEFT's "all-linear" in every mode, which on
    # Qwen3-30B-A3B also adapts the experts' fused weights (PEFT's target_parameters) and on gpt-oss-20b only the
    # attention projections (its experts are not linear modules); Liger 0.8.5's Qwen3-MoE patch fails on PEFT's
    # expert wrapper (AttributeError), so that shape's baseline is TRL alone.
    _moe_sft("sft_moe_gpt-oss-20b_b16_h100.json", "gpt-oss-20b", "moe_sft_gpt-oss-20b.json"),
    _moe_sft("sft_moe_qwen3-30b-a3b_b16_h100.json", "qwen3-30b-a3b", "moe_sft_qwen3-30b-a3b.json"),
    # a later call (another H100 80GB, the same day): gpt-oss-20b with its experts adapted too (PEFT's
    # target_parameters beside all-linear, in every mode), each mode in its own process (gpu_suite.sh moe-sft-experts)
    _moe_sft("sft_moe_experts_gpt-oss-20b_b16_h100.json", "gpt-oss-20b", "moe_sft_experts_gpt-oss-20b.json",
             "--lora-target-parameters mlp.experts.gate_up_proj mlp.experts.down_proj "),
    # the same gpt-oss-20b command on 2026-12-07 after the experts' combine was fixed (55e7567: under CUDA's autocast
    # it returned float32), 9 timed steps (another H100 80GB, scripts/gpu_suite.sh moe-sft 12 gpt-oss-20b). The
    # same day's earlier call, with the fault (swiftune 3,478 tok/s at 46.7 GB), stays as raw only:
    # 2026-12-07/sft_moe_gpt-oss-20b_b16_h100.json
    _moe_sft("sft_moe_gpt-oss-20b_b16_fixed_h100.json", "gpt-oss-20b", "moe_sft_gpt-oss-20b.json", date="2026-12-07",
             call="2026-12-07, combine fixed", steps=12),
    # GRPO, gpt-oss-20b on an 80e9-byte budget, one device call then two polls of one H100: swiftune at the
    # planner's bracket (213,504 fitted; the time budget skipped 204,032, which a fit above rules in; no failure
    # tried), then TRL's loss path bisected to 5%
    # and later calls (other H100 80GBs, the same day): one more swiftune trial at 224,000 (4.9% above 213,504),
    # then one at 235,008 (4.9% above 224,000), then one at 246,784 (5.0% above 235,008); each fitted; then 259,072
    # (fitted) and, on 2026-12-07 (another H100 80GB), 272,128: out of memory (79.8 GB at 317 s), the first failure
    dict(figure="grpo_gptoss_80gb", file=GPTOSS_GRPO_80GB, date="2026-12-07", versions=BASE,
         gpu="NVIDIA H100 80GB HBM3", keep=_modes("swiftune"),
         command=f"{GPTOSS_GRPO} --bisect-modes swiftune --completion-from-planner --time-budget 560 "
                 f"--out gptoss_grpo.json && {GPTOSS_GRPO} --bisect-modes swiftune --completion-lengths 224000 "
                 f"--fixed-only --time-budget 2900 --out gptoss_grpo_at_80.json && {GPTOSS_GRPO} --bisect-modes "
                 f"swiftune --completion-lengths 235008 --fixed-only --time-budget 2900 --out "
                 f"gptoss_grpo_at_80_235008.json && {GPTOSS_GRPO} --bisect-modes swiftune --completion-lengths "
                 f"246784 --fixed-only --time-budget 2900 --out gptoss_grpo_at_80_246784.json && {GPTOSS_GRPO} "
                 f"--bisect-modes swiftune --completion-lengths 259072 --memory-profile-completion 259072 --fixed-only "
                 f"--time-budget 2900 --out gptoss_grpo_at_80_259072.json && {GPTOSS_GRPO} --bisect-modes swiftune "
                 f"--completion-lengths 272128 --fixed-only --time-budget 2900 --out gptoss_grpo_at_80_272128.json && "
                 f"{GPTOSS_GRPO_MERGE}"),
    dict(figure="grpo_gptoss_80gb", file=GPTOSS_GRPO_80GB, date="2026-12-06", versions=WITH_TRL,
         gpu="NVIDIA H100 80GB HBM3", keep=_modes("trl_grpo"),
         command=f"{GPTOSS_GRPO} --bisect-modes trl_grpo --time-budget 400 --out gptoss_grpo_trl.json && "
                 f"{GPTOSS_GRPO_MERGE}"),
    # 2026-12-07, one H100 80GB, one call (scripts/gpu_suite.sh grpo-65k-host, each run its own process, one after
    # the other): issue 23's GRPO row beside Unsloth's anchor: swiftune with every layer's input and every layer's
    # kept sdpa outputs in pinned host memory, then the outputs kept on the GPU (out of memory on this 80 GB card),
    # then Unsloth's anchor step at the same size
    *(dict(figure="grpo_65k_beside_unsloth", file=f"2026-12-07/grpo_65k_attn36{host}_qwen3-8b_h100.json",
           date="2026-12-07", versions=BASE, gpu="NVIDIA H100 80GB HBM3",
           command=f"{GRPO_65K_ATTN} 36{flag} --completion-lengths 65536 --fixed-only --trial-repeats 2 "
                   f"--time-budget {budget} --out grpo_65k_attn36{host}.json")
      for host, flag, budget in (("_host", " --attention-outputs-on-host", 220), ("", "", 190))),
    dict(figure="grpo_65k_beside_unsloth", file="2026-12-07/unsloth_grpo_65k_qwen3-8b_h100.json", date="2026-12-07",
         versions={**WITH_UNSLOTH, "trl": "1.15.0"}, gpu="NVIDIA H100 80GB HBM3",
         command="python -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b --completion-lengths 65536 "
                 "--repeats 2 --time-budget 280 --model-dir /tmp/ck_qwen3-8b --out unsloth_grpo_65k.json"),
]
