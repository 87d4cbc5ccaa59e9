// aclnn's argument objects (our layout: torch_npu only passes them through) and the helpers every
// operator file shares (aclnn.cpp defines them).
#pragma once

#include "cann_emu.h"

#include <functional>
#include <string>
#include <vector>

struct aclTensor {
    std::vector<int64_t> view;
    std::vector<int64_t> strides;  // in elements
    int64_t offset = 0;            // in elements
    int dtype = ACL_DT_UNDEFINED;
    int format = ACL_FORMAT_ND;
    std::vector<int64_t> storage;
    void* data = nullptr;
};
struct aclScalar {
    int dtype;
    unsigned char value[16];
};
struct aclIntArray {
    std::vector<int64_t> v;
};
struct aclFloatArray {
    std::vector<float> v;
};
struct aclBoolArray {
    std::vector<bool> v;
};
struct aclTensorList {
    std::vector<aclTensor*> v;
};
struct aclScalarList {
    std::vector<aclScalar*> v;
};
struct aclOpExecutor {
    std::string op;
    std::function<aclnnStatus()> run;
    bool repeatable = false;
    std::string scope;  // cann_emu::current_scope() when phase one made it
    std::string site;   // cann_emu::launch_site(op) when phase one made it: "" unless CANN_EMU_LAUNCH_SITES names op
};

namespace cann_emu {
double scalar_value(const aclScalar* s);
// Null check, op_table.json dtype check (161002 naming op and arg), at most 8 dims, no internal format.
// takes_complex: the operator's computation handles complex dtypes too (ATen on host views, aten_support.cpp;
// a same-dtype byte copy), beyond the element loop's load/store table.
aclnnStatus check_tensor(const char* op, const char* arg, const aclTensor* t, bool takes_complex = false);
bool broadcastable_to(const aclTensor& t, const aclTensor& out);
// Phase one's end: workspace 0 and an executor that runs run() at launch.
aclnnStatus make_executor(const char* op, std::function<aclnnStatus()> run, uint64_t* ws, aclOpExecutor** ex);
// Phase two: runs the executor (named op) and frees it unless repeatable.
aclnnStatus execute(const char* op, aclOpExecutor* e, aclrtStream stream);
// device_errors.cpp: an injected memory UCE met by this launch (its error status), else 0.
aclnnStatus take_injected_mem_uce(const char* op);
}  // namespace cann_emu
