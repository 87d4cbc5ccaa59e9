// Lets the torch_npu wheel load beside a CUDA build of torch (README.md, "torch for the emulation").
//
// torch_npu's x86 wheel is built for the CPU build of torch. PyPI's torch for x86_64 Linux (2.14.0 and
// 2.14.1 alike) is the CUDA build, whose libc10_cuda.so (loaded by libtorch_python.so) registers the
// CUDA allocator's configuration keys with c10's AcceleratorAllocatorConfig at load time. torch_npu's
// libtorch_npu.so registers its own keys the same way, one of which (pinned_reserve_segment_size_mb)
// the CUDA allocator registered already, and c10 aborts the process: "Duplicated key
// 'pinned_reserve_segment_size_mb' found in device-specific configuration parser hook registration".
// A CPU build of torch (what an Ascend machine runs) registers no CUDA keys. This constructor runs
// before libtorch_npu.so's (libascendcl.so, a DT_NEEDED of libtorch_npu.so, needs this library) and
// takes the CUDA allocator's keys out of c10's set, as they are absent under a CPU build. It does
// nothing when no CUDA allocator registered them. torch itself is looked up with dlsym: the emulation
// links against no torch library.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_set>

namespace {

// c10/cuda/CUDAAllocatorConfig.h, CUDAAllocatorConfig::getKeys() of torch 2.14.
const char* const kCudaAllocatorKeys[] = {
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
};

__attribute__((constructor)) void drop_cuda_allocator_keys() {
    void* cuda = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) return;  // no CUDA build of torch in this process
    dlclose(cuda);
    using Keys = std::unordered_set<std::string>;
    auto get_keys = reinterpret_cast<Keys& (*)()>(
        dlsym(RTLD_DEFAULT, "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig14getMutableKeysB5cxx11Ev"));
    if (!get_keys) {
        std::fprintf(stderr,
                     "cann_emu: libc10_cuda.so is loaded but c10's AcceleratorAllocatorConfig::getMutableKeys "
                     "is not found; torch_npu will abort on the CUDA allocator's keys\n");
        return;
    }
    Keys& keys = get_keys();
    for (const char* key : kCudaAllocatorKeys) keys.erase(key);
    if (std::getenv("CANN_EMU_LOG"))
        std::fprintf(stderr, "cann_emu: removed the CUDA allocator's configuration keys from c10's set\n");
}

}  // namespace
