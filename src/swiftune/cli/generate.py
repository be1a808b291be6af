"""``swiftune generate``: sample from a model through a rollout engine, for quick checks.

    swiftune generate --model PATH --prompt "Reverse: abc" --num_generations 4 --engine fast
    swiftune generate --prompt "Reverse: abc"        # the built-in tiny model (random weights)
    swiftune generate --model PATH --temperature 0 --repetition_penalty 1.2   # greedy, repeats discouraged
    swiftune generate --model ADAPTER_DIR            # a LoRA adapter folder on the base it records
    swiftune generate --model BASE --adapter ADAPTER_DIR

A LoRA run of ``swiftune sft`` / ``swiftune grpo`` writes a PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``). Given as ``--model``, its base model
(``base_model_name_or_path`` in ``adapter_config.json``, or ``--base_model PATH`` when that one is
not available here) loads first, then PEFT's ``PeftModel.from_pretrained`` applies the adapter;
``--adapter`` names the adapter folder explicitly and ``--model`` the base. An adapter that does
not fit the base (target modules the base lacks, other shapes, tensors with no place in it) is
refused instead of generating from a half-applied adapter.

Prints each completion with its length, whether it stopped, its mean sampling log-probability
and the engine's tokens/s; ``--json`` prints one JSON object per completion instead.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ..errors import ConfigError
from .arguments import OneLineArgumentParser

ADAPTER_CONFIG = "adapter_config.json"  # training.loading's name, kept here so that the command imports no torch
# the adapter weights PEFT writes (safetensors by default, a torch pickle with safe_serialization=False)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``swiftune generate``."""
    p = OneLineArgumentParser(prog="swiftune generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    # --model_name_or_path: the training commands' name for it; --max_new_tokens: transformers' generate's
    p.add_argument("--model", "--model_name_or_path", dest="model", default=None,
                   help="local path or hub name of a model, or a PEFT adapter folder (its base loads first); "
                        "with --adapter: the base model (default: the built-in tiny model)")
    p.add_argument("--adapter", default=None,
                   help="a PEFT adapter folder (what a LoRA run of swiftune sft/grpo writes) to apply on --model "
                        "(default base: the one recorded in its adapter_config.json)")
    p.add_argument("--base_model", default=None,
                   help="the base model of the adapter folder, when the one recorded in its adapter_config.json "
                        "is not available here")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--num_generations", type=int, default=1, help="completions per prompt (G)")
    p.add_argument("--max_tokens", "--max_new_tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--min_p", type=float, default=None)
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="transformers' repetition penalty over the prompt and the completion so far, applied "
                        "before temperature / top-k / top-p / min-p: > 0, 1.0 off, e.g. 1.1 discourages repeats")
    p.add_argument("--stop", action="append", default=[], help="a stop string (fast engine; repeatable)")
    p.add_argument("--engine", choices=("transformers", "fast"), default="transformers")
    p.add_argument("--no_fused_layers", dest="fused_layers", action="store_false",
                   help="fast engine: run each layer's own forward instead of the engine's fused layer loop "
                        "(which needs a patched model: the built-in one is patched for it)")
    p.add_argument("--kv_cache_dtype", "--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fast engine: the KV cache in the model's dtype (auto) or as e4m3 codes with a float32 "
                        "scale per slot and head (fp8, about half the bytes; docs/fp8.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")
    return p


