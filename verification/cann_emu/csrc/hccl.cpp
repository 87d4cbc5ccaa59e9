// HCCL (hicann/hccl hccl.h, hccl_types.h; how torch_npu calls it: Ascend/pytorch
// torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, HCCLUtils.cpp, HcclCompile.h).
//
// Communicators between processes over loopback TCP (hccl_net.cpp). HcclGetRootInfo opens a
// listener and writes its port and a random token into the 4108-byte root info; HcclCommInitRootInfo
// connects every rank to rank 0 (which must be the process that made the root info, as torch_npu's
// rank 0 is) and then every pair, so each communicator owns one connection per peer.
// Collectives run when called (the emulation's streams execute at launch): every rank sends its
// contribution to rank 0, which checks that all ranks made the same call (kind, sequence number,
// dtype, count, op, root), computes in rank order and sends each rank its result; every rank blocks
// until all members joined. Send/Recv go straight to the peer. Between HcclGroupStart and
// HcclGroupEnd, Send/Recv wait and then run together (collectives still run when called).
// A failure (peer gone, timeout after CANN_EMU_HCCL_TIMEOUT seconds, mismatched calls) returns an HCCL
// error code with a message naming the call and the communicator, and sticks to the communicator
// (HcclGetCommAsyncError reports it; later calls fail at once).
#include "cann_emu.h"
#include "hccl_internal.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

using namespace cann_emu;
using namespace cann_emu::hccl;

typedef int HcclResult;
typedef void* HcclComm;
typedef void* aclrtStream;
union HcclConfigValue {
    int32_t value;
};

// ---- configuration calls (torch_npu sets HCCL_DETERMINISTIC at device set-up) -------------------
namespace {
std::mutex g_config_mutex;
std::map<int, int32_t> g_config;  // HcclConfig: 0 HCCL_DETERMINISTIC
}  // namespace

CANN_API HcclResult HcclSetConfig(int config, HcclConfigValue value) {
    count_hccl("HcclSetConfig");
    if (config != 0) return fail(HCCL_E_PARA, "HcclSetConfig: config " + std::to_string(config) + " is not emulated");
    std::lock_guard<std::mutex> lock(g_config_mutex);
    g_config[config] = value.value;
    return HCCL_SUCCESS;
}
CANN_API HcclResult HcclGetConfig(int config, HcclConfigValue* value) {
    count_hccl("HcclGetConfig");
    if (!value) return fail(HCCL_E_PTR, "HcclGetConfig: configValue is null");
    if (config != 0) return fail(HCCL_E_PARA, "HcclGetConfig: config " + std::to_string(config) + " is not emulated");
    std::lock_guard<std::mutex> lock(g_config_mutex);
    value->value = g_config.count(config) ? g_config[config] : 0;
    return HCCL_SUCCESS;
}

// HcclCommConfigCapability (hccl_types.h) numbers the HcclCommConfig fields; torch_npu tests
// `field < HcclGetCommConfigCapability()` (HcclCompile.h isHcclFeatureSupported), so the value is a
// count, not a mask. The emulation reads the fields up to and including the communicator name
// (0 buffer size, 1 deterministic, 2 comm name) and none after (op expansion mode, world rank id,
// job id, zero copy, exec timeout, algo, retry, buffer name).
constexpr uint32_t kCommNameCapability = 2;
CANN_API uint32_t HcclGetCommConfigCapability() {
    count_hccl("HcclGetCommConfigCapability");
    return kCommNameCapability + 1;
}

// ---- communicators --------------------------------------------------------------------------------
namespace {

constexpr uint32_t kRootInfoBytes = 4108;  // HCCL_ROOT_INFO_BYTES
constexpr size_t kCommNameMax = 128;       // COMM_NAME_MAX_LENGTH
constexpr char kMagic[16] = "cann_emu hccl1";
constexpr uint32_t kFrameMagic = 0x48434531;  // "HCE1"

// HcclCMDType values (hccl_types.h) name the calls in frames and messages.
enum Kind : uint32_t {
    K_BROADCAST = 1, K_ALLREDUCE = 2, K_REDUCE = 3, K_SEND = 4, K_ALLGATHER = 6, K_REDUCE_SCATTER = 7,
    K_ALLTOALLV = 8, K_ALLTOALL = 10, K_SCATTER = 12, K_ALLGATHER_V = 16, K_REDUCE_SCATTER_V = 17,
    K_BARRIER = 103,
};
const char* kind_name(uint32_t k) {
    switch (k) {
        case K_BROADCAST: return "HcclBroadcast";
        case K_ALLREDUCE: return "HcclAllReduce";
        case K_REDUCE: return "HcclReduce";
        case K_SEND: return "HcclSend";
        case K_ALLGATHER: return "HcclAllGather";
        case K_REDUCE_SCATTER: return "HcclReduceScatter";
        case K_ALLTOALLV: return "HcclAlltoAllV";
        case K_ALLTOALL: return "HcclAlltoAll";
        case K_SCATTER: return "HcclScatter";
        case K_ALLGATHER_V: return "HcclAllGatherV";
        case K_REDUCE_SCATTER_V: return "HcclReduceScatterV";
        case K_BARRIER: return "HcclBarrier";
        default: return "an unknown call";
    }
}

struct RootInfo {  // the head of HcclRootInfo's 4108 bytes
    char magic[16];
    uint64_t token;
    uint32_t port;
    int32_t pid;
};
struct Hello {  // a rank introducing itself to rank 0 (with its listener's port) or to a lower rank
    char magic[16];
    uint64_t token;
    uint32_t nranks, rank, port;
    int32_t pid;
};
struct Frame {  // before every payload; a reply's status != 0 carries an error message instead
    uint32_t magic = kFrameMagic, kind = 0;
    uint64_t seq = 0, count = 0;
    int32_t dtype = -1, op = -1;
    uint32_t root = 0, status = 0;
    uint64_t bytes = 0;
};

double timeout_s() { return config().hccl_timeout_s; }
Clock::time_point deadline_after(double s) {
    return Clock::now() + std::chrono::microseconds(int64_t(s * 1e6));
}

// A failure of the arguments of one call, raised before any traffic: the communicator stays usable.
struct Invalid {
    int code;
    std::string msg;
};
[[noreturn]] void invalid(const std::string& msg, int code = HCCL_E_PARA) { throw Invalid{code, msg}; }

struct Comm {
    uint64_t token = 0;
    std::string name;
    uint32_t rank = 0, size = 0;
    std::vector<int> fds;  // fds[r]: the connection to rank r; -1 for this rank
    double timeout = 300;
    uint64_t seq = 0;                                  // collectives so far
    std::vector<uint64_t> sent, received;              // point-to-point messages so far, per peer
    std::mutex call_mutex;                             // one call at a time
    std::atomic<int> error{HCCL_SUCCESS};              // sticky
    std::atomic<bool> suspended{false};                // by aclrtDeviceTaskAbort, until HcclCommResume
    std::mutex error_mutex;
    std::string error_msg;

