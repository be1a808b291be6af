"""CUDA-graph replay of :class:`~swiftune.rl.rollout.fast.FastRolloutEngine`'s decode step.

The decode step (``engine.decode_one(kv_len)``) reads and writes only preallocated tensors
(the static KV cache, the current tokens / positions / finished flags, the output buffers and
the random numbers drawn before each step), has static shapes for a given ``kv_len`` and no host
synchronisation, so one CUDA graph per ``kv_len`` bucket replays it. On CPU the engine calls the
same step eagerly; this module is only used on CUDA.

Capture protocol, per bucket (lazily, the first time a bucket is reached):

1. snapshot the small state tensors the step advances (tokens, positions, step, finished,
   lengths); the KV-cache slots and output columns it writes are rewritten identically by the
   real step afterwards;
2. warm up: run the step eagerly on a side stream (cuBLAS workspaces, lazy kernel loading,
   allocator), restoring the snapshot after each run;
3. capture one step into a ``torch.cuda.CUDAGraph`` on a memory pool shared by all buckets of the
   workspace (buckets are replayed one after another, never concurrently, and nothing a graph
   allocates is used after it returns: everything kept lives in the preallocated buffers);
4. restore the snapshot; from then on ``replay()`` is the step.

A capture that fails (a library call that is not capturable on some path, another thread touching
the device) is retried once on a fresh memory pool; if that fails too the bucket runs eagerly
(same results, slower) and the failure is kept in ``failures`` and reported as a warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch


class DecodeGraphs:
    """CUDA graphs of one workspace's decode step, one per ``kv_len`` bucket.

    Args:
        step: ``step(kv_len)`` runs one decode step eagerly (the function that gets captured).
        state: the tensors ``step`` advances (restored after warm-up).
        warmup: eager warm-up runs before each capture.
    """

    def __init__(self, step: Callable[[int], None], state: Sequence[torch.Tensor], warmup: int = 2):
        self.step = step
        self.state = list(state)
        self.warmup = warmup
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # None: this bucket runs eagerly
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_s = 0.0  # total time spent warming up and capturing
        self.failures: list[tuple[int, str]] = []

    def _snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.state]

    def _restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip(self.state, snap):
            t.copy_(s)

    def capture(self, kv_len: int) -> torch.cuda.CUDAGraph:
        torch.cuda.synchronize()
        start = time.perf_counter()
        snap = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step(kv_len)
                self._restore(snap)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(kv_len)
        self._restore(snap)  # capture records without running; restoring is harmless and explicit
        self.graphs[kv_len] = graph
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        return graph

    def _capture_or_none(self, kv_len: int) -> torch.cuda.CUDAGraph | None:
        for _ in range(2):
            snap = self._snapshot()
            try:
                return self.capture(kv_len)
            except RuntimeError as e:  # torch.AcceleratorError and Triton's launch errors are RuntimeErrors
                torch.cuda.synchronize()
                self._restore(snap)
                self.failures.append((kv_len, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                self.pool = torch.cuda.graph_pool_handle()  # retry on a fresh pool
        warnings.warn(f"CUDA-graph capture of the decode step failed twice at kv_len={kv_len} "
                      f"({self.failures[-1][1]}); this bucket runs eagerly", RuntimeWarning, stacklevel=3)
        return None

    def run(self, kv_len: int) -> None:
        if kv_len not in self.graphs:
            self.graphs[kv_len] = self._capture_or_none(kv_len)
        graph = self.graphs[kv_len]
        if graph is None:
            self.step(kv_len)
        else:
            graph.replay()

    def reset(self) -> None:
        self.graphs.clear()
