// What torch_npu asked of CANN, counted per training step: aclnn operators by name, those CANN runs on
// AI CPU (op_table.json's engine), operators sent down the legacy aclop path (by op type), host
// synchronisations (stream/device/event synchronisation and synchronous copies, by call and direction)
// and HCCL calls by name, with the bytes each moved (hccl_bytes: the calling rank's input buffer: a
// gather's shard, a reduce-scatter's whole input, an all-to-all's or a send's data).
// A step is what the driver last marked with cann_emu_mark_step (verification/cann_emu/audit/ wraps
// torchtitan's Trainer.train_step to do so; -1, before any mark and after each step, is "outside steps").
// torch_npu launches from its task-queue thread, so an operator is counted in the step current when it
// launches; every step ends in a host synchronisation (the loss), which drains that queue first.
// Within a step, scope_ops counts each operator under the model scope the driver marked last
// (cann_emu_mark_scope: a block's forward or backward, the loss, the optimizer) when the operator was
// prepared: its GetWorkspaceSize runs on the dispatching thread, in program order, unlike its launch.
// CANN_EMU_LAUNCH_SITES=<op>,... (or "*") also records, for those operators, the Python caller that prepared
// each (launch_sites: scope, operator, then a synchronisation site's owner | caller | via): who made a copy.
//
// CANN_EMU_COUNTS=<path>: written as JSON when the process exits. "{pid}" in it becomes the process id,
// "{rank}" the process's RANK (torchrun's); a path with "{rank}" is written only by processes that have one,
// so torchrun's agent writes nothing (e.g. <dump>/npu_inject/cann_emu_rank{rank}.json, which
// `npu-inject audit <dump>` prints).
#include "cann_emu.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <unistd.h>

