// Profiling (msprof's ACL API): what torch_npu's profiler calls when NPU activity is on.
//
// Signatures from CANN's public header (hicann/runtime include/external/acl/acl_prof.h) and, for the
// calls torch_npu looks up by name that the header leaves out (aclprofWarmup, aclprofGetSupportedFeatures
// (V2), aclprofRegisterDeviceCallback), from msprof's own source. Behaviour follows msprof's source on
// hicann/runtime's 9.1.0 branch (the CANN version the emulation reports): prof_acl_api.cpp and
// prof_acl_core.cpp (argument checks, config building), profimpl/adapter/src/msprofiler_acl_api.cpp
// (the init/start/stop/finalize state machine), engine/src/prof_acl_mgr.cpp (prechecks, per-device
// tasks), common/config/feature_manager.* (the feature list), avp/service (Msprof* reporting).
// Where CANN's document (docs/zh/api_ref/19-01_data_profiling_apis.md) disagrees with that code, the
// code wins and the comment says so.
//
// What is emulated: the state (initialised, per-device start, warmup), every argument check with its
// return code and a message for aclGetRecentErrMsg, and counts of what torch_npu reports. What is not:
// the device-side data. Real CANN creates a PROF_* directory under the result path at aclprofStart and
// its collectors fill it (AI Core task times, metrics, HCCL traces); the emulation writes nothing there,
// so torch_npu's parser finds no CANN data and takes its framework-only path.
#include "cann_emu.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace cann_emu {
namespace {

// acl_base_rt.h
constexpr aclError ACL_ERROR_UNINITIALIZE = 100001;
constexpr aclError ACL_ERROR_INVALID_PROFILING_CONFIG = 100010;
constexpr aclError ACL_ERROR_PROF_ALREADY_RUN = 100042;
constexpr aclError ACL_ERROR_PROF_NOT_RUN = 100043;
constexpr aclError ACL_ERROR_PROF_API_CONFLICT = 148047;
constexpr aclError ACL_ERROR_PROF_MODULES_UNSUPPORTED = 200007;
constexpr int32_t PROFILING_FAILED = -1;  // msprof's errno/error_code.h

// msprof's prof_acl_api.h / prof_data_config.h
constexpr uint32_t PROF_MAX_DEV_NUM = 64;
constexpr uint32_t PROF_DEFAULT_HOST_ID = PROF_MAX_DEV_NUM;
constexpr uint64_t PROF_ACL_API = 0x1, PROF_TASK_TIME_L1 = 0x2, PROF_AICORE_METRICS = 0x4, PROF_AICPU_TRACE = 0x8,
                   PROF_L2CACHE = 0x10, PROF_HCCL_TRACE = 0x20, PROF_TRAINING_TRACE = 0x40, PROF_MSPROFTX = 0x80,
                   PROF_RUNTIME_API = 0x100, PROF_GE_API_L0 = 0x200, PROF_TASK_TIME = 0x800,
                   PROF_TASK_MEMORY = 0x1000, PROF_TASK_TIME_L2 = 0x2000, PROF_OP_ATTR = 0x4000,
                   PROF_TASK_TIME_L3 = 0x8000, PROF_GE_API_L1 = 0x1000000, PROF_API_STATS = 0x400000000ULL,
                   PROF_AICPU_MODEL = 0x4000000000000000ULL;
// prof_api_common.h, release build: the switches aclprofStart accepts.
constexpr uint64_t PROF_SWITCH_SUPPORT = PROF_ACL_API | PROF_TASK_TIME | PROF_TASK_TIME_L1 | PROF_AICORE_METRICS |
                                         PROF_AICPU_TRACE | PROF_L2CACHE | PROF_HCCL_TRACE | PROF_TRAINING_TRACE |
                                         PROF_MSPROFTX | PROF_RUNTIME_API | PROF_AICPU_MODEL | PROF_TASK_MEMORY |
                                         PROF_GE_API_L0 | PROF_GE_API_L1 | PROF_TASK_TIME_L2 | PROF_OP_ATTR |
                                         PROF_TASK_TIME_L3 | PROF_API_STATS;
constexpr int ACL_AICORE_NONE = 0xFF;
constexpr int ACL_AICORE_METRICS_LAST = 8;  // ACL_AICORE_MEMORY_ACCESS
constexpr size_t kPathMax = 4096;           // aclprofInit: length in [1, 4096)
constexpr size_t kConfigMax = 256;          // aclprofSetConfig: configLength <= 256
constexpr size_t kMarkMessageMax = 155;     // MAX_MESSAGE_LEN (156) - 1
constexpr int kConfigTypeMin = 0, kConfigTypeMax = 17;  // ACL_PROF_ARGS_MIN/MAX, both excluded

std::string hex(uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%llx", (unsigned long long)v);
    return buf;
}

}  // namespace
}  // namespace cann_emu

