"""Kernels as ``torch.library`` custom ops, so torch.compile sees each call as one op.

torch_npu's kernels are operators (``torch.ops.npu.*``) with meta registrations
(``torch_npu/op_plugin/meta/_meta_registrations.py``): dynamo records one node per
call, takes output shapes from the meta function and never traces inside, so host
reads inside a kernel (TND sequence lengths, group offsets) cost no graph break.
The CPU rehearsal's reference kernels and the simulated NPU's stand-in register
theirs the same way with :func:`register_kernel`: an op without a fake
implementation fails under torch.compile there as it would on a real NPU.

A kernel joins with one call: its schema (torch_npu's argument names), the
plain-PyTorch implementation, a fake function giving output shapes (see
:mod:`npu_inject.ops.fakes`), and which inputs and outputs carry gradients.
Gradients are a second op, ``<name>_backward``: it recomputes the forward under
``torch.func.vjp`` (inside an op autograd is off, functorch is not), so the
backward is opaque to the compiler as well, like torch_npu's ``*_grad`` kernels.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def _arguments(schema: str) -> tuple[str, list[Any]]:
    """(text inside the argument parentheses, parsed arguments) of ``(args) -> returns``."""
    if not schema.startswith("(") or ") ->" not in schema:
        raise ValueError(f"kernel schema {schema!r} must read '(arguments) -> returns'")
    text = schema[1:schema.index(") ->")]
    return text, list(torch._C.parse_schema(f"_::_({text}) -> ()").arguments)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient or saved input that is an AsyncCollectiveTensor (after an all-to-all), waited for.

    Passing the subclass into the backward op would run it under the subclass's
    ``__torch_dispatch__``, where ``torch.func.vjp``'s wrappers reach the device's
    kernels unwrapped ("Cannot access storage of TensorWrapper").
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def register_kernel(
    qualname: str,
    schema: str,
    implementation: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    differentiable_inputs: Sequence[str] = (),
    differentiable_outputs: Sequence[int] = (0,),
) -> Callable[..., Any]:
    """Define ``qualname`` ("namespace::name") as a custom op; returns the callable op.

    ``implementation`` and ``fake`` are called with the schema's arguments by name.
    With ``differentiable_inputs`` (argument names, Tensor arguments only), gradients
    flow to them from the outputs at ``differentiable_outputs``; other outputs are
    treated as non-differentiable statistics (as torch_npu's softmax_max/sum are).
    """
    argument_text, arguments = _arguments(schema)
    names = [argument.name for argument in arguments]
    unknown = [name for name in differentiable_inputs if name not in names]
    if unknown:
        raise ValueError(f"register_kernel({qualname!r}): differentiable_inputs {unknown} are not in {names}")

    defaults = {argument.name: argument.default_value for argument in arguments if argument.has_default_value()}

    def in_order(values, keywords):
        """All arguments in schema order (the dispatcher may leave defaults out or pass them by name)."""
        return [*values, *(keywords[name] if name in keywords else defaults[name] for name in names[len(values):])]

    def by_name(function):
        # Kernels take torch_npu's names (custom ops may not have keyword-only tensors, torch_npu's do).
        def bound(*values, **keywords):
            return function(**dict(zip(names, in_order(values, keywords))))

        return bound

    op = torch.library.custom_op(qualname, by_name(implementation), mutates_args=(), schema=schema)
    op.register_fake(by_name(fake))
    if not differentiable_inputs:
        return op

    def call(function, values):
        return function(**dict(zip(names, values)))

    def present(values):
        """(name, position) of the differentiable inputs given in this call (optional ones may be None)."""
        return [(name, names.index(name)) for name in differentiable_inputs
                if values[names.index(name)] is not None]

    def flat(items):
        # Tensor[] arguments (grouped matmul's x and weight) contribute one entry per tensor.
        return [t for item in items for t in (item if isinstance(item, (list, tuple)) else [item])]

    def backward_implementation(grad_outputs, *values, **keywords):
        values = in_order(values, keywords)
        given = present(values)

        def forward(*inputs):
            for (_, position), tensor in zip(given, inputs):
                values[position] = tensor
            outputs = call(implementation, values)
            outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            return tuple(outputs[index] for index in differentiable_outputs)

        _, vjp = torch.func.vjp(forward, *(values[position] for _, position in given))
        return [grad.contiguous() for grad in flat(vjp(tuple(grad_outputs)))]

    def backward_fake(grad_outputs, *values, **keywords):
        values = in_order(values, keywords)
        # Contiguous, as backward_implementation returns them (inputs may be transposed views).
        return [t.new_empty(t.shape) for t in flat(values[position] for _, position in present(values))]

    # The backward op takes the forward's arguments positionally after the output gradients.
    positional_text = ", ".join(part.strip() for part in argument_text.split(",") if part.strip() != "*")
    backward_op = torch.library.custom_op(
        f"{qualname}_backward",
        backward_implementation,
        mutates_args=(),
        schema=f"(Tensor[] grad_outputs, {positional_text}) -> Tensor[]",
    )
    backward_op.register_fake(backward_fake)

    tensor_positions = [i for i, argument in enumerate(arguments) if "Tensor" in str(argument.type)]

    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.values = [None if i in tensor_positions else value for i, value in enumerate(inputs)]
        # Tensor lists are saved flat with their lengths; None stays None.
        ctx.layout = [None if inputs[i] is None else
                      (len(inputs[i]) if isinstance(inputs[i], (list, tuple)) else -1) for i in tensor_positions]
        # Shapes only: an output that gets no gradient gets zeros of its shape.
        ctx.output_metadata = [(outputs[index].shape, outputs[index].dtype, outputs[index].device)
                               for index in differentiable_outputs]
        ctx.save_for_backward(*flat(inputs[i] for i in tensor_positions if inputs[i] is not None))

    def backward(ctx, *grads):
        saved = [_plain(tensor) for tensor in ctx.saved_tensors]
        values = list(ctx.values)
        cursor = 0
        for i, length in zip(tensor_positions, ctx.layout):
            if length is None:
                continue
            if length < 0:
                values[i], cursor = saved[cursor], cursor + 1
            else:
                values[i], cursor = saved[cursor:cursor + length], cursor + length
        grads = grads[0] if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else grads
        grad_outputs = [
            torch.zeros(shape, dtype=dtype, device=device) if grads[index] is None else _plain(grads[index])
            for (shape, dtype, device), index in zip(ctx.output_metadata, differentiable_outputs)
        ]
        input_grads = iter(backward_op(grad_outputs, *values))
        result = [None] * len(names)
        for name, position in present(values):
            value = values[position]
            if isinstance(value, (list, tuple)):
                result[position] = [next(input_grads) for _ in value]
            else:
                result[position] = next(input_grads)
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
    return op
