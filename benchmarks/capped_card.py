"""Run a script as if this process's GPU had only the capped share of its memory.

``torch.cuda.set_per_process_memory_fraction`` caps what the caching allocator may reserve, which is how the
benchmarks emulate a smaller GPU (an 80 GB or 24 GB budget on an H200). The driver is not told: its free and
total bytes (``torch.cuda.mem_get_info``) still describe the whole card. A tool that sizes its work from those
numbers plans for the big card and then runs into the cap. Unsloth does: it chooses chunks of its GRPO loss
from the free bytes ``mem_get_info`` reports and enables double buffering of its offloaded checkpoints when they
are large enough; on an H200 capped at 80e9 bytes it failed at a length it fits on a real 80 GB H100. swiftune
reads the cap itself (``swiftune.losses.chunking.gpu_capacity_bytes``), so it needs none of this.

This launcher makes ``torch.cuda.mem_get_info`` answer as a card of ``fraction`` x the real total would: total
= the capped bytes, free = the capped bytes less everything the driver counts as used (this process's
allocator and CUDA context, and any other process on the card, as a real card of that size would). It sets
the same fraction on the allocator, then runs the script as ``__main__`` with the remaining arguments (its
own folder first on ``sys.path``, as ``python script.py`` would), so the tool sees one consistent, smaller card:

    python benchmarks/capped_card.py --fraction 0.533 anchors/unsloth_anchor.py --mode grpo ...

It imports nothing but torch and the standard library (it runs inside another tool's environment).

Not emulated: ``torch.cuda.get_device_properties(i).total_memory`` still gives the whole card. Unsloth 2026.10
reads it only to pick smaller kernels for cards of 24.5 GiB or less (its fused-linear loss and flex-attention
block sizes), so an emulated 80 GB card is complete, but an emulated 24 GB card still runs the big card's kernel
choices there.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

import torch


def capped_mem_get_info(real_mem_get_info, fraction: float):
    """A ``mem_get_info(device=None) -> (free, total)`` for a card of ``fraction`` x the real total bytes."""

    def mem_get_info(device=None):
        free, total = real_mem_get_info(device)
        capped = int(total * fraction)
        return max(0, capped - (total - free)), capped

    return mem_get_info


def install(fraction: float) -> None:
    """Cap the allocator at ``fraction`` of every visible GPU and make ``mem_get_info`` report that card."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--fraction must be in (0, 1], got {fraction}")
    patched = capped_mem_get_info(torch.cuda.mem_get_info, fraction)
    # both names: ``torch.cuda.mem_get_info`` is re-exported from ``torch.cuda.memory``
    torch.cuda.mem_get_info = patched
    torch.cuda.memory.mem_get_info = patched
    for index in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(fraction, index)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction", type=float, required=True, help="share of each GPU's memory this process may use")
    p.add_argument("script", help="the Python script to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    install(args.fraction)
    sys.argv = [args.script, *args.args]
    # the script's folder, not this one's: benchmarks/ holds modules (kernels.py, losses.py) that would shadow
    # packages of the same names the script's libraries import
    sys.path[0] = os.path.dirname(os.path.abspath(args.script))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
