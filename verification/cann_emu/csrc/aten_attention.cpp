// Flash attention computed by ATen's CPU kernels on the host buffers (aten_support.h): the operators
// torch_npu 2.14.0's npu_fusion_attention / npu_fusion_attention_v3 and their autograd backward
// (npu_fusion_attention_grad / _grad_v3) reach on Atlas A2 (op-plugin FlashAttentionKernelNpuOpApi.cpp):
// aclnnFlashAttentionScore / ScoreGrad (BSH, SBH, BSND, BNSD), aclnnFlashAttentionVarLenScore /
// UnpaddingScoreGrad (TND, softmax statistics in NTD order) and their V4 (TND, softmaxOutLayout
// "same_as_input": statistics in TND order, what torch_npu passes for softmax_layout="TND"); with a sink,
// aclnnFlashAttentionScoreV3 / ScoreGradV3 and aclnnFlashAttentionVarLenScoreV5 / UnpaddingScoreGradV5.
// The sink (FLOAT32, one logit per query head) joins every row's softmax with a zero value: the
// documents' m = max(sink, max(S)), out = e^(S-m) V / (sum e^(S-m) + e^(sink-m)), the statistics count it,
// and dsink = -sum over rows of P_sink * rowsum(dy * out).
// Signatures from CANN's headers (hicann/ops-transformer attention/flash_attention_score{,_grad}),
// semantics from their documents and CANN's sparse_mode table (digested in verification/torch_npu_docs.md).
//
// Every score is computed in FLOAT32: bf16/fp16 query/key/value are upcast per head, the results cast
// to the output's dtype when written. Memory: per (batch, query head) the scores of a block of query
// rows against every key (at most kScoreBlock elements at once), so no (Sq x Skv) matrix of a whole
// head is held unless it fits that block, and never more than one head's. Each row's softmax is
// exact (the block holds every key of its rows); the backward recomputes the probabilities from the
// softmax_max / softmax_sum the forward returned, as CANN's grad kernel does. A query row with no key
// left to attend to outputs 0 with statistics 0 and gets gradient 0.
//
// Not emulated (ACLNN_ERR_INNER 561000 naming the operator): keepProb < 1 (dropout draws from the NPU's
// Philox stream), pse, sparse_mode 5-8 (prefix, cut varlen sequences).
#include "aten_support.h"

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>

using namespace cann_emu;

