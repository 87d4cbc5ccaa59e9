// Optimizer operators computed by ATen's CPU kernels on the host buffers (aten_support.h): the foreach
// family torch's optimizers and grad clipping use, and aclnnApplyAdamWV2 (torch_npu's _fused_adamw_).
// Signatures from hicann/ops-nn foreach/* and optim/apply_adam_w_v2.
#include "aten_support.h"

using namespace cann_emu;

// out[i] = x[i] op scalar, the scalar a one-element tensor (aclnnForeach*Scalar) or an aclScalar (V2).
#define CANN_EMU_FOREACH_SCALAR_TENSOR(name, fn)                                                           \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensorList* x, const aclTensor* scalar,           \
                                                const aclTensorList* out, uint64_t* ws, aclOpExecutor** ex) { \
        if (int rc = check_lists(#name, {{"x", x}, {"out", out}})) return rc;                            \
        if (int rc = check_args(#name, {{"scalar", scalar}})) return rc;                                   \
        return aten_executor(#name, [xs = hold(x), s = hold(scalar), os = hold(out)] {                    \
            at::Scalar v = view(s).item();                                                                 \
            for (size_t i = 0; i < xs.size(); ++i) {                                                       \
                at::Tensor r = host_view(os[i]);                                                           \
                fn(r, host_view(xs[i]), v);                                                                \
            }                                                                                              \
        }, ws, ex);                                                                                        \
    }                                                                                                      \
    CANN_EMU_LAUNCH(name)
#define CANN_EMU_FOREACH_SCALAR(name, fn)                                                                  \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensorList* x, const aclScalar* scalar,           \
                                                aclTensorList* out, uint64_t* ws, aclOpExecutor** ex) {  \
        if (int rc = check_lists(#name, {{"x", x}, {"out", out}})) return rc;                            \
        if (int rc = check_present(#name, "scalar", scalar)) return rc;                                    \
        return aten_executor(#name, [xs = hold(x), v = host_scalar(*scalar), os = hold(out)] {            \
            for (size_t i = 0; i < xs.size(); ++i) {                                                       \
                at::Tensor r = host_view(os[i]);                                                           \
                fn(r, host_view(xs[i]), v);                                                                \
            }                                                                                              \
        }, ws, ex);                                                                                        \
    }                                                                                                      \
    CANN_EMU_LAUNCH(name)
static void add_scalar(at::Tensor& r, const at::Tensor& x, const at::Scalar& v) { at::add_out(r, x, at::scalar_to_tensor(v)); }
CANN_EMU_FOREACH_SCALAR_TENSOR(aclnnForeachAddScalar, add_scalar)
CANN_EMU_FOREACH_SCALAR_TENSOR(aclnnForeachMulScalar, at::mul_out)
CANN_EMU_FOREACH_SCALAR_TENSOR(aclnnForeachDivScalar, at::div_out)
CANN_EMU_FOREACH_SCALAR(aclnnForeachAddScalarV2, add_scalar)
CANN_EMU_FOREACH_SCALAR(aclnnForeachMulScalarV2, at::mul_out)
CANN_EMU_FOREACH_SCALAR(aclnnForeachDivScalarV2, at::div_out)

// out[i] = x[i] * scalars[i]
CANN_API aclnnStatus aclnnForeachMulScalarListGetWorkspaceSize(const aclTensorList* x, const aclScalarList* scalars,
                                                               const aclTensorList* out, uint64_t* ws,
                                                               aclOpExecutor** ex) {
    const char* op = "aclnnForeachMulScalarList";
    if (int rc = check_list(op, "x", x)) return rc;
    if (int rc = check_list(op, "out", out)) return rc;
    if (int rc = check_present(op, "scalars", scalars)) return rc;
    if (x->v.size() != out->v.size() || x->v.size() != scalars->v.size())
        return invalid(op, "x, scalars and out differ in length");
    std::vector<at::Scalar> values;
    for (const aclScalar* s : scalars->v) values.push_back(host_scalar(*s));
    return aten_executor(op, [xs = hold(x), values, os = hold(out)] {
        for (size_t i = 0; i < xs.size(); ++i) {
            at::Tensor r = host_view(os[i]);
            at::mul_out(r, host_view(xs[i]), values[i]);
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnForeachMulScalarList)

// out[i] = fn(x1[i], x2[i])
#define CANN_EMU_FOREACH_LIST(name, fn)                                                                      \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensorList* x1, const aclTensorList* x2,            \
                                                aclTensorList* out, uint64_t* ws, aclOpExecutor** ex) {  \
        if (int rc = check_lists(#name, {{"x1", x1}, {"x2", x2}, {"out", out}})) return rc;             \
        return aten_executor(#name, [a = hold(x1), b = hold(x2), os = hold(out)] {                       \
            for (size_t i = 0; i < a.size(); ++i) {                                                        \
                at::Tensor r = host_view(os[i]);                                                           \
                fn(r, host_view(a[i]), host_view(b[i]));                                                   \
            }                                                                                              \
        }, ws, ex);                                                                                        \
    }                                                                                                      \
    CANN_EMU_LAUNCH(name)
CANN_EMU_FOREACH_LIST(aclnnForeachMulList, at::mul_out)
CANN_EMU_FOREACH_LIST(aclnnForeachDivList, at::div_out)

// out[i] = ||x[i]||_p (one-element tensors), p from scalar.
CANN_API aclnnStatus aclnnForeachNormGetWorkspaceSize(const aclTensorList* x, const aclScalar* scalar,
                                                      const aclTensorList* out, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnForeachNorm";
    if (int rc = check_lists(op, {{"x", x}, {"out", out}})) return rc;
    if (int rc = check_present(op, "scalar", scalar)) return rc;
    return aten_executor(op, [xs = hold(x), p = host_scalar(*scalar), os = hold(out)] {
        for (size_t i = 0; i < xs.size(); ++i) {
            at::Tensor r = host_view(os[i]);
            at::linalg_vector_norm_out(r, host_view(xs[i]), p, at::OptionalIntArrayRef(), false, r.scalar_type());
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnForeachNorm)

// aclnnApplyAdamWV2 (ops-nn optim/apply_adam_w_v2): one parameter's AdamW step in place; step holds the
// step count minus one (torch_npu passes state_step - 1). The update is torch's AdamW formula,
// computed by ATen's _fused_adamw_ on the CPU (step + 1 as its state step).
CANN_API aclnnStatus aclnnApplyAdamWV2GetWorkspaceSize(aclTensor* var, aclTensor* m, aclTensor* v, aclTensor* max_v,
                                                       const aclTensor* grad, const aclTensor* step, float lr,
                                                       float beta1, float beta2, float weight_decay, float eps,
                                                       bool amsgrad, bool maximize, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnApplyAdamWV2";
    if (int rc = check_args(op, {{"varRef", var}, {"mRef", m}, {"vRef", v},
                                 {"maxGradNormOptionalRef", max_v, true}, {"grad", grad}, {"step", step}}))
        return rc;
    if (amsgrad && !max_v) return invalid(op, "amsgrad needs maxGradNormOptionalRef");
    // aclnnApplyAdamWV2.md (约束说明): varRef, mRef, vRef and grad share one dtype; CANN refuses mixed ones.
    if (m->dtype != var->dtype || v->dtype != var->dtype || grad->dtype != var->dtype)
        return invalid(op, std::string("mRef, vRef and grad must have varRef's dtype ") + dtype_name(var->dtype));
    return aten_executor(op, [p = hold(var), m_ = hold(m), v_ = hold(v), mv = hold(max_v), g = hold(grad),
                              s = hold(step), lr, beta1, beta2, weight_decay, eps, amsgrad, maximize] {
        at::Tensor state_step = view(s).to(at::kFloat).add(1).reshape({});
        std::vector<at::Tensor> maxes;
        if (mv) maxes.push_back(view(mv));
        at::_fused_adamw_(at::TensorList{view(p)}, at::TensorList{view(g)}, at::TensorList{view(m_)},
                          at::TensorList{view(v_)}, maxes, at::TensorList{state_step}, (double)lr, (double)beta1,
                          (double)beta2, (double)weight_decay, (double)eps, amsgrad, maximize);
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnApplyAdamWV2)

// out[i] = x1[i] + weight * (x2[i] - x1[i]) (ops-nn foreach/foreach_lerp_scalar; torch's foreach AdamW moments).
CANN_API aclnnStatus aclnnForeachLerpScalarGetWorkspaceSize(const aclTensorList* x1, const aclTensorList* x2,
                                                            const aclScalar* weight, aclTensorList* out, uint64_t* ws,
                                                            aclOpExecutor** ex) {
    const char* op = "aclnnForeachLerpScalar";
    if (int rc = check_lists(op, {{"x1", x1}, {"x2", x2}, {"out", out}})) return rc;
    if (int rc = check_present(op, "weight", weight)) return rc;
    return aten_executor(op, [a = hold(x1), b = hold(x2), w = host_scalar(*weight), o = hold(out)] {
        for (size_t i = 0; i < a.size(); ++i) {
            at::Tensor r = host_view(o[i]);
            at::lerp_out(r, host_view(a[i]), host_view(b[i]), w);
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnForeachLerpScalar)

// out[i] = fn(x[i]) (aclnnForeachCopy: out[i] = x[i], dtype converted; FSDP2's foreach copies).
#define CANN_EMU_FOREACH_UNARY(name, fn)                                                                     \
    CANN_API aclnnStatus name##GetWorkspaceSize(const aclTensorList* x, aclTensorList* out, uint64_t* ws,     \
                                                aclOpExecutor** ex) {                                    \
        if (int rc = check_lists(#name, {{"x", x}, {"out", out}})) return rc;                            \
        return aten_executor(#name, [xs = hold(x), os = hold(out)] {                                      \
            for (size_t i = 0; i < xs.size(); ++i) {                                                       \
                at::Tensor r = host_view(os[i]);                                                           \
                fn(r, host_view(xs[i]));                                                                   \
            }                                                                                              \
        }, ws, ex);                                                                                        \
    }                                                                                                      \
    CANN_EMU_LAUNCH(name)
static void copy_into(at::Tensor& r, const at::Tensor& x) { r.copy_(x); }
CANN_EMU_FOREACH_UNARY(aclnnForeachCopy, copy_into)
CANN_EMU_FOREACH_UNARY(aclnnForeachSqrt, at::sqrt_out)

// out[i] = x1[i] op x2[i] (with alpha for the V2 add/sub).
CANN_API aclnnStatus aclnnForeachAddListV2GetWorkspaceSize(const aclTensorList* x1, const aclTensorList* x2,
                                                           const aclScalar* alpha, aclTensorList* out, uint64_t* ws,
                                                           aclOpExecutor** ex) {
    const char* op = "aclnnForeachAddListV2";
    if (int rc = check_lists(op, {{"x1", x1}, {"x2", x2}, {"out", out}})) return rc;
    if (int rc = check_present(op, "alpha", alpha)) return rc;
    return aten_executor(op, [a = hold(x1), b = hold(x2), al = host_scalar(*alpha), os = hold(out)] {
        for (size_t i = 0; i < a.size(); ++i) {
            at::Tensor r = host_view(os[i]);
            at::add_out(r, host_view(a[i]), host_view(b[i]), al);
        }
    }, ws, ex);
}
CANN_EMU_LAUNCH(aclnnForeachAddListV2)
