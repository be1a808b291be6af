"""Launch-setting sweep of the split decode attention (development aid; the chosen values live in
swiftune.kernels.decode_attention).

A decode step's attention on the Qwen3-8B shape (8 K/V heads of 4 query heads, D=128) at G rows, every row
attending to ``slots`` cached slots of a cache laid out as the engine's (a longer buffer, sliced), with a bf16
or an FP8 (e4m3 codes + float32 scales) cache. Each launch setting (slots a tile, warps, pipeline stages,
chunks a row) is timed as the engine runs it, inside a CUDA graph (20 calls a graph, replays timed with CUDA
events): the host's launch cost is out. The bytes are the visible keys and values (and their scales) read
once. The default setting is timed first and last, so each case prints the best setting's time as a ratio to
the default's.

    python -m benchmarks.tune_decode_attention [--rows 8 64] [--slots 256 768 2048] \
        [--out tune_decode_attention.json]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import time

import torch
import triton

from benchmarks.kernels import bench
from benchmarks.moe_decode import as_graph

attention = importlib.import_module("swiftune.kernels.decode_attention")

KV_HEADS, GROUP, DIM = 8, 4, 128  # Qwen3-8B's attention


def _case(rows: int, slots: int, fp8: bool, capacity: int):
    """query [B, Hk, g, D] and the cache's first ``slots`` slots of a ``capacity``-slot buffer."""
    q = torch.randn(rows, KV_HEADS, GROUP, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, KV_HEADS, capacity, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cur = torch.full((rows,), slots - 1, device="cuda", dtype=torch.long)
    scales = {}
    if fp8:
        k_scale, v_scale = (t.abs().amax(-1).float() / 448 for t in (k, v))
        k = (k.float() / k_scale[..., None]).to(torch.float8_e4m3fn)
        v = (v.float() / v_scale[..., None]).to(torch.float8_e4m3fn)
        scales = {"key_scales": k_scale[:, :, :slots], "value_scales": v_scale[:, :, :slots]}
    return q, k[:, :, :slots], v[:, :, :slots], cur, scales


def _seconds(fn, calls: int = 20, replays: int = 10) -> float:
    """Median GPU seconds per call: ``calls`` calls captured in one CUDA graph (a decode step's attention runs
    inside the engine's graph, so the host's launch cost is not the kernel's), the graph replayed ``replays``
    times, each replay timed with CUDA events."""
    fn()  # compiled before capture
    replay, _ = as_graph(lambda: [fn() for _ in range(calls)])
    return bench(replay, warmup=1, iters=replays) / 1e3 / calls


def sweep(rows: int, slots: int, fp8: bool, settings: list[dict], budget_s: float) -> list[dict]:
    """Each setting's time for one case; the first setting is the default (``{}``)."""
    q, k, v, cur, scales = _case(rows, slots, fp8, capacity=slots + 256)
    out = torch.empty_like(q)
    item = 1 if fp8 else 2
    read = 2 * rows * KV_HEADS * slots * (DIM * item + (4 if fp8 else 0))
    found, deadline = [], time.monotonic() + budget_s
    for i, setting in enumerate(settings):
        if time.monotonic() > deadline and i < len(settings) - 1:
            continue  # out of time: only the default's second timing (the last setting) is left to run
        try:
            chunks = attention._launch_split(q, k, v, cur, None, DIM ** -0.5, None, scales.get("key_scales"),
                                             scales.get("value_scales"), out, **setting)
            seconds = _seconds(lambda: attention._launch_split(
                q, k, v, cur, None, DIM ** -0.5, None, scales.get("key_scales"), scales.get("value_scales"), out,
                **setting))
        except Exception as error:  # a setting the compiler refuses (shared memory): skip it  # noqa: BLE001
            print(f"  {setting}: {type(error).__name__}: {str(error)[:120]}")
            continue
        found.append({"rows": rows, "slots": slots, "cache": "fp8" if fp8 else "bf16", "setting": setting,
                      "chunks": chunks, "us": seconds * 1e6, "tb_per_s": read / seconds / 1e12})
    return found


def settings_to_try(rows: int, slots: int) -> list[dict]:
    """The default first, then tiles x warps x stages x chunks a row (1, the default's, and 2x / 4x it), then
    the default again (a first setting timed on a cold GPU reads slower: each case reports the faster of the
    default's two timings)."""
    programs = rows * KV_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tried = [{}]
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        default = max(1, min(triton.cdiv(slots, block_n), triton.cdiv(2 * sms, programs)))
        for splits in sorted({1, default, 2 * default, 4 * default}):
            if splits <= triton.cdiv(slots, block_n):
                tried.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits})
    return tried + [{}]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    p.add_argument("--slots", type=int, nargs="+", default=[256, 768, 2048])
    p.add_argument("--caches", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    p.add_argument("--case-budget", type=float, default=15.0, help="seconds a case may sweep")
    p.add_argument("--out", default=None, help="write every timed setting and each case's best here (JSON)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    timed, best = [], []
    for cache, rows, slots in itertools.product(a.caches, a.rows, a.slots):
        found = sweep(rows, slots, cache == "fp8", settings_to_try(rows, slots), a.case_budget)
        defaults = [r for r in found if not r["setting"]]
        if not defaults:
            continue
        default = min(defaults, key=lambda r: r["us"])
        top = min(found, key=lambda r: r["us"])
        timed += found
        best.append({"rows": rows, "slots": slots, "cache": cache, "default_us": default["us"],
                     "default_chunks": default["chunks"], "default_tb_per_s": default["tb_per_s"],
                     "best_us": top["us"], "best": top["setting"], "best_chunks": top["chunks"],
                     "best_tb_per_s": top["tb_per_s"], "speedup": default["us"] / top["us"],
                     "settings_timed": len(found)})
        print(f"{cache:4s} G={rows:3d} slots {slots:5d}: default {default['us']:7.1f} us "
              f"({default['tb_per_s']:.2f} TB/s, {default['chunks']} chunks)  best {top['us']:7.1f} us "
              f"({top['tb_per_s']:.2f} TB/s) {top['setting']}  x{default['us'] / top['us']:.2f}", flush=True)
    if a.out:
        device = torch.cuda.get_device_name(0)
        with open(a.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                       "shape": {"kv_heads": KV_HEADS, "group": GROUP, "dim": DIM}, "best": best,
                       "timed": timed}, f, indent=1)


if __name__ == "__main__":
    main()