def main_generate(argv: list[str] | None = None) -> int:
    """``swiftune generate``: sample the prompts and print each completion (see the module docstring).
    Options that need the fast engine without ``--engine fast`` raise :class:`ConfigError`."""
    import torch

    from ..data import build_tokenizer, text_tokenizer_of, tiny_model_config
    from ..rl.batching import generation_stop_ids, prompt_token_ids
    from ..rl.rollout import SamplingParams, TransformersRolloutEngine
    from ..rl.rollout.protocol import check_num_generations, check_sampling_values

    args = build_parser().parse_args(argv)
    try:  # the rules SamplingParams and the engines apply, said before the model loads
        check_sampling_values(args.max_tokens, args.temperature, args.top_p, args.top_k, args.min_p,
                              args.repetition_penalty)
        check_num_generations(args.num_generations)
    except ValueError as e:
        raise ConfigError(f"--{e}") from e
    base, adapter = model_and_adapter(args.model, args.adapter, args.base_model)
    if args.engine != "fast" and (args.stop or not args.fused_layers or args.kv_cache_dtype != "auto"):
        # checked before the model loads: only the fast engine matches stop strings, has a fused loop and an
        # FP8 cache
        raise ConfigError("--stop strings, --no_fused_layers and --kv_cache_dtype fp8 need --engine fast; add "
                          "--engine fast or drop them")
    if base is None and adapter is None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(args.seed)
        tokenizer = build_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
        if torch.cuda.is_available():
            model = model.to("cuda")
        if args.engine == "fast" and args.fused_layers:  # the fused loop runs on patched models
            # (FastModel.from_pretrained patches; the transformers engine keeps the plain model)
            from ..models import patch_model

            patch_model(model)
    else:
        model, tokenizer = load_model(base, adapter, args.dtype)
    model.eval()
    # a vision-language model's processor: its tokenizer reads and writes the text prompts and completions
    tokenizer = text_tokenizer_of(tokenizer)
    prompts = args.prompt or ["Reverse: abc\n"]
    # as GRPO tokenizes and stops its prompts: a chat prompt through the chat template, stopping at the end
    # of turn too; a plain one as it is, stopping at the end of sequence only
    rows = [[{"role": "user", "content": p}] for p in prompts] if args.chat else prompts
    prompt_ids = [prompt_token_ids(tokenizer, row) for row in rows]
    stop_ids = generation_stop_ids(tokenizer, model, conversational=args.chat)
    # temperature 0 is greedy: the engines take the argmax and record log-probs at temperature 1
    params_kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                     min_p=args.min_p, stop_token_ids=stop_ids, repetition_penalty=args.repetition_penalty)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    if args.engine == "fast":
        from ..rl.rollout import FastRolloutEngine, FastSamplingParams
        from ..rl.rollout.fast import SUPPORTED

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in SUPPORTED:  # Qwen3-VL's prompts need its vision tower (GRPO's own engine runs it)
            raise ConfigError(f"--engine fast runs {', '.join(SUPPORTED)}, not {model_type!r}: use --engine "
                              "transformers")
        engine = FastRolloutEngine(model, pad_token_id=pad, seed=args.seed, tokenizer=tokenizer,
                                   fused_layers=args.fused_layers, kv_cache_dtype=args.kv_cache_dtype)
        params = FastSamplingParams(stop=tuple(args.stop), **params_kw)
    else:
        engine = TransformersRolloutEngine(model, pad_token_id=pad, seed=args.seed)
        params = SamplingParams(**params_kw)
    start = time.perf_counter()
    out = engine.generate(prompt_ids, args.num_generations, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c) for c in out.completion_ids)
    for i, (ids, lp, fin) in enumerate(zip(out.completion_ids, out.logprobs, out.finished)):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        row = dict(prompt=prompts[i // args.num_generations], completion=text, tokens=len(ids), stopped=bool(fin),
                   mean_logprob=float(lp.mean()) if len(lp) else 0.0)
        if args.json:
            print(json.dumps(row))
        else:
            print(f"[{i}] ({row['tokens']} tokens, {'stopped' if fin else 'cut'}, mean logp "
                  f"{row['mean_logprob']:.3f}) {prompts[i // args.num_generations]!r} -> {text!r}")
    if not args.json:
        print(f"{args.engine} engine: {tokens} tokens in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9):.0f} tok/s)")
    return 0


# ----------------------------------------------------------------------------- adapter folders


def is_adapter_folder(path: str | None) -> bool:
    """Whether ``path`` is a local folder holding a PEFT ``adapter_config.json``."""
    return bool(path) and os.path.isfile(os.path.join(os.path.expanduser(path), ADAPTER_CONFIG))


def model_and_adapter(model: str | None, adapter: str | None, base_model: str | None) -> tuple[str | None, str | None]:
    """``(base, adapter_folder)`` from ``--model``, ``--adapter`` and ``--base_model``, checked
    before anything loads (:class:`ConfigError` naming the option to change).

    ``--model ADAPTER_DIR`` means that adapter on its base: ``--base_model`` when given, else the
    one recorded in ``adapter_config.json``. ``--adapter`` names the adapter folder and ``--model``
    (or ``--base_model``, or the recorded one) its base. Without an adapter ``base`` is ``--model``
    (``None``: the built-in tiny model) and ``adapter_folder`` is ``None``."""
    from ..local_paths import resolve_local_path

    try:
        model = resolve_local_path(model, "--model") if model else model
        base_model = resolve_local_path(base_model, "--base_model") if base_model else base_model
        adapter = resolve_local_path(adapter, "--adapter") if adapter else adapter
    except FileNotFoundError as e:  # a mistyped local path: the option to fix, not a Hub lookup
        raise ConfigError(str(e)) from e
    if adapter is not None:
        if not os.path.isdir(adapter):
            raise ConfigError(f"--adapter {adapter!r}: not a folder; give the adapter folder a LoRA run wrote "
                              f"(it holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS[0]})")
        if not is_adapter_folder(adapter):
            raise ConfigError(f"--adapter {adapter!r} is not a PEFT adapter folder (no {ADAPTER_CONFIG}); "
                              "a full model folder goes to --model alone")
        if is_adapter_folder(model):
            raise ConfigError(f"--model {model!r} is an adapter folder too; with --adapter, --model names the "
                              "base model")
        if model is not None and base_model is not None:
            raise ConfigError("--model and --base_model both name the base of --adapter; give one of them")
        return model if model is not None else base_model, adapter
    if is_adapter_folder(model):
        return base_model, model
    if base_model is not None:
        raise ConfigError("--base_model is the base of an adapter folder; give the adapter as --model or "
                          "--adapter, or drop --base_model and load the model as --model")
    return model, None


def checked_adapter_config(adapter: str) -> dict[str, Any]:
    """The adapter folder's ``adapter_config.json`` (:func:`~swiftune.training.loading.read_adapter_config`),
    checked to be PEFT's and to have its weights file beside it (:class:`ConfigError` when the folder is
    incomplete or the file is not PEFT's)."""
    from ..training.loading import read_adapter_config

    config = read_adapter_config(adapter)
    if not config.get("peft_type"):
        raise ConfigError(f"adapter folder {adapter}: {ADAPTER_CONFIG} has no peft_type, so it is not a PEFT "
                          "adapter config; give the folder a LoRA run wrote")
    if not any(os.path.isfile(os.path.join(adapter, name)) for name in ADAPTER_WEIGHTS):
        raise ConfigError(f"adapter folder {adapter} is incomplete: {ADAPTER_CONFIG} but no "
                          f"{' or '.join(ADAPTER_WEIGHTS)}; copy the whole folder the training run wrote")
    return config


def recorded_base(adapter: str, config: dict[str, Any]) -> str:
    """The base model an adapter records (``base_model_name_or_path``), when it can be loaded from
    here: an existing local path or a Hub id; else :class:`ConfigError` saying to pass ``--base_model``."""
    from ..local_paths import looks_local

    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"adapter folder {adapter} records no base model (base_model_name_or_path is empty in "
                          f"its {ADAPTER_CONFIG}; an adapter of the built-in tiny model has none): pass "
                          "--base_model PATH, the model it was trained on")
    if not os.path.exists(os.path.expanduser(base)) and looks_local(base):
        raise ConfigError(f"adapter folder {adapter} records base model {base!r}, which is not here: pass "
                          "--base_model PATH, the model it was trained on")
    return base