    std::string label() const {
        return "communicator '" + name + "' (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
    }
    std::string peer(uint32_t r) const { return "rank " + std::to_string(r) + " of communicator '" + name + "'"; }
    void set_error(int code, const std::string& msg) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error.load() == HCCL_SUCCESS) {
            error_msg = msg;
            error.store(code);
        }
    }
    ~Comm() {
        for (int fd : fds) close_fd(fd);
    }
};

std::mutex g_mutex;
std::set<Comm*> g_comms;                // live communicators
std::map<uint64_t, int> g_listeners;    // root info token -> its listener, in the process that made it

Comm* live(HcclComm handle) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_comms.find(static_cast<Comm*>(handle));
    return it == g_comms.end() ? nullptr : *it;
}

}  // namespace

void* cann_emu::hccl_comm_named(const char* name) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (Comm* c : g_comms)
        if (name && c->name == name) return c;
    return nullptr;
}

namespace {

// A fault armed by cann_emu_inject_hccl_fault, taken by the next collective or point-to-point call of this
// process: 1, the call fails as a broken link does (HCCL_E_TCP_TRANSFER, sticky; the peers wait for data that
// never comes); 2, the call never completes (it waits until aclrtDeviceTaskAbort, as a collective stuck on the
// device does; the peers wait too). The emulation's own entries: real CANN has none.
std::atomic<int> g_injected_fault{0};

void take_injected_fault(const char* api, const Comm& c) {
    int mode = g_injected_fault.exchange(0);
    if (mode == 1)
        raise(HCCL_E_TCP_TRANSFER, std::string(api) + " #" + std::to_string(c.seq + 1) + ": the link to the peers "
              "of " + c.label() + " failed (link error, injected by cann_emu_inject_hccl_fault)");
    if (mode == 2) {
        std::fprintf(stderr, "cann_emu: %s on %s stuck on the device (injected) until aclrtDeviceTaskAbort\n", api,
                     c.label().c_str());
        for (;;) {
            check_aborted(std::string(api) + " (stuck, injected)");
            ::usleep(kAbortPollMs * 1000);
        }
    }
}

// Runs one call on a communicator: argument failures leave it usable; every other failure sticks. A Send/Recv
// collected into a group takes no injected fault: the group takes it where it runs (run_group).
template <typename F>
HcclResult run_on_comm(const char* api, HcclComm handle, F& body, bool take_fault = true) {
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, std::string(api) + ": comm is not a live communicator of this process");
    std::lock_guard<std::mutex> lock(c->call_mutex);
    start_call();
    if (int e = c->error.load()) {
        std::lock_guard<std::mutex> el(c->error_mutex);
        return fail(e, std::string(api) + " on " + c->label() + ": the communicator failed earlier: " + c->error_msg);
    }
    try {
        if (take_fault) take_injected_fault(api, *c);
        body(*c);
        return HCCL_SUCCESS;
    } catch (const Invalid& e) {
        return fail(e.code, std::string(api) + " on " + c->label() + ": " + e.msg);
    } catch (const Failure& e) {
        std::string msg = std::string(api) + " on " + c->label() + ": " + e.msg;
        c->set_error(e.code, msg);
        return fail(e.code, msg);
    }
}

// A call in its stream's order (runtime.cpp). A deferrable one (its arguments are all in body's copies and in
// device memory) is queued on the stream: with CANN_EMU_ASYNC_STREAMS=1 it runs on the stream's own thread,
// as a device runs a collective while the host goes on, and its failure reaches the communicator's async error
// and the stream's next synchronisation. Any other runs in the calling thread once the stream's earlier work
// is done.
// HCCL's own check at launch (ops' Selector: a communicator not READY returns HCCL_E_SUSPENDING); not sticky.
HcclResult refuse_suspended(const char* api, const Comm& c) {
    return fail(HCCL_E_SUSPENDING, std::string(api) + " on " + c.label() + ": the communicator is suspended since "
                "aclrtDeviceTaskAbort stopped the device's tasks; HcclCommResume it (torch_npu: the backend's "
                "resume_hccl_comm, torch_npu.distributed.reinit_process_group(rebuild_link=False)) or destroy it");
}

// How a call meets its stream: queued on it (a device runs it while the host goes on), run once the stream's
// earlier work is done, or run now in the calling thread (a Send/Recv inside a group is only collected: the
// group runs at HcclGroupEnd, in stream order; waiting for the stream here held torch_npu's task queue behind
// a collective still waiting on a peer, where HCCL only records the call).
enum class Order { queued, after_stream, collected };

template <typename F>
HcclResult on_comm(const char* api, HcclComm handle, aclrtStream stream, Order order, F body) {
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, std::string(api) + ": comm is not a live communicator of this process");
    if (c->suspended.load()) return refuse_suspended(api, *c);
    if (order == Order::collected) return run_on_comm(api, handle, body, false);
    auto task = [api, handle, body]() mutable { return int(run_on_comm(api, handle, body)); };
    return HcclResult(order == Order::queued ? launch(stream, api, task, true) : launch_after(stream, task));
}

void check_dtype(int dtype) {
    if (!dtype_bytes(dtype)) invalid("data type " + std::to_string(dtype) + " is not an HcclDataType");
}
void check_reduce(int dtype, int op) {
    check_dtype(dtype);
    if (!reducible(dtype, op)) invalid("reduction " + op_label(op) + " of " + dtype_label(dtype) + " is not supported",
                                       HCCL_E_NOT_SUPPORT);
}
void check_ptr(const void* p, uint64_t bytes, const char* what) {
    if (!p && bytes) invalid(std::string(what) + " is null", HCCL_E_PTR);
}
void check_rank(const Comm& c, uint32_t r, const char* what) {
    if (r >= c.size) invalid(std::string(what) + " " + std::to_string(r) + " is outside 0.." + std::to_string(c.size - 1));
}

