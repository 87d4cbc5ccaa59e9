"""A worker group that torchrun restarts meets its own attempt's rendezvous keys, not the dead one's.

Module ``torch.distributed.rendezvous`` (through ``torchtitan.distributed.utils``), and torchft's
manager when ``--module torchft.*`` imports it.

torchrun (``--max-restarts``) restarts every worker of a group after one dies. The workers reach the
agent's TCPStore (MASTER_ADDR:MASTER_PORT, ``TORCHELASTIC_USE_AGENT_STORE``) and torch 2.14's
``_create_c10d_store`` returns it as it is, on the belief that each attempt gets a new store. It does not:
the restarted workers get the same port and the keys the dead attempt wrote (seen with gloo: a
script whose rank 0 starts 3 s after its peer on the restart hangs in ``init_process_group``). A restarted rank that
reads its peer's address before the peer has written the new one connects to the dead process: gloo
fails ("Connection refused") or waits forever; HCCL and NCCL read a stale communicator id the same way;
torchft's manager (its own client of the same store) finds the dead manager's address ("failed to
connect ... within timeout of 60s"). Which rank wins the race decides whether a restart works.

Here each attempt's workers see the store under the prefix ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``
(what torch did before the prefix was dropped). torchft's manager, which opens its own client of that
store, is given the same view by :mod:`npu_inject.patches.torchft_heal`. Outside torchrun (no restart
count) nothing changes.
"""

from __future__ import annotations

from npu_inject.launcher import attempt_store_prefix
from npu_inject.patching import PatchContext

TARGETS = (
    "torch.distributed.rendezvous:_create_c10d_store",
)


def apply(ctx: PatchContext) -> None:
    import importlib

    import torch.distributed as dist

    # the module (torch.distributed.rendezvous, the attribute, is its function of the same name)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    def create_c10d_store(original, hostname, port, *args, **kwargs):
        store = original(hostname, port, *args, **kwargs)
        prefix = attempt_store_prefix()
        if prefix is None or not rendezvous._agent_store_serves(hostname, port):
            return store
        ctx.note(f"the workers' rendezvous store is seen under {prefix}: this attempt's keys only")
        return dist.PrefixStore(prefix, store)

    ctx.wrap("_create_c10d_store", create_c10d_store)
