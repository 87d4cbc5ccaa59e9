"""A replica group heals from a live peer without a collective off the training thread.

Module ``torchtitan.experiments.torchft.checkpoint`` (``--module torchft.*`` with ``--checkpoint.enable``).

When a replica group restarts, torchft's manager asks a healthy peer for its live state: in the peer's
quorum thread, while that peer's training thread runs its step, it calls the state-dict function
torchtitan registered (``TorchFTCheckpointManager``: the model through ``ModelWrapper.state_dict``).
torchtitan's fused attention projection (``FusedQKVLinear``, every llama3 config) splits
``wqkv`` into ``wq``/``wk``/``wv`` in a state-dict hook, after gathering the FSDP-sharded weight
(``redistribute`` to Replicate): a collective, issued from the quorum thread on the group the training
thread is using. With more than one rank per replica group the two threads' collectives interleave:
on gloo the healthy peer aborts ("Received data size doesn't match expected size"), so the failure of
one group kills the other; on HCCL or NCCL it would hang or mix the two.

What is served must also be the optimizer as it is now. torchtitan's ``TorchFTOptimizersContainer``
returns a state dict cached when the trainer was built: its state tensors are live, but its param-group
values (the learning rate the schedule sets every step) are those of step 0, both for a healing peer and
in every checkpoint written to disk. A healed group then makes its first step with the initial learning
rate: in the rehearsal its parameters stayed 1e-4 to 4e-4 (about one update) from the serving group's for
the rest of the run, optimizer states equal; a resume from disk would do the same. Here the container's
state dict is built when asked (upstream's flat optimizer state dict, which reads only the optimizers'
own state: no model access, no collective, the same tensors). And, as torchft does only for CUDA
and XPU tensors, every tensor a peer is offered is copied to host memory then (quorum time, before this
step's update) rather than read when the request is served: host memory for one copy of this rank's
model and optimizer shards while a peer heals.

Loading has the same trap as serving: torchft picks a recovery source per rank, so only some ranks of a group
may be healing, and upstream's load refreshes ``ModelWrapper``'s cache through the same split.

Here the state a peer serves holds the model's own tensors as they are (``wqkv`` unsplit, each rank's
shard, no hook run, no collective), read from the modules directly; optimizer, schedule and train
state are served as upstream serves them. The receiving rank checks that the served model state names
exactly the tensors its own model has (a mismatch stops with one line instead of a silently partial
heal: upstream loads with ``strict=False``), copies each shard into its own in place, and loads the
rest through upstream's load function. Each heal is noted in the report. Checkpoints on disk are
untouched: they keep upstream's split, portable layout.

The train state (step, tokens seen) is a plain counter the training thread moves while the peer's quorum
thread reads it: upstream served ``ntokens_seen`` from before or after the step's batch was counted, by chance,
and in one CI run of many a healed group ended with another ``ntokens_seen`` than its peer. Here each rank takes its
train state on the training thread as it starts a quorum; a peer serves that, and the healing rank adds what it
counted itself since its own quorum began (its batch of this step, or the steps of a DiLoCo window).

A group that torchrun restarts must also find its own manager: torchft's manager opens a client of the
launcher's store (MASTER_ADDR:MASTER_PORT) and its rank 0 publishes the manager's address there; the
store outlives the attempt, so a restarted rank may read the dead manager's address. The manager's
client sees the store under the attempt's prefix, as :mod:`npu_inject.patches.restart_store` gives the
main process group's rendezvous.
"""

from __future__ import annotations

from typing import Any

from npu_inject.errors import stop_run
from npu_inject.launcher import attempt_store_prefix
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.experiments.torchft.checkpoint:TorchFTCheckpointManager.__init__",
    "torchtitan.experiments.torchft.optimizer:TorchFTOptimizersContainer.state_dict",
    "torchft.manager:Manager.set_state_dict_fns",
    "torchft.manager:Manager.start_quorum",
    "torchft.manager:TCPStore",
)


def module_tensors(modules: list) -> dict[str, Any]:
    """Each module's parameters and persistent buffers by state-dict name, without running state-dict hooks."""
    tensors: dict[str, Any] = {}
    for model in modules:
        for prefix, module in model.named_modules():
            dotted = f"{prefix}." if prefix else ""
            for name, parameter in module.named_parameters(recurse=False):
                tensors[dotted + name] = parameter.detach()
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    tensors[dotted + name] = buffer.detach()
    return tensors


