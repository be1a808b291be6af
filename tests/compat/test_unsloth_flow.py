"""Unsloth's SFT notebook flow (tests/compat/unsloth_flow.py) through swiftune, and on a CUDA machine
with Unsloth's wheels through Unsloth too, each in its own process, with only the imports changed.

On any machine the swiftune side runs end to end and is checked against the plain libraries: its
adapters start as PEFT's own (same seed), it trains (every step logged, finite, falling losses,
both LoRA matrices move), and ``for_inference`` + ``generate`` gives transformers' greedy tokens on
the base weights with the saved adapter merged by PEFT.

On a CUDA machine where Unsloth's wheels are installed in :data:`UNSLOTH_SITE` (or can be, from a
wheels folder: :func:`find_unsloth_site`), the same flow runs through Unsloth (its own process and
``PYTHONPATH``: it patches transformers, PEFT and TRL on import, and brings TRL 1.15) and the two
must start from the same LoRA A matrices, log per-step losses within bf16 tolerance
(:data:`BF16_LOSS_TOL`) over the same tokens, and log every metric name Unsloth logs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compat import unsloth_flow
from tests.compat.common import scratch_dir
from tests.helpers import rel_err

REPO = Path(__file__).resolve().parents[2]
FLOW = Path(unsloth_flow.__file__)
# Where scripts/gpu_suite.sh (part unsloth-flow) installs Unsloth's wheels with pip --target; else
# the first wheels folder found (a copy of the shared folder carried to the GPU machine, or the
# shared folder itself) is installed into a temporary one.
UNSLOTH_SITE = Path("/tmp/site-unsloth")
UNSLOTH_WHEELS = (REPO / ".shared" / "wheels" / "unsloth", REPO.parent / "shared" / "wheels" / "unsloth")
MAX_STEPS = 6
FAMILIES = ["qwen3", "llama"]

# Per-step losses, Unsloth vs swiftune, both bf16 on the GPU: bf16 keeps 8 significant bits (unit
# rounding 2^-8 ~ 4e-3 relative per operation) and the two run different kernels (Unsloth's fused LoRA
# MLP, RoPE and cross-entropy; swiftune's), so one forward's loss may differ by a few 1e-3 from the
# first step on; the later steps also carry the different rounding of the updates (8-bit Adam divides
# each gradient entry by its own magnitude, so entries near zero move by a full step either way).
# 2e-2 relative allows that (an estimate from the rounding, not yet a measured spread: the first GPU
# run prints both loss lists on failure) and is well below the ~8% the six steps move the loss (5.72
# to 5.25 for Qwen3 on CPU in float32).
BF16_LOSS_TOL = 2e-2
# LoRA A before training: both are PEFT's kaiming-uniform init drawn on the CPU from the same seed;
# a side that stores the adapters in bf16 rounds them by at most 2^-8 relative.
BF16_WEIGHT_TOL = 4e-3


def flow_env(pythonpath: list[str]) -> dict[str, str]:
    """The child's environment: this one with ``PYTHONPATH`` replaced (never inherited: the Unsloth
    child must not see TRL 1.16 or swiftune's source, the swiftune child not Unsloth's site) and
    without ``TRITON_INTERPRET``: on a CPU-only machine the test session sets it for the kernel
    tests, but here the flow is what is tested, and swiftune runs its plain-PyTorch kernels on
    CPU tensors then (the interpreted kernels would take minutes for the six steps)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=os.pathsep.join(pythonpath), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1")
    return env