using Bytes = std::string;
// The one collective pattern: each rank contributes bytes, rank 0 checks the calls agree, computes
// every rank's reply from all contributions (in rank order), and sends it back.
void collective(Comm& c, Frame mine, bool same_count, const char* send, size_t send_bytes,
                const std::function<std::vector<Bytes>(std::vector<Bytes>&)>& compute,
                const std::function<void(const Bytes&)>& take) {
    const char* api = kind_name(mine.kind);
    mine.seq = c.seq++;
    mine.bytes = send_bytes;
    Clock::time_point deadline = deadline_after(c.timeout);
    std::string what = std::string(api) + " #" + std::to_string(mine.seq);
    if (c.rank != 0) {
        std::vector<Lane> out{{c.fds[0], true, c.peer(0), {}}};
        out[0].parts.push_back({(char*)&mine, sizeof(mine), nullptr});
        out[0].parts.push_back({(char*)send, send_bytes, nullptr});
        pump(out, deadline, what);
        Frame reply;
        std::vector<Lane> in{{c.fds[0], false, c.peer(0), {}}};
        in[0].parts.push_back({(char*)&reply, sizeof(reply), nullptr});
        pump(in, deadline, what);
        if (reply.magic != kFrameMagic) raise(HCCL_E_INTERNAL, what + ": a malformed reply came from " + c.peer(0));
        Bytes data(reply.bytes, '\0');
        in[0].parts.push_back({data.data(), data.size(), nullptr});
        pump(in, deadline, what);
        if (reply.status) raise(int(reply.status), "rank 0 reports: " + data);
        take(data);
        return;
    }
    std::vector<Frame> head(c.size);
    std::vector<Bytes> contrib(c.size);
    try {
        std::vector<Lane> in;
        for (uint32_t r = 1; r < c.size; ++r) {
            in.push_back({c.fds[r], false, c.peer(r), {}});
            in.back().parts.push_back({(char*)&head[r], sizeof(Frame), nullptr});
        }
        pump(in, deadline, what);
        for (uint32_t r = 1; r < c.size; ++r) {
            const Frame& h = head[r];
            auto call = [](const Frame& f) {
                return std::string(kind_name(f.kind)) + " #" + std::to_string(f.seq) + " (" + dtype_label(f.dtype) +
                       ", count " + std::to_string(f.count) + ", op " + std::to_string(f.op) + ", root " +
                       std::to_string(f.root) + ")";
            };
            if (h.magic != kFrameMagic || h.kind != mine.kind || h.seq != mine.seq || h.dtype != mine.dtype ||
                h.op != mine.op || h.root != mine.root || (same_count && h.count != mine.count))
                raise(HCCL_E_PARA, "the ranks disagree: rank " + std::to_string(r) + " called " + call(h) +
                                       ", rank 0 called " + call(mine));
            contrib[r].resize(h.bytes);
            in[r - 1].parts.push_back({contrib[r].data(), contrib[r].size(), nullptr});
        }
        pump(in, deadline, what);
        if (send_bytes) contrib[0].assign(send, send_bytes);
        std::vector<Bytes> replies = compute(contrib);
        std::vector<Frame> rh(c.size);
        std::vector<Lane> out;
        for (uint32_t r = 1; r < c.size; ++r) {
            rh[r] = mine;
            rh[r].bytes = replies[r].size();
            out.push_back({c.fds[r], true, c.peer(r), {}});
            out.back().parts.push_back({(char*)&rh[r], sizeof(Frame), nullptr});
            out.back().parts.push_back({replies[r].data(), replies[r].size(), nullptr});
        }
        pump(out, deadline, what);
        take(replies[0]);
    } catch (const Failure& e) {
        // Tell the other ranks why (best effort, briefly), so each fails with the cause.
        std::string msg = what + ": " + e.msg;
        for (uint32_t r = 1; r < c.size; ++r) {
            Frame f = mine;
            f.status = uint32_t(e.code);
            f.bytes = msg.size();
            std::vector<Lane> out{{c.fds[r], true, c.peer(r), {}}};
            out[0].parts.push_back({(char*)&f, sizeof(f), nullptr});
            out[0].parts.push_back({msg.data(), msg.size(), nullptr});
            try {
                pump(out, deadline_after(2), what);
            } catch (const Failure&) {
            }
        }
        throw;
    }
}

std::vector<Bytes> same_for_all(uint32_t n, Bytes b) { return std::vector<Bytes>(n, std::move(b)); }

// ---- point-to-point -------------------------------------------------------------------------------
struct P2P {
    Comm* comm;
    bool send;
    char* buf;
    uint64_t count;
    int dtype;
    uint32_t peer;
    void* stream = nullptr;  // the stream it was called on (a grouped one runs at HcclGroupEnd)
};
thread_local int t_group_depth = 0;
thread_local std::vector<P2P> t_group_ops;

// Runs the operations together: each (communicator, peer, direction) is one lane, in call order.
void run_p2p(const std::vector<P2P>& ops, const std::string& what) {
    std::map<std::tuple<Comm*, uint32_t, bool>, size_t> lane_of;
    std::vector<Lane> lanes;
    std::deque<Frame> frames;  // stable addresses
    double timeout = 0;
    for (const P2P& op : ops) {
        Comm& c = *op.comm;
        timeout = std::max(timeout, c.timeout);
        auto key = std::make_tuple(op.comm, op.peer, op.send);
        if (!lane_of.count(key)) {
            lane_of[key] = lanes.size();
            lanes.push_back({c.fds[op.peer], op.send, c.peer(op.peer), {}});
        }
        Lane& lane = lanes[lane_of[key]];
        uint64_t bytes = op.count * dtype_bytes(op.dtype);
        Frame& f = frames.emplace_back();
        if (op.send) {
            f.kind = K_SEND;
            f.seq = c.sent[op.peer]++;
            f.count = op.count;
            f.dtype = op.dtype;
            f.bytes = bytes;
            lane.parts.push_back({(char*)&f, sizeof(f), nullptr});
            lane.parts.push_back({op.buf, bytes, nullptr});
        } else {
            uint64_t seq = c.received[op.peer]++;
            Frame* got = &f;
            lane.parts.push_back({(char*)&f, sizeof(f), [got, op, seq, &c]() {
                                      if (got->magic != kFrameMagic || got->kind != K_SEND || got->seq != seq ||
                                          got->count != op.count || got->dtype != op.dtype)
                                          raise(HCCL_E_PARA, "rank " + std::to_string(op.peer) + " sent message #" +
                                                                 std::to_string(got->seq) + " of " +
                                                                 std::to_string(got->count) + " " + dtype_label(got->dtype) +
                                                                 " elements, but rank " + std::to_string(c.rank) +
                                                                 " receives message #" + std::to_string(seq) + " of " +
                                                                 std::to_string(op.count) + " " + dtype_label(op.dtype));
                                  }});
            lane.parts.push_back({op.buf, bytes, nullptr});
        }
    }
    pump(lanes, deadline_after(timeout), what);
}

void check_p2p(Comm& c, const void* buf, uint64_t count, int dtype, uint32_t peer, const char* who) {
    check_dtype(dtype);
    check_ptr(buf, count * dtype_bytes(dtype), "buf");
    check_rank(c, peer, who);
    if (peer == c.rank) invalid(std::string(who) + " is this rank");
}

// Point-to-point now, or at HcclGroupEnd inside a group.
HcclResult p2p(const char* api, HcclComm handle, bool send, void* buf, uint64_t count, int dtype, uint32_t peer,
               aclrtStream stream) {
    // Outside a group the call is queued on its stream like a collective (a device runs it while the host goes
    // on); inside one it is collected in this thread until HcclGroupEnd.
    bool grouped = t_group_depth > 0;
    return on_comm(api, handle, stream, grouped ? Order::collected : Order::queued, [=](Comm& c) {
        check_p2p(c, buf, count, dtype, peer, send ? "destRank" : "srcRank");
        count_hccl_bytes(api, count * dtype_bytes(dtype));
        P2P op{&c, send, static_cast<char*>(buf), count, dtype, peer, stream};
        if (grouped) t_group_ops.push_back(op);
        else run_p2p({op}, api);
    });
}