using namespace cann_emu;

// msprof's ProfConfig (prof_acl_api.h): the device list ends with the host (64) that
// aclprofCreateConfig appends.
struct aclprofConfig {
    uint32_t devNums;
    uint32_t devIdList[PROF_MAX_DEV_NUM + 1];
    int aicoreMetrics;
    uint64_t dataTypeConfig;
};
struct aclprofStepInfo {  // prof_acl_core.cpp
    bool startFlag;
    bool endFlag;
    uint64_t indexId;
};

namespace cann_emu {
namespace {

struct DeviceTask {
    uint64_t data_type_config;
    int count;  // the host task is shared: every start on it counts, every stop takes one back
};
struct State {
    std::mutex mutex;
    bool initialized = false;  // msprof's WORK_MODE_API_CTRL
    std::string result_path;
    std::string path_config;      // ACL_PROF_PATH from aclprofSetConfig
    bool repeat_invoking = false;  // a start is in effect until the next stop (g_isRepeatInvoking)
    bool warmup = false;
    bool acl_api_ready = false;    // started (not warming up)
    std::map<uint32_t, DeviceTask> tasks;  // running device tasks, the host (64) included
    std::unordered_set<const aclprofConfig*> configs;  // live aclprofCreateConfig results
    std::map<int, std::string> set_config;            // aclprofSetConfig values by type
    uint64_t step_index = 0;
    // counts of what was asked and reported (cann_emu_profiling_counts)
    std::map<std::string, uint64_t> counts;
    std::map<uint64_t, std::string> hashes;
};
State& state() {
    static State& s = *new State;  // never destroyed: late calls at exit still find it
    return s;
}
void count(State& s, const char* what) { s.counts[what]++; }

bool msproftx_on(const State& s) {
    for (const auto& [dev, task] : s.tasks)
        if (task.data_type_config & PROF_MSPROFTX) return true;
    return false;
}

// preCheckProfConfig (msprofiler_acl_api.cpp)
aclError precheck_config(const char* api, const aclprofConfig* cfg) {
    if (!cfg) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": EK0001 profilerConfig can not be nullptr");
    if (!state().configs.count(cfg))
        return fail(ACL_ERROR_INVALID_PARAM,
                    std::string(api) + ": profilerConfig was not made by aclprofCreateConfig or was destroyed");
    if (cfg->dataTypeConfig == 0)
        return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": EK0001 dataTypeConfig can not be zero");
    if (cfg->dataTypeConfig & ~PROF_SWITCH_SUPPORT)
        return fail(ACL_ERROR_PROF_MODULES_UNSUPPORTED,
                    std::string(api) + ": EK0001 dataTypeConfig " + hex(cfg->dataTypeConfig) +
                        " is not supported, supported switch is: " + hex(PROF_SWITCH_SUPPORT));
    return ACL_SUCCESS;
}

