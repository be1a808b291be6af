"""Tiled MLP: run a per-token module over the sequence in tiles, saving only its input.

At 500K tokens the gated MLP of an 8B model builds ``gate``, ``up`` and ``act`` of
``tokens x intermediate`` (3 x 12 GB in bf16), and PEFT's float32 LoRA adapters add a float32
copy of each projection input.  An MLP acts on every token independently,

    y_t = down(act(gate(x_t)) * up(x_t))        for every token t,

so it can run on tiles of ``n`` tokens and give exactly the same ``y``.  :class:`TiledApply`
(an ``autograd.Function``) does that:

* forward, under ``no_grad``: ``y[a:b] = f(x[a:b])`` tile by tile into one output buffer; only
  ``x`` is saved (plus the parameters, which exist anyway);
* backward: for each tile, recompute ``y_t = f(x_t)`` with grad enabled (the module's *own*
  forward: fused kernels, PEFT LoRA, whatever is bound), then
  ``torch.autograd.grad(y_t, [x_t, *params], dy[a:b])``: the tile's input gradient goes into
  ``dx[a:b]`` and the parameter gradients are summed over tiles (float32 accumulators for
  half-precision parameters): ``dW = sum_tiles dW_tile``, the same sum the untiled matmul makes.

Peak temporary memory is one tile's buffers instead of the whole sequence's.  The price is one
more forward of the module in backward (the MLP costs 4 forward-equivalents instead of 3; under
checkpointing 5 instead of 4), so tiling only starts above ``tile_tokens`` tokens.  Under
swiftune's offloaded checkpointing of a layer whose MLP output only feeds the residual add
(Llama, Mistral, Qwen2, Qwen3) the recompute skips the MLP's output (:func:`recompute_output_unused`:
the recompute only rebuilds saved tensors, and the tiled MLP saves its input alone), which brings
it back to 4, the cost of the untiled MLP under checkpointing.  The RNG state
(dropout in LoRA) and the autocast state of the forward are restored for the recompute, so masks
and dtypes match.  Parameter gradients are returned through autograd (no nested ``.backward``),
so gradient hooks, DDP and gradient accumulation see an ordinary gradient.

Tile size (:func:`swiftune.memory.auto_tile_tokens`): about 1 GiB of a tile's buffers, i.e.
``1 GiB / (I (3 b + 8) + 16 H)`` tokens rounded down to 256: 4,352 tokens for Qwen3-8B in bf16.

:func:`enable_tiled_mlp` binds the tiled forward on each gated-MLP *instance* (``gate_proj``,
``up_proj``, ``down_proj``), on top of whatever forward the instance had (swiftune's fused one
after :func:`swiftune.patch_model`); ``projections=True`` also tiles the LoRA-wrapped attention
projections (call it after PEFT has wrapped them).  Before or after ``patch_model``: patching a
tiled MLP replaces what each tile runs (:func:`replace_untiled_forward`), not the tiling.

Mixture-of-experts blocks (Qwen3-MoE's and Mixtral's ``SparseMoeBlock``, gpt-oss's ``GptOssMLP``)
are per-token too (no expert capacity, nothing shared between tokens), but their router must not run
tile by tile: the router logits of the whole batch feed the load-balancing loss (swiftune's recorder
and transformers' own ``output_router_logits`` capture hook the router module, and a tiled call would
hand them pieces computed without gradient). So :func:`tiled_moe_forward` routes every token once,
with gradient, exactly as the block does (``router(x) -> weights, experts``), and tiles only the
experts (:class:`TiledExperts`: the same save-the-input, recompute-per-tile scheme with the routing
weights as a second per-token input, their gradient returned to the router). A block with anything
else inside (a shared expert, router jitter noise, which changes its input in place) is refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from types import MethodType

import torch
from torch import nn

from ..memory.planner import auto_tile_tokens

_ORIG = "_swiftune_untiled_forward"  # the instance's forward before tiling (None: the class's)
_TILE = "_swiftune_tile_tokens"
_OUTPUT_UNUSED = "_swiftune_recompute_output_unused"  # set by recompute_output_unused
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def tile_bounds(n: int, tile: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of ``ceil(n / tile)`` balanced tiles (no sliver at the end)."""
    if n <= 0:
        return []
    k = math.ceil(n / max(1, tile))
    size = math.ceil(n / k)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class ForwardState:
    """RNG and autocast state of a forward, replayed for a recompute in backward (the tiles here,
    a derived layer input in :mod:`.checkpointing`)."""

    def __init__(self, device: torch.device, with_rng: bool) -> None:
        self.device = device
        self.cpu_rng = torch.get_rng_state() if with_rng else None
        self.dev_rng = torch.cuda.get_rng_state(device) if with_rng and device.type == "cuda" else None
        dt = device.type
        self.autocast = torch.is_autocast_enabled(dt) if torch.amp.is_autocast_available(dt) else False
        self.autocast_dtype = torch.get_autocast_dtype(dt) if self.autocast else None

    def replay(self):
        """A context manager: forked RNG set to the forward's state, the forward's autocast."""
        stack = contextlib.ExitStack()
        if self.cpu_rng is not None:
            devices = [self.device] if self.dev_rng is not None else []
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(self.cpu_rng)
            if self.dev_rng is not None:
                torch.cuda.set_rng_state(self.dev_rng, self.device)
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        return stack


