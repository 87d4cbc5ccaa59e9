"""The model's matmuls checked on the device every N steps; a corrupted step is trained again, a failing NPU named.

Off by default: ``TORCHTITAN_NPU_PATCHES=+matmul_checks``. A chip that now and then computes a wrong block of a
matmul raises nothing and leaves finite values: the job trains on wrong gradients. On every ``every``-th step
(registry option, default 20; ``TORCHTITAN_NPU_SDC_EVERY=N`` overrides it) each bias-free ``nn.Linear`` of the
model (and each subclass that keeps its forward: torchtitan's ``Linear``) computes its result and both gradients through :class:`npu_inject.ops.matmul_check.CheckedLinear`, with
the operators autograd uses, so the checks change no bit of the training, and checks the three products with
CANN's V-ABFT row checksums: torch_npu's ``_npu_matmul_abft_verify`` kernel (Atlas A2 and A3, bf16 and fp32)
where the device runs it, the same algorithm in torch elsewhere (the rehearsal, the simulated NPU, a SoC or
dtype the kernel refuses: one fallback line at the first check). Eager, compiled (the checks trace with the
block; torch.compile keeps a second graph for the checked steps) and pipelined jobs alike.

The verdicts stay on the device until the step's gradients are clipped (:mod:`npu_inject.training_step`,
before the optimizer): then each rank's five counts (failed forward and backward verdicts, forward and
backward checks run, linear calls left unchecked) are gathered over the job's ranks in one ``all_gather`` and
read once, so every rank reaches the same decision. A step with a failed verdict is not applied: the attempt stops before the
optimizer and the step runs again on the same batches (the owner kept them), checked again (with torchft committing
every step, the step is kept out on every replica group instead, through torchft's should_commit, and its
batches skipped: the other groups already averaged the attempt's gradients and would not wait). The rank whose
products failed is named (host, device) in the log and the report; a rank that fails ``stop_after`` times
(default 3) within ``window`` steps (default 100) stops every rank with one line: drain its device.

Fails loudly rather than checking nothing: a checked step on which a rank's forward checks ran but none of
its backward checks did, or on which no rank checked any matmul (every linear biased or of a forward of its own),
stops the job; an ``sdc_matmul`` fault on a step that is not checked stops at start-up.

MoE experts (torchtitan's ``GroupedExperts``): their three grouped products per call and their gradients are
checked too, through upstream's ``_grouped_mm`` seam (upstream's ``torch._grouped_mm`` or moe_dispatch's
npu_grouped_matmul, whose own backward runs untouched: :meth:`Ledger.grouped_mm` wraps it in identity
functions), always with the torch check (the kernel takes one dense product), each group's rows picked by a
one-hot matrix, so no host read of the offsets. The weight gradient's threshold takes each input column's
extremes over all groups' rows (wider than the kernel's, never tighter).

Tensor-parallel linears (DTensors, FSDP's unsharded weights among them) are checked on each rank's local
shards, with the local products DTensor itself would run (column-wise, row-wise and replicated layouts:
:func:`npu_inject.ops.matmul_check.tensor_parallel_layout`); MoE experts under tensor or expert parallelism
reach their grouped products as local tensors already.

What it does not check: linears with a bias or a forward of their own (Float8Linear, dist_gemm's; named in
the report at start-up), linear calls whose layout, dtype or strides the check does not take (counted on the
device and named once in the log and the report), attention's matmuls (fused kernels), and unchecked steps (a
corruption there trains on; replica_check compares the replicas).

Cost on a checked step: per product, the checksum work of about three reads of the product's operands and
result (CANN's kernel: about 8 a^2 flops for an a x a x a product; the torch check: a float32 copy of the first
operand and some 60 small operators); one ``all_gather`` of five floats and one device-to-host copy per step.
Nothing on unchecked steps. Measured on the real torch_npu over the CANN emulation (llama3 debug, 2 ranks, rank
0): one more stream synchronisation and one more device-to-host copy on a checked step (12 and 7 against 11 and
6), 9,940 aclnn launches against 865 (the debug model's products are small: most take the torch check). The
default of 20 steps is chosen from ``npu-inject plan``'s estimate for llama3_8b on 8 A2 (a checked step adds
about 21% of the step, memory-bound: about 1% of the training time at every 20; deepseek_v3_671b on 1024 A3 with
EP 256: 26%, 1.3% at every 20, two thirds of it the experts' torch check); a chip that keeps miscomputing
is caught within 20 steps, a one-off fault on an unchecked step is not.
With torchft committing every step, a checked step adds one all-reduce of one float across the replica
groups and its host read.
"""

from __future__ import annotations

import logging
import os
from collections import deque

