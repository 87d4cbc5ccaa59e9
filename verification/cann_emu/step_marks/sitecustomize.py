"""Marks torchtitan's training steps for the CANN emulation's per-step counts (test tooling).

On the PYTHONPATH only when ``cann_env(..., counts=PATH)`` or ``env.py --counts PATH`` asked for the
counts. When ``torchtitan.trainer`` is imported, ``Trainer.train_step`` is wrapped to tell
libcann_emu.so (``cann_emu_mark_step``) which step the operators it counts belong to, and which part of
the step (``cann_emu_mark_scope``): hooks on each model part's children (a ModuleDict or ModuleList of
blocks counts per block: ``layers.0``) name their forward and, from the moment the gradient of a child's
output is ready, its backward; ``loss`` runs from the model's output to the last child's backward;
gradient clipping, the optimizer and the LR schedulers are wrapped for the step. A scope holds what
runs until the next mark: FSDP's all-gather in a block's pre-forward counts under that block (the hook
goes first), a reduce-scatter under the backward scope current when it is issued. Not with
``compile.enable`` (the hooks would break its graphs): the step is then one scope. Nothing of torch_npu
is touched. Any sitecustomize this one shadows is run first.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if entry and os.path.abspath(entry) != here:
            candidate = os.path.join(entry, "sitecustomize.py")
            if os.path.isfile(candidate):
                spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
                return


def _children(model) -> list:
    """(name, module) of a model part's children; a ModuleDict or ModuleList of blocks one per block."""
    import torch

    named = []
    for name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            named += [(f"{name}.{key}", block) for key, block in child.named_children()]
        else:
            named.append((name, child))
    return named


class _Scopes:
    """The scope marked last, and the ones a child's forward interrupted (restored when it returns: a child
    called from the loss, as the chunked loss calls the LM head, returns to "loss")."""

    def __init__(self, mark_scope) -> None:
        self._mark_scope = mark_scope
        self.current = ""
        self.backward_task: int | None = None  # the autograd graph task a restore is queued for
        self._interrupted: list[str] = []

    def mark(self, name: str) -> None:
        self.current = name
        self._mark_scope(name.encode())

    def enter(self, name: str) -> None:
        self._interrupted.append(self.current)
        self.mark(name)

    def leave(self) -> None:
        self.mark(self._interrupted.pop() if self._interrupted else "")


def _hook_scopes(model, scopes: _Scopes) -> None:
    """Forward and backward scopes of one model part's children (see the module docstring)."""
    import torch

    def on_grad_ready(name: str):
        def hook(grad):
            task = torch._C._current_graph_task_id()
            if task != scopes.backward_task:
                # The first child gradient of this backward: when it ends, the scope it interrupted returns
                # (a loss that runs backward per chunk inside its forward, as the chunked loss does).
                scopes.backward_task = task
                before = scopes.current

                def restore() -> None:
                    scopes.backward_task = None
                    scopes.mark(before)

                torch.autograd.Variable._execution_engine.queue_callback(restore)
            scopes.mark(f"backward: {name}")
        return hook

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def pre(name: str):
        def hook(module, args):
            scopes.enter(f"recompute: {name}" if in_backward() else f"forward: {name}")
        return hook

    def post(name: str):
        def hook(module, args, output):
            scopes.leave()
            if in_backward():  # a recompute inside a backward: no gradient hooks on its outputs
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(on_grad_ready(name))
        return hook

    for name, child in _children(model):
        child.register_forward_pre_hook(pre(name), prepend=True)
        child.register_forward_hook(post(name))

    def model_pre(module, args):
        scopes.enter("forward: model, outside its children")

    def model_post(module, args, output):
        scopes.leave()
        if not in_backward():
            scopes.mark("loss")  # what runs from the model's output to the first child's backward

    model.register_forward_pre_hook(model_pre, prepend=True)
    model.register_forward_hook(model_post)


@functools.cache
def _shared_scopes() -> _Scopes:
    """The one scope state of the process: the step's wrapper and gradient clipping's mark the same scopes."""
    mark_scope = ctypes.CDLL("libcann_emu.so").cann_emu_mark_scope
    mark_scope.argtypes = [ctypes.c_char_p]
    mark_scope.restype = None
    return _Scopes(mark_scope)


def _install() -> None:
    import wrapt

    @wrapt.when_imported("torchtitan.trainer")
    def _mark_steps(module) -> None:
        library = ctypes.CDLL("libcann_emu.so")
        mark = library.cann_emu_mark_step
        mark.argtypes = [ctypes.c_int64]
        mark.restype = None
        scopes = _shared_scopes()
        hooked = set()

        def scoped(name: str):
            def call(wrapped, instance, args, kwargs):
                scopes.mark(name)
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    scopes.mark("step: after the optimizer")
            return call

        def train_step(wrapped, instance, args, kwargs):
            if id(instance) not in hooked:
                hooked.add(id(instance))
                if not instance.config.compile.enable:
                    for part in instance.model_parts:
                        _hook_scopes(part, scopes)
                    wrapt.wrap_function_wrapper(instance.optimizers, "step", scoped("optimizer"))
                    wrapt.wrap_function_wrapper(instance.lr_schedulers, "step", scoped("lr schedulers"))
            mark(int(instance.step))
            scopes.mark("step: before the forward" if not instance.config.compile.enable else "step (compiled)")
            try:
                return wrapped(*args, **kwargs)
            finally:
                mark(-1)
                scopes.mark("")

        wrapt.wrap_function_wrapper(module, "Trainer.train_step", train_step)

    @wrapt.when_imported("torchtitan.distributed.utils")
    def _mark_clipping(module) -> None:
        def clip_grad_norm_(wrapped, instance, args, kwargs):
            _shared_scopes().mark("grad clipping")
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(module, "clip_grad_norm_", clip_grad_norm_)


_run_shadowed_sitecustomize()
if os.environ.get("CANN_EMU_COUNTS"):
    _install()
