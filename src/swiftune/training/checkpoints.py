"""Checkpoints that are complete before they are visible, and resuming from the newest complete one.

transformers writes ``checkpoint-N`` in place, file after file: a run killed while saving (or a
full disk) leaves a ``checkpoint-N`` that looks like the newest and fails on resume. Here the
Trainer writes into a hidden sibling, ``.saving-checkpoint-N/checkpoint-N`` (no ``checkpoint-*``
glob or ``get_last_checkpoint`` sees it), the trainer adds its own files, a completion marker
(``swiftune_checkpoint.json``: the step and the run's key settings) goes in last, and one rename
makes the folder ``checkpoint-N``. The previous checkpoints are untouched until then, so a failed
save leaves them usable.

Resuming (``resume_from_checkpoint=True``) takes the newest ``checkpoint-N`` that is complete:
it has the marker, or, written by plain transformers or an older swiftune, a readable
``trainer_state.json`` (the Trainer writes it after the weights, optimizer and RNG states). Others
are skipped with a warning. When the checkpoint's recorded settings differ from the run's (another
run's folder, or changed options), a warning lists the differences; other training data (the row count
and a hash of a few rows, :func:`dataset_fingerprint`) gets its own warning, since the resumed run skips
the checkpoint's batches of whatever data it is given.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
MARKER_NAME = "swiftune_checkpoint.json"
TRAINER_STATE_NAME = "trainer_state.json"
STAGING_PREFIX = ".saving-"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (full disk, lost mount, permissions); the previous ones are intact."""


# ------------------------------------------------------------------------------------ writing


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def staging_run_dir(run_dir: str, step: int) -> str:
    """The hidden folder the Trainer writes ``checkpoint-{step}`` into (as if it were ``run_dir``)."""
    return os.path.join(run_dir, f"{STAGING_PREFIX}{checkpoint_name(step)}")


def prepare_staging(run_dir: str, step: int) -> str:
    """An empty staging folder for ``step`` (the leftovers of an earlier, interrupted save removed)."""
    staging = staging_run_dir(run_dir, step)
    if os.path.exists(staging):
        shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)
    return staging


REPLACED_PREFIX = f"{STAGING_PREFIX}replaced-"
DELETED_PREFIX = f"{STAGING_PREFIX}deleted-"


