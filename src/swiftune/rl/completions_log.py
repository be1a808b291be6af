"""What reward functions log (TRL's ``log_metric`` / ``log_extra``) and the ``log_completions`` table.

Every reward function is called with ``log_metric(name, value)`` and ``log_extra(column, values)``
keyword arguments, as TRL 1.16 passes them. A metric's values are averaged over the processes and the
generations of a logging period and logged under ``name``; extra columns join the completions table.

With ``log_completions=True`` the trainer prints, at every logging step, the last generation's
prompts, completions, each reward function's value and the advantage: a rich table when rich is
installed, plain text otherwise (in a script, a notebook or a log file alike).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, TextIO


class RewardLogs:
    """Collects what reward functions log during one generation."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list[Any]] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        """A scalar for this generation (passed to reward functions as ``log_metric``)."""
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """One value per completion for the completions table (passed as ``log_extra``)."""
        self.extra[str(column)].extend(list(values))

    def take_metrics(self, accelerator: Any = None) -> dict[str, float]:
        """Each metric's mean over its values on every process (sum / count); cleared after."""
        if accelerator is not None and accelerator.num_processes > 1:
            import torch
            from accelerate.utils import gather_object

            names = sorted(set(gather_object(list(self.metrics))))  # the same order on every rank
            local = [[sum(self.metrics.get(n, [])), len(self.metrics.get(n, []))] for n in names]
            totals = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device)
                                        .reshape(-1, 2), reduction="sum").cpu() if names else None
            out = {n: float(totals[i, 0] / totals[i, 1]) for i, n in enumerate(names) if totals[i, 1] > 0}
        else:
            out = {n: sum(v) / len(v) for n, v in self.metrics.items() if v}
        self.metrics.clear()
        return out

    def take_extra(self) -> dict[str, list[Any]]:
        out = dict(self.extra)
        self.extra.clear()
        return out


def _text(x: Any) -> str:
    if isinstance(x, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in x):
        return "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in x)
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.2f}"
    return str(x)


def completion_rows(prompts: list, completions: list, rewards: dict[str, list[float]], advantages: list[float],
                    extra: dict[str, list] | None = None, num: int | None = None,
                    unique_prompts: bool = False) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (strings): the first ``num`` completions (all for None), one per
    distinct prompt with ``unique_prompts``."""
    extra = {k: v for k, v in (extra or {}).items() if len(v) == len(prompts)}
    header = ["Prompt", "Completion", *rewards, "Advantage", *extra]
    rows, seen = [], set()
    for i in range(len(prompts)):
        key = _text(prompts[i])
        if unique_prompts and key in seen:
            continue
        seen.add(key)
        rows.append([key, _text(completions[i]), *(_text(float(v[i])) for v in rewards.values()),
                     _text(float(advantages[i])), *(_text(v[i]) for v in extra.values())])
        if num is not None and len(rows) >= num:
            break
    return header, rows


def print_completions(step: int, header: list[str], rows: list[list[str]], file: TextIO | None = None) -> None:
    """Print the table: rich when installed, aligned plain text otherwise."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(*header, title=f"Step {step}", show_lines=True, expand=True)
        for row in rows:
            table.add_row(*row)
        Console(file=file, soft_wrap=False).print(table)
        return
    widths = [min(40, max([len(h)] + [len(r[j].replace("\n", " ")) for r in rows])) for j, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return " | ".join(c.replace("\n", " ")[:w].ljust(w) for c, w in zip(cells, widths))

    print(f"Step {step}", file=file)
    print(line(header), file=file)
    print("-+-".join("-" * w for w in widths), file=file)
    for row in rows:
        print(line(row), file=file)
