"""RMSNorm, including Gemma's ``(1 + w)`` form, computed in float32, with weight gradient.

Forward, per row ``x`` of length N (``offset`` = 0 for Llama/Qwen, 1 for Gemma)::

    r     = 1 / sqrt(mean(x^2) + eps)
    x_hat = x * r
    y     = round(x_hat * (offset + w))

Backward, with ``g = dy * (offset + w)``::

    dx = r * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat

``add_rms_norm`` (decoding only, no backward) fuses the residual add that precedes each norm of
a pre-norm decoder layer: ``s = round(x + residual)``, ``y = rms_norm(s)``; it returns ``(y, s)``
with exactly the roundings of the unfused ``rms_norm(x + residual)``. ``add_rms_norm_fp8`` also
quantises ``y`` (as rounded) per row to e4m3 in the same program, the bytes of
:func:`swiftune.kernels.fp8_quant.fp8_quantize_rowwise` of ``y``: the codes an FP8 projection that
reads ``y`` would make, one launch fewer per norm in an FP8 decode step.

Only x, w and the per-row ``r`` (one float32 per row) are saved. The backward kernel runs a
fixed number of programs that each walk a strided set of rows and accumulate their share of
``dw`` in registers; the partial sums are added afterwards, so no atomics are needed and the
result is deterministic. Under the Triton interpreter (CPU) both take 64 rows a program as one tile
(:func:`rows_per_program`).
"""

from __future__ import annotations

import torch

from .fp8_quant import e4m3_codes, e4m3_scale, fp8_quantize_rowwise_reference
from .launch import Backend, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2, tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Plain PyTorch: float32 statistics, one rounding at the end, output in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.to(y.dtype))).to(x.dtype)