// ProfAclMgr::CheckConfigConsistency: a running device must be stopped (or started again) with the
// switches it was started with.
aclError check_consistency(State& s, const aclprofConfig* cfg, const char* api) {
    for (uint32_t i = 0; i < cfg->devNums; ++i) {
        auto it = s.tasks.find(cfg->devIdList[i]);
        if (it != s.tasks.end() && it->second.data_type_config != cfg->dataTypeConfig)
            return fail(ACL_ERROR_INVALID_PROFILING_CONFIG,
                        std::string(api) + ": EK0001 dataTypeConfig " + hex(cfg->dataTypeConfig) +
                            " differs from the one device " + std::to_string(cfg->devIdList[i]) +
                            " was started with (" + hex(it->second.data_type_config) + ")");
    }
    return ACL_SUCCESS;
}

// ProfAclMgr::CheckDeviceTask and the start of each device task.
aclError start_devices(State& s, const aclprofConfig* cfg, const char* api) {
    for (uint32_t i = 0; i < cfg->devNums; ++i) {
        uint32_t dev = cfg->devIdList[i];
        if (s.tasks.count(dev) && dev != PROF_DEFAULT_HOST_ID)
            return fail(ACL_ERROR_PROF_ALREADY_RUN, std::string(api) + ": EK0001 the profiling task on device " +
                                                              std::to_string(dev) + " is already started");
    }
    for (uint32_t i = 0; i < cfg->devNums; ++i) {
        uint32_t dev = cfg->devIdList[i];
        auto it = s.tasks.find(dev);
        if (it != s.tasks.end()) it->second.count++;  // the host
        else s.tasks[dev] = {cfg->dataTypeConfig, 1};
    }
    return ACL_SUCCESS;
}

bool all_digits(const std::string& v) {
    if (v.empty()) return false;
    for (char c : v)
        if (c < '0' || c > '9') return false;
    return true;
}
// ParamValidation::CheckArgRange
bool in_range(const std::string& v, uint32_t lo, uint32_t hi) {
    if (!all_digits(v) || v.size() > std::to_string(hi).size()) return false;
    unsigned long x = std::stoul(v);
    return x >= lo && x <= hi;
}
bool options_in(const std::string& v, std::initializer_list<const char*> allowed) {
    size_t start = 0;
    while (true) {
        size_t comma = v.find(',', start);
        std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        bool ok = false;
        for (const char* a : allowed) ok = ok || item == a;
        if (!ok) return false;
        if (comma == std::string::npos) return true;
        start = comma + 1;
    }
}

}  // namespace
}  // namespace cann_emu

// ---- initialisation ----------------------------------------------------------------------------
CANN_API aclError aclprofInit(const char* path, size_t length) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofInit");
    if (!path) return fail(ACL_ERROR_INVALID_PARAM, "aclprofInit: EK0006 profilerResultPath is nullptr");
    if (length == 0 || length >= kPathMax)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofInit: EK0001 length " + std::to_string(length) +
                                                 " of profilerResultPath should be in [1, 4096)");
    if (std::strlen(path) != length)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofInit: EK0001 length " + std::to_string(length) +
                                                 " does not equal strlen(profilerResultPath) " +
                                                 std::to_string(std::strlen(path)));
    if (s.initialized)
        return fail(ACL_ERROR_REPEAT_INITIALIZE,
                    "aclprofInit: EK0002 profiling is already initialised (aclprofFinalize first)");
    s.result_path.assign(path, length);
    s.initialized = true;
    return ACL_SUCCESS;
}

// Not initialised (never, or after a finalize): CANN 9.1.0 returns success without doing anything (the
// document says it fails; msprofiler_acl_api.cpp's ProfFinalize returns ACL_SUCCESS).
CANN_API aclError aclprofFinalize() {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofFinalize");
    if (!s.initialized) return ACL_SUCCESS;
    s.tasks.clear();
    s.initialized = false;
    s.repeat_invoking = false;
    s.warmup = false;
    s.acl_api_ready = false;
    return ACL_SUCCESS;
}