Comm* init_comm(const char* api, uint32_t nranks, const void* root_info, uint32_t rank, const void* config) {
    if (!root_info) invalid("rootInfo is null", HCCL_E_PTR);
    RootInfo info;
    std::memcpy(&info, root_info, sizeof(info));
    if (std::memcmp(info.magic, kMagic, sizeof(kMagic)) != 0)
        invalid("rootInfo was not made by this emulation's HcclGetRootInfo");
    if (nranks == 0 || rank >= nranks)
        invalid("rank " + std::to_string(rank) + " is outside 0..nRanks-1 (nRanks " + std::to_string(nranks) + ")");
    auto c = std::make_unique<Comm>();
    c->token = info.token;
    c->rank = rank;
    c->size = nranks;
    c->timeout = timeout_s();
    c->fds.assign(nranks, -1);
    c->sent.assign(nranks, 0);
    c->received.assign(nranks, 0);
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)info.token);
    c->name = std::string("cann_emu_hccl_") + hex;
    if (config) {  // HcclCommConfig: {size_t size; uint32_t magic; uint32_t version; uint64_t}, buffer
                   // size, deterministic, then hcclCommName[128] at byte 32.
        size_t size;
        uint32_t magic;
        std::memcpy(&size, config, sizeof(size));
        std::memcpy(&magic, static_cast<const char*>(config) + 8, sizeof(magic));
        if (magic != 0xf0f0f0f0) invalid("config has not HCCL_COMM_CONFIG_MAGIC_WORD (HcclCommConfigInit not called?)");
        if (size >= 32 + kCommNameMax) {
            const char* name = static_cast<const char*>(config) + 32;
            size_t len = strnlen(name, kCommNameMax);
            if (len == kCommNameMax) invalid("config's hcclCommName is not terminated within 128 bytes");
            if (len) c->name.assign(name, len);
        }
    }
    Clock::time_point deadline = deadline_after(c->timeout);
    std::string what = std::string(api) + " of communicator '" + c->name + "'";
    auto read_hello = [&](int fd, const std::string& who) {
        Hello h;
        std::vector<Lane> in{{fd, false, who, {}}};
        in[0].parts.push_back({(char*)&h, sizeof(h), nullptr});
        pump(in, deadline, what);
        if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.token != info.token || h.nranks != nranks ||
            h.rank >= nranks)
            raise(HCCL_E_PARA, "a peer joined with another root info or rank count (its rank " +
                                   std::to_string(h.rank) + ", nRanks " + std::to_string(h.nranks) + "; here " +
                                   std::to_string(nranks) + ")");
        return h;
    };
    auto write = [&](int fd, const void* p, size_t n, const std::string& who) {
        std::vector<Lane> out{{fd, true, who, {}}};
        out[0].parts.push_back({(char*)p, n, nullptr});
        pump(out, deadline, what);
    };
    if (rank == 0) {
        int listener = -1;
        {
            std::lock_guard<std::mutex> lock(g_mutex);
            auto it = g_listeners.find(info.token);
            if (it != g_listeners.end()) {
                listener = it->second;
                g_listeners.erase(it);
            }
        }
        if (listener < 0)
            invalid("rank 0 must run in the process that called HcclGetRootInfo for this root info (pid " +
                    std::to_string(info.pid) + "; this is pid " + std::to_string(getpid()) + "), once");
        std::vector<uint32_t> ports(nranks, 0);
        try {
            for (uint32_t k = 1; k < nranks; ++k) {
                int fd = accept_one(listener, deadline, "the other " + std::to_string(nranks - k) + " rank(s)");
                Hello h;
                try {
                    h = read_hello(fd, "a joining rank");
                } catch (...) {
                    close_fd(fd);
                    throw;
                }
                if (h.rank == 0 || c->fds[h.rank] >= 0) {
                    close_fd(fd);
                    raise(HCCL_E_PARA, "two processes joined as rank " + std::to_string(h.rank));
                }
                c->fds[h.rank] = fd;
                ports[h.rank] = h.port;
            }
        } catch (...) {
            close_fd(listener);
            throw;
        }
        close_fd(listener);
        for (uint32_t r = 1; r < nranks; ++r) write(c->fds[r], ports.data(), ports.size() * 4, c->peer(r));
    } else {
        int port = 0;
        int listener = listen_loopback(&port);
        try {
            int fd = connect_loopback(int(info.port), deadline, "rank 0 (pid " + std::to_string(info.pid) + ")");
            c->fds[0] = fd;
            Hello h{};
            std::memcpy(h.magic, kMagic, sizeof(kMagic));
            h.token = info.token;
            h.nranks = nranks;
            h.rank = rank;
            h.port = uint32_t(port);
            h.pid = getpid();
            write(fd, &h, sizeof(h), c->peer(0));
            std::vector<uint32_t> ports(nranks, 0);
            std::vector<Lane> in{{fd, false, c->peer(0), {}}};
            in[0].parts.push_back({(char*)ports.data(), ports.size() * 4, nullptr});
            pump(in, deadline, what);
            for (uint32_t j = 1; j < rank; ++j) {  // connect to lower ranks, accept higher ones
                c->fds[j] = connect_loopback(int(ports[j]), deadline, c->peer(j));
                write(c->fds[j], &h, sizeof(h), c->peer(j));
            }
            for (uint32_t k = rank + 1; k < nranks; ++k) {
                int afd = accept_one(listener, deadline, "rank(s) above " + std::to_string(rank));
                Hello p;
                try {
                    p = read_hello(afd, "a higher rank");
                } catch (...) {
                    close_fd(afd);
                    throw;
                }
                if (p.rank <= rank || c->fds[p.rank] >= 0) {
                    close_fd(afd);
                    raise(HCCL_E_PARA, "unexpected connection from rank " + std::to_string(p.rank));
                }
                c->fds[p.rank] = afd;
            }
        } catch (...) {
            close_fd(listener);
            throw;
        }
        close_fd(listener);
    }
    return c.release();
}

HcclResult init_api(const char* api, uint32_t nranks, const void* root_info, uint32_t rank, const void* config,
                    HcclComm* comm) {
    if (!comm) return fail(HCCL_E_PTR, std::string(api) + ": comm is null");
    start_call();
    try {
        Comm* c = init_comm(api, nranks, root_info, rank, config);
        std::lock_guard<std::mutex> lock(g_mutex);
        g_comms.insert(c);
        *comm = c;
        return HCCL_SUCCESS;
    } catch (const Invalid& e) {
        return fail(e.code, std::string(api) + " (rank " + std::to_string(rank) + " of " + std::to_string(nranks) + "): " + e.msg);
    } catch (const Failure& e) {
        return fail(e.code, std::string(api) + " (rank " + std::to_string(rank) + " of " + std::to_string(nranks) + "): " + e.msg);
    }
}

