"""Gradient parity: swiftune's training forward against the *unpatched* transformers (+ PEFT) model.

The reference is always the plain library: transformers' eager model (PEFT LoRA on top where
the case trains adapters), run on each document alone, with the next-token cross entropy summed
over each document's trained labels and divided by the batch's trained-token count. Never another
swiftune path.

The swiftune side is what a user runs: ``patch_model`` with its defaults (the Triton kernels,
through the interpreter on CPU; packed attention), ``FastModel.for_training`` /
``FastModel.get_peft_model`` for full fine-tuning / LoRA on all seven projections, swiftune's
own collators for padded, padding-free and packed batches, gradient checkpointing off, on,
``"offload"`` (every layer input on the host) and the tiled MLP, and the fused chunked loss of
``SFTTrainer`` (``sft_loss``). The tiled-MLP cases arrange the same documents so that the last tile
of the batch's tokens holds a scored token in every layout (see ``TILE_TOKENS``).

For each case: the loss and **every trainable tensor's gradient** within fp32 tolerance (relative
norm < 1e-5) of the reference, the same set of tensors with a gradient, and each of them non-zero
wherever the reference's is.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from swiftune.data import make_collator
from swiftune.models import causal_lm_of, patch_model
from swiftune.training import FastModel
from swiftune.models.tiled_mlp import enable_tiled_mlp, tile_bounds
from swiftune.sft.trainer import sft_loss
from tests.helpers import (VOCAB, CudaAutocastFloat32Ops, assert_gradients_match, record_layer_dtypes, rel_err,
                           tiny_model)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
# families with sliding-window layers get windows shorter than the longest document
WINDOWED = {"mistral", "qwen2", "gemma2", "gemma3"}
LAYOUTS = ("padded", "padding_free", "packed")
CHECKPOINTING = ("off", "on", "offload", "tiled_mlp")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD_ID = VOCAB - 1
TOL = 1e-5
# The tiled MLP runs over the batch's flattened tokens (rows x width, padding included) in tiles of
# TILE_TOKENS. With the documents in _examples' order the padded and packed batches end in padding,
# so their last tile held no token the loss sees and a bug in the last tile went unnoticed. The
# tiled cases therefore put the longest document last (a padded batch's last row has no padding) and
# pack rows of at most TILED_MAX_LENGTH tokens ([10, 6] and [7, 4, 3] + 2 padding, in place of
# [10, 7, 6] and [4, 3] + 16 padding). Last tile: padded 50 tokens -> [48, 50), padding-free 30 ->
# [28, 30) (both partial, the 10-token document's last two tokens), packed 32 -> [28, 32) (the
# 3-token document's last two tokens, then padding); tiles such as [8, 12) straddle two documents.
# _swiftune_step asserts that the last tile holds a scored token.
TILE_TOKENS = 4
MAX_LENGTH = 24
TILED_MAX_LENGTH = 16


def _examples(seed: int = 0, tiled: bool = False) -> list[dict]:
    """Five documents of 3..10 tokens (the longest beyond the sliding window of 8); the first third
    of each is an untrained prompt, except the 4-token one, trained from its first token (which has
    nothing before it to be predicted from: in a packed row its label must still be masked).
    ``tiled``: the same documents with the 10-token one moved last (see ``TILE_TOKENS``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (10, 4, 7, 3, 6):
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        prompt = 0 if n == 4 else max(1, n // 3)
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (n - prompt)})
    return out[1:] + out[:1] if tiled else out


def _trained_labels(example: dict) -> torch.Tensor:
    ids = torch.tensor(example["input_ids"])
    mask = torch.tensor(example["completion_mask"], dtype=torch.bool)
    return torch.where(mask, ids, torch.full_like(ids, -100))


