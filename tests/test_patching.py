"""patch_model on tiny random models of every supported family (fp32, Triton interpreter on CPU).

* patched vs unpatched (transformers' eager attention): logits and loss;
* (packed rows vs each document alone, every gradient: tests/test_gradient_parity.py);
* a padded 2-D-mask batch vs the same rows packed;
* a negative control, idempotence, unknown architectures, generation with a KV cache.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from swiftune.attention import ATTENTION_NAME, has_packed_context
from swiftune.data.builtin import tiny_model_config
from swiftune.models import is_patched, patch_model, unpatch_model
from swiftune.training import FastModel
from tests.helpers import SLIDING_LAYERS, VOCAB, rel_err, tiny_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def _docs(seed: int, count: int | None = None, low: int = 3, high: int = 15) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    count = count or int(torch.randint(3, 9, (1,), generator=g))
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _pack(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    return ids, pos


def _sum_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document (logits [L, V], ids [L])."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


# ----------------------------------------------------------------------------- patched == unpatched


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_unpatched(family):
    window = family in ("mistral", "gemma2", "gemma3")  # sliding layers where the family has them
    reference = tiny_model(family, window=window)
    patched = patch_model(copy.deepcopy(reference))
    assert patched.config._attn_implementation == ATTENTION_NAME and is_patched(patched)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids, labels=ids, use_cache=False)
        got = patched(ids, labels=ids, use_cache=False)
    assert rel_err(got.logits, want.logits) < 1e-5
    assert rel_err(got.loss, want.loss) < 1e-5


# ----------------------------------------------------------------------------- packed == alone


def _lora(model: transformers.PreTrainedModel):
    # init_lora_weights=False: random A *and* B, so that every LoRA gradient is nonzero.
    return FastModel.get_peft_model(
        model, r=4, lora_alpha=8, use_gradient_checkpointing=False, init_lora_weights=False, random_state=0
    )


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# Packed rows against each document alone, with every gradient, are tests/test_gradient_parity.py's
# subject (against the unpatched model); here: a negative control for the boundaries.


def test_negative_control_boundaries_removed():
    """Same comparison without restarting positions (one long document): it must fail."""
    model = patch_model(tiny_model("qwen3"), kernel_backend="reference")
    docs = _docs(seed=3, count=4)
    ids, _ = _pack(docs)
    with torch.no_grad():
        merged = model(input_ids=ids, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    assert rel_err(merged, alone) > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_padded_batch_equals_packed_row(family):
    """A right- and left-padded 2-D-mask batch gives the packed row's logits and loss."""
    model = patch_model(tiny_model(family, window=family == "gemma2"), kernel_backend="reference")
    docs = _docs(seed=5, count=3, low=6, high=18)
    seq = max(len(d) for d in docs)
    ids = torch.zeros(3, seq, dtype=torch.long)
    mask = torch.zeros(3, seq, dtype=torch.long)
    for row, d in enumerate(docs):
        cols = slice(seq - len(d), seq) if row == 2 else slice(0, len(d))  # row 2 is left-padded
        ids[row, cols], mask[row, cols] = d, 1
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(3), mask.argmax(-1)] = -100  # a row's first token has no predecessor in its document

    packed_ids, packed_pos = _pack(docs)
    packed_labels = packed_ids.clone()
    packed_labels[0, packed_pos[0] == 0] = -100  # no label crosses a document boundary
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels, use_cache=False)
        packed = model(input_ids=packed_ids, position_ids=packed_pos, labels=packed_labels, use_cache=False)
    got = torch.cat([padded.logits[row, mask[row].bool()] for row in range(3)])
    assert rel_err(got, packed.logits[0]) < 1e-5
    assert rel_err(padded.loss, packed.loss) < 1e-5


# ----------------------------------------------------------------------------- patching mechanics


@pytest.mark.parametrize("padded", [False, True])
def test_layout_computed_once_and_no_square_mask(monkeypatch, padded):
    """Every layer gets the same PackedBatch object and at most the 2-D mask, never [B, 1, S, S]."""
    from transformers import AttentionInterface

    from swiftune.attention import PACKED_KWARG

    model = patch_model(tiny_model("gemma2", window=True), kernel_backend="reference")
    real = AttentionInterface._global_mapping[ATTENTION_NAME]
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((None if attention_mask is None else attention_mask.dim(), id(kwargs.get(PACKED_KWARG))))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, spy)
    ids, pos = _pack(_docs(seed=7, count=3))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -3:] = 0
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, attention_mask=mask if padded else None, use_cache=False)
    assert len(seen) == model.config.num_hidden_layers
    assert {dims for dims, _ in seen} == ({2} if padded else {None})
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != id(None)


