"""Test set-up: on a machine without CUDA, Triton kernels run through the interpreter.

``TRITON_INTERPRET`` must be set before swiftune (and with it ``triton.jit``) is imported,
so it is set here, at collection time, and nowhere in the library.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device this machine has: CPU (Triton interpreter) here, CUDA on the GPU machine."""
    return request.param