def _reference_step(model: torch.nn.Module, examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Unpatched model, one document at a time: sum of next-token CE / trained tokens."""
    model.zero_grad(set_to_none=True)
    labels = [_trained_labels(e) for e in examples]
    # the first token of a document predicts nothing from before it: never trained
    count = sum(int((lab[1:] != -100).sum()) for lab in labels)
    device = next(model.parameters()).device
    total = 0.0
    for example, lab in zip(examples, labels):
        logits = model(input_ids=torch.tensor([example["input_ids"]], device=device), use_cache=False).logits[0]
        total = total + torch.nn.functional.cross_entropy(
            logits[:-1].double(), lab[1:].to(device), ignore_index=-100, reduction="sum"
        )
    loss = total / count
    loss.backward()
    return loss.detach(), _grads(model)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _trainable(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _scored(batch: dict) -> torch.Tensor:
    """Per token of the batch, rows flattened: whether its output is scored (the next token of its
    document is trained)."""
    labels = batch["labels"]
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]
    if "position_ids" in batch:  # a document's first token is predicted from nothing
        target[:, :-1][batch["position_ids"][:, 1:] == 0] = -100
    return (target != -100).reshape(-1)


def _last_tile(batch: dict) -> tuple[int, int, bool]:
    """The tiled MLP's last tile ``[a, b)`` over the batch's flattened tokens, and whether it holds a scored token."""
    scored = _scored(batch)
    a, b = tile_bounds(scored.numel(), TILE_TOKENS)[-1]
    return a, b, bool(scored[a:b].any())


def _swiftune_step(model: torch.nn.Module, examples: list[dict], layout: str,
                   tiled: bool = False) -> tuple[torch.Tensor, dict]:
    collate = make_collator(layout, max_length=TILED_MAX_LENGTH if tiled else MAX_LENGTH, pad_token_id=PAD_ID)
    batch = collate(examples)
    count = batch["num_trained_tokens"]
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    if layout == "packed":
        assert batch["input_ids"].shape[0] > 1, "the packed case must have several rows"
    if tiled:  # a bug in the last tile must reach the loss
        a, b, scored = _last_tile(batch)
        assert scored, f"{layout}: the tiled MLP's last tile [{a}, {b}) is not scored"
    model.zero_grad(set_to_none=True)
    loss, _ = sft_loss(model, inputs, batch["labels"].to(device), num_items_in_batch=count)
    loss.backward()
    return loss.detach(), _grads(model)


def _documents(batch: dict) -> torch.Tensor:
    """Per token of the batch, rows flattened: its document's number, -1 for padding."""
    rows, width = batch["input_ids"].shape
    if "attention_mask" in batch:  # padded: one document a row
        doc = torch.arange(rows).unsqueeze(1).expand(rows, width).clone()
        doc[batch["attention_mask"] == 0] = -1
        return doc.reshape(-1)
    doc = (batch["position_ids"] == 0).reshape(-1).cumsum(0) - 1
    real = torch.arange(width).unsqueeze(0) < batch["row_tokens"].unsqueeze(1)
    return torch.where(real.reshape(-1), doc, torch.full_like(doc, -1))


def test_tiled_cases_reach_the_last_tile():
    """The tiled cases' batches (no model): in every layout the last tile holds a scored token; where
    a row holds several documents (padding-free, packed) a tile holds real tokens of two of them; at
    least one layout ends in a partial tile."""
    partial = []
    for layout in LAYOUTS:
        batch = make_collator(layout, max_length=TILED_MAX_LENGTH, pad_token_id=PAD_ID)(_examples(tiled=True))
        a, b, scored = _last_tile(batch)
        assert scored, (layout, a, b)
        doc = _documents(batch)
        tiles = tile_bounds(doc.numel(), TILE_TOKENS)
        if layout != "padded":
            assert any(len(set(doc[s:e][doc[s:e] >= 0].tolist())) > 1 for s, e in tiles), layout
        partial.append(b - a < TILE_TOKENS)
    assert any(partial), "no tiled layout ends in a partial tile"


def _lora_reference(base: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so every adapter tensor gets a gradient
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(copy.deepcopy(base), config)


def _swiftune_model(base: torch.nn.Module, reference: torch.nn.Module, lora: bool, checkpointing: str,
                    kernel_backend: str = "auto") -> torch.nn.Module:
    # "auto" is the default: Triton kernels (the interpreter on CPU), packed attention
    model = patch_model(copy.deepcopy(base), kernel_backend=kernel_backend)
    mode = {"off": False, "on": True, "offload": "offload", "tiled_mlp": False}[checkpointing]
    budget = {"offload_gpu_budget_bytes": 0} if mode == "offload" else {}
    if lora:
        model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                         use_gradient_checkpointing=mode, init_lora_weights=False, **budget)
        model.load_state_dict(reference.state_dict())
    else:
        model = FastModel.for_training(model, use_gradient_checkpointing=mode, **budget)
    if checkpointing == "tiled_mlp":
        enable_tiled_mlp(model, tile_tokens=TILE_TOKENS, projections=lora)  # several tiles per document
    return model.train()


def _assert_parity(reference: tuple, got: tuple, trainable: list[str], tol: float = TOL) -> None:
    (ref_loss, ref_grads), (loss, grads) = reference, got
    assert torch.isfinite(loss), loss
    assert rel_err(loss, ref_loss) < tol, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, trainable, tol)


