"""Budgets and host pages of the offloaded checkpointing (:mod:`swiftune.training.checkpointing`):
which layer inputs stay on the GPU (:func:`split_layers`), how much host memory a new pinned
allocation of this rank may take (:func:`host_available_bytes`: its share of the host), and the
pool of fixed-size pinned pages (:class:`PagePool`) that holds the offloaded ones across steps, and one
tensor's bytes in those pages from the forward to the backward (:class:`HostCopy`).
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.planner import (PAGE_BYTES, choose_page_bytes, derived_input_count, host_share_bytes, pages_for,
                              pinned_slot_bytes)

GiB = 2**30


class CheckpointBudgetError(MemoryError):
    """The layer checkpoints of a step fit neither the GPU budget nor the pinned host memory."""


# ------------------------------------------------------------------------------------ budgets


@dataclass(frozen=True)
class OffloadPlan:
    """Which layers keep their checkpoint on the GPU for one forward (see :func:`split_layers`)."""

    num_layers: int
    layer_bytes: int
    offload: tuple[int, ...]
    keep: tuple[int, ...]
    host_bytes: int
    page_bytes: int
    derived: tuple[int, ...] = ()  # inputs stored nowhere: recomputed from the layer before in backward

    @property
    def gpu_bytes(self) -> int:
        return len(self.keep) * self.layer_bytes


def split_layers(
    num_layers: int,
    layer_bytes: int,
    gpu_budget_bytes: int,
    host_budget_bytes: int,
    page_bytes: int = PAGE_BYTES,
    allow_derived: bool = True,
) -> OffloadPlan:
    """Keep ``K = min(L, gpu_budget // B)`` layer inputs on the GPU, offload the first ``L - K``.

    When the host cannot hold the ``L - K`` offloaded inputs either (``allow_derived``), the
    ``D`` missing ones are *derived*: layers ``1, 3, ..., 2D - 1`` store no input at all, and
    backward recomputes it from the stored input of the layer before (one more forward of that
    layer, without grad, per derived layer; see :mod:`.checkpointing`). At most every second
    layer is derived (:func:`swiftune.memory.planner.derived_input_count`, the planner's rule
    too). Host pages are ``choose_page_bytes(B, page_bytes)`` bytes. Raises
    :class:`CheckpointBudgetError` when even that does not fit. A pure function.
    """
    if num_layers < 0 or layer_bytes < 0 or page_bytes < 1:
        raise ValueError("num_layers and layer_bytes must be >= 0 and page_bytes >= 1")
    per_layer_host = pinned_slot_bytes(layer_bytes, page_bytes)
    page_bytes = choose_page_bytes(layer_bytes, page_bytes)
    if layer_bytes == 0:
        keep_n = num_layers
    else:
        keep_n = max(0, min(num_layers, int(gpu_budget_bytes) // layer_bytes))
    n_off = num_layers - keep_n
    derived: tuple[int, ...] = ()
    if allow_derived and n_off * per_layer_host > host_budget_bytes:
        missing = derived_input_count(num_layers, n_off, max(0, int(host_budget_bytes)) // per_layer_host)
        derived = tuple(range(1, 2 * missing, 2))
        n_off -= missing
    host = n_off * per_layer_host
    if host > host_budget_bytes:
        raise CheckpointBudgetError(
            f"swiftune offloaded checkpointing: {num_layers} layer checkpoints of {layer_bytes / 1e9:.3f} GB "
            f"each ({num_layers * layer_bytes / 1e9:.2f} GB in all) do not fit: the GPU budget of "
            f"{max(gpu_budget_bytes, 0) / 1e9:.2f} GB holds {keep_n} of them, and the other {n_off} need "
            f"{host / 1e9:.2f} GB of pinned host memory, but only {max(host_budget_bytes, 0) / 1e9:.2f} GB is "
            f"available{' (recomputing every second layer input would still leave too many)' if allow_derived else ''}. "
            "Use fewer tokens per step, free host memory, raise gpu_budget_bytes / host_budget_bytes "
            "if the machine has room, or plan the run with `swiftune plan`."
        )
    derived_set = set(derived)
    stored = [i for i in range(num_layers) if i not in derived_set]
    return OffloadPlan(num_layers, layer_bytes, tuple(stored[:n_off]), tuple(stored[n_off:]), host, page_bytes,
                       derived)


def local_world_size() -> int:
    """Processes of this job on this host, which share its memory: the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun and ``accelerate launch`` set it for every rank); without it, in
    an initialised process group, the whole world (as if every rank were on this host: an
    undercount of each rank's share on several hosts, never an over-subscription); else 1."""
    launcher = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if launcher:
        if not launcher.isdigit() or int(launcher) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={launcher!r} is not a number of processes >= 1; unset it or "
                             "launch with torchrun / accelerate launch, which set it")
        return int(launcher)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def host_memory_bytes() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this host's memory (psutil when installed, else
    ``/proc/meminfo``); ``None`` when neither can be read."""
    avail = total = None
    try:
        import psutil

        vm = psutil.virtual_memory()
        avail, total = int(vm.available), int(vm.total)
    except (ImportError, OSError):  # psutil missing, or it cannot read this system's counters
        try:
            with open("/proc/meminfo") as f:
                info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ":" in ln}
            avail, total = info.get("MemAvailable"), info.get("MemTotal")
        except OSError:
            pass
    if avail is None or total is None:
        return None
    return avail, total


def host_available_bytes(margin_bytes: int | None = None, ranks_on_host: int | None = None) -> int:
    """Host memory this rank's new pinned allocations may take: ``(MemAvailable - margin) // N``.

    ``N`` (``ranks_on_host``, default :func:`local_world_size`) processes of one job on one host
    each pin their own offloaded checkpoints, so each may take only its share
    (:func:`swiftune.memory.planner.host_share_bytes`, as ``swiftune plan --world_size`` plans);
    the margin is the host's, kept once. ``margin_bytes`` defaults to ``max(4 GiB, 10% of
    MemTotal)`` (the rest of the processes and the system keep that much). 0 when the host's
    memory cannot be read (:func:`host_memory_bytes`).
    """
    memory = host_memory_bytes()
    if memory is None:
        return 0
    avail, total = memory
    margin = max(4 * GiB, total // 10) if margin_bytes is None else margin_bytes
    ranks = local_world_size() if ranks_on_host is None else ranks_on_host
    return host_share_bytes(max(0, avail - margin), ranks)


# ---------------------------------------------------------------------------- host page pool


class PagePool:
    """Fixed-size host pages (pinned when ``pin``), reused across layers and steps."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.held_bytes = 0  # allocated by the pool (free + in use)
        self.in_use_bytes = 0
        self.alloc_seconds = 0.0  # time spent pinning new pages (slow: the first steps only)

    @property
    def free_bytes(self) -> int:
        return self.held_bytes - self.in_use_bytes

    def acquire(self, n: int, page_bytes: int) -> list[torch.Tensor]:
        free = self._free.setdefault(page_bytes, [])
        pages = [free.pop() for _ in range(min(n, len(free)))]
        if len(pages) < n:
            self._unpin_other_sizes((n - len(pages)) * page_bytes, page_bytes)
        t0 = time.perf_counter()
        try:
            while len(pages) < n:
                pages.append(torch.empty(page_bytes, dtype=torch.uint8, pin_memory=self.pin))
                self.held_bytes += page_bytes
        except RuntimeError as e:  # cudaHostAlloc refused: report it as a budget problem
            free.extend(pages)
            raise CheckpointBudgetError(
                f"swiftune offloaded checkpointing: could not pin {n * page_bytes / 1e9:.2f} GB of host memory "
                f"({self.held_bytes / 1e9:.2f} GB already pinned): {e}"
            ) from e
        finally:
            self.alloc_seconds += time.perf_counter() - t0
        self.in_use_bytes += n * page_bytes
        return pages

    def _unpin_other_sizes(self, nbytes: int, page_bytes: int) -> None:
        """Unpin idle pages of sizes other than ``page_bytes`` (left by a step of another shape, which cannot
        serve this request) worth at least ``nbytes``, the pool's held memory staying about what its
        steps use, smallest pages first. Only that many: one step takes pages of several sizes (a layer
        input and its attention outputs), and unpinning all the others would make the next step pin them
        again (slow) as soon as one small tensor changes size."""
        for size in sorted(k for k in self._free if k != page_bytes):
            idle = self._free[size]
            while idle and nbytes > 0:
                idle.pop()
                self.held_bytes -= size
                nbytes -= size
            if not idle:
                del self._free[size]
            if nbytes <= 0:
                return

    def release(self, pages: list[torch.Tensor], page_bytes: int) -> None:
        self._free.setdefault(page_bytes, []).extend(pages)
        self.in_use_bytes -= len(pages) * page_bytes

    def clear(self) -> None:
        """Drop the free pages (pages in use go when their layers are done)."""
        for size, pages in self._free.items():
            self.held_bytes -= len(pages) * size
        self._free.clear()


