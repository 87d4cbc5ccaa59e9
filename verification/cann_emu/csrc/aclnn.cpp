// aclnn on host buffers: the opaque argument objects (aclTensor, aclScalar, arrays; their layout is
// ours, torch_npu only passes them through), the two-phase executor, and the operators the emulation
// computes. Signatures follow hicann/opbase include/nnopbase/aclnn/acl_meta.h and each operator's
// document in hicann/ops-math / ops-nn (cited beside the operator).
//
// Two phases as CANN: aclnnXGetWorkspaceSize(args..., &workspaceSize, &executor) checks the arguments
// (ACLNN_ERR_PARAM_NULLPTR 161001 / ACLNN_ERR_PARAM_INVALID 161002, naming the operator) and returns an
// executor holding copies of the argument descriptors; aclnnX(workspace, size, executor, stream)
// computes on the host buffers at launch and frees the executor unless it was made repeatable.
#include "aclnn_internal.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace cann_emu {

size_t dtype_size(int dtype) {
    switch (dtype) {
        case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
        case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
        case ACL_INT8: case ACL_UINT8: case ACL_BOOL: return 1;
        case ACL_HIFLOAT8: case ACL_FLOAT8_E5M2: case ACL_FLOAT8_E4M3FN: case ACL_FLOAT8_E8M0: return 1;
        case ACL_COMPLEX32: return 4;
        case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
        case ACL_COMPLEX128: return 16;
        default: return 0;
    }
}

const char* dtype_name(int dtype) {
    switch (dtype) {
        case ACL_FLOAT: return "FLOAT";
        case ACL_FLOAT16: return "FLOAT16";
        case ACL_BF16: return "BFLOAT16";
        case ACL_DOUBLE: return "DOUBLE";
        case ACL_INT8: return "INT8";
        case ACL_INT16: return "INT16";
        case ACL_INT32: return "INT32";
        case ACL_INT64: return "INT64";
        case ACL_UINT8: return "UINT8";
        case ACL_UINT16: return "UINT16";
        case ACL_UINT32: return "UINT32";
        case ACL_UINT64: return "UINT64";
        case ACL_BOOL: return "BOOL";
        case ACL_COMPLEX64: return "COMPLEX64";
        case ACL_COMPLEX128: return "COMPLEX128";
        case ACL_INT4: return "INT4";
        case ACL_UINT1: return "UINT1";
        case ACL_COMPLEX32: return "COMPLEX32";
        case ACL_HIFLOAT8: return "HIFLOAT8";
        case ACL_FLOAT8_E5M2: return "FLOAT8_E5M2";
        case ACL_FLOAT8_E4M3FN: return "FLOAT8_E4M3FN";
        case ACL_FLOAT8_E8M0: return "FLOAT8_E8M0";
        case ACL_FLOAT6_E3M2: return "FLOAT6_E3M2";
        case ACL_FLOAT6_E2M3: return "FLOAT6_E2M3";
        case ACL_FLOAT4_E2M1: return "FLOAT4_E2M1";
        case ACL_FLOAT4_E1M2: return "FLOAT4_E1M2";
        default: return "UNKNOWN";
    }
}

}  // namespace cann_emu

using namespace cann_emu;

