"""The rollout buffer in GRPO checkpoints, so that a resumed run continues mid-generation exactly.

With ``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps`` one
generation serves several optimizer steps, and a checkpoint can fall between them. Its micro-batches
(packed rows, advantages, masks, old and reference log-probs) were built from the policy as it was
at generation time; regenerating after a resume would sample from, and take old log-probs under,
a later policy. So every checkpoint also stores, per process, the micro-step counter and the
buffer, and resuming puts them back.

The buffer is this process's share of a global generation, so it is only put back on the same
number of processes: resumed on another number (a checkpoint of 2 GPUs resumed on 1), the buffer
is dropped with a warning and the micro-step counter kept, so a checkpoint at a generation boundary
resumes exactly and one between the steps of a generation samples that generation again.

The file (``rollouts-rank{r}.safetensors``) holds the tensors, and in its metadata a JSON tree of
the rest: numbers, strings, lists, tuples, ``None`` and the dataclasses the caller allows
(:data:`ROLLOUT_TYPES` plus the trainer's micro-batch class), fields by name, tensors by key.
Nothing in it is executed on loading: a checkpoint from someone else cannot run code. (Until this
format, the buffer was a pickle, ``rollouts-rank{r}.pt``, read with ``torch.load(weights_only=False)``,
which runs whatever the file holds; such files are refused.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..attention import PackedBatch, RowLayout
from .policy import PolicyRow

logger = logging.getLogger(__name__)

ROLLOUT_TYPES: tuple[type, ...] = (PolicyRow, RowLayout, PackedBatch)
FORMAT = "swiftune-rollouts-1"
_META_KEY = "swiftune_rollout_state"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file swiftune will not read (a pickle that could run code) or cannot understand."""


def rollout_state_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"rollouts-rank{rank}.safetensors")


def legacy_rollout_state_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"rollouts-rank{rank}.pt")


