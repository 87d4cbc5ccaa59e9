// ACL runtime on host memory: devices, memory counted against a per-device capacity, streams and
// events, copies of every kind, synchronisation, device properties and versions.
// Work runs at launch, in the launching thread (so every stream order holds), unless CANN_EMU_ASYNC_STREAMS=1:
// then a collective runs on its stream's own thread, as a device runs it apart from the host, and what is
// launched behind unfinished work (on that stream, or on a stream waiting for its event) queues there too.
// Signatures follow CANN's public headers (hicann/runtime include/external/acl/acl_rt.h, acl_base_rt.h).
#include "cann_emu.h"

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace cann_emu {

static int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : fallback;
}

bool cann_version_below(const char* version, const char* bound) {
    // Part by part: numbers numerically, before any other part; other parts as strings; a missing part first.
    auto parts = [](const char* v) {
        std::vector<std::string> out(1);
        for (; *v; ++v) {
            if (*v == '.') out.emplace_back();
            else out.back().push_back(*v);
        }
        return out;
    };
    auto numeric = [](const std::string& p) { return !p.empty() && p.find_first_not_of("0123456789") == std::string::npos; };
    std::vector<std::string> a = parts(version), b = parts(bound);
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
        bool na = numeric(a[i]), nb = numeric(b[i]);
        if (na != nb) return na;
        if (na ? std::stoll(a[i]) != std::stoll(b[i]) : a[i] != b[i])
            return na ? std::stoll(a[i]) < std::stoll(b[i]) : a[i] < b[i];
    }
    return a.size() < b.size();
}

const Config& config() {
    // Never destroyed: static destructors (the operator counts' writer) and late runtime calls read it.
    static const Config& cfg = *new Config([] {
        Config c;
        c.devices = env_int("CANN_EMU_DEVICES", 8);
        const char* soc = std::getenv("CANN_EMU_SOC");
        c.soc = soc && *soc ? soc : "Ascend910B2";
        const char* gb = std::getenv("CANN_EMU_MEMORY_GB");
        c.capacity = (uint64_t)((gb && *gb ? std::atof(gb) : 64.0) * (1ULL << 30));
        const char* ver = std::getenv("CANN_EMU_CANN_VERSION");
        c.cann_version = ver && *ver ? ver : "9.1.0";
        const char* hccl_timeout = std::getenv("CANN_EMU_HCCL_TIMEOUT");
        c.hccl_timeout_s = hccl_timeout && *hccl_timeout ? std::atof(hccl_timeout) : 300.0;
        if (!(c.hccl_timeout_s > 0)) {
            std::fprintf(stderr, "cann_emu: CANN_EMU_HCCL_TIMEOUT=%s is not a positive number of seconds\n", hccl_timeout);
            std::abort();
        }
        const char* async_streams = std::getenv("CANN_EMU_ASYNC_STREAMS");
        c.async_streams = async_streams && std::strcmp(async_streams, "1") == 0;
        if (async_streams && *async_streams && !c.async_streams && std::strcmp(async_streams, "0") != 0) {
            std::fprintf(stderr, "cann_emu: CANN_EMU_ASYNC_STREAMS=%s is neither 1 nor 0\n", async_streams);
            std::abort();
        }
        if (c.devices < 1 || c.devices > 64) {
            std::fprintf(stderr, "cann_emu: CANN_EMU_DEVICES=%d is outside 1..64\n", c.devices);
            std::abort();
        }
        return c;
    }());
    return cfg;
}

static thread_local std::string t_last_error;

int fail(int code, const std::string& msg) {
    t_last_error = "cann_emu: " + msg;
    std::fprintf(stderr, "%s (status %d)\n", t_last_error.c_str(), code);
    return code;
}

int unimplemented(const char* name) {
    bool is_aclnn = std::strncmp(name, "aclnn", 5) == 0;
    return fail(is_aclnn ? ACLNN_ERR_INNER : ACL_ERROR_INTERNAL_ERROR,
                std::string(name) + " is not implemented by the CANN emulation");
}

static thread_local int t_device = -1;
int current_device() { return t_device; }

// ---- memory ------------------------------------------------------------------------------------
struct Allocation {
    int device;  // -1: host (aclrtMallocHost)
    size_t size;
};
static std::mutex g_mem_mutex;
static std::unordered_map<void*, Allocation> g_allocations;
static std::vector<uint64_t> g_used;  // bytes in use per device
static std::vector<uint64_t> g_peak;  // most bytes ever in use per device (aclrtGetMemUsageInfo)

static std::vector<uint64_t>& used() {
    if (g_used.empty()) g_used.assign(config().devices, 0);
    return g_used;
}
static std::vector<uint64_t>& peak() {
    if (g_peak.empty()) g_peak.assign(config().devices, 0);
    return g_peak;
}

static constexpr size_t kAlign = 512;  // device addresses on Ascend are 512-byte aligned for aclnn

static void* host_alloc(size_t size) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, size ? size : 1) != 0) return nullptr;
    return p;
}

// ---- streams and events ------------------------------------------------------------------------
struct Task {
    const char* what;
    std::function<int()> run;
};
struct Stream {
    int device;
    int id;
    // CANN_EMU_ASYNC_STREAMS=1 (guarded by g_async_mutex): the work not yet done, in stream order.
    std::deque<Task> queued;
    bool busy = false;       // a task of this stream is running (on its thread, or inline in a launching one)
    bool worker = false;     // the stream's thread was started
    bool destroyed = false;  // aclrtDestroyStream: the thread ends once the queue is empty
    int error = ACL_SUCCESS; // a queued task's failure, reported by the next synchronisation
    std::string error_what;
};
static int g_next_stream_id = 1;  // 0: the default stream
struct Event {
    uint32_t flags;
    bool recorded = false;
    double time_ms = 0;
    // CANN_EMU_ASYNC_STREAMS=1 (guarded by g_async_mutex): records are numbered; those not yet done are pending.
    // A wait is for the record latest when it was made, never satisfied by a later record done first.
    uint64_t recorded_seq = 0;
    std::set<uint64_t> pending;
};
static std::mutex g_obj_mutex;
static std::unordered_set<Stream*> g_streams;
// Shared with the queued records and waits that use an event, so that destroying it frees it once they ran.
static std::unordered_map<Event*, std::shared_ptr<Event>> g_events;