// ---- configuration -----------------------------------------------------------------------------
CANN_API aclprofConfig* aclprofCreateConfig(uint32_t* devices, uint32_t n, int metrics, const void* events,
                                            uint64_t data_type_config) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofCreateConfig");
    if (n != 0 && !devices) {
        fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0006 deviceIdList is nullptr");
        return nullptr;
    }
    if (events) {
        fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0001 aicoreEvents must be nullptr");
        return nullptr;
    }
    const uint32_t dev_count = (uint32_t)config().devices;
    if (n > PROF_MAX_DEV_NUM || n > dev_count) {
        fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0001 deviceNums " + std::to_string(n) +
                                          " should be in range [1, " + std::to_string(dev_count) + "]");
        return nullptr;
    }
    std::unordered_set<uint32_t> seen;
    for (uint32_t i = 0; i < n; ++i) {
        if (devices[i] >= dev_count) {
            fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0001 device id " + std::to_string(devices[i]) +
                                              " should be in range [0," + std::to_string(dev_count) + ")");
            return nullptr;
        }
        if (!seen.insert(devices[i]).second) {
            fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0001 device id " + std::to_string(devices[i]) +
                                              " is duplicatedly set");
            return nullptr;
        }
    }
    if (n == 0 && !(data_type_config & PROF_MSPROFTX)) {
        fail(ACL_ERROR_INVALID_PARAM, "aclprofCreateConfig: EK0001 deviceNums can not be 0");
        return nullptr;
    }
    auto* cfg = new aclprofConfig{};
    cfg->aicoreMetrics = metrics;
    cfg->dataTypeConfig = data_type_config | PROF_AICPU_MODEL;
    cfg->devNums = n;
    for (uint32_t i = 0; i < n; ++i) cfg->devIdList[i] = devices[i];
    // Task time levels imply the ones below them, and any task time the training trace.
    if (data_type_config & PROF_TASK_TIME_L1) cfg->dataTypeConfig |= PROF_TASK_TIME;
    if (data_type_config & (PROF_TASK_TIME_L2 | PROF_OP_ATTR))
        cfg->dataTypeConfig |= PROF_TASK_TIME | PROF_TASK_TIME_L1;
    if (data_type_config & PROF_TASK_TIME_L3)
        cfg->dataTypeConfig |= PROF_TASK_TIME | PROF_TASK_TIME_L1 | PROF_TASK_TIME_L2;
    if (cfg->dataTypeConfig & PROF_TASK_TIME) cfg->dataTypeConfig |= PROF_TRAINING_TRACE;
    if (data_type_config & PROF_API_STATS) cfg->dataTypeConfig = PROF_ACL_API | PROF_API_STATS;
    cfg->devIdList[cfg->devNums++] = PROF_DEFAULT_HOST_ID;
    s.configs.insert(cfg);
    return cfg;
}

CANN_API aclError aclprofDestroyConfig(const aclprofConfig* cfg) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofDestroyConfig");
    if (!cfg) return fail(ACL_ERROR_INVALID_PARAM, "aclprofDestroyConfig: EK0006 profilerConfig is nullptr");
    if (!s.configs.erase(cfg))
        return fail(ACL_ERROR_INVALID_PARAM,
                    "aclprofDestroyConfig: profilerConfig was not made by aclprofCreateConfig or was destroyed");
    delete cfg;
    return ACL_SUCCESS;
}

