"""spmd_types type checking (torchtitan's ``--debug.spmd_typechecking``) around our kernels.

With the spmd_types backend and type checking on, torchtitan runs the forward under
``spmd_types.checker.typecheck``: every torch op must see typed tensors, and every
``autograd.Function`` must be registered. Upstream treats its opaque attention kernels
(compiled flex_attention, varlen_attn) as a boundary: the kernel runs under
``spmd.no_typecheck()`` and its outputs take the query's type (``FlexAttention.compiled_flex_attn``).
Our kernel calls do the same, through :func:`opaque_kernel` and :func:`type_like`.
"""

from __future__ import annotations

import contextlib

import spmd_types as spmd
import torch
from spmd_types.runtime import get_partition_spec


def type_checking() -> bool:
    """True inside torchtitan's spmd_types type checking (only entered with the spmd_types backend)."""
    return spmd.is_type_checking()


def opaque_kernel():
    """A context in which a kernel's internals (host metadata tensors, reference math) go unchecked."""
    return spmd.no_typecheck() if spmd.is_type_checking() else contextlib.nullcontext()


def type_like(out: torch.Tensor, like: torch.Tensor, keep_dims: int | None = None) -> torch.Tensor:
    """Give ``out`` the SPMD type of ``like`` (its local type and the partition spec of its
    first ``keep_dims`` dims), as upstream types an attention kernel's output after the query;
    a no-op without type checking."""
    if not spmd.is_type_checking():
        return out
    spec = get_partition_spec(like)
    if spec is not None and keep_dims is not None:
        spec = spmd.PartitionSpec(*tuple(spec)[:keep_dims])
    spmd.assert_type(out, spmd.get_local_type(like), spec)
    return out


def replicated_metadata(t: torch.Tensor) -> torch.Tensor:
    """Type a tensor our code built from host values every rank shares (an index, a cached mask)
    as Replicate on the current mesh, what torch.arange/torch.tensor give under type checking;
    needed when the tensor was made (or cached) outside the checked region."""
    if spmd.is_type_checking() and spmd.current_mesh() is not None and not spmd.has_local_type(t):
        spmd.assert_type(t, {axis: spmd.R for axis in spmd.current_mesh()})
    return t