namespace cann_emu {
namespace {

using Counter = std::map<std::string, uint64_t>;
struct StepCounts {
    Counter aclnn, aicpu, aclop, syncs, hccl, hccl_bytes;
    // "<kind> | <owner> | <caller file:line function> | <innermost torch frame>": the first frame outside torch,
    // torch_npu, wrapt and the standard library made the synchronisation; its owner is npu_inject, torchtitan,
    // other, or torch/torch_npu when no such frame exists.
    Counter sync_sites;
    Counter scope_ops;    // "<scope> | <operator>", once the driver has marked a scope
    Counter scope_order;  // scope -> the step's launch number of its first operator (program order)
    Counter launch_sites;  // "<scope> | <operator> | <owner> | <caller> | <via>", for CANN_EMU_LAUNCH_SITES's operators
    uint64_t launches = 0;
};
struct Audit {
    std::mutex mutex;
    int64_t step = -1;
    std::string scope;  // "" until the driver marks one
    std::map<int64_t, StepCounts> steps;  // -1: outside steps
    std::map<std::string, bool> aicpu_warned;
};
// Never destroyed: torch_npu may still launch work while the process's static objects go away.
Audit& audit() {
    static Audit* a = new Audit;
    return *a;
}

void dump_counter(FILE* f, const char* key, const Counter& m, const char* indent, const char* end) {
    std::fprintf(f, "%s\"%s\": {", indent, key);
    const char* sep = "";
    for (const auto& [name, n] : m) {
        std::string escaped;  // JSON string escaping (sync sites hold paths and Python names)
        for (char ch : name) {
            if (ch == '"' || ch == '\\') escaped += '\\';
            if (static_cast<unsigned char>(ch) >= 0x20) escaped += ch;
        }
        std::fprintf(f, "%s\"%s\": %llu", sep, escaped.c_str(), (unsigned long long)n);
        sep = ", ";
    }
    std::fprintf(f, "}%s\n", end);
}

void write_counts() {
    const char* path = std::getenv("CANN_EMU_COUNTS");
    if (!path || !*path) return;
    std::string file = path;
    size_t at = file.find("{pid}");
    if (at != std::string::npos) file.replace(at, 5, std::to_string(getpid()));
    const char* rank = std::getenv("RANK");
    at = file.find("{rank}");
    if (at != std::string::npos) {
        if (!rank || !*rank) return;  // not a rank (torchrun's agent): documented above
        file.replace(at, 6, rank);
    }
    FILE* f = std::fopen(file.c_str(), "w");
    if (!f) {
        std::fprintf(stderr, "cann_emu: cannot write the operator counts to %s\n", file.c_str());
        return;
    }
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    StepCounts total;
    for (const auto& [step, c] : a.steps) {
        for (const auto& [k, n] : c.aclnn) total.aclnn[k] += n;
        for (const auto& [k, n] : c.aicpu) total.aicpu[k] += n;
        for (const auto& [k, n] : c.aclop) total.aclop[k] += n;
        for (const auto& [k, n] : c.syncs) total.syncs[k] += n;
        for (const auto& [k, n] : c.hccl) total.hccl[k] += n;
        for (const auto& [k, n] : c.hccl_bytes) total.hccl_bytes[k] += n;
        for (const auto& [k, n] : c.sync_sites) total.sync_sites[k] += n;
        for (const auto& [k, n] : c.scope_ops) total.scope_ops[k] += n;
        for (const auto& [k, n] : c.launch_sites) total.launch_sites[k] += n;
    }
    std::fprintf(f, "{\n  \"schema\": 2,\n  \"soc\": \"%s\",\n  \"pid\": %d,\n  \"rank\": %s,\n",
                 config().soc.c_str(), (int)getpid(),
                 rank && *rank && std::strspn(rank, "0123456789") == std::strlen(rank) ? rank : "null");
    dump_counter(f, "aclnn", total.aclnn, "  ", ",");
    dump_counter(f, "aicpu", total.aicpu, "  ", ",");
    dump_counter(f, "aclop", total.aclop, "  ", ",");
    dump_counter(f, "syncs", total.syncs, "  ", ",");
    dump_counter(f, "hccl", total.hccl, "  ", ",");
    dump_counter(f, "hccl_bytes", total.hccl_bytes, "  ", ",");
    dump_counter(f, "sync_sites", total.sync_sites, "  ", ",");
    dump_counter(f, "scope_ops", total.scope_ops, "  ", ",");
    dump_counter(f, "launch_sites", total.launch_sites, "  ", ",");
    std::fprintf(f, "  \"steps\": {\n");
    size_t i = 0;
    for (const auto& [step, c] : a.steps) {
        std::string name = step < 0 ? "outside steps" : std::to_string(step);
        std::fprintf(f, "    \"%s\": {\n", name.c_str());
        dump_counter(f, "aclnn", c.aclnn, "      ", ",");
        dump_counter(f, "aicpu", c.aicpu, "      ", ",");
        dump_counter(f, "aclop", c.aclop, "      ", ",");
        dump_counter(f, "syncs", c.syncs, "      ", ",");
        dump_counter(f, "hccl", c.hccl, "      ", ",");
        dump_counter(f, "hccl_bytes", c.hccl_bytes, "      ", ",");
        dump_counter(f, "sync_sites", c.sync_sites, "      ", ",");
        dump_counter(f, "scope_ops", c.scope_ops, "      ", ",");
        dump_counter(f, "launch_sites", c.launch_sites, "      ", ",");
        dump_counter(f, "scope_order", c.scope_order, "      ", "");
        std::fprintf(f, "    }%s\n", ++i < a.steps.size() ? "," : "");
    }
    std::fprintf(f, "  }\n}\n");
    std::fclose(f);
}
struct CountsWriter {
    ~CountsWriter() { write_counts(); }
} g_counts_writer;

}  // namespace

std::string current_scope() {
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    return a.scope;
}

void count_call(const char* op, const std::string& scope, const std::string& site) {
    const char* engine = op_engine(op);
    bool aicpu = engine && std::strcmp(engine, "AiCpu") == 0;
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    StepCounts& c = a.steps[a.step];
    ++c.aclnn[op];
    std::string name = scope.empty() ? "(before any scope)" : scope;
    if (!a.scope.empty() || !scope.empty()) {
        ++c.scope_ops[name + " | " + op];
        c.scope_order.emplace(name, c.launches);
    }
    if (!site.empty()) ++c.launch_sites[name + " | " + op + " | " + site];
    ++c.launches;
    if (aicpu) {
        ++c.aicpu[op];
        if (!a.aicpu_warned[op]) {
            a.aicpu_warned[op] = true;
            std::fprintf(stderr, "cann_emu: %s runs on AI CPU on %s (counted in CANN_EMU_COUNTS)\n", op,
                         config().soc.c_str());
        }
    }
}

namespace {
// ---- where a host synchronisation came from: the Python stack of the thread that made it -------------
// CPython's C API, looked up in the process (the interpreter that loaded torch_npu) rather than linked, so
// the library still loads without Python (ctypes tests, C callers). Only on a synchronisation: tens per step.
struct PythonApi {
    int (*is_initialized)() = nullptr;
    void* (*this_thread_state)() = nullptr;  // PyGILState_GetThisThreadState: null on a thread Python never saw
    int (*gil_ensure)() = nullptr;
    void (*gil_release)(int) = nullptr;
    void* (*current_frame)() = nullptr;      // PyEval_GetFrame: borrowed
    void* (*frame_back)(void*) = nullptr;    // new references from here on
    void* (*frame_code)(void*) = nullptr;
    int (*frame_line)(void*) = nullptr;
    void* (*get_attr)(void*, const char*) = nullptr;
    const char* (*utf8)(void*) = nullptr;
    void (*incref)(void*) = nullptr;
    void (*decref)(void*) = nullptr;
    bool complete = false;
};
const PythonApi& python_api() {
    static PythonApi api = [] {
        PythonApi p;
        auto find = [](auto& slot, const char* name) { slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(RTLD_DEFAULT, name)); return slot != nullptr; };
        p.complete = find(p.is_initialized, "Py_IsInitialized") && find(p.this_thread_state, "PyGILState_GetThisThreadState") &&
                     find(p.gil_ensure, "PyGILState_Ensure") && find(p.gil_release, "PyGILState_Release") &&
                     find(p.current_frame, "PyEval_GetFrame") && find(p.frame_back, "PyFrame_GetBack") &&
                     find(p.frame_code, "PyFrame_GetCode") && find(p.frame_line, "PyFrame_GetLineNumber") &&
                     find(p.get_attr, "PyObject_GetAttrString") && find(p.utf8, "PyUnicode_AsUTF8") &&
                     find(p.incref, "Py_IncRef") && find(p.decref, "Py_DecRef");
        return p;
    }();
    return api;
}

// A path from the package on: ".../site-packages/torchtitan/train.py" -> "torchtitan/train.py".
std::string short_path(std::string path) {
    for (const char* root : {"/site-packages/", "/dist-packages/"}) {
        size_t at = path.rfind(root);
        if (at != std::string::npos) return path.substr(at + std::strlen(root));
    }
    size_t at = path.rfind("/npu_inject/");
    if (at != std::string::npos) return path.substr(at + 1);
    return path;
}

bool is_torch_internal(const std::string& file) {
    return file.rfind("torch/", 0) == 0 || file.rfind("torch_npu/", 0) == 0 || file.rfind("<frozen", 0) == 0 ||
           file.rfind("wrapt/", 0) == 0 || file.find("/contextlib.py") != std::string::npos ||
           file.find("/python3.") != std::string::npos;
}

// "<owner> | <file:line function> | via <innermost torch frame>" for the calling thread, or why there is none.
std::string python_site() {
    const PythonApi& py = python_api();
    if (!py.complete || !py.is_initialized()) return "none | (no Python in this process) | ";
    if (!py.this_thread_state()) return "torch_npu | (a thread without Python: torch_npu's own) | ";
    int state = py.gil_ensure();  // the caller may have released the GIL (torch.npu.synchronize does)
    std::string caller, via, owner = "torch/torch_npu";
    void* frame = py.current_frame();
    if (frame) py.incref(frame);
    for (int depth = 0; frame && depth < 64 && caller.empty(); ++depth) {
        void* code = py.frame_code(frame);
        void* file_obj = code ? py.get_attr(code, "co_filename") : nullptr;
        void* name_obj = code ? py.get_attr(code, "co_qualname") : nullptr;
        std::string file = short_path(file_obj && py.utf8(file_obj) ? py.utf8(file_obj) : "?");
        std::string where = file + ":" + std::to_string(py.frame_line(frame)) + " " +
                            (name_obj && py.utf8(name_obj) ? py.utf8(name_obj) : "?");
        if (name_obj) py.decref(name_obj);
        if (file_obj) py.decref(file_obj);
        if (code) py.decref(code);
        if (!is_torch_internal(file)) {
            caller = where;
            owner = file.rfind("npu_inject/", 0) == 0 ? "npu_inject" : file.rfind("torchtitan/", 0) == 0 ? "torchtitan"
                                                                                                         : "other";
        } else if (via.empty()) {
            via = where;
        }
        void* back = py.frame_back(frame);
        py.decref(frame);
        frame = back;
    }
    if (frame) py.decref(frame);
    py.gil_release(state);
    return owner + " | " + (caller.empty() ? "(torch and torch_npu frames only)" : caller) + " | " + via;
}

}  // namespace

