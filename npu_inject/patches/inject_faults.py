"""Faults on purpose, to rehearse what a long job meets: TORCHTITAN_NPU_FAULTS names them.

Off by default; ``TORCHTITAN_NPU_PATCHES=+inject_faults`` with ``TORCHTITAN_NPU_FAULTS`` set causes
them (the variable set without the patch stops at start-up: faults asked for and silently not caused
would let a recovery check pass for nothing). Its form is ``KIND@STEP`` or ``KIND@STEP:rank=R``,
comma-separated; a bad item stops at start-up naming it.

* ``nan_loss@K``: during training step K, the output of the rank's first model part is multiplied by
  NaN, so that rank's loss and, through the gradient reduction, every rank's gradients are NaN (what a
  bad batch or an overflow does). With :mod:`npu_inject.patches.finite_steps` the step is then not
  applied; without it, torchtitan writes NaN into the weights.
* ``loss_spike@K``: the same with a finite factor (50): the loss and the gradient norm of step K rise
  many-fold, as a bad batch throws them up. :mod:`npu_inject.patches.spikes` keeps the update out.
* ``bitflip_param@K``: after step K's update, the lowest exponent bit of the first element of the rank's first
  parameter (its local shard) is flipped: the value halves or doubles, finite, as a flipped bit in memory
  leaves it; the rank's replica now differs from the others, which :mod:`npu_inject.patches.replica_check`
  catches on its next checked step.
* ``sdc_matmul@K``: in step K's forward, one finite wrong value in one matmul result: the first element x of the
  forward product of the rank's first checked linear becomes 1024 x + 1024, as a chip that miscomputes a block
  leaves it (nothing raises, nothing is NaN). Caused by :mod:`npu_inject.patches.matmul_checks` (required; K
  must be a step it checks), in the step's first attempt only, so the retried attempt computes it right.
* ``sdc_expert@K``: the same in each grouped product's result of the model's first MoE experts (its first
  ``GroupedExperts``: the gate, up and down projections) in step K's forward.
* ``kill@K``: as step K starts, the rank's process sends itself SIGKILL: no exception, no cleanup, what
  a lost node or the OOM killer leaves. Its peers' next collective fails or times out.
* ``hang@K``: as step K starts, the rank sleeps and never returns, as a hung device or a collective
  whose peer is gone would: its peers' next collective times out (``--comm.train_timeout_seconds``,
  torchft's ``--fault_tolerance.process_group_timeout_ms``).

* ``kill_in_forward@K``, ``hang_in_forward@K``: the same, in the rank's forward of step K (a forward pre-hook
  of its first model part), after the step began: with torchft the rank's group has joined the step's
  quorum, so its peers meet the failure inside a collective (their group's, or torchft's cross-group
  all-reduce) instead of before it.

* ``uce_in_forward@K``: in the rank's forward of step K, a device memory error (UCE), on the CANN emulation
  (``verification/cann_emu``) only: a 64 MiB block is taken from torch_npu's allocator and given back (memory
  only the step's temporaries use), the emulation marks it bad, and the next kernel fails as the device
  reports a UCE (ACL_ERROR_RT_DEVICE_MEM_ERROR, then ``aclrtGetMemUceInfo``). torch_npu stops its task queue
  ("UCE ERROR"); :mod:`npu_inject.patches.uce_repair` repairs it (:mod:`npu_inject.patches.step_repair` with
  several ranks). Once per run, every attempt.
* ``uce_in_state@K``: the same on the memory of the rank's first parameter (the job's state: not repairable in the
  job); ``uce_in_update@K``: the same as step K's optimizer begins (its update may be cut: not repairable).

* ``link_error@K``, ``stuck_collective@K``: on the CANN emulation only, the rank's next HCCL collective after
  its forward of step K began fails as a broken link does (HCCL_E_TCP_TRANSFER, on the communicator for good), or
  never completes until the device is stopped (``cann_emu_inject_hccl_fault``); the peers wait in the same
  collective. :mod:`npu_inject.patches.step_repair` repairs both. Once per run; an item given twice fails the
  retried attempt too (a second fault in the same step).

``kill`` and ``hang`` (and their ``_in_forward`` forms) fire as the first step at or after K starts (a rank healed from a torchft peer
jumps to the peer's step), in the launcher's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT
unset or 0): the ranks ``--max-restarts`` brings back train on, which is what a recovery check needs.

A fault that could never be caused stops every rank at start-up with one line naming it: one aimed at a
rank the job does not have (``rank=R`` with R >= the job's rank count), or at a step after the last one
(``--training.steps``). The check runs as ``Trainer.__init__`` (or an override of it) starts, the first
point where both are known (the config is parsed after this patch applies): the rank count is torchrun's
``WORLD_SIZE``, or ``NGPU`` in torchtitan's fake comm modes, as torchtitan's ``init_distributed`` takes
it. A fault at a step a resumed run has already passed is not checked.

Module ``torchtitan.trainer``: ``Trainer.__init__`` is wrapped, and the patch takes part in the step before it
runs and after it (:mod:`npu_inject.training_step`); a forward hook lives for the chosen step only. Each fault
caused is said on stderr by the rank that causes it (``npu_inject inject_faults: step K: KIND on rank R``) and
noted in its report (a killed or hung rank writes none).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.settings import ENV_FAULTS
from npu_inject.training_step import Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.__init__",
    "torchtitan.trainer:Trainer.train_step",
)

FAKE_COMM_MODES = ("fake_backend", "local_tensor")  # torchtitan's one-process modes, sized by NGPU


SPIKE_SCALE = 50.0  # loss_spike: the first model part's output times this (logits: the loss rises many-fold)


def _scaled(factor: float):
    def scale(module, args, output):
        if isinstance(output, tuple):
            return (output[0] * factor, *output[1:])
        return output * factor

    return scale


def announce(kind: str, step: int) -> None:
    """One line on stderr as this rank causes a fault (the report alone would miss a killed or hung rank)."""
    print(f"npu_inject inject_faults: step {step}: {kind} on rank {os.environ.get('RANK', '0')}",
          file=sys.stderr, flush=True)


def never_caused(faults, world_size: int | None, steps: int, size_from: str = "WORLD_SIZE") -> str | None:
    """The first fault of ``faults`` this job could never cause (a rank outside 0..``world_size``-1, a step
    after ``steps``), as one line; None when each can be caused. ``world_size`` (read from variable
    ``size_from``) None: not known, not checked."""
    for fault in faults:
        if world_size is not None and fault.rank is not None and fault.rank >= world_size:
            return (f"npu_inject inject_faults: {ENV_FAULTS}: {fault.item!r}: the job has no rank {fault.rank} "
                    f"(its ranks are 0..{world_size - 1}, {size_from}={world_size}), so the fault would never be "
                    f"caused; aim it at a rank 0..{world_size - 1}, or drop :rank= to cause it on every rank")
        if fault.step > steps:
            return (f"npu_inject inject_faults: {ENV_FAULTS}: {fault.item!r}: step {fault.step} is after the "
                    f"job's last step (--training.steps {steps}), so the fault would never be caused; use a "
                    f"step 1..{steps}, or train longer")
    return None


def job_world_size(comm_mode: str) -> tuple[int | None, str]:
    """The job's rank count as torchtitan's init_distributed will take it, and the variable it comes from; None
    where that is not set (torchtitan then fails there with its own message)."""
    name = "NGPU" if comm_mode in FAKE_COMM_MODES else "WORLD_SIZE"
    value = os.environ.get(name, "")
    return (int(value) if value.isdigit() else None), name


EXPONENT_LOW_BIT = {"float32": (23, "int32"), "bfloat16": (7, "int16"), "float16": (10, "int16")}


def flip_exponent_bit(model) -> str:
    """Flip the lowest exponent bit of the first element of ``model``'s first parameter (its local shard); returns
    the parameter's name."""
    import torch

    name, parameter = next(iter(model.named_parameters()))
    tensor = parameter.detach()
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    bit, integer = EXPONENT_LOW_BIT[str(tensor.dtype).removeprefix("torch.")]
    with torch.no_grad():
        bits = tensor.view(getattr(torch, integer)).view(-1)
        bits[0] ^= 1 << bit
    return name


def stop(kind: str, step: int) -> None:
    """Kill or hang this rank now. Said on stderr, not in the report: a killed or hung rank writes no report."""
    announce(kind, step)
    if kind.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()


UCE_KINDS = ("uce_in_forward", "uce_in_state", "uce_in_update")
UCE_BLOCK_BYTES = 64 << 20  # its own segment of torch_npu's allocator, released whole by empty_cache


def _emulation_entry(library: str, symbol: str, kinds: str, what: str):
    """The CANN emulation's entry ``symbol`` of ``library`` that causes ``kinds``, or a stop naming them."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(library), symbol)
    except (OSError, AttributeError):
        stop_run(f"npu_inject inject_faults: {kinds} needs the CANN emulation (verification/cann_emu: "
                 f"eval \"$(python verification/cann_emu/env.py)\"): only there can {what} be caused on purpose; a "
                 f"real device's {library} has no such entry")


HCCL_FAULT_MODES = {"link_error": 1, "stuck_collective": 2}  # cann_emu_inject_hccl_fault's modes


def _cause_mem_uce(inject, device, step: int, rank: int, held=None) -> None:
    """Mark device memory bad: a fresh 64 MiB block given back at once (memory of the step's temporaries), or the
    memory of the tensor ``held`` (the job's state)."""
    import ctypes

    import torch

    torch.accelerator.synchronize()  # the step's own work meets it, not work queued before
    block = torch.empty(UCE_BLOCK_BYTES, dtype=torch.uint8, device=device) if held is None else held
    print(f"npu_inject inject_faults: step {step}: device memory error (UCE) at {block.data_ptr():#x} on rank {rank}",
          file=sys.stderr, flush=True)
    status = inject(ctypes.c_void_p(block.data_ptr()), ctypes.c_size_t(block.nbytes))
    if status != 0:
        stop_run(f"npu_inject inject_faults: the CANN emulation refused the memory error (status {status})")
    # a fresh block goes back to the allocator's cache here: memory of the step's temporaries


def apply(ctx: PatchContext) -> None:
    from npu_inject import selection

    faults = selection.current().settings.faults
    rank = int(os.environ.get("RANK", "0"))
    mine = [fault for fault in faults if fault.rank in (None, rank)]
    scaled_steps = {kind: {fault.step for fault in mine if fault.kind == kind} for kind in ("nan_loss", "loss_spike")}
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    stops = {fault.step: fault.kind for fault in mine
             if fault.kind in ("kill", "hang", "kill_in_forward", "hang_in_forward") and first_attempt}

    uce_steps = {(fault.step, fault.kind) for fault in mine if fault.kind in UCE_KINDS}
    flip_steps = {fault.step for fault in mine if fault.kind == "bitflip_param"}
    sdc_steps = {(fault.step, fault.kind) for fault in mine if fault.kind in ("sdc_matmul", "sdc_expert")}
    inject_uce = _emulation_entry("libascendcl.so", "cann_emu_inject_mem_uce", "uce_in_forward",
                                  "a device memory error") if uce_steps else None
    hccl_faults = [(fault.step, fault.kind) for fault in mine if fault.kind in HCCL_FAULT_MODES]
    inject_hccl = _emulation_entry("libhccl.so", "cann_emu_inject_hccl_fault", "link_error or stuck_collective",
                                   "an HCCL collective's failure") if hccl_faults else None

    def trainer_init(original, trainer, config, *args, **kwargs):
        world_size, size_from = job_world_size(config.comm.mode)
        problem = never_caused(faults, world_size, config.training.steps, size_from)
        if problem is not None:
            stop_run(problem)
        return original(trainer, config, *args, **kwargs)

    def arm_uce(step: Step, kind: str) -> None:
        trainer, number = step.trainer, step.trainer.step

        def cause_uce(*args):
            handle.remove()
            held = None
            if kind == "uce_in_state":  # the local memory of the rank's first parameter
                held = next(trainer.model_parts[0].parameters())
                held = held.to_local() if hasattr(held, "to_local") else held
            _cause_mem_uce(inject_uce, trainer.device, number, rank, held)
            where = "" if kind == "uce_in_forward" else f" ({kind})"
            ctx.note(f"step {number}: device memory error (UCE) injected on rank {rank}{where}")

        if kind == "uce_in_update":  # the next kernel is the optimizer's first
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            handle = register_optimizer_step_pre_hook(cause_uce)
        else:
            handle = trainer.model_parts[0].register_forward_pre_hook(cause_uce)
        step.on_exit(handle.remove)

    def arm_hccl_fault(step: Step, kind: str, times: int) -> None:
        """The rank's next collective after the forward of each of ``times`` attempts of the step began fails."""
        number, left = step.trainer.step, [times]

        def cause_hccl_fault(module, args):
            left[0] -= 1
            if left[0] == 0:
                hook.remove()
            announce(kind, number)
            status = inject_hccl(HCCL_FAULT_MODES[kind])
            if status != 0:
                stop_run(f"npu_inject inject_faults: the CANN emulation refused {kind} (status {status})")
            ctx.note(f"step {number}: {kind} injected on rank {rank}")

        hook = step.trainer.model_parts[0].register_forward_pre_hook(cause_hccl_fault)
        step.on_exit(hook.remove)

    def before_step(step: Step) -> None:
        trainer = step.trainer
        for number, kind in sorted(uce_steps):  # once: the step retried after the repair runs clean
            if number == trainer.step:
                uce_steps.discard((number, kind))
                arm_uce(step, kind)
        due_hccl = [kind for number, kind in hccl_faults if number == trainer.step]
        for kind in dict.fromkeys(due_hccl):  # an item given twice fails the step's retry too
            arm_hccl_fault(step, kind, due_hccl.count(kind))
        hccl_faults[:] = [(number, kind) for number, kind in hccl_faults if number != trainer.step]
        # the first step at or after K: a rank that healed from a torchft peer may jump past K
        due = [number for number in stops if number <= trainer.step]
        kind = stops.pop(min(due)) if due else None
        if kind in ("kill", "hang"):
            stop(kind, trainer.step)
        elif kind:  # the model's forward: the step's quorum and its first collectives have begun
            # Bound now: the loops below rebind ``kind`` (a hook reading it late caused loss_spike instead).
            trainer.model_parts[0].register_forward_pre_hook(
                lambda module, args, kind=kind, number=trainer.step: stop(kind, number))
        for number, kind in sorted(sdc_steps):  # matmul_checks causes it, in this first attempt
            if number == trainer.step:
                sdc_steps.discard((number, kind))
                step.armed.add(kind)
                announce(kind, trainer.step)
                ctx.note(f"step {trainer.step}: {kind} injected on rank {rank}")
        for kind, factor in (("nan_loss", float("nan")), ("loss_spike", SPIKE_SCALE)):
            if trainer.step in scaled_steps[kind]:
                step.on_exit(trainer.model_parts[0].register_forward_hook(_scaled(factor)).remove)
                announce(kind, trainer.step)
                ctx.note(f"step {trainer.step}: {kind} injected on rank {rank}")

    # torchft's trainer overrides __init__ without calling the base one; the check runs again (the same
    # verdict) where an override calls super().__init__
    ctx.wrap_overrides("Trainer.__init__", trainer_init)
    def after_step(step: Step) -> None:
        if step.number in flip_steps:
            flip_steps.discard(step.number)
            name = flip_exponent_bit(step.trainer.model_parts[0])
            announce("bitflip_param", step.number)
            ctx.note(f"step {step.number}: bitflip_param injected on rank {rank} ({name}, after the update)")

    take_part(ctx, before_step=before_step, after_step=after_step)
