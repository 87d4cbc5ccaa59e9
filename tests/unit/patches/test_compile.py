"""torch.compile through the runtime: backend choice (patch compile), kernels as ops, no graph break of ours.

Graph breaks are counted with ``torch._dynamo.explain`` on one transformer block of
torchtitan's own debug models, built in this process with the runtime's patches,
against the same block with the patched functions replaced by the independent
plain-PyTorch test plugins (tests/support/plugins: SDPA attention, loop-over-experts MoE):
the runtime must add no break (torchtitan compiles blocks with fullgraph=True, where
any break is an error). The qwen3 MoE case runs with ``-m compile_long``.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from npu_inject import runtime
from testkit import PLUGINS, clean_env


# -- backend choice ----------------------------------------------------------------------


def _compile_patch():
    return importlib.import_module("npu_inject.patches.compile")


def test_rehearsal_compiles_with_torchs_cpu_inductor():
    backend, why, problem = _compile_patch().resolve_backend("inductor", "auto", "cpu")
    assert (backend, problem) == ("inductor", "")
    assert "C++ inductor" in why


def test_npu_without_torch_npu_inductor_falls_back_to_aot_eager(monkeypatch):
    compile_patch = _compile_patch()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(compile_patch.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu._inductor" else real_find_spec(name, *a))
    backend, why, problem = compile_patch.resolve_backend("inductor", "auto", "npu")
    assert backend == "aot_eager"
    assert "torch_npu._inductor" in problem and "'inductor' (--compile.backend) cannot run on target npu" in why


def test_npu_with_a_triton_that_drives_no_npu_falls_back_to_aot_eager():
    """torch's CUDA triton imports beside torch_npu on a machine with neither GPU nor triton-ascend (the CANN
    emulation here): inductor would fail at its first kernel with "0 active drivers"; aot_eager runs instead."""
    problem = _compile_patch()._triton_driver_problem()
    assert "has no active driver" in problem and "triton-ascend" in problem, problem


def test_registry_option_forces_a_backend_and_unknown_backends_fall_back():
    compile_patch = _compile_patch()
    assert compile_patch.resolve_backend("inductor", "aot_eager", "npu") == (
        "aot_eager", "registry option backend", "")
    backend, why, problem = compile_patch.resolve_backend("inductor", "npugraph_ex", "cpu")
    assert backend == "aot_eager" and "npugraph_ex" in problem, (why, problem)


def test_registry_rejects_an_unknown_backend_option(tmp_path):
    from npu_inject.errors import ConfigError

    user = tmp_path / "user.json"
    user.write_text(json.dumps({"patches": {"compile": {"options": {"backend": "tensorrt"}}}}))
    with pytest.raises(ConfigError, match="backend"):
        runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REGISTRY=str(user)), install_hooks=False)


def test_compile_caches_are_keyed_on_the_ops_sources(tmp_path, monkeypatch):
    """A cached inductor graph bakes in our fakes' output strides: changing an op must miss the cache
    (a stale entry failed the deepseek compiled run with a stride assertion in the grouped matmul backward)."""
    import torch.compiler.config as compiler_config

    compile_patch = _compile_patch()
    (tmp_path / "fakes.py").write_text("def fake(x): return x.new_empty(x.shape)\n")
    before = compile_patch.ops_source_digest(tmp_path)
    (tmp_path / "fakes.py").write_text("def fake(x): return torch.empty_like(x)\n")
    assert compile_patch.ops_source_digest(tmp_path) != before

    class Context:
        cleanups, notes = [], []
        add_cleanup, note = cleanups.append, notes.append

    monkeypatch.setattr(compiler_config, "cache_key_tag", "user-tag")
    compile_patch._tag_compile_caches(Context)
    assert compiler_config.cache_key_tag == f"user-tag+npu_inject.ops:{compile_patch.ops_source_digest()}"
    (cleanup,) = Context.cleanups
    cleanup()
    assert compiler_config.cache_key_tag == "user-tag"


# -- kernels are opaque ops under compile --------------------------------------------------


def test_rehearsal_fusion_attention_op_matches_the_reference_compiled_and_eager():
    from npu_inject.ops import reference, rehearsal
    from npu_inject.ops.attention import compressed_causal_mask

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, heads, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    mask = compressed_causal_mask(torch.device("cpu"))
    ends = [5, 24, 30, 48]

    def attention(kernel, q, k, v):
        causal, *_ = kernel(q, k, v, 4, "BSND", atten_mask=mask, scale=0.3, sparse_mode=2)
        packed, *_ = kernel(q.reshape(48, 4, 8), k.reshape(48, 2, 8), v.reshape(48, 2, 8), 4, "TND",
                            atten_mask=mask, scale=0.3, sparse_mode=3, actual_seq_qlen=ends,
                            actual_seq_kvlen=ends, softmax_layout="TND")
        return causal.square().sum() + packed.view(2, 24, 4, 8).sin().sum()

    expected = attention(reference.npu_fusion_attention, q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v))
    compiled = torch.compile(lambda *t: attention(rehearsal.npu_fusion_attention, *t), fullgraph=True,
                             backend="aot_eager")
    for run in (lambda *t: attention(rehearsal.npu_fusion_attention, *t), compiled):
        value = run(q, k, v)
        grads = torch.autograd.grad(value, (q, k, v))
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def _kernel_samples():
    """(kernel name, args, kwargs) in the modes npu_inject calls each kernel with."""
    from npu_inject.ops.attention import compressed_causal_mask

    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, requires_grad=True)

    mask = compressed_causal_mask(torch.device("cpu"))
    ends = [5, 16, 20, 32]
    return [
        ("npu_fusion_attention", (randn(2, 16, 4, 8), randn(2, 16, 2, 8), randn(2, 16, 2, 8), 4, "BSND"),
         {"atten_mask": mask, "scale": 0.3, "sparse_mode": 2}),
        ("npu_fusion_attention", (randn(32, 4, 8), randn(32, 2, 8), randn(32, 2, 8), 4, "TND"),
         {"atten_mask": mask, "scale": 0.3, "sparse_mode": 3, "actual_seq_qlen": ends, "actual_seq_kvlen": ends,
          "softmax_layout": "TND"}),
        ("npu_grouped_matmul", ([randn(10, 6)], [randn(3, 6, 5)]),
         {"group_list": torch.tensor([2, 2, 10]), "group_list_type": 0, "group_type": 0, "split_item": 3}),
        # torchtitan passes B_t = w.transpose(-2, -1): gradients of a strided view, returned contiguous
        # as the fake says (a mismatch fails inductor's assert_tensor_metadata at run time).
        ("npu_grouped_matmul", ([randn(10, 6)], [randn(3, 5, 6).transpose(-2, -1)]),
         {"group_list": torch.tensor([2, 2, 10]), "group_list_type": 0, "group_type": 0, "split_item": 3}),
        ("npu_moe_token_permute", (randn(4, 6), torch.tensor([[0, 2], [1, 0], [2, 2], [1, 1]])), {}),
        ("npu_moe_token_unpermute", (randn(8, 6), torch.tensor([3, 0, 5, 1, 7, 2, 6, 4], dtype=torch.int32),
                                     randn(4, 2)), {}),
    ]


@pytest.mark.parametrize("index", range(len(_kernel_samples())))
def test_kernel_ops_pass_torch_library_opcheck(index):
    """Schema, fake vs real outputs, autograd registration and AOT dispatch, per kernel (torch's own checker)."""
    from npu_inject.ops import rehearsal  # noqa: F401  (registers torch.ops.npu_inject.*)

    name, args, kwargs = _kernel_samples()[index]
    torch.library.opcheck(getattr(torch.ops.npu_inject, name).default, args, kwargs)


@pytest.mark.parametrize("index", range(len(_kernel_samples())))
def test_kernel_backward_op_fakes_give_the_real_outputs_strides(index):
    """Inductor asserts each opaque op's output sizes and strides against its fake at run time.

    Not through opcheck: its schema, fake and AOT checks run the real op under a dispatch mode,
    which cannot read functorch's wrappers inside the backward op's torch.func.vjp
    ("Cannot access storage of TensorWrapper").
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_inject.ops import rehearsal  # noqa: F401  (registers torch.ops.npu_inject.*)

    name, args, kwargs = _kernel_samples()[index]
    outputs = getattr(torch.ops.npu_inject, name)(*args, **kwargs)
    grad_outputs = [torch.randn_like(outputs if isinstance(outputs, torch.Tensor) else outputs[0])]
    backward = getattr(torch.ops.npu_inject, f"{name}_backward")
    real = backward(grad_outputs, *args, **kwargs)
    mode = FakeTensorMode()
    fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t.detach()),
                                                  (grad_outputs, args, kwargs))
    with mode:
        fake = backward(fake_args[0], *fake_args[1], **fake_args[2])
    assert real and len(real) == len(fake)
    for got, expected in zip(fake, real):
        assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype), name


# -- graph breaks: the runtime adds none -----------------------------------------------------


def _block_graph_breaks(monkeypatch, module: str, flavor: str, patches: str, registry: str | None,
                        varlen: bool = False, block: int = 0) -> tuple[int, list[str]]:
    env = {"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_PATCHES": patches}
    if registry:
        env["TORCHTITAN_NPU_REGISTRY"] = os.path.join(PLUGINS, registry)
        monkeypatch.syspath_prepend(PLUGINS)
    rt = runtime.activate(clean_env(**env), install_hooks=False)
    try:
        for trigger in ("torchtitan.tools.utils", "torchtitan.models.common.decoder",
                        "torchtitan.models.common.moe", "torchtitan.distributed.compile"):
            importlib.import_module(trigger)
        for patch_id in patches.split(","):
            assert rt.apply(patch_id.lstrip("+")), rt.report.patches[patch_id.lstrip("+")]
        model_registry = importlib.import_module(f"torchtitan.models.{module}").model_registry
        spec = model_registry(flavor, attn_backend="varlen") if varlen else model_registry(flavor)
        config = spec.model
        config.layers = config.layers[:block + 1]
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
        # Two packed documents per row: exercises the document masks and varlen offsets.
        positions = torch.cat([torch.arange(24), torch.arange(40)]).repeat(2, 1)
        masks = model.get_attention_masks(positions)
        torch._dynamo.reset()
        torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile sets it
        h = model.tok_embeddings(tokens)
        explanation = torch._dynamo.explain(list(model.layers.values())[block])(h, masks, positions)
        return explanation.graph_break_count, [str(reason.reason) for reason in explanation.break_reasons]
    finally:
        runtime.deactivate()
        torch._dynamo.reset()


@pytest.mark.parametrize("varlen", [False, True], ids=["flex", "varlen"])
def test_llama3_block_has_no_graph_break_of_the_runtime(monkeypatch, varlen):
    runtime_breaks = _block_graph_breaks(monkeypatch, "llama3", "debugmodel", "device,attention,compile", None,
                                         varlen)
    plain_breaks = _block_graph_breaks(monkeypatch, "llama3", "debugmodel", "device,sdpa_reference_attention",
                                       "reference_registry.json", varlen)
    print(f"\nllama3 block graph breaks ({'varlen' if varlen else 'flex'}): runtime {runtime_breaks[0]}, "
          f"plain PyTorch {plain_breaks[0]}")
    assert runtime_breaks[0] - plain_breaks[0] == 0, runtime_breaks[1]


@pytest.mark.parametrize("module, flavor", [
    ("deepseek_v3", "debugmodel"),
    # 64 experts: about 2.5 minutes on 2 CPU cores, the same dispatch code as deepseek_v3's.
    pytest.param("qwen3", "debugmodel_moe", marks=pytest.mark.compile_long),
])
def test_moe_block_has_no_graph_break_of_the_runtime(monkeypatch, module, flavor):
    block = 1 if module == "deepseek_v3" else 0  # deepseek_v3's first layer is dense
    runtime_breaks = _block_graph_breaks(monkeypatch, module, flavor, "device,attention,moe_dispatch,compile",
                                         None, block=block)
    plain_breaks = _block_graph_breaks(monkeypatch, module, flavor, "device,attention,moe_reference",
                                       "moe_reference_registry.json", block=block)
    print(f"\n{module} MoE block graph breaks: runtime {runtime_breaks[0]} {runtime_breaks[1]}, "
          f"plain PyTorch {plain_breaks[0]} {plain_breaks[1]}")
    assert runtime_breaks[0] - plain_breaks[0] == 0, runtime_breaks[1]


# -- recompiles: packed-document boundaries are data, not constants of the graph ---------------


@pytest.mark.parametrize("varlen", [False, True], ids=["flex", "varlen"])
def test_llama3_block_compiles_at_most_twice_over_document_layouts(monkeypatch, varlen):
    """Each batch packs a different number of documents. The document ends reach the kernel
    (npu_fusion_attention_v3) as a tensor, never per batch (host ints recompiled every new count,
    past dynamo's recompile limit within 10 varlen steps). Flex plans mark the count dynamic
    before the first trace: one compile. Varlen's tensor is made inside the block from
    torchtitan's metadata: one compile with static shapes, one with a dynamic count. The compressed causal mask is first
    made inside the trace, as in a training run (a cache filled then must not recompile)."""
    monkeypatch.setattr("npu_inject.ops.attention._compressed_masks", {})
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="device,attention,compile"),
                          install_hooks=False)
    try:
        for trigger in ("torchtitan.tools.utils", "torchtitan.models.common.decoder",
                        "torchtitan.distributed.compile"):
            importlib.import_module(trigger)
        for patch_id in ("device", "attention", "compile"):
            assert rt.apply(patch_id), rt.report.patches[patch_id]
        model_registry = importlib.import_module("torchtitan.models.llama3").model_registry
        spec = model_registry("debugmodel", attn_backend="varlen") if varlen else model_registry("debugmodel")
        config = spec.model
        config.layers = config.layers[:2]
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        graphs = []

        def counting_backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        torch._dynamo.reset()
        # Two blocks, compiled one by one as torchtitan does: they share one code object and its graphs.
        blocks = [torch.compile(block, fullgraph=True, backend=counting_backend) for block in model.layers.values()]
        # Documents per row: 2, 3, 1, 4, 5, 2 (64 tokens each).
        for lengths in ([24, 40], [10, 20, 34], [64], [5, 5, 5, 49], [1, 2, 3, 4, 54], [7, 57]):
            positions = torch.cat([torch.arange(n) for n in lengths]).repeat(2, 1)
            h = torch.randn(2, 64, config.dim)
            masks = model.get_attention_masks(positions)
            # capture_scalar_outputs as torchtitan's apply_compile sets it.
            with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
                for block in blocks:
                    h = block(h, masks, positions)
        print(f"\nllama3, 2 blocks ({'varlen' if varlen else 'flex'}) over 6 document layouts: {len(graphs)} compiles")
        assert len(graphs) <= (2 if varlen else 1)
    finally:
        runtime.deactivate()
        torch._dynamo.reset()
