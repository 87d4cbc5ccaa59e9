// Compile options (acl_op_compiler.h: aclSetCompileopt / aclGetCompileoptSize / aclGetCompileopt) and
// the runtime's error queries. The emulation compiles nothing; it keeps the options torch_npu sets and
// answers CANN's defaults for Atlas A2 (binary kernels: ACL_OP_JIT_COMPILE "disable").
#include "cann_emu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {
constexpr int ACL_OP_JIT_COMPILE = 10;  // aclCompileOpt's 11th member
constexpr size_t kCompileOptSize = 256;
std::mutex g_mutex;
std::map<int, std::string>& options() {
    static std::map<int, std::string> o{{ACL_OP_JIT_COMPILE, "disable"}};
    return o;
}
}  // namespace

using namespace cann_emu;

CANN_API aclError aclSetCompileopt(int opt, const char* value) {
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclSetCompileopt: value is null");
    std::lock_guard<std::mutex> lock(g_mutex);
    options()[opt] = value;
    return ACL_SUCCESS;
}
CANN_API size_t aclGetCompileoptSize(int opt) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (opt == ACL_OP_JIT_COMPILE) return kCompileOptSize;
    auto it = options().find(opt);
    return it == options().end() || it->second.empty() ? 0 : it->second.size() + 1;
}
CANN_API aclError aclGetCompileopt(int opt, char* value, size_t length) {
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclGetCompileopt: value is null");
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = options().find(opt);
    std::string v = it == options().end() ? "" : it->second;
    if (v.size() + 1 > length)
        return fail(ACL_ERROR_INVALID_PARAM, "aclGetCompileopt: length " + std::to_string(length) + " is too small");
    std::memcpy(value, v.c_str(), v.size() + 1);
    return ACL_SUCCESS;
}

// aclCannAttr (acl_base_rt.h): 0 INF_NAN mode, 1 BF16, 2 JIT compile. Atlas A2 supports all three.
CANN_API aclError aclGetCannAttribute(int attr, int32_t* value) {
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclGetCannAttribute: value is null");
    if (attr < 0 || attr > 2)
        return fail(ACL_ERROR_INVALID_PARAM, "aclGetCannAttribute: attribute " + std::to_string(attr) + " is unknown");
    *value = 1;
    return ACL_SUCCESS;
}
CANN_API aclError aclGetCannAttributeList(const int** list, size_t* num) {
    static const int attrs[] = {0, 1, 2};
    if (!list || !num) return fail(ACL_ERROR_INVALID_PARAM, "aclGetCannAttributeList: null argument");
    *list = attrs;
    *num = 3;
    return ACL_SUCCESS;
}

// aclsysGetVersionStr: pkgName as CANN's package names ("runtime", "driver", ...); versionStr holds
// ACL_PKG_VERSION_MAX_SIZE (128) bytes. The driver reports its own version (CANN_EMU_DRIVER_VERSION,
// default 25.5.0), every CANN package the emulated CANN version.
CANN_API aclError aclsysGetVersionStr(char* pkg, char* version) {
    if (!pkg || !version) return fail(ACL_ERROR_INVALID_PARAM, "aclsysGetVersionStr: null argument");
    std::string v = config().cann_version;
    if (std::strcmp(pkg, "driver") == 0) {
        const char* d = std::getenv("CANN_EMU_DRIVER_VERSION");
        v = d && *d ? d : "25.5.0";
    }
    std::snprintf(version, 128, "%s", v.c_str());
    if (std::getenv("CANN_EMU_LOG")) std::fprintf(stderr, "cann_emu: aclsysGetVersionStr(%s) = %s\n", pkg, version);
    return ACL_SUCCESS;
}

// aclSysParamOpt (acl_base_rt.h): 0 deterministic, 1 debug kernel, 2 strong consistency, 3 early start.
static std::map<int, int64_t>& sys_params() {
    static std::map<int, int64_t> p;
    return p;
}
static aclError set_sys_param(const char* api, int opt, int64_t value) {
    if (opt < 0 || opt > 3) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": option " + std::to_string(opt) + " is unknown");
    std::lock_guard<std::mutex> lock(g_mutex);
    sys_params()[opt] = value;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetSysParamOpt(int opt, int64_t value) { return set_sys_param("aclrtSetSysParamOpt", opt, value); }
CANN_API aclError aclrtCtxSetSysParamOpt(int opt, int64_t value) { return set_sys_param("aclrtCtxSetSysParamOpt", opt, value); }
CANN_API aclError aclrtGetSysParamOpt(int opt, int64_t* value) {
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetSysParamOpt: value is null");
    if (opt < 0 || opt > 3) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetSysParamOpt: option " + std::to_string(opt) + " is unknown");
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = sys_params().find(opt);
    *value = it == sys_params().end() ? 0 : it->second;
    return ACL_SUCCESS;
}

// aclrtFloatOverflowMode: 0 saturation, 1 INF/NaN (the default on Atlas A2).
static int g_sat_mode = 1;
CANN_API aclError aclrtSetDeviceSatMode(int mode) {
    if (mode != 0 && mode != 1) return fail(ACL_ERROR_INVALID_PARAM, "aclrtSetDeviceSatMode: mode " + std::to_string(mode) + " is unknown");
    g_sat_mode = mode;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetDeviceSatMode(int* mode) {
    if (!mode) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceSatMode: mode is null");
    *mode = g_sat_mode;
    return ACL_SUCCESS;
}
