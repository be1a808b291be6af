"""Rollout generation: FastRolloutEngine vs transformers ``generate`` (dynamic and static cache).

For each model shape (random bf16 weights built on the GPU from benchmarks/workload.py), each row
count G (one random 256-token prompt, G sampled completions, temperature 1, **no stop token**, so
every row runs to the forced length) and each number of new tokens N:

* ``generate_dynamic`` / ``generate_static``: transformers ``model.generate`` on the *unpatched*
  model (sdpa), ``do_sample=True``, ``min_new_tokens = max_new_tokens = --baseline-steps`` (default
  64: at ~60-80 ms a step a full 8,192-token baseline would take 10 minutes; the per-step time of
  generate does not fall with length, so its tokens/s over 64 steps is an upper bound of its
  tokens/s at N);
* ``fast``: ``swiftune.rl.rollout.FastRolloutEngine`` on the same model after ``swiftune.patch_model``
  (CUDA graphs on), the full N tokens; decode-step time = decode wall time / steps (graph capture
  reported apart, prefill included in tokens/s).

Beside each decode-step time: the HBM floor = (bytes of the weights read per step + bytes of the KV
cache in use, averaged over the run) / measured copy bandwidth (``dst.copy_(src)`` of 2 GiB,
counting read + write). Mixture-of-experts shapes (``qwen3-30b-a3b``, ``mixtral-8x7b``) read per step
only the experts their G rows route to: the floor counts every non-expert weight (attention, norms,
routers, dense layers, LM head) plus, per MoE layer, the *measured* mean number of distinct experts a
decode step routes to (an eager run of the engine with the routers recorded, 16 steps at the same G:
the union of the G rows' top-k, which is what the grouped GEMM reads) times one expert's bytes. Two
bounds are reported beside it: ``hbm_floor_topk_ms`` (top-k experts per layer, one token's active
weights: no batch of G > 1 rows can read less) and ``hbm_floor_union_bound_ms`` (``min(E, G k)``
experts per layer, the union's upper bound). Before the timings, checks on the first shape: the engine's greedy tokens
with CUDA graphs equal its eager tokens (64 steps, exact), and their agreement with transformers'
greedy ``generate`` (bf16: reported, near-ties may diverge).

    python -m benchmarks.rollout --out rollout.json        # GPU: Qwen3-1.7B + 8B, G 8/64, N 1024/8192 (~6-8 min)
    python -m benchmarks.rollout --model tiny              # CPU smoke test (seconds)
    python -m benchmarks.rollout --model qwen3-30b-a3b mixtral-8x7b --new-tokens 1024 --baseline-kinds dynamic \
        --lora-rows                                        # GPU: the MoE shapes (scripts/gpu_suite.sh moe-rollout)
    python -m benchmarks.rollout --from-log a.txt b.txt --out rollout.json   # JSON from printed logs

``--load-in-4bit`` / ``--load-in-fp8``: the decoder's linear weights in NF4 (bitsandbytes) or in FP8
(``float8_e4m3fn`` with per-row float32 scales, swiftune's ``FP8Linear``: ``torch._scaled_mm`` with
the activations quantised by the fused Triton kernel on GPUs with FP8 tensor cores); the HBM floor
then counts the quantised bytes and their scales, and the JSON says ``weights``.

The JSON is rewritten after every run, so a run stopped by a time limit keeps what it measured;
``--from-log`` rebuilds the same rows from the lines the script prints (for logs of killed runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from benchmarks import results as result_rows
from benchmarks.workload import quantize_linears_4bit, random_model, reset_cuda_memory

from swiftune.rl.rollout.fast import kv_bytes_per_token


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 2 * src.numel() * 10 / (time.perf_counter() - t)


def build_model(name: str, device: torch.device, dtype: torch.dtype, load_in_4bit: bool = False,
                load_in_fp8: bool = False):
    """Random-init model of shape ``name``; with ``load_in_4bit`` its decoder's linear weights in NF4
    (bitsandbytes, double quantisation), as QLoRA's rollouts read them; with ``load_in_fp8`` in e4m3
    with per-row scales, as ``load_in_fp8=True`` loads them (``swiftune.models.fp8_linear``)."""
    if load_in_4bit and load_in_fp8:
        raise ValueError("load_in_4bit and load_in_fp8 are exclusive: pick one weight format")
    model = random_model(name, device, dtype)
    if load_in_4bit:
        quantize_linears_4bit(model, dtype)
    if load_in_fp8:
        from swiftune.models.fp8_linear import quantize_model_fp8

        quantize_model_fp8(model)
    return model.eval()


def quant_state_bytes(p) -> int:
    """Bytes of a bitsandbytes 4-bit weight's quantisation state read with it (its absmax, and with
    double quantisation the absmax's own absmax and code); 0 for a plain parameter."""
    state = getattr(p, "quant_state", None)
    total = 0
    while state is not None:
        total += sum(t.numel() * t.element_size() for t in (state.absmax, getattr(state, "code", None))
                     if isinstance(t, torch.Tensor))
        state = getattr(state, "state2", None)
    return total


