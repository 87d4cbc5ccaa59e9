// The CANN emulation's shared declarations: our own types for what torch_npu passes through the ACL
// C API (names and values follow CANN's public headers: hicann/runtime include/external/acl/*.h,
// hicann/opbase include/nnopbase/aclnn/acl_meta.h), and the emulation's state helpers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#define CANN_API extern "C" __attribute__((visibility("default")))

typedef int aclError;
typedef int32_t aclnnStatus;
typedef void* aclrtStream;
typedef void* aclrtEvent;
typedef void* aclrtContext;

// Status codes (acl_base_rt.h, rt_error_codes.h, aclnn's op_errno.h).
constexpr aclError ACL_SUCCESS = 0;
constexpr aclError ACL_ERROR_INVALID_PARAM = 100000;
constexpr aclError ACL_ERROR_REPEAT_INITIALIZE = 100002;
constexpr aclError ACL_ERROR_BAD_ALLOC = 200000;
constexpr aclError ACL_ERROR_INVALID_DEVICE = 200002;
constexpr aclError ACL_ERROR_INTERNAL_ERROR = 500000;
constexpr aclError ACL_ERROR_RT_PARAM_INVALID = 107000;
constexpr aclError ACL_ERROR_RT_INVALID_DEVICEID = 107001;
constexpr aclError ACL_ERROR_RT_CONTEXT_NULL = 107002;
constexpr aclError ACL_ERROR_RT_MEMORY_ALLOCATION = 207001;
constexpr aclError ACL_ERROR_RT_DEVICE_MEM_ERROR = 507053;
constexpr aclError ACL_ERROR_RT_DEVICE_TASK_ABORT = 107022;  // the device's tasks were stopped (aclrtDeviceTaskAbort)
constexpr aclnnStatus ACLNN_ERR_PARAM_NULLPTR = 161001;
constexpr aclnnStatus ACLNN_ERR_PARAM_INVALID = 161002;
constexpr aclnnStatus ACLNN_ERR_INNER = 561000;

typedef enum {
    ACL_DT_UNDEFINED = -1,
    ACL_FLOAT = 0,
    ACL_FLOAT16 = 1,
    ACL_INT8 = 2,
    ACL_INT32 = 3,
    ACL_UINT8 = 4,
    ACL_INT16 = 6,
    ACL_UINT16 = 7,
    ACL_UINT32 = 8,
    ACL_INT64 = 9,
    ACL_UINT64 = 10,
    ACL_DOUBLE = 11,
    ACL_BOOL = 12,
    ACL_STRING = 13,
    ACL_COMPLEX64 = 16,
    ACL_COMPLEX128 = 17,
    ACL_BF16 = 27,
    ACL_INT4 = 29,
    ACL_UINT1 = 30,
    ACL_COMPLEX32 = 33,
    ACL_HIFLOAT8 = 34,
    ACL_FLOAT8_E5M2 = 35,
    ACL_FLOAT8_E4M3FN = 36,
    ACL_FLOAT8_E8M0 = 37,
    ACL_FLOAT6_E3M2 = 38,
    ACL_FLOAT6_E2M3 = 39,
    ACL_FLOAT4_E2M1 = 40,
    ACL_FLOAT4_E1M2 = 41,
} aclDataType;  // hicann/runtime include/external/acl/acl_base_rt.h

typedef enum {
    ACL_FORMAT_UNDEFINED = -1,
    ACL_FORMAT_NCHW = 0,
    ACL_FORMAT_NHWC = 1,
    ACL_FORMAT_ND = 2,
    ACL_FORMAT_NC1HWC0 = 3,
    ACL_FORMAT_FRACTAL_Z = 4,
    ACL_FORMAT_FRACTAL_NZ = 29,
    ACL_FORMAT_NCDHW = 30,
    ACL_FORMAT_NC = 35,
    ACL_FORMAT_NCL = 47,
} aclFormat;

typedef enum {
    ACL_MEMCPY_HOST_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEFAULT,
    ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE,
    ACL_MEMCPY_INTER_DEVICE_TO_DEVICE,
} aclrtMemcpyKind;