static double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// ---- stream order with CANN_EMU_ASYNC_STREAMS=1 ------------------------------------------------
// One mutex and one condition for every stream and event: a task ending, an event completing and an abort
// all wake every waiter, which re-checks its own condition (few streams, few waiters).
// Never destroyed: the streams' threads still wait on them while the process exits (glibc's destructor of a
// condition variable waits for its waiters).
static std::mutex& g_async_mutex = *new std::mutex;
static std::condition_variable& g_async_cv = *new std::condition_variable;
static uint64_t g_abort_epoch = 0;       // aclrtDeviceTaskAbort calls so far
static thread_local int t_task_depth = 0;  // > 0 while this thread runs a task: what it launches runs inside it
static std::vector<Stream*> g_default_streams;  // the null stream of each device (never destroyed)

static Stream* resolve(void* stream) {
    if (stream) return static_cast<Stream*>(stream);
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    if (g_default_streams.empty())
        for (int d = 0; d < config().devices; ++d) g_default_streams.push_back(new Stream{d, 0});
    return g_default_streams[t_device < 0 ? 0 : t_device];
}

static int run_task(const std::function<int()>& task) {
    ++t_task_depth;
    int rc = task();
    --t_task_depth;
    return rc;
}

// The stream's own thread: runs its queued tasks in order, one at a time, never beside an inline one.
static void stream_thread(Stream* s) {
    t_device = s->device;
    std::unique_lock<std::mutex> lock(g_async_mutex);
    for (;;) {
        g_async_cv.wait(lock, [s] { return (!s->busy && !s->queued.empty()) || (s->destroyed && s->queued.empty()); });
        if (s->queued.empty()) break;  // destroyed, nothing left
        Task task = std::move(s->queued.front());
        s->queued.pop_front();
        s->busy = true;
        uint64_t epoch = g_abort_epoch;
        lock.unlock();
        int rc = run_task(task.run);
        lock.lock();
        s->busy = false;
        // A task the abort ended is not a failure to report later: its waiters were told TASK_ABORT.
        if (rc != ACL_SUCCESS && s->error == ACL_SUCCESS && g_abort_epoch == epoch) {
            s->error = rc;
            s->error_what = task.what;
        }
        g_async_cv.notify_all();
    }
    delete s;
}

// Waits (g_async_mutex held) until ready() holds: ACL_SUCCESS, or TASK_ABORT when the device's tasks were stopped
// first (aclrtDeviceTaskAbort).
template <typename Ready>
static int wait_unless_aborted(std::unique_lock<std::mutex>& lock, Ready ready) {
    uint64_t epoch = g_abort_epoch;
    g_async_cv.wait(lock, [&] { return ready() || g_abort_epoch != epoch; });
    return g_abort_epoch != epoch ? ACL_ERROR_RT_DEVICE_TASK_ABORT : ACL_SUCCESS;
}

// Waits (lock held) until s has nothing unfinished, or the device's tasks were stopped; then takes its error.
static int drain(std::unique_lock<std::mutex>& lock, Stream* s, const char* api) {
    if (int rc = wait_unless_aborted(lock, [s] { return !s->busy && s->queued.empty(); })) return rc;
    int rc = s->error;
    if (rc != ACL_SUCCESS) {
        std::string what = s->error_what;
        s->error = ACL_SUCCESS;
        lock.unlock();
        fail(rc, std::string(api) + ": " + what + ", queued on stream " + std::to_string(s->id) + ", failed");
        lock.lock();
    }
    return rc;
}

int launch(void* stream, const char* what, std::function<int()> task, bool defer_always) {
    if (!config().async_streams || t_task_depth > 0) return run_task(task);
    Stream* s = resolve(stream);
    std::unique_lock<std::mutex> lock(g_async_mutex);
    bool now = !defer_always && !s->busy && s->queued.empty();
    static const bool trace = std::getenv("CANN_EMU_ASYNC_TRACE") != nullptr;
    if (trace) std::fprintf(stderr, "async %d %ld stream %d%s %s: %s\n", getpid(), (long)gettid(), s->id, stream ? "" : "(null)", what,
                            now ? "inline" : "queued");
    if (now) {
        s->busy = true;  // later launches on s queue behind this one
        lock.unlock();
        int rc = run_task(task);
        lock.lock();
        s->busy = false;
        g_async_cv.notify_all();
        return rc;
    }
    s->queued.push_back(Task{what, std::move(task)});
    if (!s->worker) {
        s->worker = true;
        std::thread(stream_thread, s).detach();  // never joined: it may outlive main at exit
    }
    g_async_cv.notify_all();
    return ACL_SUCCESS;
}

int launch_after(void* stream, std::function<int()> task) {
    if (config().async_streams && t_task_depth == 0) {
        Stream* s = resolve(stream);
        std::unique_lock<std::mutex> lock(g_async_mutex);
        if (int rc = drain(lock, s, "a launch that waits for its stream")) return rc;
    }
    return run_task(task);
}

// Every live stream of device, its null stream included.
static std::vector<Stream*> device_streams(int device) {
    resolve(nullptr);  // makes the null streams
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    std::vector<Stream*> streams;
    size_t null_stream = device < 0 ? 0 : size_t(device);  // as resolve: a thread without a device uses device 0's
    if (null_stream < g_default_streams.size()) streams.push_back(g_default_streams[null_stream]);
    for (Stream* s : g_streams)
        if (s->device == device) streams.push_back(s);
    return streams;
}