# ------------------------------------------------------------------------------ one tensor


def _spans(nbytes: int, page: int) -> list[tuple[int, int]]:
    return [(a, min(a + page, nbytes)) for a in range(0, nbytes, page)]


def _is_dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill one span of its storage with no gaps (a permuted contiguous tensor)."""
    if x.numel() <= 1:
        return True
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
    return x.permute(order).is_contiguous()


def _storage_bytes(x: torch.Tensor) -> torch.Tensor:
    """The span of a dense ``x``'s storage that holds its elements, as flat bytes (a view, no copy)."""
    return torch.as_strided(x, (x.numel(),), (1,), x.storage_offset()).view(torch.uint8)


class HostCopy:
    """One tensor's bytes in host pages of a :class:`PagePool`, from the forward to the backward.

    The bytes go to pages of ``page_bytes``, or of the next power of two of a smaller tensor
    (:func:`~swiftune.memory.planner.choose_page_bytes`, the planner's rule). The constructor starts the
    copy: on ``stream`` (CUDA) after the work already queued on the compute
    stream, which produces ``x``, with ``x``'s block kept from the allocator until the copy has run; at
    once where ``stream`` is ``None`` (CPU tensors). :meth:`restore` copies the bytes back into a new
    tensor of ``x``'s shape, dtype, device and strides (a kernel may read a permuted layout, e.g. an
    attention output in ``[batch, tokens, heads, dim]`` order seen as ``[batch, heads, tokens, dim]``),
    allocated on the compute stream; the caller makes the compute stream wait for the returned event
    before it reads the tensor. The pages go back to the pool when the copy object is dropped.
    """

    def __init__(self, pool: PagePool, x: torch.Tensor, page_bytes: int, stream: Any) -> None:
        src = x.detach()
        if not _is_dense(src):
            src = src.contiguous()
        self._like = torch.empty_like(src, device="meta")  # shape, dtype and strides, no memory
        self.device = src.device
        self.nbytes = src.numel() * src.element_size()
        self.page_bytes = page_bytes = choose_page_bytes(self.nbytes, page_bytes)
        self._pages = pool.acquire(pages_for(self.nbytes, page_bytes), page_bytes)
        weakref.finalize(self, pool.release, self._pages, page_bytes)  # back to the pool when done
        flat = _storage_bytes(src)
        if stream is None:
            for page, (a, b) in zip(self._pages, _spans(self.nbytes, page_bytes)):
                page[: b - a].copy_(flat[a:b])
            return
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            for page, (a, b) in zip(self._pages, _spans(self.nbytes, page_bytes)):
                page[: b - a].copy_(flat[a:b], non_blocking=True)
        src.record_stream(stream)  # the allocator keeps the block until the copy has run

    def restore(self, stream: Any) -> tuple[torch.Tensor, Any]:
        """A new device tensor with the kept bytes, and the CUDA event its copy records (``None``: copied)."""
        out = torch.empty_like(self._like, device=self.device)
        flat = _storage_bytes(out)
        spans = _spans(self.nbytes, self.page_bytes)
        if stream is None:
            for page, (a, b) in zip(self._pages, spans):
                flat[a:b].copy_(page[: b - a])
            return out, None
        # the new block may be one that kernels queued on the compute stream still read: wait for them
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for page, (a, b) in zip(self._pages, spans):
                flat[a:b].copy_(page[: b - a], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event
