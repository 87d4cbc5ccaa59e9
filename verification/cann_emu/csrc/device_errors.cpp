// A device's uncorrectable memory error (UCE), caused on purpose and reported as CANN reports one.
//
// cann_emu_inject_mem_uce(addr, len) (the emulation's own entry, called by npu_inject's inject_faults)
// marks a device memory region bad. The next aclnn launch then fails as a kernel that read it would:
// ACL_ERROR_RT_DEVICE_MEM_ERROR (507053) with "reason=[device mem error]" in the recent error message,
// which is what torch_npu's task queue looks for before it asks aclrtGetMemUceInfo for the bad regions
// and stops its queue with "UCE ERROR". The region stays reported until one of the repair calls takes it:
// aclrtMemUceRepair (CANN without aclrtRepairError), or aclrtGetErrorVerbose then aclrtRepairError.
// Signatures and structs: hicann/runtime include/external/acl/acl_rt.h.
//
// What this cannot show: a real device's detection (a kernel touching the region), whether a real
// repair succeeds, or a UCE outside an aclnn launch (a copy, a collective).
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>

#include "cann_emu.h"

namespace {

constexpr int UCE_INFO_RESERVED_SIZE = 14;
constexpr int ACL_RT_MEM_UCE_INFO_MAX_NUM = 20;
constexpr int ACL_RT_ERROR_MEMORY = 1;

struct aclrtMemUceInfo {
    void* addr;
    size_t len;
    size_t reserved[UCE_INFO_RESERVED_SIZE];
};

struct aclrtMemUceInfoArray {
    size_t arraySize;
    aclrtMemUceInfo memUceInfoArray[ACL_RT_MEM_UCE_INFO_MAX_NUM];
};

union aclrtErrorInfoDetail {
    aclrtMemUceInfoArray uceInfo;
    int aicoreErrType;
};

struct aclrtErrorInfo {
    uint8_t tryRepair;
    uint8_t hasDetail;
    uint8_t reserved[2];
    int errorType;  // aclrtErrorType
    aclrtErrorInfoDetail detail;
};

struct Region {
    void* addr;
    size_t len;
};

std::mutex g_mutex;
std::optional<Region> g_armed;     // injected, not yet met by a launch
std::optional<Region> g_reported;  // met: what aclrtGetMemUceInfo lists until repaired
// The device error aclrtPeekAtLastError reports (torch_npu asks it for the code after a launch failed with a
// device error): every other emulated call reports its error when it is made (work runs at launch).
std::atomic<aclError> g_pending{ACL_SUCCESS};

void repaired(const char* by) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_reported) std::fprintf(stderr, "cann_emu: memory UCE at %p (%zu bytes) repaired by %s\n", g_reported->addr,
                                 g_reported->len, by);
    g_reported.reset();
    g_pending = ACL_SUCCESS;
}

}  // namespace

namespace cann_emu {
// Called at every aclnn launch: the injected region's error, once.
aclnnStatus take_injected_mem_uce(const char* op) {
    Region region;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!g_armed) return 0;
        region = *g_armed;
        g_reported = region;
        g_armed.reset();
    }
    g_pending = ACL_ERROR_RT_DEVICE_MEM_ERROR;
    char where[64];
    std::snprintf(where, sizeof where, "%p (%zu bytes)", region.addr, region.len);
    return fail(ACL_ERROR_RT_DEVICE_MEM_ERROR, std::string(op) + ": reason=[device mem error]: uncorrectable memory "
                                                   "error at " + where + " (injected)");
}
}  // namespace cann_emu

CANN_API aclError cann_emu_inject_mem_uce(void* addr, size_t len) {
    if (!addr || !len) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "cann_emu_inject_mem_uce: addr and len must be set");
    std::lock_guard<std::mutex> lock(g_mutex);
    g_armed = Region{addr, len};
    return ACL_SUCCESS;
}

CANN_API aclError aclrtGetMemUceInfo(int32_t device, aclrtMemUceInfo* info, size_t arraySize, size_t* retSize) {
    if (device < 0) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "aclrtGetMemUceInfo: deviceId " + std::to_string(device) + " is negative");
    if (!retSize || (arraySize && !info)) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "aclrtGetMemUceInfo: memUceInfoArray or retSize is null");
    std::lock_guard<std::mutex> lock(g_mutex);
    *retSize = 0;
    if (g_reported && arraySize > 0) {
        std::memset(info, 0, sizeof *info);
        info[0].addr = g_reported->addr;
        info[0].len = g_reported->len;
        *retSize = 1;
    }
    return ACL_SUCCESS;
}

CANN_API aclError aclrtMemUceRepair(int32_t device, aclrtMemUceInfo* info, size_t arraySize) {
    if (device < 0 || (arraySize && !info)) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "aclrtMemUceRepair: bad deviceId or array");
    repaired("aclrtMemUceRepair");
    return ACL_SUCCESS;
}

CANN_API aclError aclrtGetErrorVerbose(int32_t device, aclrtErrorInfo* error) {
    if (device < 0 || !error) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "aclrtGetErrorVerbose: bad deviceId or errorInfo");
    std::memset(error, 0, sizeof *error);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_reported) {
        error->tryRepair = 1;
        error->hasDetail = 1;
        error->errorType = ACL_RT_ERROR_MEMORY;
        error->detail.uceInfo.arraySize = 1;
        error->detail.uceInfo.memUceInfoArray[0].addr = g_reported->addr;
        error->detail.uceInfo.memUceInfoArray[0].len = g_reported->len;
    }
    return ACL_SUCCESS;
}

CANN_API aclError aclrtRepairError(int32_t device, const aclrtErrorInfo* error) {
    if (device < 0 || !error) return cann_emu::fail(ACL_ERROR_INVALID_PARAM, "aclrtRepairError: bad deviceId or errorInfo");
    if (error->errorType == ACL_RT_ERROR_MEMORY) repaired("aclrtRepairError");
    return ACL_SUCCESS;
}

CANN_API aclError aclrtPeekAtLastError(int /*level*/) { return g_pending.load(); }
CANN_API aclError aclrtGetLastError(int /*level*/) { return g_pending.exchange(ACL_SUCCESS); }