def remove_stale_staging(run_dir: str) -> list[str]:
    """Finish or undo what a run killed while saving left in ``run_dir``, then remove the rest.

    A staged ``checkpoint-N`` whose marker is written was complete when the run died (between the
    marker and the rename, or between the two renames of :func:`publish`): it is published. A
    ``checkpoint-N`` that :func:`publish` had moved aside and no new one replaced goes back. Every
    other hidden folder (a save cut short, a rotation's or a replacement's removal) is removed."""
    removed = []
    if not os.path.isdir(run_dir):
        return removed
    for name in sorted(os.listdir(run_dir)):
        match = _CHECKPOINT_RE.match(name[len(STAGING_PREFIX):])
        if name.startswith(STAGING_PREFIX) and match:
            staged, final = os.path.join(run_dir, name, match.group(0)), os.path.join(run_dir, match.group(0))
            marker = read_marker(staged)
            if marker is not None and marker.get("complete") and not os.path.exists(final):
                publish(staged, final)
                logger.warning("swiftune: %s was saved completely before the run stopped; published it", final)
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name.startswith(REPLACED_PREFIX) and os.path.isdir(path):
            final = os.path.join(run_dir, name[len(REPLACED_PREFIX):])
            if not os.path.exists(final) and checkpoint_problem(path) is None:
                os.replace(path, final)
                logger.warning("swiftune: restored %s (the run stopped while replacing it)", final)
                continue
        if name.startswith(STAGING_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("swiftune: removed %d unfinished checkpoint save(s) in %s (a run stopped while saving): %s",
                    len(removed), run_dir, ", ".join(os.path.basename(p) for p in removed))
    return removed


def discard_checkpoint(path: str) -> None:
    """Remove the checkpoint folder ``path``: renamed to a hidden name first, so that a run killed
    while deleting it leaves no half-deleted ``checkpoint-N`` that still holds its marker."""
    aside = os.path.join(os.path.dirname(path), DELETED_PREFIX + os.path.basename(path))
    if os.path.exists(aside):
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(path, aside)
    except OSError:
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """transformers' ``rotate_checkpoints`` (the newest kept, the best one kept, the oldest removed down to
    ``save_total_limit``), each removal through :func:`discard_checkpoint`, with "newest" read from the
    completion markers' write times (:func:`checkpoints_oldest_first`), not from folder mtimes or step numbers."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = checkpoints_oldest_first(run_dir)
    if len(checkpoints) <= save_total_limit:
        return
    protected = {os.path.abspath(checkpoints[-1])}
    if best_model_checkpoint is not None:
        protected.add(os.path.abspath(best_model_checkpoint))
    remaining = len(checkpoints)
    for path in checkpoints:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if os.path.abspath(path) not in protected:
            discard_checkpoint(path)
            remaining -= 1


def checkpoints_oldest_first(run_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``run_dir``, the one written last at the end: ordered by the time their
    completion markers record, folders without one first, steps breaking ties. transformers orders by folder
    mtime, or by step where it finds mtimes unreliable; after a run started from scratch in an earlier run's
    output_dir, step order ranks the earlier run's higher steps as newer, and the rotation then removed the
    checkpoint just written."""
    def written(item: tuple[int, str]) -> tuple[int, float, int]:
        step, path = item
        marker = read_marker(path)
        when = marker.get("time") if marker else None
        return (0, 0.0, step) if not isinstance(when, (int, float)) else (1, float(when), step)

    return [path for _, path in sorted(list_checkpoints(run_dir), key=written)]


def write_json_atomic(path: str, data: Any) -> None:
    """``path`` holds ``data`` as JSON or keeps what it held: written beside it, synced, renamed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_marker(folder: str, step: int, settings: dict[str, Any], model_only: bool = False) -> None:
    """The completion marker; ``model_only``: saved with ``save_only_model=True`` (no optimizer,
    scheduler or random states: not resumable, :func:`resume_problem`)."""
    write_json_atomic(os.path.join(folder, MARKER_NAME), {
        "complete": True, "step": step, "time": time.time(), "settings": settings, "model_only": model_only})


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(staged: str, final: str) -> None:
    """Make the complete ``staged`` folder ``final`` with one rename (an existing ``final``, e.g. of
    another run in a reused output_dir, is moved aside first and removed after)."""
    aside = None
    if os.path.exists(final):
        aside = os.path.join(os.path.dirname(final), f"{REPLACED_PREFIX}{os.path.basename(final)}")
        if os.path.exists(aside):
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(staged, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    _fsync_dir(os.path.dirname(final))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    root = os.path.dirname(staged)
    if os.path.basename(root).startswith(STAGING_PREFIX):
        shutil.rmtree(root, ignore_errors=True)


FINAL_STAGING_NAME = f"{STAGING_PREFIX}final"


def final_staging_dir(output_dir: str) -> str:
    """The hidden folder a command's final save writes into before its files move into ``output_dir``
    (a leftover of a run killed while saving is removed with the other ``.saving-*`` folders)."""
    return os.path.join(output_dir, FINAL_STAGING_NAME)


def move_saved_files(staged: str, output_dir: str) -> list[str]:
    """Move everything the final save wrote into ``staged`` into ``output_dir``, one rename each (a file
    or folder of the same name, e.g. from an earlier run into the same folder, is replaced), then remove
    ``staged``. No file in ``output_dir`` is ever half-written: a run stopped before the moves leaves the
    earlier files as they were, and each move is a rename. Returns the names moved."""
    names = sorted(os.listdir(staged))
    for name in names:
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            discard_checkpoint(target)  # os.replace cannot replace a folder that holds files
        os.replace(os.path.join(staged, name), target)
    _fsync_dir(output_dir)
    shutil.rmtree(staged, ignore_errors=True)
    return names


_WRITE_FAILURE_TEXT = ("unexpected pos", "pytorchstreamwriter", "file write failed", "no space left",
                       "disk quota", "write failed")


def is_write_failure(error: BaseException) -> bool:
    """An error of writing files: any OSError, and torch's serializer failures (a full disk makes
    ``torch.save`` fail with ``RuntimeError: ... unexpected pos 601792 vs 601680``)."""
    if isinstance(error, OSError):
        return True
    return isinstance(error, RuntimeError) and any(t in str(error).lower() for t in _WRITE_FAILURE_TEXT)


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def save_failure(error: BaseException, run_dir: str, step: int) -> CheckpointSaveError:
    """The error to raise when writing ``checkpoint-{step}`` into ``run_dir`` failed: what failed,
    whether the disk is full, which checkpoint is still usable and how to go on."""
    free = _free_bytes(run_dir)
    code = getattr(error, "errno", None)
    full = code in (errno.ENOSPC, errno.EDQUOT) or "no space left" in str(error).lower() or (
        free is not None and free < 64 * 2**20)
    target = os.path.join(run_dir, checkpoint_name(step))
    if full:
        what = (f"the disk is full: writing {target} failed ({error}); "
                f"{free / 2**20:.0f} MiB left on the filesystem of {run_dir}" if free is not None else
                f"the disk is full: writing {target} failed ({error})")
    elif isinstance(error, RuntimeError):
        what = (f"writing {target} failed: {error} (torch's file writer fails like this when the disk fills up "
                "or the folder's filesystem goes away: check its free space)")
    else:
        what = f"writing {target} failed: {error}"
    previous, _ = newest_complete_checkpoint(run_dir)
    keep = (f"The previous checkpoint {previous} is complete and untouched: free space (or lower "
            "save_total_limit, or choose an output_dir on a larger disk) and resume from it with "
            "resume_from_checkpoint=True." if previous else
            "No earlier checkpoint exists; free space or choose an output_dir on a larger disk and start again.")
    out = CheckpointSaveError(f"{what}. The unfinished save was removed. {keep}")
    out.errno = code if code is not None else (errno.ENOSPC if full else errno.EIO)
    return out


# ------------------------------------------------------------------------------------ reading


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``run_dir``, newest (highest step) first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(run_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def read_marker(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, MARKER_NAME)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete."""
    if not os.path.isdir(folder):
        return "no such folder"
    marker = read_marker(folder)
    if marker is not None:
        return None if marker.get("complete") else "its completion marker says it is incomplete"
    if os.path.exists(os.path.join(folder, MARKER_NAME)):
        return f"its completion marker {MARKER_NAME} is unreadable"
    try:
        with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
            json.load(f)
    except FileNotFoundError:
        return f"it has no {TRAINER_STATE_NAME} (the save was cut short)"
    except (OSError, ValueError):
        return f"its {TRAINER_STATE_NAME} is unreadable (the save was cut short)"
    return None


