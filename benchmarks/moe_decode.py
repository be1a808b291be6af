"""One MoE layer's routed experts in a decode step: the fused decode kernels vs today's grouped-GEMM path.

Qwen3-30B-A3B's experts (128 experts top-8, hidden 2048, expert intermediate 768; the shape table of
benchmarks/workload.py), or gpt-oss-20b's (32 experts top-4, hidden and intermediate 2,880; transposed
stacks with interleaved gate/up columns, biases, clamped SwiGLU), bf16, transformers' own experts module
and router with random weights, routing from that router on random hidden states, at T = 8 and 64 tokens
(the rollout engine's G = 8 / 64 rows) by default.
Timed on the same tensors in one process, each as a CUDA graph replay (how the engine's decode step
runs) and eagerly:

* ``grouped_mm``: ``rollout_experts_forward(..., decode_kernel=False)``, the path the engine ran before
  (sort, gather, ``F.grouped_mm`` gate/up, SwiGLU, ``F.grouped_mm`` down, routing weight, k-slot combine);
* ``kernel``: :func:`swiftune.kernels.moe_decode.moe_decode` (what ``rollout_experts_forward`` now runs
  for these steps), at its default tiles, then a small sweep of tile widths / depths / warps (the fastest
  reported, to tune the launcher's defaults);
* ``floor``: the bytes of the distinct experts the routing reads (gate/up and down of each), over the
  device-to-device copy bandwidth measured here.

Checks before timing: the kernel equals the float32 reference loop within bf16 tolerance and today's
path within bf16 tolerance; ``rollout_experts_forward`` (kernel allowed) returns the kernel's output bit
for bit; a graph replay equals the eager call bit for bit.

    python -m benchmarks.moe_decode --out moe_decode.json      # H200: well under a minute
    python -m benchmarks.moe_decode --model gpt-oss-20b --out moe_decode_gptoss.json
    python -m benchmarks.moe_decode --model tiny-moe --tokens 4 --iters 2 --out /tmp/m.json   # CPU smoke

On a machine without CUDA the kernel column is the plain-PyTorch reference (no interpreter) and
nothing is captured: the smoke run checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import transformers

from benchmarks import results
from benchmarks.kernels import bench
from benchmarks.workload import model_config
from swiftune.kernels.moe_decode import moe_decode, moe_decode_reference
from swiftune.models.experts import default_decode_kernel_cap, rollout_experts_forward
from swiftune.models.families import FAMILIES, ExpertsSpec

# the tiles timed beside the launcher's defaults (each compiles both GEMM kernels once: a few seconds apiece,
# within the script's minute), each checked against the float32 reference first:
# (block_n, block_k, num_warps, block_m): block_m None is the launcher's (the token count's power of two); 16 is
# one tensor-core tile of rows, which at 64 tokens wastes less work on experts that hold a few rows each
SWEEP = [(16, 64, 4, None), (64, 64, 4, None), (32, 128, 8, None), (64, 128, 8, None),
         (32, 64, 4, 16), (64, 64, 4, 16), (64, 128, 8, 16)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_ms(fn, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU: benchmarks.kernels.bench; the wall clock on the CPU)."""
    if cuda:
        return bench(fn, warmup=2, iters=iters)
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def as_graph(fn):
    """``fn`` captured in a CUDA graph (after a warm-up that compiles): returns the replay and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def copy_bandwidth(cuda: bool, iters: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of 2 GB (1 GB of CPU memory on the CPU)."""
    n = (2 if cuda else 1) * 2**30 // 2 // (1 if cuda else 64)
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda" if cuda else "cpu").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, cuda)
    return 2 * src.numel() * 2 / (ms * 1e-3)


#: the experts module and router classes of each family this benchmark takes (transformers' own)
LAYERS = {"qwen3_moe": ("qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeTopKRouter"),
          "gpt_oss": ("gpt_oss", "GptOssExperts", "GptOssTopKRouter")}


def build_layer(model: str, device: str, dtype: torch.dtype):
    """transformers' experts module and router of ``model``'s config (Qwen3-MoE or gpt-oss), random
    weights; ``None`` for another family."""
    config = model_config(model)
    if config.model_type not in LAYERS:
        return None, None, config
    package, experts_cls, router_cls = LAYERS[config.model_type]
    mod = getattr(transformers.models, package)
    mod = getattr(mod, f"modeling_{package}")
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: 30B-A3B's expert stacks are 2.4 GB in float32
        experts, router = getattr(mod, experts_cls)(config), getattr(mod, router_cls)(config)
    with torch.no_grad():
        for p in list(experts.parameters()) + list(router.parameters()):
            p.normal_(0.0, 0.02)
    return experts.to(device, dtype).eval(), router.to(device, dtype).eval(), config


def spec_of(config) -> ExpertsSpec:
    """How the config's family stores its expert stacks."""
    return FAMILIES[config.model_type].experts


