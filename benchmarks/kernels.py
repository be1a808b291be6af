"""Kernel microbenchmarks: forward + backward of each swiftune kernel on one GPU (forward only
for the decoding kernels ``add_rms_norm`` and ``decode_qkv`` and for ``fp8_quant``; for ``decode_qkv``
the "eager" column is the unfused swiftune kernels it replaces).

Baselines measured in the same process on the same tensors:
  (a) transformers' eager implementation (apply_rotary_pos_emb, LlamaRMSNorm, act * up),
  (b) torch.compile of that same eager code.
Achieved bandwidth counts the bytes each kernel must move at minimum (inputs read once,
outputs written once) and is compared with a device-to-device copy measured here too.

    python -m benchmarks.kernels                 # sizes of several GB, prints a table
    python -m benchmarks.kernels --out k.json    # also writes the rows as JSON
    python -m benchmarks.kernels --fp8-matmul --out f.json   # only the FP8 decode matmul table (below)
    python -m benchmarks.kernels --nf4-matmul --out n.json   # only the NF4 decode matmul table (below)

The FP8 decode matmul (no grad) has a table of its own: Qwen3-8B's projection shapes at M = 1, 8,
32, 64 rows, four ways to run that product on the same tensors: the weight-only kernel
(``fp8_weight_only_matmul``: x unquantised, codes decoded to bf16), the FP8 x FP8 kernel
(``fp8_dot_matmul``: fused per-row quantise of x, then ``tl.dot`` on e4m3 codes; the "dot" columns),
the FP8 linear's ``torch._scaled_mm`` path (the same quantise, then ``_scaled_mm``) and a bf16 matmul
on the bf16 weight. Each call cycles through enough copies of the weight (>= 256 MB) that none is read
from L2, as in a decode step, where every layer's weights differ; GB/s counts the bytes each path must
read (codes or bf16 weight, x, scales) and write. Default tiles are timed everywhere; the weight-only
kernel's tile widths, K splits and decodings are swept at M = 8 (it is dispatched up to 16), the FP8 x
FP8 kernel's tiles, splits, operand order, warps, stages and accumulator promotion at M = 64 (the
G = 64 decode step), to tune the launchers' heuristics. The dot path's result is checked against
``_scaled_mm``'s on the same codes (``dot_rel_err``), and a last line adds up one decoder layer's seven
projections per M: the fastest FP8 path of each against bf16.

The NF4 decode matmul table (``--nf4-matmul``, needs bitsandbytes) times, on Qwen3-8B's projection shapes at
M = 1, 8, 16 rows (the NF4 kernel's rows in the rollout engine), swiftune's weight-only NF4 kernel
(``nf4_weight_only_matmul``: codes and double-quantised absmax decoded in registers) against bitsandbytes'
own ``Linear4bit`` forward on the same layer (what the engine runs without the kernel: a fused
matrix-vector product at one row, dequantise-then-multiply above) and a bf16 matmul, with the same
L2-defeating copies; GB/s counts the codes, the absmax, x and y. Each kernel result is checked against
bitsandbytes' on the same codes (``rel_err``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import results
from swiftune.kernels import (add_rms_norm, decode_qkv, decode_qkv_reference, fp8_quantize_rowwise,
                              fp8_quantize_rowwise_reference, fp8_weight_only_matmul, geglu, rms_norm, rope_qk,
                              swiglu)
from swiftune.kernels.fp8_dot import fp8_dot_matmul, fp8_dot_quantize


def bench(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() over iters runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(nbytes: int = 4 * 2**30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)  # bytes read + written per second


def fwd_bwd(op, inputs, grads):
    def run():
        for t in inputs:
            t.grad = None
        outs = op(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads)

    return run


def hf_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def hf_rms(x, w, eps=1e-6):
    # transformers' LlamaRMSNorm.forward, written out so torch.compile sees the same ops
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def hf_add_rms(x, res, w, eps=1e-6):
    # a pre-norm layer's residual add, then transformers' RMSNorm
    s = x + res
    return hf_rms(s, w, eps), s


def unfused_decode_qkv(q, k, v, wq, wk, cos, sin, kc, vc, slot):
    # what the engine ran before decode_qkv: two norm kernels, the RoPE kernel, two indexed writes
    q, k = rms_norm(q[:, :, None], wq, 1e-6), rms_norm(k[:, :, None], wk, 1e-6)
    q, k = rope_qk(q, k, cos[:, None], sin[:, None])
    rows = torch.arange(q.shape[0], device=q.device)
    kc[rows, :, slot] = k[:, :, 0]
    vc[rows, :, slot] = v
    return q


def cases(scale: float):
    dt = torch.bfloat16
    # RoPE: Qwen3-8B attention shapes (32 q heads, 8 kv heads, head_dim 128), one long row
    S = int(131072 * scale)
    q = torch.randn(1, S, 32, 128, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    k = torch.randn(1, S, 8, 128, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    pos = torch.arange(S, device="cuda")[None].float()
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qk_bytes = (q.numel() + k.numel()) * 2
    rope_bytes = 2 * (2 * qk_bytes + 2 * cos.numel() * 2)  # fwd + bwd: read+write q,k; read cos,sin
    yield (
        "rope_qk", f"q[1,32,{S},128] k[1,8,{S},128]", rope_bytes,
        fwd_bwd(lambda a, b: rope_qk(a, b, cos, sin), [q, k], (gq, gk)),
        fwd_bwd(lambda a, b: hf_rope(a, b, cos, sin), [q, k], (gq, gk)),
        fwd_bwd(torch.compile(lambda a, b: hf_rope(a, b, cos, sin)), [q, k], (gq, gk)),
    )
    del q, k, gq, gk, cos, sin, emb

    # SwiGLU / GeGLU: Qwen3-8B MLP intermediate (12288) over many tokens
    T, I = int(65536 * scale), 12288
    g = torch.randn(T, I, device="cuda", dtype=dt, requires_grad=True)
    u = torch.randn(T, I, device="cuda", dtype=dt, requires_grad=True)
    go = torch.randn(T, I, device="cuda", dtype=dt)
    glu_bytes = (3 + 5) * g.numel() * 2  # fwd: read g,u write out; bwd: read dout,g,u write dg,du
    eager_swiglu = lambda a, b: F.silu(a) * b  # noqa: E731
    eager_geglu = lambda a, b: F.gelu(a, approximate="tanh") * b  # noqa: E731
    yield (
        "swiglu", f"[{T},{I}]", glu_bytes,
        fwd_bwd(swiglu, [g, u], (go,)),
        fwd_bwd(eager_swiglu, [g, u], (go,)),
        fwd_bwd(torch.compile(eager_swiglu), [g, u], (go,)),
    )
    yield (
        "geglu_tanh", f"[{T},{I}]", glu_bytes,
        fwd_bwd(lambda a, b: geglu(a, b, "tanh"), [g, u], (go,)),
        fwd_bwd(eager_geglu, [g, u], (go,)),
        fwd_bwd(torch.compile(eager_geglu), [g, u], (go,)),
    )
    del g, u, go

    # RMSNorm: hidden 4096 over many tokens, weight gradient included
    T, H = int(262144 * scale), 4096
    x = torch.randn(T, H, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(H, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=dt)
    rms_bytes = (2 + 3) * x.numel() * 2  # fwd: read x write y; bwd: read dy,x write dx
    yield (
        "rms_norm", f"[{T},{H}]", rms_bytes,
        fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), [x, w], (dy,)),
        fwd_bwd(hf_rms, [x, w], (dy,)),
        fwd_bwd(torch.compile(hf_rms), [x, w], (dy,)),
    )
    del x, w, dy

    # residual add + RMSNorm (decoding, no grad): many tokens for bandwidth, and the rollout
    # engine's decode shape (8 rows of Qwen3-1.7B's 2048), where launches dominate
    for T, H in ((int(262144 * scale), 4096), (8, 2048)):
        x, res = (torch.randn(T, H, device="cuda", dtype=dt) for _ in range(2))
        w = torch.randn(H, device="cuda", dtype=dt)
        yield (
            "add_rms", f"[{T},{H}] no grad", 4 * x.numel() * 2,  # read x, residual; write y, sum
            torch.no_grad()(lambda x=x, res=res, w=w: add_rms_norm(x, res, w, 1e-6)),
            torch.no_grad()(lambda x=x, res=res, w=w: hf_add_rms(x, res, w)),
            torch.no_grad()(lambda x=x, res=res, w=w, f=torch.compile(hf_add_rms): f(x, res, w)),
        )

    # one decode step's q/k norms + RoPE + K/V cache writes, Qwen3-1.7B heads, 8 rows (launch-bound);
    # baselines: the unfused swiftune kernels, and the plain-PyTorch reference compiled
    B, Hq, Hk, D, L = 8, 16, 8, 128, 1280
    q, k, v = (torch.randn(B, h, D, device="cuda", dtype=dt) for h in (Hq, Hk, Hk))
    wq, wk = (torch.rand(D, device="cuda", dtype=dt) + 0.5 for _ in range(2))
    cos, sin = (torch.randn(B, D, device="cuda", dtype=dt) for _ in range(2))
    kc, vc = (torch.zeros(B, Hk, L, D, device="cuda", dtype=dt) for _ in range(2))
    slot = torch.randint(0, L, (B,), device="cuda")
    args = (q, k, v, wq, wk, cos, sin, kc, vc, slot)
    yield (
        "decode_qkv", f"B{B} Hq{Hq} Hk{Hk} D{D} no grad", 2 * (q.numel() + 2 * k.numel()) * 2,
        torch.no_grad()(lambda: decode_qkv(q, k, v, wq, wk, 1e-6, cos, sin, kc, vc, slot)),
        torch.no_grad()(lambda: unfused_decode_qkv(*args)),
        torch.no_grad()(lambda f=torch.compile(decode_qkv_reference): f(q, k, v, wq, wk, 1e-6, cos, sin, kc, vc, slot)),
    )

    # per-row FP8 quantisation of the FP8 linear's inputs (no grad): Qwen3-8B's hidden and MLP
    # widths over a 16K-token batch, and a G=64 decode step; baselines: the unfused torch ops
    # (absmax, divide, clamp, cast: a float32 copy of x) eager and compiled
    for T, H in ((int(16384 * scale), 4096), (int(16384 * scale), 12288), (64, 4096)):
        x = torch.randn(T, H, device="cuda", dtype=dt)
        yield (
            "fp8_quant", f"[{T},{H}] bf16 no grad", x.numel() * (2 + 1) + T * 4,  # read x; write codes, scales
            torch.no_grad()(lambda x=x: fp8_quantize_rowwise(x)),
            torch.no_grad()(lambda x=x: fp8_quantize_rowwise_reference(x)),
            torch.no_grad()(lambda x=x, f=torch.compile(fp8_quantize_rowwise_reference): f(x)),
        )


QWEN3_8B_PROJECTIONS = {  # name -> (N, K): out and in features of each decoder linear
    "q/o_proj": (4096, 4096), "k/v_proj": (1024, 4096), "gate/up_proj": (12288, 4096), "down_proj": (4096, 12288),
}
# the projections that read one input, their weights stacked along N (per-row scales stack with them): one product
# instead of three or two. The FP8 table times them too: whether a decode step would gain by stacking them
QWEN3_8B_STACKED = {"qkv_stacked": (6144, 4096), "gate_up_stacked": (24576, 4096)}
_FP8_SWEEP = [(bn, sk) for bn in (32, 64, 128) for sk in (1, 2, 4)]  # few: each is a compile
_FP8_MS = (1, 8, 32, 64)  # decode rows: G = 1 .. 64 completions a step
# the weight-only kernel is dispatched up to 16 rows (models/fp8_linear.py); its sweep at M = 1 matched M = 8's
# (docs/results/2026-12-02): one M keeps the compiles, and the whole table, within 90 s
_WEIGHT_ONLY_SWEEP_MS = (8,)
_DOT_SWEEP_MS = (64,)  # the G = 64 decode step (FP8's decode target)
_DOT_SWEEP = [  # fp8_dot_matmul overrides, each a compile (shapes share them); {} = the defaults
    dict(block_n=64), dict(block_n=128), dict(block_n=128, split_k=1), dict(block_n=64, split_k=8),
    dict(swap_ab=False, block_n=128), dict(block_n=256, num_warps=8), dict(num_warps=8, num_stages=3),
    dict(block_k=256, num_stages=3), dict(num_stages=6), dict(precise_acc=False),
    # 64-column tiles were the fastest for the stacked products on both cards (2026-12-03, 2026-12-06): their
    # neighbours, to choose the default from rather than from one point
    dict(block_n=32), dict(block_n=64, split_k=1), dict(block_n=64, split_k=2), dict(block_n=64, split_k=4),
    dict(block_n=64, num_stages=3), dict(block_n=64, num_stages=6), dict(block_n=64, block_k=256, num_stages=3),
    dict(block_n=64, num_warps=2),
    dict(reduce_in_launch=True),  # a split K's partials added by each tile's last program, not a second launch
]
# one decoder layer's products: as the model has them, and with q/k/v and gate/up each stacked into one
_LAYER_PROJECTIONS = {"q/o_proj": 2, "k/v_proj": 2, "gate/up_proj": 2, "down_proj": 1}
_STACKED_LAYER_PROJECTIONS = {"qkv_stacked": 1, "q/o_proj": 1, "gate_up_stacked": 1, "down_proj": 1}


def graph_ms(fn, copies: int, reps: int = 5) -> float:
    """Milliseconds of one ``fn(i)`` call: ``fn(0) .. fn(copies - 1)`` captured in one CUDA graph (as
    the rollout engine runs a decode step: a few-microsecond kernel is not timed behind its Python
    launch), the graph replayed ``reps`` times per timing."""
    def run():
        for i in range(copies):
            fn(i)

    run()  # compiles the Triton kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def replay():
        for _ in range(reps):
            graph.replay()

    return bench(replay) / (reps * copies)


def fp8_matmul_rows(copy_bw: float) -> list[dict]:
    """The FP8 decode matmul table (see the module doc): weight-only kernel vs the _scaled_mm path vs
    bf16, per Qwen3-8B projection shape and M, plus the fastest tile / split / decoding."""
    from swiftune.models.fp8_linear import FP8State, fp8_matmul, quantize_rowwise

    rows = []
    native = torch.cuda.get_device_capability() >= (8, 9)
    for name, (n, k) in {**QWEN3_8B_PROJECTIONS, **QWEN3_8B_STACKED}.items():
        copies = max(2, -(-(256 * 2**20) // (2 * n * k)))  # the bf16 copies alone exceed L2 several times
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        q, s = zip(*(quantize_rowwise(w) for w in w16))
        s1 = [v.view(-1) for v in s]  # the kernels take the scales as [N]
        for m in _FP8_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def timed(fn):
                return graph_ms(fn, copies)

            with torch.no_grad():
                t_ours = timed(lambda i: fp8_weight_only_matmul(x, q[i], s[i]))
                # a split K's partials added by each tile's last program instead of a second launch (the same bits)
                t_ours_in_launch = timed(lambda i: fp8_weight_only_matmul(x, q[i], s[i], reduce_in_launch=True))
                try:  # the FP8 linear's training / prefill path: fused quantise of x, then _scaled_mm
                    t_scaled = timed(lambda i: fp8_matmul(x, q[i], FP8State(s[i], True), torch.bfloat16))
                    y_scaled = fp8_matmul(x, q[0], FP8State(s[0], True), torch.bfloat16)
                except RuntimeError as e:  # no FP8 tensor cores (or an M _scaled_mm refuses)
                    print(f"fp8_matmul {name} M={m}: _scaled_mm path did not run: {e}", file=sys.stderr)
                    t_scaled, y_scaled = float("nan"), None
                t_bf16 = timed(lambda i: torch.mm(x, w16[i].t()))
                best = (t_ours, None, None, "auto")
                if m in _WEIGHT_ONLY_SWEEP_MS:
                    for bn, sk in _FP8_SWEEP:
                        t = timed(lambda i, bn=bn, sk=sk: fp8_weight_only_matmul(x, q[i], s[i], block_n=bn, split_k=sk))
                        best = min(best, (t, bn, sk, "auto"), key=lambda r: r[0])
                    for decode in ("bits", "native") if native else ("bits",):
                        t = timed(lambda i, d=decode: fp8_weight_only_matmul(x, q[i], s[i], block_n=best[1],
                                                                             split_k=best[2], decode=d))
                        best = min(best, (t, best[1], best[2], decode), key=lambda r: r[0])
                # the FP8 x FP8 kernel: the same quantise launch as _scaled_mm's path, then tl.dot on e4m3
                t_dot = timed(lambda i: fp8_dot_matmul(x, q[i], s1[i]))
                y_dot = fp8_dot_matmul(x, q[0], s1[0])
                dot_err = (float((y_dot.float() - y_scaled.float()).norm() / y_scaled.float().norm())
                           if y_scaled is not None else float("nan"))
                # and given x's codes, as the decode step runs it (the norm kernel makes q/k/v's and gate/up's
                # codes; o/down's quantise launch is the same whatever the product's tiles): the sweep's times
                xq, xs = fp8_dot_quantize(x)
                t_codes = timed(lambda i: fp8_dot_matmul(xq, q[i], s1[i], x_scale=xs))
                dot_best, sweep = (t_dot, "default"), {}
                if m in _DOT_SWEEP_MS:
                    for cfg in _DOT_SWEEP:
                        label = ",".join(f"{key}={val}" for key, val in cfg.items())
                        sweep[label] = timed(lambda i, cfg=cfg: fp8_dot_matmul(xq, q[i], s1[i], x_scale=xs, **cfg))
                    label = min(sweep, key=sweep.get)
                    # the best overrides' time with the quantise launch, comparable with dot_ms
                    dot_best = min(dot_best, (t_dot - t_codes + sweep[label], label), key=lambda r: r[0])
            fp8_bytes = n * k + 2 * m * k + 4 * n + 2 * m * n
            bf16_bytes = 2 * n * k + 2 * m * k + 2 * m * n
            rows.append(dict(
                kernel="fp8_matmul", shape=f"{name} N{n} K{k} M{m}", m=m, weight_mb=n * k / 1e6,
                ours_ms=t_ours, ours_reduce_in_launch_ms=t_ours_in_launch, scaled_mm_ms=t_scaled, bf16_ms=t_bf16,
                vs_scaled_mm=t_scaled / t_ours, vs_bf16=t_bf16 / t_ours,
                ours_gb_s=fp8_bytes / (t_ours * 1e-3) / 1e9, bf16_gb_s=bf16_bytes / (t_bf16 * 1e-3) / 1e9,
                scaled_mm_gb_s=fp8_bytes / (t_scaled * 1e-3) / 1e9, of_copy=fp8_bytes / (t_ours * 1e-3) / copy_bw,
                best_ms=best[0], best_block_n=best[1], best_split_k=best[2], best_decode=best[3],
                dot_ms=t_dot, dot_gb_s=fp8_bytes / (t_dot * 1e-3) / 1e9, dot_vs_bf16=t_bf16 / t_dot,
                dot_vs_scaled_mm=t_scaled / t_dot, dot_of_copy=fp8_bytes / (t_dot * 1e-3) / copy_bw,
                dot_best_ms=dot_best[0], dot_best_cfg=dot_best[1], dot_rel_err=dot_err,
                dot_codes_ms=t_codes, **({"dot_codes_sweep_ms": sweep} if sweep else {}),
            ))
        torch.cuda.empty_cache()
    return rows


def layer_summary(rows: list[dict], stacked: bool = False) -> list[dict]:
    """Per M: one Qwen3-8B decoder layer's seven projections (q, k, v, o, gate, up, down) in bf16 and
    with the fastest FP8 path of each (weight-only, dot or _scaled_mm, defaults and swept tiles);
    ``stacked``: the same layer with q/k/v and gate/up each one product (``QWEN3_8B_STACKED``), where
    the rows have them."""
    layout = _STACKED_LAYER_PROJECTIONS if stacked else _LAYER_PROJECTIONS
    out = []
    for m in sorted({r["m"] for r in rows}):
        bf16 = fp8 = 0.0
        paths = []
        mine = {name: r for r in rows if r["m"] == m and (name := r["shape"].split()[0]) in layout}
        if set(mine) != set(layout):
            continue
        for name, r in mine.items():
            options = {"weight_only": min(r["ours_ms"], r["best_ms"]), "dot": min(r["dot_ms"], r["dot_best_ms"]),
                       "scaled_mm": r["scaled_mm_ms"]}
            path = min((p for p in options if math.isfinite(options[p])), key=options.get)
            bf16 += layout[name] * r["bf16_ms"]
            fp8 += layout[name] * options[path]
            paths.append(f"{name}:{path}")
        out.append(dict(m=m, bf16_layer_ms=bf16, fp8_layer_ms=fp8, fp8_vs_bf16=bf16 / fp8, paths=" ".join(paths),
                        **({"stacked": True} if stacked else {})))
    return out


def print_fp8_matmul(rows: list[dict], summary: list[dict]) -> None:
    print(f"{'fp8 matmul':<34} {'M':>3} {'ours ms':>8} {'GB/s':>6} {'%copy':>6} {'scaled_mm':>9} {'GB/s':>6} "
          f"{'bf16 ms':>8} {'GB/s':>6} {'x s_mm':>7} {'x bf16':>7} {'best ms':>8} {'tile/split/decode':>18}")
    for r in rows:
        cfg = f"{r['best_block_n']}/{r['best_split_k']}/{r['best_decode']}" if r["best_block_n"] else "default"
        print(f"{r['shape']:<34} {r['m']:>3} {r['ours_ms']:8.4f} {r['ours_gb_s']:6.0f} {100 * r['of_copy']:5.0f}% "
              f"{r['scaled_mm_ms']:9.4f} {r['scaled_mm_gb_s']:6.0f} {r['bf16_ms']:8.4f} {r['bf16_gb_s']:6.0f} "
              f"{r['vs_scaled_mm']:7.2f} {r['vs_bf16']:7.2f} {r['best_ms']:8.4f} {cfg:>18}")
    print(f"\n{'fp8 x fp8 dot (fp8_dot_matmul)':<34} {'M':>3} {'dot ms':>8} {'GB/s':>6} {'%copy':>6} {'x bf16':>7} "
          f"{'x s_mm':>7} {'rel err':>8} {'best ms':>8}  best overrides")
    for r in rows:
        print(f"{r['shape']:<34} {r['m']:>3} {r['dot_ms']:8.4f} {r['dot_gb_s']:6.0f} {100 * r['dot_of_copy']:5.0f}% "
              f"{r['dot_vs_bf16']:7.2f} {r['dot_vs_scaled_mm']:7.2f} {r['dot_rel_err']:8.1e} {r['dot_best_ms']:8.4f}  "
              f"{r['dot_best_cfg']}")
    for r in rows:
        if "dot_codes_sweep_ms" in r:  # every override, x's codes given (the decode step's products)
            print(f"\n{r['shape']} M={r['m']}, codes given: defaults {r['dot_codes_ms']:.4f} ms; " + "; ".join(
                f"{label} {t:.4f}" for label, t in sorted(r["dot_codes_sweep_ms"].items(), key=lambda kv: kv[1])))
    print(f"\n{'one decoder layer (7 projections)':<34} {'M':>3} {'bf16 ms':>8} {'fp8 ms':>8} {'x bf16':>7}  fastest FP8 path")
    for r in summary:
        label = "q/k/v and gate/up stacked" if r.get("stacked") else ""
        print(f"{label:<34} {r['m']:>3} {r['bf16_layer_ms']:8.4f} {r['fp8_layer_ms']:8.4f} {r['fp8_vs_bf16']:7.2f}  {r['paths']}")


def fp8_matmul_main(argv, args, copy_bw: float) -> int:
    start = time.perf_counter()
    rows = fp8_matmul_rows(copy_bw)
    summary = layer_summary(rows) + layer_summary(rows, stacked=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=copy_bw / 1e12,
                seconds=time.perf_counter() - start)
    print(f"\n{meta}")
    print_fp8_matmul(rows, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, layer=summary), f, indent=1)
    results.save("kernels_fp8_matmul", argv, dict(meta=meta, rows=rows), args.out, args.rows)
    assert all(math.isfinite(r["ours_ms"]) and math.isfinite(r["dot_ms"]) for r in rows)
    # the dot path multiplies the codes _scaled_mm multiplies: only float32 summation order and the
    # bf16 rounding may differ (a broken compile must not report a fast time)
    assert all(not r["dot_rel_err"] > 1e-2 for r in rows), [(r["shape"], r["dot_rel_err"]) for r in rows]
    return 0


# the rows the engine sends through the NF4 kernel (models.nf4_decode: to 16 by default, 64 at most)
_NF4_MS = (1, 8, 16, 32, 64)


def nf4_layers(n: int, k: int, copies: int, device: str) -> list:
    """``copies`` bitsandbytes NF4 ``Linear4bit`` layers ``[n, k]`` (double quantisation, bf16 compute) of
    random weights, quantised on ``device``."""
    import bitsandbytes as bnb

    out = []
    for _ in range(copies):
        layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                                  quant_type="nf4", device="meta")
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        layer.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
        out.append(layer.to(device))
    return out


def _nf4_copies(n: int, k: int, copies: int | None, device: str) -> tuple[list, list]:
    """``(layers, weights)``: ``copies`` NF4 layers ``[n, k]`` (default: enough for 256 MB of bf16 weights, so
    that none is read from L2) and their :class:`NF4Weight`. The caller drops both and calls
    :func:`_free_cached` before the next shape's."""
    from swiftune.models.nf4_decode import nf4_weight_of

    layers = nf4_layers(n, k, copies or max(2, -(-(256 * 2**20) // (2 * n * k))), device)
    return layers, [nf4_weight_of(layer) for layer in layers]


def _free_cached(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _nf4_bytes(n: int, k: int, m: int) -> int:
    """What an NF4 product of ``m`` rows must move: codes, 8-bit absmax per 64, x, y."""
    return n * k // 2 + n * k // 64 + 2 * m * k + 2 * m * n


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def nf4_matmul_rows(copy_bw: float, shapes: dict | None = None, ms: tuple = _NF4_MS, device: str = "cuda",
                    timed=None, copies: int | None = None) -> list[dict]:
    """The NF4 decode matmul table (see the module doc). ``timed(fn, copies)``: milliseconds of ``fn(i)``
    (default: :func:`graph_ms`, falling back to eager timing where a path cannot be captured); ``shapes``,
    ``device``, ``timed`` and ``copies`` (default: enough for 256 MB of bf16 weights) let the CPU test run
    it small."""
    from swiftune.kernels.nf4_matmul import nf4_weight_only_matmul

    def default_timed(fn, n_copies):
        try:
            return graph_ms(fn, n_copies)
        except RuntimeError as e:  # a path that syncs or allocates where a capture cannot
            print(f"nf4_matmul: timed eagerly ({e})", file=sys.stderr)
            return bench(lambda: [fn(i) for i in range(n_copies)]) / n_copies

    timed = timed or default_timed
    rows = []
    for name, (n, k) in (shapes or QWEN3_8B_PROJECTIONS).items():
        layers, weights = _nf4_copies(n, k, copies, device)
        n_copies = len(layers)
        w16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(n_copies)]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                ref = layers[0](x)
                err = _rel_err(nf4_weight_only_matmul(x, weights[0]), ref)
                t_ours = timed(lambda i: nf4_weight_only_matmul(x, weights[i]), n_copies)
                t_bnb = timed(lambda i: layers[i](x), n_copies)
                t_bf16 = timed(lambda i: torch.mm(x, w16[i].t()), n_copies)
            nf4_bytes = _nf4_bytes(n, k, m)
            rows.append(dict(kernel="nf4_matmul", shape=f"{name} N{n} K{k} M{m}", m=m, weight_mb=n * k / 1e6,
                             ours_ms=t_ours, bnb_ms=t_bnb, bf16_ms=t_bf16, vs_bnb=t_bnb / t_ours,
                             vs_bf16=t_bf16 / t_ours, ours_gb_s=nf4_bytes / (t_ours * 1e-3) / 1e9,
                             of_copy=nf4_bytes / (t_ours * 1e-3) / copy_bw, rel_err=err))
        layers = weights = w16 = None  # this shape's copies freed before the next shape's
        _free_cached(device)
    return rows


_NF4_SWEEP = {"q/o_proj": ((4096, 4096), 8), "gate/up_proj": ((12288, 4096), 16), "down_proj": ((4096, 12288), 1)}


def nf4_sweep_rows(copy_bw: float, shapes: dict | None = None, device: str = "cuda", timed=None,
                   copies: int | None = None, block_ns: tuple = (128,), splits: tuple = (None,),
                   stages: tuple = (2, 4), lookups: tuple = (1, 2), unrolls: tuple = (1, 2, 4)) -> list[dict]:
    """The NF4 kernel's tile widths, K splits, pipeline depths, table lookups and K steps an iteration on one
    (shape, M) each (``shapes``: name -> ((N, K), M)), to tune the launcher's defaults; each result checked
    against bitsandbytes' as in the table."""
    from swiftune.kernels.nf4_matmul import nf4_weight_only_matmul

    timed = timed or graph_ms
    rows = []
    for name, ((n, k), m) in (shapes or _NF4_SWEEP).items():
        layers, weights = _nf4_copies(n, k, copies, device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = layers[0](x)
            for block_n, split_k, depth, lookup, unroll in itertools.product(block_ns, splits, stages, lookups,
                                                                              unrolls):
                def run(i, block_n=block_n, split_k=split_k, depth=depth, lookup=lookup, unroll=unroll):
                    return nf4_weight_only_matmul(x, weights[i], block_n=block_n, split_k=split_k, num_stages=depth,
                                                  lookup=lookup, unroll=unroll)

                err = _rel_err(run(0), ref)
                ms = timed(run, len(layers))
                rows.append(dict(kernel="nf4_matmul_sweep", shape=f"{name} N{n} K{k} M{m}", m=m, block_n=block_n,
                                 split_k=split_k or "auto", num_stages=depth, lookup=lookup, unroll=unroll,
                                 ours_ms=ms, rel_err=err, of_copy=_nf4_bytes(n, k, m) / (ms * 1e-3) / copy_bw))
        layers = weights = None
        _free_cached(device)
    return rows


def nf4_matmul_main(argv, args, copy_bw: float) -> int:
    start = time.perf_counter()
    rows = nf4_matmul_rows(copy_bw)
    sweep = nf4_sweep_rows(copy_bw)
    for shape in dict.fromkeys(r["shape"] for r in sweep):
        mine = sorted((r for r in sweep if r["shape"] == shape), key=lambda r: r["ours_ms"])
        print(f"nf4 sweep {shape}, fastest first: "
              + ", ".join(f"block_n {r['block_n']} split {r['split_k']} stages {r['num_stages']} lookup {r['lookup']} "
                          f"unroll {r['unroll']}: "
                          f"{r['ours_ms']:.4f} ms ({100 * r['of_copy']:.0f}%)" for r in mine[:6]))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=copy_bw / 1e12,
                seconds=time.perf_counter() - start)
    print(f"\n{meta}")
    print(f"{'nf4 matmul':<34} {'M':>3} {'ours ms':>8} {'GB/s':>6} {'%copy':>6} {'bnb ms':>8} {'bf16 ms':>8} "
          f"{'x bnb':>6} {'x bf16':>6} {'rel err':>8}")
    for r in rows:
        print(f"{r['shape']:<34} {r['m']:>3} {r['ours_ms']:8.4f} {r['ours_gb_s']:6.0f} {100 * r['of_copy']:5.0f}% "
              f"{r['bnb_ms']:8.4f} {r['bf16_ms']:8.4f} {r['vs_bnb']:6.2f} {r['vs_bf16']:6.2f} {r['rel_err']:8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, sweep=sweep), f, indent=1)
    results.save("kernels_nf4_matmul", argv, dict(meta=meta, rows=rows), args.out, args.rows)
    # bitsandbytes' bf16 product and the kernel's float32 sums of the same codes: bf16 rounding apart
    assert all(math.isfinite(r["ours_ms"]) and r["rel_err"] < 1e-2 for r in rows + sweep), rows + sweep
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the token counts (1.0 = several GB)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    p.add_argument("--fp8-matmul", action="store_true",
                   help="only the FP8 decode matmul table (weight-only kernel vs _scaled_mm path vs bf16)")
    p.add_argument("--nf4-matmul", action="store_true",
                   help="only the NF4 decode matmul table (swiftune's NF4 kernel vs bitsandbytes vs bf16)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    copy_bw = copy_bandwidth()
    if args.fp8_matmul:
        return fp8_matmul_main(argv, args, copy_bw)
    if args.nf4_matmul:
        return nf4_matmul_main(argv, args, copy_bw)
    rows = []
    for name, shape, nbytes, ours, eager, compiled in cases(args.scale):
        t_ours, t_eager, t_comp = bench(ours), bench(eager), bench(compiled)
        bw = nbytes / (t_ours * 1e-3)
        rows.append(dict(
            kernel=name, shape=shape, gbytes=nbytes / 1e9, ours_ms=t_ours, eager_ms=t_eager, compile_ms=t_comp,
            vs_eager=t_eager / t_ours, vs_compile=t_comp / t_ours, tb_s=bw / 1e12, of_copy=bw / copy_bw,
        ))
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=copy_bw / 1e12)
    try:
        import transformers
        import triton

        meta.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    print(f"\n{meta}")
    print(f"{'kernel':<11} {'shape':<30} {'GB':>6} {'ours ms':>8} {'eager':>8} {'compile':>8} "
          f"{'x eager':>8} {'x comp':>7} {'TB/s':>6} {'%copy':>6}")
    for r in rows:
        print(f"{r['kernel']:<11} {r['shape']:<30} {r['gbytes']:6.2f} {r['ours_ms']:8.2f} {r['eager_ms']:8.2f} "
              f"{r['compile_ms']:8.2f} {r['vs_eager']:8.2f} {r['vs_compile']:7.2f} {r['tb_s']:6.2f} "
              f"{100 * r['of_copy']:5.0f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    results.save("kernels", argv, dict(meta=meta, rows=rows), args.out, args.rows)
    assert all(math.isfinite(r["ours_ms"]) for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
