"""Where the time of one step goes: device time per kernel, summed by kind of work; and, for a
step bound by the host, the host's own time per library (:func:`host_time_profile`).

A missed speed target is reported with what limits it. This wraps one step in
``torch.profiler`` (device activity only: kernels and copies, not the Python around them) and sums
each kernel's own device time into a few kinds (attention, matrix multiplies, host<->device copies,
Triton kernels, the rest), plus the top kernels by name:

    python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune trl_grpo \
        --completion-lengths 32768 --fixed-only --profile-completion 32768
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator

# the first kind whose words appear in a kernel's (lower-cased) name is its kind
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy host<->device", ("memcpy htod", "memcpy dtoh", "pinned", "pageable")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "cudnn", "flex")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul", "sm90_")),
    ("copy device", ("memcpy", "memset")),
)
TRITON = "triton (swiftune, liger, inductor)"
OTHER = "elementwise / reductions / other"


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    for kind, words in KINDS:
        if any(w in name for w in words):
            return kind
    # a Triton kernel is named by its Python function: a bare identifier, where CUDA C++ kernels
    # carry "void", namespaces and template arguments
    if "triton" in name or name.replace("_", "").isalnum():
        return TRITON
    return OTHER


def summarise(events: Iterable[tuple[str, float, int]], top: int = 12) -> dict:
    """``events``: ``(kernel name, own device time in microseconds, calls)``. Returns the total in ms,
    ms and share per kind (largest first) and the ``top`` kernels by time."""
    events = [(n, float(us), int(c)) for n, us, c in events if us > 0]
    total = sum(us for _, us, _ in events)
    kinds: dict[str, float] = {}
    for name, us, _ in events:
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    share = (lambda us: us / total) if total else (lambda us: 0.0)
    return {
        "device_ms": total / 1e3,
        "launches": sum(c for _, _, c in events),
        "kinds": [{"kind": k, "ms": us / 1e3, "share": share(us)}
                  for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])],
        "top": [{"kernel": n[:120], "kind": kind_of(n), "ms": us / 1e3, "calls": c, "share": share(us)}
                for n, us, c in sorted(events, key=lambda e: -e[1])[:top]],
    }


def _own_device_us(event) -> float:
    # torch >= 2.4 says "device"; older releases "cuda"
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return getattr(event, attr)
    return 0.0


#: trace categories of the device's own work (kernels, copies, fills)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _is_sync(name: str) -> bool:
    """A host call that waits for the device: a synchronize, or a synchronous (not ``Async``) ``cudaMemcpy``."""
    low = name.lower() + " "
    return "synchronize" in low or (low.startswith("cudamemcpy ") and "async" not in low)


def idle_gaps(trace: dict | list, min_us: float = 20.0, top: int = 15) -> dict:
    """Where the device sat idle inside a profiled span, from a chrome trace (``export_chrome_trace``).

    The device's work (kernels, copies, fills, on every stream) is merged into busy intervals; each
    hole of at least ``min_us`` between two of them is a gap. A gap that opens within ``min_us`` of a
    host call that waits for the device returning (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
    a synchronous ``cudaMemcpy``: an ``.item()``, ``.tolist()``, ``nonzero``) is charged to that
    wait: the host let the device drain, then spent the gap on its own work before the next launch.
    Returns the span (first device event's start to the last one's end), busy time and idle time (the
    gaps' sum; shorter holes count in neither) in ms, the idle time in gaps that open after a wait, the
    gap count, and the ``top`` gaps by length with the device work on either side."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
                    for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    if not device:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "idle_after_sync_ms": 0.0, "gaps": 0, "top": []}
    sync_ends = sorted(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events
                       if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and _is_sync(str(e.get("name", ""))))
    gaps, busy = [], 0.0
    start, end, last = device[0]
    for s, e, name in device[1:]:
        if s > end:
            busy += end - start
            if s - end >= min_us:
                gaps.append((s - end, end, last, name))
            start, end, last = s, e, name
        elif e >= end:
            end, last = e, name
    busy += end - start
    span = end - device[0][0]

    def after_sync(gap_start: float) -> bool:
        i = bisect.bisect_left(sync_ends, gap_start - min_us)
        return i < len(sync_ends) and sync_ends[i] <= gap_start + min_us

    idle = sum(g for g, *_ in gaps)
    flagged = [after_sync(at) for _, at, _, _ in gaps]
    ranked = sorted(zip(gaps, flagged), key=lambda item: -item[0][0])[:top]
    return {
        "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3,
        "idle_after_sync_ms": sum(g for (g, *_), f in zip(gaps, flagged) if f) / 1e3, "gaps": len(gaps),
        "top": [{"ms": g / 1e3, "after_sync": f, "before": before[:90], "after": after[:90]}
                for (g, _, before, after), f in ranked],
    }


