// The fused transformer-block operators torch_npu's npu_rms_norm, npu_rotary_mul and npu_swiglu reach,
// forward and backward, computed with ATen on the host buffers in FLOAT32 (CANN computes them in FP32
// for FLOAT16/BFLOAT16 inputs and rounds the outputs to the input dtype, per each operator's document).
// Signatures: hicann/ops-nn norm/rms_norm(_grad), activation/swi_glu(_grad); hicann/ops-transformer
// posembedding/interleave_rope (aclnnRotaryPositionEmbedding, ...Grad). aclnnRotaryPositionEmbeddingV2 has
// no public document; its signature is the one op-plugin's npu_rotary_mul calls it with
// (RotaryMulKernelNpuOpApi.cpp: x, cos, sin, mode, rotate, out).
#include "aten_support.h"

using namespace cann_emu;

namespace {

// The trailing dims gamma covers (gamma_shape == x_shape[n:], per aclnnRmsNorm's document).
std::vector<int64_t> normalized_dims(const at::Tensor& x, const at::Tensor& gamma) {
    std::vector<int64_t> dims;
    for (int64_t d = x.dim() - gamma.dim(); d < x.dim(); ++d) dims.push_back(d);
    return dims;
}
bool gamma_fits(const aclTensor& x, const aclTensor& gamma) {
    if (gamma.view.size() > x.view.size()) return false;
    size_t shift = x.view.size() - gamma.view.size();
    for (size_t d = 0; d < gamma.view.size(); ++d)
        if (gamma.view[d] != x.view[d + shift]) return false;
    return true;
}

// mode 0 (half): (x1, x2) -> (-x2, x1) over the last dim's halves; mode 1 (interleave): pairs
// (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]). rotate_t is the transpose (used by the gradient).
at::Tensor rotate(const at::Tensor& x, int64_t mode, bool transpose) {
    double sign = transpose ? -1.0 : 1.0;
    if (mode == 0) {
        auto halves = x.chunk(2, -1);
        return at::cat({halves[1] * -sign, halves[0] * sign}, -1);
    }
    auto pairs = x.unflatten(-1, {-1, 2});
    auto even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
    return at::stack({odd * -sign, even * sign}, -1).flatten(-2);
}
// Sums t down to shape (the dims a smaller operand was broadcast along), as autograd reduces it.
at::Tensor reduce_to(const at::Tensor& t, at::IntArrayRef shape) {
    std::vector<int64_t> dims;
    int64_t lead = t.dim() - (int64_t)shape.size();
    for (int64_t d = 0; d < t.dim(); ++d)
        if (d < lead || (shape[d - lead] == 1 && t.size(d) != 1)) dims.push_back(d);
    at::Tensor summed = dims.empty() ? t : t.sum(dims, true);
    return summed.reshape(shape);
}

}  // namespace