Frame frame(uint32_t kind, uint64_t count, int dtype, int op = -1, uint32_t root = 0) {
    Frame f;
    f.kind = kind;
    f.count = count;
    f.dtype = dtype;
    f.op = op;
    f.root = root;
    return f;
}
void copy_out(void* dst, const Bytes& b, size_t expect, const char* api) {
    if (b.size() != expect)
        raise(HCCL_E_PARA, std::string(api) + ": " + std::to_string(b.size()) + " bytes came back where " +
                               std::to_string(expect) + " were expected (the ranks' counts disagree)");
    if (expect) std::memcpy(dst, b.data(), expect);
}
std::vector<const char*> pointers(const std::vector<Bytes>& v) {
    std::vector<const char*> p;
    for (const Bytes& b : v) p.push_back(b.data());
    return p;
}

}  // namespace

CANN_API HcclResult HcclGetRootInfo(void* root_info) {
    count_hccl("HcclGetRootInfo");
    if (!root_info) return fail(HCCL_E_PTR, "HcclGetRootInfo: rootInfo is null");
    try {
        RootInfo info{};
        std::memcpy(info.magic, kMagic, sizeof(kMagic));
        int port = 0;
        int fd = listen_loopback(&port);
        std::random_device rd;
        info.token = (uint64_t(rd()) << 32) ^ rd() ^ (uint64_t(getpid()) << 16) ^
                     uint64_t(Clock::now().time_since_epoch().count());
        info.port = uint32_t(port);
        info.pid = getpid();
        {
            std::lock_guard<std::mutex> lock(g_mutex);
            g_listeners[info.token] = fd;
        }
        std::memset(root_info, 0, kRootInfoBytes);
        std::memcpy(root_info, &info, sizeof(info));
        return HCCL_SUCCESS;
    } catch (const Failure& e) {
        return fail(e.code, "HcclGetRootInfo: " + e.msg);
    }
}

CANN_API HcclResult HcclCommInitRootInfo(uint32_t nranks, const void* root_info, uint32_t rank, HcclComm* comm) {
    count_hccl("HcclCommInitRootInfo");
    return init_api("HcclCommInitRootInfo", nranks, root_info, rank, nullptr, comm);
}
CANN_API HcclResult HcclCommInitRootInfoConfig(uint32_t nranks, const void* root_info, uint32_t rank,
                                               const void* config, HcclComm* comm) {
    count_hccl("HcclCommInitRootInfoConfig");
    return init_api("HcclCommInitRootInfoConfig", nranks, root_info, rank, config, comm);
}

// Arms a fault for this process's next HCCL call (see take_injected_fault): 1 link error, 2 stuck; 0 disarms.
CANN_API HcclResult cann_emu_inject_hccl_fault(int mode) {
    if (mode < 0 || mode > 2)
        return fail(HCCL_E_PARA, "cann_emu_inject_hccl_fault: mode " + std::to_string(mode) + " is not 0 (none), 1 "
                    "(link error) or 2 (stuck until aclrtDeviceTaskAbort)");
    g_injected_fault.store(mode);
    return HCCL_SUCCESS;
}

// Stops the device's tasks: the HCCL calls blocked in this process, and (CANN_EMU_ASYNC_STREAMS=1) the work queued
// on its streams, whose waiters get ACL_ERROR_RT_DEVICE_TASK_ABORT.
CANN_API aclError aclrtDeviceTaskAbort(int32_t device, uint32_t /*timeout*/) {
    count_hccl("aclrtDeviceTaskAbort");
    if (device < 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceTaskAbort: deviceId " + std::to_string(device) + " is negative");
    abort_calls();
    {
        // HCCL's task-abort handler suspends every communicator (HcclCommunicator::Suspend): each call on one
        // fails with HCCL_E_SUSPENDING until HcclCommResume.
        std::lock_guard<std::mutex> lock(g_mutex);
        for (Comm* c : g_comms) c->suspended.store(true);
    }
    abort_streams(device);
    return ACL_SUCCESS;
}

// Clears a suspended communicator for new calls. A call that the abort cut mid-way has left the communicator
// failed (its peers may hold part of that call): real HCCL clears that too; the emulation cannot, and says so.
CANN_API HcclResult HcclCommResume(HcclComm handle) {
    count_hccl("HcclCommResume");
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, "HcclCommResume: comm is not a live communicator of this process");
    std::lock_guard<std::mutex> lock(c->call_mutex);
    if (int e = c->error.load()) {
        std::lock_guard<std::mutex> el(c->error_mutex);
        return fail(HCCL_E_NOT_SUPPORT, "HcclCommResume on " + c->label() + ": the communicator failed (" + c->error_msg +
                                            "); the emulation resumes only a communicator that had no call cut or failed "
                                            "(real HCCL clears one): destroy it and make a new one");
    }
    c->suspended.store(false);
    return HCCL_SUCCESS;
}

CANN_API HcclResult HcclCommDestroy(HcclComm handle) {
    count_hccl("HcclCommDestroy");
    Comm* c = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_comms.find(static_cast<Comm*>(handle));
        if (it == g_comms.end()) return fail(HCCL_E_PTR, "HcclCommDestroy: comm is not a live communicator of this process");
        c = *it;
        g_comms.erase(it);
    }
    { std::lock_guard<std::mutex> wait(c->call_mutex); }  // a call in flight ends first
    delete c;
    return HCCL_SUCCESS;
}

CANN_API HcclResult HcclGetRankSize(HcclComm handle, uint32_t* size) {
    count_hccl("HcclGetRankSize");
    if (!size) return fail(HCCL_E_PTR, "HcclGetRankSize: rankSize is null");
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, "HcclGetRankSize: comm is not a live communicator of this process");
    *size = c->size;
    return HCCL_SUCCESS;
}
CANN_API HcclResult HcclGetRankId(HcclComm handle, uint32_t* rank) {
    count_hccl("HcclGetRankId");
    if (!rank) return fail(HCCL_E_PTR, "HcclGetRankId: rank is null");
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, "HcclGetRankId: comm is not a live communicator of this process");
    *rank = c->rank;
    return HCCL_SUCCESS;
}
CANN_API HcclResult HcclGetCommName(HcclComm handle, char* name) {
    count_hccl("HcclGetCommName");
    if (!name) return fail(HCCL_E_PTR, "HcclGetCommName: commName is null");
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, "HcclGetCommName: comm is not a live communicator of this process");
    std::snprintf(name, kCommNameMax, "%s", c->name.c_str());
    return HCCL_SUCCESS;
}
// The watchdog's question: the communicator's sticky error (HCCL_SUCCESS while healthy).
CANN_API HcclResult HcclGetCommAsyncError(HcclComm handle, HcclResult* error) {
    count_hccl("HcclGetCommAsyncError");
    if (!error) return fail(HCCL_E_PTR, "HcclGetCommAsyncError: asyncError is null");
    Comm* c = live(handle);
    if (!c) return fail(HCCL_E_PTR, "HcclGetCommAsyncError: comm is not a live communicator of this process");
    *error = c->error.load();
    return HCCL_SUCCESS;
}