namespace {

constexpr int64_t kCompressedSide = 2048;  // modes 2, 3, 4 take the compressed 2048 x 2048 triu mask
constexpr int64_t kScoreBlock = int64_t(1) << 22;  // score elements per row block (16 MiB of FLOAT32)
constexpr int64_t kStatsColumns = 8;               // softmax_max / softmax_sum: each value repeated 8 times

// The diagonals a sparse mode keeps: key j for query i iff lo <= j - i <= hi (absent: unbounded).
struct Band {
    std::optional<int64_t> lo, hi;
};

// Everything both phases need, settled in phase one.
struct Plan {
    std::string layout;  // BSH, SBH, BSND, BNSD, TND
    int64_t b = 1, n = 0, nkv = 0, sq = 0, skv = 0, d = 0, dv = 0;  // sq/skv: tokens for TND
    double scale = 1.0;
    int64_t pre = 0, next = 0, sparse_mode = 0;
    bool has_mask = false;
    std::vector<std::pair<int64_t, int64_t>> q_bounds, kv_bounds;  // TND: [start, end) per sequence
    bool stats_tnd = false;  // TND statistics in TND order (same_as_input) rather than NTD
};

int64_t numel(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

bool contiguous(const aclTensor& t) {
    int64_t stride = 1;
    for (size_t i = t.view.size(); i-- > 0;) {
        if (t.view[i] != 1 && t.strides[i] != stride) return false;
        stride *= t.view[i];
    }
    return true;
}

std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "(";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + ")";
}

// The sparse mode's band for one sequence of sq queries and skv keys. "Left-up" counts the diagonal
// from (0, 0), "right-down" from the bottom-right corner (sparse_mode table). Without a mask the
// kernel computes full attention whatever the mode and tokens say (the documents' 约束说明).
Band band_of(const Plan& p, int64_t sq, int64_t skv) {
    if (!p.has_mask) return {};
    int64_t shift = skv - sq;
    switch (p.sparse_mode) {
        case 0:  // defaultMask: the explicit mask plus -preTokens <= j - i <= nextTokens
            if (p.pre >= sq && p.next >= skv) return {};
            return {-p.pre, p.next};
        case 1: return {};                          // allMask: the explicit mask alone
        case 2: return {std::nullopt, 0};           // leftUpCausal
        case 3: return {std::nullopt, shift};       // rightDownCausal
        default: return {shift - p.pre, shift + p.next};  // 4: band, counted from the bottom-right corner
    }
}

// The explicit mask of modes 0 and 1 for one sequence as (B|1, N|1, Sq, Skv); undefined for other modes
// (2, 3, 4 derive theirs from the lengths: the compressed mask's contents are not read). TND takes a 2-D
// (maxSq, maxSkv) mask whose top-left corner serves each sequence.
at::Tensor sequence_mask(const Plan& p, const at::Tensor& mask, int64_t sq, int64_t skv) {
    if (!p.has_mask || p.sparse_mode > 1) return at::Tensor();
    if (p.layout == "TND") return mask.slice(0, 0, sq).slice(1, 0, skv).unsqueeze(0).unsqueeze(0);
    return mask.dim() == 2 ? mask.unsqueeze(0).unsqueeze(0) : mask;
}

// What to mask (True) in rows [i0, i1) x every key: the band and explicit (this head's (Sq, Skv) mask,
// or undefined). Undefined when nothing is masked.
at::Tensor block_mask(const Band& band, const at::Tensor& explicit_SS, int64_t i0, int64_t i1, int64_t skv) {
    at::Tensor masked;
    if (band.lo || band.hi) {
        at::Tensor diagonal = at::arange(skv, at::kLong).unsqueeze(0) - at::arange(i0, i1, at::kLong).unsqueeze(1);
        masked = at::zeros({i1 - i0, skv}, at::kBool);
        if (band.lo) masked.logical_or_(diagonal < *band.lo);
        if (band.hi) masked.logical_or_(diagonal > *band.hi);
    }
    if (explicit_SS.defined()) {
        at::Tensor tile = explicit_SS.slice(0, i0, i1).to(at::kBool);
        masked = masked.defined() ? masked.logical_or(tile) : tile;
    }
    return masked;
}

int64_t block_rows(int64_t sq, int64_t skv) {
    return std::max<int64_t>(1, std::min<int64_t>(sq, kScoreBlock / std::max<int64_t>(skv, 1)));
}

// This head's (Sq, Skv) slice of a (B|1, N|1, Sq, Skv) mask; undefined stays undefined.
at::Tensor head_mask(const at::Tensor& mask, int64_t b, int64_t n) {
    if (!mask.defined()) return mask;
    return mask[mask.size(0) == 1 ? 0 : b][mask.size(1) == 1 ? 0 : n];
}

// softmax(scale * q k^T, masked) v for q (B, N, Sq, D), k (B, Nkv, Skv, D), v (B, Nkv, Skv, Dv), query head
// n using kv head n / (N / Nkv). Writes out (B, N, Sq, Dv) (cast to its dtype); returns the row max and
// sum of exp(score - max), (B, N, Sq) FLOAT32.
std::pair<at::Tensor, at::Tensor> forward_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& mask, const Band& band, double scale,
                                               const at::Tensor& sink, const at::Tensor& out) {
    const int64_t B = q.size(0), N = q.size(1), sq = q.size(2), nkv = k.size(1), skv = k.size(2);
    const int64_t group = N / nkv, rows = block_rows(sq, skv);
    const double inf = std::numeric_limits<double>::infinity();
    at::Tensor row_max = at::zeros({B, N, sq}, at::kFloat), row_sum = at::zeros({B, N, sq}, at::kFloat);
    out.zero_();
    if (skv == 0 && !sink.defined()) return {row_max, row_sum};
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < nkv; ++h) {
            at::Tensor k_h = k[b][h].to(at::kFloat), v_h = v[b][h].to(at::kFloat);
            for (int64_t n = h * group; n < (h + 1) * group; ++n) {
                at::Tensor q_n = q[b][n].to(at::kFloat), mask_n = head_mask(mask, b, n);
                for (int64_t i0 = 0; i0 < sq; i0 += rows) {
                    const int64_t i1 = std::min(sq, i0 + rows);
                    at::Tensor s = at::matmul(q_n.slice(0, i0, i1), k_h.t()).mul_(scale);
                    at::Tensor masked = block_mask(band, mask_n, i0, i1, skv);
                    if (masked.defined()) s.masked_fill_(masked, -inf);
                    at::Tensor m = skv ? s.amax(-1, true) : at::full({i1 - i0, 1}, -inf, at::kFloat);
                    if (sink.defined()) m.clamp_min_(sink[n]);  // m = max(sink, max(S))
                    m.masked_fill_(m == -inf, 0.0);  // a row with no key: exp(-inf - 0) = 0 everywhere
                    at::Tensor p = (s - m).exp_();
                    at::Tensor l = p.sum(-1, true);
                    if (sink.defined()) l.add_((sink[n] - m).exp_());  // the sink's column, value 0
                    at::Tensor o = at::matmul(p, v_h).div_(at::where(l > 0, l, at::ones_like(l)));
                    out[b][n].slice(0, i0, i1).copy_(o);
                    row_max[b][n].slice(0, i0, i1).copy_(m.squeeze(-1));
                    row_sum[b][n].slice(0, i0, i1).copy_(l.squeeze(-1));
                }
            }
        }
    return {row_max, row_sum};
}

// The gradients of forward_core: dy and out (the forward's output) as out, row_max / row_sum (B, N, Sq)
// FLOAT32 from the forward. Writes dq, dk, dv (k's and v's shapes; GQA heads summed per kv head).
void backward_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                   const at::Tensor& out, const at::Tensor& mask, const Band& band, double scale,
                   const at::Tensor& row_max, const at::Tensor& row_sum, const at::Tensor& sink,
                   const at::Tensor& dsink, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
    const int64_t B = q.size(0), N = q.size(1), sq = q.size(2), nkv = k.size(1), skv = k.size(2);
    const int64_t group = N / nkv, rows = block_rows(sq, skv);
    const double inf = std::numeric_limits<double>::infinity();
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (skv == 0 || sq == 0) return;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < nkv; ++h) {
            at::Tensor k_h = k[b][h].to(at::kFloat), v_h = v[b][h].to(at::kFloat);
            at::Tensor dk_h = at::zeros_like(k_h), dv_h = at::zeros_like(v_h);
            for (int64_t n = h * group; n < (h + 1) * group; ++n) {
                at::Tensor q_n = q[b][n].to(at::kFloat), dy_n = dy[b][n].to(at::kFloat);
                // D_i = sum_j P_ij dP_ij = rowsum(dO * O): the softmax backward's row term.
                at::Tensor delta = (dy_n * out[b][n].to(at::kFloat)).sum(-1, true);
                at::Tensor m_n = row_max[b][n].unsqueeze(-1), l_n = row_sum[b][n].unsqueeze(-1);
                at::Tensor inv_l = at::where(l_n > 0, l_n.reciprocal(), at::zeros_like(l_n));
                at::Tensor mask_n = head_mask(mask, b, n);
                // The sink's column: dS = P_sink * (0 - D), summed over rows into this head's dsink.
                if (sink.defined()) dsink[n].sub_(((sink[n] - m_n).exp() * inv_l * delta).sum());
                for (int64_t i0 = 0; i0 < sq; i0 += rows) {
                    const int64_t i1 = std::min(sq, i0 + rows);
                    at::Tensor q_i = q_n.slice(0, i0, i1), dy_i = dy_n.slice(0, i0, i1);
                    at::Tensor s = at::matmul(q_i, k_h.t()).mul_(scale);
                    at::Tensor masked = block_mask(band, mask_n, i0, i1, skv);
                    if (masked.defined()) s.masked_fill_(masked, -inf);
                    at::Tensor p = (s - m_n.slice(0, i0, i1)).exp_().mul_(inv_l.slice(0, i0, i1));
                    dv_h.add_(at::matmul(p.t(), dy_i));
                    at::Tensor ds = at::matmul(dy_i, v_h.t()).sub_(delta.slice(0, i0, i1)).mul_(p).mul_(scale);
                    dq[b][n].slice(0, i0, i1).copy_(at::matmul(ds, k_h));
                    dk_h.add_(at::matmul(ds.t(), q_i));
                }
            }
            dk[b][h].copy_(dk_h);
            dv[b][h].copy_(dv_h);
        }
}