// ---- argument objects --------------------------------------------------------------------------
CANN_API aclTensor* aclCreateTensor(const int64_t* view_dims, uint64_t view_num, int dtype, const int64_t* stride,
                                    int64_t offset, int format, const int64_t* storage_dims, uint64_t storage_num,
                                    void* data) {
    auto* t = new aclTensor;
    t->view.assign(view_dims, view_dims + view_num);
    if (stride) {
        t->strides.assign(stride, stride + view_num);
    } else {  // contiguous
        t->strides.assign(view_num, 1);
        for (int64_t i = (int64_t)view_num - 2; i >= 0; --i) t->strides[i] = t->strides[i + 1] * t->view[i + 1];
    }
    t->offset = offset;
    t->dtype = dtype;
    t->format = format;
    if (storage_dims) t->storage.assign(storage_dims, storage_dims + storage_num);
    t->data = data;
    return t;
}
CANN_API aclScalar* aclCreateScalar(void* value, int dtype) {
    size_t n = dtype_size(dtype);
    if (!value || n == 0) {
        fail(ACLNN_ERR_PARAM_INVALID, std::string("aclCreateScalar: dtype ") + dtype_name(dtype) + " is not emulated");
        return nullptr;
    }
    auto* s = new aclScalar{dtype, {}};
    std::memcpy(s->value, value, n);
    return s;
}
CANN_API aclIntArray* aclCreateIntArray(const int64_t* v, uint64_t n) { return new aclIntArray{{v, v + n}}; }
CANN_API aclFloatArray* aclCreateFloatArray(const float* v, uint64_t n) { return new aclFloatArray{{v, v + n}}; }
// Parentheses: braces would make a two-element initializer list of the pointers converted to bool.
CANN_API aclBoolArray* aclCreateBoolArray(const bool* v, uint64_t n) { return new aclBoolArray{std::vector<bool>(v, v + n)}; }
CANN_API aclTensorList* aclCreateTensorList(aclTensor* const* v, uint64_t n) { return new aclTensorList{{v, v + n}}; }
CANN_API aclScalarList* aclCreateScalarList(aclScalar* const* v, uint64_t n) { return new aclScalarList{{v, v + n}}; }
CANN_API aclnnStatus aclDestroyTensor(const aclTensor* t) { delete t; return 0; }
CANN_API aclnnStatus aclDestroyScalar(const aclScalar* s) { delete s; return 0; }
CANN_API aclnnStatus aclDestroyIntArray(const aclIntArray* a) { delete a; return 0; }
CANN_API aclnnStatus aclDestroyFloatArray(const aclFloatArray* a) { delete a; return 0; }
CANN_API aclnnStatus aclDestroyBoolArray(const aclBoolArray* a) { delete a; return 0; }
CANN_API aclnnStatus aclDestroyTensorList(const aclTensorList* l) {
    if (l) for (auto* t : l->v) delete t;  // CANN: destroying a list destroys its tensors
    delete l;
    return 0;
}
CANN_API aclnnStatus aclDestroyScalarList(const aclScalarList* l) {
    if (l) for (auto* s : l->v) delete s;
    delete l;
    return 0;
}
CANN_API aclnnStatus aclGetViewShape(const aclTensor* t, int64_t** dims, uint64_t* num) {
    if (!t || !dims || !num) return fail(ACLNN_ERR_PARAM_NULLPTR, "aclGetViewShape: null argument");
    *num = t->view.size();
    *dims = new int64_t[t->view.size() + 1];
    std::copy(t->view.begin(), t->view.end(), *dims);
    return 0;
}
CANN_API aclnnStatus aclGetDataType(const aclTensor* t, int* dtype) {
    if (!t || !dtype) return fail(ACLNN_ERR_PARAM_NULLPTR, "aclGetDataType: null argument");
    *dtype = t->dtype;
    return 0;
}
CANN_API aclnnStatus aclGetFormat(const aclTensor* t, int* format) {
    if (!t || !format) return fail(ACLNN_ERR_PARAM_NULLPTR, "aclGetFormat: null argument");
    *format = t->format;
    return 0;
}
CANN_API aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* e) {
    if (!e) return fail(ACLNN_ERR_PARAM_NULLPTR, "aclSetAclOpExecutorRepeatable: executor is null");
    e->repeatable = true;
    return 0;
}
CANN_API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* e) { delete e; return 0; }