def load_model(base: str | None, adapter: str | None, dtype: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for :func:`model_and_adapter`'s ``(base, adapter_folder)``:
    ``FastModel.from_pretrained`` of the base (with an adapter and no base: the one the adapter
    records), then the adapter through PEFT's ``PeftModel.from_pretrained``, checked to fit the
    base (:func:`check_adapter_targets`, :func:`check_adapter_loaded`)."""
    from ..training import FastModel

    if adapter is None:
        return FastModel.from_pretrained(base, dtype=dtype)
    config = checked_adapter_config(adapter)
    if base is None:
        base = recorded_base(adapter, config)
        try:
            model, tokenizer = FastModel.from_pretrained(base, dtype=dtype)
        except OSError as e:  # a recorded Hub id that is neither cached here nor reachable
            raise ConfigError(f"adapter folder {adapter} records base model {base!r}, which could not be loaded "
                              f"({' '.join(str(e).split())[:200]}): pass --base_model PATH, the model it was "
                              "trained on") from e
    else:
        model, tokenizer = FastModel.from_pretrained(base, dtype=dtype)
    check_adapter_targets(model, config, adapter, base)
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(model, adapter)
    except RuntimeError as e:  # load_state_dict: "size mismatch for ...": another model's shapes
        if "size mismatch" not in str(e):
            raise
        raise ConfigError(f"adapter folder {adapter} does not fit base model {base!r} (other shapes: "
                          f"{' '.join(str(e).split())[:300]}); pass the model it was trained on as "
                          "--base_model (or --model with --adapter)") from e
    check_adapter_loaded(model, adapter, base)
    return model, tokenizer


def check_adapter_targets(model: Any, config: dict[str, Any], adapter: str, base: str) -> None:
    """Refuse an adapter whose listed target modules name no module of the base (an adapter of
    another architecture): PEFT would add fresh, untrained layers for the names it finds and drop
    the rest. A regular-expression ``target_modules`` (a string) is left to :func:`check_adapter_loaded`."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return
    names = [name for name, _ in model.named_modules()]
    missing = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in names))
    if missing:
        raise ConfigError(f"adapter folder {adapter} targets modules the base model {base!r} does not have "
                          f"({', '.join(missing)}): it was trained on another model; pass that one as "
                          "--base_model (or --model with --adapter)")