// aclprofConfigType (acl_prof.h). Values are checked as ProfParamsAdapter::CheckApiConfigIsValid does;
// the types torch_npu never sets and whose checks are long (SYS_MEM_SERVICEFLOW, OPTYPE, NTS_METRICS)
// fail by name.
CANN_API aclError aclprofSetConfig(int type, const char* value, size_t length) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofSetConfig");
    if (type <= kConfigTypeMin || type >= kConfigTypeMax)
        return fail(ACL_ERROR_INVALID_PARAM,
                    "aclprofSetConfig: EK0001 configType " + std::to_string(type) +
                        " should be greater than ACL_PROF_ARGS_MIN and less than ACL_PROF_ARGS_MAX");
    if (length > kConfigMax)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofSetConfig: EK0001 configLength " + std::to_string(length) +
                                                 " should be less than or equal to 256");
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclprofSetConfig: EK0006 config is nullptr");
    if (std::strlen(value) != length)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofSetConfig: EK0001 configLength " + std::to_string(length) +
                                                 " does not equal strlen(config)");
    const std::string v(value, length);
    bool ok;
    const char* reason;
    switch (type) {
        case 1:  // ACL_PROF_STORAGE_LIMIT: <n>MB, n in [200, 4294967295]
            ok = v.size() > 2 && v.compare(v.size() - 2, 2, "MB") == 0 && all_digits(v.substr(0, v.size() - 2)) &&
                 v.size() - 2 <= 10 && std::stoull(v.substr(0, v.size() - 2)) >= 200 &&
                 std::stoull(v.substr(0, v.size() - 2)) <= 4294967295ULL;
            reason = "Please input a value in range [200, 4294967295] and end with MB, for example 200MB";
            break;
        case 3:  // ACL_PROF_SYS_HARDWARE_MEM_FREQ (Atlas A2: [1, 100] Hz)
        case 5:  // ACL_PROF_SYS_IO_FREQ
        case 7:  // ACL_PROF_DVPP_FREQ
        case 11:  // ACL_PROF_LOW_POWER_FREQ
            ok = in_range(v, 1, 100);
            reason = "Please input an integer value in 1-100";
            break;
        case 6:   // ACL_PROF_SYS_INTERCONNECTION_FREQ
        case 10:  // ACL_PROF_HOST_SYS_USAGE_FREQ
        case 13:  // ACL_PROF_SYS_CPU_FREQ
            ok = in_range(v, 1, 50);
            reason = "Please input an integer value in 1-50";
            break;
        case 4:  // ACL_PROF_LLC_MODE
            ok = v == "read" || v == "write";
            reason = "Please input 'read' or 'write'";
            break;
        case 8:  // ACL_PROF_HOST_SYS
            ok = options_in(v, {"cpu", "mem", "disk", "network", "osrt", "numa"});
            reason = "Please input one or more of 'cpu', 'mem', 'disk', 'network', 'osrt' or 'numa'";
            break;
        case 9:  // ACL_PROF_HOST_SYS_USAGE
            ok = options_in(v, {"cpu", "mem"});
            reason = "Please input 'cpu' or 'mem'";
            break;
        case 16:  // ACL_PROF_PATH
            ok = true;
            reason = "";
            s.path_config = v;
            if (s.initialized && !v.empty()) s.result_path = v;
            break;
        default:
            return fail(ACL_ERROR_INTERNAL_ERROR,
                        "aclprofSetConfig: configType " + std::to_string(type) +
                            " is not emulated by the CANN emulation");
    }
    if (!ok)
        return fail(ACL_ERROR_INVALID_PROFILING_CONFIG, "aclprofSetConfig: EK0001 value '" + v + "' of configType " +
                                                            std::to_string(type) + " is invalid: " + reason);
    s.set_config[type] = v;
    return ACL_SUCCESS;
}

// ---- start, warmup, stop -----------------------------------------------------------------------
CANN_API aclError aclprofWarmup(const aclprofConfig* cfg) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofWarmup");
    if (!cfg) return fail(ACL_ERROR_INVALID_PARAM, "aclprofWarmup: EK0006 profilerConfig is nullptr");
    if (aclError rc = precheck_config("aclprofWarmup", cfg)) return rc;
    if (!s.initialized)  // no auto-init here, unlike aclprofStart
        return fail(ACL_ERROR_PROF_NOT_RUN, "aclprofWarmup: EK0002 aclprofInit must be called before aclprofWarmup");
    if (s.acl_api_ready)
        return fail(ACL_ERROR_PROF_API_CONFLICT,
                    "aclprofWarmup: EK0002 aclprofWarmup cannot be called after aclprofStart");
    if (aclError rc = start_devices(s, cfg, "aclprofWarmup")) return rc;
    s.warmup = true;
    return ACL_SUCCESS;
}

