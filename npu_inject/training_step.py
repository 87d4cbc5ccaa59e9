"""The training step's one owner: the patches that act on a step take part in its named phases.

torchtitan's ``Trainer.train_step`` takes a step's batches from the data iterator, runs forward and backward
for each, clips the gradients (``dist_utils.clip_grad_norm_``, the job's total norm) and steps the optimizers
and learning-rate schedulers. Patch ``step_owner`` wraps it (and the overrides of torchft's, flux's and the
graph trainer's) and ``clip_grad_norm_`` once; the patches that guard, repair or fault a step register here
for its phases instead of each wrapping it in turn (their nesting was registry.json's key order, which nothing
stated):

* ``before_step(step)``: the step is about to run, once per step (not again for a retry);
* ``before_optimizer(step)``: the backward ran and the gradients are clipped (``step.grad_norm``), the
  optimizer has not stepped: :meth:`Step.skip_update` keeps this attempt's update out;
* ``after_step(step)``: the step returned (its update applied, or kept out, or the step discarded);
* ``on_failure(step, error)``: the attempt raised. A handler returns None (not its error) or a recovery, a
  function called once the failed attempt's frames (and tensors) are gone, which returns :data:`RETRY` (the
  step runs again on the same batches) or :data:`DISCARD` (the step counts as trained, nothing applied).
  The first handler that answers decides; no answer re-raises the error.

The phases run in :data:`ORDER`, outermost first: before-phases in that order, after- and failure-phases in
reverse, as nested wrappers would run. A patch not in ORDER cannot take part (it names this file); the order
is checked in tests/unit/runtime/test_training_step.py. The step's batches are kept by the owner, the one
place that does, so that a retry gets exactly what the failed attempt got (:class:`StepBatches`).

torch is imported by the functions only: the runtime core imports this module without it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

# Outermost first. restart_progress watches whole steps (a retry inside one is the same step); torchft_leave's
# watchdog bounds the whole step, retries included; replica_check compares the replicas after everything inside
# the step changed them (a bit inject_faults flips after the update among it); uce_repair and torchft_recover
# repair what an attempt's device work met, outside the faults caused in it; matmul_checks reads the attempt's
# verdicts first (a corrupted attempt is retried before anything judges its gradients), then finite_steps and
# spikes judge the finished backward.
ORDER = (
    "restart_progress",
    "torchft_leave",
    "replica_check",
    "uce_repair",
    "step_repair",
    "torchft_recover",
    "inject_faults",
    "matmul_checks",
    "finite_steps",
    "spikes",
)
PHASES = ("before_step", "before_optimizer", "after_step", "on_failure")


class _Decision:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


RETRY = _Decision("RETRY")
DISCARD = _Decision("DISCARD")
_NOT_SET = object()


class StepBatches:
    """The data iterator of one step, which can give the step's batches again from the first.

    torchtitan moves each batch's tensors to the device in the dict it was given, so each pass gets a new
    dict (of the loader's own class: batch_host_copies' remembers the host tensors) of the batch's tensors.
    Memory: the step's host batches, which the loader made anyway, live until the step ends."""

    def __init__(self, source) -> None:
        self.source, self.taken, self.position = source, [], 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position == len(self.taken):
            self.taken.append(next(self.source))
        item = self.taken[self.position]
        self.position += 1
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], dict):
            return copy.copy(item[0]), item[1]
        return item

    def rewind(self) -> None:
        self.position = 0

    @classmethod
    def of(cls, taken: list) -> "StepBatches":
        """The batches an earlier step took, to give again (a rollback's retraining)."""
        batches = cls(iter(()))
        batches.taken = list(taken)
        return batches


