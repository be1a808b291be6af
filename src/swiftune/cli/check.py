"""``swiftune check``: each fused Triton kernel, forward and backward, against its plain-PyTorch
reference evaluated in float64, on this machine (the Triton interpreter on a CPU)."""

from __future__ import annotations

import sys

CHECK_DOC = """swiftune check: each fused Triton kernel, forward and backward, against its plain-PyTorch
reference evaluated in float64, on this machine.

On a CUDA device the kernels are the compiled ones. On a CPU the Triton kernels run through the
Triton interpreter: TRITON_INTERPRET=1 must be set before triton is imported, so when it was not,
the check runs itself again in a subprocess with it set. Nothing is ever compared with itself: every
kernel is called with backend='triton', which raises rather than fall back to the reference."""


def triton_runs_on_cpu() -> bool:
    """Whether the Triton kernels run on CPU tensors here (decorated under TRITON_INTERPRET=1)."""
    import torch

    from ..kernels import swiglu

    try:
        swiglu(torch.zeros(1, 2), torch.zeros(1, 2), backend="triton")
    except ValueError:
        return False
    return True


def check_rows(device: str) -> list[tuple[str, float, float]]:
    """``(kernel, forward rel err, backward rel err)`` of every kernel vs its float64 reference."""
    import torch

    from .. import kernels as K

    big = device == "cuda"
    rows_, cols = (64, 1000) if big else (16, 200)
    heads, kv_heads, seq, dim = (8, 2, 64, 64) if big else (4, 2, 8, 32)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def rel(got, want):
        got, want = got.detach().double(), want.detach().double()
        return float((got - want).norm() / want.norm().clamp_min(1e-300))

    def compare(run, reference, inputs):
        """forward and backward of ``run`` (float32, Triton) vs ``reference`` (float64)."""
        xs = [t.clone().requires_grad_(True) for t in inputs]
        out = run(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        grads_out = [rand(*o.shape) for o in outs]
        torch.autograd.backward(outs, grads_out)
        ref_xs = [t.detach().double().requires_grad_(True) for t in inputs]
        ref = reference(*ref_xs)
        refs = ref if isinstance(ref, tuple) else (ref,)
        torch.autograd.backward(refs, [g.double() for g in grads_out])
        forward = rel(torch.cat([o.flatten() for o in outs]), torch.cat([r.flatten() for r in refs]))
        backward = rel(torch.cat([x.grad.flatten() for x in xs]), torch.cat([x.grad.flatten() for x in ref_xs]))
        return forward, backward

    g, u = rand(rows_, cols), rand(rows_, cols)
    x, w = rand(rows_, cols), rand(cols)
    q, k = rand(2, heads, seq, dim), rand(2, kv_heads, seq, dim)
    angles = rand(2, seq, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    triton = {"backend": "triton"}
    cases = [
        ("swiglu", lambda a, b: K.swiglu(a, b, **triton), K.swiglu_reference, [g, u]),
        ("geglu", lambda a, b: K.geglu(a, b, "none", **triton), lambda a, b: K.geglu_reference(a, b, "none"), [g, u]),
        ("geglu_tanh", lambda a, b: K.geglu(a, b, "tanh", **triton), lambda a, b: K.geglu_reference(a, b, "tanh"),
         [g, u]),
        ("rms_norm", lambda a, b: K.rms_norm(a, b, 1e-6, **triton), lambda a, b: K.rms_norm_reference(a, b, 1e-6),
         [x, w]),
        ("rms_norm_1+w", lambda a, b: K.rms_norm(a, b, 1e-6, 1.0, **triton),
         lambda a, b: K.rms_norm_reference(a, b, 1e-6, 1.0), [x, w]),
        ("rope_qk", lambda a, b: K.rope_qk(a * 1, b * 1, cos, sin, **triton),
         lambda a, b: K.rope_qk_reference(a, b, cos.double(), sin.double()), [q, k]),
    ]
    return [(name, *compare(run, reference, inputs)) for name, run, reference, inputs in cases]


def run_check(argv: list[str]) -> int:
    """Each kernel, forward and backward, against its reference on this machine (see CHECK_DOC)."""
    import argparse
    import os
    import subprocess

    parser = argparse.ArgumentParser(prog="swiftune check", description=CHECK_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative error (norm of the difference / norm of the reference) that passes")
    parser.add_argument("--under-interpreter", action="store_true", help=argparse.SUPPRESS)  # the re-run
    args = parser.parse_args(argv)
    if not 0 < args.tolerance < float("inf"):  # NaN too: every comparison with it is false
        print(f"swiftune check: --tolerance {args.tolerance:g}: give a relative error > 0 (default 1e-5)",
              file=sys.stderr)
        return 2

    import torch

    from ..kernels.launch import HAS_TRITON

    if not HAS_TRITON:
        print("swiftune check: triton is not installed, so there is no Triton kernel to check (swiftune runs "
              "its plain-PyTorch references); install triton to check the kernels", file=sys.stderr)
        return 1
    if triton_runs_on_cpu():
        device, what = "cpu", "run by the Triton interpreter on the CPU, TRITON_INTERPRET=1"
    elif torch.cuda.is_available():
        device, what = "cuda", f"compiled for {torch.cuda.get_device_name()}"
    elif args.under_interpreter:
        print("swiftune check: TRITON_INTERPRET=1 was set, yet the Triton kernels do not run on CPU tensors; "
              "nothing was checked", file=sys.stderr)
        return 1
    else:
        print("swiftune check: no CUDA device; running the Triton kernels through the Triton interpreter "
              "(TRITON_INTERPRET=1 must be set before triton is imported: checking in a subprocess)", flush=True)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.call([sys.executable, "-m", "swiftune.cli", "check", "--under-interpreter", *argv], env=env)

    print(f"swiftune check: Triton kernels ({what}), float32, vs their plain-PyTorch references in float64")
    print(f"{'kernel':14s} {'forward':>10s} {'backward':>10s}")
    ok = True
    for name, forward, backward in check_rows(device):
        good = forward < args.tolerance and backward < args.tolerance  # NaN fails
        ok &= good
        print(f"{name:14s} {forward:10.2e} {backward:10.2e}  {'ok' if good else 'FAIL'}")
    verdict = "every kernel matches its reference" if ok else "MISMATCH: a kernel differs from its reference"
    print(f"{verdict} (relative error tolerance {args.tolerance:g}; Triton kernels {what})")
    return 0 if ok else 1
