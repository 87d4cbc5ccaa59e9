"""Reference for torch_npu's ``npu_chunk_gated_delta_rule``: the gated delta rule, chunked.

The gated delta rule (Gated Delta Networks, Yang, Kautz & Hatamizadeh 2024) keeps a
state matrix per value head, ``S`` (Dv x Dk), and for each token t::

    S_t = alpha_t * S_{t-1} + beta_t * (v_t - alpha_t * S_{t-1} k_t) k_t^T,   alpha_t = exp(g_t)
    o_t = scale * S_t q_t

torch_npu 2.14.0 (``_op_plugin_docs.py``): packed TND inputs -- query/key (T, Nk, Dk),
value (T, Nv, Dv), beta and g (T, Nv) -- per-sequence lengths ``actual_seq_lengths``
(B,), ``initial_state`` (B, Nv, Dv, Dk); returns ``(out (T, Nv, Dv), final_state)``.
Nv is a multiple of Nk: value head h reads key/query head h // (Nv / Nk). The kernel
is documented for inference only (no backward entry, Dk = Dv = 128, sequences of at
most 8 tokens), so training on either target runs this plain-PyTorch version.

Within a chunk of C tokens the recurrence is solved at once: with gamma_t the
cumulative decay since the chunk's start and u_t = beta_t (v_t - alpha_t S_{t-1} k_t),
``(I + L) U = beta * (V - gamma * K S_0^T)`` where L is strictly lower triangular,
``L_tj = beta_t (gamma_t / gamma_j) k_t . k_j``; then outputs and the next state are
matrix products. One triangular solve per chunk; autograd gives the backward.
"""

from __future__ import annotations

import torch

CHUNK = 64


def _chunk_step(q_NCK, k_NCK, v_NCV, beta_NC, g_NC, state_NVK, scale):
    """One chunk for all heads: (out (N, C, Dv), state after the chunk)."""
    C = q_NCK.shape[1]
    log_gamma_NC = torch.cumsum(g_NC, dim=1)
    gamma_NC = torch.exp(log_gamma_NC)
    inclusive = torch.ones(C, C, dtype=torch.bool, device=q_NCK.device).tril()
    strict = inclusive.tril(-1)
    log_ratio_NCC = log_gamma_NC.unsqueeze(2) - log_gamma_NC.unsqueeze(1)  # gamma_t / gamma_j in log space
    ratio_incl_NCC = torch.exp(log_ratio_NCC.masked_fill(~inclusive, float("-inf")))
    ratio_strict_NCC = torch.exp(log_ratio_NCC.masked_fill(~strict, float("-inf")))

    lower_NCC = beta_NC.unsqueeze(2) * ratio_strict_NCC * (k_NCK @ k_NCK.transpose(1, 2))
    eye = torch.eye(C, dtype=q_NCK.dtype, device=q_NCK.device)
    rhs_NCV = beta_NC.unsqueeze(2) * (v_NCV - gamma_NC.unsqueeze(2) * (k_NCK @ state_NVK.transpose(1, 2)))
    u_NCV = torch.linalg.solve_triangular(eye + lower_NCC, rhs_NCV, upper=False, unitriangular=True)

    scores_NCC = (q_NCK @ k_NCK.transpose(1, 2)) * ratio_incl_NCC
    out_NCV = scale * (gamma_NC.unsqueeze(2) * (q_NCK @ state_NVK.transpose(1, 2)) + scores_NCC @ u_NCV)
    to_end_NC = torch.exp(log_gamma_NC[:, -1:] - log_gamma_NC)
    state_NVK = gamma_NC[:, -1].view(-1, 1, 1) * state_NVK + (u_NCV * to_end_NC.unsqueeze(2)).transpose(1, 2) @ k_NCK
    return out_NCV, state_NVK


def _one_sequence(q_LNK, k_LNK, v_LNV, beta_LN, g_LN, state_NVK, scale):
    L = q_LNK.shape[0]
    if L == 0:
        return v_LNV, state_NVK
    padded = -L % CHUNK
    # Padding tokens have beta = 0 and g = 0: they leave the state unchanged; their outputs are dropped.
    q, k, v, beta, g = (torch.nn.functional.pad(t.transpose(0, 1), (0, 0, 0, padded)) if t.dim() == 3
                        else torch.nn.functional.pad(t.transpose(0, 1), (0, padded))
                        for t in (q_LNK, k_LNK, v_LNV, beta_LN, g_LN))
    outs = []
    for start in range(0, L + padded, CHUNK):
        chunk = slice(start, start + CHUNK)
        out_NCV, state_NVK = _chunk_step(q[:, chunk], k[:, chunk], v[:, chunk], beta[:, chunk], g[:, chunk],
                                         state_NVK, scale)
        outs.append(out_NCV)
    return torch.cat(outs, dim=1)[:, :L].transpose(0, 1), state_NVK


def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                               scale=None, g=None):
    """(out (T, Nv, Dv) in value's dtype, final_state (B, Nv, Dv, Dk) in initial_state's dtype)."""
    if beta is None:
        raise ValueError("npu_chunk_gated_delta_rule: beta is required (shape (T, Nv))")
    T, Nk, Dk = query.shape
    Nv, Dv = value.shape[1], value.shape[2]
    if Nv % Nk:
        raise ValueError(f"npu_chunk_gated_delta_rule: value heads ({Nv}) must be a multiple of key heads ({Nk})")
    lengths = [T] if actual_seq_lengths is None else [int(n) for n in actual_seq_lengths.tolist()]
    if sum(lengths) != T:
        raise ValueError(f"npu_chunk_gated_delta_rule: actual_seq_lengths sum to {sum(lengths)}, tokens are {T}")
    scale = Dk ** -0.5 if scale is None else scale
    f32 = torch.float32
    q_TNK = query.to(f32).repeat_interleave(Nv // Nk, dim=1)
    k_TNK = key.to(f32).repeat_interleave(Nv // Nk, dim=1)
    v_TNV, beta_TN = value.to(f32), beta.to(f32)
    g_TN = torch.zeros(T, Nv, dtype=f32, device=query.device) if g is None else g.to(f32)
    if initial_state is None:
        states_BNVK = torch.zeros(len(lengths), Nv, Dv, Dk, dtype=f32, device=query.device)
    else:
        states_BNVK = initial_state.to(f32)
    outs, finals, start = [], [], 0
    for index, length in enumerate(lengths):
        tokens = slice(start, start + length)
        out_LNV, final_NVK = _one_sequence(q_TNK[tokens], k_TNK[tokens], v_TNV[tokens], beta_TN[tokens],
                                           g_TN[tokens], states_BNVK[index], scale)
        outs.append(out_LNV)
        finals.append(final_NVK)
        start += length
    state_dtype = value.dtype if initial_state is None else initial_state.dtype
    return torch.cat(outs).to(value.dtype), torch.stack(finals).to(state_dtype)