def start_flow(impl: str, model_dir: str, out_dir: str, *extra: str, site: Path | None = None) -> subprocess.Popen:
    """One run of the notebook flow in a child process (output in ``out_dir``/flow.out, .err)."""
    if impl == "unsloth":
        path = [str(site)]
    else:  # the project's source, then whatever this process was given (the GPU machine's wheel site)
        path = [str(REPO / "src"), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    cmd = [sys.executable, str(FLOW), "--impl", impl, "--model", model_dir, "--out-dir", out_dir,
           "--max-steps", str(MAX_STEPS), *extra]
    env = flow_env(path)
    env["UNSLOTH_COMPILE_LOCATION"] = os.path.join(out_dir, "unsloth_compiled_cache")  # one per child: they run at once
    with open(os.path.join(out_dir, "flow.out"), "w") as out, open(os.path.join(out_dir, "flow.err"), "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=out_dir)


def finish_flow(proc: subprocess.Popen, impl: str, out_dir: str, timeout: float = 300) -> dict:
    """The ``RESULT`` of a run :func:`start_flow` started (the child is killed past ``timeout``)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stdout, stderr = (Path(out_dir, name).read_text() for name in ("flow.out", "flow.err"))
    found = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and found, f"{impl} flow failed (exit {proc.returncode}):\n{stderr[-4000:]}"
    result = json.loads(found[-1])
    result["out_dir"] = out_dir
    return result


@functools.lru_cache(maxsize=None)
def model_dir(family: str) -> str:
    """The tiny random-init folder, written in this process (which never imports Unsloth)."""
    return unsloth_flow.save_tiny_model(scratch_dir(f"unsloth-flow-{family}"), family)


def tensors(result: dict, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(result["out_dir"], name))


def find_unsloth_site(tmp_path_factory) -> Path | str:
    """A folder with Unsloth's wheels installed (pip ``--target``): :data:`UNSLOTH_SITE` when it has
    them, else a new one made from the first of :data:`UNSLOTH_WHEELS` that exists; or why there is
    none to use."""
    if not torch.cuda.is_available():
        return "Unsloth needs a CUDA GPU (its kernels and loader have no CPU path)"
    if (UNSLOTH_SITE / "unsloth" / "__init__.py").is_file():
        return UNSLOTH_SITE
    wheels = next((folder for folder in UNSLOTH_WHEELS if any(folder.glob("unsloth-*.whl"))), None)
    if wheels is None:
        return f"no Unsloth installed in {UNSLOTH_SITE} and no wheels in {' or '.join(map(str, UNSLOTH_WHEELS))}"
    site = tmp_path_factory.mktemp("site-unsloth")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
    return site


# (family, flow arguments): the 16-bit notebook and its QLoRA form (bitsandbytes' NF4, also on CPU)
CASES = [("qwen3", ()), ("llama", ()), ("qwen3", ("--load-in-4bit",))]
CASE_IDS = ["qwen3", "llama", "qwen3-4bit"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case through swiftune, and through Unsloth where it can run; on a GPU the children all
    at once (tiny models: one GPU holds them all, and most of a child's time is importing and
    compiling), on CPU one after another (their threads would share the same cores).
    By ``(impl, family, extra)``: the ``RESULT``, or why there is none; ``"unsloth_site"``: the
    Unsloth site folder, or why there is none."""
    site = find_unsloth_site(tmp_path_factory)
    impls = ["swiftune"] + (["unsloth"] if isinstance(site, Path) else [])
    started, results = {}, {"unsloth_site": site}

    def finish(key):  # wait for every child, failed or not; each test reports its own
        proc, out_dir = started.pop(key)
        try:
            results[key] = finish_flow(proc, key[0], out_dir)
        except AssertionError as failure:
            results[key] = str(failure)

    for impl in impls:
        for family, extra in CASES:
            out_dir = scratch_dir(f"flow-{impl}-{family}")
            proc = start_flow(impl, model_dir(family), out_dir, *extra, site=site if impl == "unsloth" else None)
            started[(impl, family, extra)] = (proc, out_dir)
            if not torch.cuda.is_available():
                finish((impl, family, extra))
    for key in list(started):
        finish(key)
    return results


def flow_result(runs: dict, impl: str, family: str, extra: tuple = ()) -> dict:
    found = runs[(impl, family, tuple(extra))]
    assert isinstance(found, dict), found
    return found


# ---------------------------------------------------------------------------------------------- swiftune


@pytest.mark.parametrize("family, extra", CASES, ids=CASE_IDS)
def test_swiftune_flow_trains(runs, family, extra):
    got = flow_result(runs, "swiftune", family, extra)
    assert got["load_in_4bit"] == bool(extra)
    losses = got["losses"]
    assert got["global_step"] == MAX_STEPS and len(losses) == MAX_STEPS, got["losses"]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses), losses
    # the toy task is learnable: the last step is below the first, the second half below the first
    assert losses[-1] < losses[0] and sum(losses[3:]) < sum(losses[:3]), losses
    # every step saw tokens (num_tokens counts up), and TRL's metric names are there
    assert all(b > a for a, b in zip(got["num_tokens"], got["num_tokens"][1:])), got["num_tokens"]
    assert {"loss", "grad_norm", "learning_rate", "num_tokens", "mean_token_accuracy", "entropy"} <= set(
        got["metric_names"])
    start, end = tensors(got, "lora_init.safetensors"), tensors(got, "lora_final.safetensors")
    lora_b = [n for n in end if "lora_B" in n]
    assert len(start) == len(lora_b) == 7 * 2, sorted(end)  # seven projections, two layers
    for name in start:  # A: trained once B is non-zero (from the second update on)
        assert not torch.equal(start[name], end[name]), f"{name} did not move"
    for name in lora_b:  # B: starts at zero (PEFT), so any non-zero entry is training
        assert end[name].abs().max() > 0, f"{name} is still zero"


@pytest.mark.parametrize("family, extra", CASES, ids=CASE_IDS)
def test_swiftune_lora_init_is_peft_seeded_by_random_state(runs, family, extra):
    """The notebook's ``random_state=3407`` gives PEFT's own initial adapters for that seed (plain
    transformers + ``peft.get_peft_model``, as Unsloth calls it after ``set_seed(random_state)``;
    PEFT draws them on the CPU in float32 whatever the base layer, NF4 ones included)."""
    import peft
    import transformers

    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir(family), dtype=torch.float32)
    torch.manual_seed(3407)
    plain = peft.get_peft_model(plain, peft.LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    want = {n: p.detach() for n, p in plain.named_parameters() if "lora_A" in n}
    run = flow_result(runs, "swiftune", family, extra)
    got = tensors(run, "lora_init.safetensors")
    assert set(got) == set(want)
    for name, value in want.items():
        if run["dtype"] == "torch.float32":
            assert torch.equal(got[name], value), name
        else:  # on the GPU PEFT casts the new adapters to the bf16 base weights' dtype, then back
            assert rel_err(got[name], value) <= BF16_WEIGHT_TOL, name


@pytest.mark.parametrize("family", FAMILIES)
def test_swiftune_for_inference_generate_is_greedy_on_the_merged_adapter(runs, family):
    """``for_inference`` + ``generate``: transformers' greedy decoding on the saved base weights
    with the adapter the flow saved, loaded and merged by PEFT (no swiftune code), in the run's
    dtype on the run's device.

    In float32 (CPU) the tokens must be the same. In bf16 (GPU) two sets of kernels may break a
    near-tie of the logits either way, so there each generated token must be the reference's
    arg-max up to bf16 rounding: its reference logit within ``BF16_LOSS_TOL`` of the largest
    logit's magnitude below the largest, with the reference run on the generated sequence."""
    import peft
    import transformers

    got = flow_result(runs, "swiftune", family)
    dtype, device = getattr(torch, got["dtype"].removeprefix("torch.")), torch.device(got["device"])
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir(family), dtype=dtype).to(device)
    merged = peft.PeftModel.from_pretrained(base, os.path.join(got["out_dir"], "lora_model"))
    trained = tensors(got, "lora_final.safetensors")  # the saved adapter is the trained one
    for name, p in merged.named_parameters():
        if "lora_" in name:  # (bf16: PEFT may hold the loaded adapter in the base weights' dtype)
            loaded = p.detach().float().cpu()
            assert torch.equal(loaded, trained[name]) or (dtype != torch.float32 and rel_err(
                loaded, trained[name]) <= BF16_WEIGHT_TOL), name
    merged = merged.merge_and_unload().eval()
    prompt, generated = got["prompt_ids"], got["generated_ids"]
    assert generated, "nothing was generated"
    sequence = torch.tensor([prompt + generated], device=device)
    with torch.no_grad():
        logits = merged(sequence, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    chosen = torch.tensor(generated, device=device)
    below_max = logits.max(dim=-1).values - logits.gather(1, chosen[:, None])[:, 0]
    if dtype == torch.float32:
        with torch.no_grad():
            out = merged.generate(sequence[:, :len(prompt)], attention_mask=torch.ones_like(sequence[:, :len(prompt)]),
                                  do_sample=False, max_new_tokens=len(generated), use_cache=True)
        assert out[0, len(prompt):].tolist() == generated
        assert below_max.max() == 0
    else:
        assert below_max.max() <= BF16_LOSS_TOL * logits.abs().max(), below_max.tolist()


# ---------------------------------------------------------------------------------------------- Unsloth


@pytest.mark.parametrize("family, extra", CASES, ids=CASE_IDS)
def test_unsloth_and_swiftune_run_the_same_notebook_alike(runs, family, extra):
    if not isinstance(runs["unsloth_site"], Path):
        pytest.skip(runs["unsloth_site"])
    ref, got = flow_result(runs, "unsloth", family, extra), flow_result(runs, "swiftune", family, extra)
    assert ref["dtype"] == got["dtype"] == "torch.bfloat16", (ref["dtype"], got["dtype"])
    # the same initial adapters (same seed, PEFT's init): else the later steps could not be compared
    ref_a, got_a = tensors(ref, "lora_init.safetensors"), tensors(got, "lora_init.safetensors")
    assert set(ref_a) == set(got_a), (sorted(set(ref_a) ^ set(got_a)))[:4]
    worst = max(ref_a, key=lambda n: rel_err(got_a[n], ref_a[n]))
    assert rel_err(got_a[worst], ref_a[worst]) <= BF16_WEIGHT_TOL, worst
    # the same steps over the same tokens (the tokenization of the text column agrees)
    assert len(ref["losses"]) == len(got["losses"]) == MAX_STEPS
    if all(n is not None for n in ref["num_tokens"]):
        assert ref["num_tokens"] == got["num_tokens"], (ref["num_tokens"], got["num_tokens"])
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"]), start=1):
        assert abs(a - b) <= BF16_LOSS_TOL * abs(a), (f"step {step}: Unsloth {a:.5f}, swiftune {b:.5f}; "
                                                f"Unsloth {ref['losses']}, swiftune {got['losses']}")
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]  # the comparison is over training steps
    missing = set(ref["metric_names"]) - set(got["metric_names"])
    assert not missing, f"Unsloth logs {sorted(missing)}, swiftune does not"
    assert ref["generated_ids"] and got["generated_ids"], "for_inference + generate gave no token"