// ---- element access ----------------------------------------------------------------------------
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; --exp; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
static uint16_t float_to_half(float f) {  // round to nearest even
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
    return (uint16_t)half;
}
static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
static uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static double load(const void* p, int dtype) {
    switch (dtype) {
        case ACL_FLOAT: return *(const float*)p;
        case ACL_FLOAT16: return half_to_float(*(const uint16_t*)p);
        case ACL_BF16: return bf16_to_float(*(const uint16_t*)p);
        case ACL_DOUBLE: return *(const double*)p;
        case ACL_INT8: return *(const int8_t*)p;
        case ACL_INT16: return *(const int16_t*)p;
        case ACL_INT32: return *(const int32_t*)p;
        case ACL_INT64: return (double)*(const int64_t*)p;
        case ACL_UINT8: return *(const uint8_t*)p;
        case ACL_UINT16: return *(const uint16_t*)p;
        case ACL_UINT32: return *(const uint32_t*)p;
        case ACL_UINT64: return (double)*(const uint64_t*)p;
        case ACL_BOOL: return *(const uint8_t*)p != 0;
        default: return NAN;
    }
}
static void store(void* p, int dtype, double v) {
    switch (dtype) {
        case ACL_FLOAT: *(float*)p = (float)v; break;
        case ACL_COMPLEX64: ((float*)p)[0] = (float)v; ((float*)p)[1] = 0.0f; break;  // a real value: v + 0j
        case ACL_COMPLEX128: ((double*)p)[0] = v; ((double*)p)[1] = 0.0; break;
        case ACL_FLOAT16: *(uint16_t*)p = float_to_half((float)v); break;
        case ACL_BF16: *(uint16_t*)p = float_to_bf16((float)v); break;
        case ACL_DOUBLE: *(double*)p = v; break;
        case ACL_INT8: *(int8_t*)p = (int8_t)(int64_t)v; break;
        case ACL_INT16: *(int16_t*)p = (int16_t)(int64_t)v; break;
        case ACL_INT32: *(int32_t*)p = (int32_t)(int64_t)v; break;
        case ACL_INT64: *(int64_t*)p = (int64_t)v; break;
        case ACL_UINT8: *(uint8_t*)p = (uint8_t)(int64_t)v; break;
        case ACL_UINT16: *(uint16_t*)p = (uint16_t)(int64_t)v; break;
        case ACL_UINT32: *(uint32_t*)p = (uint32_t)(int64_t)v; break;
        case ACL_UINT64: *(uint64_t*)p = (uint64_t)v; break;
        case ACL_BOOL: *(uint8_t*)p = v != 0; break;
        default: break;
    }
}
// The dtypes load/store compute (the "small dtype table"): an operator whose CANN support list holds
// a dtype outside it (e.g. complex) fails by name as not emulated rather than computing wrongly.
static bool computable(int dtype) {
    switch (dtype) {
        case ACL_FLOAT: case ACL_FLOAT16: case ACL_BF16: case ACL_DOUBLE: case ACL_INT8: case ACL_INT16:
        case ACL_INT32: case ACL_INT64: case ACL_UINT8: case ACL_UINT16: case ACL_UINT32: case ACL_UINT64:
        case ACL_BOOL: return true;
        default: return false;
    }
}
namespace cann_emu {
double scalar_value(const aclScalar* s) { return load(s->value, s->dtype); }

// Visits every element of out's view; in[k] is broadcast to out's shape (right-aligned, as numpy).
static void for_each(const aclTensor& out, const std::vector<const aclTensor*>& in,
                     const std::function<void(char* o, const std::vector<const char*>& i)>& fn) {
    size_t nd = out.view.size();
    int64_t total = 1;
    for (auto d : out.view) total *= d;
    if (total == 0) return;
    std::vector<int64_t> idx(nd, 0);
    std::vector<const char*> ptrs(in.size());
    size_t osz = dtype_size(out.dtype);
    for (int64_t n = 0; n < total; ++n) {
        int64_t off = out.offset;
        for (size_t d = 0; d < nd; ++d) off += idx[d] * out.strides[d];
        for (size_t k = 0; k < in.size(); ++k) {
            const aclTensor& t = *in[k];
            int64_t ioff = t.offset;
            size_t shift = nd - t.view.size();
            for (size_t d = 0; d < t.view.size(); ++d)
                if (t.view[d] != 1) ioff += idx[d + shift] * t.strides[d];
            ptrs[k] = (const char*)t.data + ioff * (int64_t)dtype_size(t.dtype);
        }
        fn((char*)out.data + off * (int64_t)osz, ptrs);
        for (int64_t d = (int64_t)nd - 1; d >= 0; --d) {
            if (++idx[d] < out.view[d]) break;
            idx[d] = 0;
        }
    }
}
}  // namespace cann_emu

namespace cann_emu {
bool broadcastable_to(const aclTensor& t, const aclTensor& out) {
    if (t.view.size() > out.view.size()) return false;
    size_t shift = out.view.size() - t.view.size();
    for (size_t d = 0; d < t.view.size(); ++d)
        if (t.view[d] != 1 && t.view[d] != out.view[d + shift]) return false;
    return true;
}
}  // namespace cann_emu