// A null config: CANN 9.1.0 starts a default configuration on every active device; not emulated (torch_npu
// always passes its config), so it fails by name. Without aclprofInit, 9.1.0 initialises itself with the
// ACL_PROF_PATH config or "./" (commit "aclprofStart不依赖aclprofInit"). A second start before a stop
// returns success if its switches agree with the running devices' (and starts nothing new), and
// ACL_ERROR_INVALID_PROFILING_CONFIG if not; the document says a repeated start fails, the code does not.
CANN_API aclError aclprofStart(const aclprofConfig* cfg) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofStart");
    if (!cfg)
        return fail(ACL_ERROR_INTERNAL_ERROR,
                    "aclprofStart: a null profilerConfig (CANN's default configuration) is not emulated");
    if (aclError rc = precheck_config("aclprofStart", cfg)) return rc;
    if (!s.initialized) {
        s.result_path = s.path_config.empty() ? "./" : s.path_config;
        s.initialized = true;
    }
    if (s.repeat_invoking) return check_consistency(s, cfg, "aclprofStart");
    if ((cfg->dataTypeConfig & PROF_AICORE_METRICS) && cfg->aicoreMetrics != ACL_AICORE_NONE &&
        (cfg->aicoreMetrics < 0 || cfg->aicoreMetrics > ACL_AICORE_METRICS_LAST))
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofStart: EK0001 aicoreMetrics " +
                                                 std::to_string(cfg->aicoreMetrics) +
                                                 " is not supported on the current platform");
    if (s.warmup) {
        s.warmup = false;  // ChangeProfWarmupToStart: the warmed-up tasks become the started ones
    } else if (aclError rc = start_devices(s, cfg, "aclprofStart")) {
        return rc;
    }
    s.repeat_invoking = true;
    s.acl_api_ready = true;
    return ACL_SUCCESS;
}

// Not initialised: success without doing anything (CANN 9.1.0's ProfStop; the document says it fails).
// Initialised: every running device stops (not only the config's), after the config's switches were
// checked against those its running devices started with; devices never started are skipped.
CANN_API aclError aclprofStop(const aclprofConfig* cfg) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, "aclprofStop");
    if (!s.initialized) return ACL_SUCCESS;
    if (!cfg) {
        if (s.tasks.empty()) return ACL_SUCCESS;  // ProfGetCurrentConfig found no running device
        return fail(ACL_ERROR_INTERNAL_ERROR,
                    "aclprofStop: a null profilerConfig (CANN's current configuration) is not emulated");
    }
    if (aclError rc = precheck_config("aclprofStop", cfg)) return rc;
    if (aclError rc = check_consistency(s, cfg, "aclprofStop")) return rc;
    for (auto it = s.tasks.begin(); it != s.tasks.end();) {
        if (it->first == PROF_DEFAULT_HOST_ID && it->second.count > 1) {
            it->second.count--;
            ++it;
        } else {
            it = s.tasks.erase(it);
        }
    }
    s.repeat_invoking = false;
    s.acl_api_ready = false;
    s.warmup = false;
    return ACL_SUCCESS;
}