def measure(experts, router, config, tokens: int, iters: int, cuda: bool, copy_bw: float, sweep: bool
            ) -> list[dict]:
    device = experts.gate_up_proj.device
    spec = spec_of(config)
    # gpt-oss: interleaved gate/up columns, biases and its clamped SwiGLU (the module's own constants)
    layout_options = {}
    if spec.interleaved:
        layout_options = dict(interleaved=True, gate_up_bias=experts.gate_up_proj_bias,
                              down_bias=experts.down_proj_bias, activation="clamped_swiglu",
                              swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit))
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=experts.gate_up_proj.dtype)
    with torch.no_grad():
        _, weights, index = router(hidden)
        weights = weights.to(hidden.dtype)
        distinct = int(index.unique().numel())  # host read, outside anything timed or captured
        width = experts.gate_up_proj.element_size()
        per_expert = sum(p[0].numel() for p in experts.parameters()) * width  # (and the biases)
        floor_ms = distinct * per_expert / copy_bw * 1e3

        def today():
            return rollout_experts_forward(experts, hidden, index, weights, spec=spec, decode_kernel=False)

        def kernel(block_n=None, block_k=None, num_warps=None, block_m=None):
            return moe_decode(hidden, index, weights, experts.gate_up_proj, experts.down_proj,
                              transposed=spec.transposed, **layout_options, block_n=block_n, block_k=block_k,
                              num_warps=num_warps, block_m=block_m)

        got, base = kernel(), today()
        want = moe_decode_reference(hidden, index, weights, experts.gate_up_proj, experts.down_proj,
                                    transposed=spec.transposed, **layout_options, compute_dtype=torch.float32)
        checks = dict(vs_reference=rel_err(got, want), vs_grouped_mm=rel_err(got, base))
        assert checks["vs_reference"] < 1e-2 and checks["vs_grouped_mm"] < 2e-2, checks
        if cuda:
            # the layer takes the kernel up to its layout's default cap, the grouped GEMM above
            routed = got if tokens <= default_decode_kernel_cap(spec) else base
            assert torch.equal(rollout_experts_forward(experts, hidden, index, weights, spec=spec), routed)
        rows = []
        for name, fn in (("grouped_mm", today), ("kernel", kernel)):
            eager_ms = time_ms(fn, iters, cuda)
            graph_ms = None
            if cuda:
                replay, captured = as_graph(fn)
                replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, fn()), name  # replay == eager, bit for bit
                graph_ms = time_ms(replay, iters, cuda)
            rows.append(dict(path=name, tokens=tokens, distinct_experts=distinct, eager_ms=eager_ms, graph_ms=graph_ms,
                             floor_ms=floor_ms, **checks))
        if cuda and sweep:  # the tile sweep (graph replays), to tune the launcher's defaults
            best = None
            for block_n, block_k, warps, block_m in SWEEP:
                tile = (block_n, block_k, warps, block_m)
                err = rel_err(kernel(*tile), want)
                assert err < 1e-2, (tile, err)  # every tile computes the same experts
                replay, _ = as_graph(lambda t=tile: kernel(*t))
                ms = time_ms(replay, iters, cuda)
                if best is None or ms < best[0]:
                    best = (ms, f"{block_n}/{block_k}/{warps}" + (f"/m{block_m}" if block_m else ""))
            rows[-1].update(best_ms=best[0], best_tile=best[1])
    return rows


def to_result_rows(data: dict, ctx: results.Context) -> list[results.Row]:
    out = []
    for r in data["rows"]:
        s = {"tokens": r["tokens"], "distinct_experts": r["distinct_experts"], "dtype": data["meta"]["dtype"]}
        mode = "moe_decode_kernel" if r["path"] == "kernel" else "moe_grouped_mm"
        time_key = "graph_ms" if r["graph_ms"] is not None else "eager_ms"
        out.append(ctx.row("swiftune", mode, data["meta"]["model"], {**s, "timing": time_key[:-3]}, "ms", r[time_key]))
        if r["path"] == "kernel":
            out.append(ctx.row("swiftune", mode, data["meta"]["model"], s, "hbm_floor_ms", r["floor_ms"]))
            out.append(ctx.row("swiftune", mode, data["meta"]["model"], s, "copy_fraction",
                               r["floor_ms"] / r[time_key]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="a Qwen3-MoE or gpt-oss shape of benchmarks/workload.py")
    p.add_argument("--tokens", default="8,64", help="comma-separated token counts of the decode step")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--rows", default=None, help="result rows (JSON Lines); default: --out with .rows.jsonl")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16
    experts, router, config = build_layer(args.model, "cuda" if cuda else "cpu", dtype)
    if experts is None:
        print(f"--model {args.model} is a {config.model_type} shape; give a Qwen3-MoE or gpt-oss one "
              "(qwen3-30b-a3b, gpt-oss-20b, tiny-moe, tiny-gpt-oss)", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth(cuda, args.iters)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows += measure(experts, router, config, tokens, args.iters, cuda, copy_bw, not args.no_sweep)
    meta = dict(model=args.model, dtype=str(dtype).removeprefix("torch."), gpu=torch.cuda.get_device_name() if cuda
                else "cpu", torch=torch.__version__, copy_tb_s=copy_bw / 1e12, experts=experts.num_experts,
                top_k=config.num_experts_per_tok, hidden=config.hidden_size, inter=experts.down_proj.shape[1]
                if spec_of(config).transposed else experts.down_proj.shape[2])
    data = dict(benchmark="moe_decode", meta=meta, rows=rows)
    print(f"\n{meta}")
    print(f"{'path':<11} {'T':>3} {'experts':>7} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'x floor':>8} "
          f"{'best ms':>8} {'n/k/warps[/m]':>14}")
    for r in rows:
        timed = r["graph_ms"] if r["graph_ms"] is not None else r["eager_ms"]
        graph = f"{r['graph_ms']:9.4f}" if r["graph_ms"] is not None else f"{'-':>9}"
        best = f"{r['best_ms']:8.4f} {r['best_tile']:>14}" if "best_ms" in r else ""
        print(f"{r['path']:<11} {r['tokens']:>3} {r['distinct_experts']:>7} {r['eager_ms']:9.4f} {graph} "
              f"{r['floor_ms']:9.4f} {timed / r['floor_ms']:8.2f} {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    path = results.rows_path(args.rows, args.out)
    if path:
        n = results.write_rows(path, to_result_rows(data, results.run_context("moe_decode", argv)))
        print(f"# {n} result rows: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