from npu_inject import selection
from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.rank_agreement import who
from npu_inject.training_step import RETRY, Step, commits_every_step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")


class SilentCorruption(RuntimeError):
    """A checked step's matmul result failed its checksum on some rank (the step is retried)."""


def install(model_parts, ledger) -> tuple[int, int, list[str], object]:
    """Route every bias-free ``nn.Linear`` of ``model_parts`` through the ledger's checked linear while it checks.

    Returns (how many linears are checked, how many MoE experts, why the others are not, the function that
    puts the forwards back)."""
    import torch

    from torchtitan.models.common.moe import GroupedExperts

    installed, skipped, grouped = [], [], []
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, GroupedExperts):
                grouped.append(module)
                module._grouped_mm = _checked_grouped_mm(module, ledger, corruptible=len(grouped) == 1)
                continue
            # nn.Linear and its subclasses that keep its forward (torchtitan's configurable Linear); Float8Linear
            # and the like compute otherwise
            if not isinstance(module, torch.nn.Linear):
                continue
            if type(module).forward is not torch.nn.Linear.forward:
                skipped.append(f"{name} ({type(module).__name__}'s own forward)")
                continue
            if module.bias is not None:
                skipped.append(f"{name} (bias)")
                continue
            put_back = _route_forward(module, _checked_forward(module, ledger, corruptible=not installed))
            if put_back is None:
                skipped.append(f"{name} (forward wrapped by {getattr(vars(module)['forward'], '__qualname__', '?')})")
                continue
            installed.append(put_back)

    def restore() -> None:
        for put_back in installed:
            put_back()
        for module in grouped:
            vars(module).pop("_grouped_mm", None)

    return len(installed), len(grouped), skipped, restore


def _route_forward(module, checked):
    """Make ``checked`` the function that computes ``module``'s product; returns the function that puts the
    original back, or None where the module's forward is wrapped in a way this does not know.

    torchtitan's ``Module.parallelize`` (every configurable Linear, tensor-parallel or not) sets the instance's
    forward to ``forward_with_redistribution``, which redistributes the inputs, calls ``fn`` (the bound
    ``nn.Linear.forward``, taken at parallelize time) and redistributes the outputs: ``checked`` takes ``fn``'s
    place in that closure, so the redistributions still run around it."""
    import torch

    wrapper = vars(module).get("forward")
    if wrapper is None:
        module.forward = checked
        return lambda: vars(module).pop("forward", None)
    code = getattr(wrapper, "__code__", None)
    if getattr(wrapper, "__name__", None) != "forward_with_redistribution" or "fn" not in code.co_freevars:
        return None
    cell = wrapper.__closure__[code.co_freevars.index("fn")]
    inner = cell.cell_contents
    if getattr(inner, "__func__", None) is not torch.nn.Linear.forward or inner.__self__ is not module:
        return None  # a local_map region, or a forward of its own
    cell.cell_contents = checked
    return lambda: setattr(cell, "cell_contents", inner)


def _checked_forward(module, ledger, corruptible: bool):
    import torch

    from npu_inject.ops.matmul_check import checkable, tensor_parallel_layout

    original = type(module).forward

    def forward(input):
        weight = module.weight  # FSDP's unsharded parameter during the forward
        if ledger.checking:
            if checkable(input, weight, None):
                return ledger.linear(input, weight, corruptible)
            layout = tensor_parallel_layout(input, weight)
            if layout is not None and checkable(input.to_local(), weight.to_local(), None):
                return ledger.linear_tensor_parallel(input, weight, layout, corruptible)
            if torch.is_grad_enabled():  # a validation's forward is not the step's
                ledger.skip()
        return original(module, input)

    return forward


def _checked_grouped_mm(module, ledger, corruptible: bool):
    """MoE experts' grouped products (``GroupedExperts._grouped_mm``, upstream's seam, as the class has it then:
    upstream's torch._grouped_mm or patch moe_dispatch's npu_grouped_matmul) checked, their backward untouched."""
    from npu_inject.ops.matmul_check import grouped_checkable

    def grouped_mm(*, A, B_t, offs):
        original = type(module)._grouped_mm
        if ledger.checking and grouped_checkable(A, B_t, offs):
            return ledger.grouped_mm(lambda a, b, offsets: original(module, A=a, B_t=b, offs=offsets), A, B_t, offs,
                                     corruptible)
        return original(module, A=A, B_t=B_t, offs=offs)

    # the offsets' dtype the class's product asks for (patch swiglu reads it from the instance)
    marked = getattr(type(module)._grouped_mm, "npu_inject_offsets_dtype", None)
    if marked is not None:
        grouped_mm.npu_inject_offsets_dtype = marked
    return grouped_mm