// A BSH / SBH / BSND / BNSD tensor holding heads heads as a (B, N, S, D) view of the same memory.
at::Tensor to_bnsd(const at::Tensor& t, const std::string& layout, int64_t heads) {
    if (layout == "BNSD") return t;
    if (layout == "BSND") return t.transpose(1, 2);
    if (layout == "BSH") return t.unflatten(2, {heads, -1}).transpose(1, 2);
    return t.unflatten(2, {heads, -1}).permute({1, 2, 0, 3});  // SBH
}

// A TND tensor's tokens [start, end) as a (1, N, S, D) view.
at::Tensor tnd_piece(const at::Tensor& t, std::pair<int64_t, int64_t> bounds) {
    return t.slice(0, bounds.first, bounds.second).transpose(0, 1).unsqueeze(0);
}

// A TND statistics buffer (T, N, 8) as an (N, T, 8) view in the order the operator writes it.
at::Tensor stats_ntc(const at::Tensor& buffer, const Plan& p) {
    if (p.stats_tnd) return buffer.transpose(0, 1);
    return buffer.view({p.n, p.sq, kStatsColumns});  // NTD order in the (T, N, 8) buffer (contiguous)
}

// Cumulative end offsets -> [start, end) per participating sequence; trailing zeros after a positive
// offset mark batches that take no part ([2, 5, 9, 0, 0]).
aclnnStatus varlen_bounds(const char* op, const char* name, const std::vector<int64_t>& ends, int64_t total,
                          std::vector<std::pair<int64_t, int64_t>>& bounds) {
    if (ends.empty()) return invalid(op, std::string(name) + " is empty; TND needs the cumulative sequence ends");
    size_t active = ends.size();
    bool positive = std::any_of(ends.begin(), ends.end(), [](int64_t e) { return e > 0; });
    while (positive && active > 0 && ends[active - 1] == 0) --active;
    int64_t previous = 0;
    for (size_t i = 0; i < active; ++i) {
        if (ends[i] < previous)
            return invalid(op, std::string(name) + " must hold non-decreasing cumulative ends (lengths 2, 2 -> 2, 4)");
        bounds.emplace_back(previous, ends[i]);
        previous = ends[i];
    }
    if (previous > total)
        return invalid(op, std::string(name) + " ends at " + std::to_string(previous) + ", beyond the " +
                               std::to_string(total) + " tokens of the TND input");
    return 0;
}