// ---- features and callbacks (looked up in libmsprofiler.so) -------------------------------------
// The layout of msprof's common/config/feature_manager.h, virtual destructors included (torch_npu's
// profiler/feature_mgr.h declares the same).
struct FeatureInfo {
    char compatibility[16];
    char featureVersion[16];
    char affectedComponent[16];
    char affectedComponentVersion[16];
    char infoLog[128];
    FeatureInfo() = default;
    virtual ~FeatureInfo() {}
};
struct FeatureRecord {
    char featureName[64];
    FeatureInfo info;
    FeatureRecord() = default;
    FeatureRecord(const char* name, const char* log) {
        std::snprintf(featureName, sizeof(featureName), "%s", name);
        std::snprintf(info.compatibility, 16, "1");
        std::snprintf(info.featureVersion, 16, "2");
        std::snprintf(info.affectedComponent, 16, "all");
        std::snprintf(info.affectedComponentVersion, 16, "all");
        std::snprintf(info.infoLog, 128, "%s", log);
    }
    virtual ~FeatureRecord() {}
};

// FEATURE_V1 and FEATURE_V2_TABLE (feature_manager.cpp): V2 lists ATTR and MemoryAccess on
// CHIP_V4_1_0 (the Ascend910B family), everything else gets V1's ATTR.
static FeatureRecord* features(bool v2, size_t* size) {
    static FeatureRecord* v1 = new FeatureRecord[1]{{"ATTR", "It not support feature: ATTR!"}};
    static FeatureRecord* v2_910b = new FeatureRecord[2]{{"ATTR", "It not support feature: ATTR!"},
                                                         {"MemoryAccess", "It not support feature: MEMORY_ACCESS!"}};
    if (v2 && config().soc.rfind("Ascend910B", 0) == 0) {
        *size = 2;
        return v2_910b;
    }
    *size = 1;
    return v1;
}
static aclError get_features(const char* api, bool v2, size_t* size, void** data) {
    count(state(), api);
    if (!data || *data || !size)
        return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": features data or size is null, or data is not null");
    *data = features(v2, size);
    return ACL_SUCCESS;
}
CANN_API aclError aclprofGetSupportedFeatures(size_t* size, void** data) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return get_features("aclprofGetSupportedFeatures", false, size, data);
}
CANN_API aclError aclprofGetSupportedFeaturesV2(size_t* size, void** data) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return get_features("aclprofGetSupportedFeaturesV2", true, size, data);
}
// ProfAclRegisterDeviceCallback: enables start-on-aclrtSetDevice for devices set later; there is
// nothing to start on them here.
CANN_API aclError aclprofRegisterDeviceCallback() {
    std::lock_guard<std::mutex> lock(state().mutex);
    count(state(), "aclprofRegisterDeviceCallback");
    return ACL_SUCCESS;
}

// MsprofTxManager::MarkEx: fails (PROFILING_FAILED, in CANN's log only) unless a start enabled
// ACL_PROF_MSPROFTX; torch_npu's mstx.mark ignores the result.
CANN_API aclError aclprofMarkEx(const char* msg, size_t length, aclrtStream stream) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!msproftx_on(s)) {
        count(s, "aclprofMarkEx (msproftx off)");
        return PROFILING_FAILED;
    }
    if (!msg || !stream || std::strlen(msg) != length)
        return fail(PROFILING_FAILED, "aclprofMarkEx: EK0001 invalid input param for markEx");
    if (length < 1 || length > kMarkMessageMax)
        return fail(PROFILING_FAILED, "aclprofMarkEx: the length of the message should be in range of 1~155");
    count(s, "aclprofMarkEx");
    return ACL_SUCCESS;
}

// ---- step info (libascendcl.so; torch_npu's legacy E2E profiler) ---------------------------------
CANN_API aclprofStepInfo* aclprofCreateStepInfo() {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    return new aclprofStepInfo{false, false, s.step_index++};
}
CANN_API void aclprofDestroyStepInfo(aclprofStepInfo* info) {
    if (!info) {
        fail(ACL_ERROR_INVALID_PARAM, "aclprofDestroyStepInfo: EK0006 stepInfo is nullptr");
        return;
    }
    delete info;
}
CANN_API aclError aclprofGetStepTimestamp(aclprofStepInfo* info, int tag, aclrtStream) {
    if (!info) return fail(ACL_ERROR_INVALID_PARAM, "aclprofGetStepTimestamp: EK0006 stepInfo is nullptr");
    if (tag == 0 && info->startFlag)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofGetStepTimestamp: this stepInfo already started");
    if (tag == 1 && info->endFlag)
        return fail(ACL_ERROR_INVALID_PARAM, "aclprofGetStepTimestamp: this stepInfo already stopped");
    (tag == 0 ? info->startFlag : info->endFlag) = true;
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    count(s, tag == 0 ? "aclprofGetStepTimestamp start" : "aclprofGetStepTimestamp end");
    return ACL_SUCCESS;
}

