"""swiftune's benchmark scripts, run from the repository root as modules:

    PYTHONPATH=src python -m benchmarks.sft --model qwen3-8b --batch 16 --out sft.json

(or with ``pip install -e .`` instead of ``PYTHONPATH=src``). Each script prints its table last,
writes its JSON with ``--out`` and the same figures as rows of one schema (``benchmarks.results``)
with ``--rows``.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``benchmarks.<module>`` in a child process."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def child_env() -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH``, so a child
    started by ``module_command`` finds the ``benchmarks`` package from any working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env
