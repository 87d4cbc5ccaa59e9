"""Context parallel on npu_fusion_attention for flex masks and varlen: Ulysses all-to-all or all-gather-KV.

torchtitan's CP shards the batch with ``cp_shard``, which only accepts
BlockMasks (``assert isinstance(attention_masks, (BlockMask, dict))``): the
attention patch's AttentionPlan fails there, and varlen attention has no CP at
all (``apply_cp_to_forward`` and the llama3/qwen3 configs reject it). This patch:

* wraps ``cp_shard``: for an AttentionPlan, a dict of them (gpt_oss) or VarlenMetadata it shards the inputs
  with upstream's own load balancer (head-tail, PTRR -- built from a causal
  BlockMask -- or none) and returns a :class:`~npu_inject.ops.cp.ContextParallelPlan`
  (the global mask plus the global positions of every rank's rows) as the masks;
* wraps ``apply_cp_to_forward`` for llama3, qwen3, deepseek_v3 and gpt_oss: flex and varlen
  modules are left as they are (the attention patch runs
  :func:`~npu_inject.ops.cp.context_parallel_attention_BLNH` when it receives a
  ContextParallelPlan); SDPA and other models keep upstream's path;
* lets llama3/qwen3 configs and the spmd_types ``validate_config`` accept varlen with CP.

The wraps sit on the shared definitions (``torchtitan.distributed.context_parallel``,
``full_dtensor.validate_config``), which the model modules bind when they are
imported, so applying imports no model; model modules imported before the patch
applied get their bindings wrapped too. Which model runs is read from the trainer's
config, so other families are left alone. A model config's ``update_from_config``
is wrapped when a run configures varlen with CP for llama3 or qwen3.
* validates at start-up (``Trainer.Config.__post_init__``): option ``scheme``
  "ulysses" needs the query heads per tensor-parallel rank divisible by the CP degree.

Option ``scheme``: "auto" (Ulysses where heads divide, else all-gather-KV),
"ulysses" or "allgather". The report notes the scheme that ran.
"""

from __future__ import annotations

import sys

from npu_inject.errors import ConfigError
from npu_inject.patching import PatchContext
from npu_inject.module_facts import split_target

TARGETS = (
    "torchtitan.trainer:Trainer.Config.__post_init__",
    "torchtitan.distributed.context_parallel.api:cp_shard",
    "torchtitan.distributed.context_parallel.api:apply_cp_to_forward",
    "torchtitan.distributed.context_parallel:apply_cp_to_forward",
    ("torchtitan.models.llama3.parallelize:apply_cp_to_forward",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.qwen3.parallelize:apply_cp_to_forward",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.deepseek_v3.parallelize:apply_cp_to_forward",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.gpt_oss.parallelize:apply_cp_to_forward",
     "when that model module was imported before the patch applied"),
    "torchtitan.distributed.full_dtensor:validate_config",
    ("torchtitan.models.llama3.parallelize:validate_config",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.qwen3.parallelize:validate_config",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.deepseek_v3.parallelize:validate_config",
     "when that model module was imported before the patch applied"),
    ("torchtitan.models.llama3.model:Llama3Model.Config.update_from_config",
     "when a llama3 run configures context parallel"),
    ("torchtitan.models.qwen3.model:Qwen3Model.Config.update_from_config",
     "when a qwen3 run configures context parallel"),
)

_MODEL_PARALLELIZE = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")
_VARLEN_CHECKING_CONFIGS = {"llama3": "Llama3Model", "qwen3": "Qwen3Model"}


def model_family(obj) -> str | None:
    """'llama3' for an object (model or model config) defined in torchtitan.models.llama3."""
    parts = type(obj).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["torchtitan", "models"] else None


def configured_model(config):
    """The trainer config's model config (``config.model_spec.model``), or None."""
    return getattr(getattr(config, "model_spec", None), "model", None)


def query_heads(config) -> int | None:
    """Query heads per layer of the configured model (None if the model does not say)."""
    layers = getattr(configured_model(config), "layers", None)
    if not layers:
        return None
    return getattr(getattr(layers[0], "attention", None), "n_heads", None)