def test_patch_is_idempotent_and_undoable():
    reference = tiny_model("llama")
    model = patch_model(patch_model(copy.deepcopy(reference)))
    hooks = [h for h in model.model._forward_pre_hooks.values()]
    assert len(hooks) == 1 and has_packed_context(model.model)
    assert model.model.layers[0].self_attn.forward.__func__.__name__ == "fused_attention_forward"
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits
        assert rel_err(model(ids, use_cache=False).logits, want) < 1e-5
        unpatch_model(model)
        assert not is_patched(model)
        assert rel_err(model(ids, use_cache=False).logits, want) < 1e-5


def test_unknown_architecture_warns_and_runs():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.warns(UserWarning, match=r"GPT2LMHeadModel \(model_type 'gpt2'\).*stay unpatched"):
        patch_model(model)
    assert not is_patched(model) and model.config._attn_implementation != ATTENTION_NAME
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, VOCAB, (1, 8))).logits).all()


def test_generation_with_kv_cache_matches_unpatched():
    """Greedy decoding of a left-padded batch: the cached decode steps use the dense fallback."""
    reference = tiny_model("gemma3", window=True)
    patched = patch_model(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = reference.generate(ids, **kwargs)
        got = patched.generate(ids, **kwargs)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- GPU (run on the H200)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_docs(total: int, count: int, seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: count - 1].add(1).sort().values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    ids = torch.randint(0, vocab, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.cuda(), pos.cuda(), lengths


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family,backend", [("qwen3", "varlen"), ("qwen3", "flex"), ("gemma2", "flex"), ("gemma2", "auto")])
def test_gpu_model_packed_row_matches_documents_alone(family, backend):
    """bf16, compiled kernels, 4K tokens in 6 documents vs each alone through fp32 eager transformers."""
    from swiftune.attention import backend_available

    if backend != "auto" and not backend_available(backend, "cuda"):
        pytest.skip(f"{backend} not available")
    extra = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    if family == "gemma2":  # sliding window + soft-capping (auto: flex, or flash_attn when installed)
        extra.update(query_pre_attn_scalar=64, sliding_window=512, layer_types=SLIDING_LAYERS, attn_logit_softcapping=5.0)
    config = tiny_model_config(family, vocab_size=VOCAB, max_position_embeddings=8192, **extra)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda().eval()
    model = patch_model(copy.deepcopy(reference).to(torch.bfloat16), attention=backend)
    ids, pos, lengths = _gpu_docs(4096, 6, seed=0, vocab=VOCAB)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        merged = model(input_ids=ids, use_cache=False).logits[0].float()  # negative control
        want = torch.cat([reference(input_ids=d[None], use_cache=False).logits[0] for d in ids[0].split(lengths)])
    err, control = rel_err(got, want), rel_err(merged, want)
    print(f"\n{family}/{backend}: bf16 packed vs fp32 alone {err:.2e}; without boundaries {control:.2e}")
    assert err < 3e-2 and control > 3 * err  # bf16 rounding through the model vs contamination


@cuda
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_gpu_qwen3_1_7b_packed_memory_is_linear(backend):
    """Peak memory of one LoRA forward+backward (checkpointed) at 32K / 64K / 128K packed tokens."""
    config = transformers.Qwen3Config(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    patch_model(model, attention=backend)
    model = FastModel.get_peft_model(model, r=16, lora_alpha=16)
    model.train()
    decoder = model.get_base_model().model  # hidden states only: logits are the fused loss's business
    peaks = {}
    for k in (32, 64, 128):
        ids, pos, _ = _gpu_docs(k * 1024, 8, seed=k, vocab=config.vocab_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        hidden = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        hidden.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**30
        model.zero_grad(set_to_none=True)
        del hidden
    print(f"\n{backend}: peak GiB over weights at 32K/64K/128K tokens: " + " / ".join(f"{peaks[k]:.2f}" for k in peaks))
    # linear: the 64K->128K step costs about twice the 32K->64K step (a T x T term would make it 4x)
    assert peaks[128] - peaks[64] < 2.5 * (peaks[64] - peaks[32])
    assert peaks[128] < 60


def test_output_attentions_on_the_packed_attention_is_said_not_silently_empty():
    model = patch_model(tiny_model("llama"))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UserWarning, match="packed attention returns no attention weights"), torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=False)
    assert not out.attentions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids, use_cache=False)  # not asked: no warning
