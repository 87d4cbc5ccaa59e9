"""Tensor-parallel collective+GEMM pairs (dist_gemm, async TP) on Ascend's MC2 kernels.

torchtitan folds TP's all-gather and reduce-scatter into the adjacent GEMM two ways, both ending
in torch's ``symm_mem::fused_all_gather_matmul`` / ``symm_mem::fused_matmul_reduce_scatter``,
which have CUDA kernels only ("Could not run 'symm_mem::fused_all_gather_matmul' with arguments
from the 'CPU' backend"):

* ``tp_gemm_backend="dist_gemm"`` (``llama3_debugmodel_dist_gemm``): the autograd Functions of
  ``torchtitan/distributed/linear.py`` call them eagerly, forward and backward;
* ``--compile.enable_async_tensor_parallel``: ``_maybe_enable_async_tp`` registers the TP group
  and turns on inductor's micro-pipeline TP pass, which rewrites all-gather+mm and
  mm+reduce-scatter in the compiled forward and backward graphs into the same two ops.

In the rehearsal, ``aten::mm.dtype`` (dist_gemm's fp32-accumulated wgrad) gets a CPU kernel too.

This patch gives both ops a kernel for the run's device (PrivateUse1 on the NPU, CPU in the
rehearsal): :mod:`npu_inject.ops.tp_mc2`, i.e. ``npu_all_gather_base_mm`` /
``npu_mm_reduce_scatter_base`` (aclnnAllGatherMatmul / aclnnMatmulReduceScatter) where the MC2
kernel accepts the call, else the plain collective and a matmul, logged once per reason. torch's
Meta kernels (shapes under compile) and torchtitan's autograd stay as they are.

Inductor's pass also asks whether torch was built with NCCL or XCCL before rewriting anything;
torch builds for Ascend may have neither, and then async TP would silently run unfused. While the
pass runs, the wrapped ``_maybe_enable_async_tp`` lets that question answer yes on the NPU target.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torch.distributed._symmetric_memory:lib",  # the Library defining the symm_mem ops: kernels added
    "torchtitan.distributed.compile:_maybe_enable_async_tp",
    ("torch._inductor.fx_passes.post_grad:micro_pipeline_tp_pass",
     "on the NPU target, when torch was built with neither NCCL nor XCCL"),
    ("torchtitan.distributed.linear:LinearReduceScatter.backward",
     "in the rehearsal: the aten::mm.dtype it calls gets a CPU kernel"),
)


def apply(ctx: PatchContext) -> None:
    import torch
    import torch.distributed._symmetric_memory  # noqa: F401 - defines the symm_mem ops

    from npu_inject.ops import tp_mc2

    library = torch.library.Library("symm_mem", "IMPL")
    ctx.add_cleanup(library._destroy)
    for name, kernel in tp_mc2.KERNELS.items():
        library.impl(name, kernel, ctx.dispatch_key)
    ctx.changed("torch.distributed._symmetric_memory:lib")
    if ctx.rehearsal:
        # dist_gemm's row-parallel wgrad is torch.mm(..., out_dtype=torch.float32): aten::mm.dtype, which
        # torch implements for CUDA and torch_npu for the NPU, not for the CPU.
        aten = torch.library.Library("aten", "IMPL")
        ctx.add_cleanup(aten._destroy)
        aten.impl("mm.dtype", _mm_with_output_dtype, "CPU")
        ctx.changed("LinearReduceScatter.backward")

    previous_listener = tp_mc2.on_fallback
    tp_mc2.on_fallback = ctx.fallback
    ctx.add_cleanup(lambda: setattr(tp_mc2, "on_fallback", previous_listener))

    def maybe_enable_async_tp(original, compile_config, tp_mesh):
        result = original(compile_config, tp_mesh)
        if compile_config.enable_async_tensor_parallel and tp_mesh is not None:
            problem = _async_tp_problem(compile_config.backend)
            if problem:
                ctx.fallback(f"async TP: {problem}: the micro-pipeline TP pass (inductor's) does not run, the TP "
                             "collectives stay separate from their GEMMs; dist_gemm (tp_gemm_backend) fuses them "
                             "without inductor")
            else:
                ctx.note("async TP: inductor's micro-pipeline TP pass emits symm_mem fused ops, run as MC2 kernels")
        return result

    ctx.wrap("_maybe_enable_async_tp", maybe_enable_async_tp)
    if not ctx.rehearsal:
        _let_micro_pipeline_tp_run(ctx)


def _async_tp_problem(backend: str) -> str:
    """Why inductor's async-TP pass will not run ('' when it will). ``backend`` is what the blocks compile with:
    the compile patch has already replaced inductor by aot_eager where inductor cannot generate code."""
    if backend == "inductor":
        return ""
    return f"the blocks compile with {backend!r}, not inductor (the compile patch's report says why)"


def _mm_with_output_dtype(self, mat2, output_dtype):
    """aten::mm.dtype: the product accumulated in float32, returned in ``output_dtype``."""
    return (self.float() @ mat2.float()).to(output_dtype)


def _let_micro_pipeline_tp_run(ctx: PatchContext) -> None:
    """Inductor's pass rewrites only when torch has NCCL or XCCL (its only question about the build);
    HCCL is torch_npu's, so the NPU target answers that question itself while the pass runs."""
    import torch.distributed as dist

    if dist.is_nccl_available() or dist.is_xccl_available():
        return
    from torch._inductor.fx_passes import micro_pipeline_tp

    original_pass = micro_pipeline_tp.micro_pipeline_tp_pass

    def micro_pipeline_tp_pass(graph):
        # Scoped to the pass (compilation is single-threaded): nothing else sees the answer.
        saved = dist.is_xccl_available
        dist.is_xccl_available = lambda: True
        try:
            return original_pass(graph)
        finally:
            dist.is_xccl_available = saved

    ctx.replace("micro_pipeline_tp_pass", micro_pipeline_tp_pass)
    ctx.note("async TP: torch has neither NCCL nor XCCL; inductor's pass told HCCL (torch_npu) serves instead")