// ---- collectives ----------------------------------------------------------------------------------
CANN_API HcclResult HcclAllReduce(void* send, void* recv, uint64_t count, int dtype, int op, HcclComm comm,
                                  aclrtStream stream) {
    count_hccl("HcclAllReduce");
    return on_comm("HcclAllReduce", comm, stream, Order::queued, [=](Comm& c) {
        check_reduce(dtype, op);
        size_t bytes = count * dtype_bytes(dtype);
        check_ptr(send, bytes, "sendBuf");
        check_ptr(recv, bytes, "recvBuf");
        count_hccl_bytes("HcclAllReduce", bytes);
        collective(c, frame(K_ALLREDUCE, count, dtype, op), true, (const char*)send, bytes,
                   [&](std::vector<Bytes>& in) {
                       Bytes out(bytes, '\0');
                       reduce_ranks(dtype, op, count, pointers(in), out.data());
                       return same_for_all(c.size, out);
                   },
                   [&](const Bytes& b) { copy_out(recv, b, bytes, "HcclAllReduce"); });
    });
}

CANN_API HcclResult HcclReduce(void* send, void* recv, uint64_t count, int dtype, int op, uint32_t root,
                               HcclComm comm, aclrtStream stream) {
    count_hccl("HcclReduce");
    return on_comm("HcclReduce", comm, stream, Order::queued, [=](Comm& c) {
        check_reduce(dtype, op);
        check_rank(c, root, "root");
        size_t bytes = count * dtype_bytes(dtype);
        check_ptr(send, bytes, "sendBuf");
        if (c.rank == root) check_ptr(recv, bytes, "recvBuf");
        collective(c, frame(K_REDUCE, count, dtype, op, root), true, (const char*)send, bytes,
                   [&](std::vector<Bytes>& in) {
                       std::vector<Bytes> out(c.size);
                       out[root].resize(bytes);
                       reduce_ranks(dtype, op, count, pointers(in), out[root].data());
                       return out;
                   },
                   [&](const Bytes& b) { copy_out(recv, b, c.rank == root ? bytes : 0, "HcclReduce"); });
    });
}

CANN_API HcclResult HcclBroadcast(void* buf, uint64_t count, int dtype, uint32_t root, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclBroadcast");
    return on_comm("HcclBroadcast", comm, stream, Order::queued, [=](Comm& c) {
        check_dtype(dtype);
        check_rank(c, root, "root");
        size_t bytes = count * dtype_bytes(dtype);
        check_ptr(buf, bytes, "buf");
        count_hccl_bytes("HcclBroadcast", c.rank == root ? bytes : 0);
        collective(c, frame(K_BROADCAST, count, dtype, -1, root), true, (const char*)buf, c.rank == root ? bytes : 0,
                   [&](std::vector<Bytes>& in) {
                       std::vector<Bytes> out = same_for_all(c.size, in[root]);
                       out[root].clear();
                       return out;
                   },
                   [&](const Bytes& b) { copy_out(buf, b, c.rank == root ? 0 : bytes, "HcclBroadcast"); });
    });
}

CANN_API HcclResult HcclScatter(void* send, void* recv, uint64_t recv_count, int dtype, uint32_t root,
                                HcclComm comm, aclrtStream stream) {
    count_hccl("HcclScatter");
    return on_comm("HcclScatter", comm, stream, Order::queued, [=](Comm& c) {
        check_dtype(dtype);
        check_rank(c, root, "root");
        size_t chunk = recv_count * dtype_bytes(dtype);
        if (c.rank == root) check_ptr(send, chunk * c.size, "sendBuf");
        check_ptr(recv, chunk, "recvBuf");
        collective(c, frame(K_SCATTER, recv_count, dtype, -1, root), true, (const char*)send,
                   c.rank == root ? chunk * c.size : 0,
                   [&](std::vector<Bytes>& in) {
                       std::vector<Bytes> out(c.size);
                       for (uint32_t r = 0; r < c.size; ++r) out[r] = in[root].substr(r * chunk, chunk);
                       return out;
                   },
                   [&](const Bytes& b) { copy_out(recv, b, chunk, "HcclScatter"); });
    });
}

CANN_API HcclResult HcclAllGather(void* send, void* recv, uint64_t send_count, int dtype, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclAllGather");
    return on_comm("HcclAllGather", comm, stream, Order::queued, [=](Comm& c) {
        check_dtype(dtype);
        size_t chunk = send_count * dtype_bytes(dtype);
        check_ptr(send, chunk, "sendBuf");
        check_ptr(recv, chunk * c.size, "recvBuf");
        count_hccl_bytes("HcclAllGather", chunk);
        collective(c, frame(K_ALLGATHER, send_count, dtype), true, (const char*)send, chunk,
                   [&](std::vector<Bytes>& in) {
                       Bytes all;
                       for (const Bytes& b : in) all += b;
                       return same_for_all(c.size, all);
                   },
                   [&](const Bytes& b) { copy_out(recv, b, chunk * c.size, "HcclAllGather"); });
    });
}

// recvCounts/recvDispls: uint64_t[rankSize], in elements (torch_npu passes std::vector<uint64_t>).
CANN_API HcclResult HcclAllGatherV(void* send, uint64_t send_count, void* recv, const void* recv_counts,
                                   const void* recv_displs, int dtype, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclAllGatherV");
    return on_comm("HcclAllGatherV", comm, stream, Order::after_stream, [&](Comm& c) {
        check_dtype(dtype);
        if (!recv_counts || !recv_displs) invalid("recvCounts or recvDispls is null", HCCL_E_PTR);
        const uint64_t* counts = static_cast<const uint64_t*>(recv_counts);
        const uint64_t* displs = static_cast<const uint64_t*>(recv_displs);
        size_t es = dtype_bytes(dtype);
        if (counts[c.rank] != send_count)
            invalid("sendCount " + std::to_string(send_count) + " differs from recvCounts[" + std::to_string(c.rank) +
                    "] " + std::to_string(counts[c.rank]));
        check_ptr(send, send_count * es, "sendBuf");
        uint64_t total = 0;
        for (uint32_t r = 0; r < c.size; ++r) total += counts[r];
        check_ptr(recv, total * es, "recvBuf");
        count_hccl_bytes("HcclAllGatherV", send_count * es);
        collective(c, frame(K_ALLGATHER_V, send_count, dtype), false, (const char*)send, send_count * es,
                   [&](std::vector<Bytes>& in) {
                       Bytes all;  // [rankSize x uint64 element counts][data in rank order]
                       for (const Bytes& b : in) {
                           uint64_t n = b.size() / es;
                           all.append((const char*)&n, 8);
                       }
                       for (const Bytes& b : in) all += b;
                       return same_for_all(c.size, all);
                   },
                   [&](const Bytes& b) {
                       size_t at = 8 * c.size;
                       for (uint32_t r = 0; r < c.size; ++r) {
                           uint64_t n;
                           std::memcpy(&n, b.data() + 8 * r, 8);
                           if (n != counts[r])
                               raise(HCCL_E_PARA, "rank " + std::to_string(r) + " sent " + std::to_string(n) +
                                                      " elements, recvCounts[" + std::to_string(r) + "] here is " +
                                                      std::to_string(counts[r]));
                           if (n) std::memcpy(static_cast<char*>(recv) + displs[r] * es, b.data() + at, n * es);
                           at += n * es;
                       }
                   });
    });
}

