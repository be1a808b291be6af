"""The benchmark workload and model shapes shared by the benchmark scripts.

Lengths follow the reference distribution of the project's shared `data/lengths.py`
(instruction-tuning rows: log-normal, median 180 tokens, sigma 0.65, clipped to
[16, max_length], seeded), restated here because the benchmarks run on machines where only
this repository travels.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import numpy as np

from swiftune.memory.shapes import KNOWN_MODELS

# The benchmarks' model shapes: swiftune's table of real architectures (what the planner reads,
# swiftune.memory.KNOWN_MODELS) plus the RoPE base and context length of each model's config (and
# what else a forward reads that the planner does not), and tiny shapes for CPU runs of the scripts.
_CONFIG_EXTRAS: dict[str, dict] = {
    "qwen3-0.6b": dict(rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-1.7b": dict(rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-8b": dict(rope_theta=1e6, max_position_embeddings=40960),
    "llama3-8b": dict(rope_theta=500000.0, max_position_embeddings=131072),
    "qwen3-30b-a3b": dict(rope_theta=1e6, max_position_embeddings=40960),
    # gpt-oss: the config's default RoPE is the released models' YaRN (factor 32 over 4,096 positions,
    # theta 150,000); its default layer_types alternate sliding (128) and full attention
    "gpt-oss-20b": dict(max_position_embeddings=131072),
    "mixtral-8x7b": dict(),  # RoPE theta and context length are in the shape table already
    # Qwen3-VL-8B (Qwen/Qwen3-VL-8B-Instruct's config.json on the Hugging Face hub): the text decoder's
    # activation, norm epsilon, 256K positions and interleaved M-RoPE ([24, 20, 20], theta 5e6), and the
    # vision tower's GELU; the vision token ids are set by benchmarks/vl.py from its tokenizer
    "qwen3-vl-8b": dict(
        text_config=dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision_config=dict(hidden_act="gelu_pytorch_tanh")),
}


def _with_extras(shape: dict, extras: dict) -> dict:
    """``shape`` with ``extras`` added; a sub-config (``text_config``, ``vision_config``) is merged
    key by key rather than replaced, so the shape table stays the one source of its sizes."""
    merged = dict(shape)
    for key, value in extras.items():
        merged[key] = {**shape[key], **value} if isinstance(value, dict) and isinstance(shape.get(key), dict) else value
    return merged


MODEL_SHAPES: dict[str, dict] = {
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 tie_word_embeddings=False, max_position_embeddings=4096),
    # a tiny Qwen3-MoE (8 experts top-2) for CPU runs of the MoE paths of the scripts
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                     tie_word_embeddings=False, max_position_embeddings=4096),
    # gpt-oss's expert layout (transposed, interleaved gate/up, biases; 8 experts top-2) at CPU size
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=512, sliding_window=16, tie_word_embeddings=False,
                         max_position_embeddings=4096),
    **{name: _with_extras(KNOWN_MODELS[name], extras) for name, extras in _CONFIG_EXTRAS.items()},
    # the same layout at CPU size (benchmarks/vl.py's smoke tests)
    "tiny-vl": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1])),
}


def reset_cuda_memory(cuda: bool | None = None, *, collect_garbage: bool = True, empty_cache: bool = True,
                      synchronize: bool = False, reset_peak: bool = False) -> None:
    """Between two measured runs: collect garbage (``collect_garbage``), then, on CUDA only
    (``cuda``; default: whether CUDA is available), hand the caching allocator's free blocks back
    (``empty_cache``), wait for the queued work (``synchronize``) and restart the peak counters
    (``reset_peak``), in that order: what is freed first is then neither cached nor in the peak."""
    import torch

    if collect_garbage:
        gc.collect()
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return
    if empty_cache:
        torch.cuda.empty_cache()
    if synchronize:
        torch.cuda.synchronize()
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()


def emulate_gpu_budget(gb: float) -> float:
    """A GPU of ``gb`` GB (1e9 bytes) emulated on the current CUDA device: caps this process's caching
    allocator with ``torch.cuda.set_per_process_memory_fraction`` and returns the fraction it set (at most
    1). The device is passed as its index: torch 2.11 refuses a ``torch.device("cuda")`` without one."""
    import torch

    index = torch.cuda.current_device()
    fraction = min(1.0, gb * 1e9 / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def sample_lengths(n: int, seed: int = 0, max_length: int = 1024) -> np.ndarray:
    """Token lengths of n instruction rows (the shared reference distribution)."""
    rng = np.random.default_rng(seed)
    lengths = np.rint(rng.lognormal(mean=np.log(180.0), sigma=0.65, size=n))
    return np.clip(lengths, 16, max_length).astype(np.int64)


def padding_fraction(lengths: np.ndarray, batch_size: int) -> float:
    """Share of pad tokens when consecutive rows are padded to the longest in their batch."""
    usable = len(lengths) - len(lengths) % batch_size
    batches = lengths[:usable].reshape(-1, batch_size)
    return float(1.0 - batches.sum() / (batches.max(axis=1).sum() * batch_size))


#: ``NAME:layers=N``: shape NAME cut to its first N decoder layers (every other size as NAME's): a repro of
#: one layer's work at full width in a fraction of the whole model's time.
_LAYERS_SUFFIX = ":layers="


def shape_of(name: str) -> dict:
    """The shape table's entry ``name`` (a copy), or for ``NAME:layers=N`` NAME's with ``N`` decoder layers
    (``num_hidden_layers`` and, where the config lists one per layer, ``layer_types`` cut to match; a
    vision-language shape's text decoder)."""
    base, _, layers = name.partition(_LAYERS_SUFFIX)
    if base not in MODEL_SHAPES:
        raise KeyError(f"unknown model shape {base!r}: one of {', '.join(MODEL_SHAPES)}")
    shape = dict(MODEL_SHAPES[base])
    if not layers:
        return shape
    n = int(layers)
    text = dict(shape["text_config"]) if "text_config" in shape else shape
    if not 1 <= n <= text["num_hidden_layers"]:
        raise ValueError(f"{name}: {base} has {text['num_hidden_layers']} decoder layers; ask for 1 to that many")
    text["num_hidden_layers"] = n
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[:n]
    if text is not shape:
        shape["text_config"] = text
    return shape


def model_config(name: str):
    """A transformers config of the named shape (bf16 training, sdpa attention by default)."""
    from transformers import AutoConfig

    shape = shape_of(name)
    return AutoConfig.for_model(shape.pop("model_type"), **shape)


def random_model(name: str, device, dtype):
    """A random-init causal LM of the named shape built on ``device`` in ``dtype`` (seed 0, sdpa; eager
    where the architecture has no sdpa path, as gpt-oss, whose sinks sdpa cannot take): the same
    weights in every benchmark and mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch.manual_seed(0)
    config = model_config(name)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    config._attn_implementation = "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def quantize_linears_4bit(model, compute_dtype) -> None:
    """QLoRA's base in memory: every linear layer of the decoder (not the LM head) replaced by a
    bitsandbytes NF4 ``Linear4bit`` with double quantisation, as ``load_in_4bit=True`` would load a
    saved checkpoint of these weights (without writing 16 GB to disk first). Layer by layer, so the
    bf16 copy of one projection at a time is what is alive next to the 4-bit ones."""
    import bitsandbytes as bnb
    from torch import nn

    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for module in list(decoder.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, q.to(device))
            del child
    model.is_loaded_in_4bit = True  # what PEFT and the Trainer read from a model loaded in 4-bit
    reset_cuda_memory(device.type == "cuda", collect_garbage=False, reset_peak=True)


def quantize_linears_fp8(model) -> None:
    """``load_in_fp8=True``'s base in memory: every linear layer of the decoder (not the LM head)
    replaced by swiftune's ``FP8Linear`` (e4m3, a float32 scale per output row), as
    ``FastModel.from_pretrained(..., load_in_fp8=True)`` would load a saved checkpoint of these
    weights; layer by layer, as there."""
    from swiftune.models.fp8_linear import quantize_model_fp8

    quantize_model_fp8(model)
    reset_cuda_memory(collect_garbage=False, reset_peak=True)


def apply_liger_like_trl(model) -> None:
    """Liger-Kernel's layer kernels (RMSNorm, RoPE, SwiGLU) on ``model``, as TRL 1.16 applies them for
    ``use_liger_kernel=True``: without Liger's fused linear cross entropy, which TRL switches off
    because its own fused LM head (``trl.trainer.utils.add_fused_lm_head``) computes the loss."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)


def host_rss() -> int:
    """This process's resident host memory in bytes (psutil, else /proc; 0 where neither works)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def random_token_rows(lengths: np.ndarray, vocab_size: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized rows of random ids with the given lengths (every token trained)."""
    rng = np.random.default_rng(seed + 1)
    return [{"input_ids": rng.integers(0, vocab_size, int(n)).tolist()} for n in lengths]


def pad_to_longest(examples: list[dict]) -> dict:
    """The padded baseline's collator: right padding to the longest row, an attention mask, labels
    -100 on padding and on position 0 (never a target once the loss shifts; keeps transformers'
    trained-token count the same across its versions)."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        att[i, : len(e["input_ids"])] = 1
    labels = ids.masked_fill(att == 0, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


def step_context_callback(step: int, open_context: Callable[[], contextlib.AbstractContextManager]):
    """A Trainer callback that runs optimizer step ``step`` (1-based) inside ``open_context()``
    (a profiler, say): entered as the step begins, exited as it ends."""
    from transformers import TrainerCallback

    class StepContext(TrainerCallback):
        stack: contextlib.ExitStack | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                self.stack = contextlib.ExitStack()
                self.stack.enter_context(open_context())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step and self.stack is not None:
                self.stack.close()
                self.stack = None

    return StepContext()


def word_tokenizer(vocab_size: int, pad_token: str = "t0"):
    """A tokenizer whose token ``i`` is the word ``t{i}`` (pad t0 unless ``pad_token`` says another, eos t1,
    unk t2): text <-> ids exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=pad_token, eos_token="t1", unk_token="t2")