// ---- operator support: op_table.json (CANN's documents for Atlas A2 training products, per SoC and CANN
// version where a row says so, real-machine reports winning over documents) -------------------------------
namespace cann_emu {
aclnnStatus check_tensor(const char* op, const char* arg, const aclTensor* t, bool takes_complex) {
    if (!t) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": " + arg + " is null");
    const int* dtypes = nullptr;
    int n = 0;
    if (!op_arg_dtypes(op, arg, config().soc.c_str(), config().cann_version.c_str(), &dtypes, &n))
        return fail(ACLNN_ERR_INNER, std::string(op) + ": op_table.json has no dtypes for argument " + arg);
    bool ok = false;
    for (int i = 0; i < n; ++i) ok |= dtypes[i] == t->dtype;
    if (!ok) {
        // CANN's own text (opbase's OP_CHECK_DTYPE_NOT_SUPPORT under the EZ1001 parameter error, e.g.
        // "Tensor self not implemented for DT_COMPLEX64, should be in dtype support list [DT_FLOAT,...,]."),
        // after the operator's name.
        std::string list = "[";
        for (int i = 0; i < n; ++i) list += std::string("DT_") + dtype_name(dtypes[i]) + ",";
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": AclNN_Parameter_Error(EZ1001): Tensor " + arg +
                                                 " not implemented for DT_" + dtype_name(t->dtype) +
                                                 ", should be in dtype support list " + list + "].");
    }
    if (t->view.size() > 8)
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": " + arg + " has more than 8 dimensions");
    if (t->format != ACL_FORMAT_ND && t->format != ACL_FORMAT_NCHW && t->format != ACL_FORMAT_NHWC &&
        t->format != ACL_FORMAT_NCDHW && t->format != ACL_FORMAT_NC && t->format != ACL_FORMAT_NCL)
        return fail(ACLNN_ERR_PARAM_INVALID,
                    std::string(op) + ": " + arg + " format " + std::to_string(t->format) + " is not supported");
    bool complex = t->dtype == ACL_COMPLEX64 || t->dtype == ACL_COMPLEX128;
    if (!computable(t->dtype) && !(takes_complex && complex))
        return fail(ACLNN_ERR_INNER, std::string(op) + ": " + arg + " dtype " + dtype_name(t->dtype) +
                                         " is supported by CANN but not emulated");
    return 0;
}
}  // namespace cann_emu

namespace cann_emu {
aclnnStatus make_executor(const char* op, std::function<aclnnStatus()> run, uint64_t* ws, aclOpExecutor** ex) {
    if (!ws || !ex) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": workspaceSize or executor is null");
    *ws = 0;
    *ex = new aclOpExecutor{op, std::move(run), false, current_scope(), launch_site(op)};
    return 0;
}
}  // namespace cann_emu
namespace cann_emu {
// Phase two: runs the executor in its stream's order (runtime.cpp launch). The injected UCE is met at launch,
// where the emulation reports it.
aclnnStatus execute(const char* op, aclOpExecutor* e, aclrtStream stream) {
    if (!e) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": executor is null");
    if (e->op != op) return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": executor was made by " + e->op);
    static const bool trace = std::getenv("CANN_EMU_TRACE") != nullptr;
    if (trace) std::fprintf(stderr, "cann_emu trace: %s\n", op);
    count_call(op, e->scope, e->site);
    if (aclnnStatus rc = take_injected_mem_uce(op)) {
        if (!e->repeatable) delete e;
        return rc;
    }
    return launch(stream, op, [e]() {
        aclnnStatus rc = e->run();
        if (!e->repeatable) delete e;
        return rc;
    }, false);
}
}  // namespace cann_emu

