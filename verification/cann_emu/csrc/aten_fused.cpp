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

// ops-nn norm/layer_norm_v4 (aclnnLayerNorm): out = (x - E[x]) * rstd * weight + bias over normalizedShape's
// trailing dims, rstd = 1 / sqrt(Var[x] + eps) (biased variance); meanOut and rstdOut [A.., 1..] (FLOAT32 math;
// torchtitan's qwen3_5 vision blocks and gpt_oss's norms reach it through torch's native_layer_norm).
namespace {
bool trailing_shape(const aclTensor& x, const std::vector<int64_t>& shape) {
    if (shape.empty() || shape.size() > x.view.size()) return false;
    size_t shift = x.view.size() - shape.size();
    for (size_t d = 0; d < shape.size(); ++d)
        if (shape[d] != x.view[d + shift]) return false;
    return true;
}
std::vector<int64_t> last_dims(int64_t rank, size_t count) {
    std::vector<int64_t> dims;
    for (int64_t d = rank - static_cast<int64_t>(count); d < rank; ++d) dims.push_back(d);
    return dims;
}
// mean or rstd as [A.., 1..] whatever shape with those elements the caller gave (torch_npu passes [A.., 1..])
at::Tensor keepdim_shaped(const at::Tensor& stat, const at::Tensor& x, size_t normalized) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    for (size_t i = 0; i < normalized; ++i) shape[shape.size() - 1 - i] = 1;
    return stat.to(at::kFloat).reshape(shape);
}
}  // namespace