int drain_device(int device) {
    if (!config().async_streams || t_task_depth > 0) return ACL_SUCCESS;
    std::vector<Stream*> streams = device_streams(device);
    std::unique_lock<std::mutex> lock(g_async_mutex);
    int first = ACL_SUCCESS;
    for (Stream* s : streams) {
        int rc = drain(lock, s, "aclrtSynchronizeDevice");
        if (rc != ACL_SUCCESS && first == ACL_SUCCESS) first = rc;
        if (rc == ACL_ERROR_RT_DEVICE_TASK_ABORT) break;
    }
    return first;
}

void abort_streams(int device) {
    std::vector<Stream*> streams = device_streams(device);
    std::lock_guard<std::mutex> lock(g_async_mutex);
    ++g_abort_epoch;
    for (Stream* s : streams) {
        if (!s->queued.empty())
            std::fprintf(stderr, "cann_emu: aclrtDeviceTaskAbort dropped %zu task(s) queued on stream %d of device %d\n",
                         s->queued.size(), s->id, s->device);
        s->queued.clear();
        s->error = ACL_SUCCESS;
    }
    {
        // The dropped records never happen: their events count as done, so no later wait hangs on them.
        std::lock_guard<std::mutex> objects(g_obj_mutex);
        for (auto& entry : g_events) entry.second->pending.clear();
    }
    g_async_cv.notify_all();
}

}  // namespace cann_emu

using namespace cann_emu;

static int check_device(int32_t device) {
    if (device < 0 || device >= config().devices)
        return fail(ACL_ERROR_RT_INVALID_DEVICEID,
                    "device " + std::to_string(device) + " does not exist (CANN_EMU_DEVICES=" +
                        std::to_string(config().devices) + ")");
    return ACL_SUCCESS;
}

// ---- initialisation, errors, versions ----------------------------------------------------------
static bool g_initialized = false;

CANN_API aclError aclInit(const char* /*configPath*/) {
    if (g_initialized) return ACL_ERROR_REPEAT_INITIALIZE;
    g_initialized = true;
    return ACL_SUCCESS;
}
CANN_API aclError aclFinalize() {
    g_initialized = false;
    return ACL_SUCCESS;
}
CANN_API const char* aclGetRecentErrMsg() {
    static thread_local std::string returned;
    if (t_last_error.empty()) return nullptr;
    returned.swap(t_last_error);
    t_last_error.clear();
    return returned.c_str();
}
CANN_API void aclAppLog(int level, const char* func, const char* file, uint32_t line, const char* fmt, ...) {
    // As CANN, application logs go to the log files unless ASCEND_SLOG_PRINT_TO_STDOUT=1; the emulation
    // keeps no log files, so they are printed when asked for (or with CANN_EMU_LOG) and dropped otherwise.
    const char* to_stdout = std::getenv("ASCEND_SLOG_PRINT_TO_STDOUT");
    if (!std::getenv("CANN_EMU_LOG") && !(to_stdout && std::strcmp(to_stdout, "1") == 0)) return;
    va_list ap;
    va_start(ap, fmt);
    std::fprintf(stderr, "cann_emu log [%d] %s (%s:%u): ", level, func ? func : "", file ? file : "", line);
    std::vfprintf(stderr, fmt, ap);
    std::fprintf(stderr, "\n");
    va_end(ap);
}

struct aclCANNPackageVersion {
    char version[128];
    char majorVersion[64];
    char minorVersion[64];
    char releaseVersion[64];
    char patchVersion[64];
    char reserved[128];
};
CANN_API aclError aclsysGetCANNVersion(int /*aclCANNPackageName*/ name, aclCANNPackageVersion* v) {
    if (!v) return fail(ACL_ERROR_INVALID_PARAM, "aclsysGetCANNVersion: version is null");
    (void)name;  // every package of the emulation has the one version
    std::memset(v, 0, sizeof(*v));
    const std::string& ver = config().cann_version;
    std::snprintf(v->version, sizeof(v->version), "%s", ver.c_str());
    std::string parts[4];
    size_t start = 0;
    for (int i = 0; i < 4 && start <= ver.size(); ++i) {
        size_t dot = ver.find('.', start);
        parts[i] = ver.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        if (dot == std::string::npos) break;
        start = dot + 1;
    }
    std::snprintf(v->majorVersion, 64, "%s", parts[0].c_str());
    std::snprintf(v->minorVersion, 64, "%s", parts[1].c_str());
    std::snprintf(v->releaseVersion, 64, "%s", parts[2].c_str());
    std::snprintf(v->patchVersion, 64, "%s", parts[3].c_str());
    return ACL_SUCCESS;
}
CANN_API const char* aclrtGetSocName() { return config().soc.c_str(); }

