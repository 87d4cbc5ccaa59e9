"""torchtitan configs for tools/bench_mc2.py: llama3's debug model at dim 512, 2 layers (``--module
tools.bench_mc2_configs --config llama3_dim512[_dist_gemm]``, run from the repository root).

At dim 256 the debug model's wo has k = 128 per rank under TP 2, below MC2's k >= 256; at dim 512 every
block projection's k (forward and backward) is 256 or more, so dist_gemm can put all of them on MC2.
Everything else is upstream's llama3_debugmodel (its layer builder, tokenizer, data, training).
"""

from __future__ import annotations

import dataclasses


def _dim512(tp_gemm_backend: str):
    from torchtitan.models import llama3
    from torchtitan.models.llama3 import config_registry

    base = config_registry.llama3_debugmodel_dist_gemm() if tp_gemm_backend == "dist_gemm" else \
        config_registry.llama3_debugmodel()
    debug = base.model_spec.model
    dim, n_heads = 512, 16
    model = dataclasses.replace(
        debug, dim=dim,
        tok_embeddings=dataclasses.replace(debug.tok_embeddings, embedding_dim=dim),
        norm=dataclasses.replace(debug.norm, normalized_shape=dim),
        lm_head=dataclasses.replace(debug.lm_head, in_features=dim, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=dim, n_heads=n_heads,
            hidden_dim=llama3.compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=dataclasses.replace(debug.layers[0].attention.rope, dim=dim // n_heads),
            attn_backend="flex", tp_gemm_backend=tp_gemm_backend))
    base.model_spec = dataclasses.replace(base.model_spec, model=model)
    return base


def llama3_dim512():
    return _dim512("default")


def llama3_dim512_dist_gemm():
    return _dim512("dist_gemm")
