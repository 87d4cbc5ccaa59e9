"""--compile.enable compiles with a backend the target runs: inductor where it can generate code, else aot_eager.

torchtitan compiles each transformer block (``apply_compile``, fullgraph) and
the loss (``BaseLoss._maybe_compile``) with ``--compile.backend``, "inductor" by
default. Inductor generates code per device type: in the CPU rehearsal that is
torch's own C++ backend (it needs a C++ compiler); on an NPU it exists only when
torch_npu's inductor backend (``torch_npu._inductor``, which needs triton-ascend)
has registered "npu" code generation. Without it, inductor fails deep inside
lowering at the first forward.

This patch resolves the backend once per process, where torchtitan hands the
CompileConfig to ``torch.compile``:

* option ``backend`` = "auto" (default): the requested backend when the target
  runs it -- "inductor" needs a C++ compiler (cpu) or torch_npu's NPU inductor
  with triton (npu); a backend registered with dynamo (torch_npu's "npu"
  torchair backend, "npugraph_ex") needs to be importable. Otherwise "aot_eager"
  (the same forward/backward graphs, run op by op): a one-time warning and a
  report fallback entry, never a crash in inductor;
* any other option value forces that backend, with the same check and fallback.

The report names the backend that ran and why, per rank. The kernels stay
opaque ops with fake implementations (:mod:`npu_inject.ops.fakes`), and the
runtime's one-time fallback warnings, logged from inside compiled blocks, are
registered with dynamo as reorderable (logged after the graph), so the runtime
adds no graph break to the compiled blocks.

Inductor's on-disk caches (FX graph, AOT autograd) key on the traced graph, not
on the Python behind a custom op: a compiled graph bakes in the output strides
our fakes gave when it was cached, so after the kernels or fakes change a cache
hit asserts the old strides against the new kernel. The patch appends a digest
of the ``npu_inject.ops`` sources to ``torch.compiler.config.cache_key_tag``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import pathlib
import shutil

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.distributed.compile:apply_compile",
    "torchtitan.components.loss:BaseLoss._maybe_compile",
)

SAFE_BACKEND = "aot_eager"


def _inductor_problem(target: str) -> str:
    """Why torch's inductor cannot generate code for the target ("" when it can)."""
    if target == "cpu":
        from torch._inductor import cpp_builder

        try:
            compiler = cpp_builder.get_cpp_compiler()
        except RuntimeError as exc:  # torch looked for one and found none
            return f"no C++ compiler for torch's CPU inductor ({exc})"
        return "" if shutil.which(compiler) else f"no C++ compiler ({compiler!r} is not on PATH)"
    if importlib.util.find_spec("torch_npu._inductor") is None:
        return "the installed torch_npu has no NPU inductor backend (torch_npu._inductor)"
    if importlib.util.find_spec("triton") is None:
        return "torch_npu's NPU inductor needs triton-ascend, which is not importable"
    try:
        importlib.import_module("torch_npu._inductor")
    except Exception as exc:  # any import failure means inductor cannot lower for the NPU
        return f"importing torch_npu._inductor failed: {type(exc).__name__}: {exc}"
    from torch._inductor.codegen.common import get_scheduling_for_device

    if get_scheduling_for_device("npu") is None:
        return "torch_npu._inductor registered no code generation for the 'npu' device"
    return _triton_driver_problem()


def _triton_driver_problem() -> str:
    """Why triton cannot launch kernels here ('' when it can). CUDA's triton (torch's own dependency) imports
    fine beside torch_npu but drives no NPU: inductor would fail at its first kernel ("0 active drivers")."""
    from triton.runtime import driver

    try:
        driver.active.get_current_target()
    except RuntimeError as exc:  # triton found no backend whose driver is active on this machine
        version = importlib.metadata.version("triton") if importlib.util.find_spec("triton") else "?"
        return (f"triton {version} has no active driver here ({exc}); torch_npu's NPU inductor needs "
                "triton-ascend's NPU driver")
    return ""


