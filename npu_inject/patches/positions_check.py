"""RoPE's position bounds check reads the positions on the host once per forward, not once per layer.

torchtitan checks, in every layer's RoPE (``_maybe_check_max_pos`` in ``models/common/rope.py``),
that no position id exceeds the cache, with ``torch._assert_async``: on CUDA a device-side assert
that costs no synchronisation. torch_npu has no device-side assert; its ``_assert_async`` copies the
flag to the host and synchronises the stream, once per layer and pass (12 device-to-host copies and
12 stream synchronisations per llama3 debug step on the real wheel). This patch checks the same bound
on the host copy of the positions that the attention kernel reads anyway for its document lengths
(:func:`npu_inject.ops.host_reads.host_copy`: one copy per positions tensor, shared), and raises at
once with upstream's message where the device assert would have failed later. Under torch.compile
upstream skips the check, and so does this; on fake tensors (``npu-inject plan``) there is nothing to read.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.rope:_maybe_check_max_pos",
)


def apply(ctx: PatchContext) -> None:
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    from npu_inject.ops import host_reads, spmd_typing

    def check_max_pos(positions, *, max_valid_pos: int) -> None:
        if torch.compiler.is_compiling():
            return
        local = positions.to_local() if isinstance(positions, DTensor) else positions
        if is_fake(local) or local.device.type == "meta":
            return  # no values to check (npu-inject plan records a step on fake tensors)
        with spmd_typing.opaque_kernel():  # host metadata, unchecked as upstream's check is
            highest = int(host_reads.host_copy(local).max()) if local.numel() else -1
        if highest > max_valid_pos:
            raise RuntimeError(f"position_ids exceed {max_valid_pos=} (npu_inject positions_check: the highest "
                               f"position id is {highest})")

    ctx.replace("_maybe_check_max_pos", check_max_pos)
    ctx.add_cleanup(host_reads.clear)