@contextlib.contextmanager
def device_time_profile(result: dict, gaps: bool = False, started: list | None = None,
                        ended: list | None = None) -> Iterator[None]:
    """Profile the device work of the ``with`` body; on exit ``result["profile"]`` holds :func:`summarise`'s
    dict. Only kernels and copies are kept (events with device time and no child events). With ``gaps``,
    also :func:`idle_gaps` of the body's trace as ``result["profile"]["idle"]``. ``started`` gets the
    ``time.perf_counter()`` at which the profiler was running and the device idle, just before the body;
    ``ended``, the one at which the body's device work had ended (before the trace is read)."""
    import json
    import os
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if started is not None:
            torch.cuda.synchronize()
            started.append(time.perf_counter())
        yield
        torch.cuda.synchronize()
        if ended is not None:
            ended.append(time.perf_counter())
    events = [(e.key, _own_device_us(e), e.count) for e in prof.key_averages()]
    result["profile"] = summarise(events)
    if gaps:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                result["profile"]["idle"] = idle_gaps(json.load(f))
        finally:
            os.remove(path)


@contextlib.contextmanager
def timed_device_profile(result: dict) -> Iterator[None]:
    """:func:`device_time_profile` of the ``with`` body with its idle gaps, plus its wall time as
    ``result["profile"]["step_wall_ms"]``: when the device is busy for a small part of the wall
    time, the body is bound by the host (Python, launches), and the gaps say where the device waited.
    The profiler adds its own cost to that wall time; compare with an unprofiled run too."""
    import time

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    started: list[float] = []
    ended: list[float] = []
    with device_time_profile(result, gaps=True, started=started, ended=ended):  # synchronizes, then summarises
        yield
    # the step's wall time runs from the profiler's start, not from before it: starting the profiler is not the
    # step's host work (its cost is kept apart, as profiler_start_ms)
    result["profile"]["step_wall_ms"] = (ended[0] - started[0]) * 1e3
    result["profile"]["profiler_start_ms"] = (started[0] - t0) * 1e3


# ----------------------------------------------------------------------------------- the host

#: where a Python function's own time is counted, by the first of these path parts in its file
#: (C functions, "~" in cProfile, are the calls into torch's and Python's built-ins: each torch op's
#: dispatch and launch, synchronisations, allocations)
HOST_GROUPS: tuple[tuple[str, str], ...] = (
    ("swiftune", "/swiftune/"), ("peft", "/peft/"), ("transformers", "/transformers/"),
    ("accelerate", "/accelerate/"), ("trl / liger", "/trl/"), ("trl / liger", "/liger_kernel/"),
    ("triton (launchers)", "/triton/"), ("torch (Python)", "/torch/"), ("benchmark", "/benchmarks/"),
)
BUILTIN = "built-in calls (torch ops, launches, syncs)"
HOST_OTHER = "other Python"


def host_group_of(filename: str) -> str:
    if filename == "~" or filename.startswith("<built-in"):
        return BUILTIN
    path = filename.replace("\\", "/")
    for group, part in HOST_GROUPS:
        if part in path:
            return group
    return HOST_OTHER