namespace cann_emu {

struct Config {
    int devices;               // CANN_EMU_DEVICES, default 8
    std::string soc;           // CANN_EMU_SOC, default Ascend910B2
    uint64_t capacity;         // CANN_EMU_MEMORY_GB per device, default 64
    std::string cann_version;  // CANN_EMU_CANN_VERSION, default 9.1.0
    double hccl_timeout_s;     // CANN_EMU_HCCL_TIMEOUT: how long an HCCL call waits for its peers, default 300
    bool async_streams;        // CANN_EMU_ASYNC_STREAMS=1: collectives run on their stream's own thread (runtime.cpp)
};
const Config& config();

// Remembers msg for aclGetRecentErrMsg (torch_npu appends it to its exception text), prints it to
// stderr, and returns code.
int fail(int code, const std::string& msg);
// For the generated stubs: torch_npu reached a CANN function the emulation does not implement.
int unimplemented(const char* name);

int current_device();  // the calling thread's device (aclrtSetDevice), -1 before any
// Stream order (runtime.cpp). launch runs task on stream now, in the calling thread, when the stream has no
// unfinished work; otherwise (and always for a collective, defer_always) it queues task behind that work, to run
// on the stream's own thread, and returns ACL_SUCCESS: a queued task's failure is reported by the stream's next
// synchronisation. Without CANN_EMU_ASYNC_STREAMS=1, and for work launched from inside a running task (an MC2
// operator's collective), task runs now. launch_after waits for the stream's unfinished work, then runs task now.
int launch(void* stream, const char* what, std::function<int()> task, bool defer_always);
int launch_after(void* stream, std::function<int()> task);
int drain_device(int device);  // waits for every stream of device; its first queued failure, else ACL_SUCCESS
void abort_streams(int device);  // aclrtDeviceTaskAbort: queued work is dropped, waits end with TASK_ABORT
size_t dtype_size(int dtype);  // bytes per element; 0 for a dtype the emulation does not know
const char* dtype_name(int dtype);
// op_table.json, compiled in by build.py: the dtypes argument arg of operator op accepts on SoC soc at CANN
// version cann (the first of the row's variants that speaks for them, else the row's own list; false when
// the table has no such row) and the engine CANN runs op on ("AiCore"/"AiCpu"; null when absent).
bool op_arg_dtypes(const char* op, const char* arg, const char* soc, const char* cann, const int** dtypes, int* n);
// Whether CANN version `version` is older than `bound` ("9.0.0" < "9.1.0"; a part that is not a number,
// "RC1", sorts after the numbers), as build.py's version_key orders them.
bool cann_version_below(const char* version, const char* bound);
const char* op_engine(const char* op);
// audit.cpp: per training step, what torch_npu asked of CANN (CANN_EMU_COUNTS).
// An aclnn operator launched (AI CPU too), the model scope current when it was prepared, and where in Python
// it was prepared (launch_site; "" when not asked for).
void count_call(const char* op, const std::string& scope, const std::string& site = "");
// CANN_EMU_LAUNCH_SITES=<op>,<op>,... (or "*"): for those operators, "<owner> | <caller> | <via>" of the thread
// preparing one (as a synchronisation's site), counted per step under launch_sites; "" for any other operator.
std::string launch_site(const char* op);
// The scope the driver last marked (cann_emu_mark_scope), "" before any: read when an operator is prepared
// (its GetWorkspaceSize, on the thread that dispatched it), since torch_npu launches later from its queue.
std::string current_scope();
void count_sync(const char* kind);    // a host synchronisation, e.g. "aclrtSynchronizeStream"
void count_aclop(const char* op_type);  // an operator sent down the legacy aclop path
void count_hccl(const char* api);     // an HCCL call by name ("<op>:<api>" inside an MC2 operator)
void count_hccl_bytes(const char* api, uint64_t bytes);  // the bytes that call moved (this rank's input)
// While alive, this thread's HCCL calls are an MC2 operator's own communication: counted as "<op>:<api>",
// not as standalone collectives.
struct Mc2Scope {
    explicit Mc2Scope(const char* op);
    ~Mc2Scope();
};
// hccl.cpp: the live communicator HcclGetCommName calls name (an MC2 operator's group), or nullptr.
void* hccl_comm_named(const char* name);

}  // namespace cann_emu