def _dynamo_backend_problem(name: str) -> str:
    import torch._dynamo

    try:
        torch._dynamo.lookup_backend(name)
    except Exception as exc:  # unknown name or an entry point that fails to load
        return f"dynamo backend {name!r} is unavailable ({type(exc).__name__}: {exc})"
    return ""


def resolve_backend(requested: str, option: str, target: str) -> tuple[str, str, str]:
    """(backend, why, problem): the backend to use, the reason, and why the wanted one cannot run."""
    wanted, source = (requested, "--compile.backend") if option == "auto" else (option, "registry option backend")
    problem = _inductor_problem(target) if wanted == "inductor" else _dynamo_backend_problem(wanted)
    if problem:
        return SAFE_BACKEND, f"{wanted!r} ({source}) cannot run on target {target}: {problem}", problem
    if wanted == "inductor":
        how = "torch's C++ inductor" if target == "cpu" else "torch_npu's NPU inductor"
        return wanted, f"{source}; {how}", ""
    return wanted, source, ""


def _reorder_runtime_warnings(ctx: PatchContext) -> None:
    """Patches log a fallback once, possibly from inside a compiled block: dynamo may move
    that call after the graph (registered as reorderable) instead of breaking the graph there."""
    import torch._dynamo

    warning = logging.getLogger("npu_inject").warning
    functions = torch._dynamo.config.reorderable_logging_functions
    if warning not in functions:
        functions.add(warning)
        ctx.add_cleanup(lambda: functions.discard(warning))


def ops_source_digest(root: pathlib.Path | None = None) -> str:
    """Digest of the custom ops' Python under ``root`` (default: ``npu_inject.ops``; implementations,
    fakes, autograd): what a cached graph depends on beyond the graph itself."""
    if root is None:
        import npu_inject.ops

        root = pathlib.Path(npu_inject.ops.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _tag_compile_caches(ctx: PatchContext) -> None:
    """Inductor's caches miss when our ops change (see the module docstring); a user's tag is kept."""
    import torch.compiler.config as compiler_config

    previous = compiler_config.cache_key_tag
    tag = f"npu_inject.ops:{ops_source_digest()}"
    compiler_config.cache_key_tag = f"{previous}+{tag}" if previous else tag
    ctx.add_cleanup(lambda: setattr(compiler_config, "cache_key_tag", previous))
    ctx.note(f"torch.compile cache key tag: {compiler_config.cache_key_tag}")


def apply(ctx: PatchContext) -> None:
    _reorder_runtime_warnings(ctx)
    resolved: dict[str, tuple[str, str, str]] = {}

    def backend_for(requested: str, component: str) -> str:
        if not resolved:  # only runs that compile pay for the digest
            _tag_compile_caches(ctx)
        if requested not in resolved:
            resolved[requested] = resolve_backend(requested, ctx.options["backend"], ctx.device_kind)
        backend, why, problem = resolved[requested]
        if problem:
            ctx.fallback(f"torch.compile runs on {backend!r}: {why}")
        ctx.note(f"torch.compile backend for the {component}: {backend} ({why})")
        return backend

    def with_backend(compile_config, component):
        backend = backend_for(compile_config.backend, component)
        if backend == compile_config.backend:
            return compile_config
        return dataclasses.replace(compile_config, backend=backend)

    def apply_compile(original, model, *, compile_config, parallel_dims):
        return original(model, compile_config=with_backend(compile_config, "model blocks"),
                        parallel_dims=parallel_dims)

    def maybe_compile_loss(original, loss, compile_config):
        if compile_config is not None and compile_config.enable and "loss" in compile_config.components:
            compile_config = with_backend(compile_config, "loss")
        return original(loss, compile_config)

    ctx.wrap("apply_compile", apply_compile)
    ctx.wrap("BaseLoss._maybe_compile", maybe_compile_loss)