if triton is not None:

    @triton.jit
    def rms_row(x, w_ptr, y_row_ptr, cols, mask, n_cols, eps, offset, ROWS: tl.constexpr = 1):
        """Normalise one float32 row ``x`` and store ``round(x * r * (offset + w))`` at
        ``y_row_ptr + cols``; returns ``r``. Every forward kernel that normalises (this module's,
        ``decode_qkv``) goes through it, so their roundings agree bit for bit. ``ROWS > 1`` (the
        interpreter's tiles, see :func:`rows_per_program`): ``x`` is ``[ROWS, BLOCK]``, ``y_row_ptr``
        and ``mask`` are too, ``cols`` is ``[1, BLOCK]``, and ``r`` is ``[ROWS]``."""
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ROWS == 1:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            tl.store(y_row_ptr + cols, (x * r * (offset + w)).to(y_row_ptr.dtype.element_ty), mask=mask)
        else:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            tl.store(y_row_ptr + cols, (x * r[:, None] * (offset + w)).to(y_row_ptr.dtype.element_ty), mask=mask)
        return r

    @triton.jit
    def _load_program_row(x_ptr, stride_x, n_cols, BLOCK: tl.constexpr, INT64: tl.constexpr):
        """``(row, cols, mask, x)``: this program's row (64-bit when ``INT64``), the column offsets of
        a one-block row and their mask, and that row of ``x`` in float32 (the forward kernels' start)."""
        row = tl.program_id(0)
        if INT64:
            row = row.to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        return row, cols, mask, x

    @triton.jit
    def _rms_fwd_kernel(
        x_ptr, w_ptr, y_ptr, r_ptr, n_rows, n_cols, stride_x, stride_y, eps, offset,
        BLOCK: tl.constexpr, INT64: tl.constexpr, ROWS: tl.constexpr,
    ):
        if ROWS == 1:
            row, cols, mask, x = _load_program_row(x_ptr, stride_x, n_cols, BLOCK, INT64)
            r = rms_row(x, w_ptr, y_ptr + row * stride_y, cols, mask, n_cols, eps, offset)
            tl.store(r_ptr + row, r)
        else:
            first = tl.program_id(0) * ROWS
            if INT64:
                first = first.to(tl.int64)
            rows = first + tl.arange(0, ROWS)
            cols = tl.arange(0, BLOCK)[None, :]
            mask = (rows[:, None] < n_rows) & (cols < n_cols)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            r = rms_row(x, w_ptr, y_ptr + rows[:, None] * stride_y, cols, mask, n_cols, eps, offset, ROWS)
            tl.store(r_ptr + rows, r, mask=rows < n_rows)

    @triton.jit
    def _rms_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols,
        stride_dy, stride_x, stride_dx, offset,
        BLOCK: tl.constexpr, INT64: tl.constexpr, ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        if ROWS > 1:  # the interpreter's tiles: rows [pid ROWS, (pid + 1) ROWS), one [ROWS, BLOCK] tile
            first_row = pid * ROWS
            if INT64:
                first_row = first_row.to(tl.int64)
            rows = first_row + tl.arange(0, ROWS)
            tile = (rows[:, None] < n_rows) & mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
            x_hat = x * r
            g = dy * w[None, :]
            dx = r * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
            tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=tile)
            tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(dy * x_hat, axis=0), mask=mask)
        else:
            dw = tl.zeros((BLOCK,), dtype=tl.float32)
            first = pid
            if INT64:
                first = pid.to(tl.int64)
            # rows first, first + n_prog, ...: the row is computed from ``first`` rather than taken as the loop's
            # induction variable, so it is 64-bit whenever ``first`` is (the interpreter's loop variable is a Python
            # int whatever the bounds' types, and a Python int times an int32 stride wraps at 2^31)
            for i in range(0, tl.cdiv(n_rows - pid, n_prog)):
                row = first + i * n_prog
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_ptr + row)
                x_hat = x * r
                g = dy * w
                dx = r * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
                tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw += dy * x_hat
            tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)

    @triton.jit
    def _add_rms_fwd_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, s_ptr, q_ptr, qs_ptr, n_cols, stride_x, stride_res, stride_y, stride_s,
        stride_q, eps, offset, BLOCK: tl.constexpr, INT64: tl.constexpr, QUANTIZE: tl.constexpr,
    ):
        row, cols, mask, x = _load_program_row(x_ptr, stride_x, n_cols, BLOCK, INT64)
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the activation dtype first, as the unfused `x + residual` does, and
        # normalise the rounded value: the new residual stream and y match the unfused path
        s = (x + res).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, s, mask=mask)
        sf = s.to(tl.float32)
        r = rms_row(sf, w_ptr, y_ptr + row * stride_y, cols, mask, n_cols, eps, offset)
        if QUANTIZE:
            # y as stored (rms_row's expression, rounded to y's dtype), quantised as fp8_quant's kernel
            # quantises a row that fits one block: masked columns load as 0 there, and are 0 here
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = (sf * r * (offset + w)).to(y_ptr.dtype.element_ty).to(tl.float32)
            y = tl.where(mask, y, 0.0)
            scale = e4m3_scale(tl.max(tl.abs(y), axis=0))
            tl.store(qs_ptr + row, scale)
            tl.store(q_ptr + row * stride_q + cols, e4m3_codes(y, scale).to(q_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    rms_row = None
    _rms_fwd_kernel = None
    _add_rms_fwd_kernel = None


INTERPRETER_ROWS_PER_PROGRAM = 64


def rows_per_program(interpreted: bool) -> int:
    """Rows one program of :func:`rms_norm` normalises (forward) or differentiates (backward). On a GPU,
    one row a forward program, and a fixed number of backward programs walking the rows. Under the
    Triton interpreter, which runs programs (and every jit helper they call) one after another in
    Python: 64 rows a program as one ``[64, BLOCK]`` tile, the same arithmetic."""
    return INTERPRETER_ROWS_PER_PROGRAM if interpreted else 1


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as ``[rows, n_cols]`` with a unit last stride (copied only when it has none)."""
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be 1-D with x's last dimension: weight {tuple(weight.shape)}, x {tuple(x.shape)}"
        )
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, offset: float, force_int64: bool):
        shape = x.shape
        x2 = _as_rows(x, shape[-1])
        n_rows, n_cols = x2.shape
        # The output is allocated in x's shape and returned as itself, not as a view of a 2-D
        # buffer: a custom Function's view output has an owner outside the graph, which would
        # keep the next op (the in-place RoPE on Qwen3 / Gemma 3's normalised q/k) from writing it.
        y = torch.empty(shape, dtype=x.dtype, device=x.device)
        y2 = y.view(n_rows, n_cols)
        r = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = next_pow2(n_cols)
        int64 = force_int64 or needs_int64(x2)
        rows = rows_per_program(kernel_is_interpreted(_rms_fwd_kernel))
        _rms_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            x2, weight, y2, r, n_rows, n_cols, x2.stride(0), y2.stride(0), eps, offset,
            BLOCK=block, INT64=int64, ROWS=rows, num_warps=_num_warps(block),
        )
        ctx.save_for_backward(x2, weight, r)  # not y: an in-place op may rewrite y afterwards
        ctx.offset, ctx.int64, ctx.shape = offset, int64, shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, r = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _as_rows(dy, n_cols)
        dx = torch.empty_like(x2)
        rows = rows_per_program(kernel_is_interpreted(_rms_bwd_kernel))
        if x2.is_cuda:
            n_prog = min(n_rows, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
        else:
            n_prog = triton.cdiv(n_rows, rows) if rows > 1 else min(n_rows, 4)
        n_prog = max(n_prog, 1)
        dw_part = torch.empty((n_prog, n_cols), dtype=torch.float32, device=x2.device)
        block = next_pow2(n_cols)
        # the incoming gradient's rows may lie further apart than the input's (a view into a larger buffer,
        # e.g. what a concatenation's backward hands back): its offsets decide as well as the input's
        int64 = ctx.int64 or needs_int64(dy2, dx)
        _rms_bwd_kernel[(n_prog,)](
            dy2, x2, weight, r, dx, dw_part, n_rows, n_cols,
            dy2.stride(0), x2.stride(0), dx.stride(0), ctx.offset,
            BLOCK=block, INT64=int64, ROWS=rows, num_warps=_num_warps(block),
        )
        dw = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    *,
    backend: Backend = "auto",
    _force_int64: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``: ``x / rms(x) * (offset + weight)``.

    ``offset=1.0`` gives Gemma's ``(1 + w)`` parameterisation. Statistics and the product are
    computed in float32; the output has x's dtype; the weight gradient has the weight's dtype.
    """
    _check_norm_args(x, weight, eps)
    if choose_backend(backend, _rms_fwd_kernel, {"x": x, "weight": weight}) == "reference":
        return rms_norm_reference(x, weight, eps, offset)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), _force_int64)


