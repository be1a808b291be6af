"""``benchmarks.flop_floor`` against torch's own FLOP counter on the unpatched transformers + PEFT model: a
LoRA step's forward and backward products, with and without checkpointing (every term of the formula is much
larger than the tolerance, so a missing or doubled one fails)."""

import peft
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.flop_floor import attention_pairs, step_flops
from tests.helpers import tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_step_flops_equal_torch_flop_counter_on_the_unpatched_peft_model(family, checkpointing):
    model = tiny_model(family)
    config = model.config
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    if checkpointing:
        # transformers' checkpointing, without the hook that makes the frozen embeddings' output require a
        # gradient (swiftune removes it: it would add the first layer's q/k/v input gradients)
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.base_model.model.disable_input_require_grads()
        model.train()
    tokens = 48
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss = model(input_ids=ids).logits.float().logsumexp(-1).sum()
        forward = counter.get_total_flops()
        loss.backward()
    want = step_flops(config, [tokens], lora_rank=4, attention="eager", recompute=checkpointing)
    assert forward == sum(v for k, v in want.items() if k.endswith("_forward"))
    if checkpointing:
        # torch's non-reentrant checkpoint stops its recompute once every saved tensor is back: each layer's
        # last product (down_proj's adapter B, 2 T r H) is not run again
        assert counter.get_total_flops() == pytest.approx(want["total"], rel=5e-3)
        assert counter.get_total_flops() > want["total"] - want["recompute"]
    else:
        assert counter.get_total_flops() == want["total"]


def test_causal_pairs_with_a_shared_prompt():
    """Two completions of 3 and 2 tokens after a 2-token prompt placed once: the prompt's own 3 pairs, then
    each completion's causal pairs plus every one of its tokens against the prompt."""
    assert attention_pairs([3, 2], shared_prompt=2) == 3 + (6 + 3 * 2) + (3 + 2 * 2)
    assert attention_pairs([3, 2], shared_prompt=2, attention="eager") == 49
