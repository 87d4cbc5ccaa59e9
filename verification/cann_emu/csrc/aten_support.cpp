// aten_support.h's definitions: aclTensor <-> at::Tensor, argument checks.
#include "aten_support.h"

namespace cann_emu {

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
        case ACL_COMPLEX32: return at::kComplexHalf;
        case ACL_FLOAT8_E5M2: return at::kFloat8_e5m2;
        case ACL_FLOAT8_E4M3FN: return at::kFloat8_e4m3fn;
        default: return at::ScalarType::Undefined;
    }
}

int acl_dtype(at::ScalarType type) {
    for (int d : {ACL_FLOAT, ACL_FLOAT16, ACL_BF16, ACL_DOUBLE, ACL_INT8, ACL_INT16, ACL_INT32, ACL_INT64, ACL_UINT8,
                  ACL_UINT16, ACL_UINT32, ACL_UINT64, ACL_BOOL, ACL_COMPLEX64, ACL_COMPLEX128, ACL_COMPLEX32,
                  ACL_FLOAT8_E5M2, ACL_FLOAT8_E4M3FN})
        if (scalar_type(d) == type) return d;
    return ACL_DT_UNDEFINED;
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

std::vector<aclTensor> hold(const aclTensorList* list) {
    std::vector<aclTensor> held;
    if (list)
        for (const aclTensor* t : list->v) held.push_back(*t);
    return held;
}

std::vector<at::Tensor> view(const std::vector<aclTensor>& list) {
    std::vector<at::Tensor> views;
    views.reserve(list.size());
    for (const aclTensor& t : list) views.push_back(host_view(t));
    return views;
}

aclnnStatus check_args(const char* op, std::initializer_list<TensorArg> args) {
    for (const TensorArg& a : args) {
        if (!a.tensor && a.optional) continue;
        if (int rc = check_tensor(op, a.name, a.tensor, /*takes_complex=*/true)) return rc;
    }
    return 0;
}

aclnnStatus check_list(const char* op, const char* name, const aclTensorList* list) {
    if (!list) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": " + name + " is null");
    for (const aclTensor* t : list->v)
        if (int rc = check_tensor(op, name, t)) return rc;
    return 0;
}

aclnnStatus check_lists(const char* op, std::initializer_list<ListArg> lists) {
    for (const ListArg& l : lists)
        if (int rc = check_list(op, l.name, l.list)) return rc;
    std::string names;
    size_t i = 0;
    bool same = true;
    for (const ListArg& l : lists) {
        names += (i == 0 ? "" : i + 1 == lists.size() ? " and " : ", ") + std::string(l.name);
        same &= l.list->v.size() == lists.begin()->list->v.size();
        ++i;
    }
    return same ? 0 : invalid(op, names + " differ in length");
}

aclnnStatus check_present(const char* op, const char* what, const void* arg) {
    return arg ? 0 : fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": " + what + " is null");
}

aclnnStatus invalid(const char* op, const std::string& why) {
    return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": " + why);
}

}  // namespace cann_emu