class TiledApply(torch.autograd.Function):
    """``y = f(x)`` for a per-token ``f``, computed and differentiated in token tiles.

    ``forward(ctx, f, x, tile_tokens, with_rng, *params)``: ``x`` is ``[..., H]``; tiles run over
    the flattened leading axes; ``params`` are the trainable tensors ``f`` uses (gradients are
    returned for them).
    """

    @staticmethod
    def forward(ctx, f, x, tile_tokens, with_rng, skip_output, *params):  # type: ignore[override]
        ctx.f, ctx.tile = f, tile_tokens
        ctx.state = ForwardState(x.device, with_rng)
        if skip_output:  # a recompute whose output nobody reads (see recompute_output_unused)
            ctx.save_for_backward(x, *params)
            return torch.empty_like(x)
        x2 = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for a, b in tile_bounds(x2.shape[0], tile_tokens):
                y = f(x2[a:b].unsqueeze(0)).squeeze(0)
                if out is None:
                    out = y.new_empty((x2.shape[0], y.shape[-1]))
                out[a:b].copy_(y)
                del y
        if out is None:  # zero tokens: one call gives the output width and dtype
            with torch.no_grad():
                out = f(x2.unsqueeze(0)).squeeze(0)
        ctx.save_for_backward(x, *params)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        need_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        targets = [p for p, n in zip(params, need_p) if n]
        x2 = x.detach().reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(x2) if need_x else None
        # Sum tile gradients in float32 for half-precision parameters (the untiled matmul also
        # accumulates in float32 and rounds once).
        acc = [torch.zeros_like(p, dtype=torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype)
               for p in targets]
        with ctx.state.replay(), torch.enable_grad():
            for a, b in tile_bounds(x2.shape[0], ctx.tile):
                xt = x2[a:b].unsqueeze(0).requires_grad_(need_x)
                yt = ctx.f(xt).squeeze(0)
                inputs = ([xt] if need_x else []) + targets
                if not inputs:
                    break
                grads = torch.autograd.grad(yt, inputs, dy2[a:b].to(yt.dtype), allow_unused=True)
                del yt
                if need_x:
                    g = grads[0]
                    if g is None:  # f ignores its input
                        dx[a:b].zero_()
                    else:
                        dx[a:b].copy_(g.squeeze(0))
                    grads = grads[1:]
                for buf, g in zip(acc, grads):
                    if g is not None:
                        buf.add_(g)
        it = iter(acc)
        p_grads = [next(it).to(p.dtype) if n else None for p, n in zip(params, need_p)]
        gx = dx.view(x.shape) if need_x else None
        return (None, gx, None, None, None, *p_grads)