// Shapes, layout, arguments the emulation does not compute; fills plan. Shared by all six operators.
aclnnStatus plan_attention(const char* op, const aclTensor* q, const aclTensor* k, const aclTensor* v,
                           const aclTensor* pse, const aclTensor* padding_mask, const aclTensor* mask,
                           const aclIntArray* q_lens, const aclIntArray* kv_lens, double scale, double keep_prob,
                           int64_t pre, int64_t next, int64_t head_num, const char* layout, int64_t sparse_mode,
                           Plan& p) {
    if (int rc = check_present(op, "inputLayout", layout)) return rc;
    p.layout = layout;
    const bool tnd = p.layout == "TND";
    if (tnd && (!q_lens || !kv_lens)) return invalid(op, "inputLayout TND needs actualSeqQLen and actualSeqKvLen");
    if (p.layout != "BSH" && p.layout != "SBH" && p.layout != "BSND" && p.layout != "BNSD" && !tnd)
        return invalid(op, "inputLayout " + p.layout + " is not one of BSH, SBH, BSND, BNSD, TND");
    if (!(keep_prob > 0.0 && keep_prob <= 1.0))
        return invalid(op, "keepProb " + std::to_string(keep_prob) + " is outside (0, 1]");
    if (keep_prob < 1.0)
        return fail(ACLNN_ERR_INNER, std::string(op) + ": keepProb " + std::to_string(keep_prob) +
                                         " < 1: dropout not emulated (its mask comes from the NPU's Philox stream)");
    if (pse) return fail(ACLNN_ERR_INNER, std::string(op) + ": realShift/pse is not emulated");
    if (padding_mask) return invalid(op, "paddingMask is reserved and must be null");
    if (sparse_mode < 0 || sparse_mode > 8)
        return invalid(op, "sparseMode " + std::to_string(sparse_mode) + " is not 0-8");
    if (sparse_mode >= 5)
        return fail(ACLNN_ERR_INNER, std::string(op) + ": sparseMode " + std::to_string(sparse_mode) +
                                         " (prefix / cut varlen sequences) is not emulated");
    if (head_num <= 0) return invalid(op, "headNum must be positive");
    if (q->dtype != k->dtype || v->dtype != q->dtype) return invalid(op, "query, key and value dtypes differ");
    const size_t rank = (p.layout == "BSND" || p.layout == "BNSD") ? 4 : 3;
    if (q->view.size() != rank || k->view.size() != rank || v->view.size() != rank)
        return invalid(op, "inputLayout " + p.layout + " takes " + std::to_string(rank) + "-D query, key, value");
    const auto &qs = q->view, &ks = k->view, &vs = v->view;
    int64_t bk = 0, bv = 0, skv_v = 0;
    if (p.layout == "BSH" || p.layout == "SBH") {
        const int bi = p.layout == "BSH" ? 0 : 1, si = 1 - bi;
        if (qs[2] % head_num) return invalid(op, "query's H is not a multiple of headNum");
        p.b = qs[bi], p.sq = qs[si], p.n = head_num, p.d = qs[2] / head_num;
        if (p.d == 0 || ks[2] % p.d) return invalid(op, "key's H is not a multiple of query's head dim");
        p.nkv = ks[2] / p.d, bk = ks[bi], p.skv = ks[si], bv = vs[bi], skv_v = vs[si];
        if (p.nkv == 0 || vs[2] % p.nkv) return invalid(op, "value's H is not a multiple of key's head count");
        p.dv = vs[2] / p.nkv;
    } else if (tnd) {
        p.sq = qs[0], p.n = qs[1], p.d = qs[2], p.skv = ks[0], p.nkv = ks[1], skv_v = vs[0], p.dv = vs[2];
        bk = bv = p.b;
        if (vs[1] != p.nkv) return invalid(op, "key and value head counts differ");
        if (ks[2] != p.d) return invalid(op, "query and key head dims differ");
    } else {
        const int si = p.layout == "BSND" ? 1 : 2, ni = p.layout == "BSND" ? 2 : 1;
        p.b = qs[0], p.sq = qs[si], p.n = qs[ni], p.d = qs[3];
        bk = ks[0], p.skv = ks[si], p.nkv = ks[ni], bv = vs[0], skv_v = vs[si], p.dv = vs[3];
        if (vs[ni] != p.nkv) return invalid(op, "key and value head counts differ");
        if (ks[3] != p.d) return invalid(op, "query and key head dims differ");
    }
    if (p.n != head_num)
        return invalid(op, "headNum " + std::to_string(head_num) + " but query has " + std::to_string(p.n) + " heads");
    if (p.nkv <= 0 || p.n % p.nkv)
        return invalid(op, "query heads " + std::to_string(p.n) + " are not a multiple of key/value heads " +
                               std::to_string(p.nkv) + " (GQA)");
    if (bk != p.b || bv != p.b || skv_v != p.skv)
        return invalid(op, "query, key and value batch or key/value lengths differ");
    if (p.dv > p.d) return invalid(op, "value's head dim exceeds query's (D == Dk >= Dv)");
    if (tnd) {
        if (int rc = varlen_bounds(op, "actualSeqQLen", hold(q_lens), p.sq, p.q_bounds)) return rc;
        if (int rc = varlen_bounds(op, "actualSeqKvLen", hold(kv_lens), p.skv, p.kv_bounds)) return rc;
        if (p.q_bounds.size() != p.kv_bounds.size())
            return invalid(op, "actualSeqQLen and actualSeqKvLen describe different numbers of sequences");
    }
    p.scale = scale, p.pre = pre, p.next = next, p.sparse_mode = sparse_mode, p.has_mask = mask != nullptr;
    if (mask) {
        const auto& ms = mask->view;
        if (sparse_mode >= 2) {
            if (ms.size() < 2 || ms[ms.size() - 1] != kCompressedSide || ms[ms.size() - 2] != kCompressedSide ||
                numel(ms) != kCompressedSide * kCompressedSide)
                return invalid(op, "sparseMode " + std::to_string(sparse_mode) +
                                       " takes the compressed 2048 x 2048 attenMask, got " + shape_text(ms));
        } else if (tnd) {
            int64_t max_q = 0, max_kv = 0;
            for (auto [s, e] : p.q_bounds) max_q = std::max(max_q, e - s);
            for (auto [s, e] : p.kv_bounds) max_kv = std::max(max_kv, e - s);
            if (ms.size() != 2 || ms[0] < max_q || ms[1] < max_kv)
                return invalid(op, "TND takes a 2-D attenMask of at least (maxSq, maxSkv), got " + shape_text(ms));
        } else {
            bool fits = (ms.size() == 2 && ms[0] == p.sq && ms[1] == p.skv) ||
                        (ms.size() == 4 && (ms[0] == 1 || ms[0] == p.b) && (ms[1] == 1 || ms[1] == p.n) &&
                         ms[2] == p.sq && ms[3] == p.skv);
            if (!fits)
                return invalid(op, "attenMask " + shape_text(ms) + " is not BNSS, B1SS, 11SS or SS for sparseMode " +
                                       std::to_string(sparse_mode));
        }
        if ((sparse_mode == 0 || sparse_mode == 4) && pre + next < 0)
            return invalid(op, "preTokens + nextTokens < 0 leaves an empty band");
    }
    return 0;
}

// The shape attentionOut / dy has: query's, with value's head dim.
std::vector<int64_t> out_shape(const Plan& p) {
    if (p.layout == "BSH") return {p.b, p.sq, p.n * p.dv};
    if (p.layout == "SBH") return {p.sq, p.b, p.n * p.dv};
    if (p.layout == "BSND") return {p.b, p.sq, p.n, p.dv};
    if (p.layout == "BNSD") return {p.b, p.n, p.sq, p.dv};
    return {p.sq, p.n, p.dv};
}

std::vector<int64_t> stats_shape(const Plan& p) {
    if (p.layout == "TND") return {p.sq, p.n, kStatsColumns};
    return {p.b, p.n, p.sq, kStatsColumns};
}