@dataclass
class Step:
    """One training step as the owner runs it."""

    trainer: Any
    batches: StepBatches
    number: int  # torchtitan's step counter as the step began
    attempt: int = 0  # 0, then 1 for the first retry
    grad_norm: Any = None  # this attempt's total gradient norm (a tensor), once clipped
    update_began: bool = False  # an optimizer's step began in this attempt (torch.optim's step pre-hook)
    skipped: list[str] = field(default_factory=list)  # why this attempt's update was kept out
    discarded: bool = False  # a failure handler discarded the step
    armed: set[str] = field(default_factory=set)  # faults inject_faults armed for this step (another patch causes them)
    _grad_norm_value: float | None = None
    _reads_along: dict[str, Callable[[], Any]] = field(default_factory=dict)  # name -> makes a device scalar
    _made: dict[str, Any] = field(default_factory=dict)  # this attempt's made scalars, read with the norm
    _values_read: dict[str, float] = field(default_factory=dict)
    _rerun: Callable[[StepBatches], Any] | None = None  # torchtitan's train_step of this step, unwrapped
    _shadowed: list = field(default_factory=list)
    _exits: list[Callable[[], None]] = field(default_factory=list)

    def grad_norm_value(self) -> float:
        """The total gradient norm as a Python float: one device-to-host copy per attempt, shared by the phases
        (with the scalars registered by :meth:`read_along`, in the same copy)."""
        if self._grad_norm_value is None:
            import torch

            norm = self.grad_norm
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            names = list(self._made)
            if not names:
                self._grad_norm_value = float(norm)
            else:
                values = torch.stack([norm.reshape(()).float(), *(self._made[name].reshape(()).to(
                    device=norm.device, dtype=torch.float32) for name in names)]).tolist()
                self._grad_norm_value = values[0]
                self._values_read = dict(zip(names, values[1:]))
        return self._grad_norm_value

    def read_along(self, name: str, make: Callable[[], Any]) -> None:
        """Read the device scalar ``make()`` returns in the gradient norm's one host copy, on every attempt.

        The owner calls ``make`` on every rank as soon as the gradients are clipped, before any phase handler, so
        a collective inside it runs at the same point on every rank; :meth:`value_read` returns the value."""
        if name in self._reads_along:
            raise ValueError(f"step {self.number}: a value named {name!r} is already read along with the gradient "
                             "norm (npu_inject/training_step.py); choose another name")
        self._reads_along[name] = make

    def value_read(self, name: str) -> float:
        """The value of ``name`` (see :meth:`read_along`) for this attempt, read with the gradient norm."""
        if name not in self._made:
            raise KeyError(f"step {self.number}: no value {name!r} was made for this attempt (registered: "
                           f"{', '.join(self._reads_along) or 'none'}); read_along() it before the step's gradients "
                           "are clipped")
        self.grad_norm_value()
        return self._values_read[name]

    def skip_update(self, reason: str) -> None:
        """Keep this attempt's update out: the optimizers' and schedulers' ``step`` do nothing (their hooks,
        MoE's expert-bias update among them, do not run), so parameters, optimizer state and the learning rate
        stay those of the last applied step. With torchft committing every step, the reason is reported to
        torchft instead, whose ``should_commit`` then refuses the step on the whole replica group."""
        if self.skipped:
            self.skipped.append(reason)
            return
        self.skipped.append(reason)
        trainer = self.trainer
        if commits_every_step(trainer):
            trainer.ft_manager.manager.report_error(FloatingPointError(f"step {self.number}: {reason} (npu_inject)"))
        else:
            self._shadow(trainer.optimizers)
        self._shadow(trainer.lr_schedulers)

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the step ends, however it ends (newest first)."""
        self._exits.append(callback)

    def _shadow(self, owner) -> None:
        # An instance attribute shadows the method for this attempt only; one already there (another tool's
        # wrapper) is kept aside and put back.
        self._shadowed.append((owner, vars(owner).get("step", _NOT_SET)))
        owner.step = _no_step

    def _end_attempt(self) -> None:
        for owner, previous in reversed(self._shadowed):
            if previous is _NOT_SET:
                del owner.step
            else:
                owner.step = previous
        self._shadowed.clear()

    def _begin_retry(self) -> None:
        self.attempt += 1
        self.grad_norm, self._grad_norm_value, self.update_began = None, None, False
        self._made, self._values_read = {}, {}
        self.skipped = []
        self.batches.rewind()


def commits_every_step(trainer) -> bool:
    """Whether torchft commits every step (``--fault_tolerance.enable`` without a semi-sync method): the gradients
    are averaged across the replica groups, and torchft's ``should_commit`` answers for one group only."""
    ft = getattr(trainer, "ft_manager", None)
    return getattr(ft, "enabled", False) and getattr(ft, "use_async_quorum", False)


def _no_step(*args, **kwargs) -> None:
    return None


@dataclass
class _Participant:
    patch_id: str
    handlers: dict[str, Callable]


