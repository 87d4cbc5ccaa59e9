// aclnn operators computed with ATen's CPU kernels on the host buffers (issue 20: "computed with ATen
// CPU kernels"). An aclTensor becomes a CPU at::Tensor over the same memory (at::from_blob with its
// view, strides and offset); the operator runs its out= form into the output's memory. Argument checks
// follow each operator's CANN document (op_table.json and the shape rules cited beside the operator).
#include "aclnn_internal.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mul.h>

#include <exception>
#include <string>

namespace cann_emu {
namespace {

at::ScalarType scalar_type(int dtype) {
    switch (dtype) {
        case ACL_FLOAT: return at::kFloat;
        case ACL_FLOAT16: return at::kHalf;
        case ACL_BF16: return at::kBFloat16;
        case ACL_DOUBLE: return at::kDouble;
        case ACL_INT8: return at::kChar;
        case ACL_INT16: return at::kShort;
        case ACL_INT32: return at::kInt;
        case ACL_INT64: return at::kLong;
        case ACL_UINT8: return at::kByte;
        case ACL_UINT16: return at::kUInt16;
        case ACL_UINT32: return at::kUInt32;
        case ACL_UINT64: return at::kUInt64;
        case ACL_BOOL: return at::kBool;
        case ACL_COMPLEX64: return at::kComplexFloat;
        case ACL_COMPLEX128: return at::kComplexDouble;
        default: return at::ScalarType::Undefined;
    }
}

at::Tensor host_view(const aclTensor& t) {
    auto type = scalar_type(t.dtype);
    char* base = static_cast<char*>(t.data) + t.offset * (int64_t)dtype_size(t.dtype);
    return at::from_blob(base, t.view, t.strides, at::TensorOptions().dtype(type).device(at::kCPU));
}

at::Scalar host_scalar(const aclScalar& s) {
    switch (s.dtype) {
        case ACL_FLOAT: case ACL_FLOAT16: case ACL_BF16: case ACL_DOUBLE: return at::Scalar(scalar_value(&s));
        case ACL_BOOL: return at::Scalar(scalar_value(&s) != 0);
        default: return at::Scalar((int64_t)scalar_value(&s));
    }
}

// Runs body with ATen below autograd; an ATen error becomes ACLNN_ERR_INNER naming the operator.
template <typename Body>
aclnnStatus run_aten(const char* op, Body body) {
    try {
        at::AutoDispatchBelowADInplaceOrView guard;
        body();
        return 0;
    } catch (const std::exception& error) {
        return fail(ACLNN_ERR_INNER, std::string(op) + ": ATen failed: " + error.what());
    }
}

}  // namespace
}  // namespace cann_emu

using namespace cann_emu;

// aclnnMul / aclnnInplaceMul: out = self * other (hicann/ops-math math/mul/docs/aclnnMul&aclnnInplaceMul_en.md)
static aclnnStatus mul_prepare(const char* op, const aclTensor* self, const aclTensor* other, const aclTensor* out,
                               uint64_t* ws, aclOpExecutor** ex) {
    bool inplace = self == out;
    if (int rc = check_tensor(op, inplace ? "selfRef" : "self", self)) return rc;
    if (int rc = check_tensor(op, "other", other)) return rc;
    if (!inplace)
        if (int rc = check_tensor(op, "out", out)) return rc;
    if (!broadcastable_to(*self, *out) || !broadcastable_to(*other, *out))
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": shapes do not broadcast to out's shape");
    aclTensor s = *self, o = *other, r = *out;
    return make_executor(op, [op, s, o, r]() {
        return run_aten(op, [&] {
            at::Tensor result = host_view(r);
            at::mul_out(result, host_view(s), host_view(o));
        });
    }, ws, ex);
}
CANN_API aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor* self, const aclTensor* other, aclTensor* out,
                                              uint64_t* ws, aclOpExecutor** ex) {
    return mul_prepare("aclnnMul", self, other, out, ws, ex);
}
CANN_API aclnnStatus aclnnMul(void*, uint64_t, aclOpExecutor* ex, aclrtStream) { return execute("aclnnMul", ex); }
CANN_API aclnnStatus aclnnInplaceMulGetWorkspaceSize(aclTensor* self, const aclTensor* other, uint64_t* ws,
                                                     aclOpExecutor** ex) {
    return mul_prepare("aclnnInplaceMul", self, other, self, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceMul(void*, uint64_t, aclOpExecutor* ex, aclrtStream) {
    return execute("aclnnInplaceMul", ex);
}

// aclnnAddmm: out = beta * self + alpha * (mat1 @ mat2) (hicann/ops-nn matmul/mat_mul_v3/docs/
// aclnnAddmm&aclnnInplaceAddmm.md): mat1 (m, k), mat2 (k, n), self broadcast to out (m, n); on Atlas A2
// cubeMathType 2 (USE_FP16) is refused for BFLOAT16 and 3 (USE_HF32) for anything but FLOAT32. The
// emulation computes HF32 requests (cubeMathType 1/3 on FLOAT32) in FLOAT32.
CANN_API aclnnStatus aclnnAddmmGetWorkspaceSize(const aclTensor* self, const aclTensor* mat1, const aclTensor* mat2,
                                                const aclScalar* beta, const aclScalar* alpha, aclTensor* out,
                                                int8_t cube_math_type, uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnAddmm";
    if (!beta || !alpha) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": beta or alpha is null");
    if (int rc = check_tensor(op, "self", self)) return rc;
    if (int rc = check_tensor(op, "mat1", mat1)) return rc;
    if (int rc = check_tensor(op, "mat2", mat2)) return rc;
    if (int rc = check_tensor(op, "out", out)) return rc;
    if (mat1->view.size() != 2 || mat2->view.size() != 2 || out->view.size() != 2 ||
        mat1->view[1] != mat2->view[0] || out->view[0] != mat1->view[0] || out->view[1] != mat2->view[1])
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": mat1 (m, k), mat2 (k, n) and out (m, n) do not agree");
    if (self->view.size() < 1 || self->view.size() > 2 || !broadcastable_to(*self, *out))
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": self does not broadcast to out's shape");
    if ((cube_math_type == 2 && mat1->dtype == ACL_BF16) || (cube_math_type == 3 && mat1->dtype != ACL_FLOAT) ||
        cube_math_type < 0 || cube_math_type > 4)
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": cubeMathType " + std::to_string(cube_math_type) +
                                                 " is not supported for " + dtype_name(mat1->dtype));
    aclTensor s = *self, a = *mat1, b = *mat2, r = *out;
    aclScalar be = *beta, al = *alpha;
    return make_executor(op, [op, s, a, b, r, be, al]() {
        return run_aten(op, [&] {
            at::Tensor result = host_view(r);
            at::addmm_out(result, host_view(s), host_view(a), host_view(b), host_scalar(be), host_scalar(al));
        });
    }, ws, ex);
}
CANN_API aclnnStatus aclnnAddmm(void*, uint64_t, aclOpExecutor* ex, aclrtStream) { return execute("aclnnAddmm", ex); }
