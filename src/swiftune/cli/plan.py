"""``swiftune plan``: the memory planner's command line (the breakdown for ``--tokens`` and the
largest context that fits the GPU).

The planner (:mod:`swiftune.memory`) is a leaf that knows nothing of the rest of swiftune; what it
needs from other layers (the attention backends' terms, this machine's GPU) is gathered here.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..memory import KNOWN_MODELS, max_tokens, plan_memory
from ..memory.planner import OPTIMIZER_STATE_BYTES
from .arguments import OneLineArgumentParser


def _bool_or_offload(text: str) -> bool | str:
    t = text.strip().lower()
    if t in ("offload", "unsloth"):
        return "offload"
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true, false or offload, got {text!r}")


_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``swiftune plan``."""
    p = OneLineArgumentParser(prog="swiftune plan", description="Predict peak GPU memory of one training step.")
    p.add_argument("--model", default="qwen3-8b",
                   help=f"a config.json path, a model folder, or one of: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step (batch x sequence)")
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--full_finetune", action="store_true")
    p.add_argument("--gpu_gb", type=float, default=None, help="GPU memory in GB (1e9 bytes); default: this GPU's, or 80")
    p.add_argument("--host_gb", type=float, default=None,
                   help="the host's memory for pinned offloaded checkpoints, GB; with --world_size each rank plans "
                        "with its share (divided among --ranks_per_host ranks, as the runtime divides the host's "
                        "free memory)")
    p.add_argument("--ranks_per_host", type=int, default=None,
                   help="processes of the job on one host, which share --host_gb (torchrun --nproc_per_node; "
                        "default: --world_size, one host)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPE_BYTES))
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES),
                   help="optimizer whose state the plan counts")
    p.add_argument("--gradient_checkpointing", type=_bool_or_offload, default=True, help="true, false or offload")
    p.add_argument("--logit_chunk_tokens", type=int, default=None)
    p.add_argument("--no_tiled_mlp", action="store_true")
    p.add_argument("--tiled_projections", action="store_true")
    p.add_argument("--lora_dtype", default="fp32", choices=sorted(_DTYPE_BYTES), help="LoRA weight dtype (PEFT: fp32)")
    p.add_argument("--full_logits", action="store_true", help="plain F.cross_entropy on full logits")
    p.add_argument("--autocast", action="store_true",
                   help="the step runs under bf16 autocast (swiftune sft / grpo with bf16): LoRA matmuls in bf16")
    p.add_argument("--lora_input_casts", action="store_true",
                   help="with --autocast: PEFT still copies each LoRA input to float32 (other trainers; "
                        "swiftune's switch that off)")
    p.add_argument("--flex_attention", action="store_true",
                   help="attention runs flex (GRPO's shared-prompt rows): K/V keep their heads, dq stays bf16")
    p.add_argument("--sdpa_attention", action="store_true",
                   help="attention runs sdpa per document (what `auto` picks on CUDA for documents of 4,096+ "
                        "tokens, without sliding windows or soft-caps): K/V keep their heads")
    p.add_argument("--lora_experts", action="store_true",
                   help="LoRA on the stacked expert weights too (--lora_target_parameters mlp.experts.gate_up_proj "
                        "mlp.experts.down_proj; gpt-oss, where all-linear reaches only the attention)")
    p.add_argument("--load_in_4bit", action="store_true",
                   help="QLoRA: the decoder's linear weights in NF4 with double quantisation (as --load_in_4bit "
                        "loads them)")
    p.add_argument("--load_in_fp8", action="store_true",
                   help="the decoder's linear weights in FP8 (e4m3, a float32 scale per row; as --load_in_fp8 "
                        "loads them)")
    p.add_argument("--image_tokens", type=int, default=0,
                   help="vision-language models: how many of --tokens are merged image tokens (Qwen3-VL: an image "
                        "of h x w patches gives h w / 4); the vision tower's activations are planned for them")
    p.add_argument("--world_size", type=int, default=1,
                   help="processes (GPUs) training together (torchrun --nproc_per_node): the plan is one rank's and "
                        "--tokens that rank's tokens")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2: weights, grads and optimizer states sharded over --world_size (default: DDP, "
                        "replicated)")
    p.add_argument("--offload_attention_output_layers", type=int, default=0,
                   help="with --gradient_checkpointing offload: the last N layers keep their sdpa attention outputs "
                        "through the recompute (as the training commands' flag of the same name)")
    p.add_argument("--offload_attention_outputs_on_host", action="store_true",
                   help="with --offload_attention_output_layers N: those outputs in pinned host memory instead")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _default_gpu_bytes() -> int:
    """This GPU's memory; without one (or without torch) an 80 GB card, the common training GPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the planner itself needs no torch
        return int(80e9)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(80e9)


def main_plan(argv: list[str] | None = None) -> int:
    """``swiftune plan``: print the breakdown for ``--tokens`` and the largest context that fits."""
    args = build_parser().parse_args(argv)
    gpu = int(args.gpu_gb * 1e9) if args.gpu_gb is not None else _default_gpu_bytes()
    host = int(args.host_gb * 1e9) if args.host_gb is not None else None
    kw = dict(
        full_finetune=args.full_finetune, dtype_bytes=_DTYPE_BYTES[args.dtype], optimizer=args.optimizer,
        gradient_checkpointing=args.gradient_checkpointing, logit_chunk_tokens=args.logit_chunk_tokens,
        host_bytes=host, tiled_mlp=not args.no_tiled_mlp, tiled_projections=args.tiled_projections,
        lora_dtype_bytes=_DTYPE_BYTES[args.lora_dtype], chunked_loss=not args.full_logits,
        autocast=args.autocast, lora_input_casts=args.lora_input_casts or not args.autocast,
        weight_quantization="nf4_double_quant" if args.load_in_4bit else ("fp8" if args.load_in_fp8 else None),
        image_tokens=args.image_tokens, world_size=args.world_size, fsdp=args.fsdp,
        ranks_per_host=args.ranks_per_host, attention_output_layers=args.offload_attention_output_layers,
        attention_outputs_on_host=args.offload_attention_outputs_on_host, lora_experts=args.lora_experts,
    )
    if args.load_in_4bit and args.load_in_fp8:
        print("swiftune plan: choose one of --load_in_4bit and --load_in_fp8", file=sys.stderr)
        return 2
    if args.flex_attention and args.sdpa_attention:
        print("swiftune plan: choose one of --flex_attention and --sdpa_attention", file=sys.stderr)
        return 2
    if args.flex_attention or args.sdpa_attention:
        from ..attention.backends import planner_attention_terms

        kw.update(planner_attention_terms("flex" if args.flex_attention else "sdpa"))
    try:
        plan = plan_memory(args.model, args.tokens, args.lora_rank, gpu_bytes=gpu, **kw)
        best = max_tokens(args.model, gpu, args.lora_rank, **kw)
    except (ValueError, TypeError, KeyError) as e:
        print(f"swiftune plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": plan.as_dict(), "max_tokens": best}, indent=2, default=str))
    else:
        print(plan.table())
        print(f"largest context that fits {gpu / 1e9:.1f} GB: {best:,} tokens")
    return 0