def fp8_scale_bytes(model) -> int:
    """Bytes of the float32 scales read with FP8 weights (``FP8Linear.weight_scale``, a buffer)."""
    from swiftune.models.fp8_linear import is_fp8_linear

    return sum(m.weight_scale.numel() * m.weight_scale.element_size() for m in model.modules() if is_fp8_linear(m))


def weight_bytes(model) -> int:
    """Bytes read per decode step: every parameter except the input embedding (only G rows of it are read);
    NF4 weights count their packed bytes and their quantisation state, FP8 ones a byte each and their scales."""
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() + quant_state_bytes(p) for p in model.parameters())
    total += fp8_scale_bytes(model)
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    return total if tied else total - emb.numel() * emb.element_size()


def expert_stacks(model) -> list:
    """The fused experts modules of a mixture-of-experts model (``gate_up_proj`` / ``down_proj`` of shape
    ``[E, ., .]``); empty for a dense model."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3]


def moe_read_bytes(model, experts_per_layer: float) -> int:
    """Bytes a decode step reads when each MoE layer's grouped GEMMs read ``experts_per_layer`` of its ``E``
    experts: :func:`weight_bytes` with each expert stack counted at that share (a dense model: all of it)."""
    total = weight_bytes(model)
    for stack in expert_stacks(model):
        stack_bytes = sum(p.numel() * p.element_size() for p in stack.parameters(recurse=False))
        total -= stack_bytes * (1.0 - experts_per_layer / stack.gate_up_proj.shape[0])
    return int(total)


def routed_experts_per_step(model, prompt: list[int], rows: int, steps: int = 16) -> float:
    """Mean number of distinct experts one decode step of ``rows`` rows routes to, per MoE layer: an eager
    engine run (temperature 1, ``steps`` tokens) with the routers' logits recorded; the prefill's calls
    (the first one per layer) are left out."""
    from swiftune.models.moe import moe_config, record_router_logits
    from swiftune.rl.rollout import SamplingParams
    from swiftune.rl.rollout.fast import FastRolloutEngine

    _, top_k, _ = moe_config(model)
    layers = len(expert_stacks(model))
    engine = FastRolloutEngine(model, seed=0, use_cuda_graph=False, keep_cache=False)
    with record_router_logits(model) as logits:
        engine.generate([prompt], rows, SamplingParams(max_tokens=steps, temperature=1.0))
    decode = logits[layers:]
    return sum(torch.unique(z.topk(top_k, dim=-1).indices).numel() for z in decode) / max(1, len(decode))


def time_generate(model, prompt: list[int], rows: int, steps: int, static: bool) -> dict:
    ids = torch.tensor([prompt] * rows, device=model.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    # warm-up of the same length: the static cache is sized prompt + max_new_tokens, and transformers
    # compiles the forward for it, so a shorter warm-up would leave the compile inside the timing
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
    sync()
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
    sync()
    wall = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    return {"wall_s": wall, "new_tokens": new, "tokens_per_s": rows * new / wall, "step_ms": 1e3 * wall / new}


def time_fast(model, prompt: list[int], rows: int, new_tokens: int, kv_bucket: int, lora: str = "runtime",
              profile_steps: int = 0, **engine_options) -> dict:
    from swiftune.rl.rollout.fast import FastRolloutEngine
    from swiftune.rl.rollout import SamplingParams

    engine = FastRolloutEngine(model, seed=0, keep_cache=False, kv_bucket=kv_bucket, check_every=64, lora=lora,
                               **engine_options)
    engine.generate([prompt], rows, SamplingParams(max_tokens=4, temperature=1.0))  # warm-up (prefill kernels)
    sync()
    t = time.perf_counter()
    out = engine.generate([prompt], rows, SamplingParams(max_tokens=new_tokens, temperature=1.0))
    sync()
    wall = time.perf_counter() - t
    st = out.stats
    lengths = [len(c) for c in out.completion_ids]
    assert all(n == new_tokens for n in lengths), "forced length not reached"
    gen_s = st["prefill_s"] + st["decode_s"]
    return {"wall_s": wall, "new_tokens": new_tokens, "tokens_per_s": rows * new_tokens / gen_s,
            "step_ms": 1e3 * st["decode_s"] / max(1.0, st["decode_steps"] - 1), "prefill_s": st["prefill_s"],
            "capture_s": st["capture_s"], "kv_cache_gb": st["kv_cache_bytes"] / 1e9,
            "fused_layers": engine.fused_layers, "moe_decode_max_tokens": engine.moe_decode_max_tokens,
            "moe_fused_routing": engine.moe_fused_routing, "moe_route_kernels": engine.moe_route_kernels,
            "decode_attention": engine.decode_attention,
            "nf4_decode_kernel": engine.nf4_decode_kernel, "nf4_decode_max_rows": engine.nf4_decode_max_rows,
            "nf4_dense": engine.nf4_dense, "nf4_dense_layers": int(st.get("nf4_dense_layers", 0)),
            "fp8_stacked_qkv": engine.fp8_stacked_qkv, "fp8_stacked_gate_up": engine.fp8_stacked_gate_up,
            "fp8_norm_codes": engine.fp8_norm_codes, "fp8_glu_codes": engine.fp8_glu_codes,
            "lora_decode_kernel": engine.decode_options.lora_decode_kernel,
            "kv_cache_dtype": engine.kv_cache_dtype,
            **({"profile": decode_profile(engine, profile_prompt(prompt, new_tokens, profile_steps), rows,
                                          profile_steps)} if profile_steps else {})}


def profile_prompt(prompt: list[int], new_tokens: int, steps: int) -> list[int]:
    """The prompt of the profiled ``generate``: ``prompt`` lengthened (its own tokens repeated) so that the
    ``steps`` profiled decode steps attend to as many slots as the timed run's ``new_tokens`` steps do on average
    (prompt + new_tokens / 2): the attention's share of a step grows with the slots it reads, and a profile of
    the first ``steps`` tokens after the bare prompt would show a short-row step."""
    extra = max(0, new_tokens // 2 - steps // 2)
    return prompt + [prompt[i % len(prompt)] for i in range(extra)]


def decode_profile(engine, prompt: list[int], rows: int, steps: int) -> dict:
    """Where a decode step's device time goes: one more ``generate`` of ``steps`` tokens under
    ``torch.profiler`` (its graphs are already captured), each kernel's device time summed by name and
    divided by the steps (the prefill is in it: one forward of ``prompt`` beside hundreds of steps; the timed
    runs pass :func:`profile_prompt`'s, so the steps attend to the timed run's mean number of slots).
    ``device_ms_per_step`` below the timed step is the launch gaps' share; ``launches_per_step``
    counts the kernels. CUDA only (``{}`` elsewhere)."""
    from benchmarks.time_profile import device_time_profile
    from swiftune.rl.rollout import SamplingParams

    if not torch.cuda.is_available():
        return {}
    result: dict = {}
    with device_time_profile(result):
        engine.generate([prompt], rows, SamplingParams(max_tokens=steps, temperature=1.0))
    prof = result["profile"]
    per_step = {"steps": steps, "prompt_tokens": len(prompt), "device_ms_per_step": prof["device_ms"] / steps,
                "launches_per_step": prof["launches"] / steps,
                "kinds": [{**k, "ms": k["ms"] / steps} for k in prof["kinds"]],
                "top": [{**k, "ms": k["ms"] / steps, "calls": k["calls"] / steps} for k in prof["top"]]}
    return per_step


#: the engine's on/off decode options for FP8 weights and runtime LoRA: (flag, default, help); each flag's default
#: is the engine's, its --no- form the A/B's baseline
FP8_AND_LORA_SWITCHES = (
    ("--fp8-stacked-qkv", True, "--load-in-fp8: a decode step's q/k/v as one FP8 product over their adjacent codes "
     "(the engine's default); --no-fp8-stacked-qkv: three products, the baseline (FastRolloutEngine(fp8_stacked_qkv=...))"),
    ("--fp8-stacked-gate-up", True, "--load-in-fp8: a decode step's gate/up as one FP8 product over their adjacent "
     "codes (the engine's default); --no-fp8-stacked-gate-up: two products, the baseline "
     "(FastRolloutEngine(fp8_stacked_gate_up=...))"),
    ("--fp8-norm-codes", True, "FP8 weights: the residual add + norm kernel makes q/k/v's and gate/up's input codes "
     "(the engine's default); --no-fp8-norm-codes: a separate quantise launch, the baseline "
     "(FastRolloutEngine(fp8_norm_codes=...))"),
    ("--fp8-glu-codes", False, "FP8 weights: the MLP's activation kernel makes down_proj's input codes; "
     "--no-fp8-glu-codes (the engine's default): a separate quantise launch (FastRolloutEngine(fp8_glu_codes=...))"),
    ("--lora-decode-kernel", None, "runtime LoRA rows: each adapter's product added in two launches (the "
     "engine's default on CUDA); --no-lora-decode-kernel: two matmuls and their casts, the baseline "
     "(FastRolloutEngine(lora_decode_kernel=...); neither: the engine's 'auto')"),
)


def weight_options(a) -> dict:
    """The engine's options for quantised (NF4, FP8) weights and the KV cache's dtype that the command line names
    (the library's defaults where it names none)."""
    options = {"nf4_decode_kernel": a.nf4_decode_kernel, "fp8_stacked_qkv": a.fp8_stacked_qkv,
               "fp8_stacked_gate_up": a.fp8_stacked_gate_up, "fp8_norm_codes": a.fp8_norm_codes,
               "fp8_glu_codes": a.fp8_glu_codes,
               "lora_decode_kernel": "auto" if a.lora_decode_kernel is None else a.lora_decode_kernel,
               "kv_cache_dtype": a.kv_cache_dtype,
               "nf4_dense": {"on": True, "off": False}.get(a.nf4_dense, "auto")}
    if a.nf4_decode_max_rows is not None:
        options["nf4_decode_max_rows"] = a.nf4_decode_max_rows
    return options


def lora_runs(model, name: str, prompt: list[int], rows_list: list[int], new_tokens: int,
              kv_bucket: int, **engine_options) -> list[dict]:
    """The engine on a PEFT LoRA model (r=16, all linear layers): adapters run as PEFT layers vs merged."""
    from swiftune.training import FastModel

    from swiftune.training.quantization import is_quantized_4bit, is_quantized_fp8

    quantized = is_quantized_4bit(model) or is_quantized_fp8(model)
    peft_model = FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False)
    runs = []
    # adapters cannot be merged exactly into NF4 or e4m3 weights (the engine refuses): they run as layers;
    # on MoE shapes (PEFT adapts the fused experts too) the merge's saved copy of every expert stack would
    # take as much memory as the model again: the runtime path (per-block low-rank products) only
    modes = ("runtime",) if quantized or expert_stacks(model) else ("runtime", "merge")
    for rows in rows_list:
        for lora in modes:
            r = time_fast(peft_model, prompt, rows, new_tokens, kv_bucket, lora=lora, **engine_options)
            runs.append({"model": name, "rows": rows, "new_tokens": new_tokens, "lora": lora, "fast": r})
            print(f"LoRA r=16 {lora:<8} G={rows} N={new_tokens}: {r['tokens_per_s']:.0f} tok/s, "
                  f"{r['step_ms']:.2f} ms/step", flush=True)
    peft_model.unload()
    return runs


