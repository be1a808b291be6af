"""Packed attention backends at long context: time and memory of forward + backward, one GPU.

Each backend of ``swiftune.attention`` runs the same bf16 q/k/v (Qwen3-8B heads: 32 query, 8 key/value
heads of 128) laid out as documents of the given length, causal within each. Reported per backend:
median milliseconds of forward + backward (CUDA events), the achieved TFLOP/s (causal attention:
``4 L^2 d Hq / 2`` forward, 2.5x that backward, per document), the bytes the forward keeps alive
for backward beyond its inputs and output (what a recomputed layer holds: K/V expanded to the
query heads shows here), the extra peak of the backward, and the kernel that did most of the work
(from the profiler). Ratios are against torch's varlen kernel measured in the same run.

    python -m benchmarks.attention_backends                                  # 2 x 32K and 1 x 128K documents
    python -m benchmarks.attention_backends --doc-tokens 65536 --docs 2 --out attention.json

The memory columns are what ``swiftune.memory`` plans with (``kv_expanded``, ``float32_dq``).
"""

from __future__ import annotations

import argparse
import json
import sys


import torch

from benchmarks import results
from benchmarks.kernels import bench
from benchmarks.time_profile import device_time_profile


def attention_flops(doc_tokens: int, docs: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over ``docs`` documents (backward = 2.5x forward)."""
    forward = docs * 4 * doc_tokens**2 * head_dim * heads / 2
    return 3.5 * forward


def measure(backend: str, doc_tokens: int, docs: int, hq: int, hk: int, d: int, iters: int) -> dict:
    from swiftune.attention import build_packed_batch, packed_attention

    total = doc_tokens * docs
    positions = torch.arange(doc_tokens, device="cuda").repeat(docs)[None]
    packed = build_packed_batch(1, total, positions, backend=backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for h in (hq, hk, hk))
    dout = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    row: dict = {"backend": backend, "doc_tokens": doc_tokens, "docs": docs}

    def step():
        out = packed_attention(q, k, v, packed, backend=backend)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    try:
        step()  # compile / warm up
        torch.cuda.synchronize()
        # memory: what the forward keeps for backward beyond its inputs and output; the backward's peak
        base = torch.cuda.memory_allocated()
        out = packed_attention(q, k, v, packed, backend=backend)
        torch.cuda.synchronize()
        row["saved_bytes_per_token"] = (torch.cuda.memory_allocated() - base - out.numel() * out.element_size()) / total
        torch.cuda.reset_peak_memory_stats()
        after_forward = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        row["backward_extra_bytes_per_token"] = (torch.cuda.max_memory_allocated() - after_forward) / total
        del out
        q.grad = k.grad = v.grad = None
        row["ms"] = bench(step, warmup=0, iters=iters)
        row["tflops"] = attention_flops(doc_tokens, docs, hq, d) / (row["ms"] * 1e-3) / 1e12
        prof: dict = {}
        with device_time_profile(prof):
            step()
        top = prof["profile"]["top"]
        row["top_kernel"] = top[0]["kernel"] if top else None
    except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape is a row of the report
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc-tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--docs", type=int, nargs="+", default=[2, 1], help="documents per row, one per --doc-tokens")
    p.add_argument("--backends", nargs="+", default=["varlen", "sdpa", "flex", "flash_attn"])
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HK", "D"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_backends.py needs a CUDA device", file=sys.stderr)
        return 2
    if len(args.docs) != len(args.doc_tokens):
        p.error("give one --docs value per --doc-tokens value")
    from swiftune.attention import backend_available

    hq, hk, d = args.heads
    rows = []
    for doc_tokens, docs in zip(args.doc_tokens, args.docs):
        for backend in args.backends:
            if not backend_available(backend, "cuda"):
                continue
            rows.append(measure(backend, doc_tokens, docs, hq, hk, d, args.iters))
            torch.cuda.empty_cache()
    base = {(r["doc_tokens"], r["docs"]): r["ms"] for r in rows if r["backend"] == "varlen" and "ms" in r}
    print(f"\n# packed causal attention, forward + backward, bf16, {hq}/{hk} heads of {d} "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"{'backend':<11} {'docs x tokens':>15} {'ms':>9} {'x varlen':>9} {'TFLOP/s':>8} {'saved B/tok':>12} "
          f"{'bwd B/tok':>10}  kernel")
    for r in rows:
        shape = f"{r['docs']} x {r['doc_tokens']:,}"
        if "error" in r:
            print(f"{r['backend']:<11} {shape:>15}  {r['error'][:100]}")
            continue
        ref = base.get((r["doc_tokens"], r["docs"]))
        ratio = f"{ref / r['ms']:.2f}" if ref else "-"
        print(f"{r['backend']:<11} {shape:>15} {r['ms']:9.1f} {ratio:>9} {r['tflops']:8.0f} "
              f"{r['saved_bytes_per_token']:12.0f} {r['backward_extra_bytes_per_token']:10.0f}  "
              f"{(r['top_kernel'] or '')[:60]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "attention", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "heads": [hq, hk, d], "rows": rows}, f, indent=1)
    results.save("attention_backends", argv, {"benchmark": "attention", "heads": [hq, hk, d], "rows": rows},
                 args.out, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