def check_adapter_loaded(model: Any, adapter: str, base: str) -> None:
    """Refuse an adapter whose saved tensors did not all find a place in the base (PEFT loads the
    rest and warns): e.g. an adapter of a deeper model of the same family."""
    from peft import get_peft_model_state_dict

    saved = set(saved_adapter_keys(adapter))
    # the adapter tensors as PEFT saves them (save_embedding_layers=False: "auto" would ask the Hub
    # about the base's vocabulary), and every model tensor, for saved embedding / modules_to_save weights
    placed = set(get_peft_model_state_dict(model, save_embedding_layers=False))
    for name in model.state_dict():
        placed.update((name, name.replace(".base_layer.", ".")))
    dropped = sorted(saved - placed)
    if dropped:
        raise ConfigError(f"adapter folder {adapter} does not fit base model {base!r}: {len(dropped)} of its "
                          f"{len(saved)} tensors have no place in it (e.g. {dropped[0]}); pass the model it was "
                          "trained on as --base_model (or --model with --adapter)")


def saved_adapter_keys(adapter: str) -> list[str]:
    """The tensor names in the adapter folder's weights file (read without loading the tensors
    from a safetensors file)."""
    safetensors_path = os.path.join(adapter, ADAPTER_WEIGHTS[0])
    if os.path.isfile(safetensors_path):
        from safetensors import safe_open

        with safe_open(safetensors_path, framework="pt") as f:
            return list(f.keys())
    import torch

    return list(torch.load(os.path.join(adapter, ADAPTER_WEIGHTS[1]), map_location="cpu", weights_only=True))