// ---- devices -----------------------------------------------------------------------------------
CANN_API aclError aclrtGetDeviceCount(uint32_t* count) {
    if (!count) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceCount: count is null");
    *count = (uint32_t)config().devices;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetDevice(int32_t device) {
    if (int rc = check_device(device)) return rc;
    t_device = device;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetDevice(int32_t* device) {
    if (!device) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: deviceId is null");
    if (t_device < 0) {
        // As CANN: no context on this thread yet (torch_npu treats this as "not initialised").
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    *device = t_device;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtResetDevice(int32_t device) { return check_device(device); }
CANN_API aclError aclrtResetDeviceForce(int32_t device) { return check_device(device); }
// Work that ran at launch is done; queued work (CANN_EMU_ASYNC_STREAMS=1) is waited for. Each call is counted
// (audit.cpp).
CANN_API aclError aclrtSynchronizeDevice() {
    count_sync("aclrtSynchronizeDevice");
    return drain_device(t_device);
}
CANN_API aclError aclrtSynchronizeDeviceWithTimeout(int32_t /*timeout*/) {
    count_sync("aclrtSynchronizeDevice");
    return drain_device(t_device);
}

// Contexts: one per device; the handle is the device number + 1 (never null).
CANN_API aclError aclrtGetCurrentContext(aclrtContext* ctx) {
    if (!ctx) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetCurrentContext: context is null");
    if (t_device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *ctx = reinterpret_cast<aclrtContext>((intptr_t)t_device + 1);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetCurrentContext(aclrtContext ctx) {
    intptr_t d = reinterpret_cast<intptr_t>(ctx) - 1;
    if (int rc = check_device((int32_t)d)) return rc;
    t_device = (int)d;
    return ACL_SUCCESS;
}

// aclrtDevAttr values (acl_rt.h)
CANN_API aclError aclrtGetDeviceInfo(uint32_t device, int attr, int64_t* value) {
    if (int rc = check_device((int32_t)device)) return rc;
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceInfo: value is null");
    switch (attr) {
        case 1: *value = 6; return ACL_SUCCESS;     // AI CPU cores
        case 101: *value = 24; return ACL_SUCCESS;  // AI cores (910B2: 24 cube cores)
        case 102: *value = 24; return ACL_SUCCESS;  // cube cores
        case 201: *value = 48; return ACL_SUCCESS;  // vector cores
        case 301: *value = (int64_t)config().capacity; return ACL_SUCCESS;
        default:
            return fail(ACL_ERROR_INVALID_PARAM,
                        "aclrtGetDeviceInfo: attribute " + std::to_string(attr) + " is not emulated");
    }
}
// aclDeviceInfo: 0 AI core num, 1 vector core num, 2 L2 size
CANN_API aclError aclGetDeviceCapability(uint32_t device, int info, int64_t* value) {
    if (int rc = check_device((int32_t)device)) return rc;
    if (!value) return fail(ACL_ERROR_INVALID_PARAM, "aclGetDeviceCapability: value is null");
    switch (info) {
        case 0: *value = 24; return ACL_SUCCESS;
        case 1: *value = 48; return ACL_SUCCESS;
        case 2: *value = 192LL << 20; return ACL_SUCCESS;
        default:
            return fail(ACL_ERROR_INVALID_PARAM,
                        "aclGetDeviceCapability: info " + std::to_string(info) + " is not emulated");
    }
}
CANN_API aclError aclrtGetRunMode(int* mode) {
    if (!mode) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetRunMode: runMode is null");
    *mode = 1;  // ACL_HOST: the program runs on the host beside the device
    return ACL_SUCCESS;
}
CANN_API aclError aclrtDeviceCanAccessPeer(int32_t* can, int32_t device, int32_t peer) {
    if (int rc = check_device(device)) return rc;
    if (int rc = check_device(peer)) return rc;
    if (!can) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceCanAccessPeer: canAccessPeer is null");
    *can = device != peer;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtDeviceEnablePeerAccess(int32_t peer, uint32_t /*flags*/) { return check_device(peer); }

// ---- memory ------------------------------------------------------------------------------------
CANN_API aclError aclrtMalloc(void** ptr, size_t size, int /*policy*/) {
    if (!ptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: devPtr is null");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: size is 0");
    int dev = t_device;
    if (dev < 0) return fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtMalloc: no device set on this thread");
    {
        std::lock_guard<std::mutex> lock(g_mem_mutex);
        auto& u = used();
        if (u[dev] + size > config().capacity) {
            return fail(ACL_ERROR_RT_MEMORY_ALLOCATION,
                        "aclrtMalloc: out of device memory on device " + std::to_string(dev) + ": " +
                            std::to_string(size) + " bytes requested, " + std::to_string(u[dev]) +
                            " of " + std::to_string(config().capacity) + " in use");
        }
        void* p = host_alloc(size);
        if (!p) return fail(ACL_ERROR_BAD_ALLOC, "aclrtMalloc: the host has no memory for " +
                                                     std::to_string(size) + " bytes");
        u[dev] += size;
        peak()[dev] = std::max(peak()[dev], u[dev]);
        g_allocations[p] = {dev, size};
        *ptr = p;
    }
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMallocAlign32(void** ptr, size_t size, int policy) { return aclrtMalloc(ptr, size, policy); }
CANN_API aclError aclrtFree(void* ptr) {
    if (!ptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtFree: devPtr is null");
    drain_device(t_device);  // as CANN's aclrtFree, which synchronises the device: queued work may use ptr
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto it = g_allocations.find(ptr);
    if (it == g_allocations.end() || it->second.device < 0)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtFree: not a device allocation");
    used()[it->second.device] -= it->second.size;
    g_allocations.erase(it);
    std::free(ptr);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMallocHost(void** ptr, size_t size) {
    if (!ptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: hostPtr is null");
    void* p = host_alloc(size);
    if (!p) return fail(ACL_ERROR_BAD_ALLOC, "aclrtMallocHost: no host memory");
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    g_allocations[p] = {-1, size};
    *ptr = p;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtFreeHost(void* ptr) {
    if (!ptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: hostPtr is null");
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto it = g_allocations.find(ptr);
    if (it == g_allocations.end() || it->second.device >= 0)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: not a host allocation of aclrtMallocHost");
    g_allocations.erase(it);
    std::free(ptr);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetMemInfo(int /*attr*/, size_t* free_bytes, size_t* total) {
    if (!free_bytes || !total) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetMemInfo: null output");
    int dev = t_device;
    if (dev < 0) return fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetMemInfo: no device set on this thread");
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    *total = config().capacity;
    *free_bytes = config().capacity - used()[dev];
    return ACL_SUCCESS;
}

// ---- virtual memory: what torch_npu's expandable segments call ----------------------------------
// acl_rt.h's family: reserve a range of virtual addresses, create physical memory, map it into the
// range, unmap, free, release. The range is host address space without backing (mmap PROT_NONE); a
// physical handle is a memfd of its size, counted against the device's capacity as aclrtMalloc's
// memory is (so aclrtGetMemInfo and the OOM check see it); a map puts the handle's bytes at an address
// of a reservation (MAP_FIXED|MAP_SHARED), and an unmap gives that address back to PROT_NONE. Torch's
// copies and the operators then read and write mapped addresses like any device address.
struct aclrtMemLocation {
    uint32_t id;
    int type;  // aclrtMemLocationType: ACL_MEM_LOCATION_TYPE_DEVICE = 1
};
struct aclrtPhysicalMemProp {
    int handleType;      // ACL_MEM_HANDLE_TYPE_NONE = 0
    int allocationType;  // ACL_MEM_ALLOCATION_TYPE_PINNED = 0
    int memAttr;         // aclrtMemAttr
    aclrtMemLocation location;
    uint64_t reserve;
};
struct PhysicalMemory {
    int device;
    size_t size;
    int fd;
};
struct Mapping {
    size_t size;
    PhysicalMemory* handle;
};
static std::map<char*, size_t> g_reservations;  // start -> size
static std::map<char*, Mapping> g_mappings;      // start -> what is mapped there
static std::unordered_set<PhysicalMemory*> g_physical;

// The reservation holding [p, p + size), or null.
static const std::pair<char* const, size_t>* reservation_of(char* p, size_t size) {
    auto it = g_reservations.upper_bound(p);
    if (it == g_reservations.begin()) return nullptr;
    --it;
    return p + size <= it->first + it->second ? &*it : nullptr;
}

CANN_API aclError aclrtReserveMemAddress(void** virPtr, size_t size, size_t alignment, void* expectPtr,
                                         uint64_t /*flags*/) {
    if (!virPtr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtReserveMemAddress: virPtr is null");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtReserveMemAddress: size is 0");
    // CANN's document: alignment and expectPtr are reserved and must be 0.
    if (alignment != 0 || expectPtr != nullptr)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtReserveMemAddress: alignment and expectPtr must be 0");
    // Device virtual addresses start on a huge page (2 MiB), as the driver maps them; torch_npu aligns
    // blocks of 2 MiB or more to base_addr_aligned_kb relative to that address.
    constexpr size_t kHugePage = 2u << 20;
    char* p = static_cast<char*>(
        mmap(nullptr, size + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (p == MAP_FAILED)
        return fail(ACL_ERROR_BAD_ALLOC, "aclrtReserveMemAddress: no virtual address range of " +
                                             std::to_string(size) + " bytes");
    char* start = p + (kHugePage - reinterpret_cast<uintptr_t>(p) % kHugePage) % kHugePage;
    if (start > p) munmap(p, start - p);
    munmap(start + size, p + size + kHugePage - (start + size));
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    g_reservations[start] = size;
    *virPtr = start;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtReleaseMemAddress(void* virPtr) {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto it = g_reservations.find(static_cast<char*>(virPtr));
    if (it == g_reservations.end())
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtReleaseMemAddress: not the start of a reserved range");
    auto mapped = g_mappings.lower_bound(it->first);
    if (mapped != g_mappings.end() && mapped->first < it->first + it->second)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtReleaseMemAddress: the range still has memory mapped "
                                             "(aclrtUnmapMem first)");
    munmap(it->first, it->second);
    g_reservations.erase(it);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMallocPhysical(void** handle, size_t size, const aclrtPhysicalMemProp* prop,
                                      uint64_t flags) {
    if (!handle || !prop) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocPhysical: handle or prop is null");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocPhysical: size is 0");
    if (flags != 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocPhysical: flags must be 0");
    if (prop->handleType != 0 || prop->allocationType != 0 || prop->location.type != 1)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocPhysical: only handleType NONE, allocationType "
                                             "PINNED and location DEVICE are supported (acl_rt.h)");
    int dev = static_cast<int>(prop->location.id);
    if (int rc = check_device(dev)) return rc;
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto& u = used();
    if (u[dev] + size > config().capacity)
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION,
                    "aclrtMallocPhysical: out of device memory on device " + std::to_string(dev) + ": " +
                        std::to_string(size) + " bytes requested, " + std::to_string(u[dev]) + " of " +
                        std::to_string(config().capacity) + " in use");
    int fd = memfd_create("cann_emu_physical", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
        if (fd >= 0) close(fd);
        return fail(ACL_ERROR_BAD_ALLOC, "aclrtMallocPhysical: the host has no memory for " +
                                             std::to_string(size) + " bytes");
    }
    auto* memory = new PhysicalMemory{dev, size, fd};
    g_physical.insert(memory);
    u[dev] += size;
    peak()[dev] = std::max(peak()[dev], u[dev]);
    *handle = memory;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtFreePhysical(void* handle) {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto* memory = static_cast<PhysicalMemory*>(handle);
    if (!g_physical.count(memory)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreePhysical: not a physical handle");
    for (auto& [start, mapping] : g_mappings)
        if (mapping.handle == memory)
            return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreePhysical: the handle is still mapped (aclrtUnmapMem first)");
    used()[memory->device] -= memory->size;
    close(memory->fd);
    g_physical.erase(memory);
    delete memory;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMapMem(void* virPtr, size_t size, size_t offset, void* handle, uint64_t flags) {
    if (flags != 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMapMem: flags must be 0");
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto* memory = static_cast<PhysicalMemory*>(handle);
    if (!g_physical.count(memory)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMapMem: not a physical handle");
    char* start = static_cast<char*>(virPtr);
    if (size == 0 || offset + size > memory->size)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMapMem: offset + size exceeds the handle's " +
                                                 std::to_string(memory->size) + " bytes");
    if (!reservation_of(start, size))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMapMem: the address range is not inside a reservation");
    auto next = g_mappings.lower_bound(start);
    bool overlaps = (next != g_mappings.end() && next->first < start + size) ||
                    (next != g_mappings.begin() && std::prev(next)->first + std::prev(next)->second.size > start);
    if (overlaps) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMapMem: the address range is already mapped");
    void* p = mmap(start, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memory->fd, static_cast<off_t>(offset));
    if (p == MAP_FAILED) return fail(ACL_ERROR_BAD_ALLOC, "aclrtMapMem: mmap failed");
    g_mappings[start] = {size, memory};
    return ACL_SUCCESS;
}
CANN_API aclError aclrtUnmapMem(void* virPtr) {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto it = g_mappings.find(static_cast<char*>(virPtr));
    if (it == g_mappings.end()) return fail(ACL_ERROR_INVALID_PARAM, "aclrtUnmapMem: nothing is mapped at this address");
    // Back to reserved, unbacked address space.
    mmap(it->first, it->second.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    g_mappings.erase(it);
    return ACL_SUCCESS;
}

// acl_rt.h's aclrtMemUsageInfo. CANN reports one row per component (runtime, HCCL, the app, ...); the
// emulation has one: the device memory of aclrtMalloc, which is all torch_npu's allocator takes.
struct aclrtMemUsageInfo {
    char name[32];
    uint64_t curMemSize;
    uint64_t memPeakSize;
    size_t reserved[8];
};
CANN_API aclError aclrtGetMemUsageInfo(int32_t device, aclrtMemUsageInfo* info, size_t input_num,
                                       size_t* output_num) {
    if (int rc = check_device(device)) return rc;
    if (!info || !output_num)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetMemUsageInfo: memUsageInfo or outputNum is null");
    *output_num = 0;
    if (input_num == 0) return ACL_SUCCESS;
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    std::memset(&info[0], 0, sizeof(info[0]));
    std::snprintf(info[0].name, sizeof(info[0].name), "%s", "aclrtMalloc");
    info[0].curMemSize = used()[device];
    info[0].memPeakSize = peak()[device];
    *output_num = 1;
    return ACL_SUCCESS;
}

static aclError copy(const char* api, void* dst, size_t dest_max, const void* src, size_t count, int kind) {
    if (count == 0) return ACL_SUCCESS;
    if (!dst || !src) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": null address");
    if (count > dest_max)
        return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": count " + std::to_string(count) +
                                                 " exceeds destMax " + std::to_string(dest_max));
    if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_INTER_DEVICE_TO_DEVICE)
        return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": invalid kind " + std::to_string(kind));
    std::memmove(dst, src, count);
    return ACL_SUCCESS;
}
// A synchronous copy blocks the host until the stream's earlier work is done: counted as a sync by
// direction (ACL_MEMCPY_*, acl_rt.h).
CANN_API aclError aclrtMemcpy(void* dst, size_t dest_max, const void* src, size_t count, int kind) {
    static const char* const kinds[] = {"aclrtMemcpy host to host", "aclrtMemcpy host to device",
                                        "aclrtMemcpy device to host", "aclrtMemcpy device to device"};
    if (kind >= ACL_MEMCPY_HOST_TO_HOST && kind <= ACL_MEMCPY_DEVICE_TO_DEVICE) count_sync(kinds[kind]);
    else count_sync("aclrtMemcpy other");
    if (int rc = drain_device(t_device)) return rc;
    return copy("aclrtMemcpy", dst, dest_max, src, count, kind);
}
// An asynchronous copy in stream order. One with host memory on either side runs when the stream's earlier
// work is done, in the calling thread: the host buffer may be gone once the call returns.
static aclError copy_async(const char* api, void* dst, size_t dest_max, const void* src, size_t count, int kind,
                           aclrtStream stream) {
    auto task = [=]() { return copy(api, dst, dest_max, src, count, kind); };
    if (kind == ACL_MEMCPY_DEVICE_TO_DEVICE || kind == ACL_MEMCPY_INNER_DEVICE_TO_DEVICE)
        return launch(stream, api, task, false);
    return launch_after(stream, task);
}
CANN_API aclError aclrtMemcpyAsync(void* dst, size_t dest_max, const void* src, size_t count, int kind,
                                   aclrtStream stream) {
    return copy_async("aclrtMemcpyAsync", dst, dest_max, src, count, kind, stream);
}
CANN_API aclError aclrtMemcpyAsyncWithCondition(void* dst, size_t dest_max, const void* src, size_t count,
                                                int kind, aclrtStream stream) {
    return copy_async("aclrtMemcpyAsyncWithCondition", dst, dest_max, src, count, kind, stream);
}
CANN_API aclError aclrtMemcpy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                size_t height, int kind) {
    if (kind < 0 || kind > ACL_MEMCPY_INTER_DEVICE_TO_DEVICE)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy2d: invalid kind");
    if (width > dpitch || width > spitch) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy2d: width exceeds pitch");
    for (size_t r = 0; r < height; ++r)
        std::memmove((char*)dst + r * dpitch, (const char*)src + r * spitch, width);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMemcpy2dAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, int kind, aclrtStream stream) {
    return launch_after(stream, [=]() { return aclrtMemcpy2d(dst, dpitch, src, spitch, width, height, kind); });
}
CANN_API aclError aclrtMemset(void* ptr, size_t max_count, int32_t value, size_t count) {
    if (count > max_count) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: count exceeds maxCount");
    if (count) std::memset(ptr, value, count);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtMemsetAsync(void* ptr, size_t max_count, int32_t value, size_t count, aclrtStream stream) {
    if (count > max_count) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemsetAsync: count exceeds maxCount");
    return launch(stream, "aclrtMemsetAsync", [=]() { return aclrtMemset(ptr, max_count, value, count); }, false);
}

// ---- streams -----------------------------------------------------------------------------------
static aclError make_stream(aclrtStream* stream, const char* api) {
    if (!stream) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": stream is null");
    if (t_device < 0) return fail(ACL_ERROR_RT_CONTEXT_NULL, std::string(api) + ": no device set on this thread");
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    auto* s = new Stream{t_device, g_next_stream_id++};
    g_streams.insert(s);
    *stream = s;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtCreateStream(aclrtStream* stream) { return make_stream(stream, "aclrtCreateStream"); }
CANN_API aclError aclrtCreateStreamWithConfig(aclrtStream* stream, uint32_t, uint32_t) {
    return make_stream(stream, "aclrtCreateStreamWithConfig");
}
CANN_API aclError aclrtDestroyStream(aclrtStream stream) {
    auto* s = static_cast<Stream*>(stream);
    {
        std::lock_guard<std::mutex> lock(g_obj_mutex);
        if (!g_streams.erase(s)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyStream: unknown stream");
    }
    std::lock_guard<std::mutex> lock(g_async_mutex);
    if (s->worker) {  // its thread frees it once its queue is empty
        s->destroyed = true;
        g_async_cv.notify_all();
    } else {
        delete s;
    }
    return ACL_SUCCESS;
}
CANN_API aclError aclrtDestroyStreamForce(aclrtStream stream) { return aclrtDestroyStream(stream); }
static aclError synchronize_stream(aclrtStream stream) {
    count_sync("aclrtSynchronizeStream");
    if (!config().async_streams || t_task_depth > 0) return ACL_SUCCESS;  // work ran at launch
    Stream* s = resolve(stream);
    std::unique_lock<std::mutex> lock(g_async_mutex);
    return drain(lock, s, "aclrtSynchronizeStream");
}
CANN_API aclError aclrtSynchronizeStream(aclrtStream stream) { return synchronize_stream(stream); }
CANN_API aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t) { return synchronize_stream(stream); }
CANN_API aclError aclrtStreamQuery(aclrtStream stream, int* status) {
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamQuery: status is null");
    *status = 0;  // ACL_STREAM_STATUS_COMPLETE
    if (config().async_streams) {
        Stream* s = resolve(stream);
        std::lock_guard<std::mutex> lock(g_async_mutex);
        if (s->busy || !s->queued.empty()) *status = 1;  // ACL_STREAM_STATUS_NOT_READY
    }
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetStreamFailureMode(aclrtStream, uint64_t) { return ACL_SUCCESS; }
static std::shared_ptr<Event> find_event(aclrtEvent event);
static std::string unknown_event(aclrtEvent event);
static bool done(const Event* e, uint64_t seq) { return !e->pending.count(seq); }  // g_async_mutex held
static bool complete(const Event* e) { return done(e, e->recorded_seq); }
// The stream waits for the event's latest record: queued behind it when that record is not done yet.
CANN_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamWaitEvent: event is null");
    if (!config().async_streams) return ACL_SUCCESS;  // the recorded work is done already
    std::shared_ptr<Event> e = find_event(event);
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamWaitEvent: " + unknown_event(event));
    uint64_t seq;
    {
        std::lock_guard<std::mutex> lock(g_async_mutex);
        if (complete(e.get())) return ACL_SUCCESS;
        seq = e->recorded_seq;
    }
    return launch(stream, "aclrtStreamWaitEvent", [e, seq]() {
        std::unique_lock<std::mutex> lock(g_async_mutex);
        return wait_unless_aborted(lock, [&] { return done(e.get(), seq); });
    }, true);
}

// ---- events ------------------------------------------------------------------------------------
static aclError make_event(aclrtEvent* event, uint32_t flags, const char* api) {
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": event is null");
    auto e = std::make_shared<Event>();
    e->flags = flags;
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    g_events[e.get()] = e;
    *event = e.get();
    return ACL_SUCCESS;
}
CANN_API aclError aclrtCreateEvent(aclrtEvent* event) { return make_event(event, 0, "aclrtCreateEvent"); }
CANN_API aclError aclrtCreateEventWithFlag(aclrtEvent* event, uint32_t flag) {
    return make_event(event, flag, "aclrtCreateEventWithFlag");
}
CANN_API aclError aclrtCreateEventExWithFlag(aclrtEvent* event, uint32_t flag) {
    return make_event(event, flag, "aclrtCreateEventExWithFlag");
}
static std::string unknown_event(aclrtEvent event) {
    char text[96];
    std::snprintf(text, sizeof text, "event %p is not a live event of this process (never created, or destroyed)", event);
    return text;
}
static std::shared_ptr<Event> find_event(aclrtEvent event) {
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    auto it = g_events.find(static_cast<Event*>(event));
    return it == g_events.end() ? nullptr : it->second;
}
CANN_API aclError aclrtDestroyEvent(aclrtEvent event) {
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    if (!g_events.erase(static_cast<Event*>(event)))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyEvent: " + unknown_event(event));
    return ACL_SUCCESS;
}
CANN_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    std::shared_ptr<Event> e = find_event(event);
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtRecordEvent: " + unknown_event(event));
    uint64_t seq;
    {
        std::lock_guard<std::mutex> lock(g_async_mutex);
        e->recorded = true;
        seq = ++e->recorded_seq;
        e->pending.insert(seq);
    }
    return launch(stream, "aclrtRecordEvent", [e, seq]() {
        std::lock_guard<std::mutex> lock(g_async_mutex);
        e->time_ms = now_ms();
        e->pending.erase(seq);
        g_async_cv.notify_all();
        return ACL_SUCCESS;
    }, false);
}
CANN_API aclError aclrtResetEvent(aclrtEvent event, aclrtStream) {
    std::shared_ptr<Event> e = find_event(event);
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtResetEvent: " + unknown_event(event));
    e->recorded = false;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSynchronizeEvent(aclrtEvent event) {
    count_sync("aclrtSynchronizeEvent");
    std::shared_ptr<Event> e = find_event(event);
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtSynchronizeEvent: " + unknown_event(event));
    std::unique_lock<std::mutex> lock(g_async_mutex);
    return wait_unless_aborted(lock, [&] { return complete(e.get()); });
}
CANN_API aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t) { return aclrtSynchronizeEvent(event); }
CANN_API aclError aclrtQueryEventStatus(aclrtEvent event, int* status) {
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventStatus: status is null");
    std::shared_ptr<Event> e = find_event(event);
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventStatus: " + unknown_event(event));
    std::lock_guard<std::mutex> lock(g_async_mutex);
    *status = complete(e.get()) ? 1 : 0;  // ACL_EVENT_RECORDED_STATUS_COMPLETE, _NOT_READY
    return ACL_SUCCESS;
}
CANN_API aclError aclrtQueryEventWaitStatus(aclrtEvent event, int* status) {
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventWaitStatus: status is null");
    if (!find_event(event)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventWaitStatus: " + unknown_event(event));
    *status = 0;  // ACL_EVENT_WAIT_STATUS_COMPLETE
    return ACL_SUCCESS;
}
CANN_API aclError aclrtEventElapsedTime(float* ms, aclrtEvent start, aclrtEvent end) {
    std::shared_ptr<Event> s = find_event(start);
    std::shared_ptr<Event> e = find_event(end);
    if (!ms) return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: ms is null");
    if (!s) return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: start: " + unknown_event(start));
    if (!e) return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: end: " + unknown_event(end));
    if (!s->recorded || !e->recorded)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: an event was not recorded");
    *ms = (float)(e->time_ms - s->time_ms);
    return ACL_SUCCESS;
}

// ---- driver (libascend_hal.so): torch_npu counts devices with drvGetDevNum through ctypes ------
CANN_API int drvGetDevNum(uint32_t* count) {
    if (!count) return 1;  // DRV_ERROR_INVALID_VALUE
    *count = (uint32_t)config().devices;
    return 0;
}

CANN_API aclError aclrtStreamGetId(aclrtStream stream, int32_t* id) {
    if (!id) return fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamGetId: streamId is null");
    if (!stream) {
        *id = 0;
        return ACL_SUCCESS;
    }
    std::lock_guard<std::mutex> lock(g_obj_mutex);
    auto* s = static_cast<Stream*>(stream);
    if (!g_streams.count(s)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamGetId: unknown stream");
    *id = s->id;
    return ACL_SUCCESS;
}

// ---- timeouts, callbacks, status ---------------------------------------------------------------
static uint64_t g_op_timeout_us = 0;
CANN_API aclError aclrtSetOpExecuteTimeOutV2(uint64_t timeout, uint64_t* actual) {
    g_op_timeout_us = timeout;
    if (actual) *actual = timeout;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetOpExecuteTimeOut(uint32_t timeout) {
    g_op_timeout_us = (uint64_t)timeout * 1000000ULL;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetOpExecuteTimeout(uint32_t* timeout_ms) {
    if (!timeout_ms) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetOpExecuteTimeout: timeoutMs is null");
    *timeout_ms = (uint32_t)(g_op_timeout_us / 1000);
    return ACL_SUCCESS;
}
CANN_API aclError aclrtSetOpWaitTimeout(uint32_t) { return ACL_SUCCESS; }
// Kept, never called: the emulation raises no asynchronous device exceptions.
static void* g_exception_callback = nullptr;
CANN_API aclError aclrtSetExceptionInfoCallback(void* callback) {
    g_exception_callback = callback;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtQueryDeviceStatus(int32_t device, int* status) {
    if (int rc = check_device(device)) return rc;
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryDeviceStatus: deviceStatus is null");
    *status = 0;  // ACL_RT_DEVICE_STATUS_NORMAL
    return ACL_SUCCESS;
}

// aclrtDevResLimitType: 0 cube cores, 1 vector cores (Ascend910B2: 24 and 48).
static std::mutex g_res_mutex;
static std::unordered_map<int64_t, uint32_t> g_res_limits;  // (device << 8 | type) -> limit
static uint32_t default_res_limit(int type) { return type == 0 ? 24 : 48; }
CANN_API aclError aclrtSetDeviceResLimit(int32_t device, int type, uint32_t value) {
    if (int rc = check_device(device)) return rc;
    if (type != 0 && type != 1) return fail(ACL_ERROR_INVALID_PARAM, "aclrtSetDeviceResLimit: type " + std::to_string(type) + " is unknown");
    std::lock_guard<std::mutex> lock(g_res_mutex);
    g_res_limits[((int64_t)device << 8) | type] = value;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetDeviceResLimit(int32_t device, int type, uint32_t* value) {
    if (int rc = check_device(device)) return rc;
    if (!value || (type != 0 && type != 1)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceResLimit: bad argument");
    std::lock_guard<std::mutex> lock(g_res_mutex);
    auto it = g_res_limits.find(((int64_t)device << 8) | type);
    *value = it == g_res_limits.end() ? default_res_limit(type) : it->second;
    return ACL_SUCCESS;
}
CANN_API aclError aclrtGetStreamResLimit(aclrtStream, int type, uint32_t* value) {
    if (t_device < 0) return fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetStreamResLimit: no device set on this thread");
    return aclrtGetDeviceResLimit(t_device, type, value);
}

struct aclrtUuid {
    char bytes[16];
};
// A fixed UUID per device: "cann-emu-dev" and the device number.
CANN_API aclError aclrtDeviceGetUuid(int32_t device, aclrtUuid* uuid) {
    if (int rc = check_device(device)) return rc;
    if (!uuid) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceGetUuid: uuid is null");
    std::memset(uuid->bytes, 0, 16);
    std::memcpy(uuid->bytes, "cann-emu-dev", 12);
    uuid->bytes[15] = (char)device;
    return ACL_SUCCESS;
}

// ---- graph capture (aclmdlRI*): not emulated; no stream is ever capturing --------------------
CANN_API aclError aclmdlRICaptureGetInfo(aclrtStream, int* status, void** model) {
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclmdlRICaptureGetInfo: status is null");
    *status = 0;  // ACL_MODEL_RI_CAPTURE_STATUS_NONE
    if (model) *model = nullptr;
    return ACL_SUCCESS;
}
