// Elementwise, comparison, reduction, indexing and creation operators computed by ATen's CPU kernels on
// the host buffers (aten_support.h). Each GetWorkspaceSize has the signature of CANN's header for that
// operator (hicann/ops-math, ops-nn: <op>/op_api/aclnn_*.h or the operator's docs/aclnn*.md), checks
// its tensors against op_table.json and returns an executor; the body runs the ATen out= form into the
// output's own memory (an output of the wrong shape fails: its storage cannot be resized).
#include "aten_support.h"

#include <cstdint>

using namespace cann_emu;

// ---- families sharing one signature ------------------------------------------------------------------
// out = fn(self): (const aclTensor* self, aclTensor* out, ...); arg is the input's name in CANN's document.
#define CANN_EMU_UNARY_ARG(name, arg, fn)                                                                   \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* ws,        \
                                                aclOpExecutor** ex) {                                   \
        if (int rc = check_args(#name, {{arg, self}, {"out", out}})) return rc;                          \
        return aten_executor(#name, [s = hold(self), o = hold(out)] { at::Tensor r = view(o); fn(r, view(s)); }, \
                             ws, ex);                                                                     \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
#define CANN_EMU_UNARY(name, fn) CANN_EMU_UNARY_ARG(name, "self", fn)
// out = fn(self, other) on tensors: (const aclTensor* self, const aclTensor* other, aclTensor* out, ...)
#define CANN_EMU_BINARY(name, fn)                                                                         \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclTensor* other, aclTensor* out, \
                                                uint64_t* ws, aclOpExecutor** ex) {                     \
        if (int rc = check_args(#name, {{"self", self}, {"other", other}, {"out", out}})) return rc;     \
        if (!broadcastable_to(*self, *out) || !broadcastable_to(*other, *out))                           \
            return invalid(#name, "self and other do not broadcast to out's shape");                     \
        return aten_executor(#name, [s = hold(self), t = hold(other), o = hold(out)] {                   \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(s), view(t));                                                                     \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
// out = fn(self, scalar other): (const aclTensor* self, const aclScalar* other, aclTensor* out, ...)
#define CANN_EMU_TENSOR_SCALAR(name, fn)                                                                  \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclScalar* other, aclTensor* out, \
                                                uint64_t* ws, aclOpExecutor** ex) {                     \
        if (int rc = check_present(#name, "other", other)) return rc;                                   \
        if (int rc = check_args(#name, {{"self", self}, {"out", out}})) return rc;                       \
        return aten_executor(#name, [s = hold(self), v = host_scalar(*other), o = hold(out)] {           \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(s), v);                                                                           \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
// selfRef = fn(selfRef, other): (aclTensor* selfRef, const aclTensor* other, ...)
#define CANN_EMU_INPLACE_BINARY(name, fn)                                                                 \
    CANN_API aclnnStatus name##GetWorkspaceSize(aclTensor* self, const aclTensor* other, uint64_t* ws,      \
                                                aclOpExecutor** ex) {                                   \
        if (int rc = check_args(#name, {{"selfRef", self}, {"other", other}})) return rc;                \
        if (!broadcastable_to(*other, *self)) return invalid(#name, "other does not broadcast to selfRef's shape"); \
        return aten_executor(#name, [s = hold(self), t = hold(other)] {                                  \
            at::Tensor r = view(s);                                                                      \
            fn(r, r, view(t));                                                                           \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
// selfRef = fn(selfRef, scalar other): (aclTensor* selfRef, const aclScalar* other, ...)
#define CANN_EMU_INPLACE_SCALAR(name, fn)                                                                 \
    CANN_API aclnnStatus name##GetWorkspaceSize(aclTensor* self, const aclScalar* other, uint64_t* ws,      \
                                                aclOpExecutor** ex) {                                   \
        if (int rc = check_present(#name, "other", other)) return rc;                                   \
        if (int rc = check_args(#name, {{"selfRef", self}})) return rc;                                  \
        return aten_executor(#name, [s = hold(self), v = host_scalar(*other)] {                          \
            at::Tensor r = view(s);                                                                      \
            fn(r, r, v);                                                                                 \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)

// hicann/ops-math math/<op>/docs and ops-nn activation/<op>/docs.
CANN_EMU_UNARY(aclnnLog, at::log_out)
CANN_EMU_UNARY(aclnnExp, at::exp_out)
CANN_EMU_UNARY(aclnnReciprocal, at::reciprocal_out)
CANN_EMU_UNARY(aclnnNeg, at::neg_out)
CANN_EMU_UNARY(aclnnSqrt, at::sqrt_out)
CANN_EMU_UNARY(aclnnRsqrt, at::rsqrt_out)
CANN_EMU_UNARY(aclnnAbs, at::abs_out)
CANN_EMU_UNARY(aclnnSilu, at::silu_out)
CANN_EMU_UNARY(aclnnSigmoid, at::sigmoid_out)
CANN_EMU_UNARY(aclnnTanh, at::tanh_out)
CANN_EMU_UNARY(aclnnBitwiseNot, at::bitwise_not_out)  // torch's ~ on bool and integer tensors
// ops-math math/complex: out = input * cos(angle) + j * input * sin(angle) (torch.polar; llama3's RoPE cache
// when the rotary patch is off)
CANN_API aclnnStatus aclnnPolarGetWorkspaceSize(const aclTensor* input, const aclTensor* angle, aclTensor* out,
                                                uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnPolar";
    if (int rc = check_args(op, {{"input", input}, {"angle", angle}, {"out", out}})) return rc;
    return aten_executor(op, [i = hold(input), a = hold(angle), o = hold(out)] {
        at::Tensor r = view(o);
        at::polar_out(r, view(i), view(a));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnPolar)
// aclnn_complex.h: out = real + j * imag, broadcast (torch_npu's copy_ into a complex tensor uses it)
CANN_API aclnnStatus aclnnComplexGetWorkspaceSize(const aclTensor* real, const aclTensor* imag, aclTensor* out,
                                                  uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnComplex";
    if (int rc = check_args(op, {{"real", real}, {"imag", imag}, {"out", out}})) return rc;
    if (real->dtype != imag->dtype) return invalid(op, "imag's dtype must be real's");
    return aten_executor(op, [re = hold(real), im = hold(imag), o = hold(out)] {
        view(o).copy_(at::complex(view(re), view(im)));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnComplex)
// ops-math math/lerp (aclnnLerps&aclnnInplaceLerps): selfRef += weight * (end - selfRef), weight a host scalar
// (torch's single-tensor AdamW moments: exp_avg.lerp_(grad, 1 - beta1)).
CANN_API aclnnStatus aclnnInplaceLerpsGetWorkspaceSize(aclTensor* self, const aclTensor* end, const aclScalar* weight,
                                                       uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnInplaceLerps";
    if (int rc = check_args(op, {{"selfRef", self}, {"end", end}})) return rc;
    if (int rc = check_present(op, "weight", weight)) return rc;
    return aten_executor(op, [s = hold(self), e = hold(end), w = host_scalar(*weight)] {
        view(s).lerp_(view(e), w);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceLerps)
// ops-math conversion/split_v (aclnnSplitWithSize): self cut along dim into splitSize's lengths, into out
// (torch.split_with_sizes_copy; torchtitan's pipeline stages and MoE split with it).
CANN_API aclnnStatus aclnnSplitWithSizeGetWorkspaceSize(const aclTensor* self, const aclIntArray* splitSize, int64_t dim,
                                                        aclTensorList* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSplitWithSize";
    if (int rc = check_args(op, {{"self", self}})) return rc;
    if (int rc = check_list(op, "out", out)) return rc;
    if (int rc = check_present(op, "splitSize", splitSize)) return rc;
    int64_t rank = static_cast<int64_t>(self->view.size());
    int64_t axis = dim < 0 ? dim + rank : dim;
    if (axis < 0 || axis >= rank) return invalid(op, "dim " + std::to_string(dim) + " is outside self's dimensions");
    int64_t total = 0;
    for (int64_t n : splitSize->v) total += n;
    if (total != self->view[axis] || splitSize->v.size() != out->v.size())
        return invalid(op, "splitSize must sum to self's size along dim and name one length per out tensor");
    return aten_executor(op, [s = hold(self), sizes = hold(splitSize), axis, o = hold(out)] {
        auto parts = view(s).split_with_sizes(sizes, axis);
        for (size_t i = 0; i < parts.size(); ++i) host_view(o[i]).copy_(parts[i]);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSplitWithSize)
// ops-cv image/upsample_bilinear2d (aclnnUpsampleBilinear2d): NCHW resized to outputSize (qwen3_5's vision
// position embeddings); a scale of 0 means none given (torch_npu passes 0 for an absent one).
CANN_API aclnnStatus aclnnUpsampleBilinear2dGetWorkspaceSize(const aclTensor* self, const aclIntArray* outputSize,
                                                             bool alignCorners, double scalesH, double scalesW,
                                                             aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnUpsampleBilinear2d";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    if (int rc = check_present(op, "outputSize", outputSize)) return rc;
    if (self->view.size() != 4 || outputSize->v.size() != 2)
        return invalid(op, "self must be 4-D (NCHW) and outputSize two lengths");
    auto scale = [](double s) { return s > 0 ? std::optional<double>(s) : std::nullopt; };
    return aten_executor(op, [s = hold(self), size = hold(outputSize), alignCorners, h = scale(scalesH),
                              w = scale(scalesW), o = hold(out)] {
        at::Tensor r = view(o);
        at::upsample_bilinear2d_out(r, view(s), size, alignCorners, h, w);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnUpsampleBilinear2d)
// ops-cv image/upsample_bilinear2d_grad (aclnnUpsampleBilinear2dBackwardV2): out, shaped inputSize (NCHW), is the
// gradient of aclnnUpsampleBilinear2d for gradOut (N, C, outputSize); a scale <= 0 means none given.
CANN_API aclnnStatus aclnnUpsampleBilinear2dBackwardV2GetWorkspaceSize(
    const aclTensor* gradOut, const aclIntArray* outputSize, const aclIntArray* inputSize, bool alignCorners,
    double scalesH, double scalesW, aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnUpsampleBilinear2dBackwardV2";
    if (int rc = check_args(op, {{"gradOut", gradOut}, {"out", out}})) return rc;
    if (int rc = check_present(op, "outputSize", outputSize)) return rc;
    if (int rc = check_present(op, "inputSize", inputSize)) return rc;
    if (gradOut->dtype != out->dtype) return invalid(op, "out must have gradOut's dtype");
    if (gradOut->view.size() != 4 || out->view.size() != 4) return invalid(op, "gradOut and out must be 4-D (NCHW)");
    if (outputSize->v.size() != 2 || inputSize->v.size() != 4)
        return invalid(op, "outputSize must hold 2 lengths (H, W) and inputSize 4 (N, C, H, W)");
    for (int64_t n : outputSize->v)
        if (n < 1) return invalid(op, "every element of outputSize must be at least 1");
    for (int64_t n : inputSize->v)
        if (n < 1) return invalid(op, "every element of inputSize must be at least 1");
    const std::vector<int64_t>& g = gradOut->view;
    if (g[0] != inputSize->v[0] || g[1] != inputSize->v[1] || out->view[0] != g[0] || out->view[1] != g[1])
        return invalid(op, "gradOut, inputSize and out must agree in N and C");
    if (g[2] != outputSize->v[0] || g[3] != outputSize->v[1])
        return invalid(op, "gradOut's H and W must be outputSize's");
    auto scale = [](double s) { return s > 0 ? std::optional<double>(s) : std::nullopt; };
    return aten_executor(op, [grad = hold(gradOut), output_size = hold(outputSize), input_size = hold(inputSize),
                              alignCorners, h = scale(scalesH), w = scale(scalesW), o = hold(out)] {
        at::Tensor r = view(o);
        at::upsample_bilinear2d_backward_out(r, view(grad), output_size, input_size, alignCorners, h, w);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnUpsampleBilinear2dBackwardV2)
// ops-cv image/grid_sample (aclnnGridSampler2D): out[n, c, h, w] = input[n, c] sampled at grid[n, h, w] (x, y in
// [-1, 1]); interpolationMode 0 bilinear, 1 nearest, 2 bicubic; paddingMode 0 zeros, 1 border, 2 reflection
// (torch's grid_sample encoding; muse_glimmer's vision encoder).
static aclnnStatus grid_sampler_modes(const char* op, int64_t interpolation, int64_t padding) {
    if (interpolation < 0 || interpolation > 2 || padding < 0 || padding > 2)
        return invalid(op, "interpolationMode must be 0, 1 or 2 and paddingMode 0, 1 or 2, not " +
                               std::to_string(interpolation) + " and " + std::to_string(padding));
    return 0;
}
CANN_API aclnnStatus aclnnGridSampler2DGetWorkspaceSize(const aclTensor* input, const aclTensor* grid,
                                                        int64_t interpolation, int64_t padding, bool align_corners,
                                                        aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnGridSampler2D";
    if (int rc = check_args(op, {{"input", input}, {"grid", grid}, {"out", out}})) return rc;
    if (int rc = grid_sampler_modes(op, interpolation, padding)) return rc;
    if (input->view.size() != 4 || grid->view.size() != 4 || grid->view[3] != 2)
        return invalid(op, "input must be (N, C, H, W) and grid (N, Hout, Wout, 2)");
    return aten_executor(op, [i = hold(input), g = hold(grid), interpolation, padding, align_corners, o = hold(out)] {
        view(o).copy_(at::grid_sampler_2d(view(i), view(g), interpolation, padding, align_corners));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnGridSampler2D)
// ops-cv image/grid_sampler2_d_grad (aclnnGridSampler2DBackward): the gradients of input and grid; outputMask
// (inputGrad, gridGrad) says which are wanted.
CANN_API aclnnStatus aclnnGridSampler2DBackwardGetWorkspaceSize(const aclTensor* grad_output, const aclTensor* input,
                                                                const aclTensor* grid, int64_t interpolation,
                                                                int64_t padding, bool align_corners,
                                                                const aclBoolArray* output_mask, aclTensor* input_grad,
                                                                aclTensor* grid_grad, uint64_t* ws,
                                                                aclOpExecutor** ex) {
    const char* op = "aclnnGridSampler2DBackward";
    if (int rc = check_present(op, "outputMask", output_mask)) return rc;
    if (int rc = check_args(op, {{"gradOutput", grad_output}, {"input", input}, {"grid", grid},
                                 {"inputGrad", input_grad, true}, {"gridGrad", grid_grad, true}}))
        return rc;
    if (int rc = grid_sampler_modes(op, interpolation, padding)) return rc;
    if (output_mask->v.size() != 2)
        return invalid(op, "outputMask must have 2 entries (inputGrad, gridGrad), not " +
                               std::to_string(output_mask->v.size()));
    if ((output_mask->v[0] && !input_grad) || (output_mask->v[1] && !grid_grad))
        return invalid(op, "an output outputMask asks for is null");
    return aten_executor(op, [go = hold(grad_output), i = hold(input), g = hold(grid), interpolation, padding,
                              align_corners, mask = output_mask->v, gi = hold(input_grad), gg = hold(grid_grad)] {
        auto [d_input, d_grid] = at::grid_sampler_2d_backward(view(go), view(i), view(g), interpolation, padding,
                                                              align_corners, {bool(mask[0]), bool(mask[1])});
        if (mask[0]) view(gi).copy_(d_input);
        if (mask[1]) view(gg).copy_(d_grid);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnGridSampler2DBackward)
// ops-math math/bitwise_and (aclnnInplaceBitwiseAndTensor): selfRef &= other, broadcast (mask combination)
CANN_API aclnnStatus aclnnInplaceBitwiseAndTensorGetWorkspaceSize(aclTensor* self, const aclTensor* other, uint64_t* ws,
                                                                  aclOpExecutor** ex) {
    const char* op = "aclnnInplaceBitwiseAndTensor";
    if (int rc = check_args(op, {{"selfRef", self}, {"other", other}})) return rc;
    return aten_executor(op, [s = hold(self), o = hold(other)] { view(s).bitwise_and_(view(o)); }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceBitwiseAndTensor)

CANN_EMU_BINARY(aclnnMul, at::mul_out)
CANN_EMU_BINARY(aclnnDiv, at::div_out)
CANN_EMU_BINARY(aclnnEqTensor, at::eq_out)
CANN_EMU_BINARY(aclnnNeTensor, at::ne_out)
CANN_EMU_BINARY(aclnnGtTensor, at::gt_out)
CANN_EMU_BINARY(aclnnGeTensor, at::ge_out)
CANN_EMU_BINARY(aclnnLtTensor, at::lt_out)
CANN_EMU_BINARY(aclnnLeTensor, at::le_out)
CANN_EMU_BINARY(aclnnBitwiseAndTensor, at::bitwise_and_out)
CANN_EMU_BINARY(aclnnBitwiseOrTensor, at::bitwise_or_out)
CANN_EMU_BINARY(aclnnLogicalAnd, at::logical_and_out)
CANN_EMU_BINARY(aclnnMaximum, at::maximum_out)
CANN_EMU_BINARY(aclnnMinimum, at::minimum_out)

CANN_EMU_TENSOR_SCALAR(aclnnMuls, at::mul_out)
CANN_EMU_TENSOR_SCALAR(aclnnDivs, at::div_out)
CANN_EMU_TENSOR_SCALAR(aclnnEqScalar, at::eq_out)
CANN_EMU_TENSOR_SCALAR(aclnnNeScalar, at::ne_out)
CANN_EMU_TENSOR_SCALAR(aclnnGtScalar, at::gt_out)
CANN_EMU_TENSOR_SCALAR(aclnnGeScalar, at::ge_out)
CANN_EMU_TENSOR_SCALAR(aclnnLtScalar, at::lt_out)
CANN_EMU_TENSOR_SCALAR(aclnnLeScalar, at::le_out)
CANN_EMU_TENSOR_SCALAR(aclnnPowTensorScalar, at::pow_out)
CANN_EMU_TENSOR_SCALAR(aclnnBitwiseAndScalar, at::bitwise_and_out)
CANN_EMU_TENSOR_SCALAR(aclnnBitwiseOrScalar, at::bitwise_or_out)
CANN_EMU_TENSOR_SCALAR(aclnnClampMin, at::clamp_min_out)
CANN_EMU_TENSOR_SCALAR(aclnnClampMax, at::clamp_max_out)

CANN_EMU_INPLACE_BINARY(aclnnInplaceMul, at::mul_out)
CANN_EMU_INPLACE_BINARY(aclnnInplaceDiv, at::div_out)
// ops-math math/logical_and: selfRef = selfRef && other, each cast to BOOL and the result back to selfRef's dtype
CANN_EMU_INPLACE_BINARY(aclnnInplaceLogicalAnd, at::logical_and_out)
CANN_EMU_INPLACE_SCALAR(aclnnInplaceMuls, at::mul_out)
// ops-math math/bitwise_xor (aclnnInplaceBitwiseXorScalar): selfRef ^= other, integers and BOOL (inject_faults'
// bitflip_param flips one bit of a float parameter through its integer view)
CANN_EMU_INPLACE_SCALAR(aclnnInplaceBitwiseXorScalar, at::bitwise_xor_out)
CANN_EMU_INPLACE_SCALAR(aclnnInplaceDivs, at::div_out)

// ---- with alpha (hicann/ops-math math/sub, math/add: aclnnSub, aclnnSubs, aclnnAdds, their in-place forms,
// aclnnRsub and aclnnRsubs) ----
// out = self + sign * alpha * other, other a tensor or a scalar; reversed (Rsub): out = other + sign * alpha * self.
static aclnnStatus alpha_prepare(const char* op, const aclTensor* self, const aclTensor* other,
                                 const aclScalar* other_scalar, const aclScalar* alpha, const aclTensor* out,
                                 double sign, uint64_t* ws, aclOpExecutor** ex, bool reversed = false) {
    bool inplace = self == out;
    if (int rc = check_present(op, "alpha", alpha)) return rc;
    if (int rc = check_args(op, {{inplace ? "selfRef" : "self", self}})) return rc;
    if (!inplace)
        if (int rc = check_args(op, {{"out", out}})) return rc;
    if (other) {
        if (int rc = check_args(op, {{"other", other}})) return rc;
        if (!broadcastable_to(*self, *out) || !broadcastable_to(*other, *out))
            return invalid(op, "self and other do not broadcast to out's shape");
    } else if (int rc = check_present(op, "other", other_scalar)) {
        return rc;
    }
    at::Scalar a = host_scalar(*alpha);
    a = a.isIntegral(true) ? at::Scalar(a.toLong() * (int64_t)sign) : at::Scalar(a.toDouble() * sign);
    std::optional<at::Scalar> s_other = hold(other_scalar);
    return aten_executor(op, [s = hold(self), t = hold(other), s_other, a, o = hold(out), reversed] {
        at::Tensor r = view(o);
        at::Tensor other_tensor = t ? view(t) : at::scalar_to_tensor(*s_other);
        if (reversed)
            at::add_out(r, other_tensor, view(s), a);
        else
            at::add_out(r, view(s), other_tensor, a);
    }, ws, ex);
}
CANN_API aclnnStatus aclnnSubGetWorkspaceSize(const aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                                              aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnSub", self, other, nullptr, alpha, out, -1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSub)
CANN_API aclnnStatus aclnnInplaceSubGetWorkspaceSize(aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                                                     uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnInplaceSub", self, other, nullptr, alpha, self, -1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceSub)
CANN_API aclnnStatus aclnnSubsGetWorkspaceSize(const aclTensor* self, const aclScalar* other, const aclScalar* alpha,
                                               aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnSubs", self, nullptr, other, alpha, out, -1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSubs)
CANN_API aclnnStatus aclnnInplaceSubsGetWorkspaceSize(aclTensor* self, const aclScalar* other, const aclScalar* alpha,
                                                      uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnInplaceSubs", self, nullptr, other, alpha, self, -1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceSubs)
CANN_API aclnnStatus aclnnAddsGetWorkspaceSize(const aclTensor* self, const aclScalar* other, const aclScalar* alpha,
                                               aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnAdds", self, nullptr, other, alpha, out, 1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnAdds)
CANN_API aclnnStatus aclnnInplaceAddsGetWorkspaceSize(aclTensor* self, const aclScalar* other, const aclScalar* alpha,
                                                      uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnInplaceAdds", self, nullptr, other, alpha, self, 1.0, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceAdds)
CANN_API aclnnStatus aclnnRsubGetWorkspaceSize(const aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                                               aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnRsub", self, other, nullptr, alpha, out, -1.0, ws, ex, /*reversed=*/true);
}
CANN_EMU_LAUNCH(aclnnRsub)
CANN_API aclnnStatus aclnnRsubsGetWorkspaceSize(const aclTensor* self, const aclScalar* other, const aclScalar* alpha,
                                                aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return alpha_prepare("aclnnRsubs", self, nullptr, other, alpha, out, -1.0, ws, ex, /*reversed=*/true);
}
CANN_EMU_LAUNCH(aclnnRsubs)

// aclnnClamp (ops-math math/clamp): either bound may be null.
CANN_API aclnnStatus aclnnClampGetWorkspaceSize(const aclTensor* self, const aclScalar* min, const aclScalar* max,
                                                aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnClamp";
    if (!min && !max) return invalid(op, "clipValueMin and clipValueMax are both null");
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), lo = hold(min), hi = hold(max), o = hold(out)] {
        at::Tensor r = view(o);
        at::clamp_out(r, view(s), lo, hi);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnClamp)

// aclnnSWhere (ops-math math/s_where): out = condition ? self : other.
CANN_API aclnnStatus aclnnSWhereGetWorkspaceSize(const aclTensor* condition, const aclTensor* self,
                                                 const aclTensor* other, aclTensor* out, uint64_t* ws,
                                                 aclOpExecutor** ex) {
    const char* op = "aclnnSWhere";
    if (int rc = check_args(op, {{"condition", condition}, {"self", self}, {"other", other}, {"out", out}})) return rc;
    return aten_executor(op, [c = hold(condition), s = hold(self), t = hold(other), o = hold(out)] {
        at::Tensor r = view(o);
        at::where_out(r, view(c), view(s), view(t));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSWhere)

// aclnnCast (ops-math math/cast): out = self converted to dtype (out's dtype must be dtype).
CANN_API aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor* self, int dtype, aclTensor* out, uint64_t* ws,
                                               aclOpExecutor** ex) {
    const char* op = "aclnnCast";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    if (out->dtype != dtype) return invalid(op, std::string("out's dtype is not ") + dtype_name(dtype));
    return aten_executor(op, [s = hold(self), o = hold(out)] { view(o).copy_(view(s)); }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnCast)

// ---- reductions (ops-math math/reduce_sum, mean, reduce_all/any, linalg_vector_norm; ops-nn) ----
static at::OptionalIntArrayRef dims_or_all(const std::vector<int64_t>& dims) {
    return dims.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(dims);
}
CANN_API aclnnStatus aclnnReduceSumGetWorkspaceSize(const aclTensor* self, const aclIntArray* dims, bool keep_dims,
                                                    int dtype, aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnReduceSum";
    if (int rc = check_present(op, "dims", dims)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), d = hold(dims), keep_dims, type = scalar_type(dtype), o = hold(out)] {
        at::Tensor r = view(o);
        at::sum_out(r, view(s), dims_or_all(d), keep_dims, type);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnReduceSum)
CANN_API aclnnStatus aclnnMeanGetWorkspaceSize(const aclTensor* self, const aclIntArray* dims, bool keep_dims,
                                               int dtype, aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnMean";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), d = hold(dims), keep_dims, type = scalar_type(dtype), o = hold(out)] {
        at::Tensor r = view(o);
        at::mean_out(r, view(s), dims_or_all(d), keep_dims, type);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMean)
#define CANN_EMU_DIMS_REDUCE(name, fn)                                                                    \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclIntArray* dims, bool keep_dims, \
                                                aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {     \
        if (int rc = check_args(#name, {{"self", self}, {"out", out}})) return rc;                       \
        return aten_executor(#name, [s = hold(self), d = hold(dims), keep_dims, o = hold(out)] {          \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(s), dims_or_all(d), keep_dims);                                                   \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
// amax/amin take every dimension for an empty list.
static void amax_out(at::Tensor& r, const at::Tensor& s, at::OptionalIntArrayRef d, bool keep) {
    at::amax_out(r, s, d.has_value() ? *d : at::IntArrayRef{}, keep);
}
static void amin_out(at::Tensor& r, const at::Tensor& s, at::OptionalIntArrayRef d, bool keep) {
    at::amin_out(r, s, d.has_value() ? *d : at::IntArrayRef{}, keep);
}
CANN_EMU_DIMS_REDUCE(aclnnAll, at::all_out)
CANN_EMU_DIMS_REDUCE(aclnnAny, at::any_out)
CANN_EMU_DIMS_REDUCE(aclnnAmax, amax_out)
CANN_EMU_DIMS_REDUCE(aclnnAmin, amin_out)

CANN_API aclnnStatus aclnnLinalgVectorNormGetWorkspaceSize(const aclTensor* self, const aclScalar* ord,
                                                           const aclIntArray* dims, bool keep_dims, int dtype,
                                                           aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnLinalgVectorNorm";
    if (int rc = check_present(op, "ord", ord)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), p = host_scalar(*ord), d = hold(dims), keep_dims,
                              type = scalar_type(dtype), o = hold(out)] {
        at::Tensor r = view(o);
        at::linalg_vector_norm_out(r, view(s), p, dims_or_all(d), keep_dims, type);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnLinalgVectorNorm)
CANN_API aclnnStatus aclnnNormGetWorkspaceSize(const aclTensor* self, const aclScalar* p, const aclIntArray* dims,
                                               bool keep_dims, aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnNorm";
    if (int rc = check_present(op, "pScalar", p)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), pv = host_scalar(*p), d = hold(dims), keep_dims, o = hold(out)] {
        at::Tensor r = view(o);
        at::linalg_vector_norm_out(r, view(s), pv, dims_or_all(d), keep_dims, r.scalar_type());
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNorm)

// aclnnCumsum (ops-math math/cumsum): along dim, accumulated in dtype.
CANN_API aclnnStatus aclnnCumsumGetWorkspaceSize(const aclTensor* self, int64_t dim, int dtype, aclTensor* out,
                                                 uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnCumsum";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, type = scalar_type(dtype), o = hold(out)] {
        at::Tensor r = view(o);
        at::cumsum_out(r, view(s), dim, type);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnCumsum)

// aclnnIsFinite (ops-math math/is_finite/docs/aclnnIsFinite.md): out = isfinite(self), BOOL, with self's shape;
// op_api fills true for a type that is not floating.
CANN_API aclnnStatus aclnnIsFiniteGetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* ws,
                                                   aclOpExecutor** ex) {
    const char* op = "aclnnIsFinite";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    if (self->view != out->view) return invalid(op, "out must have self's shape");
    return aten_executor(op, [s = hold(self), o = hold(out)] { view(o).copy_(at::isfinite(view(s))); }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnIsFinite)

// ---- linear algebra ------------------------------------------------------------------------------------------
// aclnnTriangularSolve (ops-math math/triangular_solve/docs/aclnnTriangularSolve.md): xOut solves A X = self
// (A^T X = self with transpose), A upper triangular or lower with upper false, its diagonal taken as ones with
// unitriangular; mOut is A broadcast to the batch (copied before the diagonal is replaced, as op_api's
// aclnn_triangular_solve.cpp does). The batch dimensions of self and A broadcast. torch_npu's
// linalg_solve_triangular and triangular_solve call it. CANN runs it on AI CPU (MatrixTriangularSolve).
static bool batch_broadcast(const std::vector<int64_t>& a, const std::vector<int64_t>& b, std::vector<int64_t>& out) {
    size_t n = std::max(a.size(), b.size());
    out.assign(n, 1);
    for (size_t i = 0; i < n; ++i) {
        int64_t x = i < a.size() ? a[a.size() - 1 - i] : 1, y = i < b.size() ? b[b.size() - 1 - i] : 1;
        if (x != y && x != 1 && y != 1) return false;
        out[n - 1 - i] = x == 1 ? y : x;
    }
    return true;
}
static std::string shape_text(const std::vector<int64_t>& shape) {
    std::string text = "(";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + (shape.size() == 1 ? ",)" : ")");
}
CANN_API aclnnStatus aclnnTriangularSolveGetWorkspaceSize(const aclTensor* self, const aclTensor* A, bool upper,
                                                          bool transpose, bool unitriangular, aclTensor* x_out,
                                                          aclTensor* m_out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnTriangularSolve";
    const std::pair<const char*, const aclTensor*> tensors[] = {{"self", self}, {"A", A}, {"xOut", x_out},
                                                                {"mOut", m_out}};
    for (auto [name, t] : tensors)
        if (int rc = check_present(op, name, t)) return rc;  // the document: 161001 before any dtype check
    if (int rc = check_args(op, {{"self", self}, {"A", A}, {"xOut", x_out}, {"mOut", m_out}})) return rc;
    for (auto [name, t] : tensors)
        if (t->dtype != self->dtype)
            return invalid(op, std::string(name) + " must have self's dtype " + dtype_name(self->dtype) + ", not " +
                                   dtype_name(t->dtype));
    if (unitriangular && self->dtype != ACL_FLOAT)
        return invalid(op, std::string("with unitriangular, self, A, xOut and mOut must be FLOAT, not ") +
                               dtype_name(self->dtype));
    for (auto [name, t] : tensors)
        if (t->view.size() < 2)
            return invalid(op, std::string(name) + " must have 2 to 8 dimensions, not " + std::to_string(t->view.size()));
    const std::vector<int64_t>& b = self->view;
    const std::vector<int64_t>& a = A->view;
    int64_t m = a[a.size() - 1], n = b[b.size() - 1];
    if (a[a.size() - 2] != m) return invalid(op, "A must be square in its last two dimensions, not " + shape_text(a));
    if (b[b.size() - 2] != m)
        return invalid(op, "self's second-to-last dimension must be A's " + std::to_string(m) + ", self is " +
                               shape_text(b) + " and A " + shape_text(a));
    std::vector<int64_t> batch;
    if (!batch_broadcast({a.begin(), a.end() - 2}, {b.begin(), b.end() - 2}, batch))
        return invalid(op, "the batch dimensions of self " + shape_text(b) + " and A " + shape_text(a) +
                               " do not broadcast");
    std::vector<int64_t> x_shape = batch, m_shape = batch;
    x_shape.insert(x_shape.end(), {m, n});
    m_shape.insert(m_shape.end(), {m, m});
    if (x_out->view != x_shape) return invalid(op, "xOut must be " + shape_text(x_shape) + ", not " + shape_text(x_out->view));
    if (m_out->view != m_shape) return invalid(op, "mOut must be " + shape_text(m_shape) + ", not " + shape_text(m_out->view));
    return aten_executor(op, [s = hold(self), t = hold(A), upper, transpose, unitriangular, x = hold(x_out),
                              mo = hold(m_out)] {
        at::Tensor rhs = view(s), coefficients = view(t);
        if (rhs.numel() == 0 || coefficients.numel() == 0) return;  // CANN returns before any kernel
        view(mo).copy_(coefficients);  // broadcasts A over the batch
        // A^T X = b is the triangle of the other side; .mT() transposes without conjugating, as the document's A^T
        at::Tensor r = view(x);
        if (transpose)
            at::linalg_solve_triangular_out(r, coefficients.mT(), rhs, !upper, /*left=*/true, unitriangular);
        else
            at::linalg_solve_triangular_out(r, coefficients, rhs, upper, /*left=*/true, unitriangular);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnTriangularSolve)

// ---- joining, triangles, creation ----------------------------------------------------------------------
#define CANN_EMU_JOIN(name, fn)                                                                            \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensorList* tensors, int64_t dim, aclTensor* out,  \
                                                uint64_t* ws, aclOpExecutor** ex) {                     \
        if (int rc = check_list(#name, "tensors", tensors)) return rc;                                   \
        if (int rc = check_args(#name, {{"out", out}})) return rc;                                       \
        return aten_executor(#name, [l = hold(tensors), dim, o = hold(out)] {                            \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(l), dim);                                                                         \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
CANN_EMU_JOIN(aclnnCat, at::cat_out)
CANN_EMU_JOIN(aclnnStack, at::stack_out)

#define CANN_EMU_TRIANGLE(name, fn)                                                                        \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, int64_t diagonal, aclTensor* out,     \
                                                uint64_t* ws, aclOpExecutor** ex) {                     \
        if (int rc = check_args(#name, {{"self", self}, {"out", out}})) return rc;                       \
        return aten_executor(#name, [s = hold(self), diagonal, o = hold(out)] {                          \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(s), diagonal);                                                                    \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
CANN_EMU_TRIANGLE(aclnnTriu, at::triu_out)
CANN_EMU_TRIANGLE(aclnnTril, at::tril_out)

// aclnnArange (ops-math math/arange): out = start, start + step, ... < end.
CANN_API aclnnStatus aclnnArangeGetWorkspaceSize(const aclScalar* start, const aclScalar* end, const aclScalar* step,
                                                 aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnArange";
    if (int rc = check_present(op, "start", start)) return rc;
    if (int rc = check_present(op, "end", end)) return rc;
    if (int rc = check_present(op, "step", step)) return rc;
    if (int rc = check_args(op, {{"out", out}})) return rc;
    return aten_executor(op, [a = host_scalar(*start), b = host_scalar(*end), c = host_scalar(*step), o = hold(out)] {
        at::Tensor r = view(o);
        at::arange_out(r, a, b, c);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnArange)
// ops-math math/lin_space (aclnnLinspace): steps values from start to end, both included (torch.linspace).
CANN_API aclnnStatus aclnnLinspaceGetWorkspaceSize(const aclScalar* start, const aclScalar* end, int64_t steps,
                                                   aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnLinspace";
    if (int rc = check_present(op, "start", start)) return rc;
    if (int rc = check_present(op, "end", end)) return rc;
    if (int rc = check_args(op, {{"out", out}})) return rc;
    if (steps < 0) return invalid(op, "steps must be >= 0");
    int64_t elements = 1;
    for (int64_t n : out->view) elements *= n;
    if (elements != steps) return invalid(op, "out must hold steps elements");
    return aten_executor(op, [a = host_scalar(*start), b = host_scalar(*end), steps, o = hold(out)] {
        at::Tensor r = view(o);
        at::linspace_out(r, a, b, steps);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnLinspace)
// ops-math math/search_sorted (aclnnSearchSorted): for each value of self, the index at which it would be
// inserted into sortedSequence's last dim to keep it sorted (right: after equal values); sorter, when given,
// sorts sortedSequence; out INT64, or INT32 with outInt32 (torch.searchsorted; gpt_oss's MoE routing).
CANN_API aclnnStatus aclnnSearchSortedGetWorkspaceSize(const aclTensor* sorted_sequence, const aclTensor* self,
                                                       bool out_int32, bool right, const aclTensor* sorter,
                                                       aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSearchSorted";
    if (int rc = check_args(op, {{"sortedSequence", sorted_sequence}, {"self", self}, {"sorter", sorter, true},
                                 {"out", out}}))
        return rc;
    if (out->view != self->view) return invalid(op, "out's shape must be self's");
    if ((out->dtype == ACL_INT32) != out_int32) return invalid(op, "out must be INT32 with outInt32, else INT64");
    return aten_executor(op, [seq = hold(sorted_sequence), s = hold(self), out_int32, right, sorter_ = hold(sorter),
                              o = hold(out)] {
        at::Tensor r = view(o);
        std::optional<at::Tensor> order = sorter_ ? std::optional<at::Tensor>(view(sorter_)) : std::nullopt;
        at::searchsorted_out(r, view(seq), view(s), out_int32, right, std::nullopt, order);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSearchSorted)
// ops-math math/reduce_prod (aclnnProdDim): the product along dim, in dtype (out's), keepDim as torch's
// (torch.prod(x, dim); qwen3_5's vision grid sizes).
CANN_API aclnnStatus aclnnProdDimGetWorkspaceSize(const aclTensor* self, int64_t dim, bool keep_dim, int dtype,
                                                  aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnProdDim";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    if (dtype != out->dtype) return invalid(op, "dtype must be out's data type");
    int64_t rank = static_cast<int64_t>(self->view.size());
    int64_t axis = dim < 0 ? dim + std::max<int64_t>(rank, 1) : dim;
    if (axis < 0 || axis >= std::max<int64_t>(rank, 1)) return invalid(op, "dim " + std::to_string(dim) + " is out of range");
    return aten_executor(op, [s = hold(self), axis, keep_dim, o = hold(out)] {
        at::Tensor r = view(o);
        at::prod_out(r, view(s), axis, keep_dim, r.scalar_type());
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnProdDim)
// ops-math math/reduce_log_sum_exp (aclnnLogSumExp): log(sum(exp(self))) over dim (torch.logsumexp; gpt_oss's
// attention sinks).
CANN_API aclnnStatus aclnnLogSumExpGetWorkspaceSize(const aclTensor* self, const aclIntArray* dim, bool keep_dim,
                                                    aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnLogSumExp";
    if (int rc = check_present(op, "dim", dim)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), d = hold(dim), keep_dim, o = hold(out)] {
        at::Tensor r = view(o);
        at::Tensor x = view(s);
        at::logsumexp_out(r, x.is_floating_point() ? x : x.to(r.scalar_type()), d, keep_dim);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnLogSumExp)
// ops-math math/nan_to_num (aclnnNanToNum, aclnnInplaceNanToNum): NaN, +inf and -inf replaced by the given
// floats (torch.nan_to_num; gpt_oss's attention sinks). torch_npu passes the finite extremes of the dtype when
// the caller gives none.
static aclnnStatus nan_to_num_prepare(const char* op, const aclTensor* self, float nan, float posinf, float neginf,
                                      const aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    bool inplace = self == out;
    if (int rc = inplace ? check_args(op, {{"selfRef", self}}) : check_args(op, {{"self", self}, {"out", out}}))
        return rc;
    return aten_executor(op, [s = hold(self), nan, posinf, neginf, o = hold(out)] {
        at::Tensor r = view(o);
        at::nan_to_num_out(r, view(s), (double)nan, (double)posinf, (double)neginf);
    }, ws, ex);
}
CANN_API aclnnStatus aclnnNanToNumGetWorkspaceSize(const aclTensor* self, float nan, float posinf, float neginf,
                                                   aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return nan_to_num_prepare("aclnnNanToNum", self, nan, posinf, neginf, out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNanToNum)
CANN_API aclnnStatus aclnnInplaceNanToNumGetWorkspaceSize(aclTensor* self, float nan, float posinf, float neginf,
                                                          uint64_t* ws, aclOpExecutor** ex) {
    return nan_to_num_prepare("aclnnInplaceNanToNum", self, nan, posinf, neginf, self, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceNanToNum)
// ops-math (aclnnEye): out = the n x m identity (torch.eye; qwen3_5's gated delta rule).
CANN_API aclnnStatus aclnnEyeGetWorkspaceSize(int64_t n, int64_t m, aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnEye";
    if (int rc = check_args(op, {{"out", out}})) return rc;
    if (n < 0 || m < 0 || out->view != std::vector<int64_t>{n, m})
        return invalid(op, "out must be (n, m) with n and m >= 0, n " + std::to_string(n) + " m " + std::to_string(m));
    return aten_executor(op, [n, m, o = hold(out)] {
        at::Tensor r = view(o);
        at::eye_out(r, n, m);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnEye)
// ops-math (aclnnAddcmul): out = self + value * tensor1 * tensor2, broadcast (torch.addcmul; gpt_oss). The in-place
// form is CANN_EMU_INPLACE_ADDC below.
CANN_API aclnnStatus aclnnAddcmulGetWorkspaceSize(const aclTensor* self, const aclTensor* tensor1,
                                                  const aclTensor* tensor2, const aclScalar* value, aclTensor* out,
                                                  uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnAddcmul";
    if (int rc = check_present(op, "value", value)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"tensor1", tensor1}, {"tensor2", tensor2}, {"out", out}})) return rc;
    if (!broadcastable_to(*self, *out) || !broadcastable_to(*tensor1, *out) || !broadcastable_to(*tensor2, *out))
        return invalid(op, "self, tensor1 and tensor2 must broadcast to out's shape");
    return aten_executor(op, [s = hold(self), a = hold(tensor1), b = hold(tensor2), v = host_scalar(*value),
                              o = hold(out)] {
        at::Tensor r = view(o);
        at::addcmul_out(r, view(s), view(a), view(b), v);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnAddcmul)

// aclnnInplaceFillTensor (ops-math conversion/fill): selfRef[...] = value, a one-element tensor.
CANN_API aclnnStatus aclnnInplaceFillTensorGetWorkspaceSize(aclTensor* self, const aclTensor* value, uint64_t* ws,
                                                            aclOpExecutor** ex) {
    const char* op = "aclnnInplaceFillTensor";
    if (int rc = check_args(op, {{"selfRef", self}, {"value", value}})) return rc;
    return aten_executor(op, [s = hold(self), v = hold(value)] { view(s).fill_(view(v)); }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceFillTensor)

// aclnnInplaceMaskedFillScalar (ops-math): selfRef[mask] = value.
CANN_API aclnnStatus aclnnInplaceMaskedFillScalarGetWorkspaceSize(aclTensor* self, const aclTensor* mask,
                                                                  const aclScalar* value, uint64_t* ws,
                                                                  aclOpExecutor** ex) {
    const char* op = "aclnnInplaceMaskedFillScalar";
    if (int rc = check_present(op, "value", value)) return rc;
    if (int rc = check_args(op, {{"selfRef", self}, {"mask", mask}})) return rc;
    return aten_executor(op, [s = hold(self), m = hold(mask), v = host_scalar(*value)] {
        view(s).masked_fill_(view(m), v);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceMaskedFillScalar)

// ---- indexing (ops-math / ops-nn index, gather, scatter) -------------------------------------------------
CANN_API aclnnStatus aclnnGatherGetWorkspaceSize(const aclTensor* self, const int64_t dim, const aclTensor* index,
                                                 aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnGather";
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), o = hold(out)] {
        at::Tensor r = view(o);
        at::gather_out(r, view(s), dim, view(i));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnGather)

// reduce: 0 none, 1 add, 2 multiply (aclnnScatter's document).
static std::optional<c10::string_view> scatter_reduce(int64_t reduce) {
    if (reduce == 1) return c10::string_view("add");
    if (reduce == 2) return c10::string_view("multiply");
    return std::nullopt;
}
static aclnnStatus check_reduce(const char* op, int64_t reduce) {
    if (reduce < 0 || reduce > 2) return invalid(op, "reduce must be 0 (none), 1 (add) or 2 (multiply)");
    return 0;
}
// r[index] = src along dim, reduced as the operators' reduce argument says; src a tensor or a scalar.
template <class Src>
static void scatter_into(at::Tensor& r, int64_t dim, const at::Tensor& index, const Src& src, int64_t reduce) {
    if (auto how = scatter_reduce(reduce))
        r.scatter_(dim, index, src, *how);
    else
        r.scatter_(dim, index, src);
}
CANN_API aclnnStatus aclnnScatterGetWorkspaceSize(const aclTensor* self, int64_t dim, const aclTensor* index,
                                                  const aclTensor* src, int64_t reduce, aclTensor* out, uint64_t* ws,
                                                  aclOpExecutor** ex) {
    const char* op = "aclnnScatter";
    if (int rc = check_reduce(op, reduce)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"src", src}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), x = hold(src), reduce, o = hold(out)] {
        at::Tensor r = view(o);
        if (auto how = scatter_reduce(reduce))
            at::scatter_out(r, view(s), dim, view(i), view(x), *how);
        else
            at::scatter_out(r, view(s), dim, view(i), view(x));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnScatter)
CANN_API aclnnStatus aclnnInplaceScatterGetWorkspaceSize(aclTensor* self, int64_t dim, const aclTensor* index,
                                                         const aclTensor* src, int64_t reduce, uint64_t* ws,
                                                         aclOpExecutor** ex) {
    const char* op = "aclnnInplaceScatter";
    if (int rc = check_reduce(op, reduce)) return rc;
    if (int rc = check_args(op, {{"selfRef", self}, {"index", index}, {"src", src}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), x = hold(src), reduce] {
        at::Tensor r = view(s);
        scatter_into(r, dim, view(i), view(x), reduce);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceScatter)
CANN_API aclnnStatus aclnnScatterAddGetWorkspaceSize(const aclTensor* self, int64_t dim, const aclTensor* index,
                                                     const aclTensor* src, aclTensor* out, uint64_t* ws,
                                                     aclOpExecutor** ex) {
    const char* op = "aclnnScatterAdd";
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"src", src}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), x = hold(src), o = hold(out)] {
        at::Tensor r = view(o);
        at::scatter_add_out(r, view(s), dim, view(i), view(x));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnScatterAdd)
CANN_API aclnnStatus aclnnIndexSelectGetWorkspaceSize(const aclTensor* self, int64_t dim, const aclTensor* index,
                                                      aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnIndexSelect";
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), o = hold(out)] {
        at::Tensor r = view(o);
        at::index_select_out(r, view(s), dim, view(i));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnIndexSelect)

// aclnnNonzero (ops-math math/non_zero): out is (n, rank) INT64 sized for every element; CANN writes the
// count's rows and torch_npu reads the real shape back (EXEC_NPU_CMD_SYNC), so rows past the count stay.
CANN_API aclnnStatus aclnnNonzeroGetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* ws,
                                                  aclOpExecutor** ex) {
    const char* op = "aclnnNonzero";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), o = hold(out), out_desc = const_cast<aclTensor*>(out)] {
        at::Tensor found = at::nonzero(view(s));
        at::Tensor r = view(o);
        r.narrow(0, 0, found.size(0)).copy_(found);
        out_desc->view = {found.size(0), found.size(1)};  // the shape torch_npu reads back (aclGetViewShape)
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNonzero)
// aclnnNonzeroV2 (ops-nn index/non_zero/docs/aclnnNonzeroV2.md): the transposed layout, out (rank, n) with one
// column per non-zero element. torch_npu sizes out (rank, numel) as the document's constraint asks, syncs, reads
// the view shape back and resize_s out to it in place, so the (rank, count) result must be compact at out's
// start (CANN resets out's storage shape to its view before the kernel writes).
CANN_API aclnnStatus aclnnNonzeroV2GetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* ws,
                                                    aclOpExecutor** ex) {
    const char* op = "aclnnNonzeroV2";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    int64_t rank = static_cast<int64_t>(self->view.size()), elements = 1, capacity = 1;
    for (int64_t n : self->view) {
        if (n > INT32_MAX)  // the document: output indices must fit int32 on Atlas A2
            return invalid(op, "every dimension of self must be <= 2147483647, not " + std::to_string(n));
        elements *= n;
    }
    for (int64_t n : out->view) capacity *= n;
    if (elements == 0 || capacity == 0) return aten_executor(op, [] {}, ws, ex);  // CANN returns before any kernel
    if (capacity < rank * elements)
        return invalid(op, "out must be sized for every element of self being non-zero: at least rank * numel = " +
                               std::to_string(rank * elements) + " elements, not " + std::to_string(capacity));
    return aten_executor(op, [s = hold(self), o = *out, out_desc = out] {
        at::Tensor found = at::nonzero(view(s)).t();  // (rank, count)
        aclTensor compact = o;
        compact.view = {found.size(0), found.size(1)};
        compact.strides = {found.size(1), 1};
        host_view(compact).copy_(found);
        out_desc->view = compact.view;  // the shape torch_npu reads back (aclGetViewShape)
        out_desc->strides = compact.strides;
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNonzeroV2)

// aclnnChunkCat (ops-math conversion/chunk_cat): each tensor split into numChunks chunks along dim, the
// i-th chunks of all tensors concatenated (torch's _chunk_cat, which FSDP2's reduce-scatter packing uses).
CANN_API aclnnStatus aclnnChunkCatGetWorkspaceSize(const aclTensorList* tensors, int64_t dim, int64_t num_chunks,
                                                   aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnChunkCat";
    if (int rc = check_list(op, "tensors", tensors)) return rc;
    if (int rc = check_args(op, {{"out", out}})) return rc;
    if (num_chunks < 1) return invalid(op, "numChunks must be >= 1");
    return aten_executor(op, [l = hold(tensors), dim, num_chunks, o = hold(out)] {
        at::Tensor r = view(o);
        at::_chunk_cat_out(r, view(l), dim, num_chunks);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnChunkCat)

// An index list as aclnnIndex/aclnnIndexPutImpl take it (ops-nn index/index and index_put_v2 op_api): every
// entry must be a tensor (161001 for a null one); an entry with no elements is a full slice (torch's None:
// torch_npu passes an empty tensor of self's dtype there), its dtype not checked; the others are INT64,
// INT32 or BOOL.
static aclnnStatus hold_indices(const char* op, const aclTensorList* indices, std::vector<Held>& held) {
    for (size_t i = 0; i < indices->v.size(); ++i) {
        const aclTensor* t = indices->v[i];
        if (int rc = check_present(op, ("indices[" + std::to_string(i) + "]").c_str(), t)) return rc;
        int64_t elements = 1;
        for (int64_t n : t->view) elements *= n;
        if (elements == 0) {
            held.push_back(std::nullopt);
            continue;
        }
        if (int rc = check_args(op, {{"indices", t}})) return rc;
        held.push_back(hold(t));
    }
    return 0;
}
static bool any_index(const std::vector<Held>& held) {
    for (const Held& h : held)
        if (h) return true;
    return false;
}
static c10::List<std::optional<at::Tensor>> index_list(const std::vector<Held>& held) {
    c10::List<std::optional<at::Tensor>> index;
    for (const Held& h : held) index.push_back(h ? std::optional<at::Tensor>(view(h)) : std::nullopt);
    return index;
}

// aclnnIndexPutImpl (ops-nn index/index_put_v2): selfRef[indices] = values (or += with accumulate); an
// index list entry may be null (a full slice, torch's None).
CANN_API aclnnStatus aclnnIndexPutImplGetWorkspaceSize(aclTensor* self, const aclTensorList* indices,
                                                       const aclTensor* values, const bool accumulate,
                                                       const bool unsafe, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnIndexPutImpl";
    if (int rc = check_present(op, "indices", indices)) return rc;
    if (int rc = check_args(op, {{"selfRef", self}, {"values", values}})) return rc;
    std::vector<Held> held;
    if (int rc = hold_indices(op, indices, held)) return rc;
    return aten_executor(op, [s = hold(self), held, v = hold(values), accumulate] {
        at::Tensor target = view(s), update = view(v);
        if (target.numel() == 0 || update.numel() == 0) return;
        if (!any_index(held)) return void(accumulate ? target.add_(update) : target.copy_(update));  // full slices
        target.index_put_(index_list(held), update, accumulate);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnIndexPutImpl)

// ---- more elementwise and reductions MoE routing and the distributed paths reach --------------------------
CANN_EMU_UNARY(aclnnErf, at::erf_out)
CANN_EMU_UNARY(aclnnExp2, at::exp2_out)
CANN_EMU_UNARY(aclnnFloor, at::floor_out)
CANN_EMU_UNARY(aclnnGelu, at::gelu_out)
CANN_EMU_UNARY(aclnnRelu, at::relu_out)
CANN_API aclnnStatus aclnnPowTensorTensorGetWorkspaceSize(const aclTensor* self, const aclTensor* exponent,
                                                          aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnPowTensorTensor";
    if (int rc = check_args(op, {{"self", self}, {"exponent", exponent}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), e = hold(exponent), o = hold(out)] {
        at::Tensor r = view(o);
        at::pow_out(r, view(s), view(e));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnPowTensorTensor)
CANN_EMU_BINARY(aclnnFloorDivide, at::floor_divide_out)
static void max_all(at::Tensor& r, const at::Tensor& s) { r.copy_(s.max()); }
static void min_all(at::Tensor& r, const at::Tensor& s) { r.copy_(s.min()); }
CANN_EMU_UNARY(aclnnMax, max_all)
CANN_EMU_UNARY(aclnnMin, min_all)

// out = fn(gradOutput, x): the activation gradients (ops-nn activation/*_grad).
#define CANN_EMU_ACTIVATION_GRAD(name, second, fn)                                                          \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* grad, const aclTensor* x, aclTensor* out,  \
                                                uint64_t* ws, aclOpExecutor** ex) {                     \
        if (int rc = check_args(#name, {{"gradOutput", grad}, {second, x}, {"gradInput", out}})) return rc;  \
        return aten_executor(#name, [g = hold(grad), s = hold(x), o = hold(out)] {                        \
            at::Tensor r = view(o);                                                                      \
            fn(r, view(g), view(s));                                                                     \
        }, ws, ex);                                                                                      \
    }                                                                                                    \
    CANN_EMU_LAUNCH(name)
static void gelu_grad(at::Tensor& r, const at::Tensor& g, const at::Tensor& x) { at::gelu_backward_out(r, g, x); }
CANN_EMU_ACTIVATION_GRAD(aclnnGeluBackward, "self", gelu_grad)
CANN_EMU_ACTIVATION_GRAD(aclnnSigmoidBackward, "output", at::sigmoid_backward_out)
CANN_EMU_ACTIVATION_GRAD(aclnnTanhBackward, "output", at::tanh_backward_out)

// aclnnConstantPadNd (ops-math conversion/pad_v3): pad in torch's order (last dim first), value fill.
CANN_API aclnnStatus aclnnConstantPadNdGetWorkspaceSize(const aclTensor* self, const aclIntArray* pad,
                                                        const aclScalar* value, aclTensor* out, uint64_t* ws,
                                                        aclOpExecutor** ex) {
    const char* op = "aclnnConstantPadNd";
    if (int rc = check_present(op, "pad", pad)) return rc;
    if (int rc = check_present(op, "value", value)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), p = hold(pad), v = host_scalar(*value), o = hold(out)] {
        view(o).copy_(at::constant_pad_nd(view(s), p, v));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnConstantPadNd)

// ---- ordering (ops-math sort, topk, argsort; ops-math reduce max with indices) ------------------------------
CANN_API aclnnStatus aclnnSortGetWorkspaceSize(const aclTensor* self, bool stable, int64_t dim, bool descending,
                                               aclTensor* values, aclTensor* indices, uint64_t* ws,
                                               aclOpExecutor** ex) {
    const char* op = "aclnnSort";
    if (int rc = check_args(op, {{"self", self}, {"valuesOut", values}, {"indicesOut", indices}})) return rc;
    return aten_executor(op, [s = hold(self), stable, dim, descending, v = hold(values), i = hold(indices)] {
        auto [sv, si] = at::sort(view(s), stable, dim, descending);
        view(v).copy_(sv);
        view(i).copy_(si);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSort)
CANN_API aclnnStatus aclnnArgsortGetWorkspaceSize(const aclTensor* self, int64_t dim, bool descending, aclTensor* out,
                                                  uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnArgsort";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, descending, o = hold(out)] {
        view(o).copy_(at::argsort(view(s), /*stable=*/true, dim, descending));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnArgsort)
CANN_API aclnnStatus aclnnTopkGetWorkspaceSize(const aclTensor* self, int64_t k, int64_t dim, bool largest,
                                               bool sorted, aclTensor* values, aclTensor* indices, uint64_t* ws,
                                               aclOpExecutor** ex) {
    const char* op = "aclnnTopk";
    if (int rc = check_args(op, {{"self", self}, {"valuesOut", values}, {"indicesOut", indices}})) return rc;
    return aten_executor(op, [s = hold(self), k, dim, largest, sorted, v = hold(values), i = hold(indices)] {
        auto [tv, ti] = at::topk(view(s), k, dim, largest, sorted);
        view(v).copy_(tv);
        view(i).copy_(ti);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnTopk)
// aclnnMaxDim / aclnnMinDim: the extreme values along dim and their indices.
static aclnnStatus dim_extreme(const char* op, bool largest, const aclTensor* self, int64_t dim, bool keepdim,
                               aclTensor* out, aclTensor* indices, uint64_t* ws, aclOpExecutor** ex) {
    if (int rc = check_args(op, {{"self", self}, {"out", out}, {"indices", indices}})) return rc;
    return aten_executor(op, [s = hold(self), largest, dim, keepdim, o = hold(out), i = hold(indices)] {
        auto [values, positions] = largest ? at::max(view(s), dim, keepdim) : at::min(view(s), dim, keepdim);
        view(o).copy_(values);
        view(i).copy_(positions);
    }, ws, ex);
}
CANN_API aclnnStatus aclnnMaxDimGetWorkspaceSize(const aclTensor* self, int64_t dim, bool keepdim, aclTensor* out,
                                                 aclTensor* indices, uint64_t* ws, aclOpExecutor** ex) {
    return dim_extreme("aclnnMaxDim", true, self, dim, keepdim, out, indices, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMaxDim)

// ---- counting and index accumulation (ops-math bincount, histc; ops-nn index_add) ----------------------------
CANN_API aclnnStatus aclnnBincountGetWorkspaceSize(const aclTensor* self, const aclTensor* weights, int64_t minlength,
                                                   aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnBincount";
    if (int rc = check_args(op, {{"self", self}, {"weights", weights, true}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), w = hold(weights), minlength, o = hold(out)] {
        at::Tensor counted = at::bincount(view(s), w ? std::optional<at::Tensor>(view(w)) : std::nullopt, minlength);
        at::Tensor r = view(o);
        r.zero_();
        r.narrow(0, 0, std::min(r.size(0), counted.size(0))).copy_(counted.narrow(0, 0, std::min(r.size(0), counted.size(0))));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnBincount)
CANN_API aclnnStatus aclnnHistcGetWorkspaceSize(const aclTensor* self, int64_t bins, const aclScalar* min,
                                                const aclScalar* max, aclTensor* out, uint64_t* ws,
                                                aclOpExecutor** ex) {
    const char* op = "aclnnHistc";
    if (int rc = check_present(op, "min", min)) return rc;
    if (int rc = check_present(op, "max", max)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), bins, lo = host_scalar(*min), hi = host_scalar(*max), o = hold(out)] {
        at::Tensor r = view(o);
        at::histc_out(r, view(s), bins, lo, hi);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnHistc)
CANN_API aclnnStatus aclnnIndexAddGetWorkspaceSize(const aclTensor* self, const int64_t dim, const aclTensor* index,
                                                   const aclTensor* source, const aclScalar* alpha, aclTensor* out,
                                                   uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnIndexAdd";
    if (int rc = check_present(op, "alpha", alpha)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"source", source}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), x = hold(source), a = host_scalar(*alpha),
                              o = hold(out)] {
        at::Tensor r = view(o);
        at::index_add_out(r, view(s), dim, view(i), view(x), a);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnIndexAdd)
CANN_API aclnnStatus aclnnInplaceIndexCopyGetWorkspaceSize(aclTensor* self, int64_t dim, const aclTensor* index,
                                                           const aclTensor* source, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnInplaceIndexCopy";
    if (int rc = check_args(op, {{"selfRef", self}, {"index", index}, {"source", source}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), x = hold(source)] {
        view(s).index_copy_(dim, view(i), view(x));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceIndexCopy)

// aclnnIndex (ops-nn index/index): out = self[indices] (advanced indexing; a null entry is a full slice).
CANN_API aclnnStatus aclnnIndexGetWorkspaceSize(const aclTensor* self, const aclTensorList* indices, aclTensor* out,
                                                uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnIndex";
    if (int rc = check_present(op, "indices", indices)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    std::vector<Held> held;
    if (int rc = hold_indices(op, indices, held)) return rc;
    return aten_executor(op, [s = hold(self), held, o = hold(out)] {
        at::Tensor result = view(o);
        if (result.numel() == 0) return;  // e.g. a mask with no true element: nothing to gather
        if (!any_index(held)) return void(result.copy_(view(s)));  // every entry a full slice
        result.copy_(at::index(view(s), index_list(held)));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnIndex)

// aclnnPowScalarTensor (ops-math math/pow): out = self ** exponent, self a scalar.
CANN_API aclnnStatus aclnnPowScalarTensorGetWorkspaceSize(const aclScalar* self, const aclTensor* exponent,
                                                          aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnPowScalarTensor";
    if (int rc = check_present(op, "self", self)) return rc;
    if (int rc = check_args(op, {{"exponent", exponent}, {"out", out}})) return rc;
    return aten_executor(op, [b = host_scalar(*self), e = hold(exponent), o = hold(out)] {
        at::Tensor r = view(o);
        at::pow_out(r, b, view(e));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnPowScalarTensor)

CANN_EMU_UNARY_ARG(aclnnCos, "input", at::cos_out)
CANN_EMU_UNARY(aclnnSin, at::sin_out)
CANN_EMU_UNARY(aclnnCeil, at::ceil_out)
CANN_EMU_UNARY(aclnnTrunc, at::trunc_out)
CANN_EMU_UNARY(aclnnExpm1, at::expm1_out)
CANN_EMU_UNARY(aclnnLog1p, at::log1p_out)
CANN_EMU_UNARY(aclnnLog2, at::log2_out)

// aclnnAddV3 (ops-math math/add): out = self + alpha * other, self a scalar.
CANN_API aclnnStatus aclnnAddV3GetWorkspaceSize(const aclScalar* self, const aclTensor* other, const aclScalar* alpha,
                                                aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnAddV3";
    if (int rc = check_present(op, "self", self)) return rc;
    if (int rc = check_present(op, "alpha", alpha)) return rc;
    if (int rc = check_args(op, {{"other", other}, {"out", out}})) return rc;
    return aten_executor(op, [a = host_scalar(*self), t = hold(other), al = host_scalar(*alpha), o = hold(out)] {
        at::Tensor r = view(o);
        at::add_out(r, at::scalar_to_tensor(a), view(t), al);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnAddV3)

// ---- in-place forms: selfRef = fn(selfRef) / fn(selfRef, scalar) (arg: the tensor's name in CANN's document) ----
#define CANN_EMU_INPLACE_UNARY(name, arg, method)                                                            \
    CANN_API aclnnStatus name##GetWorkspaceSize(aclTensor* self, uint64_t* ws, aclOpExecutor** ex) {          \
        if (int rc = check_args(#name, {{arg, self}})) return rc;                                           \
        return aten_executor(#name, [s = hold(self)] { view(s).method(); }, ws, ex);                          \
    }                                                                                                       \
    CANN_EMU_LAUNCH(name)
#define CANN_EMU_INPLACE_WITH_SCALAR(name, arg, what, method)                                                \
    CANN_API aclnnStatus name##GetWorkspaceSize(aclTensor* self, const aclScalar* other, uint64_t* ws,       \
                                                aclOpExecutor** ex) {                                      \
        if (int rc = check_present(#name, what, other)) return rc;                                          \
        if (int rc = check_args(#name, {{arg, self}})) return rc;                                           \
        return aten_executor(#name, [s = hold(self), v = host_scalar(*other)] { view(s).method(v); }, ws, ex); \
    }                                                                                                       \
    CANN_EMU_LAUNCH(name)
CANN_EMU_INPLACE_UNARY(aclnnInplaceExp, "selfRef", exp_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceLog, "selfRef", log_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceNeg, "selfRef", neg_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceReciprocal, "selfRef", reciprocal_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceRsqrt, "selfRef", rsqrt_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceSqrt, "self", sqrt_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceSigmoid, "selfRef", sigmoid_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceTanh, "selfRef", tanh_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceRelu, "selfRef", relu_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceFloor, "selfRef", floor_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceCeil, "selfRef", ceil_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceErf, "selfRef", erf_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceSin, "selfRef", sin_)
CANN_EMU_INPLACE_UNARY(aclnnInplaceCos, "inputRef", cos_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplacePowTensorScalar, "self", "exponent", pow_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceClampMax, "selfRef", "clipValueMax", clamp_max_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceEqScalar, "selfRef", "other", eq_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceNeScalar, "selfRef", "other", ne_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceGtScalar, "selfRef", "other", gt_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceGeScalar, "selfRef", "other", ge_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceLtScalar, "selfRef", "other", lt_)
CANN_EMU_INPLACE_WITH_SCALAR(aclnnInplaceLeScalar, "selfRef", "other", le_)

// aclnnInplaceAddcmul / aclnnInplaceAddcdiv (ops-math): selfRef += value * tensor1 (* or /) tensor2.
#define CANN_EMU_INPLACE_ADDC(name, method)                                                                  \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclTensor* t1, const aclTensor* t2, \
                                                const aclScalar* value, uint64_t* ws, aclOpExecutor** ex) { \
        if (int rc = check_present(#name, "value", value)) return rc;                                       \
        if (int rc = check_args(#name, {{"selfRef", self}, {"tensor1", t1}, {"tensor2", t2}})) return rc;    \
        return aten_executor(#name, [s = hold(self), a = hold(t1), b = hold(t2), v = host_scalar(*value)] {   \
            view(s).method(view(a), view(b), v);                                                            \
        }, ws, ex);                                                                                         \
    }                                                                                                       \
    CANN_EMU_LAUNCH(name)
CANN_EMU_INPLACE_ADDC(aclnnInplaceAddcmul, addcmul_)
CANN_EMU_INPLACE_ADDC(aclnnInplaceAddcdiv, addcdiv_)

// aclnnScatterValue / aclnnInplaceScatterValue (ops-math): self[index] = value along dim (reduce as aclnnScatter).
CANN_API aclnnStatus aclnnInplaceScatterValueGetWorkspaceSize(aclTensor* self, int64_t dim, const aclTensor* index,
                                                              const aclScalar* value, int64_t reduce, uint64_t* ws,
                                                              aclOpExecutor** ex) {
    const char* op = "aclnnInplaceScatterValue";
    if (int rc = check_reduce(op, reduce)) return rc;
    if (int rc = check_present(op, "value", value)) return rc;
    if (int rc = check_args(op, {{"selfRef", self}, {"index", index}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), v = host_scalar(*value), reduce] {
        at::Tensor r = view(s);
        scatter_into(r, dim, view(i), v, reduce);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceScatterValue)
CANN_API aclnnStatus aclnnScatterValueGetWorkspaceSize(const aclTensor* self, int64_t dim, const aclTensor* index,
                                                       const aclScalar* value, int64_t reduce, aclTensor* out,
                                                       uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnScatterValue";
    if (int rc = check_reduce(op, reduce)) return rc;
    if (int rc = check_present(op, "value", value)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"index", index}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, i = hold(index), v = host_scalar(*value), reduce, o = hold(out)] {
        at::Tensor r = view(o);
        r.copy_(view(s));
        scatter_into(r, dim, view(i), v, reduce);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnScatterValue)
CANN_EMU_TENSOR_SCALAR(aclnnFloorDivides, at::floor_divide_out)
CANN_EMU_TENSOR_SCALAR(aclnnRemainderTensorScalar, at::remainder_out)
CANN_EMU_BINARY(aclnnRemainderTensorTensor, at::remainder_out)

// aclnnDivMod / aclnnDivMods (ops-math math/div): mode 0 true division, 1 truncation, 2 floor.
static std::optional<c10::string_view> rounding(int mode) {
    if (mode == 1) return c10::string_view("trunc");
    if (mode == 2) return c10::string_view("floor");
    return std::nullopt;
}
CANN_API aclnnStatus aclnnDivModGetWorkspaceSize(const aclTensor* self, const aclTensor* other, int mode, aclTensor* out,
                                                 uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnDivMod";
    if (mode < 0 || mode > 2) return invalid(op, "mode must be 0 (true), 1 (trunc) or 2 (floor)");
    if (int rc = check_args(op, {{"self", self}, {"other", other}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), t = hold(other), mode, o = hold(out)] {
        at::Tensor r = view(o);
        at::div_out(r, view(s), view(t), rounding(mode));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnDivMod)
CANN_API aclnnStatus aclnnDivModsGetWorkspaceSize(const aclTensor* self, const aclScalar* other, int mode, aclTensor* out,
                                                  uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnDivMods";
    if (mode < 0 || mode > 2) return invalid(op, "mode must be 0 (true), 1 (trunc) or 2 (floor)");
    if (int rc = check_present(op, "other", other)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), v = host_scalar(*other), mode, o = hold(out)] {
        at::Tensor r = view(o);
        at::div_out(r, view(s), at::scalar_to_tensor(v), rounding(mode));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnDivMods)
CANN_API aclnnStatus aclnnArgMaxGetWorkspaceSize(const aclTensor* self, int64_t dim, bool keepdim, aclTensor* out,
                                                 uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnArgMax";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), dim, keepdim, o = hold(out)] {
        at::Tensor r = view(o);
        at::argmax_out(r, view(s), dim, keepdim);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnArgMax)
CANN_API aclnnStatus aclnnMinDimGetWorkspaceSize(const aclTensor* self, int64_t dim, bool keepdim, aclTensor* out,
                                                 aclTensor* indices, uint64_t* ws, aclOpExecutor** ex) {
    return dim_extreme("aclnnMinDim", false, self, dim, keepdim, out, indices, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMinDim)

// ---- copies with a shape rule (ops-math repeat, expand, flip, roll, repeat_interleave; masked fill) ----------
#define CANN_EMU_SHAPED(name, what, expr)                                                                    \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclIntArray* arg, aclTensor* out, \
                                                uint64_t* ws, aclOpExecutor** ex) {                        \
        if (int rc = check_present(#name, what, arg)) return rc;                                            \
        if (int rc = check_args(#name, {{"self", self}, {"out", out}})) return rc;                          \
        return aten_executor(#name, [s = hold(self), a = hold(arg), o = hold(out)] {                        \
            view(o).copy_(expr);                                                                            \
        }, ws, ex);                                                                                         \
    }                                                                                                       \
    CANN_EMU_LAUNCH(name)
CANN_EMU_SHAPED(aclnnRepeat, "repeats", view(s).repeat(a))
CANN_EMU_SHAPED(aclnnExpand, "size", view(s).expand(a))
CANN_EMU_SHAPED(aclnnFlip, "dims", view(s).flip(a))

CANN_API aclnnStatus aclnnRepeatInterleaveIntWithDimGetWorkspaceSize(const aclTensor* self, int64_t repeats,
                                                                     int64_t dim, int64_t output_size, aclTensor* out,
                                                                     uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnRepeatInterleaveIntWithDim";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), repeats, dim, o = hold(out)] {
        view(o).copy_(at::repeat_interleave(view(s), repeats, dim));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRepeatInterleaveIntWithDim)
CANN_API aclnnStatus aclnnRepeatInterleaveWithDimGetWorkspaceSize(const aclTensor* self, const aclTensor* repeats,
                                                                  int64_t dim, int64_t output_size, aclTensor* out,
                                                                  uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnRepeatInterleaveWithDim";
    if (int rc = check_args(op, {{"self", self}, {"repeats", repeats}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), r = hold(repeats), dim, o = hold(out)] {
        view(o).copy_(at::repeat_interleave(view(s), view(r), dim));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRepeatInterleaveWithDim)
CANN_API aclnnStatus aclnnRepeatInterleaveTensorGetWorkspaceSize(const aclTensor* repeats, int64_t output_size,
                                                                 aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnRepeatInterleaveTensor";
    if (int rc = check_args(op, {{"repeats", repeats}, {"out", out}})) return rc;
    return aten_executor(op, [r = hold(repeats), o = hold(out)] { view(o).copy_(at::repeat_interleave(view(r))); },
                         ws, ex);
}
CANN_EMU_LAUNCH(aclnnRepeatInterleaveTensor)
CANN_API aclnnStatus aclnnInplaceMaskedFillTensorGetWorkspaceSize(aclTensor* self, const aclTensor* mask,
                                                                  const aclTensor* value, uint64_t* ws,
                                                                  aclOpExecutor** ex) {
    const char* op = "aclnnInplaceMaskedFillTensor";
    if (int rc = check_args(op, {{"selfRef", self}, {"mask", mask}, {"value", value}})) return rc;
    return aten_executor(op, [s = hold(self), m = hold(mask), v = hold(value)] {
        view(s).masked_fill_(view(m), view(v));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceMaskedFillTensor)
CANN_API aclnnStatus aclnnRepeatInterleaveGetWorkspaceSize(const aclTensor* self, const aclTensor* repeats,
                                                           int64_t output_size, aclTensor* out, uint64_t* ws,
                                                           aclOpExecutor** ex) {
    const char* op = "aclnnRepeatInterleave";  // self flattened, each element repeats[i] times
    if (int rc = check_args(op, {{"self", self}, {"repeats", repeats}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), r = hold(repeats), o = hold(out)] {
        view(o).copy_(at::repeat_interleave(view(s).flatten(), view(r)));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRepeatInterleave)
CANN_API aclnnStatus aclnnRepeatInterleaveIntGetWorkspaceSize(const aclTensor* self, int64_t repeats,
                                                              int64_t output_size, aclTensor* out, uint64_t* ws,
                                                              aclOpExecutor** ex) {
    const char* op = "aclnnRepeatInterleaveInt";
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), repeats, o = hold(out)] {
        view(o).copy_(at::repeat_interleave(view(s).flatten(), repeats));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRepeatInterleaveInt)
CANN_API aclnnStatus aclnnSignGetWorkspaceSize(const aclTensor* self, aclTensor* result, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSign";
    if (int rc = check_args(op, {{"self", self}, {"result", result}})) return rc;
    return aten_executor(op, [s = hold(self), o = hold(result)] {
        at::Tensor r = view(o);
        at::sign_out(r, view(s));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSign)
