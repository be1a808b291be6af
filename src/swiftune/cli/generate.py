"""``swiftune generate``: sample from a model through a rollout engine, for quick checks.

    swiftune generate --model PATH --prompt "Reverse: abc" --num_generations 4 --engine fast
    swiftune generate --prompt "Reverse: abc"        # the built-in tiny model (random weights)

Prints each completion with its length, whether it stopped, its mean sampling log-probability
and the engine's tokens/s; ``--json`` prints one JSON object per completion instead.
"""

from __future__ import annotations

import argparse
import json
import time

from ..errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The options of ``swiftune generate``."""
    p = argparse.ArgumentParser(prog="swiftune generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local path or hub name (default: the built-in tiny model)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--num_generations", type=int, default=1, help="completions per prompt (G)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--min_p", type=float, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (fast engine; repeatable)")
    p.add_argument("--engine", choices=("transformers", "fast"), default="transformers")
    p.add_argument("--no_fused_layers", dest="fused_layers", action="store_false",
                   help="fast engine: run each layer's own forward instead of the engine's fused layer loop "
                        "(which needs a patched model: the built-in one is patched for it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")
    return p


def main_generate(argv: list[str] | None = None) -> int:
    """``swiftune generate``: sample the prompts and print each completion (see the module docstring).
    Options that need the fast engine without ``--engine fast`` raise :class:`ConfigError`."""
    import torch

    from ..data import build_tokenizer, tiny_model_config
    from ..rl.rollout import SamplingParams, TransformersRolloutEngine
    from ..training import FastModel

    args = build_parser().parse_args(argv)
    if args.engine != "fast" and (args.stop or not args.fused_layers):
        # checked before the model loads: only the fast engine matches stop strings and has a fused loop
        raise ConfigError("--stop strings and --no_fused_layers need --engine fast; add --engine fast or drop them")
    if args.model is None:
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
        model, tokenizer = FastModel.from_pretrained(args.model, dtype=args.dtype)
    model.eval()
    prompts = args.prompt or ["Reverse: abc\n"]
    if args.chat:
        prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=True) for p in prompts]
        prompt_ids = [ids["input_ids"] if isinstance(ids, dict) else list(ids) for ids in prompt_ids]
    else:
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    stop_ids = sorted({i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                       if isinstance(i, int) and i != tokenizer.unk_token_id})
    greedy = args.temperature <= 0
    # temperature 0 means greedy: top_k=1 picks the most likely token; a positive temperature keeps
    # the sampling log-probabilities finite
    params_kw = dict(max_tokens=args.max_tokens, temperature=1.0 if greedy else args.temperature,
                     top_p=args.top_p, top_k=1 if greedy else args.top_k, min_p=args.min_p, stop_token_ids=stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    if args.engine == "fast":
        from ..rl.rollout import FastRolloutEngine, FastSamplingParams

        engine = FastRolloutEngine(model, pad_token_id=pad, seed=args.seed, tokenizer=tokenizer,
                                   fused_layers=args.fused_layers)
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
