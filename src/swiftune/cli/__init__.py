"""The ``swiftune`` command.

    swiftune sft [CONFIG.yaml] [--key value ...]    supervised fine-tuning
    swiftune grpo [CONFIG.yaml] [--key value ...]   reinforcement learning (GRPO and its variants)
    swiftune generate --model PATH --prompt "..."   sample through a rollout engine (quick checks)
    swiftune plan --model qwen3-8b --tokens 65536   predicted peak GPU memory and the largest context
    swiftune check                                  Triton kernels vs their references on this machine
                                                    (the Triton interpreter on a CPU)

With no arguments ``swiftune sft`` trains a tiny built-in model on the built-in instruction
dataset (no download), on the GPU when there is one, else on the CPU (a short run);
``swiftune grpo`` runs a built-in toy task (a short SFT warm-up, then GRPO on reversing words).
Options are the fields of :class:`swiftune.SFTConfig` / :class:`swiftune.GRPOConfig`
(transformers' ``TrainingArguments`` plus swiftune's) and of the commands' model arguments
(``--help`` lists them all); a YAML file gives the same keys (lists as YAML lists), and command-line
options override it. A mistyped option, a value out of range or a local path that does not exist
ends in one line naming it (exit status 2); add ``--traceback`` to see where an error came from.
"""

from __future__ import annotations

import logging
import os
import sys

from ..errors import ConfigError


def run_sft(argv: list[str]) -> int:
    from .sft import run_sft as run

    return run(argv)


def run_grpo(argv: list[str]) -> int:
    from .grpo import run_grpo as run

    return run(argv)


def run_generate(argv: list[str]) -> int:
    from .generate import main_generate

    return main_generate(argv)


def run_plan(argv: list[str]) -> int:
    from .plan import main_plan

    return main_plan(argv)


def run_check(argv: list[str]) -> int:
    from .check import run_check as run

    return run(argv)


# The training and sampling commands allocate tensors whose sizes change from step to step (packed rows,
# completions of every length, offloaded checkpoints fetched back layer by layer). With PyTorch's default
# fixed-size segments the freed blocks of one step fit the next step's sizes badly: a GRPO step on a
# 24 GB budget failed with 3 GiB reserved but unallocated, where growable segments let a 14% longer
# completion fit (docs/memory.md). A value the user set is kept; CUDA reads it at its first allocation,
# after this.
ALLOCATOR_SETTINGS = "expandable_segments:True"
COMMANDS_THAT_ALLOCATE = ("sft", "grpo", "generate")


def default_allocator_settings(command: str, environ: dict[str, str] | None = None) -> None:
    """Ask for growable CUDA memory segments for ``command`` unless ``PYTORCH_CUDA_ALLOC_CONF`` is set."""
    environ = os.environ if environ is None else environ
    if command in COMMANDS_THAT_ALLOCATE:
        environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)


# Each command's module is imported only when that command runs, so that `swiftune plan` and
# `swiftune --help` do not pay for importing torch and transformers.
COMMANDS = {"sft": run_sft, "grpo": run_grpo, "generate": run_generate, "plan": run_plan, "check": run_check}


def main(argv: list[str] | None = None) -> int:
    """The ``swiftune`` command; returns its exit status.

    A mistake in the command line or config (a :class:`swiftune.errors.ConfigError`) ends in one
    line naming it and exit status 2; a ``ValueError``, ``OSError`` or ``ImportError`` (a bad file,
    dataset or model) raised while running ends in one line and status 1; Ctrl-C ends in one line
    (where the checkpoint went) and status 130. ``--traceback`` shows the whole traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            import difflib

            close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            print(f"swiftune: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}){hint}", file=sys.stderr)
            return 2
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    show_traceback = "--traceback" in rest
    rest = [a for a in rest if a != "--traceback"]
    # swiftune's own progress at INFO; every other library's logger stays at WARNING (datasets, for one,
    # reports at INFO which optional frameworks it found at import)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("swiftune").setLevel(logging.INFO)
    # bitsandbytes (imported by PEFT when installed) warns at every import on CPUs with AVX512-BF16
    # that an optional Hub kernel is missing, then runs its own CPU kernel: not this command's business
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    default_allocator_settings(command)
    try:
        return COMMANDS[command](rest)
    except KeyboardInterrupt as e:
        if show_traceback:
            raise
        # Ctrl-C: the trainers save a checkpoint of the last finished step and say where (their
        # TrainingInterrupted message); a plain KeyboardInterrupt came before training started
        print(f"swiftune {command}: interrupted: {_one_line(e) if str(e) else 'stopped before training'}",
              file=sys.stderr)
        return 130
    except ConfigError as e:
        if show_traceback:
            raise
        # a setting to change (an option, a YAML key, a config field): the message says which and
        # how, so no traceback hint
        print(f"swiftune {command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as e:
        if show_traceback:
            raise
        print(f"swiftune {command}: error: {_one_line(e)} (add --traceback for the traceback)", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