aclnnStatus check_shape(const char* op, const char* name, const aclTensor* t, const std::vector<int64_t>& shape) {
    if (t->view != shape)
        return invalid(op, std::string(name) + " has shape " + shape_text(t->view) + ", expected " + shape_text(shape));
    return 0;
}

aclnnStatus check_stats(const char* op, const char* name, const aclTensor* t, const Plan& p) {
    if (int rc = check_shape(op, name, t, stats_shape(p))) return rc;
    if (p.layout == "TND" && !p.stats_tnd && !contiguous(*t))
        return invalid(op, std::string(name) + " must be contiguous (NTD order in the (T, N, 8) buffer)");
    return 0;
}

aclnnStatus softmax_layout(const char* op, const char* what, const char* layout, Plan& p) {
    if (int rc = check_present(op, what, layout)) return rc;
    std::string s = layout;
    if (s != "" && s != "same_as_input") return invalid(op, std::string(what) + " must be \"\" or \"same_as_input\"");
    p.stats_tnd = s == "same_as_input";
    return 0;
}

// The forward's phase two: every sequence (one per TND document, or the whole batch).
void run_forward(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                 const at::Tensor& sink, const at::Tensor& out, const at::Tensor& max_out, const at::Tensor& sum_out) {
    if (p.layout != "TND") {
        at::Tensor mask4 = sequence_mask(p, mask, p.sq, p.skv);
        auto [row_max, row_sum] = forward_core(to_bnsd(q, p.layout, p.n), to_bnsd(k, p.layout, p.nkv),
                                               to_bnsd(v, p.layout, p.nkv), mask4, band_of(p, p.sq, p.skv), p.scale,
                                               sink, to_bnsd(out, p.layout, p.n));
        max_out.copy_(row_max.unsqueeze(-1).expand(stats_shape(p)));
        sum_out.copy_(row_sum.unsqueeze(-1).expand(stats_shape(p)));
        return;
    }
    out.zero_();  // tokens after the last sequence
    max_out.zero_();
    sum_out.zero_();
    at::Tensor max_ntc = stats_ntc(max_out, p), sum_ntc = stats_ntc(sum_out, p);
    for (size_t i = 0; i < p.q_bounds.size(); ++i) {
        auto qb = p.q_bounds[i], kb = p.kv_bounds[i];
        const int64_t sq = qb.second - qb.first, skv = kb.second - kb.first;
        if (sq == 0) continue;
        at::Tensor mask4 = sequence_mask(p, mask, sq, skv);
        auto [row_max, row_sum] = forward_core(tnd_piece(q, qb), tnd_piece(k, kb), tnd_piece(v, kb), mask4,
                                               band_of(p, sq, skv), p.scale, sink, tnd_piece(out, qb));
        max_ntc.slice(1, qb.first, qb.second).copy_(row_max[0].unsqueeze(-1).expand({p.n, sq, kStatsColumns}));
        sum_ntc.slice(1, qb.first, qb.second).copy_(row_sum[0].unsqueeze(-1).expand({p.n, sq, kStatsColumns}));
    }
}

void run_backward(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                  const at::Tensor& mask, const at::Tensor& max_in, const at::Tensor& sum_in, const at::Tensor& out,
                  const at::Tensor& sink, const at::Tensor& dsink_out, const at::Tensor& dq, const at::Tensor& dk,
                  const at::Tensor& dv) {
    // Summed over every batch and sequence in FLOAT32, written once at the end.
    at::Tensor dsink = sink.defined() ? at::zeros({p.n}, at::kFloat) : at::Tensor();
    at::Tensor sink_f = sink.defined() ? sink.to(at::kFloat) : at::Tensor();
    if (p.layout != "TND") {
        at::Tensor mask4 = sequence_mask(p, mask, p.sq, p.skv);
        backward_core(to_bnsd(q, p.layout, p.n), to_bnsd(k, p.layout, p.nkv), to_bnsd(v, p.layout, p.nkv),
                      to_bnsd(dy, p.layout, p.n), to_bnsd(out, p.layout, p.n), mask4, band_of(p, p.sq, p.skv), p.scale,
                      max_in.select(-1, 0), sum_in.select(-1, 0), sink_f, dsink, to_bnsd(dq, p.layout, p.n),
                      to_bnsd(dk, p.layout, p.nkv), to_bnsd(dv, p.layout, p.nkv));
        if (dsink_out.defined()) dsink_out.copy_(dsink);
        return;
    }
    dq.zero_();  // tokens outside every sequence
    dk.zero_();
    dv.zero_();
    at::Tensor max_nt = stats_ntc(max_in, p).select(-1, 0), sum_nt = stats_ntc(sum_in, p).select(-1, 0);
    for (size_t i = 0; i < p.q_bounds.size(); ++i) {
        auto qb = p.q_bounds[i], kb = p.kv_bounds[i];
        const int64_t sq = qb.second - qb.first, skv = kb.second - kb.first;
        if (sq == 0 || skv == 0) continue;
        at::Tensor mask4 = sequence_mask(p, mask, sq, skv);
        backward_core(tnd_piece(q, qb), tnd_piece(k, kb), tnd_piece(v, kb), tnd_piece(dy, qb), tnd_piece(out, qb),
                      mask4, band_of(p, sq, skv), p.scale, max_nt.slice(1, qb.first, qb.second).unsqueeze(0),
                      sum_nt.slice(1, qb.first, qb.second).unsqueeze(0), sink_f, dsink, tnd_piece(dq, qb),
                      tnd_piece(dk, kb), tnd_piece(dv, kb));
    }
    if (dsink_out.defined()) dsink_out.copy_(dsink);
}

