"""Chunked-loss benchmark: forward + backward time and peak memory against the plain PyTorch losses.

Shapes default to a Qwen3-8B LM head (hidden 4096, vocabulary 151,936, bf16).  Each row is one
loss at one token count; baselines are measured in the same process on the same tensors:

  ce/plain        F.cross_entropy(F.linear(h, W).float(), labels)          (transformers' loss)
  ce/swiftune     swiftune.losses.linear_cross_entropy
  logp/plain      log_softmax(F.linear(h, W).float() / T).gather(index)    (the usual RL code)
  logp/swiftune   swiftune.losses.selective_log_softmax
  logp/offload    the same with offload=True

The hidden states are a non-leaf (``h = h0 * 1``) dropped right after the forward call, as the
output of a model's final norm would be, so offloading can actually free them.  "extra GB" is the
peak allocated memory above what was allocated before the call (inputs, weight).  By default the
LM head is frozen (LoRA); ``--train-head`` also computes its gradient.  "held GB" is what the
loss keeps alive between forward and backward (saved tensors; for the fused cross entropy, the
gradients it computed in forward): in a whole model that sits on top of every activation.  Rows that run out of
memory are reported as OOM and skipped.

    python -m benchmarks.losses --tokens 8192 65536 --out losses.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import results
from benchmarks.workload import reset_cuda_memory
from swiftune.losses import linear_cross_entropy, selective_log_softmax


def _plain_ce(h, w, lab, T):
    return F.cross_entropy(F.linear(h, w).float(), lab)


BACKEND = "auto"


def _swift_ce(h, w, lab, T, chunk=None):
    return linear_cross_entropy(h, w, lab, chunk_tokens=chunk, backend=BACKEND)


def _plain_logp(h, w, idx, T):
    logp = torch.log_softmax(F.linear(h, w).float() / T, dim=-1)
    return logp.gather(-1, idx[:, None]).squeeze(-1).sum()


def _swift_logp(h, w, idx, T, chunk=None, offload=False):
    return selective_log_softmax(
        h, w, idx, temperature=T, chunk_tokens=chunk, offload=offload, backend=BACKEND
    ).sum()


def measure(fn, h0, w, target, T, repeats: int, warmup: int) -> dict:
    """Median ms of forward+backward, peak extra memory, and memory held between forward and backward."""

    def step(base: int = 0):
        h = h0 * 1.0  # non-leaf, freed after forward unless the loss saves it
        loss = fn(h, w, target, T)
        del h
        held = torch.cuda.memory_allocated() - base  # what the loss keeps alive until backward
        loss.backward()
        return loss.detach(), held

    for _ in range(warmup):
        step()
        h0.grad = None
        w.grad = None
    torch.cuda.synchronize()
    times, peaks, helds, value = [], [], [], None
    for _ in range(repeats):
        h0.grad = None
        w.grad = None
        reset_cuda_memory(True, empty_cache=False, synchronize=True, reset_peak=True)
        base = torch.cuda.memory_allocated()  # (the peak reset leaves what is allocated as it is)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value, held = step(base)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append(torch.cuda.max_memory_allocated() - base)
        helds.append(held)
    grad = h0.grad.detach().clone() if h0.grad is not None else None
    return {"ms": statistics.median(times), "peak_bytes": max(peaks), "held_bytes": max(helds),
            "value": float(value), "grad": grad}


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--chunk-tokens", type=int, default=None, help="default: automatic")
    p.add_argument("--train-head", action="store_true", help="also compute the LM head's gradient")
    p.add_argument("--losses", nargs="+", default=["ce", "logp"], choices=["ce", "logp"])
    p.add_argument("--no-plain", action="store_true", help="skip the materialising baselines")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"],
                   help="swiftune's per-block math: Triton kernels (auto) or plain PyTorch (reference)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/losses.py needs a CUDA device", file=sys.stderr)
        return 2

    global BACKEND
    BACKEND = args.backend
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, device=dev, dtype=dtype) * args.hidden**-0.5).requires_grad_(
        args.train_head
    )
    ch = args.chunk_tokens
    methods = []
    if "ce" in args.losses:
        methods += [("ce", "plain", _plain_ce), ("ce", "swiftune", lambda h, w, t, T: _swift_ce(h, w, t, T, ch))]
    if "logp" in args.losses:
        methods += [
            ("logp", "plain", _plain_logp),
            ("logp", "swiftune", lambda h, w, t, T: _swift_logp(h, w, t, T, ch)),
            ("logp", "offload", lambda h, w, t, T: _swift_logp(h, w, t, T, ch, offload=True)),
        ]
    if args.no_plain:
        methods = [m for m in methods if m[1] != "plain"]

    rows = []
    header = (f"{'tokens':>8} {'loss':>5} {'method':>9} {'ms':>9} {'extra GB':>9} {'held GB':>8} {'time/plain':>10} "
              f"{'mem/plain':>9} {'err/plain':>9}")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} hidden {args.hidden} vocab {args.vocab} "
          f"{args.dtype} head {'trained' if args.train_head else 'frozen'} backend {args.backend}", flush=True)
    for n in args.tokens:
        h0 = torch.randn(n, args.hidden, device=dev, dtype=dtype).requires_grad_()
        target = torch.randint(0, args.vocab, (n,), device=dev)
        base: dict[str, dict] = {}
        for loss, method, fn in methods:
            row = {"tokens": n, "loss": loss, "method": method}
            t0 = time.perf_counter()
            try:
                r = measure(fn, h0, w, target, args.temperature, args.repeats, args.warmup)
            except torch.cuda.OutOfMemoryError:
                row.update(status="oom")
                r = None
            finally:
                h0.grad = None
                w.grad = None
                reset_cuda_memory(True)
            if r is not None:
                grad = r.pop("grad")
                row.update(status="ok", **r)
                if method == "plain":
                    base[loss] = {**r, "grad": grad}
                elif loss in base:
                    b = base[loss]
                    row["time_ratio"] = r["ms"] / b["ms"]
                    row["mem_ratio"] = r["peak_bytes"] / max(b["peak_bytes"], 1)
                    row["grad_rel_err"] = _rel(grad, b["grad"])
                    row["value_rel_err"] = abs(r["value"] - b["value"]) / max(abs(b["value"]), 1e-30)
                if method == "offload":
                    ref = next((x for x in rows if x["tokens"] == n and x["loss"] == loss and x["method"] == "swiftune"
                                and x["status"] == "ok"), None)
                    if ref is not None:
                        row["time_vs_no_offload"] = r["ms"] / ref["ms"]
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            if len(rows) == 1:
                print(header, flush=True)
            fmt = lambda k, f: (f % row[k]) if row.get(k) is not None else "-"  # noqa: E731
            if row["status"] == "ok":
                print(f"{n:>8} {loss:>5} {method:>9} {row['ms']:>9.1f} {row['peak_bytes'] / 2**30:>9.2f} "
                      f"{row['held_bytes'] / 2**30:>8.2f} "
                      f"{fmt('time_ratio', '%.2f'):>10} {fmt('mem_ratio', '%.3f'):>9} {fmt('grad_rel_err', '%.1e'):>9}"
                      + (f"  offload/no-offload time {row['time_vs_no_offload']:.3f}" if "time_vs_no_offload" in row else ""),
                      flush=True)
            else:
                print(f"{n:>8} {loss:>5} {method:>9} {'OOM':>9}", flush=True)
        del h0, target, base
        reset_cuda_memory(True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "rows": rows}, f, indent=1)
    results.save("losses", argv, {"benchmark": "losses", "rows": rows}, args.out, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
