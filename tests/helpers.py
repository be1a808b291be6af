"""Shared test helpers."""

import torch
import transformers
from transformers import TrainerCallback

from swiftune.data.builtin import tiny_model_config


class KillAt(TrainerCallback):
    """Stops training at the end of ``step`` as a killed process would (after that step's checkpoint)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("simulated kill")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative norm error in float64; NaN/inf anywhere yields inf, so it never passes."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().clamp_min(1e-30)
    return float((a - e).norm() / denom)


WINDOW = 8
VOCAB = 300

# Tiny sizes (the kernels run through the Triton interpreter): hidden 64, 2 layers, 4 q heads and
# 2 kv heads of 16. Gemma 2 gets a small attention soft-cap so that tanh actually bends the scores.
_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_EXTRAS = {
    "gemma": dict(),
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=1.0, final_logit_softcapping=5.0),
    "gemma3": dict(query_pre_attn_scalar=16),
}
SLIDING_LAYERS = ["sliding_attention", "full_attention"]


def tiny_model(family: str, window: bool = False, seed: int = 0, **sizes) -> transformers.PreTrainedModel:
    """Random fp32 model with transformers' eager attention (the ground truth); ``sizes`` override
    the tiny sizes (e.g. one layer of a real model's shape)."""
    extra = dict(_SIZES, **_EXTRAS.get(family, {}))
    extra.update(sizes)
    if family in ("gemma2", "gemma3"):
        extra.update(sliding_window=WINDOW if window else 4096, layer_types=SLIDING_LAYERS)
    elif family == "mistral":
        extra.update(sliding_window=WINDOW if window else None)
    elif family in ("qwen2", "qwen3") and window:
        extra.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, layer_types=SLIDING_LAYERS)
    config = tiny_model_config(family, vocab_size=VOCAB, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def assert_gradients_match(ref_grads: dict, grads: dict, trainable: list[str], tol: float | dict[str, float]) -> None:
    """Every tensor with a reference gradient has one here, within ``tol`` (one bound, or one per
    tensor name) by relative norm, and a non-zero one wherever the reference's is non-zero; no
    gradient outside ``trainable``."""
    assert ref_grads, "the reference has no gradient at all"
    missing = sorted(set(ref_grads) - set(grads))
    assert not missing, f"no gradient where the unpatched model has one: {missing}"
    assert set(grads) <= set(trainable)
    bound = tol if isinstance(tol, dict) else dict.fromkeys(ref_grads, tol)
    errors = {name: rel_err(grads[name], g) / bound[name] for name, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1, f"{worst}: relative error {errors[worst] * bound[worst]:.2e} (allowed {bound[worst]:.2e})"
    for name, g in ref_grads.items():
        if g.abs().max() > 0:
            assert grads[name].abs().max() > 0, f"{name}: zero gradient, the reference's is not"


def builtin_qwen3(lora: bool, lora_seed: int = 1, r: int = 8, **config) -> torch.nn.Module:
    """The built-in tokenizer's tiny Qwen3, the same random base weights every time (they play the
    pretrained weights); LoRA (alpha = 2r) from ``lora_seed``, with B drawn too (PEFT starts it at
    zero) so that the gradients of A are not all zero. ``config``: config fields changed (tiny_model_config)."""
    from swiftune.training import FastModel

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("qwen3", **config), dtype=torch.float32)
    if lora:
        torch.manual_seed(lora_seed)
        model = FastModel.get_peft_model(model, r=r, lora_alpha=2 * r, use_gradient_checkpointing=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def train_adapters_two_sft_steps(model: torch.nn.Module, tokenizer, output_dir: str) -> None:
    """Two SFTTrainer steps of a LoRA model on four prompt/completion rows (CPU): the losses are
    finite and some adapter tensor moved (a quantised base's own checks are the caller's)."""
    import swiftune

    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rows = [{"prompt": f"Reverse: {w}\n", "completion": w[::-1]} for w in ("abc", "garden", "river", "stone")]
    args = swiftune.SFTConfig(output_dir=output_dir, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                              logging_steps=1, save_strategy="no", report_to="none", use_cpu=True)
    trainer = swiftune.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "the adapters trained"


def save_tiny_checkpoints(tmp_path_factory, families: tuple[str, ...] = ("llama", "qwen3")) -> dict[str, str]:
    """``family -> folder`` of a saved tiny model and the built-in tokenizer (for the loading paths)."""
    from swiftune.data import build_tokenizer

    out = {}
    for family in families:
        path = tmp_path_factory.mktemp(family)
        tiny_model(family).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        out[family] = str(path)
    return out


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA parameters of a PEFT model by name."""
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def copy_lora_tensors(source: torch.nn.Module, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Give ``target`` the LoRA parameters of ``source`` (the same names, at least one), so that both sides of a
    parity test train the same adapters; returns ``target``'s LoRA parameters."""
    want, got = lora_tensors(source), lora_tensors(target)
    assert got.keys() == want.keys() and got
    with torch.no_grad():
        for name, p in got.items():
            p.copy_(want[name])
    return got


def count_launches(monkeypatch, module, name: str) -> list:
    """Replace the Triton kernel ``module.<name>`` with one that records each launch's grid, then launches the
    real kernel; returns the list of grids (one per launch)."""
    kernel, grids = getattr(module, name), []

    class Counted:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Counted())
    return grids


class CudaAutocastFloat32Ops(torch.overrides.TorchFunctionMode):
    """CUDA autocast's float32 policy for the reductions and pointwise ops below, wherever autocast is on for the CPU:
    their bf16 / fp16 inputs cast to float32 and a float32 result (an explicit ``dtype=`` kept). The CPU's own
    autocast leaves them in the input's dtype, so without this a CPU run cannot show a patched forward that relies
    on one of them keeping bf16 (the experts' combine once returned float32 under CUDA's autocast)."""

    FUNCS = frozenset({
        torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.prod, torch.Tensor.prod,
        torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
        torch.Tensor.log_softmax, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.pow,
        torch.Tensor.pow, torch.Tensor.__pow__, torch.rsqrt, torch.Tensor.rsqrt, torch.reciprocal,
        torch.Tensor.reciprocal, torch.nn.functional.layer_norm,
    })

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCS and torch.is_autocast_enabled("cpu") and kwargs.get("dtype") is None:
            def widen(t):
                return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t
            args = tuple(widen(a) for a in args)
        return func(*args, **kwargs)


def record_layer_dtypes(layers) -> list[torch.dtype]:
    """A list that every forward of each of ``layers`` (decoder layers) appends its output hidden states' dtype to."""
    dtypes: list[torch.dtype] = []
    for layer in layers:
        layer.register_forward_hook(lambda m, a, out: dtypes.append((out[0] if isinstance(out, tuple) else out).dtype))
    return dtypes