def _check_add_rms_args(name: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_norm_args(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(x.shape)} {x.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        raise RuntimeError(f"{name} has no backward: call it under torch.no_grad() (decoding)")


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``s = x + residual`` (in x's dtype), ``(rms_norm(s), s)``."""
    s = x + residual
    return rms_norm_reference(s, weight, eps, offset), s


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: the residual add and the next
    RMSNorm of a pre-norm decoder layer, for decoding (one kernel instead of two per norm).

    No autograd: inputs that require grad are refused (training keeps the separate ops, whose
    backward exists). ``x`` and ``residual`` share shape and dtype; outputs are in that dtype.
    """
    _check_add_rms_args("add_rms_norm", x, residual, weight, eps)
    if choose_backend(backend, _add_rms_fwd_kernel, {"x": x, "residual": residual, "weight": weight}) == "reference":
        return add_rms_norm_reference(x, residual, weight, eps, offset)
    y, s, _, _ = _launch_add_rms(x, residual, weight, eps, offset, quantize=False)
    return y, s


def _launch_add_rms(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    quantize: bool) -> tuple[torch.Tensor, ...]:
    shape = x.shape
    x2, r2 = _as_rows(x, shape[-1]), _as_rows(residual, shape[-1])
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y)
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device) if quantize else y
    scales = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device) if quantize else y
    block = next_pow2(n_cols)
    _add_rms_fwd_kernel[(n_rows,)](
        x2, r2, weight, y, s, q, scales, n_cols, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
        q.stride(0), float(eps), float(offset), BLOCK=block, INT64=needs_int64(x2, r2, q),
        QUANTIZE=quantize, num_warps=_num_warps(block),
    )
    return y.view(shape), s.view(shape), q, scales


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                     *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, s, codes, scales)``: :func:`add_rms_norm`'s ``(y, s)`` and ``y``'s per-row e4m3 codes
    (``[rows, hidden]``, rows = every axis but the last) and float32 scales (``[rows, 1]``), the bytes of
    ``fp8_quantize_rowwise(y)``, in one launch. For decoding (no autograd), like :func:`add_rms_norm`."""
    _check_add_rms_args("add_rms_norm_fp8", x, residual, weight, eps)
    if choose_backend(backend, _add_rms_fwd_kernel, {"x": x, "residual": residual, "weight": weight}) == "reference":
        y, s = add_rms_norm_reference(x, residual, weight, eps, offset)
        codes, scales = fp8_quantize_rowwise_reference(y.reshape(-1, y.shape[-1]))
        return y, s, codes, scales
    return _launch_add_rms(x, residual, weight, eps, offset, quantize=True)