def _to(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor moved and every per-forward ``cache`` dict emptied (dataclasses, lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: ({} if f.name == "cache" else _to(getattr(obj, f.name), device))
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able tree of ``obj``; its tensors go into ``tensors`` (CPU, contiguous, unshared)."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"tuple": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("rollout state dicts need string keys")
        return {"dict": {k: _encode(v, tensors) for k, v in obj.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: ({"dict": {}} if f.name == "cache" else _encode(getattr(obj, f.name), tensors))
                  for f in dataclasses.fields(obj) if f.init}
        return {"dataclass": type(obj).__qualname__, "fields": fields}
    raise TypeError(f"cannot store a {type(obj).__name__} in the rollout state")


def _decode(node: Any, tensors: dict[str, torch.Tensor], types: dict[str, type], path: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(x, tensors, types, path) for x in node]
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise UnsafeCheckpointError(f"{path}: unexpected entry {str(node)[:80]!r} in the rollout state")
    if "tensor" in node:
        key = node["tensor"]
        if key not in tensors:
            raise UnsafeCheckpointError(f"{path}: the rollout state names a tensor {key!r} it does not hold")
        return tensors[key]
    if "tuple" in node and isinstance(node["tuple"], list):
        return tuple(_decode(x, tensors, types, path) for x in node["tuple"])
    if "dict" in node and isinstance(node["dict"], dict):
        return {str(k): _decode(v, tensors, types, path) for k, v in node["dict"].items()}
    if "dataclass" in node and isinstance(node.get("fields"), dict):
        cls = types.get(node["dataclass"])
        if cls is None:
            raise UnsafeCheckpointError(f"{path}: the rollout state holds a {node['dataclass']!r}, not one of the "
                                        f"types it may hold ({', '.join(sorted(types))})")
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        fields = node["fields"]
        unknown = set(fields) - allowed
        if unknown:
            raise UnsafeCheckpointError(f"{path}: {cls.__name__} has no fields {sorted(unknown)}")
        return cls(**{k: _decode(v, tensors, types, path) for k, v in fields.items()})
    raise UnsafeCheckpointError(f"{path}: unexpected entry {str(node)[:80]!r} in the rollout state")


def current_world_size() -> int:
    """The number of processes of the default process group (1 without one)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def save_rollout_state(checkpoint_dir: str, rank: int, micro_step: int, buffer: list | None,
                       world_size: int | None = None, generation_metrics: dict[str, float] | None = None,
                       engine_rng_state: torch.Tensor | None = None) -> None:
    """Write process ``rank``'s micro-step counter and rollout buffer; ``world_size`` (default: the
    process group's) is recorded so that a resume on another number of processes can tell.
    ``generation_metrics``: the last generation's logged metrics (reward, lengths, ...), which the steps
    that reuse its buffer log again (:func:`saved_generation_metrics` reads them back).
    ``engine_rng_state``: the rollout engine's sampling generator state (:func:`saved_engine_rng_state`)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    world = current_world_size() if world_size is None else int(world_size)
    tree = {"format": FORMAT, "micro_step": int(micro_step), "world_size": world, "buffer": _encode(buffer, tensors),
            "generation_metrics": {str(k): float(v) for k, v in (generation_metrics or {}).items()},
            "engine_rng_state": _encode(engine_rng_state, tensors)}
    save_file(tensors, rollout_state_path(checkpoint_dir, rank), metadata={_META_KEY: json.dumps(tree)})


def _refuse_legacy(path: str) -> None:
    """A pickled buffer of an older swiftune: read with ``weights_only=True`` (which cannot run code),
    whose unpickler refuses the dataclasses it holds: an error saying what to do."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends: refused, nothing ran
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    else:
        reason = "not a swiftune rollout state"
    raise UnsafeCheckpointError(
        f"{path}: a pickled rollout buffer, which swiftune no longer reads (unpickling can run any code the "
        f"file holds; it was refused: {reason}). Delete the file to resume from this checkpoint without its "
        "unfinished generation (the next one is sampled again), or resume from a checkpoint written by this "
        "version (rollouts-rank*.safetensors).")


def saved_generation_metrics(checkpoint_dir: str, rank: int) -> dict[str, float]:
    """The generation metrics :func:`save_rollout_state` wrote for ``rank`` (empty without any: no
    state file, or one of a version that did not write them). Reads the file's metadata only."""
    path = rollout_state_path(checkpoint_dir, rank)
    if not os.path.exists(path):
        return {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            tree = json.loads((f.metadata() or {}).get(_META_KEY) or "{}")
    except Exception as e:
        raise UnsafeCheckpointError(f"{path}: not a readable swiftune rollout state ({e})") from e
    metrics = tree.get("generation_metrics") if isinstance(tree, dict) else None
    if not isinstance(metrics, dict):
        return {}
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _read_tree(path: str, tensors: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            tree = json.loads((f.metadata() or {}).get(_META_KEY) or "{}")
            loaded = {key: f.get_tensor(key) for key in f.keys()} if tensors else {}
    except Exception as e:
        raise UnsafeCheckpointError(f"{path}: not a readable swiftune rollout state ({e})") from e
    return (tree if isinstance(tree, dict) else {}), loaded


def saved_engine_rng_state(checkpoint_dir: str, rank: int, world_size: int | None = None) -> torch.Tensor | None:
    """The rollout engine's random state :func:`save_rollout_state` wrote for ``rank``; None without one (a
    checkpoint of an engine without one, or of an older version) or when it was saved by another number of
    processes (each process's engine draws its own stream: as the Trainer's random states, not carried over)."""
    path = rollout_state_path(checkpoint_dir, rank)
    if not os.path.exists(path):
        return None
    tree, tensors = _read_tree(path, tensors=True)
    node = tree.get("engine_rng_state")
    world = current_world_size() if world_size is None else int(world_size)
    if not isinstance(node, dict) or tree.get("world_size") != world:
        return None
    state = _decode(node, tensors, {}, path)
    return state if isinstance(state, torch.Tensor) else None


def load_rollout_state(checkpoint_dir: str, rank: int, device: torch.device | str,
                       types: Iterable[type] = (), world_size: int | None = None) -> tuple[int, list | None] | None:
    """``(micro_step, buffer)`` saved with the checkpoint, or None (a checkpoint without one).

    ``types``: the dataclasses the buffer may hold besides :data:`ROLLOUT_TYPES` (the trainer's
    micro-batch); anything else in the file is an :class:`UnsafeCheckpointError`. ``world_size``
    (default: the process group's): saved by another number of processes, the buffer (one
    process's share of that run's global generation) is dropped: ``(micro_step, None)``.
    """
    path = rollout_state_path(checkpoint_dir, rank)
    if not os.path.exists(path):
        legacy = legacy_rollout_state_path(checkpoint_dir, rank)
        if os.path.exists(legacy):
            _refuse_legacy(legacy)
        return None
    allowed = {cls.__qualname__: cls for cls in (*ROLLOUT_TYPES, *types)}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = (f.metadata() or {}).get(_META_KEY)
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:
        raise UnsafeCheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    try:
        tree = json.loads(meta) if meta is not None else None
    except ValueError as e:
        raise UnsafeCheckpointError(f"{path}: its rollout metadata is not JSON ({e})") from e
    if not isinstance(tree, dict) or tree.get("format") != FORMAT or not isinstance(tree.get("micro_step"), int):
        raise UnsafeCheckpointError(f"{path}: not a swiftune rollout state ({FORMAT})")
    buffer = _decode(tree.get("buffer"), tensors, allowed, path)
    saved_world = tree.get("world_size")
    world = current_world_size() if world_size is None else int(world_size)
    if isinstance(saved_world, int) and saved_world != world and buffer is not None:
        logger.warning("swiftune: %s was saved by %d process(es) and this run has %d: its rollout buffer (that "
                       "process's share of a global generation) is not used; if the checkpoint fell between the "
                       "optimizer steps of one generation, that generation is sampled again under the current policy "
                       "(resume on %d processes to continue it exactly).", path, saved_world, world, saved_world)
        buffer = None
    return tree["micro_step"], (_to(buffer, device) if buffer is not None else None)