def newest_complete_checkpoint(run_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint of ``run_dir`` (or None) and the newer ones skipped, with why."""
    skipped = []
    for _, path in list_checkpoints(run_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def resolve_resume(resume: str | bool | None, run_dir: str, *, warn: bool = True) -> str | None:
    """The checkpoint folder to resume from: ``True`` = the newest complete one in ``run_dir``
    (skipping incomplete ones with a warning, unless ``warn=False``: a check ahead of the trainer's own
    call); a path must be a complete checkpoint."""
    if resume is None or resume is False:
        return None
    if resume is True:
        path, skipped = newest_complete_checkpoint(run_dir)
        if warn:
            for bad, why in skipped:
                logger.warning("swiftune: skipping %s for resuming: %s", bad, why)
        if path is None:
            found = f" ({len(skipped)} incomplete: {', '.join(os.path.basename(p) for p, _ in skipped)})" \
                if skipped else ""
            raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in output_dir {run_dir}{found}; "
                             "start without resume_from_checkpoint, or give a checkpoint folder")
        if skipped and warn:
            logger.warning("swiftune: resuming from %s, the newest complete checkpoint", path)
        return path
    path = str(resume)
    problem = checkpoint_problem(path)
    if problem is not None:
        parent = os.path.dirname(os.path.abspath(path))
        newest, _ = newest_complete_checkpoint(parent)
        hint = f"; the newest complete checkpoint beside it is {newest}" if newest else ""
        raise ValueError(f"resume_from_checkpoint={path!r} cannot be resumed from: {problem}{hint}")
    return path


def warn_on_earlier_checkpoints(run_dir: str, save_total_limit: int | None) -> list[str]:
    """Warn once when a run that starts from scratch (no ``resume_from_checkpoint``) finds ``checkpoint-N``
    folders of an earlier run in ``run_dir``: its own checkpoints replace theirs of the same step, its rotation
    removes the oldest (theirs first), and a later ``resume_from_checkpoint=True`` takes the highest step of
    either run. Returns their names, newest first (empty: nothing to say)."""
    names = [os.path.basename(path) for _, path in list_checkpoints(run_dir)]
    if not names:
        return []
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    rotation = (f"; with save_total_limit={save_total_limit} its rotation removes the oldest checkpoints, the "
                "earlier run's first" if save_total_limit else "")
    logger.warning("swiftune: output_dir %s already holds checkpoints of an earlier run (%s), and this run starts "
                   "from scratch (no resume_from_checkpoint). Its checkpoints replace those of the same step%s, and "
                   "resume_from_checkpoint=true would later take the highest step of either run. To keep that run's "
                   "checkpoints, choose another output_dir; to continue that run, pass resume_from_checkpoint=true "
                   "(--resume_from_checkpoint true).", run_dir, shown, rotation)
    return names


# ------------------------------------------------------------------------------------ settings


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def run_settings(trainer_kind: str, args: Any, keys: tuple[str, ...], model: Any = None,
                 num_processes: int = 1) -> dict[str, Any]:
    """The settings of a run that a checkpoint records and a resume compares: the trainer, the
    ``keys`` fields of ``args`` that exist, the number of processes and the model's shape."""
    missing = object()
    settings: dict[str, Any] = {"trainer": trainer_kind, "num_processes": num_processes}
    for key in keys:
        value = getattr(args, key, missing)
        if value is not missing:
            settings[key] = _plain(value)
    global_batch = global_batch_size(settings)
    if global_batch is not None:
        settings["global_batch_size"] = global_batch
    if model is not None:
        config = getattr(model, "config", None)
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
            value = getattr(config, key, None)
            if value is not None:
                settings[f"model.{key}"] = _plain(value)
        settings["model.lora"] = hasattr(model, "peft_config")
        settings["model.trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        settings["model.quantization"] = weight_quantization(model)
    return settings


def weight_quantization(model: Any) -> str:
    """How the frozen base weights are stored: ``"4bit"`` (bitsandbytes NF4/FP4: QLoRA), ``"8bit"``,
    ``"fp8"`` or ``"none"``. Adapters of a QLoRA run resume onto an unquantised base (or the reverse)
    without an error, training on another base than the checkpoint's: a resume says so."""
    kinds = set()
    for p in model.parameters():
        name = type(p).__name__
        if name == "Params4bit":
            kinds.add("4bit")
        elif name == "Int8Params":
            kinds.add("8bit")
        elif "float8" in str(p.dtype):
            kinds.add("fp8")
    return "+".join(sorted(kinds)) or "none"


def global_batch_size(settings: dict[str, Any]) -> int | None:
    """Examples (GRPO: completions) per optimizer step over all processes: per-device batch x
    gradient accumulation x processes, from recorded settings (None when one is missing)."""
    parts = [settings.get(k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_processes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in parts):
        return None
    return parts[0] * parts[1] * parts[2]


DATA_KEYS = ("data.rows", "data.sample_hash")


def _row_value(value: Any) -> Any:
    """A JSON stand-in for a value of a dataset row that json cannot write (arrays, tensors, bytes, images)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (bytes, bytearray)):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes"):  # a PIL image
        return [type(value).__name__, getattr(value, "size", None), hashlib.sha256(value.tobytes()).hexdigest()]
    return type(value).__name__  # never repr: it can hold a memory address that differs per run


def dataset_fingerprint(dataset: Any, sample: int = 8) -> dict[str, Any]:
    """``{"data.rows": n, "data.sample_hash": h}`` of a training dataset (empty for one without a
    length, e.g. an iterable dataset): its row count and a hash of a few rows (the first and the last
    ``sample`` and ``sample`` spread between), so it costs the same for a billion rows as for ten.

    A resumed run skips as many batches as the checkpoint's steps trained, of whatever data it is given:
    with another dataset (another file, another shuffle, rows added or removed, or another tokenization
    of the same rows) it continues at another place than where the checkpoint stopped; the checkpoint
    records this so that a resume can say so (:func:`warn_on_changed_settings`)."""
    try:
        n = len(dataset)
    except TypeError:
        return {}
    if n == 0:
        return {"data.rows": 0}
    spread = [round(i * (n - 1) / (sample + 1)) for i in range(1, sample + 1)]
    indices = sorted(set(range(min(sample, n))) | set(range(max(0, n - sample), n)) | set(spread))
    digest = hashlib.sha256()
    try:
        for i in indices:
            row = dataset[i]
            digest.update(json.dumps(row, sort_keys=True, default=_row_value).encode())
    except Exception as e:  # a dataset that cannot be indexed or written: the row count alone
        logger.debug("swiftune: no sample hash of the training dataset (%s)", e)
        return {"data.rows": n}
    return {"data.rows": n, "data.sample_hash": digest.hexdigest()[:16]}


# Settings that change together with the number of processes when the global batch stays the same.
_WORLD_SIZE_KEYS = ("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps")


def settings_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key: checkpoint X, this run Y"`` for every recorded setting that differs. A change of the
    number of processes that keeps the global batch (per-device batch x accumulation x processes) is
    not a difference: the resumed run continues at the same sample (:func:`world_size_change`)."""
    saved = {**saved, "global_batch_size": global_batch_size(saved)}
    current = {**current, "global_batch_size": global_batch_size(current)}
    same_global = saved["global_batch_size"] is not None and saved["global_batch_size"] == current["global_batch_size"]
    out = []
    for key in sorted(set(saved) | set(current)):
        if (same_global and key in _WORLD_SIZE_KEYS) or key in DATA_KEYS:  # data: data_difference
            continue
        if key in saved and key in current and saved[key] != current[key]:
            out.append(f"{key}: checkpoint {saved[key]!r}, this run {current[key]!r}")
    return out


def world_size_change(saved: dict[str, Any], current: dict[str, Any]) -> tuple[bool, str] | None:
    """``(continues, what it means)`` for a resume on another number of processes (None when the
    number is the same); ``continues``: the global batch is the same, so the data continues exactly.

    The Trainer skips ``global_step x gradient_accumulation_steps`` batches of the resumed run's
    loader; each process's loader yields its share of the sampler's global order (accelerate's
    round-robin of per-device batches; GRPO's generation sampler: whole prompt groups per process).
    So with the same global batch the run continues at the sample where the checkpoint stopped;
    with another global batch it does not. The Trainer's random states are saved per process
    (``rng_state_{rank}.pth``, ``rng_state.pth`` for one process) and are not restored when the
    number changes: only dropout and sampling draw from them (the data order is seeded by epoch)."""
    before, after = saved.get("num_processes"), current.get("num_processes")
    if before is None or after is None or before == after:
        return None
    old, new = global_batch_size(saved), global_batch_size(current)
    if old is not None and old == new:
        return True, (f"written by {before} process(es), resumed on {after}: the global batch is the same ({new}), "
                      "so the run continues at the sample where the checkpoint stopped; the per-process random states "
                      "(dropout, sampling) start afresh")
    accumulation = current.get("gradient_accumulation_steps")
    fix = (f" (set per_device_train_batch_size = {old} / ({after} processes x {accumulation} accumulation steps))"
           if old is not None and isinstance(accumulation, int) and old % (after * accumulation) == 0 else "")
    return False, (f"written by {before} process(es) with a global batch of {old}, resumed on {after} with a global "
                   f"batch of {new}: the resumed run skips the checkpoint's step count in batches of the new size, so it "
                   f"does not continue at the sample where the checkpoint stopped; keep the global batch{fix}")


# Recorded settings that decide which tensors a checkpoint holds: a model that differs in one cannot load them.
_MODEL_KEYS = ("model.lora", "model.trainable_parameters")


def resume_problem(folder: str, current: dict[str, Any]) -> str | None:
    """Why this run cannot continue from the complete checkpoint ``folder`` (None when it can): it
    was saved with ``save_only_model=True``, or its trained tensors belong to another model set-up
    (full fine-tuning against LoRA, another LoRA rank or target modules: transformers fails in its
    loading code, or resumes with a fresh optimizer and a restarted schedule without a word)."""
    marker = read_marker(folder)
    if marker is None:
        return None
    if marker.get("model_only"):
        return ("it was saved with save_only_model=True: it holds the model's weights but no optimizer, "
                "learning-rate scheduler or random states, so training cannot continue where it stopped (it would "
                "restart the optimizer and the schedule); start a new run from its weights (give the folder as the "
                "model), and keep save_only_model=False for checkpoints to resume from")
    saved = marker.get("settings")
    if not isinstance(saved, dict):
        return None
    diffs = [f"{key}: checkpoint {saved[key]!r}, this run {current[key]!r}" for key in _MODEL_KEYS
             if key in saved and key in current and saved[key] != current[key]]
    if diffs:
        return (f"it holds the trained tensors of another model set-up than this run's ({'; '.join(diffs)}): "
                "they cannot be loaded into this model; resume with the model, LoRA rank and target modules the "
                "checkpoint was written with, or start a separate run in another output_dir")
    return None


def data_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How the training data recorded in ``saved`` differs from ``current``'s (:func:`dataset_fingerprint`),
    or None (the same, or not recorded on one side)."""
    rows = (saved.get("data.rows"), current.get("data.rows"))
    hashes = (saved.get("data.sample_hash"), current.get("data.sample_hash"))
    if None not in rows and rows[0] != rows[1]:
        return f"{rows[0]} rows in the checkpoint's, {rows[1]} in this run's"
    if None not in hashes and hashes[0] != hashes[1]:
        return f"the same {rows[1]} rows in number, but other rows at the places sampled"
    return None


def warn_on_changed_settings(folder: str, current: dict[str, Any]) -> list[str]:
    """Warn (once, listing them) when ``folder``'s recorded settings differ from ``current``; say
    what a change of the number of processes means (:func:`world_size_change`)."""
    marker = read_marker(folder)
    saved = marker.get("settings") if marker else None
    if not isinstance(saved, dict):
        return []
    data = data_difference(saved, current)
    if data:
        step = marker.get("step")
        logger.warning("swiftune: resuming from %s with other training data than the checkpoint's (%s). The resumed run "
                       "skips the batches of the checkpoint's %s steps in this data, so it does not continue where the "
                       "checkpoint stopped: it trains other rows than the uninterrupted run would, and may leave some "
                       "rows untrained. Resume with the checkpoint's dataset (and tokenizer, chat template and length "
                       "settings); to train on this data from the checkpoint's weights, start a new run in another "
                       "output_dir from them.", folder, data, step if isinstance(step, int) else "recorded")
    diffs = settings_differences(saved, current)
    if diffs:
        logger.warning("swiftune: resuming from %s, written with other settings than this run's (another run's "
                       "output_dir, or changed options): %s. Resuming anyway; to start a separate run, choose "
                       "another output_dir.", folder, "; ".join(diffs))
    change = world_size_change(saved, current)
    if change is not None:
        continues, what = change
        (logger.info if continues else logger.warning)("swiftune: resuming from %s, %s.", folder, what)
    return diffs
