// The legacy aclop path (acl_op_compiler.h: an operator named by type, compiled and run by GE) that
// torch_npu takes for operators without an aclnn kernel. The emulation has no such kernels: the
// descriptors torch_npu builds are accepted (objects of ours), and aclopCompileAndExecute(V2) counts the
// op type per step (audit.cpp) and fails loudly naming it, so an operator a training run sends down this
// path is found by name, never computed silently.
#include "cann_emu.h"

#include <string>
#include <vector>

struct aclTensorDesc {
    int dtype;
    std::vector<int64_t> dims;
    int format;
};
struct aclDataBuffer {
    void* data;
    size_t size;
};
struct aclopAttr {};

using namespace cann_emu;

CANN_API aclTensorDesc* aclCreateTensorDesc(int dtype, int num_dims, const int64_t* dims, int format) {
    auto* d = new aclTensorDesc{dtype, {}, format};
    if (dims && num_dims > 0) d->dims.assign(dims, dims + num_dims);
    return d;
}
CANN_API void aclDestroyTensorDesc(const aclTensorDesc* d) { delete d; }
CANN_API aclDataBuffer* aclCreateDataBuffer(void* data, size_t size) { return new aclDataBuffer{data, size}; }
CANN_API aclError aclDestroyDataBuffer(const aclDataBuffer* b) {
    delete b;
    return ACL_SUCCESS;
}
CANN_API size_t aclGetTensorDescNumDims(const aclTensorDesc* d) { return d ? d->dims.size() : 0; }
CANN_API aclError aclGetTensorDescDimV2(const aclTensorDesc* d, size_t index, int64_t* dim) {
    if (!d || !dim || index >= d->dims.size())
        return fail(ACL_ERROR_INVALID_PARAM, "aclGetTensorDescDimV2: null descriptor or index out of range");
    *dim = d->dims[index];
    return ACL_SUCCESS;
}
CANN_API int aclGetTensorDescType(const aclTensorDesc* d) { return d ? d->dtype : ACL_DT_UNDEFINED; }
CANN_API int aclGetTensorDescFormat(const aclTensorDesc* d) { return d ? d->format : ACL_FORMAT_UNDEFINED; }
CANN_API aclError aclSetTensorFormat(aclTensorDesc* d, int format) {
    if (!d) return fail(ACL_ERROR_INVALID_PARAM, "aclSetTensorFormat: null descriptor");
    d->format = format;
    return ACL_SUCCESS;
}
CANN_API aclError aclSetTensorShape(aclTensorDesc* d, int num_dims, const int64_t* dims) {
    if (!d || (num_dims > 0 && !dims)) return fail(ACL_ERROR_INVALID_PARAM, "aclSetTensorShape: null argument");
    d->dims.assign(dims, dims + (num_dims > 0 ? num_dims : 0));
    return ACL_SUCCESS;
}
CANN_API aclError aclSetTensorPlaceMent(aclTensorDesc* d, int) {
    return d ? ACL_SUCCESS : fail(ACL_ERROR_INVALID_PARAM, "aclSetTensorPlaceMent: null descriptor");
}
CANN_API void aclSetTensorDescName(aclTensorDesc*, const char*) {}

CANN_API aclopAttr* aclopCreateAttr() { return new aclopAttr; }
// Attributes only describe a legacy operator the emulation will refuse by type: accepted, not kept.
CANN_API aclError aclopSetAttrBool(aclopAttr*, const char*, uint8_t) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrInt(aclopAttr*, const char*, int64_t) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrFloat(aclopAttr*, const char*, float) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrString(aclopAttr*, const char*, const char*) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrDataType(aclopAttr*, const char*, int) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrListBool(aclopAttr*, const char*, int, const uint8_t*) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrListInt(aclopAttr*, const char*, int, const int64_t*) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrListFloat(aclopAttr*, const char*, int, const float*) { return ACL_SUCCESS; }
CANN_API aclError aclopSetAttrListListInt(aclopAttr*, const char*, int, const int*, const int64_t* const[]) {
    return ACL_SUCCESS;
}
CANN_API void aclopDestroyAttr(const aclopAttr* a) { delete a; }

static aclError legacy(const char* api, const char* op_type) {
    count_aclop(op_type);
    return fail(ACL_ERROR_INTERNAL_ERROR, std::string(api) + ": operator " + (op_type ? op_type : "(null)") +
                                              " took the legacy aclop path, which the CANN emulation does not "
                                              "compute (only aclnn operators are emulated)");
}
CANN_API aclError aclopCompileAndExecute(const char* op_type, ...) { return legacy("aclopCompileAndExecute", op_type); }
CANN_API aclError aclopCompileAndExecuteV2(const char* op_type, ...) {
    return legacy("aclopCompileAndExecuteV2", op_type);
}