std::string launch_site(const char* op) {
    static const std::string wanted = [] {
        const char* names = std::getenv("CANN_EMU_LAUNCH_SITES");
        return std::string(",") + (names ? names : "") + ",";
    }();
    if (wanted == ",," || (wanted != ",*," && wanted.find(std::string(",") + op + ",") == std::string::npos)) return "";
    return python_site();  // on the preparing thread, in program order, as the scope is read
}

void count_sync(const char* kind) {
    std::string site = std::string(kind) + " | " + python_site();  // before the lock: it may wait for the GIL
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    ++a.steps[a.step].syncs[kind];
    ++a.steps[a.step].sync_sites[site];
}

namespace {
thread_local const char* t_mc2_op = nullptr;  // the MC2 operator this thread is inside, if any
}
Mc2Scope::Mc2Scope(const char* op) { t_mc2_op = op; }
Mc2Scope::~Mc2Scope() { t_mc2_op = nullptr; }

void count_hccl(const char* api) {
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    ++a.steps[a.step].hccl[t_mc2_op ? std::string(t_mc2_op) + ":" + api : std::string(api)];
}

void count_hccl_bytes(const char* api, uint64_t bytes) {
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    a.steps[a.step].hccl_bytes[t_mc2_op ? std::string(t_mc2_op) + ":" + api : std::string(api)] += bytes;
}

void count_aclop(const char* op_type) {
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    ++a.steps[a.step].aclop[op_type ? op_type : "(null)"];
}

}  // namespace cann_emu

// Called by the driver (ctypes) when a training step starts (its number) or ends (-1).
CANN_API void cann_emu_mark_step(int64_t step) {
    cann_emu::Audit& a = cann_emu::audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    a.step = step < 0 ? -1 : step;
}

// Called by the driver (ctypes) when the model scope changes (a block's forward, the loss, ...): the operators
// prepared from now on count under name (scope_ops).
CANN_API void cann_emu_mark_scope(const char* name) {
    cann_emu::Audit& a = cann_emu::audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    a.scope = name ? name : "";
}
