// What torch_npu asked of CANN, counted per training step: aclnn operators by name, those CANN runs on
// AI CPU (op_table.json's engine), operators sent down the legacy aclop path (by op type), host
// synchronisations (stream/device/event synchronisation and synchronous copies, by call and direction)
// and HCCL calls by name, with the bytes each moved (hccl_bytes: the calling rank's input buffer: a
// gather's shard, a reduce-scatter's whole input, an all-to-all's or a send's data).
// A step is what the driver last marked with cann_emu_mark_step (verification/cann_emu/audit/ wraps
// torchtitan's Trainer.train_step to do so; -1, before any mark and after each step, is "outside steps").
// torch_npu launches from its task-queue thread, so an operator is counted in the step current when it
// launches; every step ends in a host synchronisation (the loss), which drains that queue first.
//
// CANN_EMU_COUNTS=<path>: written as JSON when the process exits. "{pid}" in it becomes the process id,
// "{rank}" the process's RANK (torchrun's); a path with "{rank}" is written only by processes that have one,
// so torchrun's agent writes nothing (e.g. <dump>/npu_inject/cann_emu_rank{rank}.json, which
// `npu-inject audit <dump>` prints).
#include "cann_emu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>

namespace cann_emu {
namespace {

using Counter = std::map<std::string, uint64_t>;
struct StepCounts {
    Counter aclnn, aicpu, aclop, syncs, hccl, hccl_bytes;
};
struct Audit {
    std::mutex mutex;
    int64_t step = -1;
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
        std::fprintf(f, "%s\"%s\": %llu", sep, name.c_str(), (unsigned long long)n);
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
        dump_counter(f, "hccl_bytes", c.hccl_bytes, "      ", "");
        std::fprintf(f, "    }%s\n", ++i < a.steps.size() ? "," : "");
    }
    std::fprintf(f, "  }\n}\n");
    std::fclose(f);
}
struct CountsWriter {
    ~CountsWriter() { write_counts(); }
} g_counts_writer;

}  // namespace

void count_call(const char* op) {
    const char* engine = op_engine(op);
    bool aicpu = engine && std::strcmp(engine, "AiCpu") == 0;
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    StepCounts& c = a.steps[a.step];
    ++c.aclnn[op];
    if (aicpu) {
        ++c.aicpu[op];
        if (!a.aicpu_warned[op]) {
            a.aicpu_warned[op] = true;
            std::fprintf(stderr, "cann_emu: %s runs on AI CPU on %s (counted in CANN_EMU_COUNTS)\n", op,
                         config().soc.c_str());
        }
    }
}

void count_sync(const char* kind) {
    Audit& a = audit();
    std::lock_guard<std::mutex> lock(a.mutex);
    ++a.steps[a.step].syncs[kind];
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