def summarise_host(entries: Iterable[tuple[str, int, str, float, int]], top: int = 15) -> dict:
    """``entries``: ``(file, line, function, own seconds, calls)`` of each function (cProfile's
    ``tottime``: time in the function itself, not in what it called). Returns the total in ms, the
    own time per group of :func:`host_group_of` (largest first) and the ``top`` functions."""
    entries = [(f, int(ln), fn, float(t), int(c)) for f, ln, fn, t, c in entries]
    total = sum(t for *_, t, _ in entries)
    groups: dict[str, float] = {}
    for f, _, _, t, _ in entries:
        group = host_group_of(f)
        groups[group] = groups.get(group, 0.0) + t
    share = (lambda t: t / total) if total else (lambda t: 0.0)
    return {
        "host_ms": total * 1e3,
        "calls": sum(c for *_, c in entries),
        "groups": [{"group": g, "ms": t * 1e3, "share": share(t)} for g, t in sorted(groups.items(), key=lambda kv: -kv[1])],
        "top": [{"function": f"{fn} ({f.rsplit('/', 1)[-1]}:{ln})" if f != "~" else fn, "group": host_group_of(f),
                 "ms": t * 1e3, "calls": c, "share": share(t)}
                for f, ln, fn, t, c in sorted(entries, key=lambda e: -e[3])[:top]],
    }


@contextlib.contextmanager
def host_time_profile(result: dict) -> Iterator[None]:
    """cProfile over the ``with`` body; on exit ``result["host_profile"]`` holds
    :func:`summarise_host`'s dict and the body's wall time (``wall_ms``; CUDA synchronised at both
    ends, so a GPU-bound body shows its wait in a synchronising call). Where
    :func:`timed_device_profile` says a step is bound by the host, this says by what.

    Which threads it sees depends on Python: from 3.12 cProfile records through ``sys.monitoring``,
    process-wide, so the Python the autograd engine runs in its own thread on CUDA (checkpoint
    recomputes, saved-tensor hooks, custom Functions' backward) is counted under its own names,
    and ``run_backward``'s own time is the engine's C++ work between them; up to 3.11 it sees the
    calling thread only (there, that Python hides inside ``run_backward``)."""
    import cProfile
    import pstats
    import time

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        yield
    finally:
        sync()
        prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, function): (calls, prim calls, tottime, cumtime, callers)}
    entries = [(f, ln, fn, tt, nc) for (f, ln, fn), (nc, _, tt, _, _) in stats.items()]
    result["host_profile"] = dict(summarise_host(entries), wall_ms=wall * 1e3)


def format_host_profile(p: dict, title: str = "") -> str:
    lines = [f"# host time{(' of ' + title) if title else ''}: {p['host_ms'] / 1e3:.2f} s in Python and "
             f"built-in calls ({p['calls']:,} calls)"
             + (f"; wall time {p['wall_ms'] / 1e3:.2f} s (profiled)" if p.get("wall_ms") else "")]
    lines += [f"  {g['group']:<44} {g['ms'] / 1e3:8.3f} s  {100 * g['share']:5.1f}%" for g in p["groups"]]
    lines.append("  top functions by own time:")
    lines += [f"  {t['ms'] / 1e3:8.3f} s {100 * t['share']:5.1f}% {t['calls']:7d}x  {t['function'][:90]}"
              for t in p["top"]]
    return "\n".join(lines)


def format_profile(p: dict, title: str = "") -> str:
    lines = [f"# device time{(' of ' + title) if title else ''}: {p['device_ms'] / 1e3:.2f} s"
             + (f" in {p['launches']:,} kernels and copies" if "launches" in p else "")
             + (f"; the step took {p['step_wall_ms'] / 1e3:.2f} s of wall time (device busy "
                f"{p['device_ms'] / p['step_wall_ms']:.0%})" if p.get("step_wall_ms") else "")]
    lines += [f"  {k['kind']:<38} {k['ms'] / 1e3:8.2f} s  {100 * k['share']:5.1f}%" for k in p["kinds"]]
    lines.append("  top kernels:")
    lines += [f"  {t['ms'] / 1e3:8.2f} s {100 * t['share']:5.1f}% {t['calls']:6d}x  {t['kernel'][:90]}" for t in p["top"]]
    idle = p.get("idle")
    if idle and idle["gaps"]:
        lines.append(f"  device idle {idle['idle_ms']:.1f} ms of a {idle['span_ms']:.1f} ms span in {idle['gaps']} gaps, "
                     f"{idle['idle_after_sync_ms']:.1f} ms of it in gaps opening as the host returned from a wait; "
                     "longest gaps (after a wait: *):")
        lines += [f"  {g['ms']:8.2f} ms {'*' if g['after_sync'] else ' '} {g['before'][:50]} -> {g['after'][:50]}"
                  for g in idle["top"]]
    return "\n".join(lines)