def rebased_counters(served: dict, own_at_quorum: dict, own_now: dict) -> dict:
    """The served train state plus what this rank counted since its quorum began (integer entries only)."""
    return {key: value + own_now[key] - own_at_quorum[key]
            if isinstance(value, int) and isinstance(own_now.get(key), int) and isinstance(own_at_quorum.get(key), int)
            else value for key, value in served.items()}


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def apply(ctx: PatchContext) -> None:
    import torch
    from torch.utils._pytree import tree_map_only
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.experiments.torchft import checkpoint as ft_checkpoint

    model_key = ft_checkpoint.MODEL
    # what upstream's state-dict function serves (TorchFTCheckpointManager.__init__)
    served_keys = {ft_checkpoint.MODEL, ft_checkpoint.OPTIMIZER, ft_checkpoint.LR_SCHEDULER, ft_checkpoint.TRAIN_STATE}
    building: list = []  # the checkpoint manager whose __init__ is registering its functions
    shards: dict[int, dict[str, Any]] = {}  # per checkpoint manager: its model's tensors, taken at rest
    train_states: dict[int, Any] = {}  # per torchft manager: torchtitan's train state (the trainer)
    at_quorum: dict[int, dict] = {}  # per torchft manager: the train state as its latest quorum began

    def init(original, manager, *args, **kwargs):
        building.append(manager)
        try:
            result = original(manager, *args, **kwargs)
        finally:
            building.pop()
        if id(manager) in shards:
            # Taken here, on the training thread with the model at rest: FSDP2 swaps unsharded parameters
            # into the modules during forward and backward, which a peer's request may meet. The sharded
            # parameters are the ones the optimizer updates in place, so these stay the live state.
            shards[id(manager)] = module_tensors(manager.states[model_key].model)
        return result

    def set_state_dict_fns(original, ft_manager, load_state_dict, state_dict):
        if not building:
            return original(ft_manager, load_state_dict, state_dict)
        checkpointer = building[-1]
        key_of_manager = id(checkpointer)
        shards[key_of_manager] = {}  # filled when its __init__ returns
        train_state_key = ft_checkpoint.TRAIN_STATE
        train_states[id(ft_manager)] = checkpointer.states.get(train_state_key)

        def live_state():
            # upstream's function, but the model's entry is its tensors as they are: no split, no collective;
            # the train state as the quorum began; and a copy in host memory, taken now (see the module docstring)
            served = {key: dict(shards[key_of_manager]) if key == model_key
                      else dict(at_quorum[id(ft_manager)]) if key == train_state_key and id(ft_manager) in at_quorum
                      else value.state_dict()
                      for key, value in checkpointer.states.items() if key in served_keys}
            return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True), served)

        def load_live_state(received):
            own = shards[key_of_manager]
            got = received.get(model_key, {})
            missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
            reshaped = [f"{key} {tuple(local(got[key]).shape)} for {tuple(local(own[key]).shape)}"
                        for key in sorted(set(own) & set(got)) if local(got[key]).shape != local(own[key]).shape]
            if missing or extra or reshaped:
                stop_run(f"npu_inject torchft_heal: the live state received from a peer replica group does not "
                         f"match this group's model ({len(missing)} tensors missing, e.g. {missing[:3]}; "
                         f"{len(extra)} unknown, e.g. {extra[:3]}; {len(reshaped)} of another shape, e.g. "
                         f"{reshaped[:2]}): every replica group must run the same model, layout, group size "
                         "and npu_inject patch selection")
            # Shard into shard, in place: no hook, no collective (torchft picks a recovery source per rank, so
            # only some ranks of a group may be healing). ModelWrapper's cached split tensors are recomputed
            # at its next state_dict(); its parameter entries share their storage.
            with torch.no_grad():
                for key, tensor in own.items():
                    local(tensor).copy_(local(got[key]))
            ctx.note(f"healed from a peer replica group's live state: {len(own)} model tensors copied in place, "
                     f"{', '.join(sorted(key for key in received if key != model_key))} through upstream's load")
            rest = {key: value for key, value in received.items() if key != model_key}
            trainer = train_states.get(id(ft_manager))
            if train_state_key in rest and trainer is not None and id(ft_manager) in at_quorum:
                rest[train_state_key] = rebased_counters(rest[train_state_key], at_quorum[id(ft_manager)],
                                                         trainer.state_dict())
            return load_state_dict(rest)

        return original(ft_manager, load_live_state, live_state)

    def start_quorum(original, ft_manager, *args, **kwargs):
        trainer = train_states.get(id(ft_manager))
        if trainer is not None:  # on the training thread, before the quorum thread may serve it
            at_quorum[id(ft_manager)] = dict(trainer.state_dict())
        return original(ft_manager, *args, **kwargs)

    tcp_store = None

    def manager_store(*args, **kwargs):
        store = tcp_store(*args, **kwargs)
        prefix = attempt_store_prefix()
        return store if prefix is None else torch.distributed.PrefixStore(prefix, store)

    def optimizer_state(original, optimizers):
        return OptimizersContainer.state_dict(optimizers)  # built now: not the cache's step-0 learning rate

    ctx.wrap("TorchFTCheckpointManager.__init__", init)
    ctx.wrap("TorchFTOptimizersContainer.state_dict", optimizer_state)
    tcp_store = ctx.replace("TCPStore", manager_store)  # torchft.manager's name for the class, a factory here
    ctx.wrap("Manager.set_state_dict_fns", set_state_dict_fns)
    ctx.wrap("Manager.start_quorum", start_quorum)