// The sink's checks (FLOAT32 by op_table.json; one logit per query head).
aclnnStatus check_sink(const char* op, const char* name, const aclTensor* sink, const Plan& p) {
    if (sink && (sink->view.size() != 1 || sink->view[0] != p.n))
        return invalid(op, std::string(name) + " must be 1-D with headNum (" + std::to_string(p.n) +
                               ") logits, got " + shape_text(sink->view));
    return 0;
}

aclnnStatus forward(const char* op, const aclTensor* query, const aclTensor* key, const aclTensor* value,
                    const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
                    const aclTensor* atten_mask, const aclTensor* sink, const aclIntArray* q_lens,
                    const aclIntArray* kv_lens,
                    double scale, double keep_prob, int64_t pre, int64_t next, int64_t head_num, char* input_layout,
                    int64_t sparse_mode, const char* stats_layout, const aclTensor* softmax_max,
                    const aclTensor* softmax_sum, const aclTensor* softmax_out, const aclTensor* attention_out,
                    uint64_t* ws, aclOpExecutor** ex) {
    if (int rc = check_args(op, {{"query", query}, {"key", key}, {"value", value},
                                 {"realShiftOptional", real_shift, true}, {"dropMaskOptional", drop_mask, true},
                                 {"attenMaskOptional", atten_mask, true}, {"sinkOptional", sink, true},
                                 {"softmaxMaxOut", softmax_max}, {"softmaxSumOut", softmax_sum},
                                 {"softmaxOutOut", softmax_out, true}, {"attentionOutOut", attention_out}}))
        return rc;
    Plan p;
    if (stats_layout)
        if (int rc = softmax_layout(op, "softmaxOutLayout", stats_layout, p)) return rc;
    if (int rc = plan_attention(op, query, key, value, real_shift, padding_mask, atten_mask, q_lens, kv_lens, scale,
                                keep_prob, pre, next, head_num, input_layout, sparse_mode, p))
        return rc;
    if (attention_out->dtype != query->dtype) return invalid(op, "attentionOut's dtype differs from query's");
    if (int rc = check_shape(op, "attentionOut", attention_out, out_shape(p))) return rc;
    if (int rc = check_stats(op, "softmaxMaxOut", softmax_max, p)) return rc;
    if (int rc = check_stats(op, "softmaxSumOut", softmax_sum, p)) return rc;
    if (int rc = check_sink(op, "sinkOptional", sink, p)) return rc;
    return aten_executor(op, [p, q = hold(query), k = hold(key), v = hold(value), m = hold(atten_mask),
                              sk = hold(sink), mx = hold(softmax_max), sm = hold(softmax_sum),
                              o = hold(attention_out)] {
        run_forward(p, view(q), view(k), view(v), view(m), view(sk), view(o), view(mx), view(sm));
    }, ws, ex);
}

aclnnStatus backward(const char* op, const aclTensor* query, const aclTensor* key, const aclTensor* value,
                     const aclTensor* dy, const aclTensor* pse, const aclTensor* drop_mask,
                     const aclTensor* padding_mask, const aclTensor* atten_mask, const aclTensor* softmax_max,
                     const aclTensor* softmax_sum, const aclTensor* softmax_in, const aclTensor* attention_in,
                     const aclTensor* sink, const aclIntArray* q_lens, const aclIntArray* kv_lens, double scale,
                     double keep_prob, int64_t pre, int64_t next, int64_t head_num, char* input_layout,
                     int64_t sparse_mode, const char* stats_layout, const aclTensor* dq, const aclTensor* dk,
                     const aclTensor* dv, const aclTensor* dpse, const aclTensor* dsink, uint64_t* ws,
                     aclOpExecutor** ex) {
    if (int rc = check_args(op, {{"query", query}, {"keyIn", key}, {"value", value}, {"dy", dy},
                                 {"pseShiftOptional", pse, true}, {"dropMaskOptional", drop_mask, true},
                                 {"attenMaskOptional", atten_mask, true}, {"softmaxMaxOptional", softmax_max, true},
                                 {"softmaxSumOptional", softmax_sum, true}, {"softmaxInOptional", softmax_in, true},
                                 {"attentionInOptional", attention_in, true}, {"sinkInOptional", sink, true},
                                 {"dqOut", dq}, {"dkOut", dk}, {"dvOut", dv}, {"dpseOut", dpse, true},
                                 {"dsinkOut", dsink, true}}))
        return rc;
    if (!softmax_max || !softmax_sum || !attention_in)
        return fail(ACLNN_ERR_INNER, std::string(op) + ": without softmaxMax, softmaxSum and attentionIn (the "
                                                       "forward's outputs) the gradient is not emulated");
    Plan p;
    if (stats_layout)
        if (int rc = softmax_layout(op, "softmaxInLayout", stats_layout, p)) return rc;
    if (int rc = plan_attention(op, query, key, value, pse, padding_mask, atten_mask, q_lens, kv_lens, scale, keep_prob,
                                pre, next, head_num, input_layout, sparse_mode, p))
        return rc;
    for (auto [name, t, shape] : {std::tuple{"dy", dy, out_shape(p)},
                                  std::tuple{"attentionIn", attention_in, out_shape(p)},
                                  std::tuple{"dqOut", dq, query->view}, std::tuple{"dkOut", dk, key->view},
                                  std::tuple{"dvOut", dv, value->view}})
        if (int rc = check_shape(op, name, t, shape)) return rc;
    if (int rc = check_stats(op, "softmaxMaxOptional", softmax_max, p)) return rc;
    if (int rc = check_stats(op, "softmaxSumOptional", softmax_sum, p)) return rc;
    if (int rc = check_sink(op, "sinkInOptional", sink, p)) return rc;
    if (sink && dsink)
        if (int rc = check_shape(op, "dsinkOut", dsink, sink->view)) return rc;
    return aten_executor(op, [p, q = hold(query), k = hold(key), v = hold(value), g = hold(dy), m = hold(atten_mask),
                              mx = hold(softmax_max), sm = hold(softmax_sum), o = hold(attention_in), sk = hold(sink),
                              gs = hold(sink ? dsink : nullptr), gq = hold(dq), gk = hold(dk), gv = hold(dv)] {
        run_backward(p, view(q), view(k), view(v), view(g), view(m), view(mx), view(sm), view(o), view(sk), view(gs),
                     view(gq), view(gk), view(gv));
    }, ws, ex);
}

}  // namespace

// ---- forward: BSH / SBH / BSND / BNSD, then TND (NTD statistics), then TND with softmaxOutLayout ----------
CANN_API aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* real_shift,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask, const aclIntArray* prefix,
    double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_out, const aclTensor* attention_out, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;  // prefix: modes 5/6 only (not emulated); innerPrecise: precision hint
    const char* op = "aclnnFlashAttentionScore";
    if (input_layout && std::string(input_layout) == "TND")
        return invalid(op, "TND is aclnnFlashAttentionVarLenScore's");
    return forward(op, query, key, value, real_shift, drop_mask, padding_mask, atten_mask, nullptr, nullptr, nullptr,
                   scale, keep_prob, pre_tokens, next_tokens, head_num, input_layout, sparse_mode, nullptr,
                   softmax_max, softmax_sum, softmax_out, attention_out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionScore)

CANN_API aclnnStatus aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* real_shift,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask, const aclIntArray* prefix,
    const aclIntArray* q_lens, const aclIntArray* kv_lens, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise, int64_t sparse_mode,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_out,
    const aclTensor* attention_out, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionVarLenScore";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    return forward(op, query, key, value, real_shift, drop_mask, padding_mask, atten_mask, nullptr, q_lens, kv_lens,
                   scale, keep_prob, pre_tokens, next_tokens, head_num, input_layout, sparse_mode, "", softmax_max,
                   softmax_sum, softmax_out, attention_out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionVarLenScore)

CANN_API aclnnStatus aclnnFlashAttentionVarLenScoreV4GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* real_shift,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask, const aclIntArray* prefix,
    const aclIntArray* q_lens, const aclIntArray* kv_lens, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise, int64_t sparse_mode,
    char* softmax_out_layout, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_out, const aclTensor* attention_out, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionVarLenScoreV4";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    if (int rc = check_present(op, "softmaxOutLayout", softmax_out_layout)) return rc;
    return forward(op, query, key, value, real_shift, drop_mask, padding_mask, atten_mask, nullptr, q_lens, kv_lens,
                   scale, keep_prob, pre_tokens, next_tokens, head_num, input_layout, sparse_mode, softmax_out_layout,
                   softmax_max, softmax_sum, softmax_out, attention_out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionVarLenScoreV4)

// The sink's pair (CANN's aclnnFlashAttentionScoreV3 / VarLenScoreV5: op-plugin calls them when sink is given).
// qStartIdx / kvStartIdx (empty from torch_npu) and the rope inputs (null) are not emulated.
aclnnStatus refuse_extras(const char* op, const aclIntArray* q_start, const aclIntArray* kv_start,
                          const aclTensor* q_rope, const aclTensor* k_rope, int64_t pse_type) {
    if ((q_start && !q_start->v.empty()) || (kv_start && !kv_start->v.empty()))
        return fail(ACLNN_ERR_INNER, std::string(op) + ": qStartIdx / kvStartIdx are not emulated");
    if (q_rope || k_rope) return fail(ACLNN_ERR_INNER, std::string(op) + ": queryRope / keyRope are not emulated");
    if (pse_type != 1) return fail(ACLNN_ERR_INNER, std::string(op) + ": pseType other than 1 is not emulated");
    return 0;
}

CANN_API aclnnStatus aclnnFlashAttentionScoreV3GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* real_shift,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask, const aclTensor* sink,
    const aclIntArray* prefix, const aclIntArray* q_start, const aclIntArray* kv_start, double scale,
    double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, int64_t pse_type, const aclTensor* softmax_max,
    const aclTensor* softmax_sum, const aclTensor* softmax_out, const aclTensor* attention_out, uint64_t* ws,
    aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionScoreV3";
    if (input_layout && std::string(input_layout) == "TND")
        return invalid(op, "TND is aclnnFlashAttentionVarLenScoreV5's");
    if (int rc = refuse_extras(op, q_start, kv_start, nullptr, nullptr, pse_type)) return rc;
    return forward(op, query, key, value, real_shift, drop_mask, padding_mask, atten_mask, sink, nullptr, nullptr,
                   scale, keep_prob, pre_tokens, next_tokens, head_num, input_layout, sparse_mode, nullptr,
                   softmax_max, softmax_sum, softmax_out, attention_out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionScoreV3)

