"""Test set-up: on a machine without CUDA, Triton kernels run through the interpreter.

``TRITON_INTERPRET`` must be set before swiftune (and with it ``triton.jit``) is imported,
so it is set here, at collection time, and nowhere in the library.
"""

import os

import pytest
import torch

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