// ---- aclnnRmsNorm / aclnnRmsNormGrad --------------------------------------------------------------------
// rstd = 1 / sqrt(mean(x^2 over gamma's dims) + epsilon) (FLOAT32, x's shape with those dims 1);
// y = x * rstd * gamma.
CANN_API aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor* x, const aclTensor* gamma, double epsilon,
                                                  const aclTensor* y, const aclTensor* rstd, uint64_t* ws,
                                                  aclOpExecutor** ex) {
    const char* op = "aclnnRmsNorm";
    if (int rc = check_args(op, {{"x", x}, {"gamma", gamma}, {"yOut", y}, {"rstdOut", rstd}})) return rc;
    if (!gamma_fits(*x, *gamma)) return invalid(op, "gamma's shape is not a trailing part of x's shape");
    return aten_executor(op, [x_ = hold(x), g = hold(gamma), epsilon, y_ = hold(y), r = hold(rstd)] {
        at::Tensor xf = view(x_).to(at::kFloat), gf = view(g).to(at::kFloat);
        at::Tensor rstd_f = at::rsqrt(xf.pow(2).mean(normalized_dims(xf, gf), true) + epsilon);
        view(r).copy_(rstd_f);
        view(y_).copy_(xf * rstd_f * gf);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRmsNorm)

// With n = x * rstd and g = dy * gamma: dx = rstd * (g - n * mean(g * n)) over gamma's dims,
// dgamma = the sum of dy * n over the other dims (FLOAT32).
CANN_API aclnnStatus aclnnRmsNormGradGetWorkspaceSize(const aclTensor* dy, const aclTensor* x, const aclTensor* rstd,
                                                      const aclTensor* gamma, const aclTensor* dx,
                                                      const aclTensor* dgamma, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnRmsNormGrad";
    if (int rc = check_args(op, {{"dy", dy}, {"x", x}, {"rstd", rstd}, {"gamma", gamma}, {"dxOut", dx},
                                 {"dgammaOut", dgamma}}))
        return rc;
    if (!gamma_fits(*x, *gamma)) return invalid(op, "gamma's shape is not a trailing part of x's shape");
    return aten_executor(op, [dy_ = hold(dy), x_ = hold(x), r = hold(rstd), g_ = hold(gamma), dx_ = hold(dx),
                              dg = hold(dgamma)] {
        at::Tensor xf = view(x_).to(at::kFloat), gf = view(g_).to(at::kFloat);
        at::Tensor dyf = view(dy_).to(at::kFloat), rstd_f = view(r).to(at::kFloat);
        auto dims = normalized_dims(xf, gf);
        at::Tensor normed = xf * rstd_f, g = dyf * gf;
        view(dx_).copy_(rstd_f * (g - normed * (g * normed).mean(dims, true)));
        view(dg).copy_(reduce_to(dyf * normed, gf.sizes()));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRmsNormGrad)

// ---- aclnnRotaryPositionEmbedding(V2) / ...Grad ------------------------------------------------------------
// out = x * cos + rotate(x) * sin; cos and sin broadcast to x.
static aclnnStatus rope_prepare(const char* op, const aclTensor* x, const aclTensor* cos, const aclTensor* sin,
                                int64_t mode, const aclTensor* rotate_matrix, const aclTensor* out, uint64_t* ws,
                                aclOpExecutor** ex) {
    if (int rc = check_args(op, {{"x", x}, {"cos", cos}, {"sin", sin}, {"out", out}})) return rc;
    if (mode != 0 && mode != 1)
        return invalid(op, "mode " + std::to_string(mode) + " is not emulated (0 half, 1 interleave)");
    if (rotate_matrix) return invalid(op, "rotate (a rotation matrix) is not emulated");
    if (!broadcastable_to(*cos, *x) || !broadcastable_to(*sin, *x))
        return invalid(op, "cos and sin do not broadcast to x's shape");
    if (x->view.empty() || x->view.back() % 2) return invalid(op, "x's last dimension is not even");
    return aten_executor(op, [x_ = hold(x), c = hold(cos), s = hold(sin), mode, o = hold(out)] {
        at::Tensor xf = view(x_).to(at::kFloat);
        view(o).copy_(xf * view(c).to(at::kFloat) + rotate(xf, mode, false) * view(s).to(at::kFloat));
    }, ws, ex);
}
CANN_API aclnnStatus aclnnRotaryPositionEmbeddingGetWorkspaceSize(const aclTensor* x, const aclTensor* cos,
                                                                  const aclTensor* sin, int64_t mode, aclTensor* out,
                                                                  uint64_t* ws, aclOpExecutor** ex) {
    return rope_prepare("aclnnRotaryPositionEmbedding", x, cos, sin, mode, nullptr, out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRotaryPositionEmbedding)
CANN_API aclnnStatus aclnnRotaryPositionEmbeddingV2GetWorkspaceSize(const aclTensor* x, const aclTensor* cos,
                                                                    const aclTensor* sin, int64_t mode,
                                                                    const aclTensor* rotate_matrix, aclTensor* out,
                                                                    uint64_t* ws, aclOpExecutor** ex) {
    return rope_prepare("aclnnRotaryPositionEmbeddingV2", x, cos, sin, mode, rotate_matrix, out, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRotaryPositionEmbeddingV2)

// dx = dy * cos + rotate^T(dy * sin); dcos = sum(dy * x), dsin = sum(dy * rotate(x)) over the dims cos and
// sin broadcast along (only when xOptional is given).
CANN_API aclnnStatus aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(const aclTensor* dy, const aclTensor* cos,
                                                                      const aclTensor* sin, const aclTensor* x,
                                                                      int64_t mode, const aclTensor* dx,
                                                                      const aclTensor* dcos, const aclTensor* dsin,
                                                                      uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnRotaryPositionEmbeddingGrad";
    if (int rc = check_args(op, {{"dy", dy}, {"cos", cos}, {"sin", sin}, {"xOptional", x, true}, {"dxOut", dx},
                                 {"dcosOut", dcos}, {"dsinOut", dsin}}))
        return rc;
    if (mode != 0 && mode != 1)
        return invalid(op, "mode " + std::to_string(mode) + " is not emulated (0 half, 1 interleave)");
    return aten_executor(op, [dy_ = hold(dy), c = hold(cos), s = hold(sin), x_ = hold(x), mode, dx_ = hold(dx),
                              dc = hold(dcos), ds = hold(dsin)] {
        at::Tensor g = view(dy_).to(at::kFloat), cf = view(c).to(at::kFloat), sf = view(s).to(at::kFloat);
        view(dx_).copy_(g * cf + rotate(g * sf, mode, true));
        if (x_) {
            at::Tensor xf = view(x_).to(at::kFloat);
            view(dc).copy_(reduce_to(g * xf, cf.sizes()));
            view(ds).copy_(reduce_to(g * rotate(xf, mode, false), sf.sizes()));
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnRotaryPositionEmbeddingGrad)

// ---- aclnnSwiGlu / aclnnSwiGluGrad: x = (A, B) halves along dim; out = silu(A) * B --------------------------
static aclnnStatus halves_ok(const char* op, const aclTensor* x, int64_t dim) {
    int64_t rank = (int64_t)x->view.size();
    if (dim < -rank || dim >= rank) return invalid(op, "dim " + std::to_string(dim) + " is out of range");
    if (x->view[(dim + rank) % rank] % 2) return invalid(op, "x's size along dim is not even");
    return 0;
}
CANN_API aclnnStatus aclnnSwiGluGetWorkspaceSize(const aclTensor* x, int64_t dim, const aclTensor* out, uint64_t* ws,
                                                 aclOpExecutor** ex) {
    const char* op = "aclnnSwiGlu";
    if (int rc = check_args(op, {{"x", x}, {"out", out}})) return rc;
    if (int rc = halves_ok(op, x, dim)) return rc;
    return aten_executor(op, [x_ = hold(x), dim, o = hold(out)] {
        auto ab = view(x_).to(at::kFloat).chunk(2, dim);
        view(o).copy_(at::silu(ab[0]) * ab[1]);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSwiGlu)
// dA = dy * B * sig(A) * (1 + A * (1 - sig(A))), dB = dy * silu(A); out = (dA, dB) along dim.
CANN_API aclnnStatus aclnnSwiGluGradGetWorkspaceSize(const aclTensor* dy, const aclTensor* x, int64_t dim,
                                                     const aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSwiGluGrad";
    if (int rc = check_args(op, {{"yGrad", dy}, {"x", x}, {"out", out}})) return rc;
    if (int rc = halves_ok(op, x, dim)) return rc;
    return aten_executor(op, [dy_ = hold(dy), x_ = hold(x), dim, o = hold(out)] {
        auto ab = view(x_).to(at::kFloat).chunk(2, dim);
        at::Tensor g = view(dy_).to(at::kFloat), sig = at::sigmoid(ab[0]);
        at::Tensor da = g * ab[1] * sig * (1 + ab[0] * (1 - sig)), db = g * ab[0] * sig;
        view(o).copy_(at::cat({da, db}, dim));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSwiGluGrad)
