// MoE operators computed by ATen's CPU kernels on the host buffers (aten_support.h): the grouped matmul
// torch_npu.npu_grouped_matmul calls (aclnnGroupedMatmulV5, non-quantized, grouped along M or K) and the
// token permutation pair with their gradients (aclnnMoeTokenPermute/Grad, aclnnMoeTokenUnpermute/Grad).
// Signatures from CANN's headers (hicann/ops-transformer gmm/grouped_matmul, moe/moe_token_*/op_host/op_api);
// semantics and checks from the operators' READMEs there, op_host/op_api/aclnn_grouped_matmul.cpp and the
// *_def.cpp dtype combinations (the docs/aclnn*.md of these operators are placeholders in that snapshot).
#include "aten_support.h"

#include <ATen/ops/argsort.h>

using namespace cann_emu;

namespace {

bool is_float(int dtype) { return dtype == ACL_FLOAT || dtype == ACL_FLOAT16 || dtype == ACL_BF16; }

// What the cube unit does for FLOAT16/BFLOAT16: accumulate in FP32, round once into the output.
at::Tensor in_fp32(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

// aclnn_grouped_matmul_util.cpp IsTransposeLastTwoDims: the last two dims are a transposed contiguous
// matrix (strides (1, rows)) and the leading dims are packed on top of it.
bool transposed_last_two(const aclTensor& t) {
    size_t n = t.view.size();
    if (n < 2) return false;
    if (!(t.strides[n - 2] == 1 && t.strides[n - 1] == t.view[n - 2])) return false;
    int64_t packed = t.view[n - 1] * t.view[n - 2];
    for (int64_t d = (int64_t)n - 3; d >= 0; --d) {
        if (t.strides[d] != packed) return false;
        packed *= t.view[d];
    }
    return true;
}
// CheckSpecialTranspose: as above, but a (.., 1, 1) matrix counts as not transposed.
bool transposed_unless_1x1(const aclTensor& t) {
    size_t n = t.view.size();
    return transposed_last_two(t) && t.view[n - 1] * t.view[n - 2] != 1;
}

std::string shape(const aclTensor& t) {
    std::string s = "(";
    for (size_t i = 0; i < t.view.size(); ++i) s += (i ? ", " : "") + std::to_string(t.view[i]);
    return s + (t.view.size() == 1 ? ",)" : ")");
}

// rows[i] = table[row[i]], 0 where row[i] points past the table (a row numOutTokens dropped).
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& row) {
    int64_t n = table.size(0);
    if (n == 0) return at::zeros({row.numel(), table.size(1)}, table.options());
    return at::where(row.lt(n).unsqueeze(1), table.index_select(0, row.clamp_max(n - 1)), at::Scalar(0));
}

}  // namespace