@pytest.fixture(scope="module")
def references() -> dict:
    """Per (family, lora): the unpatched base model, its PEFT copy and the reference step (``tiled``:
    on the tiled cases' document order)."""
    cache: dict = {}

    def get(family: str, lora: bool, tiled: bool = False):
        key = (family, lora)
        if key not in cache:
            base = tiny_model(family, window=family in WINDOWED).train()
            reference = _lora_reference(base) if lora else copy.deepcopy(base)
            cache[key] = (base, reference, {})
        base, reference, steps = cache[key]
        if tiled not in steps:  # the tiled cases' document order (the same documents)
            steps[tiled] = _reference_step(reference, _examples(tiled=tiled))
        return base, reference, steps[tiled]

    return get


# The Triton kernels (what runs on a GPU) through the interpreter: every family, full and LoRA (on
# Qwen3 and Gemma 3 these are the regression cases: q_proj, k_proj, q_norm, k_norm and their adapters
# had no gradient), and the checkpointing modes, which recompute through the kernels' autograd
# Functions, on the q/k-norm families.
TRITON_CASES = [(f, lora, "padding_free", "off") for f in FAMILIES for lora in (False, True)] + [
    ("qwen3", True, "packed", mode) for mode in ("on", "offload", "tiled_mlp")
] + [("gemma3", True, "packed", "offload")]
# Every other combination of the matrix runs the same forwards with the kernels' PyTorch references
# (the interpreter costs ~10 s a case; the references a fraction of that). The attention, packing,
# checkpointing and loss paths are the same in both.
REFERENCE_CASES = [
    (f, lora, layout, mode)
    for f in FAMILIES for lora in (False, True) for layout in LAYOUTS for mode in CHECKPOINTING
    if (f, lora, layout, mode) not in TRITON_CASES
]


def _case_id(case: tuple) -> str:
    family, lora, layout, mode = case
    return f"{family}-{'lora' if lora else 'full'}-{layout}-{mode}"


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_training_gradients_equal_unpatched_model(references, case):
    _check_case(references, *case, kernel_backend="auto")


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=_case_id)
def test_training_gradients_equal_unpatched_model(references, case):
    _check_case(references, *case, kernel_backend="reference")


def _check_case(references, family: str, lora: bool, layout: str, checkpointing: str, kernel_backend: str) -> None:
    tiled = checkpointing == "tiled_mlp"
    base, reference, expected = references(family, lora, tiled)
    model = _swiftune_model(base, reference, lora, checkpointing, kernel_backend)
    assert _trainable(model) == _trainable(reference)
    _assert_parity(expected, _swiftune_step(model, _examples(tiled=tiled), layout, tiled), _trainable(reference))


def test_negative_control_parity_catches_a_detached_projection(references, monkeypatch):
    """The suite fails when one projection is cut out of the graph (as the bug did)."""
    base, reference, expected = references("qwen3", False)
    model = _swiftune_model(base, reference, lora=False, checkpointing="off")
    k_proj = model.model.layers[0].self_attn.k_proj
    forward = k_proj.forward
    monkeypatch.setattr(k_proj, "forward", lambda x: forward(x).detach())
    with pytest.raises(AssertionError, match="no gradient where the unpatched model has one"):
        _assert_parity(expected, _swiftune_step(model, _examples(), "padding_free"), _trainable(reference))


# ----------------------------------------------------------------------------- the same on the GPU, bf16

# bf16 against the fp32 reference: 2e-2 by relative norm, or, for a tensor where transformers' own
# bf16 model is further off than that (small random models' LoRA gradients are: up to 6e-2 measured),
# no more than three times transformers' own bf16 error on that tensor.
GPU_TOL = 2e-2
QWEN3_8B_LAYER = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=1)


def _bf16_case(family: str, lora: bool, layout: str, checkpointing: str, autocast: bool = False,
               device: str = "cuda", **sizes) -> None:
    """Swiftune in bf16 on CUDA (compiled kernels, the GPU's packed attention) against the unpatched
    model in fp32, one document at a time (:func:`bf16_step_equals_unpatched_fp32`). ``device="cpu"``: the
    reference kernels, and autocast with CUDA's float32 ops emulated."""
    cpu = device == "cpu"
    base = tiny_model(family, window=family in WINDOWED, **sizes).to(device).train()
    reference = _lora_reference(base) if lora else copy.deepcopy(base)
    bf16_step_equals_unpatched_fp32(
        reference, lambda: _swiftune_model(base.to(torch.bfloat16), reference, lora, checkpointing,
                                           **({"kernel_backend": "reference"} if cpu else {})),
        layout, autocast, device)


def bf16_step_equals_unpatched_fp32(reference: torch.nn.Module, swiftune_model, layout: str, autocast: bool,
                                    device: str) -> None:
    """``swiftune_model()`` (built after ``reference``'s weights are made bf16-representable, then given them) in
    bf16 against ``reference``, the unpatched model in fp32, one document at a time: the loss, and every
    trainable gradient to 2e-2 or 3x transformers' own bf16 error on that tensor, non-zero where the reference's
    is. ``autocast``: the swiftune step (and the unpatched bf16 model's) under bf16 autocast, as a Trainer's
    ``bf16=True`` runs it; on ``device="cpu"`` with CUDA's float32 ops emulated
    (:class:`tests.helpers.CudaAutocastFloat32Ops`). Every decoder layer returns bf16, the unpatched model's too."""
    cpu = device == "cpu"
    with torch.no_grad():  # the same weights on every side: only the arithmetic differs
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    expected_loss, expected = _reference_step(reference, _examples())

    def bf16_autocast() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device, dtype=torch.bfloat16, enabled=autocast))
        if cpu:
            stack.enter_context(CudaAutocastFloat32Ops())
        return stack

    plain = copy.deepcopy(reference).to(torch.bfloat16)
    plain_dtypes = record_layer_dtypes(causal_lm_of(plain).model.layers)
    with bf16_autocast():
        _, plain_bf16 = _reference_step(plain, _examples())
    model = swiftune_model()
    model.load_state_dict(reference.state_dict())
    dtypes = record_layer_dtypes(causal_lm_of(model).model.layers)
    with bf16_autocast():
        loss, grads = _swiftune_step(model, _examples(), layout)
    assert set(plain_dtypes) == {torch.bfloat16}, plain_dtypes  # the unpatched model's layers keep bf16 too
    assert dtypes and set(dtypes) == {torch.bfloat16}, dtypes
    assert torch.isfinite(loss) and rel_err(loss, expected_loss) < GPU_TOL, (float(loss), float(expected_loss))
    allowed = {name: max(GPU_TOL, 3 * rel_err(plain_bf16[name], want)) for name, want in expected.items()}
    assert_gradients_match(expected, grads, _trainable(reference), allowed)


@pytest.mark.parametrize(("family", "lora"), [(f, False) for f in FAMILIES] + [("qwen3", True), ("gemma3", True)])
def test_autocast_with_cudas_float32_ops_keeps_every_layer_bf16(family, lora):
    """A bf16 model under autocast (a Trainer's ``bf16=True``) with CUDA's float32 ops emulated on the CPU
    (:class:`tests.helpers.CudaAutocastFloat32Ops`): every decoder layer returns bf16, as the unpatched model's do,
    and the loss and every gradient equal the unpatched fp32 model's (to 3x the unpatched bf16 model's error). A
    patched forward relying on ``sum`` or ``softmax`` keeping bf16 would widen the residual stream to float32 on
    CUDA only; the MoE combine once did."""
    _bf16_case(family, lora, "packed", "off", autocast=True, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("checkpointing", ["off", "on"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_training_gradients_equal_unpatched_model(family, lora, layout, checkpointing):
    _bf16_case(family, lora, layout, checkpointing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_gpu_autocast_training_gradients_equal_unpatched_model(family):
    """The Trainer's way of running bf16 (autocast on): every layer bf16, loss and every LoRA gradient as above."""
    _bf16_case(family, True, "packed", "on", autocast=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gpu_bf16_qwen3_8b_layer_gradients_equal_unpatched_model(lora):
    _bf16_case("qwen3", lora, "padding_free", "on", **QWEN3_8B_LAYER)