CANN_API HcclResult HcclReduceScatter(void* send, void* recv, uint64_t recv_count, int dtype, int op,
                                      HcclComm comm, aclrtStream stream) {
    count_hccl("HcclReduceScatter");
    return on_comm("HcclReduceScatter", comm, stream, Order::queued, [=](Comm& c) {
        check_reduce(dtype, op);
        size_t chunk = recv_count * dtype_bytes(dtype);
        check_ptr(send, chunk * c.size, "sendBuf");
        check_ptr(recv, chunk, "recvBuf");
        count_hccl_bytes("HcclReduceScatter", chunk * c.size);
        collective(c, frame(K_REDUCE_SCATTER, recv_count, dtype, op), true, (const char*)send, chunk * c.size,
                   [&](std::vector<Bytes>& in) {
                       Bytes sum(chunk * c.size, '\0');
                       reduce_ranks(dtype, op, recv_count * c.size, pointers(in), sum.data());
                       std::vector<Bytes> out(c.size);
                       for (uint32_t r = 0; r < c.size; ++r) out[r] = sum.substr(r * chunk, chunk);
                       return out;
                   },
                   [&](const Bytes& b) { copy_out(recv, b, chunk, "HcclReduceScatter"); });
    });
}

// sendCounts/sendDispls: uint64_t[rankSize] in elements; every rank gives the same sendCounts.
CANN_API HcclResult HcclReduceScatterV(void* send, const void* send_counts, const void* send_displs, void* recv,
                                       uint64_t recv_count, int dtype, int op, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclReduceScatterV");
    return on_comm("HcclReduceScatterV", comm, stream, Order::after_stream, [&](Comm& c) {
        check_reduce(dtype, op);
        if (!send_counts || !send_displs) invalid("sendCounts or sendDispls is null", HCCL_E_PTR);
        const uint64_t* counts = static_cast<const uint64_t*>(send_counts);
        const uint64_t* displs = static_cast<const uint64_t*>(send_displs);
        size_t es = dtype_bytes(dtype);
        if (counts[c.rank] != recv_count)
            invalid("recvCount " + std::to_string(recv_count) + " differs from sendCounts[" + std::to_string(c.rank) +
                    "] " + std::to_string(counts[c.rank]));
        Bytes packed;  // the chunks in rank order, contiguous
        for (uint32_t r = 0; r < c.size; ++r) {
            check_ptr(send, counts[r] * es, "sendBuf");
            packed.append(static_cast<const char*>(send) + displs[r] * es, counts[r] * es);
        }
        std::vector<uint64_t> hub_counts(counts, counts + c.size);
        count_hccl_bytes("HcclReduceScatterV", packed.size());
        collective(c, frame(K_REDUCE_SCATTER_V, packed.size() / es, dtype, op), true, packed.data(), packed.size(),
                   [&](std::vector<Bytes>& in) {
                       Bytes sum(packed.size(), '\0');
                       reduce_ranks(dtype, op, packed.size() / es, pointers(in), sum.data());
                       std::vector<Bytes> out(c.size);
                       size_t at = 0;
                       for (uint32_t r = 0; r < c.size; ++r) {
                           out[r] = sum.substr(at, hub_counts[r] * es);
                           at += hub_counts[r] * es;
                       }
                       return out;
                   },
                   [&](const Bytes& b) { copy_out(recv, b, recv_count * es, "HcclReduceScatterV"); });
    });
}

namespace {
// AlltoAll(V): each rank sends [rankSize x uint64 counts][chunks for rank 0, 1, ...]; rank r gets
// [rankSize x uint64 counts from each rank][the chunks from rank 0, 1, ...].
void alltoall(Comm& c, uint32_t kind, const char* api, const char* send, const uint64_t* scounts,
              const uint64_t* sdispls, char* recv, const uint64_t* rcounts, const uint64_t* rdispls, int dtype) {
    size_t es = dtype_bytes(dtype);
    Bytes mine;
    uint64_t sent = 0;
    for (uint32_t r = 0; r < c.size; ++r) sent += scounts[r] * es;
    count_hccl_bytes(api, sent);
    for (uint32_t r = 0; r < c.size; ++r) mine.append((const char*)&scounts[r], 8);
    for (uint32_t r = 0; r < c.size; ++r) {
        check_ptr(send, scounts[r] * es, "sendBuf");
        mine.append(send + sdispls[r] * es, scounts[r] * es);
    }
    collective(c, frame(kind, kind == K_ALLTOALL ? scounts[0] : 0, dtype), kind == K_ALLTOALL, mine.data(), mine.size(),
               [&](std::vector<Bytes>& in) {
                   uint32_t n = c.size;
                   std::vector<std::vector<size_t>> offset(n, std::vector<size_t>(n + 1, 8 * n));
                   std::vector<std::vector<uint64_t>> count(n, std::vector<uint64_t>(n));
                   for (uint32_t i = 0; i < n; ++i) {
                       if (in[i].size() < 8 * n) raise(HCCL_E_INTERNAL, "rank " + std::to_string(i) + " sent a short AlltoAll");
                       for (uint32_t j = 0; j < n; ++j) {
                           std::memcpy(&count[i][j], in[i].data() + 8 * j, 8);
                           offset[i][j + 1] = offset[i][j] + count[i][j] * es;
                       }
                       if (offset[i][n] != in[i].size())
                           raise(HCCL_E_INTERNAL, "rank " + std::to_string(i) + "'s AlltoAll counts do not add up");
                   }
                   std::vector<Bytes> out(n);
                   for (uint32_t j = 0; j < n; ++j) {
                       for (uint32_t i = 0; i < n; ++i) out[j].append((const char*)&count[i][j], 8);
                       for (uint32_t i = 0; i < n; ++i) out[j].append(in[i], offset[i][j], count[i][j] * es);
                   }
                   return out;
               },
               [&](const Bytes& b) {
                   size_t at = 8 * c.size;
                   for (uint32_t i = 0; i < c.size; ++i) {
                       uint64_t n;
                       std::memcpy(&n, b.data() + 8 * i, 8);
                       if (n != rcounts[i])
                           raise(HCCL_E_PARA, std::string(api) + ": rank " + std::to_string(i) + " sent " +
                                                  std::to_string(n) + " elements to rank " + std::to_string(c.rank) +
                                                  ", which expects " + std::to_string(rcounts[i]) + " (recvCounts)");
                       if (n) std::memcpy(recv + rdispls[i] * es, b.data() + at, n * es);
                       at += n * es;
                   }
               });
}
}  // namespace

// Counts and displacements: uint64_t[rankSize], in elements.
CANN_API HcclResult HcclAlltoAllV(const void* send, const void* send_counts, const void* sdispls, int send_type,
                                  const void* recv, const void* recv_counts, const void* rdispls, int recv_type,
                                  HcclComm comm, aclrtStream stream) {
    count_hccl("HcclAlltoAllV");
    return on_comm("HcclAlltoAllV", comm, stream, Order::after_stream, [&](Comm& c) {
        check_dtype(send_type);
        if (send_type != recv_type)
            invalid("sendType " + dtype_label(send_type) + " differs from recvType " + dtype_label(recv_type));
        if (!send_counts || !sdispls || !recv_counts || !rdispls) invalid("a count or displacement array is null", HCCL_E_PTR);
        alltoall(c, K_ALLTOALLV, "HcclAlltoAllV", (const char*)send, (const uint64_t*)send_counts,
                 (const uint64_t*)sdispls, (char*)recv, (const uint64_t*)recv_counts, (const uint64_t*)rdispls,
                 send_type);
    });
}

