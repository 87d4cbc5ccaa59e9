// HCCL (hicann/hccl hccl.h, hccl_types.h). This slice holds the configuration calls torch_npu makes
// at device set-up; the collectives are later work (their names are loud stubs until then).
#include "cann_emu.h"

#include <map>
#include <mutex>
#include <string>

typedef int HcclResult;  // HCCL_SUCCESS = 0, HCCL_E_PARA = 1
union HcclConfigValue {
    int32_t value;
};

namespace {
std::mutex g_mutex;
std::map<int, int32_t> g_config;  // HcclConfig: 0 HCCL_DETERMINISTIC
}  // namespace

using namespace cann_emu;

CANN_API HcclResult HcclSetConfig(int config, HcclConfigValue value) {
    if (config != 0) return fail(1, "HcclSetConfig: config " + std::to_string(config) + " is not emulated");
    std::lock_guard<std::mutex> lock(g_mutex);
    g_config[config] = value.value;
    return 0;
}
CANN_API HcclResult HcclGetConfig(int config, HcclConfigValue* value) {
    if (!value) return fail(1, "HcclGetConfig: configValue is null");
    if (config != 0) return fail(1, "HcclGetConfig: config " + std::to_string(config) + " is not emulated");
    std::lock_guard<std::mutex> lock(g_mutex);
    value->value = g_config.count(config) ? g_config[config] : 0;
    return 0;
}
