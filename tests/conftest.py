"""Test set-up: on a machine without CUDA, Triton kernels run through the interpreter.

``TRITON_INTERPRET`` must be set before swiftune (and with it ``triton.jit``) is imported,
so it is set here, at collection time, and nowhere in the library.
"""

import os

import pytest

# pytest-xdist's workers share the machine's cores: each takes its share for torch's intra-op threads (and the
# scripts it runs as subprocesses, through OMP_NUM_THREADS), instead of every worker starting one thread per core.
# On the 2-core CI machine with `-n 2` the oversubscribed threads made CPU-bound tests up to 2.5x slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch sizes its thread pool from it)

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled kernels need CUDA tensors, interpreted ones CPU tensors: one device per machine.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """CPU (Triton interpreter) on a development machine, CUDA (compiled kernels) on the GPU machine."""
    return request.param


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_cache():
    """On CUDA the tests compile flex attention for many head counts, masks, windows and dtypes.
    One process running every module passes dynamo's recompile limit, after which flex runs its
    eager math (a 128K-token row then asks for a terabyte). Each module starts from a clean cache."""
    if torch.cuda.is_available():
        torch._dynamo.reset()
    yield
