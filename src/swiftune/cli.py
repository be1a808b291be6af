"""The ``swiftune`` command.

    swiftune sft [CONFIG.yaml] [--key value ...]    supervised fine-tuning
    swiftune grpo [CONFIG.yaml] [--key value ...]   reinforcement learning (GRPO and its variants)
    swiftune generate --model PATH --prompt "..."   sample through a rollout engine (quick checks)
    swiftune plan --model qwen3-8b --tokens 65536   predicted peak GPU memory and the largest context
    swiftune check                                  kernels vs their references on this machine

With no arguments ``swiftune sft`` trains a tiny built-in model on the built-in instruction
dataset (no download), on the GPU when there is one, else on the CPU in about a minute;
``swiftune grpo`` runs a built-in toy task (a short SFT warm-up, then GRPO on reversing words).
Options are the fields of :class:`swiftune.SFTConfig` / :class:`swiftune.GRPOConfig`
(transformers' ``TrainingArguments`` plus swiftune's) and of the commands' model arguments
(``--help`` lists them all); a YAML file gives the same keys, and command-line options override it.
"""

from __future__ import annotations

import logging
import sys


def run_sft(argv: list[str]) -> int:
    from .sft.command import run_sft as run

    return run(argv)


def run_grpo(argv: list[str]) -> int:
    from .rl.builtin import run_grpo as run

    return run(argv)


def run_generate(argv: list[str]) -> int:
    from .rl.generate import main_generate

    return main_generate(argv)


def run_plan(argv: list[str]) -> int:
    from .memory import main_plan

    return main_plan(argv)


def run_check(argv: list[str]) -> int:
    """Each kernel against its reference on this machine's device (compiled on CUDA)."""
    import torch

    from .kernels import geglu, geglu_reference, rms_norm, rms_norm_reference, rope_qk, rope_qk_reference, swiglu
    from .kernels import swiglu_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    g, u = torch.randn(64, 1000, device=device), torch.randn(64, 1000, device=device)
    x, w = torch.randn(64, 1000, device=device), torch.randn(1000, device=device)
    q, k = torch.randn(2, 8, 16, 64, device=device), torch.randn(2, 2, 16, 64, device=device)
    cos, sin = torch.randn(2, 16, 64, device=device), torch.randn(2, 16, 64, device=device)
    rows = [
        ("swiglu", swiglu(g, u), swiglu_reference(g, u)),
        ("geglu", geglu(g, u, "tanh"), geglu_reference(g, u, "tanh")),
        ("rms_norm", rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)),
        ("rope_qk", torch.cat([t.flatten() for t in rope_qk(q.clone(), k.clone(), cos, sin)]),
         torch.cat([t.flatten() for t in rope_qk_reference(q, k, cos, sin)])),
    ]
    ok = True
    for name, got, want in rows:
        err = float((got.double() - want.double()).norm() / want.double().norm())
        ok &= err < 1e-5
        print(f"{name:9s} rel err {err:.2e} {'ok' if err < 1e-5 else 'FAIL'}")
    print(f"device {device}: {'all kernels match their references' if ok else 'MISMATCH'}")
    return 0 if ok else 1


COMMANDS = {"sft": run_sft, "grpo": run_grpo, "generate": run_generate, "plan": run_plan, "check": run_check}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "accelerate", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