class StepOwner:
    """The participants of this process's steps and the step in progress."""

    def __init__(self) -> None:
        self.participants: list[_Participant] = []
        self.current: Step | None = None
        self.retraining = False  # steps of a rollback run inside the current one: no phase runs for them

    def take_part(self, patch_id: str, handlers: dict[str, Callable]) -> Callable[[], None]:
        """Register ``patch_id``'s phase handlers; returns the function that removes them."""
        if patch_id not in ORDER:
            raise ValueError(f"patch {patch_id!r} takes part in the training step but is not in ORDER of "
                             f"{__file__} ({', '.join(ORDER)}); add it where its phases should run")
        unknown = sorted(set(handlers) - set(PHASES))
        if unknown:
            raise ValueError(f"patch {patch_id!r}: unknown step phase(s) {', '.join(unknown)}; the phases are "
                             f"{', '.join(PHASES)}")
        if any(participant.patch_id == patch_id for participant in self.participants):
            raise ValueError(f"patch {patch_id!r} already takes part in the training step")
        participant = _Participant(patch_id, {name: fn for name, fn in handlers.items() if fn is not None})
        self.participants.append(participant)
        self.participants.sort(key=lambda each: ORDER.index(each.patch_id))
        return lambda: self.participants.remove(participant)

    def handlers(self, phase: str, reverse: bool = False) -> list[Callable]:
        ordered = reversed(self.participants) if reverse else self.participants
        return [participant.handlers[phase] for participant in ordered if phase in participant.handlers]

    def phase_order(self) -> dict[str, list[str]]:
        """Which patches run in each phase, in the order they run (the report and tests read it)."""
        order = {}
        for phase in PHASES:
            ordered = list(reversed(self.participants)) if phase in ("after_step", "on_failure") else self.participants
            order[phase] = [participant.patch_id for participant in ordered if phase in participant.handlers]
        return order

    # --- what patch step_owner installs ---------------------------------------------------------------------

    def train_step(self, original, trainer, data_iterator, *args, **kwargs):
        if self.current is not None:  # an override calling super().train_step(): the outer call owns the step
            return original(trainer, data_iterator, *args, **kwargs)
        step = Step(trainer, StepBatches(data_iterator), trainer.step)
        step._rerun = lambda batches: original(trainer, batches, *args, **kwargs)
        self.current = step
        try:
            for handler in self.handlers("before_step"):
                handler(step)
            while True:
                recovery = None
                try:
                    result = original(trainer, step.batches, *args, **kwargs)
                except Exception as error:
                    step._end_attempt()
                    recovery = self._recovery(step, error)
                    if recovery is None:
                        raise
                else:
                    step._end_attempt()
                    break
                # Out of the handler: the failed attempt's frames, and with them its tensors, are gone.
                decision = recovery()
                if decision is DISCARD:
                    step.discarded, result = True, None
                    break
                if decision is not RETRY:
                    raise TypeError(f"a step_owner recovery returned {decision!r}; valid: RETRY or DISCARD "
                                    f"(npu_inject/training_step.py)")
                step._begin_retry()
            for handler in self.handlers("after_step", reverse=True):
                handler(step)
            return result
        finally:
            self.current = None
            step._end_attempt()
            for callback in reversed(step._exits):
                callback()

    def _recovery(self, step: Step, error: Exception):
        for handler in self.handlers("on_failure", reverse=True):
            recovery = handler(step, error)
            if recovery is not None:
                return recovery
        return None

    def retrain(self, step: Step, number: int, taken: list, skipped: bool = False):
        """Train step ``number`` again on the batches it ``taken``, inside ``step`` (a rollback: the job's state was
        put back to before ``number``); torchtitan's step counter reads ``number`` meanwhile. No phase runs for it
        (its faults are not caused again, its checks not made: the state it starts from was verified); a step
        whose update was kept out (``skipped``) keeps it out again. Returns torchtitan's train_step's result."""
        trainer, now = step.trainer, step.trainer.step
        trainer.step, self.retraining = number, True
        loading = getattr(getattr(trainer, "metrics_processor", None), "data_loading_times", None)
        if isinstance(loading, list):  # torchtitan's train loop times each batch it loads; these were loaded before
            loading.append(0.0)
        if skipped:
            step._shadow(trainer.optimizers)
            step._shadow(trainer.lr_schedulers)
        try:
            return step._rerun(StepBatches.of(taken))
        finally:
            step._end_attempt()
            trainer.step, self.retraining = now, False

    def clipped(self, grad_norm) -> None:
        """``clip_grad_norm_`` returned ``grad_norm`` inside the step in progress."""
        step = self.current
        if step is None or self.retraining:  # the planner, tools: no step of the owner's; a rollback's steps
            return
        step.grad_norm, step._grad_norm_value = grad_norm, None
        step._made = {name: make() for name, make in step._reads_along.items()}
        step._values_read = {}
        for handler in self.handlers("before_optimizer"):
            handler(step)

    def optimizer_began(self) -> None:
        if self.current is not None and not self.retraining:
            self.current.update_began = True


OWNER = StepOwner()


def take_part(ctx, *, before_step=None, before_optimizer=None, after_step=None, on_failure=None) -> None:
    """Register patch ``ctx.patch_id``'s handlers for the step's phases until the patch is reverted.

    Records the patch's declared ``train_step`` targets as changed (through the owner)."""
    handlers = {"before_step": before_step, "before_optimizer": before_optimizer, "after_step": after_step,
                "on_failure": on_failure}
    remove = OWNER.take_part(ctx.patch_id, {name: fn for name, fn in handlers.items() if fn is not None})
    ctx.add_cleanup(remove)
    for target in ctx.declared_targets:
        if target.endswith(".train_step"):
            ctx.changed(target)