def checks(model, prompt: list[int], steps: int) -> dict:
    """Graph replay == eager (exact), and greedy agreement with transformers generate."""
    from swiftune.rl.rollout.fast import FastRolloutEngine
    from swiftune.rl.rollout import SamplingParams

    greedy = SamplingParams(max_tokens=steps, temperature=0)
    eager = FastRolloutEngine(model, use_cuda_graph=False, keep_cache=False).generate([prompt], 2, greedy)
    graph = FastRolloutEngine(model, use_cuda_graph=True, keep_cache=False).generate([prompt], 2, greedy)
    sampled = SamplingParams(max_tokens=steps, temperature=1.0, top_p=0.9)
    s_eager = FastRolloutEngine(model, use_cuda_graph=False, seed=1, keep_cache=False).generate([prompt], 2, sampled)
    s_graph = FastRolloutEngine(model, use_cuda_graph=True, seed=1, keep_cache=False).generate([prompt], 2, sampled)
    ids = torch.tensor([prompt], device=model.device)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps,
                         min_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
    got = graph.completion_ids[0]
    agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    return {"graph_equals_eager_greedy": graph.completion_ids == eager.completion_ids,
            "graph_equals_eager_sampled": s_graph.completion_ids == s_eager.completion_ids,
            "greedy_prefix_agreeing_with_generate": agree, "steps": steps}


