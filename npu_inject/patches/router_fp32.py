"""The MoE router's gate computes in float32, as upstream's autocast asks (only CUDA autocast honours float32).

torchtitan's ``TokenChoiceTopKRouter.forward`` (``models/common/moe.py``) asks for
a float32 gate with ``torch.autocast(device_type, dtype=torch.float32)``. Only CUDA
autocast takes float32; NPU and CPU autocast accept float16/bfloat16 only and disable
themselves, so under bf16 mixed precision the router's scores -- and with them the
top-k choice and load balancing -- come from a bf16 matmul. This patch runs upstream's
forward with a gate that computes ``F.linear(x.float(), weight.float(), bias.float())``:
what the autocast asks for. With float32 parameters and activations it changes nothing.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.moe:TokenChoiceTopKRouter.forward",
)


class _RouterWithFp32Gate:
    """The router as its forward sees it, except that ``gate`` computes in float32."""

    def __init__(self, router) -> None:
        self._router = router

    def __getattr__(self, name: str):
        return getattr(self._router, name)

    def gate(self, x_BLD):
        import torch.nn.functional as F

        gate = self._router.gate
        bias = None if gate.bias is None else gate.bias.float()
        return F.linear(x_BLD.float(), gate.weight.float(), bias)


def apply(ctx: PatchContext) -> None:
    def forward(original, router, x_BLD, expert_bias_E=None):
        return original(_RouterWithFp32Gate(router), x_BLD, expert_bias_E)

    ctx.wrap("TokenChoiceTopKRouter.forward", forward)