def tiled_apply(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int,
                params: Sequence[torch.Tensor] = (), with_rng: bool = False, skip_output: bool = False) -> torch.Tensor:
    """``f(x)`` in tiles of ``tile_tokens`` tokens (see :class:`TiledApply`); ``f`` per token.

    ``skip_output`` (``f`` maps ``[..., H]`` to ``[..., H]``): save ``x`` for backward but return an
    uninitialised output without running ``f``: for a checkpoint's recompute that reads nothing
    but the saved tensors (:func:`recompute_output_unused`)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    if not torch.is_grad_enabled():  # nothing to save: just bound the temporaries
        x2 = x.reshape(-1, x.shape[-1])
        outs = [f(x2[a:b].unsqueeze(0)).squeeze(0) for a, b in tile_bounds(x2.shape[0], tile_tokens)]
        out = torch.cat(outs) if outs else f(x2.unsqueeze(0)).squeeze(0)
        return out.view(*x.shape[:-1], out.shape[-1])
    return TiledApply.apply(f, x, int(tile_tokens), with_rng, skip_output, *params)


# ----------------------------------------------------------------------------- kept subtree walks
#
# A tiled module's forward needs its trainable parameters and whether a dropout of it is active: two
# walks of its subtree (a LoRA-wrapped MLP: some 35 modules) at every call, forward and recompute, of
# every layer. They are kept on the module with the identities of everything its modules' module and
# parameter dicts hold, and walked again when one differs: any module or parameter added, deleted or
# swapped anywhere in the subtree (PEFT wrapping a projection or adding an adapter, FSDP's sharded
# parameters, a module replaced by hand) is a change to one of those dicts. Comparing them is a pass
# over dicts in C, not a recursive walk. The kept modules and parameters are held, so an identity
# cannot be reused while kept (the module's descendants only: holding the module itself in its own
# ``__dict__`` would make a reference cycle, freed by the garbage collector instead of at once).
# ``requires_grad``, ``training`` and a dropout's ``p`` are read at every call.

_SUBTREE = "_swiftune_kept_subtree"  # on a tiled module: _Subtree


def _held_ids(views: list) -> tuple[int, ...]:
    return tuple(map(id, chain.from_iterable(views)))


class _Subtree:
    __slots__ = ("descendants", "views", "ids", "params", "dropouts")

    def __init__(self, module: nn.Module) -> None:
        modules = list(module.modules())
        self.descendants = modules[1:]
        # live views of the dicts (a dict's values() follows it), made once rather than at every check
        self.views = [d.values() for m in modules for d in (m._modules, m._parameters)]
        self.ids = _held_ids(self.views)
        self.params = list(module.parameters())
        self.dropouts = [m for m in self.descendants if isinstance(m, nn.Dropout)]

    def __reduce__(self):  # a copied or pickled module walks its own subtree again (views cannot be copied)
        return type(None), ()


def _subtree(module: nn.Module) -> _Subtree:
    kept = module.__dict__.get(_SUBTREE)
    if kept is None or _held_ids(kept.views) != kept.ids:
        kept = module.__dict__[_SUBTREE] = _Subtree(module)
    return kept


def _trainable(module: nn.Module, kept: _Subtree | None = None) -> list[torch.Tensor]:
    return [p for p in (kept or _subtree(module)).params if p.requires_grad]


def _has_dropout(module: nn.Module, kept: _Subtree | None = None) -> bool:
    return module.training and any(m.p > 0 for m in (kept or _subtree(module)).dropouts)


def _untiled(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    orig = module.__dict__.get(_ORIG)
    return orig if orig is not None else MethodType(type(module).forward, module)


def mlp_tile_tokens(mlp: nn.Module, x: torch.Tensor, tile_tokens: int | None) -> int:
    """The tile size for ``mlp`` on ``x``: ``tile_tokens`` or the ~1 GiB automatic choice."""
    if tile_tokens is not None:
        return int(tile_tokens)
    # a gated MLP's intermediate width; a projection's own output width; else a 4x guess
    inter = getattr(getattr(mlp, "gate_proj", None), "out_features", None) or getattr(mlp, "out_features", None)
    inter = inter or x.shape[-1] * 4
    return auto_tile_tokens(int(inter), x.shape[-1], x.element_size())


def tiled_mlp_forward(mlp: nn.Module, x: torch.Tensor, tile_tokens: int | None = None) -> torch.Tensor:
    """``mlp(x)`` computed in sequence tiles, saving only ``x`` for backward.

    Uses the module's untiled forward per tile (the instance's bound forward, e.g. swiftune's
    fused one or PEFT-wrapped projections underneath).  Outputs and gradients (input and every
    trainable parameter) equal the untiled module's up to floating-point summation order.
    """
    tile = mlp_tile_tokens(mlp, x, tile_tokens)
    f = _untiled(mlp)
    if x.numel() // max(x.shape[-1], 1) <= tile:
        return f(x)
    skip = bool(mlp.__dict__.get(_OUTPUT_UNUSED)) and _is_gated_mlp(mlp)
    kept = _subtree(mlp)  # checked once for both
    return tiled_apply(f, x, tile, _trainable(mlp, kept), with_rng=_has_dropout(mlp, kept), skip_output=skip)


@contextlib.contextmanager
def recompute_output_unused(mlp: nn.Module | None) -> Iterator[None]:
    """Within the ``with`` body, the tiled ``mlp`` saves its input but computes no output.

    For the recompute of a checkpointed decoder layer whose MLP output only feeds the residual add
    (Llama, Mistral, Qwen2, Qwen3: nothing after the MLP saves a tensor): the recompute exists to
    rebuild the saved tensors, and the tiled MLP's one saved tensor is its input, so its forward
    there would be one whole MLP forward for nothing (its backward recomputes each tile anyway).
    The layer's (garbage) output is discarded by checkpointing. ``None``: no-op."""
    if mlp is None:
        yield
        return
    mlp.__dict__[_OUTPUT_UNUSED] = True
    try:
        yield
    finally:
        mlp.__dict__.pop(_OUTPUT_UNUSED, None)


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tiled_mlp_forward(self, x, getattr(self, _TILE, None))