def exchange_positions(local_positions_Bl, cp_mesh, load_balancer_type: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this rank's sequence positions, every rank's in rank order): the balancer's order, read back
    from the device and all-gathered over the CP group (npu-inject plan computes it from the balancer,
    through :data:`npu_inject.ops.planner_hooks.cp_positions`)."""
    import torch

    from npu_inject.ops import planner_hooks

    if planner_hooks.cp_positions is not None:
        return planner_hooks.cp_positions(local_positions_Bl, cp_mesh, load_balancer_type)
    if not bool((local_positions_Bl == local_positions_Bl[:1]).all()):
        raise NotImplementedError(f"load balancer {load_balancer_type!r} orders batch rows differently; "
                                  "npu_inject context parallel needs one order for all rows")
    local_l = local_positions_Bl[0].contiguous()
    gathered = local_l.new_empty(local_l.numel() * cp_mesh.size())
    torch.distributed.all_gather_into_tensor(gathered, local_l, group=cp_mesh.get_group())
    return tuple(local_l.tolist()), tuple(gathered.tolist())


def apply(ctx: PatchContext) -> None:
    import torch
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _PTRRLoadBalancer
    from torch.nn.attention.flex_attention import create_block_mask

    from npu_inject.ops.attention import AttentionPlan
    from npu_inject.ops.cp import ContextParallelPlan
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
        VarlenMetadata,
    )

    requested = ctx.options["scheme"]
    configured_family: list[str | None] = []  # set by Trainer.Config.__post_init__
    wrapped_configs: set[str] = set()

    def post_init(original, config):
        parallelism = config.parallelism
        cp, tp = parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
        heads = query_heads(config)
        # tp < 1 is model_guard's to refuse by name, after the command line is merged.
        if cp > 1 and tp >= 1 and requested == "ulysses" and heads is not None and (heads // tp) % cp:
            raise ConfigError(
                f"npu_inject (patch context_parallel, option scheme='ulysses'): the model's {heads} "
                f"query heads over tensor_parallel_degree={tp} leave {heads // tp} per rank, not divisible "
                f"by context_parallel_degree={cp}; use scheme 'allgather' or 'auto', or a CP degree "
                f"dividing {heads // tp}"
            )
        family = model_family(configured_model(config))
        configured_family[:] = [family]
        if cp > 1 and family in _VARLEN_CHECKING_CONFIGS:
            target = ctx.declared(f"{_VARLEN_CHECKING_CONFIGS[family]}.Config.update_from_config")
            if target not in wrapped_configs:
                wrapped_configs.add(target)
                ctx.wrap(target, update_from_config)
        return original(config)

    def ours(family: str | None) -> bool:
        # Unknown (no trainer config seen, e.g. a direct call): the families this patch serves.
        return family in _MODEL_PARALLELIZE or (family is None and not configured_family)

    def plans_only(masks) -> bool:
        # gpt_oss's flex masks are a dict (basic_mask, sliding_window_mask); each is a plan or none is.
        return (isinstance(masks, dict) and bool(masks)
                and all(isinstance(m, AttentionPlan) for m in masks.values()))

    def cp_shard(original, cp_mesh, inputs, attention_masks, load_balancer_type="headtail",
                 input_seq_dim=1, ptrr_mask_key=None):
        keyed = plans_only(attention_masks)
        if not keyed and not isinstance(attention_masks, (AttentionPlan, VarlenMetadata)):
            return original(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim, ptrr_mask_key)
        if keyed and load_balancer_type == "ptrr" and ptrr_mask_key not in attention_masks:
            # As upstream refuses it: the key names which mask the PTRR balancer is built from.
            raise ValueError(f"--parallelism.context_parallel_ptrr_mask_key={ptrr_mask_key!r} must be one of "
                             f"the attention masks {sorted(attention_masks)} for load balancer 'ptrr'")
        if input_seq_dim != 1:
            raise ValueError(f"npu_inject context_parallel shards (batch, sequence) inputs; got input_seq_dim="
                             f"{input_seq_dim}")
        B, L = inputs[0].shape[:2]
        device = inputs[0].device
        positions_BL = torch.arange(L, device=device).expand(B, L).contiguous()
        if load_balancer_type == "ptrr":
            # PTRR is built from a BlockMask; any order is exact here, so the causal mask's cost
            # profile serves for every plan. Upstream's cp_shard would also shard that mask (a
            # compiled create_block_mask on the device), which nothing here reads: shard the
            # inputs with the balancer as upstream does, and only them.
            balancer = _PTRRLoadBalancer(
                create_block_mask(lambda b, h, q, kv: kv <= q, None, None, L, L, device=device), cp_mesh.size(0))
            buffers = (*inputs, positions_BL)
            sharded = _context_parallel_shard(mesh=cp_mesh, buffers=buffers, seq_dims=(1,) * len(buffers),
                                              load_balancer=balancer)
        else:
            sharded, _ = original(cp_mesh, (*inputs, positions_BL), None, load_balancer_type, input_seq_dim,
                                  ptrr_mask_key)
        *sharded_inputs, local_positions_Bl = sharded
        group = cp_mesh.get_group()
        local_positions, balanced_order = exchange_positions(local_positions_Bl, cp_mesh, load_balancer_type)
        if keyed:
            return tuple(sharded_inputs), {
                key: ContextParallelPlan(plan, None, local_positions, balanced_order, requested, group,
                                         report=ctx.note)
                for key, plan in attention_masks.items()
            }
        if isinstance(attention_masks, AttentionPlan):
            plan, offsets = attention_masks, None
        else:
            plan = None
            offsets = attention_masks.cu_seq_q_host or tuple(attention_masks.cu_seq_q.tolist())
        masks = ContextParallelPlan(plan, offsets, local_positions, balanced_order, requested, group,
                                    report=ctx.note)
        return tuple(sharded_inputs), masks

    def apply_cp_to_forward(original, attention_modules, cp_mesh):
        family = configured_family[0] if configured_family else None
        if (ours(family) and attention_modules
                and isinstance(attention_modules[0], (FlexAttention, VarlenAttention))):
            ctx.note(f"context parallel on npu_fusion_attention for {type(attention_modules[0]).__name__} "
                     f"(cp={cp_mesh.size()}, scheme option {requested!r})")
            return None
        return original(attention_modules, cp_mesh)

    def validate_config(original, parallel_dims, model):
        # Upstream rejects varlen with CP (no CP path for it); this patch has one. SDPA stays rejected.
        family = model_family(model)
        if (ours(family) and parallel_dims.cp_enabled
                and any(isinstance(m, VarlenAttention) for m in model.modules())):
            if not any(isinstance(m, ScaledDotProductAttention) for m in model.modules()):
                return None
        return original(parallel_dims, model)

    def update_from_config(original, model_config, *, config, **kwargs):
        # Upstream rejects varlen with CP only because its CP has no varlen path; this one has.
        parallelism = config.parallelism
        cp = parallelism.context_parallel_degree
        if cp > 1 and isinstance(model_config.layers[0].attention.inner_attention, VarlenAttention.Config):
            parallelism.context_parallel_degree = 1
            try:
                return original(model_config, config=config, **kwargs)
            finally:
                parallelism.context_parallel_degree = cp
        return original(model_config, config=config, **kwargs)

    ctx.wrap("Trainer.Config.__post_init__", post_init)
    ctx.wrap("cp_shard", cp_shard)
    shared_wraps: list = []  # what wraps the shared definitions (each holds the function it wraps as __wrapped__)
    later: list[tuple[str, str]] = []  # (model module, qualname) not imported when this patch applied
    for name, wrapper in (("apply_cp_to_forward", apply_cp_to_forward), ("validate_config", validate_config)):
        for target in ctx.targets_named(name):
            module = split_target(target)[0]
            # A model's parallelize module binds its own copy of the function when it was imported
            # before this patch applied: wrap that copy too (importing no model otherwise).
            if not module.startswith("torchtitan.models."):
                shared_wraps.append(ctx.wrap(target, wrapper))
            elif module in sys.modules:
                ctx.wrap(target, wrapper)
            else:
                later.append((module, name))

    def unbind_later_imports() -> None:
        # A model module imported while this patch applied bound the wrapped shared definition: give it the
        # original back, as if it had been imported without the patch.
        for module, name in later:
            bound = getattr(sys.modules.get(module), name, None)
            if any(bound is wrap for wrap in shared_wraps):
                setattr(sys.modules[module], name, bound.__wrapped__)

    ctx.add_cleanup(unbind_later_imports)

