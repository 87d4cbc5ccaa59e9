// Matrix products, softmax, losses, embedding, activation backward and random fills computed by ATen's
// CPU kernels on the host buffers (aten_support.h). Signatures from CANN's headers (hicann/ops-nn
// matmul/*, activation/*, loss/*, index/*; ops-math random/*).
#include "aten_support.h"

#include <map>
#include <mutex>

using namespace cann_emu;

// cubeMathType (aclnnMm's document): 0 KEEP_DTYPE, 1 ALLOW_FP32_DOWN_PRECISION, 2 USE_FP16, 3 USE_HF32,
// 4 FORCE_GRP_ACC_FOR_FP32 (newer). On Atlas A2, USE_FP16 is refused for BFLOAT16 and USE_HF32 for
// anything but FLOAT. The emulation computes every accepted request in the input dtype (HF32 in FP32).
static aclnnStatus check_cube_math(const char* op, const aclTensor* self, int8_t cube_math_type) {
    if (cube_math_type < 0 || cube_math_type > 4 || (cube_math_type == 2 && self->dtype == ACL_BF16) ||
        (cube_math_type == 3 && self->dtype != ACL_FLOAT))
        return invalid(op, "cubeMathType " + std::to_string(cube_math_type) + " is not supported for " +
                               dtype_name(self->dtype));
    return 0;
}

// The cube multiplies FLOAT16/BFLOAT16 inputs with an FP32 accumulator and rounds once, into the output's dtype.
// So does ATen's CPU GEMM for them, but on a CPU without AVX-512 BF16 that is a scalar loop: the emulated
// bf16 llama3 debug model spent 56% of its time there (perf, 2026-11-28). MKL's FP32 GEMM on FP32 copies
// accumulates the same way (in another order), then one rounding into out. FLOAT inputs go straight to product.
template <typename Product>
static void cube_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, Product product) {
    const bool reduced = a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16;
    if (!reduced) return (void)product(out, a, b);
    if (out.scalar_type() == at::kFloat) return (void)product(out, a.to(at::kFloat), b.to(at::kFloat));
    at::Tensor accumulator = at::empty(out.sizes(), out.options().dtype(at::kFloat));
    product(accumulator, a.to(at::kFloat), b.to(at::kFloat));
    out.copy_(accumulator);
}