# ----------------------------------------------------------------------------- mixture of experts

# MoE block classes whose forward is exactly ``router(x) -> (logits, weights, index)``, then
# ``experts(x, index, weights)`` on the flattened tokens (gpt-oss: returned with the weights)
_MOE_BLOCKS = {"Qwen3MoeSparseMoeBlock": "gate", "MixtralSparseMoeBlock": "gate", "GptOssMLP": "router"}
_RETURNS_WEIGHTS = ("GptOssMLP",)


def _moe_parts(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(router, experts)`` of a MoE block :func:`tiled_moe_forward` can run, ``None`` for a module
    that is not a MoE block; ``ValueError`` for one it cannot (the message says why)."""
    cls = type(module).__name__
    children = dict(module.named_children())
    if cls not in _MOE_BLOCKS:
        if "experts" in children and any(n in children for n in ("gate", "router")):
            raise ValueError(f"tiled_mlp: {cls} is a mixture-of-experts block swiftune cannot tile (it tiles "
                             f"{', '.join(sorted(_MOE_BLOCKS))}, whose forward is router then experts); turn "
                             "tiled_mlp off for this model")
        return None
    router_name = _MOE_BLOCKS[cls]
    if set(children) != {router_name, "experts"}:
        raise ValueError(f"tiled_mlp: {cls} holds {sorted(children)}, not only {router_name!r} and 'experts' "
                         "(another transformers layout, or a shared expert): it cannot be tiled as router + experts; "
                         "turn tiled_mlp off for this model")
    if getattr(module, "jitter_noise", 0.0):
        raise ValueError(f"tiled_mlp: {cls} multiplies its input by router jitter noise (router_jitter_noise="
                         f"{module.jitter_noise}) in place, which a tiled recompute cannot replay; set "
                         "router_jitter_noise=0 in the model config or turn tiled_mlp off")
    return children[router_name], children["experts"]


class TiledExperts(torch.autograd.Function):
    """``y = experts(x, index, weights)`` in token tiles, saving only ``x`` and ``weights``.

    ``forward(ctx, experts, x, index, weights, tile_tokens, *params)`` with ``x [T, H]``, ``index`` /
    ``weights [T, k]`` (the router's choices, computed once outside); backward recomputes each tile
    with gradient and returns ``dx``, ``dweights`` (to the router) and the parameters' gradients summed
    over tiles (float32 accumulators for half-precision parameters), as :class:`TiledApply`.
    """

    @staticmethod
    def forward(ctx, experts, x, index, weights, tile_tokens, *params):  # type: ignore[override]
        ctx.experts, ctx.tile = experts, tile_tokens
        ctx.state = ForwardState(x.device, False)
        out = x.new_empty(x.shape)
        with torch.no_grad():
            for a, b in tile_bounds(x.shape[0], tile_tokens):
                out[a:b].copy_(experts(x[a:b], index[a:b], weights[a:b]))
        ctx.save_for_backward(x, index, weights, *params)
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, index, weights, *params = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        need_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        targets = [p for p, n in zip(params, need_p) if n]
        dx = torch.zeros_like(x) if need_x else None
        dw = torch.zeros_like(weights) if need_w else None
        acc = [torch.zeros_like(p, dtype=torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype)
               for p in targets]
        with ctx.state.replay(), torch.enable_grad():
            for a, b in tile_bounds(x.shape[0], ctx.tile):
                xt = x[a:b].detach().requires_grad_(need_x)
                wt = weights[a:b].detach().requires_grad_(need_w)
                inputs = ([xt] if need_x else []) + ([wt] if need_w else []) + targets
                if not inputs:
                    break
                yt = ctx.experts(xt, index[a:b], wt)
                grads = list(torch.autograd.grad(yt, inputs, dy[a:b].to(yt.dtype), allow_unused=True))
                del yt
                for want, buf in ((need_x, dx), (need_w, dw)):
                    if want:
                        g = grads.pop(0)
                        if g is not None:
                            buf[a:b].copy_(g)
                for buf, g in zip(acc, grads):
                    if g is not None:
                        buf.add_(g)
        it = iter(acc)
        p_grads = [next(it).to(p.dtype) if n else None for p, n in zip(params, need_p)]
        return (None, dx, None, dw, None, *p_grads)


def moe_tile_tokens(block: nn.Module, x: torch.Tensor, tile_tokens: int | None) -> int:
    """The tile size for a MoE block on ``x``: ``tile_tokens``, or ~1 GiB of buffers from the width a
    token goes through (``top_k`` experts of width ``I_e``, read from the fused ``down_proj``)."""
    if tile_tokens is not None:
        return int(tile_tokens)
    router, experts = _moe_parts(block)
    H = x.shape[-1]
    down = getattr(experts, "down_proj", None)
    width = down.shape[1] + down.shape[2] - H if down is not None and down.dim() == 3 else 4 * H
    top_k = int(getattr(router, "top_k", None) or getattr(getattr(router, "base_layer", None), "top_k", 1) or 1)
    return auto_tile_tokens(top_k * int(width), H, x.element_size())


def tiled_moe_forward(block: nn.Module, x: torch.Tensor, tile_tokens: int | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's forward with the experts in token tiles (module docstring): the router runs
    once on every token (its hooks see the whole batch, its logits keep their gradient), the experts
    save only their input and routing weights. Inputs of at most ``tile_tokens`` tokens run the
    block's own forward."""
    router, experts = _moe_parts(block)
    tile = moe_tile_tokens(block, x, tile_tokens)
    if x.numel() // max(x.shape[-1], 1) <= tile:
        return _untiled(block)(x)
    flat = x.reshape(-1, x.shape[-1])
    _, weights, index = router(flat)
    if torch.is_grad_enabled():
        y = TiledExperts.apply(experts, flat, index, weights, tile, *_trainable(experts))
    else:
        y = torch.cat([experts(flat[a:b], index[a:b], weights[a:b]) for a, b in tile_bounds(flat.shape[0], tile)])
    y = y.view(x.shape)
    return (y, weights) if type(block).__name__ in _RETURNS_WEIGHTS else y


def _tiled_moe(self: nn.Module, x: torch.Tensor):
    return tiled_moe_forward(self, x, getattr(self, _TILE, None))


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj"))


def has_tiled_forward(module: nn.Module) -> bool:
    """Whether :func:`enable_tiled_mlp` bound its tiled forward on this module instance."""
    return _ORIG in module.__dict__


def replace_untiled_forward(module: nn.Module, forward: Callable | None) -> bool:
    """If :func:`enable_tiled_mlp` bound its tiled forward on ``module``, make ``forward`` (a bound
    method; ``None``: the class's) what each tile runs, keeping the tiling, and return True; else
    change nothing and return False. :func:`swiftune.patch_model` patches underneath the tiling
    this way, so patching after tiling (the trainers patch an unpatched model they are given)
    does not silently switch the tiling off."""
    if not has_tiled_forward(module):
        return False
    module.__dict__[_ORIG] = forward
    return True


# Replaced whenever a module gains or loses its tiled forward: the token under which the trainers keep
# an is_tiled answer (training.model_walks.ModelWalkIndex.answer) instead of walking the model per forward.
_tiling_token = [object()]


def tiling_token() -> object:
    """An object replaced whenever :func:`enable_tiled_mlp` or :func:`disable_tiled_mlp` changes which
    modules (of any model) are tiled: an :func:`is_tiled` answer kept under it stays true while it
    is the same object and the module tree is unchanged."""
    return _tiling_token[0]


def _bind_tiled(module: nn.Module, tile_tokens: int | None, forward: Callable = _tiled_forward) -> None:
    if not has_tiled_forward(module):
        _tiling_token[0] = object()
        module.__dict__[_ORIG] = module.__dict__.get("forward")  # None: the class forward
    setattr(module, _TILE, tile_tokens)
    module.forward = MethodType(forward, module)


def enable_tiled_mlp(model: nn.Module, tile_tokens: int | None = None, *, projections: bool = False) -> nn.Module:
    """Run every gated MLP of ``model`` (and optionally the LoRA attention projections) in tiles,
    and the experts of every mixture-of-experts block it knows (:func:`tiled_moe_forward`; another
    MoE block is refused with a ``ValueError`` naming it).

    Args:
        model: a transformers causal LM or a PEFT model wrapping one (patched or not).
        tile_tokens: tokens per tile; ``None`` picks ~1 GiB of buffers per tile from the MLP's
            sizes and the activation dtype (:func:`swiftune.memory.auto_tile_tokens`).  Inputs
            with at most ``tile_tokens`` tokens run untiled (no recompute cost).
        projections: also tile ``q_proj``/``k_proj``/``v_proj``/``o_proj`` modules that have
            trainable parameters (PEFT LoRA: apply after ``get_peft_model``); saves the float32
            input copies float32 adapters make, at the cost of recomputing those projections.

    Returns ``model``.  Calling again updates ``tile_tokens``.
    """
    if tile_tokens is not None and tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1 or None, got {tile_tokens}")
    n = 0
    for name, module in model.named_modules():
        if _is_gated_mlp(module):
            _bind_tiled(module, tile_tokens)
            n += 1
        elif _moe_parts(module) is not None:
            _bind_tiled(module, tile_tokens, _tiled_moe)
            n += 1
        elif (projections and name.rsplit(".", 1)[-1] in _PROJECTIONS
              and any(p.requires_grad for p in module.parameters())):
            _bind_tiled(module, tile_tokens)
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no gated MLP (gate_proj/up_proj/down_proj) or "
                         "mixture-of-experts block to tile")
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Restore the forwards :func:`enable_tiled_mlp` replaced."""
    for module in model.modules():
        if has_tiled_forward(module):
            _tiling_token[0] = object()
            orig = module.__dict__.pop(_ORIG)
            if orig is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = orig
            module.__dict__.pop(_TILE, None)
    return model


def is_tiled(model: nn.Module, projections: bool = False) -> bool:
    """Whether :func:`enable_tiled_mlp` is active on an MLP (or, with ``projections``, on an
    attention projection) of ``model``."""
    for name, m in model.named_modules():
        if has_tiled_forward(m):
            is_proj = name.rsplit(".", 1)[-1] in _PROJECTIONS
            if is_proj == projections:
                return True
    return False


__all__ = [
    "ForwardState",
    "replace_untiled_forward",
    "TiledApply",
    "TiledExperts",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "has_tiled_forward",
    "is_tiled",
    "mlp_tile_tokens",
    "recompute_output_unused",
    "tile_bounds",
    "tiled_apply",
    "tiled_mlp_forward",
    "tiled_moe_forward",
    "tiling_token",
]