// ---- Msprof* reporting (libprofapi; torch_npu's NPU inductor kernels report launches) ------------
// CANN's avp/service: null data (or length 0) fails with PROFILING_FAILED; the rest is queued for the
// collectors, here counted and dropped.
CANN_API int32_t MsprofReportApi(uint32_t /*aging*/, const void* api) {
    if (!api) return fail(PROFILING_FAILED, "MsprofReportApi: api is null");
    std::lock_guard<std::mutex> lock(state().mutex);
    count(state(), "MsprofReportApi");
    return 0;
}
CANN_API int32_t MsprofReportCompactInfo(uint32_t /*aging*/, const void* data, uint32_t length) {
    if (!data || length == 0) return fail(PROFILING_FAILED, "MsprofReportCompactInfo: data is null or length is 0");
    std::lock_guard<std::mutex> lock(state().mutex);
    count(state(), "MsprofReportCompactInfo");
    return 0;
}
CANN_API int32_t MsprofReportAdditionalInfo(uint32_t /*aging*/, const void* data, uint32_t length) {
    if (!data || length == 0)
        return fail(PROFILING_FAILED, "MsprofReportAdditionalInfo: data is null or length is 0");
    std::lock_guard<std::mutex> lock(state().mutex);
    count(state(), "MsprofReportAdditionalInfo");
    return 0;
}
// A stable id per string (FNV-1a 64); UINT64_MAX for an empty one, as ServiceHashId.
CANN_API uint64_t MsprofGetHashId(const char* info, size_t length) {
    if (!info || length == 0) {
        fail(PROFILING_FAILED, "MsprofGetHashId: hashInfo is empty");
        return UINT64_MAX;
    }
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < length; ++i) h = (h ^ (unsigned char)info[i]) * 1099511628211ULL;
    std::lock_guard<std::mutex> lock(state().mutex);
    count(state(), "MsprofGetHashId");
    state().hashes.emplace(h, std::string(info, length));
    return h;
}
// Without the host's system counter frequency (no halGetAPIVersion in the emulated driver, so torch_npu
// also reads CLOCK_MONOTONIC_RAW), CANN's MsprofSysCycleTime is CLOCK_MONOTONIC_RAW in nanoseconds.
CANN_API uint64_t MsprofSysCycleTime() {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC_RAW, &now);
    return (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec;
}

// ---- for tests ---------------------------------------------------------------------------------
// JSON: {"initialized": bool, "result_path": str, "running_devices": [..], "calls": {name: n}}.
CANN_API const char* cann_emu_profiling_state() {
    static std::string out;
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto quote = [](const std::string& v) {
        std::string q = "\"";
        for (char c : v) {
            if (c == '"' || c == '\\') q += '\\';
            q += c;
        }
        return q + "\"";
    };
    out = "{\"initialized\": " + std::string(s.initialized ? "true" : "false") +
          ", \"result_path\": " + quote(s.result_path) + ", \"running_devices\": [";
    bool first = true;
    for (const auto& [dev, task] : s.tasks) {
        out += (first ? "" : ", ") + std::to_string(dev);
        first = false;
    }
    out += "], \"calls\": {";
    first = true;
    for (const auto& [name, n] : s.counts) {
        out += (first ? "" : ", ") + quote(name) + ": " + std::to_string(n);
        first = false;
    }
    out += "}}";
    return out.c_str();
}