CANN_API aclnnStatus aclnnFlashAttentionVarLenScoreV5GetWorkspaceSize(
    const aclTensor* query, const aclTensor* query_rope, const aclTensor* key, const aclTensor* key_rope,
    const aclTensor* value, const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclTensor* sink, const aclIntArray* prefix, const aclIntArray* q_lens,
    const aclIntArray* kv_lens, const aclIntArray* q_start, const aclIntArray* kv_start, double scale,
    double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, int64_t pse_type, char* softmax_out_layout,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_out,
    const aclTensor* attention_out, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionVarLenScoreV5";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    if (int rc = refuse_extras(op, q_start, kv_start, query_rope, key_rope, pse_type)) return rc;
    if (int rc = check_present(op, "softmaxOutLayout", softmax_out_layout)) return rc;
    return forward(op, query, key, value, real_shift, drop_mask, padding_mask, atten_mask, sink, q_lens, kv_lens,
                   scale, keep_prob, pre_tokens, next_tokens, head_num, input_layout, sparse_mode, softmax_out_layout,
                   softmax_max, softmax_sum, softmax_out, attention_out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionVarLenScoreV5)

// ---- backward ----------------------------------------------------------------------------------------------
CANN_API aclnnStatus aclnnFlashAttentionScoreGradGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy, const aclTensor* pse,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_in,
    const aclTensor* attention_in, const aclIntArray* prefix, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise, int64_t sparse_mode,
    const aclTensor* dq, const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, uint64_t* ws,
    aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionScoreGrad";
    if (input_layout && std::string(input_layout) == "TND")
        return invalid(op, "TND is aclnnFlashAttentionUnpaddingScoreGrad's");
    return backward(op, query, key, value, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
                    softmax_in, attention_in, nullptr, nullptr, nullptr, scale, keep_prob, pre_tokens, next_tokens,
                    head_num, input_layout, sparse_mode, nullptr, dq, dk, dv, dpse, nullptr, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionScoreGrad)

CANN_API aclnnStatus aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy, const aclTensor* pse,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_in,
    const aclTensor* attention_in, const aclIntArray* prefix, const aclIntArray* q_lens, const aclIntArray* kv_lens,
    double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, const aclTensor* dq, const aclTensor* dk, const aclTensor* dv,
    const aclTensor* dpse, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionUnpaddingScoreGrad";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    return backward(op, query, key, value, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
                    softmax_in, attention_in, nullptr, q_lens, kv_lens, scale, keep_prob, pre_tokens, next_tokens,
                    head_num, input_layout, sparse_mode, "", dq, dk, dv, dpse, nullptr, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionUnpaddingScoreGrad)

CANN_API aclnnStatus aclnnFlashAttentionUnpaddingScoreGradV4GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy, const aclTensor* pse,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_in,
    const aclTensor* attention_in, const aclIntArray* prefix, const aclIntArray* q_lens, const aclIntArray* kv_lens,
    double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, const aclTensor* dq, const aclTensor* dk, const aclTensor* dv,
    const aclTensor* dpse, char* softmax_in_layout, uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionUnpaddingScoreGradV4";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    if (int rc = check_present(op, "softmaxInLayout", softmax_in_layout)) return rc;
    return backward(op, query, key, value, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
                    softmax_in, attention_in, nullptr, q_lens, kv_lens, scale, keep_prob, pre_tokens, next_tokens,
                    head_num, input_layout, sparse_mode, softmax_in_layout, dq, dk, dv, dpse, nullptr, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionUnpaddingScoreGradV4)

CANN_API aclnnStatus aclnnFlashAttentionScoreGradV3GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy, const aclTensor* pse,
    const aclTensor* drop_mask, const aclTensor* padding_mask, const aclTensor* atten_mask,
    const aclTensor* softmax_max, const aclTensor* softmax_sum, const aclTensor* softmax_in,
    const aclTensor* attention_in, const aclTensor* sink, const aclIntArray* prefix, const aclIntArray* q_start,
    const aclIntArray* kv_start, double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens,
    int64_t head_num, char* input_layout, int64_t inner_precise, int64_t sparse_mode, int64_t pse_type,
    const aclTensor* dq, const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, const aclTensor* dsink,
    uint64_t* ws, aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise;
    const char* op = "aclnnFlashAttentionScoreGradV3";
    if (input_layout && std::string(input_layout) == "TND")
        return invalid(op, "TND is aclnnFlashAttentionUnpaddingScoreGradV5's");
    if (int rc = refuse_extras(op, q_start, kv_start, nullptr, nullptr, pse_type)) return rc;
    return backward(op, query, key, value, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
                    softmax_in, attention_in, sink, nullptr, nullptr, scale, keep_prob, pre_tokens, next_tokens,
                    head_num, input_layout, sparse_mode, nullptr, dq, dk, dv, dpse, dsink, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionScoreGradV3)

CANN_API aclnnStatus aclnnFlashAttentionUnpaddingScoreGradV5GetWorkspaceSize(
    const aclTensor* query, const aclTensor* query_rope, const aclTensor* key, const aclTensor* key_rope,
    const aclTensor* value, const aclTensor* dy, const aclTensor* pse, const aclTensor* drop_mask,
    const aclTensor* padding_mask, const aclTensor* atten_mask, const aclTensor* softmax_max,
    const aclTensor* softmax_sum, const aclTensor* softmax_in, const aclTensor* attention_in, const aclTensor* sink,
    const aclIntArray* prefix, const aclIntArray* q_lens, const aclIntArray* kv_lens, const aclIntArray* q_start,
    const aclIntArray* kv_start, double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens,
    int64_t head_num, char* input_layout, int64_t inner_precise, int64_t sparse_mode, int64_t pse_type,
    char* softmax_in_layout, const aclTensor* dq, const aclTensor* dq_rope, const aclTensor* dk,
    const aclTensor* dk_rope, const aclTensor* dv, const aclTensor* dpse, const aclTensor* dsink, uint64_t* ws,
    aclOpExecutor** ex) {
    (void)prefix, (void)inner_precise, (void)dq_rope, (void)dk_rope;
    const char* op = "aclnnFlashAttentionUnpaddingScoreGradV5";
    if (!input_layout || std::string(input_layout) != "TND") return invalid(op, "inputLayout must be TND");
    if (int rc = refuse_extras(op, q_start, kv_start, query_rope, key_rope, pse_type)) return rc;
    if (int rc = check_present(op, "softmaxInLayout", softmax_in_layout)) return rc;
    return backward(op, query, key, value, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
                    softmax_in, attention_in, sink, q_lens, kv_lens, scale, keep_prob, pre_tokens, next_tokens,
                    head_num, input_layout, sparse_mode, softmax_in_layout, dq, dk, dv, dpse, dsink, ws, ex);
}
CANN_EMU_LAUNCH(aclnnFlashAttentionUnpaddingScoreGradV5)
