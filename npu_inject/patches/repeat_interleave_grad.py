"""torch_npu's repeat_interleave backward (gpt_oss's expert biases) gets a fake for torch.compile and a kernel A2/A3 run.

gpt_oss's experts broadcast each expert's bias to its rows with ``b.repeat_interleave(counts,
dim=0, output_size=R)`` (``models/gpt_oss/moe.py``). On the NPU torch_npu 2.14.0 differentiates
that through its own op ``npu::repeat_interleave_backward_tensor``, which

* has no fake (Meta) implementation, so ``--compile.enable`` fails while tracing gpt_oss's blocks
  ("attempted to run this operator with Meta tensors"), on every device;
* launches ``aclnnRepeatInterleaveGrad``, which CANN documents for Ascend 950 only (hicann/ops-nn
  ``index/repeat_interleave_grad/docs/aclnnRepeatInterleaveGrad.md``: Atlas A2 and A3 are not
  supported products).

This patch registers the fake (the gradient has ``self``'s shape and ``grad``'s dtype) and, for
the NPU, a kernel made of operators every product has: the row of ``self`` each output row came
from (``repeat_interleave`` of an index vector, no gradient), then ``index_add`` of the gradient
rows into zeros. Without torch_npu's op (the rehearsal, the simulated NPU's stand-in) there is
nothing to register, and the report notes it. Revert removes both registrations, restoring
torch_npu's kernel.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    # Unchanged itself: its repeat_interleave's backward gets the kernels (torch.library registrations).
    ("torchtitan.models.gpt_oss.moe:GptOssGroupedExperts.forward",
     "when torch_npu defines npu::repeat_interleave_backward_tensor (not in the rehearsal, nor in the "
     "simulated NPU's stand-in, which differentiate aten's repeat_interleave)"),
)


def repeat_interleave_backward(grad, input, repeats, dim=None):
    """d(input.repeat_interleave(repeats, dim))/d(input) applied to ``grad``: each input slice along
    ``dim`` (the flattened input when ``dim`` is None) sums the ``repeats[i]`` gradient slices made from it."""
    import torch

    flat = dim is None
    axis = 0 if flat else dim % max(input.dim(), 1)
    source = input.reshape(-1) if flat else input
    slices = source.shape[axis] if source.dim() else 1
    counts = repeats.expand(slices) if repeats.numel() == 1 else repeats
    row_of_slice = torch.repeat_interleave(torch.arange(slices, device=grad.device), counts.to(grad.device),
                                           output_size=grad.shape[axis])
    summed = grad.new_zeros(source.shape).index_add_(axis, row_of_slice, grad)
    return summed.reshape(input.shape)


def repeat_interleave_backward_fake(grad, input, repeats, dim=None):
    return grad.new_empty(input.shape)


def apply(ctx: PatchContext) -> None:
    import torch

    if not torch._C._dispatch_has_kernel("npu::repeat_interleave_backward_tensor"):
        ctx.note("no npu::repeat_interleave_backward_tensor (torch_npu's op): nothing to register")
        return
    library = torch.library.Library("npu", "IMPL")
    ctx.add_cleanup(library._destroy)
    library.impl("repeat_interleave_backward_tensor", repeat_interleave_backward_fake, "Meta")
    library.impl("repeat_interleave_backward_tensor", repeat_interleave_backward, ctx.dispatch_key)
    ctx.changed("GptOssGroupedExperts.forward")