// aclnnAdd / aclnnInplaceAdd: out = self + alpha * other (hicann/ops-math math/add/docs/aclnnAdd&aclnnInplaceAdd.md)
static aclnnStatus add_prepare(const char* op, const aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                               const aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    if (!alpha) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": alpha is null");
    bool inplace = self == out;  // aclnnInplaceAdd: selfRef is self and out
    if (int rc = check_tensor(op, inplace ? "selfRef" : "self", self)) return rc;
    if (int rc = check_tensor(op, "other", other)) return rc;
    if (!inplace)
        if (int rc = check_tensor(op, "out", out)) return rc;
    if (!broadcastable_to(*self, *out) || !broadcastable_to(*other, *out))
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": shapes do not broadcast to out's shape");
    aclTensor s = *self, o = *other, r = *out;
    double a = scalar_value(alpha);
    return make_executor(op, [s, o, r, a]() {
        for_each(r, {&s, &o}, [&](char* dst, const std::vector<const char*>& src) {
            store(dst, r.dtype, load(src[0], s.dtype) + a * load(src[1], o.dtype));
        });
        return 0;
    }, ws, ex);
}
CANN_API aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                                              aclTensor* out, uint64_t* ws, aclOpExecutor** ex) {
    return add_prepare("aclnnAdd", self, other, alpha, out, ws, ex);
}
CANN_API aclnnStatus aclnnAdd(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) { return execute("aclnnAdd", ex, stream); }
CANN_API aclnnStatus aclnnInplaceAddGetWorkspaceSize(aclTensor* self, const aclTensor* other, const aclScalar* alpha,
                                                     uint64_t* ws, aclOpExecutor** ex) {
    return add_prepare("aclnnInplaceAdd", self, other, alpha, self, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceAdd(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) {
    return execute("aclnnInplaceAdd", ex, stream);
}

// aclnnInplaceCopy: selfRef = src, converting dtype, broadcasting src (hicann/ops-math conversion/view_copy).
CANN_API aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor* self, const aclTensor* src, uint64_t* ws,
                                                      aclOpExecutor** ex) {
    const char* op = "aclnnInplaceCopy";
    bool same_dtype = self && src && self->dtype == src->dtype;  // a byte copy: complex too
    if (int rc = check_tensor(op, "selfRef", self, same_dtype)) return rc;
    if (int rc = check_tensor(op, "src", src, same_dtype)) return rc;
    if (!broadcastable_to(*src, *self))
        return fail(ACLNN_ERR_PARAM_INVALID, std::string(op) + ": src does not broadcast to selfRef's shape");
    aclTensor d = *self, s = *src;
    return make_executor(op, [d, s]() {
        if (d.dtype == s.dtype) {
            size_t n = dtype_size(d.dtype);
            for_each(d, {&s}, [&](char* dst, const std::vector<const char*>& p) { std::memcpy(dst, p[0], n); });
        } else {
            for_each(d, {&s}, [&](char* dst, const std::vector<const char*>& p) {
                store(dst, d.dtype, load(p[0], s.dtype));
            });
        }
        return 0;
    }, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceCopy(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) {
    return execute("aclnnInplaceCopy", ex, stream);
}

// aclnnInplaceFillScalar: selfRef[...] = value (hicann/ops-math conversion/fill/docs/aclnnInplaceFillScalar.md).
CANN_API aclnnStatus aclnnInplaceFillScalarGetWorkspaceSize(aclTensor* self, const aclScalar* value, uint64_t* ws,
                                                            aclOpExecutor** ex) {
    const char* op = "aclnnInplaceFillScalar";
    if (!value) return fail(ACLNN_ERR_PARAM_NULLPTR, std::string(op) + ": value is null");
    if (int rc = check_tensor(op, "selfRef", self)) return rc;
    aclTensor d = *self;
    double v = scalar_value(value);
    return make_executor(op, [d, v]() {
        for_each(d, {}, [&](char* dst, const std::vector<const char*>&) { store(dst, d.dtype, v); });
        return 0;
    }, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceFillScalar(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) {
    return execute("aclnnInplaceFillScalar", ex, stream);
}

// aclnnInplaceOne / aclnnInplaceZero: selfRef[...] = 1 / 0. Dtype lists provisional (InplaceFillScalar's;
// their own documents not yet found).
static aclnnStatus fill_prepare(const char* op, aclTensor* self, double v, uint64_t* ws, aclOpExecutor** ex) {
    // A real fill value stores into complex elements too (store writes v + 0j).
    if (int rc = check_tensor(op, "selfRef", self, /*takes_complex=*/true)) return rc;
    aclTensor d = *self;
    return make_executor(op, [d, v]() {
        for_each(d, {}, [&](char* dst, const std::vector<const char*>&) { store(dst, d.dtype, v); });
        return 0;
    }, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceOneGetWorkspaceSize(aclTensor* self, uint64_t* ws, aclOpExecutor** ex) {
    return fill_prepare("aclnnInplaceOne", self, 1.0, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceOne(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) {
    return execute("aclnnInplaceOne", ex, stream);
}
CANN_API aclnnStatus aclnnInplaceZeroGetWorkspaceSize(aclTensor* self, uint64_t* ws, aclOpExecutor** ex) {
    return fill_prepare("aclnnInplaceZero", self, 0.0, ws, ex);
}
CANN_API aclnnStatus aclnnInplaceZero(void*, uint64_t, aclOpExecutor* ex, aclrtStream stream) {
    return execute("aclnnInplaceZero", ex, stream);
}