CANN_API aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor* input, const aclIntArray* normalized_shape,
                                                    const aclTensor* weight, const aclTensor* bias, double eps,
                                                    aclTensor* out, aclTensor* mean, aclTensor* rstd, uint64_t* ws,
                                                    aclOpExecutor** ex) {
    const char* op = "aclnnLayerNorm";
    if (int rc = check_present(op, "normalizedShape", normalized_shape)) return rc;
    if (int rc = check_args(op, {{"input", input}, {"weightOptional", weight, true}, {"biasOptional", bias, true},
                                 {"out", out}, {"meanOutOptional", mean, true}, {"rstdOutOptional", rstd, true}}))
        return rc;
    std::vector<int64_t> shape = hold(normalized_shape);
    if (!trailing_shape(*input, shape)) return invalid(op, "normalizedShape must be input's trailing dimensions");
    if (out->view != input->view) return invalid(op, "out's shape must be input's");
    for (const aclTensor* affine : {weight, bias})
        if (affine && affine->view != shape) return invalid(op, "weightOptional and biasOptional must have normalizedShape");
    return aten_executor(op, [x_ = hold(input), n = shape.size(), w = hold(weight), b = hold(bias), eps, o = hold(out),
                              m = hold(mean), r = hold(rstd)] {
        at::Tensor xf = view(x_).to(at::kFloat);
        auto dims = last_dims(xf.dim(), n);
        at::Tensor mean_f = xf.mean(dims, true);
        at::Tensor rstd_f = at::rsqrt((xf - mean_f).pow(2).mean(dims, true) + eps);
        at::Tensor y = (xf - mean_f) * rstd_f;
        if (w) y = y * view(w).to(at::kFloat);
        if (b) y = y + view(b).to(at::kFloat);
        view(o).copy_(y);
        if (m) view(m).copy_(mean_f.reshape(view(m).sizes()));
        if (r) view(r).copy_(rstd_f.reshape(view(r).sizes()));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnLayerNorm)

// ops-nn norm/layer_norm_grad_v3 (aclnnLayerNormBackward): with xhat = (x - mean) * rstd and g = gradOut * weight,
// gradInput = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the normalized dims, gradWeight = sum of
// gradOut * xhat and gradBias = sum of gradOut over the others; outputMask says which of the three to write.
CANN_API aclnnStatus aclnnLayerNormBackwardGetWorkspaceSize(
        const aclTensor* grad_out, const aclTensor* input, const aclIntArray* normalized_shape, const aclTensor* mean,
        const aclTensor* rstd, const aclTensor* weight, const aclTensor* bias, const aclBoolArray* output_mask,
        aclTensor* grad_input, aclTensor* grad_weight, aclTensor* grad_bias, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnLayerNormBackward";
    if (int rc = check_present(op, "normalizedShape", normalized_shape)) return rc;
    if (int rc = check_present(op, "outputMask", output_mask)) return rc;
    if (int rc = check_args(op, {{"gradOut", grad_out}, {"input", input}, {"mean", mean}, {"rstd", rstd},
                                 {"weightOptional", weight, true}, {"biasOptional", bias, true},
                                 {"gradInputOut", grad_input, true}, {"gradWeightOut", grad_weight, true},
                                 {"gradBiasOut", grad_bias, true}}))
        return rc;
    std::vector<int64_t> shape = hold(normalized_shape);
    if (!trailing_shape(*input, shape)) return invalid(op, "normalizedShape must be input's trailing dimensions");
    if (grad_out->view != input->view) return invalid(op, "gradOut's shape must be input's");
    if (output_mask->v.size() != 3)
        return invalid(op, "outputMask must have 3 entries (gradInput, gradWeight, gradBias), not " +
                               std::to_string(output_mask->v.size()));
    const aclTensor* outs[3] = {grad_input, grad_weight, grad_bias};
    for (int i = 0; i < 3; ++i)
        if (output_mask->v[i] && !outs[i]) return invalid(op, "an output outputMask asks for is null");
    return aten_executor(op, [dy_ = hold(grad_out), x_ = hold(input), n = shape.size(), m = hold(mean), r = hold(rstd),
                              w = hold(weight), mask = output_mask->v, gi = hold(grad_input), gw = hold(grad_weight),
                              gb = hold(grad_bias)] {
        at::Tensor xf = view(x_).to(at::kFloat), dy = view(dy_).to(at::kFloat);
        auto dims = last_dims(xf.dim(), n);
        std::vector<int64_t> outer;
        for (int64_t d = 0; d < xf.dim() - static_cast<int64_t>(n); ++d) outer.push_back(d);
        at::Tensor rstd_f = keepdim_shaped(view(r), xf, n);
        at::Tensor xhat = (xf - keepdim_shaped(view(m), xf, n)) * rstd_f;
        at::Tensor g = w ? dy * view(w).to(at::kFloat) : dy;
        if (mask[0])
            view(gi).copy_(rstd_f * (g - g.mean(dims, true) - xhat * (g * xhat).mean(dims, true)));
        if (mask[1]) view(gw).copy_(outer.empty() ? dy * xhat : (dy * xhat).sum(outer));
        if (mask[2]) view(gb).copy_(outer.empty() ? dy : dy.sum(outer));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnLayerNormBackward)

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

// ---- aclnnMatmulAbftVerify: V-ABFT check of a finished matmul c = a @ b (hicann/ops-ras, Atlas A2/A3) -----------
// As the kernel computes it (reliability/matmul_abft_verify: matmul_abft_verify.h, tile_threshold_robust.hpp,
// op_host/matmul_abft_verify_tiling.cpp), the same arithmetic as npu_inject/ops/reference/matmul_abft_verify.py:
// per row i and column segment j of 256, observed sum_n c[i, n] against a[i] @ BE[:, j], BE = b's segment
// weighted and summed in fp32 then held in the input dtype; threshold e' (n |muA| bMeanAbs + sqrt|16 n bVar^2
// muA^2 + 16 n^2 bMeanSq sigmaA^2| + sqrt(n) bVar sigmaA), e' = eMax 6 sqrt(K / 1024); a non-finite difference
// fails. compRow: bit i % 8 of byte j * ceil(M/8) + i / 8 is 1 where row i of segment j is correct.
CANN_API aclnnStatus aclnnMatmulAbftVerifyGetWorkspaceSize(const aclTensor* a, const aclTensor* b, const aclTensor* c,
                                                           const aclTensor* weight, double eMax,
                                                           const aclTensor* compRow, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnMatmulAbftVerify";
    if (int rc = check_args(op, {{"a", a}, {"b", b}, {"c", c}, {"checksumWeight", weight}, {"compRow", compRow}}))
        return rc;
    if (a->view.size() != 2 || b->view.size() != 2 || c->view.size() != 2 || a->view[1] != b->view[0] ||
        c->view[0] != a->view[0] || c->view[1] != b->view[1] || weight->view.size() != 1 || weight->view[0] != b->view[1])
        return invalid(op, "a [M, K], b [K, N], c [M, N] and checksumWeight [N] expected");
    if (eMax < 0) return invalid(op, "eMax must be >= 0");
    return aten_executor(op, [a_ = hold(a), b_ = hold(b), c_ = hold(c), w_ = hold(weight), eMax, o = hold(compRow)] {
        const int64_t seg = 256, rows = view(a_).size(0), inner = view(a_).size(1), cols = view(b_).size(1);
        const int64_t segments = (cols + seg - 1) / seg, pad = segments * seg - cols;
        auto segmented = [&](const at::Tensor& t, double fill) {  // [R, N] -> [R, S, 256]
            return at::constant_pad_nd(t, {0, pad}, fill).view({t.size(0), segments, seg});
        };
        at::Tensor bf = view(b_).to(at::kFloat);
        at::Tensor encoded = segmented(bf * view(w_).to(at::kFloat), 0.0).sum(-1);  // [K, S]
        at::Tensor bmax = segmented(bf, -INFINITY).amax(-1), bmin = segmented(bf, INFINITY).amin(-1);
        at::Tensor widths = at::full({segments}, (double)seg, bf.options());
        widths.index_put_({segments - 1}, (double)(cols - seg * (segments - 1)));
        at::Tensor af = view(a_).to(at::kFloat);
        at::Tensor expected = at::matmul(af, encoded.to(view(a_).scalar_type()).to(at::kFloat));  // [M, S]
        at::Tensor observed = segmented(view(c_).to(at::kFloat), 0.0).sum(-1);
        at::Tensor mean = af.mean(1, true);
        at::Tensor spread = ((af.amax(1, true) - mean) * (mean - af.amin(1, true))).abs().sqrt();
        at::Tensor scaled = encoded / widths;
        at::Tensor mean_abs = scaled.abs().sum(0), mean_sq = (scaled * scaled).sum(0);
        at::Tensor bvar = ((bmax - scaled) * (scaled - bmin)).sum(0).abs().sqrt();
        double scale = eMax * 6.0 * std::sqrt((double)inner / 1024.0);
        at::Tensor threshold = scale * (widths * mean.abs() * mean_abs +
            (16.0 * widths * bvar.square() * mean.square() + 16.0 * widths.square() * mean_sq * spread.square()).abs().sqrt() +
            widths.sqrt() * bvar * spread);
        at::Tensor correct = ((observed - expected).abs() - threshold).le(0).t();  // [S, M]
        const int64_t row_bytes = (rows + 7) / 8;
        at::Tensor padded = at::constant_pad_nd(correct.to(at::kInt), {0, row_bytes * 8 - rows}, 0)
                                .view({segments, row_bytes, 8});
        at::Tensor bits = at::pow(2, at::arange(8, padded.options()));
        view(o).copy_((padded * bits).sum(-1).reshape({-1}).to(at::kByte));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnMatmulAbftVerify)