_GENERATE_LINE = re.compile(r"^(\S+) generate (dynamic|static) G=(\d+): ([\d.]+) tok/s, ([\d.]+) ms/step")
_FAST_LINE = re.compile(r"^(\S+) fast G=(\d+) N=(\d+): ([\d.]+) tok/s, ([\d.]+) ms/step \(floor ([\d.]+|nan)\), "
                        r"capture ([\d.]+)s")
_LORA_LINE = re.compile(r"^LoRA r=16 (\w+)\s+G=(\d+) N=(\d+): ([\d.]+) tok/s, ([\d.]+) ms/step")
_FUSED_AB_LINE = re.compile(r"^(\S+) fused_layers=(True|False) G=(\d+) N=(\d+): ([\d.]+) tok/s, ([\d.]+) ms/step")


def attach_baselines(row: dict, baselines: dict[str, dict | None]) -> None:
    """Put each measured ``generate`` baseline beside the engine's row, with the engine's speedup over it."""
    for key, b in baselines.items():
        if b:
            row[key] = b
            row[f"speedup_vs_{key}"] = row["fast"]["tokens_per_s"] / b["tokens_per_s"]


def rows_from_logs(paths: list[str]) -> dict:
    """The JSON rows rebuilt from the lines this script prints (weights/KV sizes are not in the log)."""
    results: dict = {"device": "from logs: " + ", ".join(os.path.basename(p) for p in paths), "runs": [],
                     "lora": [], "checks": {}, "skipped": []}
    base: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("Rollout generation (") and results["device"].startswith("from logs"):
                    results["device"] = line[len("Rollout generation ("):].split(",")[0]
                if m := _GENERATE_LINE.match(line):
                    name, kind, rows, tps, ms = m.groups()
                    base[(name, int(rows), kind)] = {"tokens_per_s": float(tps), "step_ms": float(ms)}
                elif m := _FAST_LINE.match(line):
                    name, rows, new, tps, ms, floor, cap = m.groups()
                    row = {"model": name, "rows": int(rows), "new_tokens": int(new), "hbm_floor_ms": float(floor),
                           "fast": {"tokens_per_s": float(tps), "step_ms": float(ms), "capture_s": float(cap)}}
                    attach_baselines(row, {f"generate_{k}": base.get((name, int(rows), k))
                                           for k in ("dynamic", "static")})
                    results["runs"].append(row)
                elif m := _FUSED_AB_LINE.match(line):
                    name, fused, rows, new, tps, ms = m.groups()
                    results.setdefault("fused_ab", []).append(
                        {"model": name, "rows": int(rows), "new_tokens": int(new), "fused_layers": fused == "True",
                         "fast": {"tokens_per_s": float(tps), "step_ms": float(ms)}})
                elif m := _LORA_LINE.match(line):
                    lora, rows, new, tps, ms = m.groups()
                    results["lora"].append({"rows": int(rows), "new_tokens": int(new), "lora": lora,
                                            "fast": {"tokens_per_s": float(tps), "step_ms": float(ms)}})
    results["benchmark"] = "rollout"
    return results