def probe_device_kernel(device) -> str | None:
    """None when torch_npu's ``_npu_matmul_abft_verify`` runs on ``device`` and answers right; else why not."""
    import torch

    if device.type != "npu":
        return f"the device is {device.type}, not an NPU"
    try:
        kernel = torch.ops.npu._npu_matmul_abft_verify
        a = torch.ones(8, 16, dtype=torch.bfloat16, device=device)
        c = torch.full((8, 16), 16.0, dtype=torch.float32, device=device)
        comp_row = kernel(a, a.new_ones(16, 16), c, a.new_ones(16), e_max=0.001)
        answer = comp_row.cpu().tolist()
    except (AttributeError, RuntimeError, TypeError) as error:
        return f"torch_npu's _npu_matmul_abft_verify is not usable here ({str(error).splitlines()[0][:200]})"
    if answer != [255]:
        return f"torch_npu's _npu_matmul_abft_verify called a correct product wrong (comp_row {answer})"
    return None


def apply(ctx: PatchContext) -> None:
    options = ctx.options  # registry.json's option_rules keep each >= 1
    settings = selection.current().settings
    every = settings.sdc_every or options["every"]
    source = "TORCHTITAN_NPU_SDC_EVERY" if settings.sdc_every else "the registry option every"
    unchecked = [fault.item for fault in settings.faults
                 if fault.kind in ("sdc_matmul", "sdc_expert") and fault.step % every]
    if unchecked:
        stop_run(f"npu_inject matmul_checks: TORCHTITAN_NPU_FAULTS: {unchecked[0]!r} is not a checked step (every "
                 f"{every}, from {source}), so the fault would never be caused; use a multiple of {every}")
    state: dict = {"ledger": None, "said": False, "said_unchecked": False, "verified": None, "first": True}
    strikes: dict[int, deque] = {}  # rank: the steps its products failed on

    def say(line: str) -> None:
        """In the report on every rank, logged by rank 0 (every rank reads the same table, so writes the same line)."""
        ctx.note(line)
        if int(os.environ.get("RANK", "0")) == 0:
            logger.warning("npu_inject matmul_checks: %s", line)

    def start(trainer) -> None:
        from npu_inject.ops.matmul_check import Ledger

        ledger = state["ledger"] = Ledger(trainer.device)
        count, experts, skipped, restore = install(trainer.model_parts, ledger)
        ctx.add_cleanup(restore)
        rank = int(os.environ.get("RANK", "0"))
        wanted = [fault.item for fault in settings.faults if fault.kind == "sdc_expert" and fault.rank in (None, rank)]
        if wanted and not experts:
            stop_run(f"npu_inject matmul_checks: TORCHTITAN_NPU_FAULTS: {wanted[0]!r} corrupts an MoE experts' grouped "
                     f"product, but rank {rank}'s model has no GroupedExperts, so the fault would never be caused; "
                     "use sdc_matmul, or a rank whose pipeline stage holds experts")
        why_not = probe_device_kernel(ledger.device)
        ledger.device_kernel = why_not is None
        if why_not is not None:
            ctx.fallback(f"products checked by the torch check (V-ABFT in torch), not on the device's kernel: {why_not}")
        ctx.note(f"every {every} steps ({source}): {count} linears"
                 + (f" and {experts} MoE experts' grouped products (the torch check)" if experts else "") + " checked"
                 + (f"; not checked: {', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}" if skipped else ""))

    def before_step(step: Step) -> None:
        if state["ledger"] is None:
            start(step.trainer)
        ledger = state["ledger"]
        # a pipeline stage's first step infers its shapes by a forward and backward of uninitialised buffers
        # (torch.distributed.pipelining): products of garbage, overflowing, that no check should judge
        inferring = state["first"] and getattr(step.trainer.parallel_dims, "pp_enabled", False)
        if inferring and step.number % every == 0:
            ctx.note(f"step {step.number} not checked: the pipeline stages infer their shapes in this process's first "
                     "step from uninitialised buffers")
        state["first"] = False
        ledger.checking = step.number % every == 0 and not inferring
        if ledger.checking:  # nothing on the device on unchecked steps
            ledger.reset()
        for kind, corruption in (("sdc_matmul", ledger.corruption), ("sdc_expert", ledger.expert_corruption)):
            if kind in step.armed:
                corruption.fill_(1.0)
                step.on_exit(lambda corruption=corruption: corruption.fill_(0.0))

    def before_optimizer(step: Step) -> None:
        ledger = state["ledger"]
        if ledger is None or not ledger.checking:
            return
        import torch
        import torch.distributed as dist

        counts = ledger.local_counts()
        distributed = dist.is_available() and dist.is_initialized()
        size = dist.get_world_size() if distributed else 1
        columns = counts.numel()
        if size > 1:
            gathered = torch.empty(size * columns, dtype=counts.dtype, device=counts.device)
            dist.all_gather_into_tensor(gathered, counts)
        else:
            gathered = counts
        table = gathered.view(size, columns).cpu().tolist()  # the one host read of the step's verdicts
        if not any(row[2] for row in table):
            stop_run(f"npu_inject matmul_checks: step {step.number} was to be checked, but no rank checked any matmul "
                     "(the report's 'not checked' line says which linears the check does not take): switch the check "
                     "off (TORCHTITAN_NPU_PATCHES=-matmul_checks)")
        unchecked = {rank: int(row[4]) for rank, row in enumerate(table) if row[4]}
        if unchecked and not state["said_unchecked"]:
            state["said_unchecked"] = True
            say(f"step {step.number}: some linear calls ran unchecked (a layout, dtype or stride the check does not "
                f"take; the others were checked): " + ", ".join(f"{count} on rank {rank}" for rank, count in
                                                               unchecked.items()))
        lost = [rank for rank, row in enumerate(table) if row[2] and not row[3]]
        if lost:
            stop_run(f"npu_inject matmul_checks: step {step.number}: rank {lost[0]}'s forward products were checked "
                     "but none of its backward products' verdicts arrived (a pipeline schedule that computes weight "
                     "gradients apart from the backward?): the backward is unchecked; switch the check off "
                     "(TORCHTITAN_NPU_PATCHES=-matmul_checks) for this schedule")
        failed = {rank: row for rank, row in enumerate(table) if row[0] or row[1]}
        across_groups = commits_every_step(step.trainer)
        if across_groups:
            # this attempt's gradients were averaged across the replica groups before the check, and torchft's
            # should_commit answers for one group only, so every group learns of a failure anywhere (one more
            # collective and host read, on checked steps) and keeps the step out.
            elsewhere = torch.full((1,), float(len(failed)), device=counts.device)
            step.trainer.ft_manager.manager.allreduce(elsewhere, reduce_op=dist.ReduceOp.SUM).wait()
            if float(elsewhere.item()) > 0 and not failed:
                say(f"step {step.number}: another replica group's matmul results failed their checksums: the update "
                    "was not applied on any replica group (torchft refuses the step); its batches are skipped")
                step.skip_update(f"matmul checksums failed in another replica group at step {step.number}")
                return
        if not failed:
            if not state["said"]:
                state["said"] = True
                ctx.note(f"step {step.number}: {int(sum(row[2] for row in table))} forward and "
                         f"{int(sum(row[3] for row in table))} backward checked products on {size} rank(s), all correct")
            state["verified"] = step.number
            return
        parts = []
        for rank, row in failed.items():
            seen = strikes.setdefault(rank, deque())
            seen.append(step.number)
            while seen and seen[0] <= step.number - options["window"]:
                seen.popleft()
            parts.append(f"{who(rank)}: {int(row[0])} forward and {int(row[1])} backward verdicts failed "
                         f"(strike {len(seen)} of {options['stop_after']} in {options['window']} steps)")
        line = f"step {step.number} attempt {step.attempt + 1}: matmul results failed their checksums on " + "; ".join(parts)
        drained = [rank for rank in failed if len(strikes[rank]) >= options["stop_after"]]
        if drained:
            stop_run(f"npu_inject matmul_checks: {line}: {', '.join(map(who, drained))} failed {options['stop_after']} "
                     f"times in {options['window']} steps (stop_after, window): drain its device; the weights are "
                     f"those of step {step.number - 1}, the last update (verified at step {state['verified']})")
        if across_groups:
            # no retry: the other groups would not wait for one (measured: their next all-reduce timed out)
            say(f"{line}: the update was not applied on any replica group (torchft refuses the step); its batches are "
                "skipped")
            step.skip_update(f"matmul checksums failed on {', '.join(map(who, failed))}")
            return
        raise SilentCorruption(line)

    def on_failure(step: Step, error: Exception):
        if not isinstance(error, SilentCorruption):
            return None
        line = f"{error}: the update was not applied; the step runs again on the same batches"

        def retry():
            say(line)
            state["ledger"].reset()
            state["ledger"].corruption.fill_(0.0)  # sdc_matmul and sdc_expert corrupt the first attempt only
            state["ledger"].expert_corruption.fill_(0.0)
            return RETRY

        return retry

    take_part(ctx, before_step=before_step, before_optimizer=before_optimizer, on_failure=on_failure)
