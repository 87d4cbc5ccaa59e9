"""Optimizers use the fastest implementation the device runs (probed: fused, foreach, for-loop), kept across loads.

torchtitan builds every optimizer with ``implementation="fused"`` by default,
which it documents as CUDA-only. torch lets ``fused=True`` through for any
PrivateUse1 device (its list of fused-capable devices names the backend
unconditionally), so on a device without the ``_fused_adam(w)_`` kernels the run
fails at the first ``optimizer.step()``; ``fused_opt_states_bf16`` also needs the
mixed-precision kernel, which the CPU fused kernel does not have.

This patch wraps ``OptimizersContainer.__init__``: before the optimizers are
built it runs each configured torch optimizer for two steps on an 8-element
tensor on the parameters' device with the configured implementation, and walks
down ``fused_opt_states_bf16 -> fused -> foreach -> for-loop`` until one both runs
and matches a for-loop reference on the host. It never picks a faster
implementation than the one configured. The choice goes into the report (a
fallback entry when it is not the configured one).

It also wraps ``OptimizersContainer.load_state_dict``: a checkpoint stores each
group's ``fused``/``foreach`` flags and ``torch.optim.Optimizer.load_state_dict``
restores them, so a checkpoint written where fused kernels exist (e.g. without
the runtime) would switch the unsupported kernel back on. After loading, every
group gets back the flags it was built with (the choice here, or a per-group
override from the config) and ``step`` counters are placed where that
implementation keeps them (on the device for fused, on the host otherwise).
"""

from __future__ import annotations

import dataclasses
import weakref

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.components.optimizer.optimizer:OptimizersContainer.__init__",
    "torchtitan.components.optimizer.optimizer:OptimizersContainer.load_state_dict",
)


# Fastest first; a configured implementation is only ever replaced by a later one.
IMPLEMENTATION_ORDER = ("fused_opt_states_bf16", "fused", "foreach", "for-loop")
PROBE_STEPS = 2


def implementation_kwargs(implementation: str) -> dict[str, bool]:
    """The constructor flags torchtitan derives from ``implementation``."""
    if implementation not in IMPLEMENTATION_ORDER:
        raise ValueError(
            f"optimizer implementation {implementation!r} is not one of {', '.join(IMPLEMENTATION_ORDER)}"
        )
    return {
        "fused": implementation in ("fused", "fused_opt_states_bf16"),
        "foreach": implementation == "foreach",
    }


def candidates(configured: str) -> tuple[str, ...]:
    """The configured implementation and every slower one, in order of preference."""
    return IMPLEMENTATION_ORDER[IMPLEMENTATION_ORDER.index(configured):]


def _prefill_bf16_states(optimizer, param) -> None:
    """What torchtitan's ``fused_opt_states_bf16`` pre-hook creates before the first step."""
    import torch

    optimizer.state[param].update(
        step=torch.zeros((), dtype=torch.float32, device=param.device),
        exp_avg=torch.zeros_like(param, dtype=torch.bfloat16),
        exp_avg_sq=torch.zeros_like(param, dtype=torch.bfloat16),
    )


def probe(optimizer_class, optimizer_kwargs: dict, device, dtype, implementation: str) -> str | None:
    """None when ``implementation`` runs correctly on ``device``, else why not.

    Two steps on an 8-element parameter, compared with ``optimizer_class``'s for-loop
    implementation on the host in float32 (bf16 states and parameters get a looser bound).
    """
    import torch

    kwargs = {k: v for k, v in optimizer_kwargs.items() if k not in ("fused", "foreach")}
    start = torch.linspace(-1.0, 1.0, 8)
    grads = [torch.linspace(0.5, -0.3, 8), torch.linspace(-0.2, 0.4, 8)]

    reference = torch.nn.Parameter(start.clone())
    reference_optimizer = optimizer_class([reference], **kwargs, fused=False, foreach=False)
    for grad in grads:
        reference.grad = grad.clone()
        reference_optimizer.step()

    try:
        param = torch.nn.Parameter(start.to(device=device, dtype=dtype))
        optimizer = optimizer_class([param], **kwargs, **implementation_kwargs(implementation))
        if implementation == "fused_opt_states_bf16":
            _prefill_bf16_states(optimizer, param)
        for grad in grads:
            param.grad = grad.to(device=device, dtype=dtype)
            optimizer.step()
        result = param.detach().to(device="cpu", dtype=torch.float32)
    except Exception as exc:  # any failure means "not supported here"; the reason is reported
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{type(exc).__name__}: {first_line}"
    low_precision = dtype != torch.float32 or implementation == "fused_opt_states_bf16"
    tolerance = 2e-2 if low_precision else 1e-5
    if not torch.allclose(result, reference.detach(), rtol=tolerance, atol=tolerance):
        worst = (result - reference.detach()).abs().max().item()
        return f"ran, but differs from the for-loop reference by up to {worst:.3g} (tolerance {tolerance})"
    return None


