"""The policy-loss forward: completion log-probs on packed, padding-free rows.

A micro-batch of rollouts becomes **one row** ``[1, T]`` with no padding:

* unshared: ``prompt_1 + completion_1 | prompt_2 + completion_2 | ...``, positions restarting
  at 0 for every sample (each sample its own document of the packed attention);
* shared prompt (``share_prompt=True``): ``prompt_g | completion_g1 | completion_g2 | ...`` for
  each group ``g`` of consecutive samples with the same prompt, the completions' positions all
  continuing from the prompt, and the attention rule of :mod:`swiftune.attention.shared_prompt` (each
  completion sees the prompt and itself, not its siblings). Exactly the unshared log-probs and
  gradients, with the prompt encoded once per group instead of ``G`` times.

The last token of a completion is never an input (it predicts nothing). The decoder's last hidden
state is captured with a forward hook (the model runs through its own top-level forward, so
DDP/FSDP hooks run, with ``logits_to_keep=1``); the rows that predict completion tokens are
gathered and :func:`swiftune.losses.selective_log_softmax` turns them into the log-probability
of each completion token (and the entropy), chunked: the ``[tokens, vocab]`` logits never exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import LAYOUT_KWARG, PackedBatch, RowLayout, register_grpo_attention
from ..losses import selective_log_softmax
from ..models.heads import hidden_states_and_head
from ..models.patching import causal_lm_of
from ..models.support import controls_attention


def install_grpo_attention(model: nn.Module) -> None:
    """Make ``model`` (patched by :func:`swiftune.patch_model`) call GRPO's row attention
    (:func:`swiftune.attention.grpo_attention_forward`)."""
    name = register_grpo_attention()
    hf_model = causal_lm_of(model)
    if hf_model.config._attn_implementation == name:
        return
    try:
        hf_model.set_attn_implementation(name)
    except (AttributeError, ValueError):  # older API: the config attribute is the switch
        hf_model.config._attn_implementation = name


def install_text_grpo_attention(model: nn.Module) -> None:
    """:func:`install_grpo_attention` for a vision-language model: its text decoder's config only
    (the vision tower keeps its own attention; the multimodal hook accepts both packed names)."""
    name = register_grpo_attention()
    config = causal_lm_of(model).config
    text = config.get_text_config()
    if text._attn_implementation == name:
        return
    try:
        causal_lm_of(model).set_attn_implementation(
            {"text_config": name, "vision_config": config.vision_config._attn_implementation})
    except (AttributeError, ValueError, TypeError):  # older API: the sub-config attribute is the switch
        text._attn_implementation = name


@dataclass
class PolicyRow:
    """One packed row of a micro-batch and where its completion tokens are.

    Attributes:
        input_ids, position_ids: ``[1, T]``.
        layout: the row's document / shared-prompt structure, passed to the attention layers.
        hidden_index: ``[N]`` row index whose hidden state predicts each completion token.
        targets: ``[N]`` the completion tokens.
        seq_index: ``[N]`` the sample (``0..B-1``) of each completion token.
        num_sequences: ``B``.
        spans: ``(prompt start, prompt end, completion start, completion end)`` of each sample in the
            row (a shared prompt's span is the same for every sample of its group); ``None`` in rows
            saved before this field existed.
        model_inputs: more forward inputs of a vision-language row (``document_ids``, ``pixel_values``,
            ``image_grid_thw``; :mod:`swiftune.rl.multimodal`, whose ``position_ids`` are ``[3, 1, T]``);
            ``None`` for text rows.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: RowLayout
    hidden_index: torch.Tensor
    targets: torch.Tensor
    seq_index: torch.Tensor
    num_sequences: int
    spans: list[tuple[int, int, int, int]] | None = None
    model_inputs: dict[str, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def group_consecutive(prompt_ids: Sequence[Sequence[int]], group_ids: Sequence[int] | None = None) -> list[list[int]]:
    """Runs of consecutive samples with the same prompt (and the same group id, when given)."""
    runs: list[list[int]] = []
    for i, p in enumerate(prompt_ids):
        same = runs and list(prompt_ids[runs[-1][0]]) == list(p) and (
            group_ids is None or group_ids[runs[-1][0]] == group_ids[i])
        if same:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def build_policy_row(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    share_prompt: bool = False,
    group_ids: Sequence[int] | None = None,
    attention_backend: str = "auto",
    device: torch.device | str = "cpu",
    include_last_token: bool = False,
) -> PolicyRow:
    """Lay out samples ``prompt_ids[i] + completion_ids[i]`` as one padding-free row (see module doc).

    ``include_last_token``: each completion's last token is an input too (at the end of its sample,
    so no other token sees it and no log-prob changes); it predicts nothing, but the MoE routers then
    route every token of ``prompt + completion``, as TRL's forward does for its load-balancing loss."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(completion_ids)} completions")
    tokens: list[int] = []
    positions: list[int] = []
    segs: list[int] = []
    doc_lengths: list[int] = []
    hidden_index: list[int] = []
    targets: list[int] = []
    seq_index: list[int] = []
    sequences: list[tuple[int, int, int, int]] = []  # (prompt start, end, completion start, end)
    runs = group_consecutive(prompt_ids, group_ids) if share_prompt else [[i] for i in range(len(prompt_ids))]
    for run in runs:
        prompt = list(prompt_ids[run[0]])
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        start = len(tokens)
        tokens += prompt
        positions += range(len(prompt))
        segs += [0] * len(prompt)
        last_prompt = len(tokens) - 1
        for k, i in enumerate(run, start=1):
            comp = list(completion_ids[i])
            offset = len(tokens)
            inputs = comp if include_last_token else comp[:-1]  # the last token predicts nothing
            tokens += inputs
            positions += range(len(prompt), len(prompt) + len(inputs))
            segs += [k] * len(inputs)
            sequences.append((start, start + len(prompt), offset, len(tokens)))
            if comp:
                hidden_index.append(last_prompt)
                hidden_index += range(offset, offset + len(comp) - 1)
                targets += comp
                seq_index += [i] * len(comp)
        doc_lengths.append(len(tokens) - start)
    T = len(tokens)
    lengths = torch.tensor(doc_lengths, dtype=torch.int32)
    cu = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    packed = PackedBatch(cu.to(device), int(lengths.max()) if doc_lengths else 0, 1, T, None, attention_backend)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    shared = share_prompt and any(len(r) > 1 for r in runs)
    seg = torch.tensor(segs, dtype=torch.int32, device=device) if shared else None
    layout = RowLayout(packed, pos, seg, attention_backend, sequences if shared else None)
    return PolicyRow(
        input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
        position_ids=pos.unsqueeze(0),
        layout=layout,
        hidden_index=torch.tensor(hidden_index, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        seq_index=torch.tensor(seq_index, dtype=torch.long, device=device),
        num_sequences=len(prompt_ids),
        spans=list(sequences),  # the runs cover the samples in order
    )


def row_sequences(row: PolicyRow) -> list[tuple[int, int, int, int]]:
    """``(prompt start, prompt end, completion start, completion end)`` of each sample of ``row``, in
    sample order: sample ``i`` is ``input_ids[ps:pe] + input_ids[cs:ce]`` (its last completion token
    is a target only). Unshared rows hold each sample whole, as ``(start, end, end, end)``."""
    if row.layout.sequences is not None:
        return list(row.layout.sequences)
    cu = row.layout.packed.cu_seqlens.tolist()
    return [(cu[d], cu[d + 1], cu[d + 1], cu[d + 1]) for d in range(len(cu) - 1)]


def _padded_hidden(model: nn.Module, row: PolicyRow) -> tuple[torch.Tensor, nn.Module, float | None]:
    """The hidden states that predict ``row``'s completion tokens (``[N, H]``), from one right-padded
    row per sample with an ``attention_mask``: what a model without swiftune's packed attention
    computes correctly. Returns them with the LM head and the final soft-cap."""
    sequences = row_sequences(row)
    if len(sequences) != row.num_sequences:
        raise ValueError(f"the row holds {len(sequences)} sequences for {row.num_sequences} samples")
    ids = row.input_ids[0]
    samples = [torch.cat([ids[ps:pe], ids[cs:ce]]) for ps, pe, cs, ce in sequences]
    width = max(len(t) for t in samples)
    input_ids = torch.zeros((len(samples), width), dtype=torch.long, device=ids.device)
    attention_mask = torch.zeros_like(input_ids)
    for r, tokens in enumerate(samples):
        input_ids[r, :len(tokens)] = tokens
        attention_mask[r, :len(tokens)] = 1
    hidden, lm_head, softcap = hidden_states_and_head(model, input_ids=input_ids, attention_mask=attention_mask)
    # where each predicting row position of the packed row sits in its sample's padded row
    bounds = torch.tensor(sequences, dtype=torch.long, device=ids.device)[row.seq_index]  # [N, 4]
    h = row.hidden_index
    prompt_start, prompt_end, completion_start = bounds[:, 0], bounds[:, 1], bounds[:, 2]
    offset = torch.where(h < prompt_end, h - prompt_start, prompt_end - prompt_start + h - completion_start)
    return hidden[row.seq_index, offset], lm_head, softcap


def router_token_weights(model: nn.Module, row: PolicyRow, sample_weights: torch.Tensor) -> torch.Tensor:
    """How much each token that :func:`completion_logprobs` runs through ``model`` counts in the MoE
    load-balancing loss (:func:`swiftune.models.moe.load_balancing_loss`'s ``token_mask``), as TRL's
    padded forward counts it: every prompt token once per sample (a shared prompt, encoded once, as
    often as its group has samples), every completion token by its sample's weight (0 for a truncated
    completion under ``mask_truncated_completions``, whose attention mask TRL zeroes), nothing else.

    Flat, in the order the routers see the tokens: the packed row ``[T]``, or (the padded fallback of
    a model whose attention is not swiftune's) ``[B, width]`` right-padded rows, padding 0. Needs a row
    built with ``include_last_token=True``, so that each completion's last token is routed too.
    """
    if row.spans is None:
        raise ValueError("the policy row has no sample spans (a rollout buffer saved by an older swiftune): "
                         "start from a new generation to add the router load-balancing loss")
    keep = sample_weights.detach().to(torch.float32).cpu().tolist()
    if controls_attention(causal_lm_of(model)):
        weights = torch.zeros(row.num_tokens, dtype=torch.float32)
        for (ps, pe, cs, ce), w in zip(row.spans, keep):
            weights[ps:pe] += 1.0
            weights[cs:ce] += w
    else:
        width = max((pe - ps) + (ce - cs) for ps, pe, cs, ce in row.spans)
        weights = torch.zeros(len(row.spans), width, dtype=torch.float32)
        for r, ((ps, pe, cs, ce), w) in enumerate(zip(row.spans, keep)):
            weights[r, :pe - ps] = 1.0
            weights[r, pe - ps:pe - ps + ce - cs] = w
    return weights.reshape(-1).to(row.input_ids.device)


def _the_row(hidden: torch.Tensor) -> torch.Tensor:
    """``[1, T, H] -> [T, H]`` by ``squeeze``, a view in backward too (indexing row 0 would make autograd
    fill a zero tensor of the whole row's hidden states and copy the gradient in)."""
    if hidden.shape[0] != 1:
        raise ValueError(f"a policy row is one row [1, T]; the model returned hidden states {tuple(hidden.shape)}")
    return hidden.squeeze(0)


def completion_logprobs(
    model: nn.Module,
    row: PolicyRow,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    offload: bool = False,
    return_entropy: bool = False,
    kernel_backend: str = "auto",
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` (float32) of the completion tokens of ``row`` under ``model`` (and entropies).

    ``model`` may be wrapped (DDP) and/or a PEFT model. Patched by :func:`swiftune.patch_model`
    (packed attention), it runs the packed row; otherwise (an architecture swiftune does not patch,
    or attention left to transformers) each sample runs as its own right-padded row with an
    ``attention_mask`` (:func:`_padded_hidden`): the same log-probs, without the packing's savings.
    Logits are divided by ``temperature`` as in sampling (TRL). ``fp32_head`` (TRL's
    ``cast_lm_head_to_fp32``) upcasts the hidden states and the head's weight before the product, so
    the logits themselves are computed in float32, not only the softmax over them.
    """
    causal_lm = causal_lm_of(model)
    if row.model_inputs is not None:  # a vision-language row: its samples kept apart by document_ids
        layout = {}
        if row.layout.shared:  # or by the shared-prompt attention, on the text decoder only
            install_text_grpo_attention(causal_lm)
            layout = {LAYOUT_KWARG: row.layout}
        hidden, lm_head, softcap = hidden_states_and_head(
            model, input_ids=row.input_ids, position_ids=row.position_ids, **row.model_inputs, **layout)
        hidden = _the_row(hidden).index_select(0, row.hidden_index)
    elif controls_attention(causal_lm):
        install_grpo_attention(causal_lm)
        hidden, lm_head, softcap = hidden_states_and_head(
            model, input_ids=row.input_ids, position_ids=row.position_ids, **{LAYOUT_KWARG: row.layout})
        hidden = _the_row(hidden).index_select(0, row.hidden_index)
    else:  # the model's own attention would let the row's samples see each other: one padded row each
        hidden, lm_head, softcap = _padded_hidden(model, row)
    weight, bias = lm_head.weight, lm_head.bias
    if fp32_head:
        hidden, weight = hidden.float(), weight.float()
        bias = bias.float() if bias is not None else None
    out = selective_log_softmax(
        hidden, weight, row.targets, temperature=temperature, logit_softcap=softcap, chunk_tokens=chunk_tokens,
        offload=offload, return_entropy=return_entropy, bias=bias,
        backend=kernel_backend if kernel_backend in ("auto", "triton", "reference") else "auto",
    )
    if return_entropy:
        logps, entropy = out
        return logps, entropy
    return out, None
