"""Where the peak of one CUDA training step goes: the allocations alive at its highest point.

``torch.cuda.max_memory_allocated`` says how high a step went, not what was there. This records the
caching allocator's alloc/free history over one step (``torch.cuda.memory._record_memory_history``),
replays it to find the moment of the peak, and sums the blocks alive then by the line of code that
allocated them (the innermost frame outside torch itself: a swiftune kernel, a PEFT layer, the
Trainer's optimizer step...). Blocks allocated before the step began (weights, optimizer states)
are one line, ``before the step``.

    python -m benchmarks.sft --model qwen3-8b --batch 16 --modes swiftune_budget_offload --memory-profile
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# frames from these folders are the machinery, not the caller that asked for memory
_MACHINERY = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py")


def allocation_site(frames: list[dict]) -> str:
    """``name (file:line)`` of the innermost frame outside torch; the innermost frame if all are torch's."""
    for f in frames:
        path = f.get("filename", "")
        if path and not any(m in path for m in _MACHINERY) and not path.startswith("<"):
            return f"{f.get('name', '?')} ({os.path.basename(path)}:{f.get('line', '?')})"
    if frames:
        f = frames[0]
        return f"{f.get('name', '?')} ({os.path.basename(f.get('filename', '?'))}:{f.get('line', '?')})"
    return "(no stack)"


def blocks_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay one device's trace: ``(peak bytes above the level at the first event, alive blocks then)``.

    An allocation counts from its ``alloc`` until its ``free_completed`` (what
    ``max_memory_allocated`` counts). A free of a block allocated before recording began lowers the
    level below the start; such blocks are not in the returned list. Two passes: find the index of
    the peak, then replay up to it (copying the live set at every new maximum would be quadratic).
    """
    level = peak = 0
    peak_at = -1
    sizes: dict[int, int] = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            level += ev["size"]
            if level > peak:
                peak, peak_at = level, i
        elif ev["action"] == "free_completed":
            level -= sizes.pop(ev["addr"], ev["size"])
    return peak, _alive_through(trace, peak_at)


def _alive_through(trace: list[dict], last: int) -> list[dict]:
    """The blocks allocated since recording began and alive after event ``last`` (a replay to it)."""
    live: dict[int, dict] = {}
    for ev in trace[: last + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return list(live.values())


def blocks_at_oom(trace: list[dict]) -> tuple[dict, list[dict]] | None:
    """The first ``oom`` event of one device's trace (an allocation the allocator could not serve) and the
    blocks allocated since recording began that were alive then; ``None`` if nothing ran out."""
    at = next((i for i, ev in enumerate(trace) if ev["action"] == "oom"), None)
    return None if at is None else (trace[at], _alive_through(trace, at))


def _by_site(alive: list[dict], top: int) -> list[dict]:
    by_site: dict[str, int] = {}
    for ev in alive:
        site = allocation_site(ev.get("frames", []))
        by_site[site] = by_site.get(site, 0) + ev["size"]
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])
    rest = sum(b for _, b in ranked[top:])
    sites = [{"site": s, "gb": b / 1e9} for s, b in ranked[:top]]
    if rest:
        sites.append({"site": f"({len(ranked) - top} other sites)", "gb": rest / 1e9})
    return sites


def peak_breakdown(trace: list[dict], bytes_before: int, top: int = 12) -> dict:
    """The peak of the traced step and its largest allocation sites (GB, 1e9 bytes); for a step that ran
    out of memory, also what was alive when it did (``at_oom``: the request, its site, the sites alive)."""
    peak, alive = blocks_at_peak(trace)
    report = {"before_step_gb": bytes_before / 1e9, "step_peak_gb": (bytes_before + peak) / 1e9,
              "alive_at_peak_gb": sum(ev["size"] for ev in alive) / 1e9, "sites": _by_site(alive, top)}
    oom = blocks_at_oom(trace)
    if oom is not None:
        ev, alive_then = oom
        report["at_oom"] = {"request_gb": ev.get("size", 0) / 1e9, "site": allocation_site(ev.get("frames", [])),
                            "alive_gb": sum(b["size"] for b in alive_then) / 1e9, "sites": _by_site(alive_then, top)}
    return report


def start_recording() -> int:
    """Begin recording the caching allocator's history; returns the bytes allocated before."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    # Stacks at allocations only (context="alloc"): the sites come from the alloc events, and with
    # stacks gathered at frees too ("all") a step whose checkpoint recompute stops early (torch
    # raises an exception through the recompute to stop it) died inside a custom autograd
    # Function with "SystemError: ... returned NULL without setting an exception" on torch 2.11
    # (16K-token SFT step with tiled MLP and offloaded checkpoints); the suspected cause is the
    # free-time stack capture while that exception unwinds. With "alloc", a 131K-token Llama-3-8B
    # step (offload mode, tiled MLP under recompute) recorded without error on the H200, and so did
    # the 16K SFT row itself (`gpu_suite.sh sft-memory`).
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    return before


def stop_recording(bytes_before: int, top: int = 12) -> dict:
    """Stop recording; the peak breakdown of what ran since :func:`start_recording`."""
    import torch

    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    return peak_breakdown(trace, bytes_before, top)


@contextlib.contextmanager
def peak_profile(record: dict, top: int = 12) -> Iterator[None]:
    """Profile the ``with`` block (one training step, CUDA) into ``record["peak_profile"]``."""
    before = start_recording()
    try:
        yield
    finally:
        record["peak_profile"] = stop_recording(before, top)


def format_breakdown(profile: dict) -> str:
    lines = [f"  before the step {profile['before_step_gb']:6.2f} GB; peak of the step "
             f"{profile['step_peak_gb']:6.2f} GB; allocated in the step and alive at its peak:"]
    lines += [f"  {s['gb']:8.3f} GB  {s['site']}" for s in profile["sites"]]
    oom = profile.get("at_oom")
    if oom:
        lines.append(f"  out of memory: {oom['request_gb']:.3f} GB asked for at {oom['site']}, with "
                     f"{oom['alive_gb']:.2f} GB allocated in the step alive:")
        lines += [f"  {s['gb']:8.3f} GB  {s['site']}" for s in oom["sites"]]
    return "\n".join(lines)