@dataclasses.dataclass
class Choice:
    implementation: str
    device_type: str
    rejected: list[tuple[str, str]]  # (implementation, reason), in the order tried


class ImplementationChooser:
    """Picks and caches one implementation per (device, dtype, optimizer setup)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, str | None] = {}

    def works(self, optimizer_class, optimizer_kwargs, device, dtype, implementation) -> str | None:
        key = (device.type, dtype, optimizer_class, repr(sorted(optimizer_kwargs.items())), implementation)
        if key not in self._cache:
            self._cache[key] = probe(optimizer_class, optimizer_kwargs, device, dtype, implementation)
        return self._cache[key]

    def choose(self, config, model_parts, resolve_factory) -> Choice | None:
        """None when there is nothing to decide (no trainable parameters, no torch optimizer)."""
        import torch

        param = next((p for m in model_parts for p in m.parameters() if p.requires_grad), None)
        if param is None:
            return None
        setups = []
        for group in config.param_groups:
            factory = resolve_factory(group.optimizer_name)
            if isinstance(factory, type) and issubclass(factory, torch.optim.Optimizer):
                setups.append((factory, dict(group.optimizer_kwargs)))
        if not setups:
            return None
        rejected: list[tuple[str, str]] = []
        for implementation in candidates(config.implementation):
            reasons = [
                f"{factory.__name__}: {reason}"
                for factory, kwargs in setups
                if (reason := self.works(factory, kwargs, param.device, param.dtype,
                                         _effective(implementation, factory)))
            ]
            if not reasons:
                return Choice(implementation, param.device.type, rejected)
            rejected.append((implementation, "; ".join(reasons)))
        raise RuntimeError(
            f"no optimizer implementation runs on {param.device.type}: "
            + "; ".join(f"{impl}: {why}" for impl, why in rejected)
        )


IMPLEMENTATION_FLAGS = ("fused", "foreach")


def implementation_flags(optimizer) -> list[dict]:
    """Each group's ``fused``/``foreach`` flags as built (including per-group overrides)."""
    return [{k: group[k] for k in IMPLEMENTATION_FLAGS if k in group} for group in optimizer.param_groups]


def _effective(implementation: str, factory) -> str:
    """torchtitan gives bf16 states to Adam/AdamW only; other optimizers run plain fused."""
    import torch

    if implementation == "fused_opt_states_bf16" and not issubclass(factory, (torch.optim.Adam, torch.optim.AdamW)):
        return "fused"
    return implementation


def conform_to_implementation(optimizer, group_flags: list[dict]) -> list[str]:
    """Give every group back its built ``group_flags``; put ``step`` counters where they belong.

    Returns a description of each group flag that had to change.
    """
    import torch

    changed = []
    for index, (group, flags) in enumerate(zip(optimizer.param_groups, group_flags, strict=True)):
        for name, value in flags.items():
            if group.get(name) != value:
                changed.append(f"group {index} {name}={group.get(name)} -> {value}")
                group[name] = value
        on_device = group.get("fused", False) or group.get("capturable", False)
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                # Fused/capturable kernels read the counter on the device, the others on the host.
                device = param.device if on_device else torch.device("cpu")
                if step.device != device:
                    optimizer.state[param]["step"] = step.to(device=device, dtype=torch.float32)
    return changed


def apply(ctx: PatchContext) -> None:
    from torchtitan.components.optimizer.optimizer import OptimizersContainer

    chooser = ImplementationChooser()
    built_flags: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def init(original, container, config, *args, model_parts, **kwargs):
        choice = chooser.choose(config, model_parts, OptimizersContainer._resolve_optimizer_factory)
        if choice is None:
            return original(container, config, *args, model_parts=model_parts, **kwargs)
        for implementation, reason in choice.rejected:
            ctx.fallback(f"optimizer implementation '{implementation}' does not run on {choice.device_type} "
                         f"({reason}); using '{choice.implementation}'")
        ctx.note(f"optimizer implementation on {choice.device_type}: {choice.implementation} "
                 f"(configured: {config.implementation})")
        if choice.implementation != config.implementation:
            config = dataclasses.replace(config, implementation=choice.implementation)
        result = original(container, config, *args, model_parts=model_parts, **kwargs)
        built_flags[container] = [implementation_flags(optimizer) for optimizer in container.optimizers]
        return result

    def load_state_dict(original, container, *args, **kwargs):
        result = original(container, *args, **kwargs)
        flags = built_flags.get(container)
        if flags is not None:
            for optimizer, group_flags in zip(container.optimizers, flags, strict=True):
                for change in conform_to_implementation(optimizer, group_flags):
                    ctx.note(f"loaded optimizer state asked for another implementation; kept this device's: {change}")
        return result

    ctx.wrap("OptimizersContainer.__init__", init)
    ctx.wrap("OptimizersContainer.load_state_dict", load_state_dict)