// ---- grouped matmul (ops-transformer gmm/grouped_matmul) ------------------------------------------------
// torch_npu 2.14.0's npu_grouped_matmul with a group_list tensor calls aclnnGroupedMatmulV5 (it probes the
// name; V4 only for FP8/FP4 or explicit x_dtype/weight_dtype). Emulated: the non-quantized single-tensor
// scenarios ("单单单"), split_item 2/3, with group_list_type 0 (cumulative ends) or 1 (counts):
//   groupType 0 (M): x (m, k) not transposed, weight (e, k, n) (may be transposed), y (m, n);
//                    y[rows of g] = x[rows of g] @ weight[g]; rows past the last group are not written
//                    (the kernel skips them; CANN requires group_list to cover at most m rows).
//   groupType 2 (K): x (m, k) transposed (stored (k, m)), weight (k, n) not transposed, y (e, m, n);
//                    y[g] = x[:, ks of g] @ weight[ks of g]; an empty group's y[g] is zero (the kernel's
//                    EmptyTensorCompute for a transposed x).
// Everything else CANN accepts (quantized and pseudo-quantized paths, bias, lists of tensors, groupType -1,
// group_list_type 2, activations) fails with 561000 naming what is not emulated.
CANN_API aclnnStatus aclnnGroupedMatmulV5GetWorkspaceSize(
    const aclTensorList* x, const aclTensorList* weight, const aclTensorList* bias, const aclTensorList* scale,
    const aclTensorList* offset, const aclTensorList* antiquant_scale, const aclTensorList* antiquant_offset,
    const aclTensorList* per_token_scale, const aclTensor* group_list, const aclTensorList* activation_input,
    const aclTensorList* activation_quant_scale, const aclTensorList* activation_quant_offset, int64_t split_item,
    int64_t group_type, int64_t group_list_type, int64_t act_type, aclIntArray* tuning_config, aclTensorList* out,
    aclTensorList* activation_feature_out, aclTensorList* dyn_quant_scale_out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnGroupedMatmulV5";
    if (int rc = check_list(op, "x", x)) return rc;  // one by one: "a || b" would return 1, not the status
    if (int rc = check_list(op, "weight", weight)) return rc;
    if (int rc = check_list(op, "out", out)) return rc;
    if (int rc = check_args(op, {{"groupListOptional", group_list, true}})) return rc;
    if (x->v.empty() || weight->v.empty() || out->v.empty()) return invalid(op, "x, weight and out must not be empty");
    if (split_item < 0 || split_item > 3) return invalid(op, "splitItem must be 0, 1, 2 or 3");
    if (group_type == 1) return invalid(op, "Not support split n dim now, groupType can not be 1");
    if (group_type != -1 && group_type != 0 && group_type != 2)
        return invalid(op, "groupType only support -1/0/2 now, but given groupType is " + std::to_string(group_type));
    if (split_item >= 2 && group_type == -1) return invalid(op, "When splitItem is 2/3, groupType can not be -1");
    if (activation_input || activation_quant_scale || activation_quant_offset || activation_feature_out ||
        dyn_quant_scale_out)
        return invalid(op, "activationInput, activationQuantScale, activationQuantOffset, activationFeatureOut and "
                           "dynQuantScaleOut only accept nullptr");
    if (group_list_type < 0 || group_list_type > 2)
        return invalid(op, "groupListType must be 0, 1 or 2, got " + std::to_string(group_list_type));
    if (tuning_config && !tuning_config->v.empty() && tuning_config->v[0] < 0)
        return invalid(op, "tuningConfigOptional must be non-negative");
    const aclTensor& x0 = *x->v[0];
    const aclTensor& w0 = *weight->v[0];
    const aclTensor& y0 = *out->v[0];
    // The quantized, pseudo-quantized and activation paths (README's table, rows 4-16).
    const char* quantized = scale ? "scale" : offset ? "offset" : antiquant_scale ? "antiquantScale"
                          : antiquant_offset ? "antiquantOffset" : per_token_scale ? "perTokenScale" : nullptr;
    if (quantized || !is_float(x0.dtype) || !is_float(w0.dtype) || act_type != 0)
        return fail(ACLNN_ERR_INNER, std::string(op) + ": the quantized / pseudo-quantized / activation path (" +
                                         (quantized ? quantized : act_type != 0 ? "actType" : "integer x or weight") +
                                         ") is not emulated; only x, weight and out of one float dtype are");
    for (const aclTensorList* list : {x, weight, (const aclTensorList*)out})
        for (const aclTensor* t : list->v)
            if (t->dtype != x0.dtype)
                return invalid(op, std::string("non-quantized: x, weight and out must share one dtype, got x ") +
                                       dtype_name(x0.dtype) + ", weight " + dtype_name(w0.dtype) + ", out " +
                                       dtype_name(t->dtype));
    if (bias) return fail(ACLNN_ERR_INNER, std::string(op) + ": biasOptional is not emulated");
    if (group_list_type == 2) return fail(ACLNN_ERR_INNER, std::string(op) + ": groupListType 2 is not emulated");
    if (group_type == -1 || x->v.size() != 1 || weight->v.size() != 1 || out->v.size() != 1 || split_item < 2)
        return fail(ACLNN_ERR_INNER, std::string(op) + ": only single x, weight and out tensors with splitItem 2/3 "
                                                       "and groupType 0 or 2 are emulated");
    if (!group_list) return invalid(op, "groupListOptional(tensor) is required in this case, but get nullptr");
    if (group_list->view.size() != 1) return invalid(op, "groupListOptional must be 1-D, got " + shape(*group_list));
    int64_t groups = group_list->view[0];
    if (groups > 1024) return invalid(op, "groupListOptional has more than 1024 groups");
    if (x0.view.size() != 2) return invalid(op, "x must be 2-D, got " + shape(x0));
    if (group_type == 0) {
        if (transposed_unless_1x1(x0)) return invalid(op, "When groupType is 0, x can not be transposed");
        if (w0.view.size() != 3 || y0.view.size() != 2)
            return invalid(op, "groupType 0: weight must be 3-D (e, k, n) and out 2-D (m, n), got weight " +
                                   shape(w0) + ", out " + shape(y0));
        if (w0.view[1] != x0.view[1] || y0.view[0] != x0.view[0] || y0.view[1] != w0.view[2])
            return invalid(op, "groupType 0: x " + shape(x0) + ", weight " + shape(w0) + " and out " + shape(y0) +
                                   " do not agree as (m, k), (e, k, n), (m, n)");
        if (!((groups == w0.view[0] && groups > 1) || w0.view[0] == 1))
            return invalid(op, "size of groupList " + std::to_string(groups) + " should be equal to weight dim 0 " +
                                   std::to_string(w0.view[0]));
    } else {
        if (!transposed_last_two(x0))
            return invalid(op, "When groupType is 2 and x is not separated, tensor in x should be transposed");
        if (transposed_unless_1x1(w0)) return invalid(op, "x and weight can not be transposed at the same time");
        if (w0.view.size() != 2 || y0.view.size() != 3)
            return invalid(op, "groupType 2: weight must be 2-D (k, n) and out 3-D (e, m, n), got weight " +
                                   shape(w0) + ", out " + shape(y0));
        if (w0.view[0] != x0.view[1] || y0.view[1] != x0.view[0] || y0.view[2] != w0.view[1])
            return invalid(op, "groupType 2: x " + shape(x0) + ", weight " + shape(w0) + " and out " + shape(y0) +
                                   " do not agree as (m, k), (k, n), (e, m, n)");
        if (!((groups == y0.view[0] && groups > 1) || y0.view[0] == 1))
            return invalid(op, "size of groupList " + std::to_string(groups) + " should be equal to y dim 0 " +
                                   std::to_string(y0.view[0]));
    }
    // CANN lets one group's weight (or y) go with a longer groupList; what it computes then is not documented.
    if (groups != (group_type == 0 ? w0.view[0] : y0.view[0]))
        return fail(ACLNN_ERR_INNER, std::string(op) + ": a groupList longer than the one group of " +
                                         (group_type == 0 ? "weight" : "out") + " is not emulated");
    return make_executor(op, [op, xs = *x->v[0], w = *weight->v[0], y = *out->v[0], gl = *group_list, group_type,
                              group_list_type]() -> aclnnStatus {
        // group_list lives in device memory: its values are known only at launch.
        at::Tensor values = host_view(gl).to(at::kLong).contiguous();
        std::vector<int64_t> ends;
        int64_t end = 0;
        for (int64_t i = 0; i < values.numel(); ++i) {
            int64_t v = values.data_ptr<int64_t>()[i];
            if (v < 0 || (group_list_type == 0 && v < end))
                return fail(ACLNN_ERR_INNER, std::string(op) + ": groupList " +
                                                 (group_list_type == 0
                                                      ? "(cumulative ends) must be non-negative and non-decreasing"
                                                      : "(counts) must be non-negative"));
            end = group_list_type == 0 ? v : end + v;
            ends.push_back(end);
        }
        int64_t extent = group_type == 0 ? xs.view[0] : xs.view[1];
        if (end > extent)
            return fail(ACLNN_ERR_INNER, std::string(op) + ": groupList covers " + std::to_string(end) + " " +
                                             (group_type == 0 ? "rows" : "columns") + " of x, which has " +
                                             std::to_string(extent));
        auto body = [&] {
            at::Tensor x_t = host_view(xs), w_t = host_view(w), y_t = host_view(y);
            int64_t start = 0;
            for (size_t g = 0; g < ends.size(); ++g) {
                int64_t len = ends[g] - start;
                if (group_type == 0) {
                    if (len > 0)
                        y_t.narrow(0, start, len).copy_(at::mm(in_fp32(x_t.narrow(0, start, len)), in_fp32(w_t[g])));
                } else if (len > 0) {
                    y_t[g].copy_(at::mm(in_fp32(x_t.narrow(1, start, len)), in_fp32(w_t.narrow(0, start, len))));
                } else {
                    y_t[g].zero_();
                }
                start = ends[g];
            }
        };
        return run_aten(op, body);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnGroupedMatmulV5)

// ---- token permutation (ops-transformer moe/moe_token_permute, moe_token_unpermute and their grads) ------
// README formulas: the (token, k) slots of indices, stably sorted by expert id, give the permuted rows;
// sortedIndices[slot] = the permuted row holding it. paddedMode true is not supported by CANN on Atlas A2.
static constexpr int64_t kMaxTopK = 512;
static constexpr int64_t kMaxIndices = 16777215;

CANN_API aclnnStatus aclnnMoeTokenPermuteGetWorkspaceSize(const aclTensor* tokens, const aclTensor* indices,
                                                          int64_t num_out_tokens, bool padded_mode,
                                                          const aclTensor* permute_tokens_out,
                                                          const aclTensor* sorted_indices_out, uint64_t* ws,
                                                          aclOpExecutor** ex) {
    const char* op = "aclnnMoeTokenPermute";
    if (int rc = check_args(op, {{"tokens", tokens}, {"indices", indices}, {"permuteTokensOut", permute_tokens_out},
                                 {"sortedIndicesOut", sorted_indices_out}}))
        return rc;
    if (padded_mode) return invalid(op, "paddedMode only supports false");
    if (permute_tokens_out->dtype != tokens->dtype) return invalid(op, "permuteTokensOut must have tokens' dtype");
    if (tokens->view.size() != 2) return invalid(op, "tokens must be 2-D, got " + shape(*tokens));
    if (indices->view.size() != 1 && indices->view.size() != 2)
        return invalid(op, "indices must be 1-D or 2-D, got " + shape(*indices));
    if (indices->view[0] != tokens->view[0])
        return invalid(op, "indices " + shape(*indices) + " and tokens " + shape(*tokens) + " differ in dim 0");
    int64_t topk = indices->view.size() == 2 ? indices->view[1] : 1;
    int64_t total = indices->view[0] * topk;
    if (topk < 1 || topk > kMaxTopK) return invalid(op, "topK must be in [1, 512], got " + std::to_string(topk));
    if (total >= kMaxIndices) return invalid(op, "indices must hold fewer than 16777215 elements");
    // numOutTokens: 0 keeps every row, > 0 the first ones, < 0 slices like a negative index.
    int64_t kept = num_out_tokens == 0 ? total : num_out_tokens > 0 ? std::min(num_out_tokens, total)
                                                                     : std::max<int64_t>(total + num_out_tokens, 0);
    if (permute_tokens_out->view != std::vector<int64_t>{kept, tokens->view[1]})
        return invalid(op, "permuteTokensOut must be (" + std::to_string(kept) + ", " +
                               std::to_string(tokens->view[1]) + "), got " + shape(*permute_tokens_out));
    if (sorted_indices_out->view != std::vector<int64_t>{total})
        return invalid(op, "sortedIndicesOut must be (" + std::to_string(total) + ",), got " +
                               shape(*sorted_indices_out));
    return aten_executor(op, [t = hold(tokens), i = hold(indices), p = hold(permute_tokens_out),
                              s = hold(sorted_indices_out), topk, kept] {
        at::Tensor slot_of_row = at::argsort(view(i).reshape(-1), /*stable=*/true, 0, false);
        at::Tensor sorted = view(s);
        at::Tensor rows = at::arange(slot_of_row.numel(), slot_of_row.options());
        sorted.index_copy_(0, slot_of_row, rows.to(sorted.scalar_type()));
        view(p).copy_(view(t).index_select(0, slot_of_row.narrow(0, 0, kept).div(topk, "floor")));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMoeTokenPermute)

// out[t] = sum over k of permutedOutputGrad[sortedIndices[t * numTopk + k]] (rows dropped by numOutTokens add 0).
CANN_API aclnnStatus aclnnMoeTokenPermuteGradGetWorkspaceSize(const aclTensor* permuted_output_grad,
                                                              const aclTensor* sorted_indices, int64_t num_topk,
                                                              bool padded_mode, aclTensor* out, uint64_t* ws,
                                                              aclOpExecutor** ex) {
    const char* op = "aclnnMoeTokenPermuteGrad";
    if (int rc = check_args(op, {{"permutedOutputGrad", permuted_output_grad}, {"sortedIndices", sorted_indices},
                                 {"out", out}}))
        return rc;
    if (padded_mode) return invalid(op, "paddedMode only supports false");
    if (out->dtype != permuted_output_grad->dtype) return invalid(op, "out must have permutedOutputGrad's dtype");
    if (num_topk < 1 || num_topk > kMaxTopK)
        return invalid(op, "numTopk must be in [1, 512], got " + std::to_string(num_topk));
    if (permuted_output_grad->view.size() != 2 || out->view.size() != 2 || sorted_indices->view.size() != 1)
        return invalid(op, "permutedOutputGrad and out must be 2-D, sortedIndices 1-D");
    if (out->view[1] != permuted_output_grad->view[1] || sorted_indices->view[0] != out->view[0] * num_topk)
        return invalid(op, "out " + shape(*out) + ", permutedOutputGrad " + shape(*permuted_output_grad) +
                               " and sortedIndices " + shape(*sorted_indices) + " do not agree with numTopk " +
                               std::to_string(num_topk));
    return aten_executor(op, [g = hold(permuted_output_grad), s = hold(sorted_indices), num_topk, o = hold(out)] {
        at::Tensor grad = in_fp32(view(g)), row = view(s).to(at::kLong), result = view(o);
        result.copy_(gather_rows(grad, row).reshape({result.size(0), num_topk, result.size(1)}).sum(1));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMoeTokenPermuteGrad)

// out[t] = sum over k of probs[t, k] * permutedTokens[sortedIndices[t * topK + k]], topK = probs' dim 1 (1 and
// no weighting without probs). restoreShapeOptional: CANN documents nullptr only; torch_npu passes [1].
CANN_API aclnnStatus aclnnMoeTokenUnpermuteGetWorkspaceSize(const aclTensor* permuted_tokens,
                                                            const aclTensor* sorted_indices, const aclTensor* probs,
                                                            bool padded_mode, const aclIntArray* restore_shape,
                                                            aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnMoeTokenUnpermute";
    (void)restore_shape;
    if (int rc = check_args(op, {{"permutedTokens", permuted_tokens}, {"sortedIndices", sorted_indices},
                                 {"probsOptional", probs, true}, {"out", out}}))
        return rc;
    if (padded_mode) return invalid(op, "paddedMode only supports false");
    if (out->dtype != permuted_tokens->dtype) return invalid(op, "out must have permutedTokens' dtype");
    if (permuted_tokens->view.size() != 2 || sorted_indices->view.size() != 1 || out->view.size() != 2)
        return invalid(op, "permutedTokens and out must be 2-D, sortedIndices 1-D");
    int64_t topk = 1;
    if (probs) {
        if (probs->view.size() != 2) return invalid(op, "probsOptional must be 2-D, got " + shape(*probs));
        topk = probs->view[1];
        if (probs->view[0] * topk != sorted_indices->view[0])
            return invalid(op, "probsOptional " + shape(*probs) + " needs one entry per sortedIndices element " +
                                   shape(*sorted_indices));
    }
    if (topk < 1 || topk > kMaxTopK) return invalid(op, "topK must be in [1, 512], got " + std::to_string(topk));
    if (out->view != std::vector<int64_t>{sorted_indices->view[0] / topk, permuted_tokens->view[1]})
        return invalid(op, "out must be (" + std::to_string(sorted_indices->view[0] / topk) + ", " +
                               std::to_string(permuted_tokens->view[1]) + "), got " + shape(*out));
    return aten_executor(op, [p = hold(permuted_tokens), s = hold(sorted_indices), pr = hold(probs), topk,
                              o = hold(out)] {
        at::Tensor row = view(s).to(at::kLong), result = view(o);
        at::Tensor gathered = gather_rows(in_fp32(view(p)), row).reshape({result.size(0), topk, result.size(1)});
        if (pr) gathered = gathered * in_fp32(view(pr)).unsqueeze(-1);
        result.copy_(gathered.sum(1));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMoeTokenUnpermute)

// permutedTokensGradOut[sortedIndices[i]] = (unpermutedTokensGrad[t] * probs[t, k]) for slot i = t * topK + k
// (without probs, unpermutedTokensGrad[i]); rows no slot points at are 0. probsGradOut[t, k] = the dot
// product of unpermutedTokensGrad[t] and permutedTokens[sortedIndices[i]]. permuteTokens is read only for
// probsGradOut: torch_npu 2.14.0 passes null without probs when CANN is 9.1.0 or newer
// (MoeTokenUnpermuteKernelNpuOpApi.cpp), so null is accepted then.
CANN_API aclnnStatus aclnnMoeTokenUnpermuteGradGetWorkspaceSize(
    const aclTensor* permute_tokens, const aclTensor* unpermuted_tokens_grad, const aclTensor* sorted_indices,
    const aclTensor* probs, bool padded_mode, const aclIntArray* restore_shape, aclTensor* permuted_tokens_grad_out,
    aclTensor* probs_grad_out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnMoeTokenUnpermuteGrad";
    (void)restore_shape;
    if (int rc = check_args(op, {{"permuteTokens", permute_tokens, probs == nullptr},
                                 {"unpermutedTokensGrad", unpermuted_tokens_grad}, {"sortedIndices", sorted_indices},
                                 {"probsOptional", probs, true}, {"permutedTokensGradOut", permuted_tokens_grad_out},
                                 {"probsGradOut", probs_grad_out, probs == nullptr}}))
        return rc;
    if (padded_mode) return invalid(op, "paddedMode only supports false");
    const aclTensor& grad = *unpermuted_tokens_grad;
    if (permuted_tokens_grad_out->dtype != grad.dtype || (permute_tokens && permute_tokens->dtype != grad.dtype))
        return invalid(op, "permuteTokens, unpermutedTokensGrad and permutedTokensGradOut must share one dtype");
    if (grad.view.size() != 2 || sorted_indices->view.size() != 1 || permuted_tokens_grad_out->view.size() != 2 ||
        (permute_tokens && permute_tokens->view != permuted_tokens_grad_out->view) ||
        permuted_tokens_grad_out->view[1] != grad.view[1])
        return invalid(op, "unpermutedTokensGrad " + shape(grad) + ", sortedIndices " + shape(*sorted_indices) +
                               " and permutedTokensGradOut " + shape(*permuted_tokens_grad_out) +
                               " must be (tokens, h), (tokens * topK,) and (rows, h), permuteTokens as the last");
    int64_t topk = 1;
    if (probs) {
        if (probs->view.size() != 2 || probs->view[0] != grad.view[0] || probs_grad_out->view != probs->view ||
            probs_grad_out->dtype != probs->dtype)
            return invalid(op, "probsOptional " + shape(*probs) + " must be (tokens, topK) with tokens = " +
                                   std::to_string(grad.view[0]) + ", probsGradOut its shape and dtype");
        topk = probs->view[1];
    }
    if (topk < 1 || topk > kMaxTopK) return invalid(op, "topK must be in [1, 512], got " + std::to_string(topk));
    if (sorted_indices->view[0] != grad.view[0] * topk)
        return invalid(op, "sortedIndices " + shape(*sorted_indices) + " needs tokens * topK = " +
                               std::to_string(grad.view[0] * topk) + " entries");
    return aten_executor(op, [p = hold(permute_tokens), g = hold(unpermuted_tokens_grad), s = hold(sorted_indices),
                              pr = hold(probs), pg = hold(permuted_tokens_grad_out), prg = hold(probs_grad_out), topk] {
        at::Tensor grad_t = in_fp32(view(g)), row = view(s).to(at::kLong), result = view(pg);
        int64_t rows = result.size(0), h = result.size(1);
        at::Tensor slot_grad = grad_t.unsqueeze(1).expand({grad_t.size(0), topk, h});  // (tokens, topK, h)
        if (pr) slot_grad = slot_grad * in_fp32(view(pr)).unsqueeze(-1);
        slot_grad = slot_grad.reshape({-1, h});
        at::Tensor kept = row.lt(rows);
        at::Tensor grad_rows = at::zeros({rows, h}, grad_t.options());
        grad_rows.index_copy_(0, row.masked_select(kept), slot_grad.index_select(0, kept.nonzero().view(-1)));
        result.copy_(grad_rows);
        if (pr) {
            at::Tensor gathered = gather_rows(in_fp32(view(p)), row);
            at::Tensor dots = (gathered.reshape({grad_t.size(0), topk, h}) * grad_t.unsqueeze(1)).sum(-1);
            view(prg).copy_(dots);
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMoeTokenUnpermuteGrad)
