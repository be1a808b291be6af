"""The matrix-multiply FLOPs of one LoRA training step of a dense decoder on packed documents, by part, and the
time they take at a given rate: the floor a measured step is judged against (its FLOPs over its time and the
GPU's peak rate is the step's model-FLOPs utilisation).

For ``L`` layers, hidden size ``H``, query heads ``Hq`` of dimension ``d``, K/V heads ``Hk``, MLP width ``I``,
vocabulary ``V``, ``T`` tokens in all, ``T_head`` of them scored by the head, and LoRA of rank ``r`` on every
projection (each ``in x out``)::

    linear forward      2 T P,   P = L (H Hq d + 2 H Hk d + Hq d H + 3 H I)   (q, k, v, o, gate, up, down)
    adapters forward    2 T r (in + out) per projection
    head forward        2 T_head H V
    attention forward   4 d Hq L x pairs: QK^T and PV, 2d FLOPs each per (query, key) pair and head.
                        Pairs: causal within each document, n (n + 1) / 2 for n tokens, plus a shared prompt's
                        p tokens seen by every completion once (flash / sdpa kernels skip what the mask hides);
                        the whole square T^2 for transformers' eager attention (one padded-free row), which
                        multiplies every pair and masks after
    backward, frozen base weights: the input gradients only, one product per forward product (linear and head);
                        the first layer's q/k/v take no input gradient (the embeddings are frozen)
    adapters backward   both weight gradients and the input gradient: 2x their forward (less the first
                        layer's q/k/v input gradients)
    attention backward  flash: 2.5x its forward (the scores recomputed, then dP, dS K, dS^T Q, P^T dO);
                        eager: 2x (the four products, the probabilities kept)
    recompute           checkpointed layers run their forward again in the backward: the linear and adapter
                        forward again, and the attention forward again unless its outputs were kept

Counts only products: norms, RoPE, the softmax and the loss are memory-bound and left out, so the floor is a
lower bound on the step's time at the rate given. (torch's non-reentrant checkpoint stops a layer's recompute
once every saved tensor is back, so a layer's last product, down_proj's adapter B, may not run again.)
"""

from __future__ import annotations

import argparse
import json
from typing import Literal

Attention = Literal["flash", "eager"]


def _dims(config) -> dict[str, int]:
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    return dict(hidden=hidden, heads=heads, kv_heads=get("num_key_value_heads") or heads,
                head_dim=get("head_dim") or hidden // heads, inter=get("intermediate_size"),
                layers=get("num_hidden_layers"), vocab=get("vocab_size"))


def projections(config) -> list[tuple[int, int]]:
    """``(in, out)`` of one decoder layer's seven projections: q, k, v, o, gate, up, down."""
    c = _dims(config)
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, c["inter"]), (h, c["inter"]), (c["inter"], h)]


def attention_pairs(documents: list[int], shared_prompt: int = 0, attention: Attention = "flash") -> int:
    """(query, key) pairs a layer's attention multiplies per head: causal pairs within each document (and each
    document's pairs with a prompt of ``shared_prompt`` tokens placed once before them), or for ``"eager"`` the
    whole square of the row."""
    if attention == "eager":
        return (shared_prompt + sum(documents)) ** 2
    causal = lambda n: n * (n + 1) // 2  # noqa: E731
    return causal(shared_prompt) + sum(causal(n) + n * shared_prompt for n in documents)


def step_flops(config, documents: list[int], *, shared_prompt: int = 0, head_tokens: int | None = None,
               lora_rank: int = 16, attention: Attention = "flash", recompute: bool = True,
               kept_attention: bool = False) -> dict[str, int]:
    """The matrix-multiply FLOPs of one forward and backward (module docstring), by part: ``documents`` are
    the packed row's documents (a GRPO group's completions after ``shared_prompt``), ``head_tokens`` the tokens
    whose log-probabilities are scored (default: every token), ``recompute`` whether each layer runs its forward
    again in the backward (checkpointing), ``kept_attention`` whether that recompute skips the attention (its
    outputs kept, ``offload_attention_output_layers``)."""
    c = _dims(config)
    tokens = shared_prompt + sum(documents)
    head_tokens = tokens if head_tokens is None else head_tokens
    projs = projections(config)
    weights = sum(i * o for i, o in projs)
    adapter = sum(i + o for i, o in projs) * lora_rank
    first_qkv = sum(i * o for i, o in projs[:3])
    first_qkv_adapter = sum(i for i, _ in projs[:3]) * lora_rank  # the adapters' A input gradients
    layers = c["layers"]
    attention_forward = 4 * c["head_dim"] * c["heads"] * layers * attention_pairs(documents, shared_prompt, attention)
    parts = {
        "linear_forward": 2 * tokens * weights * layers,
        "adapters_forward": 2 * tokens * adapter * layers,
        "head_forward": 2 * head_tokens * c["hidden"] * c["vocab"],
        "attention_forward": attention_forward,
        "linear_backward": 2 * tokens * (weights * layers - first_qkv),
        "adapters_backward": 2 * tokens * (2 * adapter * layers - first_qkv_adapter),
        "head_backward": 2 * head_tokens * c["hidden"] * c["vocab"],
        "attention_backward": attention_forward * (5 if attention == "flash" else 4) // 2,
        "recompute": (2 * tokens * (weights + adapter) * layers
                      + (0 if kept_attention else attention_forward)) if recompute else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> int:
    from benchmarks.workload import shape_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="a shape of benchmarks.workload (dense)")
    p.add_argument("--documents", type=int, nargs="+", default=[65536, 65536], help="tokens of each document")
    p.add_argument("--shared-prompt", type=int, default=256, help="a prompt every document follows, placed once")
    p.add_argument("--head-tokens", type=int, default=None, help="tokens the head scores (default: all)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--attention", choices=["flash", "eager"], default="flash")
    p.add_argument("--no-recompute", action="store_true", help="no checkpointing: no forward again in the backward")
    p.add_argument("--kept-attention", action="store_true", help="the recompute skips the attention")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 rate (H100/H200 SXM: 989)")
    p.add_argument("--step-s", type=float, nargs="*", default=[], help="measured step times: their utilisation")
    args = p.parse_args(argv)
    parts = step_flops(shape_of(args.model), args.documents, shared_prompt=args.shared_prompt,
                       head_tokens=args.head_tokens, lora_rank=args.lora_rank, attention=args.attention,
                       recompute=not args.no_recompute, kept_attention=args.kept_attention)
    rate = args.peak_tflops * 1e12
    for name, flops in parts.items():
        print(f"{name:20s} {flops / 1e15:9.3f} PFLOP  {flops / rate:8.2f} s at {args.peak_tflops:g} TFLOP/s")
    for s in args.step_s:
        print(f"a {s:g} s step: {parts['total'] / s / 1e12:.0f} TFLOP/s, {parts['total'] / s / rate:.1%} of the peak")
    print(json.dumps({"model": args.model, "documents": args.documents, "shared_prompt": args.shared_prompt,
                      "attention": args.attention, **parts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
