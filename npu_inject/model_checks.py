"""What a model family or config needs that a target may lack, or sets that no job can take, as one line
naming it and what would work instead.

The checks patch ``model_guard`` runs at start-up (it stops the job with the line) and ``npu-inject plan``
runs before it plans (:mod:`npu_inject.planner.config`). Each ``*_problem`` function returns that line, or
None when the target can train what it was given.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from dataclasses import dataclass

from npu_inject.extras import install_hint

MAKE_ASSETS = "python tools/make_assets.py (text) / python tools/make_sft_assets.py (SFT)"


@dataclass(frozen=True)
class Needs:
    """One optional import a model family needs: import name, distribution, what uses it."""

    import_name: str
    distribution: str
    used_for: str


# Per family (the --module short name): optional packages imported by its config registry.
FAMILY_NEEDS = {
    "kimi_k2_7": (Needs("torchvision", "torchvision", "its multimodal data loader decodes images"),),
    "flux": (Needs("transformers", "transformers", "its CLIP/T5 text encoders and tokenizers"),),
    "qwen3_5": (Needs("torchvision", "torchvision", "its multimodal data loader decodes images"),),
}
# Families whose model imports a package only a patch's stand-in makes runnable here:
# family -> (import name, spec.origin of the stand-in, why the real package cannot run).
STANDIN_FAMILIES = {
    "qwen3_5": ("fla", "npu_inject.patches.gated_delta_net",
                "its gated delta-net layers call flash-linear-attention's Triton/CUDA kernels (import fla), "
                "which neither the NPU nor the CPU rehearsal runs; enable patch gated_delta_net (on by default) "
                "to run them in chunked PyTorch"),
}
# torchtitan's data set names whose default path is local: its registries (hf_datasets/
# text_datasets.py DATASETS, hf_datasets/multimodal/mm_datasets.py MM_DATASETS, models/flux/
# flux_datasets.py DATASETS) resolve `path = dataset_path or default` for the lowercased name, a
# default relative to the working directory (its repository's tests/assets).
LOCAL_DATASETS = {
    "c4_test": ("tests/assets/c4_test", "python tools/make_assets.py writes it"),
    "cc12m-test": ("tests/assets/cc12m_test", "python tools/make_mm_assets.py writes a small image-text set "
                                              "there (torchtitan's own is in its source repository, not its wheel)"),
}
# The files torchtitan's HuggingFaceTokenizer (and its subclasses) loads from --hf_assets_path, one of them
# being enough; and the folder the debug configs name (./tests/assets/tokenizer), relative to the working directory.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
LOCAL_TOKENIZER = ("tests/assets/tokenizer", "python tools/make_assets.py writes it")
# Optimizers (a param group's optimizer_name) that torchtitan builds for CUDA parameters only.
CUDA_ONLY_OPTIMIZERS = {
    "DistMuon": ("DistMuon (torchtitan.distributed.flex_shard), which refuses parameters off CUDA "
                 "(\"DistMuon requires one CUDA device per process\")"),
}
# torchtitan's in-repo --override.imports modules that import a kernel package:
# module -> (import name, why the override cannot run without it, what to do).
OVERRIDE_NEEDS = {
    "torchtitan.overrides.helion_rope": (
        "helion", "Helion is a Triton-based kernel DSL for CUDA GPUs with no NPU backend",
        "drop the override (RoPE then runs as npu_rotary_mul through the rotary patch)"),
    "torchtitan.overrides.fused_swiglu": (
        "triton", "the module defines Triton kernels when imported",
        "install triton (triton-ascend on Ascend machines); only the import is needed, its ops run "
        "npu_swiglu through the overrides_kernels patch"),
    "torchtitan.overrides.fused_mla": (
        "triton", "the module defines Triton kernels when imported",
        "install triton (triton-ascend on Ascend machines); only the import is needed, its attention "
        "runs the stock path off CUDA"),
}
QUANTIZATION_RECIPES = {
    "float8.py": "float8 (torchao Float8Linear), which needs torchao and an NVIDIA SM89+ or AMD MI300 GPU",
    "mx.py": ("MXFP8 (torchao MXFP8Linear), which needs torchao and an NVIDIA SM100 GPU (Ascend 950's "
              "npu_dynamic_mx_quant + npu_quant_matmul path is not implemented)"),
    "nvfp4.py": "NVFP4 (torchao NVFP4Linear), which needs torchao and an NVIDIA SM100 GPU",
}

# Sizes and counts that torchtitan and the patches divide by, index with or loop over, as
# (section, field, whether a value is valid, what is valid). Outside them the job fails later, as a
# traceback far from the flag: --training.seq_len 0 gives empty samples and an IndexError in the data
# loader's first batch, --training.local_batch_size 0 a ZeroDivisionError in Trainer.__init__.
SETTING_RULES = (
    ("training", "seq_len", lambda n: n >= 1, ">= 1 (tokens per sample)"),
    ("training", "local_batch_size", lambda n: n >= 1, ">= 1 (samples per data-parallel rank and micro step)"),
    ("training", "global_batch_size", lambda n: n != 0,
     ">= 1, or -1 for local_batch_size x the data-parallel degree (the default)"),
    ("training", "steps", lambda n: n >= 0, ">= 0 (optimizer steps to train)"),
    ("parallelism", "data_parallel_replicate_degree", lambda n: n >= 1, ">= 1"),
    ("parallelism", "data_parallel_shard_degree", lambda n: n == -1 or n >= 1,
     ">= 1, or -1 for the ranks the other degrees leave (the default)"),
    ("parallelism", "context_parallel_degree", lambda n: n >= 1, ">= 1"),
    ("parallelism", "tensor_parallel_degree", lambda n: n >= 1, ">= 1"),
    ("parallelism", "pipeline_parallel_degree", lambda n: n >= 1, ">= 1"),
    ("parallelism", "expert_parallel_degree", lambda n: n >= 1, ">= 1"),
)


def setting_problem(config) -> str | None:
    """The first size or count in ``config`` (torchtitan's, command line merged) outside :data:`SETTING_RULES`."""
    for section, name, valid, what in SETTING_RULES:
        value = getattr(getattr(config, section, None), name, None)
        if isinstance(value, int) and not valid(value):
            return f"--{section}.{name} {value} is not valid: it must be {what}"
    return None


def selection(args: list[str]) -> tuple[str | None, str | None]:
    """(family short name, config name) from ``--module``/``--config`` in either CLI form."""
    found: dict[str, str] = {}
    for index, arg in enumerate(args):
        for flag in ("--module", "--config"):
            if arg.startswith(flag + "="):
                found[flag] = arg.split("=", 1)[1]
            elif arg == flag and index + 1 < len(args):
                found[flag] = args[index + 1]
    module = found.get("--module")
    if module is not None:
        module = module.removesuffix(".config_registry").removeprefix("torchtitan.models.")
    return module, found.get("--config")


def family_problem(family: str | None, target: str) -> str | None:
    if family in STANDIN_FAMILIES:
        import_name, origin, why = STANDIN_FAMILIES[family]
        if getattr(importlib.util.find_spec(import_name), "origin", None) != origin:
            return f"--module {family} cannot train on target {target}: {why}"
    missing = [needs for needs in FAMILY_NEEDS.get(family, ()) if importlib.util.find_spec(needs.import_name) is None]
    if not missing:
        return None
    what = ", ".join(f"{needs.distribution} ({needs.used_for})" for needs in missing)
    return f"--module {family} needs {what}, not installed: " + "; ".join(
        install_hint(needs.distribution) for needs in missing)


def quantization_problem(exc: BaseException, config: str | None, target: str) -> str | None:
    """The recipe whose converter raised ``exc`` (from torchtitan.components.quantization), or None."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        directory, filename = os.path.split(frame.filename)
        if directory.endswith(os.path.join("components", "quantization")) and filename in QUANTIZATION_RECIPES:
            return (f"--config {config} trains in {QUANTIZATION_RECIPES[filename]}; target {target} has no "
                    f"such path: use the config without the quantization suffix (torchtitan says: {exc})")
    return None


def optimizer_problem(config, config_name: str | None, target: str) -> str | None:
    groups = getattr(getattr(config, "optimizer", None), "param_groups", None) or ()
    for name in dict.fromkeys(getattr(group, "optimizer_name", None) for group in groups):
        if name in CUDA_ONLY_OPTIMIZERS:
            return (f"--config {config_name} optimizes with {CUDA_ONLY_OPTIMIZERS[name]}; target {target} "
                    f"has no {name} (not implemented by npu_inject)")
    return None


def override_problem(config, target: str) -> str | None:
    """The first ``--override.imports`` entry whose module needs a kernel package that is not importable."""
    entries = getattr(getattr(config, "override", None), "imports", None) or ()
    for entry in entries:
        name = entry if isinstance(entry, str) else entry[0]  # a bare target or (target, kwargs)
        needs = OVERRIDE_NEEDS.get(name.rpartition(".")[0])
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            package, why, what = needs
            return (f"--override.imports {name} needs {package}, which is not installed ({why}); "
                    f"target {target}: {what}")
    return None


def _hub_id_or_builder(path: str) -> bool:
    """Whether datasets.load_dataset (4.x, dataset_module_factory) takes a path that is no local
    directory as a Hub data set id or a packaged builder ('json', 'parquet'): a relative path with at
    most one '/'. Any other path must be a local directory; a URL is not checked."""
    return "://" in path or (not os.path.isabs(path) and path.count("/") <= 1)


def _dataset_problem(loader, flag: str, config_name: str | None) -> str | None:
    """The local data set ``loader`` (a dataloader config, or one of its sources) reads, if missing."""
    name = str(getattr(loader, "dataset", "") or "").lower()
    given = getattr(loader, "dataset_path", None)
    if given:  # torchtitan: path = dataset_path or the name's default
        if os.path.isdir(given) or _hub_id_or_builder(given):
            return None
        what = "is a file" if os.path.exists(given) else "does not exist"
        return (f"--config {config_name}: {flag} {os.path.abspath(given)} {what}; torchtitan reads "
                f"{'data set ' + repr(name) if name else 'the data set'} from there with "
                "datasets.load_dataset, which needs a directory (or a Hub id such as 'allenai/c4')")
    if name in LOCAL_DATASETS:
        path, how = LOCAL_DATASETS[name]
        if not os.path.isdir(path):
            return (f"--config {config_name} reads data set {name!r} from {os.path.abspath(path)} (torchtitan's "
                    f"default for that name, relative to the working directory), which does not exist: {how}, "
                    f"or pass {flag} DIR")
    return None


def _tokenizer_problem(config, config_name: str | None) -> str | None:
    """The tokenizer folder the trainer builds its tokenizer from (``--hf_assets_path``), if it is missing.

    Only a HuggingFaceTokenizer reads it (``Trainer.__init__``: ``config.tokenizer.build(tokenizer_path=
    config.hf_assets_path)``); flux's tokenizers take their own paths, and a config without a tokenizer
    reads none."""
    tokenizer, path = getattr(config, "tokenizer", None), getattr(config, "hf_assets_path", None)
    if tokenizer is None or not isinstance(path, str):
        return None
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not isinstance(tokenizer, HuggingFaceTokenizer.Config):
        return None
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            return None
        what = f"holds none of the files torchtitan's tokenizer loads ({', '.join(TOKENIZER_FILES)})"
    else:
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
    local, how = LOCAL_TOKENIZER
    if os.path.normpath(path) == local:
        get = f"{how} (run from this repository, or pass --hf_assets_path DIR)"
    else:
        get = ("put the model's Hugging Face tokenizer files there (torchtitan's scripts/download_hf_assets.py "
               "--repo_id ORG/MODEL --assets tokenizer, in its source repository), or pass --hf_assets_path DIR")
    return (f"--config {config_name} builds its tokenizer from --hf_assets_path {os.path.abspath(path)}, which "
            f"{what}: {get}")


def data_problem(config, config_name: str | None) -> str | None:
    # The tokenizer first: torchtitan builds it before the data loader.
    problem = _tokenizer_problem(config, config_name)
    if problem is not None:
        return problem
    dataloader = getattr(config, "dataloader", None)
    validator = getattr(config, "validator", None)
    loaders = [("--dataloader", dataloader)]
    if getattr(validator, "enable", False):
        loaders.append(("--validator.dataloader", getattr(validator, "dataloader", None)))
    for prefix, loader in loaders:
        sources = getattr(loader, "sources", None)  # the Interleaved* loaders read each source
        for flag, source in ([(f"{prefix}.sources[{i}].dataset_path", x) for i, x in enumerate(sources)]
                             if isinstance(sources, list) else [(f"{prefix}.dataset_path", loader)]):
            problem = _dataset_problem(source, flag, config_name)
            if problem is not None:
                return problem
    data_files = (getattr(dataloader, "load_dataset_kwargs", None) or {}).get("data_files")
    for path in [data_files] if isinstance(data_files, str) else list(data_files or ()):
        if isinstance(path, str) and not os.path.exists(path):
            return (f"--config {config_name} reads data_files {os.path.abspath(path)}, which does not exist: "
                    f"run from a directory that has it ({MAKE_ASSETS} write this repository's tests/assets)")
    autoencoder = getattr(getattr(config, "encoder", None), "autoencoder_path", None)
    if isinstance(autoencoder, str) and not os.path.exists(autoencoder):
        return (f"--config {config_name} loads its autoencoder from {os.path.abspath(autoencoder)}, which does "
                f"not exist: put FLUX.1-dev's ae.safetensors (Hugging Face black-forest-labs/FLUX.1-dev) there")
    return None


# torchtitan's TorchFTManager builds these torchft process groups (experiments/torchft/manager.py); hccl is the
# runtime's (patches/torchft_npu.py; the rehearsal runs it, and nccl, on gloo).
FT_PROCESS_GROUPS = ("gloo", "nccl", "mccl", "hccl")
LIGHTHOUSE_CONNECT_TIMEOUT_S = 5.0
# torchft 0.2.0's defaults: the manager's quorum timeout (TORCHFT_QUORUM_TIMEOUT_SEC overrides it; torchtitan passes
# none) and the lighthouse's heartbeat timeout (its --heartbeat_timeout_ms, which a replica cannot read).
FT_QUORUM_TIMEOUT_S = 60
FT_QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
FT_HEARTBEAT_TIMEOUT_S = 5


def lighthouse_problem(address: str | None) -> str | None:
    """Why torchft's lighthouse at ``address`` (TORCHFT_LIGHTHOUSE, ``http://host:port``) cannot be reached, or None."""
    import socket
    from urllib.parse import urlsplit

    if not address:
        return ("--fault_tolerance.enable needs torchft's lighthouse: start `torchft_lighthouse --min_replicas 1` "
                "and set TORCHFT_LIGHTHOUSE=http://<its host>:29510 on every replica group")
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        return f"TORCHFT_LIGHTHOUSE={address!r} is not http://host:port"
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=LIGHTHOUSE_CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return (f"TORCHFT_LIGHTHOUSE={address}: no lighthouse answers there ({exc.strerror or exc}); "
                "start `torchft_lighthouse --min_replicas 1` on that host first")


def hang_timeout_problem(config, environ=os.environ) -> str | None:
    """Why a hung rank would take every replica group down with this torchft job's timeouts, or None.

    With patch torchft_leave, a group with a hung rank leaves the quorum after ``--comm.train_timeout_seconds``
    and the lighthouse's heartbeat timeout; the other groups wait for that in their quorum, which times out after
    torchft's quorum timeout and fails them too (docs/fault-tolerance.md, measured with ``hang@4:rank=1``)."""
    train_s = getattr(getattr(config, "comm", None), "train_timeout_seconds", 0)
    if train_s <= 0:
        return None
    raw = environ.get(FT_QUORUM_TIMEOUT_ENV)
    if raw is None:
        quorum_s = FT_QUORUM_TIMEOUT_S
    else:
        try:
            quorum_s = int(raw)  # as torchft parses it
        except ValueError:
            return f"{FT_QUORUM_TIMEOUT_ENV}={raw!r} is not a whole number of seconds (torchft reads it with int())"
    if train_s + FT_HEARTBEAT_TIMEOUT_S < quorum_s:
        return None
    return (f"--comm.train_timeout_seconds {train_s} plus the lighthouse's heartbeat timeout (torchft's default "
            f"{FT_HEARTBEAT_TIMEOUT_S} s) is not under torchft's quorum timeout ({quorum_s} s, "
            f"{FT_QUORUM_TIMEOUT_ENV}): a hung rank in one replica group would hold the other groups' quorum until it times out and every "
            f"group would go down; use --comm.train_timeout_seconds below {quorum_s - FT_HEARTBEAT_TIMEOUT_S} "
            f"(llama3_torchft_debugmodel sets 15) or raise {FT_QUORUM_TIMEOUT_ENV} (docs/fault-tolerance.md)")


def fault_tolerance_problem(config, target: str, environ=os.environ, hccl_group: bool = True,
                            leave_watchdog: bool = False) -> str | None:
    """Why ``--fault_tolerance.enable`` cannot run on ``target`` as configured, or None (not enabled, or fine).
    ``hccl_group``: patch torchft_npu is selected (it makes torchft's HCCL group); ``leave_watchdog``: patch
    torchft_leave is selected (a hung group leaves after the train timeout, which must then fit the quorum's)."""
    ft = getattr(config, "fault_tolerance", None)
    if ft is None or not getattr(ft, "enable", False):
        return None
    if importlib.util.find_spec("torchft") is None:
        return f"--fault_tolerance.enable needs torchft, not installed: {install_hint('torchft')}"
    group = ft.process_group
    if group not in FT_PROCESS_GROUPS:
        return (f"--fault_tolerance.process_group {group!r} does not exist: torchtitan's TorchFTManager builds "
                f"{', '.join(FT_PROCESS_GROUPS)}")
    if target == "npu":
        if group in ("gloo", "mccl"):
            return (f"--fault_tolerance.process_group {group} cannot carry NPU tensors (gloo: host tensors; mccl: "
                    "torchcomms' CUDA backend): use --fault_tolerance.process_group hccl")
        if not hccl_group:
            return (f"--fault_tolerance.process_group {group} on NPUs needs patch torchft_npu (torchft's HCCL group "
                    "and its streams on npu), which this run's TORCHTITAN_NPU_PATCHES turns off")
    elif group == "mccl":
        return ("--fault_tolerance.process_group mccl is torchcomms' CUDA backend; the rehearsal runs torchft on "
                "gloo (a config naming nccl or hccl is run on gloo)")
    checkpoint = getattr(config, "checkpoint", None)
    if getattr(ft, "group_size", 1) > 1 and not getattr(checkpoint, "enable", True):
        # upstream's TorchFTCheckpointManager registers torchft's state functions only when checkpointing is on
        return (f"--fault_tolerance.group_size {ft.group_size} needs --checkpoint.enable: torchtitan registers the "
                "state a replica group heals from (model, optimizer, schedule, step) with torchft only when "
                "checkpointing is on, and without it every group fails at its first quorum (torchft: \"user "
                "state_dict is not initialized\"); add --checkpoint.enable (--checkpoint.interval N sets how often "
                "it also writes to disk)")
    return (hang_timeout_problem(config, environ) if leave_watchdog else None) or lighthouse_problem(
        environ.get("TORCHFT_LIGHTHOUSE"))
