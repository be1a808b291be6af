"""Helpers of the benchmark scripts' smoke tests (tests/test_benchmark_*_scripts.py): each script's tiny
mode runs end to end in a subprocess (``python -m benchmarks.NAME``) and writes its figures as result
rows that validate against benchmarks.results' schema.

The scripts run without ``TRITON_INTERPRET`` (removed from their environment), so on a machine
without CUDA the kernels use their plain-PyTorch references, as a user's CPU run would.
"""

import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<name> ARGS`` from the repository root (``name`` may end in .py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    module = "benchmarks." + name.removesuffix(".py")
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{name} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def load_bench_module(name: str):
    """A benchmark module (``benchmarks.<name>``), for its functions."""
    return importlib.import_module(f"benchmarks.{name}")


def assert_rows(out, module: str, metrics: set[str] = frozenset()) -> list:
    """The rows a run wrote beside ``out`` (``<out>.rows.jsonl``): valid, recording the run's own
    ``python -m benchmarks.<module>`` command, carrying at least ``metrics``."""
    from benchmarks.results import read_rows

    path = os.path.splitext(str(out))[0] + ".rows.jsonl"
    rows = read_rows(path)  # validates every row
    assert rows, path
    assert all(r.command.startswith(f"python -m benchmarks.{module} ") and str(out) in r.command for r in rows)
    assert metrics <= {r.metric for r in rows}, (metrics, {r.metric for r in rows})
    return rows


def stand_in_unsloth_anchor(shared, measure: str) -> None:
    """Write ``<shared>/anchors/unsloth_anchor.py``: a stand-in for the workplace's Unsloth anchor that, like it,
    writes a checkpoint marker for ``--save-model-only --model-dir DIR`` and otherwise runs ``measure`` (Python
    source with ``args``, the argument list, in scope; it prints the anchor's ``RESULT {json}`` lines)."""
    anchors = os.path.join(str(shared), "anchors")
    os.makedirs(anchors, exist_ok=True)
    body = "\n".join("    " + line for line in measure.strip("\n").splitlines())
    with open(os.path.join(anchors, "unsloth_anchor.py"), "w") as f:
        f.write("import json, os, sys\n"
                "args = sys.argv[1:]\n"
                "if '--save-model-only' in args:\n"
                "    d = args[args.index('--model-dir') + 1]; os.makedirs(d, exist_ok=True)\n"
                "    open(os.path.join(d, 'unsloth_anchor_model.json'), 'w').write('{}')\n"
                "else:\n" + body + "\n")
