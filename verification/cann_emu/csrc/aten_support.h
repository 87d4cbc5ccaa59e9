// What every ATen-backed operator file (csrc/aten_*.cpp) shares: an aclTensor seen as a CPU at::Tensor
// over the same host memory, argument checks against op_table.json, and the executor that runs an
// operator's body below autograd. An operator then reads as its CANN signature, its checks and one body:
//
//   CANN_API aclnnStatus aclnnSiluGetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* ws,
//                                                  aclOpExecutor** ex) {
//       const char* op = "aclnnSilu";
//       if (int rc = check_args(op, {{"self", self}, {"out", out}})) return rc;
//       return aten_executor(op, [s = hold(self), o = hold(out)] { at::silu_out(view(o), view(s)); }, ws, ex);
//   }
//   CANN_EMU_LAUNCH(aclnnSilu)
#pragma once

#include "aclnn_internal.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <exception>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace cann_emu {

at::ScalarType scalar_type(int acl_dtype);  // Undefined for a dtype ATen has no type for
int acl_dtype(at::ScalarType type);         // ACL_DT_UNDEFINED for a type CANN has no dtype for
// A CPU tensor over t's host memory (view, strides, offset): reading or writing it is the device's memory.
at::Tensor host_view(const aclTensor& t);
at::Scalar host_scalar(const aclScalar& s);

// A tensor argument kept by an executor: a copy of its descriptor (torch_npu may destroy the aclTensor
// after phase one), empty for an optional argument passed as null.
using Held = std::optional<aclTensor>;
inline Held hold(const aclTensor* t) { return t ? Held(*t) : std::nullopt; }
inline at::Tensor view(const Held& t) { return t ? host_view(*t) : at::Tensor(); }
std::vector<aclTensor> hold(const aclTensorList* list);
std::vector<at::Tensor> view(const std::vector<aclTensor>& list);
inline std::vector<int64_t> hold(const aclIntArray* a) { return a ? a->v : std::vector<int64_t>{}; }
inline std::optional<at::Scalar> hold(const aclScalar* s) {
    return s ? std::optional<at::Scalar>(host_scalar(*s)) : std::nullopt;
}

struct TensorArg {
    const char* name;  // as CANN's document names the parameter (op_table.json's key)
    const aclTensor* tensor;
    bool optional = false;
};
// check_tensor (null, dtype per op_table.json, rank, format) for each argument; a null optional passes.
aclnnStatus check_args(const char* op, std::initializer_list<TensorArg> args);
// The same for every tensor of a list (161001 for a null list).
aclnnStatus check_list(const char* op, const char* name, const aclTensorList* list);
struct ListArg {
    const char* name;
    const aclTensorList* list;
};
// check_list for each, then 161002 "x1, x2 and out differ in length" unless all have one length
// (the foreach operators' rule).
aclnnStatus check_lists(const char* op, std::initializer_list<ListArg> lists);
// 161001 naming op and what when a required non-tensor argument (scalar, array) is null.
aclnnStatus check_present(const char* op, const char* what, const void* arg);
// 161002 naming op: the shape rule given by why does not hold.
aclnnStatus invalid(const char* op, const std::string& why);

// Runs body with ATen below autograd; an ATen error becomes ACLNN_ERR_INNER naming the operator.
template <typename Body>
aclnnStatus run_aten(const char* op, Body& body) {
    try {
        at::AutoDispatchBelowADInplaceOrView guard;
        body();
        return 0;
    } catch (const std::exception& error) {
        return fail(ACLNN_ERR_INNER, std::string(op) + ": ATen failed: " + error.what());
    }
}

// Phase one's end for an ATen-backed operator: an executor that runs body at launch.
template <typename Body>
aclnnStatus aten_executor(const char* op, Body body, uint64_t* ws, aclOpExecutor** ex) {
    return make_executor(op, [op, body]() mutable { return run_aten(op, body); }, ws, ex);
}

}  // namespace cann_emu

// Phase two of operator name: runs the executor phase one made.
#define CANN_EMU_LAUNCH(name)                                                                  \
    CANN_API aclnnStatus name(void*, uint64_t, aclOpExecutor* executor, aclrtStream stream) { \
        return cann_emu::execute(#name, executor, stream);                                    \
    }