CANN_API HcclResult HcclAlltoAll(const void* send, uint64_t send_count, int send_type, const void* recv,
                                 uint64_t recv_count, int recv_type, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclAlltoAll");
    return on_comm("HcclAlltoAll", comm, stream, Order::queued, [=](Comm& c) {
        check_dtype(send_type);
        if (send_type != recv_type || send_count != recv_count)
            invalid("send (" + std::to_string(send_count) + " " + dtype_label(send_type) + ") and receive (" +
                    std::to_string(recv_count) + " " + dtype_label(recv_type) + ") chunks differ");
        std::vector<uint64_t> counts(c.size, send_count), displs(c.size);
        for (uint32_t r = 0; r < c.size; ++r) displs[r] = r * send_count;
        alltoall(c, K_ALLTOALL, "HcclAlltoAll", (const char*)send, counts.data(), displs.data(), (char*)recv,
                 counts.data(), displs.data(), send_type);
    });
}

CANN_API HcclResult HcclBarrier(HcclComm comm, aclrtStream stream) {
    count_hccl("HcclBarrier");
    return on_comm("HcclBarrier", comm, stream, Order::queued, [=](Comm& c) {
        collective(c, frame(K_BARRIER, 0, DT_INT8), true, nullptr, 0,
                   [&](std::vector<Bytes>&) { return std::vector<Bytes>(c.size); }, [](const Bytes&) {});
    });
}

// ---- point-to-point and groups --------------------------------------------------------------------
CANN_API HcclResult HcclSend(void* buf, uint64_t count, int dtype, uint32_t dest, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclSend");
    return p2p("HcclSend", comm, true, buf, count, dtype, dest, stream);
}
CANN_API HcclResult HcclRecv(void* buf, uint64_t count, int dtype, uint32_t src, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclRecv");
    return p2p("HcclRecv", comm, false, buf, count, dtype, src, stream);
}

struct HcclSendRecvItem {  // hccl_types.h HcclSendRecvItemDef
    int sendRecvType;      // HCCL_SEND 0, HCCL_RECV 1
    void* buf;
    uint64_t count;
    int dataType;
    uint32_t remoteRank;
};
CANN_API HcclResult HcclBatchSendRecv(HcclSendRecvItem* items, uint32_t n, HcclComm comm, aclrtStream stream) {
    count_hccl("HcclBatchSendRecv");
    return on_comm("HcclBatchSendRecv", comm, stream, Order::after_stream, [&](Comm& c) {
        if (!items && n) invalid("sendRecvInfo is null", HCCL_E_PTR);
        std::vector<P2P> ops;
        for (uint32_t i = 0; i < n; ++i) {
            const HcclSendRecvItem& it = items[i];
            if (it.sendRecvType != 0 && it.sendRecvType != 1)
                invalid("item " + std::to_string(i) + " has sendRecvType " + std::to_string(it.sendRecvType));
            bool send = it.sendRecvType == 0;
            check_p2p(c, it.buf, it.count, it.dataType, it.remoteRank, send ? "remoteRank (send)" : "remoteRank (recv)");
            ops.push_back({&c, send, static_cast<char*>(it.buf), it.count, it.dataType, it.remoteRank});
            if (send) count_hccl_bytes("HcclBatchSendRecv", it.count * dtype_bytes(it.dataType));
        }
        if (t_group_depth > 0) t_group_ops.insert(t_group_ops.end(), ops.begin(), ops.end());
        else run_p2p(ops, "HcclBatchSendRecv");
    });
}

// HcclGroupStart/End (torch_npu loads them from libhcomm): per thread, nestable. Send/Recv (and
// BatchSendRecv items) made inside wait until the outermost HcclGroupEnd and then run together, so
// a pair of ranks may send to each other in one group; collectives inside run when called.
CANN_API HcclResult HcclGroupStart() {
    count_hccl("HcclGroupStart");
    ++t_group_depth;
    return HCCL_SUCCESS;
}
// Runs a group's Send/Recv together, every communicator of the group locked; a failure sticks to all of them.
HcclResult run_group(const std::vector<P2P>& ops) {
    start_call();
    std::vector<Comm*> comms;
    for (const P2P& op : ops) comms.push_back(op.comm);
    std::sort(comms.begin(), comms.end());
    comms.erase(std::unique(comms.begin(), comms.end()), comms.end());
    std::vector<std::unique_lock<std::mutex>> locks;
    for (Comm* c : comms) {
        if (!live(c)) return fail(HCCL_E_PTR, "HcclGroupEnd: a communicator of the group was destroyed before its end");
        locks.emplace_back(c->call_mutex);
        if (c->suspended.load()) return refuse_suspended("HcclGroupEnd", *c);
        if (int e = c->error.load()) {
            std::lock_guard<std::mutex> el(c->error_mutex);
            return fail(e, "HcclGroupEnd on " + c->label() + ": the communicator failed earlier: " + c->error_msg);
        }
    }
    try {
        take_injected_fault("HcclGroupEnd", *comms.front());
        run_p2p(ops, "HcclGroupEnd (" + std::to_string(ops.size()) + " grouped Send/Recv)");
        return HCCL_SUCCESS;
    } catch (const Failure& e) {
        std::string where;
        for (Comm* c : comms) where += (where.empty() ? "" : ", ") + c->label();
        std::string msg = "HcclGroupEnd on " + where + ": " + e.msg;
        for (Comm* c : comms) c->set_error(e.code, msg);
        return fail(e.code, msg);
    }
}

// A group whose calls were all made on one stream is queued on it (CANN_EMU_ASYNC_STREAMS=1), as a device runs
// it while the host goes on, its failure reported at the stream's next synchronisation; otherwise it runs now,
// after every stream's earlier work.
CANN_API HcclResult HcclGroupEnd() {
    count_hccl("HcclGroupEnd");
    if (t_group_depth == 0) return fail(HCCL_E_PARA, "HcclGroupEnd: no HcclGroupStart is open on this thread");
    if (--t_group_depth > 0 || t_group_ops.empty()) return HCCL_SUCCESS;
    std::vector<P2P> ops;
    ops.swap(t_group_ops);
    bool one_stream = std::all_of(ops.begin(), ops.end(), [&](const P2P& op) { return op.stream == ops.front().stream; });
    if (config().async_streams && one_stream)
        return HcclResult(launch(ops.front().stream, "HcclGroupEnd", [ops]() { return int(run_group(ops)); }, true));
    if (int rc = drain_device(current_device())) return HcclResult(rc);  // the group runs after the streams' work
    return run_group(ops);
}
