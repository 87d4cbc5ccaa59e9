// HCCL emulation internals shared by hccl.cpp (the API), hccl_net.cpp (loopback TCP transport) and
// hccl_reduce.cpp (element types and reductions). Names and values follow hicann/hccl's public
// headers (hccl.h, hccl_types.h as vendored by Ascend/pytorch third_party/hccl/inc/hccl/).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace cann_emu::hccl {

// HcclResult (hccl_types.h).
enum : int {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_TCP_TRANSFER = 13,
    HCCL_E_REMOTE = 21,
    HCCL_E_SUSPENDING = 22,  // a communicator that aclrtDeviceTaskAbort suspended, until HcclCommResume
};

// HcclDataType (hccl_types.h).
enum : int {
    DT_INT8 = 0, DT_INT16 = 1, DT_INT32 = 2, DT_FP16 = 3, DT_FP32 = 4, DT_INT64 = 5, DT_UINT64 = 6,
    DT_UINT8 = 7, DT_UINT16 = 8, DT_UINT32 = 9, DT_FP64 = 10, DT_BFP16 = 11, DT_INT128 = 12,
    DT_HIF8 = 14, DT_FP8E4M3 = 15, DT_FP8E5M2 = 16, DT_FP8E8M0 = 17,
};
// HcclReduceOp.
enum : int { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3 };

// A failure inside the emulation: the API entry point turns it into fail(code, "<call> on
// communicator '<name>' (rank r of n): <msg>").
struct Failure {
    int code;
    std::string msg;
};
[[noreturn]] void raise(int code, const std::string& msg);

size_t dtype_bytes(int dtype);          // 0: unknown
std::string dtype_label(int dtype);     // "fp32", ... or "dtype 99"
std::string op_label(int op);           // "sum", ...
// Whether op can reduce dtype (every integer and floating type; not int128/fp8/hif8).
bool reducible(int dtype, int op);
// out[i] = inputs[0][i] (op) inputs[1][i] (op) ... for count elements of dtype, folded in rank
// order; fp16/bf16 in float32, rounded once at the end; integers wrap as two's complement.
void reduce_ranks(int dtype, int op, uint64_t count, const std::vector<const char*>& inputs, char* out);

using Clock = std::chrono::steady_clock;

// A byte stream part: sent from / received into ptr. `done` runs when the part completed (a
// received header's check), and may append further parts to the lane.
struct Part {
    char* ptr;
    size_t len;
    std::function<void()> done;
};
// One direction of one connection, its parts in stream order.
struct Lane {
    int fd;
    bool send;
    std::string peer;  // for messages: "rank 2 of communicator 'x'"
    std::deque<Part> parts;
    size_t off = 0;
};
// Moves every lane's parts concurrently (poll, non-blocking send/recv) until all are done; raises
// HCCL_E_TIMEOUT at deadline naming the lanes still waiting, HCCL_E_TCP_TRANSFER when a peer closed.
void pump(std::vector<Lane>& lanes, Clock::time_point deadline, const std::string& what);

// aclrtDeviceTaskAbort (runtime.cpp): every HCCL call blocked in this process when it is called fails within
// kAbortPollMs with HCCL_E_INTERNAL ("aborted by aclrtDeviceTaskAbort"), as CANN stops a device's tasks. A call
// notes the abort count as it starts (start_call); the transport's waits check it.
constexpr int kAbortPollMs = 100;
void start_call();
void check_aborted(const std::string& what);
void abort_calls();

// Sockets on 127.0.0.1.
int listen_loopback(int* port);
int connect_loopback(int port, Clock::time_point deadline, const std::string& what);
int accept_one(int listen_fd, Clock::time_point deadline, const std::string& what);
void close_fd(int fd);

}  // namespace cann_emu::hccl