def merge_results(paths: list[str]) -> dict:
    """One result from several saved ones: runs, skips, LoRA and A/B rows concatenated, checks merged.

    Every file must come from the same device and prompt length (the rows are compared in one plot)."""
    results: dict = {"benchmark": "rollout", "runs": [], "checks": {}, "skipped": [], "lora": [], "fused_ab": [],
                     "merged_from": [os.path.basename(p) for p in paths]}
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        for key in ("device", "prompt_tokens"):  # (JSON rebuilt from logs may lack them)
            if part.get(key) is None:
                continue
            if results.get(key) is not None and part[key] != results[key]:
                raise SystemExit(f"{path}: {key} {part[key]!r} differs from {results[key]!r}; "
                                 "merge only runs of one device and prompt length")
            results[key] = part[key]
        results["copy_bandwidth_gbs"] = part.get("copy_bandwidth_gbs")
        results["baseline_steps"] = part.get("baseline_steps")
        for key in ("runs", "skipped", "lora", "fused_ab"):
            results[key] += part.get(key, [])
        results["checks"].update(part.get("checks", {}))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=None, help="shapes of benchmarks/workload.py (tiny: CPU smoke)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="G values (default 8 64; tiny 2 4)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (tiny 16)")
    p.add_argument("--new-tokens", type=int, nargs="+", default=None, help="default 1024 8192 (tiny 16 32)")
    p.add_argument("--baseline-steps", type=int, default=None, help="tokens per generate baseline (64; tiny 8)")
    p.add_argument("--kv-bucket", type=int, default=256)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--moe-decode-max-tokens", type=int, default=None,
                   help="MoE shapes: the most tokens a decode step sends through the fused decode kernels "
                        "(FastRolloutEngine(moe_decode_max_tokens=...); default: the library's)")
    p.add_argument("--moe-fused-routing", action=argparse.BooleanOptionalAction, default=True,
                   help="MoE shapes: the routers' top-k as one Triton launch (the engine's default); "
                        "--no-moe-fused-routing: torch's ops (FastRolloutEngine(moe_fused_routing=False))")
    p.add_argument("--moe-route-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="MoE shapes: steps above the decode kernels' cap sort (two launches) and combine (one) "
                        "(the engine's default); --no-moe-route-kernels: torch's ops "
                        "(FastRolloutEngine(moe_route_kernels=False)), the baseline")
    p.add_argument("--decode-attention", choices=("auto", "sdpa", "split"), default="auto",
                   help="the decode step's attention over the cache: the split kernel where it compiles (auto, the "
                        "engine's default; swiftune.kernels.decode_attention), always (split) or SDPA (sdpa, the "
                        "baseline) (FastRolloutEngine(decode_attention=...))")
    for flag, default, text in FP8_AND_LORA_SWITCHES:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="the engine's KV cache: the model's dtype (the default) or e4m3 codes with a float32 scale "
                        "per slot and head (FastRolloutEngine(kv_cache_dtype='fp8')); the HBM floor counts its bytes")
    p.add_argument("--nf4-decode-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="--load-in-4bit: decode steps of 2 to --nf4-decode-max-rows rows through swiftune's NF4 "
                        "kernel (the engine's default); --no-nf4-decode-kernel: bitsandbytes' dequantise-then-multiply "
                        "(FastRolloutEngine(nf4_decode_kernel=False)), the baseline")
    p.add_argument("--nf4-decode-max-rows", type=int, default=None,
                   help="--load-in-4bit: the most rows a decode step sends through the NF4 kernel, 2-64 "
                        "(FastRolloutEngine(nf4_decode_max_rows=...); default: the library's, 16)")
    p.add_argument("--nf4-dense", choices=("auto", "on", "off"), default="auto",
                   help="--load-in-4bit: decode from a copy of the NF4 weights dequantised once per generate call "
                        "(FastRolloutEngine(nf4_dense=...); auto, the library's default: on CUDA when the copy takes "
                        "at most a quarter of the free memory)")
    p.add_argument("--baseline-kinds", nargs="+", choices=("dynamic", "static"), default=["dynamic", "static"],
                   help="which generate baselines to time (static compiles the forward: minutes on MoE shapes)")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds: an engine run whose estimated end lies past it is skipped (listed in the JSON)")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each engine run, one more of this many tokens under torch.profiler: the device time "
                        "per decode step by kernel (the JSON's fast.profile; CUDA only; 0: none)")
    p.add_argument("--lora-rows", type=int, nargs="*", default=None,
                   help="after the plain runs of the first shape: LoRA r=16 on all linear layers, the engine with "
                        "lora=runtime and lora=merge at these G and the shortest N (default: 8)")
    p.add_argument("--ab-fused-rows", type=int, nargs="*", default=None,
                   help="after the plain runs of the first shape: the engine with fused_layers=True and =False "
                        "at these G and the shortest N (the A/B of the engine's fused layer loop)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="the decoder's linear weights in NF4 (bitsandbytes): rollouts from QLoRA's base; the HBM "
                        "floor counts the 4-bit bytes")
    p.add_argument("--load-in-fp8", action="store_true",
                   help="the decoder's linear weights in FP8 (e4m3, per-row float32 scales, swiftune's FP8Linear: "
                        "torch._scaled_mm on FP8 GPUs): rollouts from load_in_fp8's base; the HBM floor counts a "
                        "byte a weight plus the scales")
    p.add_argument("--fp8-reduce-in-launch", action="store_true",
                   help="--load-in-fp8: the decode products add a split K's partials in their own launch "
                        "(swiftune.models.fp8_linear.reduce_decode_splits_in_launch); default: a second launch")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/rollout.json when $OUT is set)")
    p.add_argument("--result-rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the JSON path with .rows.jsonl; --rows is the rollout's G)")
    p.add_argument("--from-log", nargs="+", default=None, help="build the JSON from printed logs instead of running")
    p.add_argument("--merge", nargs="+", default=None,
                   help="write one JSON with the rows of these saved results (e.g. the N=1024 and N=8192 runs)")
    a = p.parse_args(argv)
    if a.load_in_4bit and a.load_in_fp8:
        p.error("--load-in-4bit and --load-in-fp8 are exclusive: pick one weight format")
    out = a.out or (os.path.join(os.environ["OUT"], "rollout.json") if os.environ.get("OUT") else None)

    def save() -> None:
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=2)
        if out or a.result_rows:
            result_rows.save("rollout", argv, results, out, a.result_rows)

    if a.merge:
        results = merge_results(a.merge)
        save()
        print(f"{len(results['runs'])} engine rows from {len(a.merge)} files -> {out}")
        return 0
    if a.from_log:
        results = rows_from_logs(a.from_log)
        save()
        print(f"{len(results['runs'])} engine rows, {len(results['lora'])} LoRA rows -> {out}")
        return 0
    tiny = bool(a.model) and all(m.startswith("tiny") for m in a.model)
    models = a.model or ["qwen3-1.7b", "qwen3-8b"]
    rows_list = a.rows or ([2, 4] if tiny else [8, 64])
    prompt_tokens = a.prompt_tokens or (16 if tiny else 256)
    new_list = a.new_tokens or ([16, 32] if tiny else [1024, 8192])
    base_steps = a.baseline_steps or (8 if tiny else 64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device)
    from swiftune.models import patch_model

    results: dict = {"benchmark": "rollout",
                     "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "copy_bandwidth_gbs": bw / 1e9, "prompt_tokens": prompt_tokens, "baseline_steps": base_steps,
                     "weights": ("nf4" if a.load_in_4bit else "fp8" if a.load_in_fp8
                                 else str(dtype).removeprefix("torch.")),
                     "fp8_reduce_in_launch": a.fp8_reduce_in_launch,
                     "runs": [], "checks": {}, "skipped": []}
    t_start = time.perf_counter()
    for name in models:
        model = build_model(name, device, dtype, a.load_in_4bit, a.load_in_fp8)
        if a.fp8_reduce_in_launch:
            from swiftune.models.fp8_linear import reduce_decode_splits_in_launch

            reduce_decode_splits_in_launch(model)
        cfg = model.config
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=gen).tolist()
        wbytes = weight_bytes(model)
        kv_tok = kv_bytes_per_token(cfg, torch.finfo(dtype).bits // 8, a.kv_cache_dtype)
        base: dict = {}
        if not a.no_baselines:
            for rows in rows_list:
                for static in [kind == "static" for kind in a.baseline_kinds]:
                    r = time_generate(model, prompt, rows, base_steps, static)
                    base[(rows, static)] = r
                    print(f"{name} generate {'static' if static else 'dynamic'} G={rows}: "
                          f"{r['tokens_per_s']:.0f} tok/s, {r['step_ms']:.1f} ms/step", flush=True)
                    reset_cuda_memory(device.type == "cuda")
        patch_model(model)
        moe = expert_stacks(model)
        routed: dict[int, float] = {}  # rows -> measured distinct experts per MoE layer and decode step
        if moe:
            for rows in rows_list:
                routed[rows] = routed_experts_per_step(model, prompt, rows)
                print(f"{name} G={rows}: {routed[rows]:.1f} of {moe[0].gate_up_proj.shape[0]} experts per layer "
                      "and decode step (measured)", flush=True)
        if not a.no_checks and name == models[0]:
            results["checks"][name] = checks(model, prompt, 32 if tiny else 64)
            print("checks", results["checks"][name], flush=True)
        step_at: dict[int, float] = {}  # rows -> decode step ms of the shortest N (for the time estimate)
        for new in sorted(new_list):
            for rows in rows_list:
                est = step_at.get(rows, 0.0) * new / 1e3 * 1.5  # the KV read grows along the run
                if time.perf_counter() - t_start + est > a.time_budget:
                    results["skipped"].append({"model": name, "rows": rows, "new_tokens": new, "estimated_s": est})
                    print(f"{name} fast G={rows} N={new}: skipped (estimated {est:.0f}s over --time-budget)")
                    continue
                r = time_fast(model, prompt, rows, new, a.kv_bucket, moe_decode_max_tokens=a.moe_decode_max_tokens,
                              moe_fused_routing=a.moe_fused_routing, moe_route_kernels=a.moe_route_kernels,
                              decode_attention=a.decode_attention,
                              profile_steps=a.profile_steps,
                              **weight_options(a))
                step_at.setdefault(rows, r["step_ms"])
                kv_mean = rows * kv_tok * (prompt_tokens + new / 2)
                read = moe_read_bytes(model, routed[rows]) if moe else wbytes
                floor_ms = 1e3 * (read + kv_mean) / bw if bw == bw else float("nan")
                row = {"model": name, "rows": rows, "new_tokens": new, "fast": r, "hbm_floor_ms": floor_ms,
                       "weight_gb": read / 1e9, "kv_mean_gb": kv_mean / 1e9}
                if moe:
                    experts, top_k = moe[0].gate_up_proj.shape[0], cfg.num_experts_per_tok
                    row.update({"all_weights_gb": wbytes / 1e9, "experts_per_layer": routed[rows],
                                "experts_per_layer_floor": "measured union of the G rows' top-k per decode step",
                                "hbm_floor_topk_ms": 1e3 * (moe_read_bytes(model, top_k) + kv_mean) / bw,
                                "hbm_floor_union_bound_ms": 1e3 * (moe_read_bytes(model, min(experts, rows * top_k))
                                                                   + kv_mean) / bw})
                attach_baselines(row, {"generate_dynamic": base.get((rows, False)),
                                       "generate_static": base.get((rows, True))})
                results["runs"].append(row)
                save()
                print(f"{name} fast G={rows} N={new}: {r['tokens_per_s']:.0f} tok/s, {r['step_ms']:.2f} ms/step "
                      f"(floor {floor_ms:.2f}), capture {r['capture_s']:.1f}s", flush=True)
                if r.get("profile"):
                    prof = r["profile"]
                    print(f"  profile: {prof['device_ms_per_step']:.2f} device ms and "
                          f"{prof['launches_per_step']:.0f} launches a step; " + "; ".join(
                              f"{k['kernel'][:60]} {k['ms']:.3f} ms x{k['calls']:.0f}" for k in prof["top"]),
                          flush=True)
                reset_cuda_memory(device.type == "cuda")
        if name == models[0] and a.ab_fused_rows:
            results["fused_ab"] = []
            for rows in a.ab_fused_rows:
                for fused in (True, False):
                    r = time_fast(model, prompt, rows, min(new_list), a.kv_bucket, fused_layers=fused)
                    results["fused_ab"].append({"model": name, "rows": rows, "new_tokens": min(new_list),
                                                "fused_layers": fused, "fast": r})
                    print(f"{name} fused_layers={fused} G={rows} N={min(new_list)}: {r['tokens_per_s']:.0f} tok/s, "
                          f"{r['step_ms']:.2f} ms/step", flush=True)
            save()
        if name == models[0] and (a.lora_rows is None or a.lora_rows):
            results["lora"] = lora_runs(model, name, prompt, a.lora_rows or [8], min(new_list), a.kv_bucket,
                                        **weight_options(a))
        # every reference to the model's modules goes (the expert stacks too), or the next shape's weights
        # meet this one's still on the GPU
        del model, moe
        reset_cuda_memory(device.type == "cuda")
        if device.type == "cuda":
            print(f"{name}: freed, {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated", flush=True)

    save()
    for r in results["skipped"]:
        print(f"skipped (time budget): {r}")
    print(f"\nRollout generation ({results['device']}, prompt {prompt_tokens}, copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"generate timed over {base_steps} tokens)")
    head = (f"{'model':<12}{'G':>4}{'N':>6}{'fast tok/s':>12}{'step ms':>9}{'floor ms':>9}{'x floor':>8}"
            f"{'dyn tok/s':>11}{'stat tok/s':>11}{'x dyn':>7}{'x stat':>7}")
    print(head)
    print("-" * len(head))
    for r in results.get("lora", []):
        print(f"LoRA r=16 lora={r['lora']:<8} G={r['rows']} N={r['new_tokens']}: {r['fast']['tokens_per_s']:.0f} tok/s, "
              f"{r['fast']['step_ms']:.2f} ms/step")
    ab = results.get("fused_ab", [])
    for on in (r for r in ab if r["fused_layers"]):
        off = next((r for r in ab if not r["fused_layers"] and r["rows"] == on["rows"]), None)
        ratio = f", unfused / fused step time {off['fast']['step_ms'] / on['fast']['step_ms']:.3f}" if off else ""
        print(f"fused_layers A/B {on['model']} G={on['rows']} N={on['new_tokens']}: fused {on['fast']['step_ms']:.2f} "
              f"ms/step" + (f", unfused {off['fast']['step_ms']:.2f} ms/step" if off else "") + ratio)
    for r in results["runs"]:
        if "experts_per_layer" in r:
            print(f"{r['model']} G={r['rows']}: floor counts {r['experts_per_layer']:.1f} experts per layer (measured); "
                  f"top-k bound {r['hbm_floor_topk_ms']:.2f} ms, union bound {r['hbm_floor_union_bound_ms']:.2f} ms")
    for r in results["runs"]:
        f = r["fast"]
        dyn = r.get("generate_dynamic", {}).get("tokens_per_s", float("nan"))
        st = r.get("generate_static", {}).get("tokens_per_s", float("nan"))
        print(f"{r['model']:<12}{r['rows']:>4}{r['new_tokens']:>6}{f['tokens_per_s']:>12.0f}{f['step_ms']:>9.2f}"
              f"{r['hbm_floor_ms']:>9.2f}{f['step_ms'] / r['hbm_floor_ms']:>8.2f}{dyn:>11.0f}{st:>11.0f}"
              f"{r.get('speedup_vs_generate_dynamic', float('nan')):>7.1f}"
              f"{r.get('speedup_vs_generate_static', float('nan')):>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