// out = self @ mat2: aclnnMm (2-D), aclnnBatchMatMul (3-D), aclnnMatmul (torch.matmul's broadcasting).
// An out of FLOAT with FLOAT16/BFLOAT16 inputs (torch_npu's mm.dtype: torchtitan dist_gemm's fp32 wgrad) is the
// cube's FP32 accumulator written out unrounded.
#define CANN_EMU_MATMUL(name, rank_ok, fn)                                                                  \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, const aclTensor* mat2, aclTensor* out, \
                                                int8_t cube_math_type, uint64_t* ws, aclOpExecutor** ex) { \
        if (int rc = check_args(#name, {{"self", self}, {"mat2", mat2}, {"out", out}})) return rc;         \
        if (!(rank_ok)) return invalid(#name, "self, mat2 and out have ranks the operator does not accept"); \
        if (int rc = check_cube_math(#name, self, cube_math_type)) return rc;                              \
        return aten_executor(#name, [s = hold(self), m = hold(mat2), o = hold(out)] {                      \
            at::Tensor r = view(o);                                                                        \
            cube_product(r, view(s), view(m),                                                              \
                         [](at::Tensor& y, const at::Tensor& x, const at::Tensor& w) { fn(y, x, w); });    \
        }, ws, ex);                                                                                        \
    }                                                                                                      \
    CANN_EMU_LAUNCH(name)
CANN_EMU_MATMUL(aclnnMm, self->view.size() == 2 && mat2->view.size() == 2 && out->view.size() == 2, at::mm_out)
CANN_EMU_MATMUL(aclnnBatchMatMul, self->view.size() == 3 && mat2->view.size() == 3 && out->view.size() == 3,
                at::bmm_out)
CANN_EMU_MATMUL(aclnnMatmul, self->view.size() >= 1 && mat2->view.size() >= 1, at::matmul_out)

// aclnnAddmm (ops-nn matmul/mat_mul_v3 aclnnAddmm&aclnnInplaceAddmm): out = beta * self + alpha * (mat1 @ mat2).
CANN_API aclnnStatus aclnnAddmmGetWorkspaceSize(const aclTensor* self, const aclTensor* mat1, const aclTensor* mat2,
                                                const aclScalar* beta, const aclScalar* alpha, aclTensor* out,
                                                int8_t cube_math_type, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnAddmm";
    if (int rc = check_present(op, "beta", beta)) return rc;
    if (int rc = check_present(op, "alpha", alpha)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"mat1", mat1}, {"mat2", mat2}, {"out", out}})) return rc;
    if (mat1->view.size() != 2 || mat2->view.size() != 2 || out->view.size() != 2 ||
        mat1->view[1] != mat2->view[0] || out->view[0] != mat1->view[0] || out->view[1] != mat2->view[1])
        return invalid(op, "mat1 (m, k), mat2 (k, n) and out (m, n) do not agree");
    if (self->view.size() < 1 || self->view.size() > 2 || !broadcastable_to(*self, *out))
        return invalid(op, "self does not broadcast to out's shape");
    if (int rc = check_cube_math(op, mat1, cube_math_type)) return rc;
    return aten_executor(op, [s = hold(self), a = hold(mat1), b = hold(mat2), be = host_scalar(*beta),
                              al = host_scalar(*alpha), o = hold(out)] {
        at::Tensor r = view(o), bias = view(s);
        cube_product(r, view(a), view(b), [&](at::Tensor& y, const at::Tensor& x, const at::Tensor& w) {
            at::addmm_out(y, bias.to(y.scalar_type()), x, w, be, al);
        });
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnAddmm)

// ---- softmax (ops-nn activation/softmax, log_softmax and their backward) -------------------------------
#define CANN_EMU_SOFTMAX(name, fn)                                                                         \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* self, int64_t dim, aclTensor* out, uint64_t* ws, \
                                                aclOpExecutor** ex) {                                    \
        if (int rc = check_args(#name, {{"self", self}, {"out", out}})) return rc;                        \
        return aten_executor(#name, [s = hold(self), dim, o = hold(out)] {                                \
            at::Tensor r = view(o);                                                                       \
            fn(r, view(s), dim, false);                                                                   \
        }, ws, ex);                                                                                       \
    }                                                                                                     \
    CANN_EMU_LAUNCH(name)
#define CANN_EMU_SOFTMAX_BACKWARD(name, fn)                                                                \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensor* grad, const aclTensor* output, int64_t dim, \
                                                aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {      \
        if (int rc = check_args(#name, {{"gradOutput", grad}, {"output", output}, {"out", out}})) return rc; \
        return aten_executor(#name, [g = hold(grad), y = hold(output), dim, o = hold(out)] {              \
            at::Tensor r = view(o);                                                                       \
            at::Tensor y_t = view(y);                                                                     \
            fn(r, view(g), y_t, dim, y_t.scalar_type());                                                  \
        }, ws, ex);                                                                                       \
    }                                                                                                     \
    CANN_EMU_LAUNCH(name)
CANN_EMU_SOFTMAX(aclnnSoftmax, at::_softmax_out)
CANN_EMU_SOFTMAX(aclnnLogSoftmax, at::_log_softmax_out)
CANN_EMU_SOFTMAX_BACKWARD(aclnnSoftmaxBackward, at::_softmax_backward_data_out)
CANN_EMU_SOFTMAX_BACKWARD(aclnnLogSoftmaxBackward, at::_log_softmax_backward_data_out)

// ---- losses (ops-nn loss/nll_loss, nll_loss_grad) -------------------------------------------------------
CANN_API aclnnStatus aclnnNLLLossGetWorkspaceSize(const aclTensor* self, const aclTensor* target,
                                                  const aclTensor* weight, int64_t reduction, int64_t ignore_index,
                                                  aclTensor* out, aclTensor* total_weight, uint64_t* ws,
                                                  aclOpExecutor** ex) {
    const char* op = "aclnnNLLLoss";
    if (reduction < 0 || reduction > 2) return invalid(op, "reduction must be 0 (none), 1 (mean) or 2 (sum)");
    if (int rc = check_args(op, {{"self", self}, {"target", target}, {"weight", weight},
                                 {"out", out}, {"totalWeightOut", total_weight}}))
        return rc;
    return aten_executor(op, [s = hold(self), t = hold(target), w = hold(weight), reduction, ignore_index,
                              o = hold(out), tw = hold(total_weight)] {
        at::Tensor r = view(o), r_w = view(tw);
        at::nll_loss_forward_out(r, r_w, view(s), view(t), view(w), reduction, ignore_index);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNLLLoss)
CANN_API aclnnStatus aclnnNLLLossBackwardGetWorkspaceSize(const aclTensor* grad, const aclTensor* self,
                                                          const aclTensor* target, const aclTensor* weight,
                                                          int64_t reduction, int64_t ignore_index,
                                                          const aclTensor* total_weight, aclTensor* out, uint64_t* ws,
                                                          aclOpExecutor** ex) {
    const char* op = "aclnnNLLLossBackward";
    if (reduction < 0 || reduction > 2) return invalid(op, "reduction must be 0 (none), 1 (mean) or 2 (sum)");
    if (int rc = check_args(op, {{"gradOutput", grad}, {"self", self}, {"target", target}, {"weight", weight},
                                 {"totalWeight", total_weight}, {"out", out}}))
        return rc;
    return aten_executor(op, [g = hold(grad), s = hold(self), t = hold(target), w = hold(weight), reduction,
                              ignore_index, tw = hold(total_weight), o = hold(out)] {
        at::Tensor r = view(o);
        at::nll_loss_backward_out(r, view(g), view(s), view(t), view(w), reduction, ignore_index, view(tw));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnNLLLossBackward)

// ---- embedding (ops-nn index/embedding, embedding_dense_grad) ------------------------------------------
CANN_API aclnnStatus aclnnEmbeddingGetWorkspaceSize(const aclTensor* weight, const aclTensor* indices,
                                                    const aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnEmbedding";
    if (int rc = check_args(op, {{"weight", weight}, {"indices", indices}, {"out", out}})) return rc;
    return aten_executor(op, [w = hold(weight), i = hold(indices), o = hold(out)] {
        view(o).copy_(at::embedding(view(w), view(i)));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnEmbedding)
// The gradient of each row of weight: the sum of grad's rows whose index selects it (paddingIdx's row 0,
// scaleGradByFreq divides by the index's frequency), as ATen's embedding_dense_backward.
CANN_API aclnnStatus aclnnEmbeddingDenseBackwardGetWorkspaceSize(const aclTensor* grad, const aclTensor* indices,
                                                                 uint64_t num_weights, uint64_t padding_idx,
                                                                 bool scale_grad_by_freq, const aclTensor* out,
                                                                 uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnEmbeddingDenseBackward";
    if (int rc = check_args(op, {{"grad", grad}, {"indices", indices}, {"out", out}})) return rc;
    return aten_executor(op, [g = hold(grad), i = hold(indices), num_weights, padding_idx, scale_grad_by_freq,
                              o = hold(out)] {
        // paddingIdx arrives as uint64 (CANN's prototype): torch's -1 ("none") is 2^64-1.
        int64_t padding = (int64_t)padding_idx;
        view(o).copy_(at::embedding_dense_backward(view(g), view(i), (int64_t)num_weights, padding, scale_grad_by_freq));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnEmbeddingDenseBackward)

// ---- activation backward (ops-nn activation/silu_grad, gelu_grad) --------------------------------------
CANN_API aclnnStatus aclnnSiluBackwardGetWorkspaceSize(const aclTensor* grad, const aclTensor* self,
                                                       aclTensor* grad_input, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSiluBackward";
    if (int rc = check_args(op, {{"gradOutput", grad}, {"self", self}, {"gradInput", grad_input}})) return rc;
    return aten_executor(op, [g = hold(grad), s = hold(self), o = hold(grad_input)] {
        at::Tensor r = view(o);
        at::silu_backward_out(r, view(g), view(s));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSiluBackward)

// ops-nn activation/softplus_v2 (aclnnSoftplus): out = log(1 + exp(beta * self)) / beta where beta * self <=
// threshold, self elsewhere (torch.nn.functional.softplus; qwen3_5's linear-attention gate).
CANN_API aclnnStatus aclnnSoftplusGetWorkspaceSize(const aclTensor* self, const aclScalar* beta,
                                                   const aclScalar* threshold, aclTensor* out, uint64_t* ws,
                                                   aclOpExecutor** ex) {
    const char* op = "aclnnSoftplus";
    if (int rc = check_present(op, "beta", beta)) return rc;
    if (int rc = check_present(op, "threshold", threshold)) return rc;
    if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
    return aten_executor(op, [s = hold(self), b = host_scalar(*beta), t = host_scalar(*threshold), o = hold(out)] {
        at::Tensor r = view(o);
        at::softplus_out(r, view(s), b, t);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSoftplus)
// ops-nn activation/softplus_v2_grad (aclnnSoftplusBackward): gradInput = gradOutput * sigmoid(beta * self) where
// beta * self <= threshold, gradOutput elsewhere.
CANN_API aclnnStatus aclnnSoftplusBackwardGetWorkspaceSize(const aclTensor* grad, const aclTensor* self,
                                                           const aclScalar* beta, const aclScalar* threshold,
                                                           aclTensor* grad_input, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnSoftplusBackward";
    if (int rc = check_present(op, "beta", beta)) return rc;
    if (int rc = check_present(op, "threshold", threshold)) return rc;
    if (int rc = check_args(op, {{"gradOutput", grad}, {"self", self}, {"gradInput", grad_input}})) return rc;
    return aten_executor(op, [g = hold(grad), s = hold(self), b = host_scalar(*beta), t = host_scalar(*threshold),
                              o = hold(grad_input)] {
        at::Tensor r = view(o);
        at::Tensor x = view(s);  // self may be an integer or bool tensor (the document's dtype list)
        at::softplus_backward_out(r, view(g), x.is_floating_point() ? x : x.to(r.scalar_type()), b, t);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnSoftplusBackward)

// ---- random fills (ops-math random/dsa_random_normal, dsa_random_uniform) -------------------------------
// torch_npu passes its generator's seed and Philox offset. Ascend's Philox stream is not reproduced: the
// emulation draws from a CPU generator seeded with that seed, in launch order, and starts it again when
// the offset goes back (torch.manual_seed). So one seed gives the numbers CPU PyTorch draws for the same
// calls -- the CPU rehearsal's initial weights -- which is what lets a run on the emulation be compared
// with the rehearsal step by step. A real NPU draws other numbers from the same seed.
namespace {
struct Stream {
    at::Generator generator;
    int64_t last_offset;
};
at::Generator stream_for(int64_t seed, int64_t offset) {
    static std::mutex mutex;
    static std::map<int64_t, Stream>* streams = new std::map<int64_t, Stream>;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = streams->find(seed);
    if (it == streams->end() || offset <= it->second.last_offset)
        it = streams->insert_or_assign(seed, Stream{at::make_generator<at::CPUGeneratorImpl>((uint64_t)seed), offset})
                 .first;
    it->second.last_offset = offset;
    return it->second.generator;
}
}  // namespace
CANN_API aclnnStatus aclnnInplaceNormalGetWorkspaceSize(const aclTensor* self, float mean, float std, int64_t seed,
                                                        int64_t offset, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnInplaceNormal";
    if (int rc = check_args(op, {{"selfRef", self}})) return rc;
    if (std < 0) return invalid(op, "std must be >= 0");
    return aten_executor(op, [s = hold(self), mean, std, seed, offset] {
        view(s).normal_(mean, std, stream_for(seed, offset));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceNormal)
CANN_API aclnnStatus aclnnInplaceUniformGetWorkspaceSize(const aclTensor* self, double from, double to, uint64_t seed,
                                                         uint64_t offset, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnInplaceUniform";
    if (int rc = check_args(op, {{"selfRef", self}})) return rc;
    if (from > to) return invalid(op, "from must be <= to");
    return aten_executor(op, [s = hold(self), from, to, seed, offset] {
        view(s).uniform_(from, to, stream_for((int64_t)seed, (int64_t)offset));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceUniform)
// aclnn_random.h: integers drawn uniformly from [from, to - 1] (torch.randint, Tensor.random_).
CANN_API aclnnStatus aclnnInplaceRandomGetWorkspaceSize(const aclTensor* self, int64_t from, int64_t to, int64_t seed,
                                                        int64_t offset, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnInplaceRandom";
    if (int rc = check_args(op, {{"selfRef", self}})) return rc;
    if (from >= to) return invalid(op, "from must be < to (the values are drawn from [from, to - 1])");
    return aten_executor(op, [s = hold(self), from, to, seed, offset] {
        view(s).random_(from, to, stream_for(seed, offset));
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnInplaceRandom)
