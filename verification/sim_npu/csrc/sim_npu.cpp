// Simulated Ascend NPU for tests: PyTorch's PrivateUse1 backend (renamed to
// "npu" from Python) whose device memory is ordinary host memory.
//
// What lives here (see verification/sim_npu/README.md for the design):
//   * DeviceAllocator that counts bytes per device (current/peak/allocated/
//     freed, OOM against a configurable capacity) -- backs torch.npu.memory_*
//     and torch.accelerator.memory_*;
//   * pinned host allocator (so pin_memory()/is_pinned() work with "npu" as
//     the accelerator);
//   * device guard with thread-local current device, streams and events that
//     complete immediately (work runs synchronously);
//   * PrivateUse1 hooks and a generator that shares the CPU default
//     generator's Mersenne Twister stream, exposed with a 16-byte
//     (seed, offset) state like CUDA/NPU Philox generators;
//   * a few native kernels (allocation, views, resize, set_, copies) and a
//     boxed fallback that runs every other aten op's CPU kernel directly on
//     CPU tensors ALIASING the npu memory, so in-place/out/view ops alias
//     correctly without copies.
//
// Python-facing helpers are registered as custom ops in the `npu_sim`
// namespace (no pybind11: keeps the one-time compile short).

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace npu_sim {

using c10::DeviceIndex;
using c10::DeviceType;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;

constexpr DeviceType kNpu = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ---------------------------------------------------------------------------
// Configuration (set once from Python via npu_sim::configure before use).
// ---------------------------------------------------------------------------

std::atomic<int> g_device_count{8};
std::atomic<int64_t> g_capacity_bytes{int64_t(64) << 30};

DeviceIndex device_count() {
  return static_cast<DeviceIndex>(g_device_count.load());
}

void check_device_index(int64_t index) {
  const int count = g_device_count.load();
  TORCH_CHECK(
      index >= 0 && index < count,
      "Invalid npu device index ",
      index,
      ": the simulated NPU has ",
      count,
      " devices (set by TORCHTITAN_NPU_SIM_DEVICES); valid indices are 0..",
      count - 1,
      ".");
}

// Like CUDA, a fresh thread starts on device 0.
thread_local DeviceIndex tls_current_device = 0;

DeviceIndex current_device() {
  return tls_current_device;
}

void set_current_device(int64_t index) {
  check_device_index(index);
  tls_current_device = static_cast<DeviceIndex>(index);
}

// ---------------------------------------------------------------------------
// Device allocator with byte accounting.
// ---------------------------------------------------------------------------

// Owner of one device block. Either malloc'ed by us (owns_host_memory) or an
// adopted CPU storage produced by a fallback kernel (kept alive by
// adopted_host_storage).
struct DeviceBlock {
  void* base;
  size_t nbytes;
  DeviceIndex device;
  bool owns_host_memory;
  c10::Storage adopted_host_storage;
};

struct DeviceCounters {
  Stat allocated_bytes;
  Stat allocation_count;
  int64_t num_ooms = 0;
  int64_t num_device_alloc = 0;
  int64_t num_device_free = 0;
};

class NpuDeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = current_device();
    reserve(device, nbytes);
    void* base = nullptr;
    if (nbytes > 0) {
      try {
        base = c10::alloc_cpu(nbytes);
      } catch (...) {
        release(device, nbytes, nullptr);
        throw;
      }
    }
    auto* block = new DeviceBlock{base, nbytes, device, true, c10::Storage()};
    track(block);
    return c10::DataPtr(
        base, block, &NpuDeviceAllocator::free_block, c10::Device(kNpu, device));
  }

  // Takes ownership of a CPU storage that a fallback kernel produced and
  // returns it as device memory, counted like a fresh allocation (a real
  // device kernel would have allocated its output on the device).
  c10::DataPtr adopt(const c10::Storage& host_storage, DeviceIndex device) {
    const size_t nbytes = host_storage.nbytes();
    reserve(device, nbytes);
    void* base = host_storage.mutable_data();
    auto* block = new DeviceBlock{base, nbytes, device, false, host_storage};
    track(block);
    return c10::DataPtr(
        base, block, &NpuDeviceAllocator::free_block, c10::Device(kNpu, device));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    // raw_alloc/raw_delete are not offered: every block carries a context.
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) {
      std::memcpy(dest, src, count);
    }
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    // Nothing is cached: freed blocks go straight back to the host.
  }

  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/)
      override {
    // Streams run synchronously, so no block outlives its last use.
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(
      DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const DeviceCounters& c = counters_[device];
    c10::CachingDeviceAllocator::DeviceStats stats;
    // Without a cache, allocated == reserved == active == requested, and
    // every allocation is its own segment; all blocks count as "large pool".
    for (auto type : {StatType::AGGREGATE, StatType::LARGE_POOL}) {
      const auto i = static_cast<size_t>(type);
      stats.allocated_bytes[i] = c.allocated_bytes;
      stats.reserved_bytes[i] = c.allocated_bytes;
      stats.active_bytes[i] = c.allocated_bytes;
      stats.requested_bytes[i] = c.allocated_bytes;
      stats.allocation[i] = c.allocation_count;
      stats.segment[i] = c.allocation_count;
      stats.active[i] = c.allocation_count;
    }
    stats.num_alloc_retries = 0;
    stats.num_ooms = c.num_ooms;
    stats.num_device_alloc = c.num_device_alloc;
    stats.num_device_free = c.num_device_free;
    return stats;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceCounters& c = counters_[device];
    c.allocated_bytes.reset_accumulated();
    c.allocation_count.reset_accumulated();
    c.num_ooms = 0;
    c.num_device_alloc = 0;
    c.num_device_free = 0;
  }

  void resetPeakStats(DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    counters_[device].allocated_bytes.reset_peak();
    counters_[device].allocation_count.reset_peak();
  }

  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t capacity = g_capacity_bytes.load();
    const int64_t used = counters_[device].allocated_bytes.current;
    return {static_cast<size_t>(std::max<int64_t>(capacity - used, 0)),
            static_cast<size_t>(capacity)};
  }

  std::optional<DeviceIndex> device_of(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    auto it = live_blocks_.upper_bound(address);
    if (it == live_blocks_.begin()) {
      return std::nullopt;
    }
    --it;
    const DeviceBlock* block = it->second;
    if (address < it->first + std::max<size_t>(block->nbytes, 1)) {
      return block->device;
    }
    return std::nullopt;
  }

 private:
  void reserve(DeviceIndex device, size_t nbytes) {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceCounters& c = counters_[device];
    const int64_t capacity = g_capacity_bytes.load();
    if (c.allocated_bytes.current + static_cast<int64_t>(nbytes) > capacity) {
      c.num_ooms += 1;
      constexpr double kMiB = 1024.0 * 1024.0;
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          false,
          "NPU out of memory (simulated). Tried to allocate ",
          static_cast<double>(nbytes) / kMiB,
          " MiB on npu:",
          static_cast<int>(device),
          " with ",
          static_cast<double>(c.allocated_bytes.current) / kMiB,
          " MiB already allocated of ",
          static_cast<double>(capacity) / kMiB,
          " MiB capacity (set by TORCHTITAN_NPU_SIM_MEMORY_GB).");
    }
    c.allocated_bytes.increase(nbytes);
    c.allocation_count.increase(1);
    c.num_device_alloc += 1;
  }

  void release(DeviceIndex device, size_t nbytes, const void* base) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceCounters& c = counters_[device];
    c.allocated_bytes.decrease(nbytes);
    c.allocation_count.decrease(1);
    c.num_device_free += 1;
    if (base != nullptr) {
      live_blocks_.erase(reinterpret_cast<uintptr_t>(base));
    }
  }

  void track(DeviceBlock* block) {
    if (block->base == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    live_blocks_[reinterpret_cast<uintptr_t>(block->base)] = block;
  }

  static void free_block(void* context);

  std::mutex mutex_;
  std::array<DeviceCounters, kMaxDevices> counters_;
  std::map<uintptr_t, DeviceBlock*> live_blocks_;
};

// Leaked on purpose: tensors may be freed during interpreter shutdown, after
// static destructors would have run.
NpuDeviceAllocator* g_device_allocator = new NpuDeviceAllocator();

void NpuDeviceAllocator::free_block(void* context) {
  auto* block = static_cast<DeviceBlock*>(context);
  g_device_allocator->release(block->device, block->nbytes, block->base);
  if (block->owns_host_memory && block->base != nullptr) {
    c10::free_cpu(block->base);
  }
  delete block;
}

// ---------------------------------------------------------------------------
// Pinned ("page-locked") host memory: ordinary host memory, remembered so
// that is_pinned() answers like on a real accelerator.
// ---------------------------------------------------------------------------

class PinnedHostAllocator final : public at::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* base = nbytes > 0 ? c10::alloc_cpu(nbytes) : nullptr;
    if (base != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_[reinterpret_cast<uintptr_t>(base)] = nbytes;
      bytes_.increase(nbytes);
    }
    return c10::DataPtr(
        base, base, &PinnedHostAllocator::free_pinned, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &PinnedHostAllocator::free_pinned;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) {
      std::memcpy(dest, src, count);
    }
  }

  bool is_pinned(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    auto it = live_.upper_bound(address);
    if (it == live_.begin()) {
      return false;
    }
    --it;
    return address < it->first + it->second;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {bytes_.current, bytes_.peak, static_cast<int64_t>(live_.size())};
  }

 private:
  static void free_pinned(void* base);

  std::mutex mutex_;
  std::map<uintptr_t, size_t> live_;
  Stat bytes_;
};

PinnedHostAllocator* g_pinned_allocator = new PinnedHostAllocator();

void PinnedHostAllocator::free_pinned(void* base) {
  if (base == nullptr) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(g_pinned_allocator->mutex_);
    auto it = g_pinned_allocator->live_.find(reinterpret_cast<uintptr_t>(base));
    if (it != g_pinned_allocator->live_.end()) {
      g_pinned_allocator->bytes_.decrease(it->second);
      g_pinned_allocator->live_.erase(it);
    }
  }
  c10::free_cpu(base);
}

// ---------------------------------------------------------------------------
// Random numbers.
//
// Every npu default generator is a view of the CPU default generator: npu
// random kernels run the CPU kernels, which draw from that same Mersenne
// Twister stream, so torch.manual_seed(s) followed by the same random calls
// gives bit-identical values on "cpu" and "npu".
//
// The state is exposed like CUDA's/Ascend's Philox state -- 16 bytes: seed
// (uint64) then offset (int64) -- because DTensor's OffsetBasedRNGTracker
// reads and writes it that way. Here the offset counts 32-bit words drawn
// from mt19937(seed); converting an engine state to an offset needs the
// number of twists since seeding, which StreamPositionIndex finds (and
// caches) by hashing each twisted state.
// ---------------------------------------------------------------------------

constexpr int kMtStateWords = 624;  // at::MERSENNE_STATE_N

uint64_t hash_mt_state(const std::array<uint32_t, kMtStateWords>& words) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (uint32_t w : words) {
    h ^= w;
    h *= 1099511628211ULL;
  }
  return h;
}

class StreamPositionIndex {
 public:
  // Number of 32-bit words drawn since mt19937(seed) produced `data`.
  uint64_t position_of(const at::mt19937_data_pod& data) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (data.left_ == 1 && data.next_ == 0) {
      return 0;  // freshly seeded, nothing drawn
    }
    reset_if_new_seed(data.seed_);
    const uint64_t target = hash_mt_state(data.state_);
    auto found = twists_by_hash_.find(target);
    while (found == twists_by_hash_.end()) {
      TORCH_CHECK(
          frontier_twists_ < kMaxTwists,
          "Cannot express the CPU generator's state as an npu (seed, offset) "
          "state: it is not reachable from its seed ",
          data.seed_,
          " within ",
          kMaxTwists * kMtStateWords,
          " draws. Set generator states with torch.manual_seed or "
          "torch.npu.set_rng_state instead of a foreign state tensor.");
      advance_frontier();
      found = twists_by_hash_.find(target);
    }
    return (found->second - 1) * kMtStateWords + data.next_;
  }

  at::mt19937_data_pod state_at(uint64_t seed, uint64_t position) {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_if_new_seed(seed);
    at::mt19937 fresh(seed);
    if (position == 0) {
      return fresh.data();
    }
    const uint64_t twists = (position - 1) / kMtStateWords + 1;
    const uint32_t next = static_cast<uint32_t>(position - (twists - 1) * kMtStateWords);
    TORCH_CHECK(
        twists <= kMaxTwists,
        "npu rng offset ",
        position,
        " is beyond the simulator's limit of ",
        kMaxTwists * kMtStateWords,
        " words.");
    at::mt19937_data_pod data;
    if (twists >= frontier_twists_) {
      while (frontier_twists_ < twists) {
        advance_frontier();
      }
      data = frontier_;
    } else {
      auto checkpoint = checkpoints_.upper_bound(twists);
      --checkpoint;  // checkpoints_ always holds twist count 0
      data = checkpoint->second;
      for (uint64_t t = checkpoint->first; t < twists; ++t) {
        data = twisted(data);
      }
    }
    data.seed_ = seed;
    data.seeded_ = true;
    data.next_ = next;
    data.left_ = kMtStateWords + 1 - static_cast<int>(next);
    return data;
  }

 private:
  static constexpr uint64_t kMaxTwists = uint64_t(1) << 23;  // ~5e9 words
  static constexpr uint64_t kCheckpointEvery = 64;

  static at::mt19937_data_pod twisted(at::mt19937_data_pod data) {
    // With left_ == 1 the next draw regenerates the whole state block.
    data.left_ = 1;
    at::mt19937 engine;
    engine.set_data(data);
    engine();
    return engine.data();
  }

  void reset_if_new_seed(uint64_t seed) {
    if (has_seed_ && seed == seed_) {
      return;
    }
    has_seed_ = true;
    seed_ = seed;
    twists_by_hash_.clear();
    checkpoints_.clear();
    frontier_ = at::mt19937(seed).data();
    frontier_twists_ = 0;
    checkpoints_.emplace(0, frontier_);
  }

  void advance_frontier() {
    frontier_ = twisted(frontier_);
    frontier_twists_ += 1;
    twists_by_hash_.emplace(hash_mt_state(frontier_.state_), frontier_twists_);
    if (frontier_twists_ % kCheckpointEvery == 0) {
      checkpoints_.emplace(frontier_twists_, frontier_);
    }
  }

  std::mutex mutex_;
  bool has_seed_ = false;
  uint64_t seed_ = 0;
  std::unordered_map<uint64_t, uint64_t> twists_by_hash_;
  std::map<uint64_t, at::mt19937_data_pod> checkpoints_;
  at::mt19937_data_pod frontier_{};
  uint64_t frontier_twists_ = 0;
};

class NpuGeneratorImpl final : public c10::GeneratorImpl {
 public:
  NpuGeneratorImpl(
      DeviceIndex device,
      at::Generator host_generator,
      std::shared_ptr<StreamPositionIndex> index)
      : c10::GeneratorImpl{c10::Device(kNpu, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)},
        host_generator_(std::move(host_generator)),
        index_(std::move(index)) {}

  // The CPU generator whose stream this npu generator draws from; fallback
  // kernels receive it in place of the npu generator.
  const at::Generator& host_generator() const {
    return host_generator_;
  }

  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    host()->set_current_seed(seed);
  }

  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    return host()->current_seed();
  }

  uint64_t seed() override {
    const uint64_t random = c10::detail::getNonDeterministicRandom();
    set_current_seed(random);
    return random;
  }

  void set_offset(uint64_t offset) override {
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    set_position_locked(host()->current_seed(), offset);
  }

  uint64_t get_offset() const override {
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    return index_->position_of(host()->engine().data());
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    uint64_t seed = 0;
    uint64_t position = 0;
    {
      std::lock_guard<std::mutex> lock(host_generator_.mutex());
      const at::mt19937_data_pod data = host()->engine().data();
      seed = data.seed_;
      position = index_->position_of(data);
    }
    auto state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr<uint8_t>(), &seed, 8);
    std::memcpy(state.data_ptr<uint8_t>() + 8, &position, 8);
    return state.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& new_state) override {
    TORCH_CHECK(
        new_state.device().is_cpu() && new_state.dtype() == at::kByte &&
            new_state.numel() == 16 && new_state.is_contiguous(),
        "npu generator state must be a contiguous CPU uint8 tensor of 16 "
        "bytes (uint64 seed, int64 offset) as returned by "
        "torch.npu.get_rng_state(); got dtype ",
        new_state.dtype(),
        ", device ",
        new_state.device(),
        " and ",
        new_state.numel(),
        " elements.");
    uint64_t seed = 0;
    int64_t offset = 0;
    const auto* bytes = static_cast<const uint8_t*>(new_state.data());
    std::memcpy(&seed, bytes, 8);
    std::memcpy(&offset, bytes + 8, 8);
    TORCH_CHECK(offset >= 0, "npu generator state has a negative offset ", offset, ".");
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    set_position_locked(seed, static_cast<uint64_t>(offset));
  }

 private:
  at::CPUGeneratorImpl* host() const {
    return host_generator_.get<at::CPUGeneratorImpl>();
  }

  void set_position_locked(uint64_t seed, uint64_t position) {
    at::mt19937 engine;
    engine.set_data(index_->state_at(seed, position));
    host()->set_engine(engine);
    // The cached second Box-Muller sample is not part of the 16-byte state.
    host()->set_next_float_normal_sample(std::nullopt);
    host()->set_next_double_normal_sample(std::nullopt);
  }

  NpuGeneratorImpl* clone_impl() const override {
    std::lock_guard<std::mutex> lock(host_generator_.mutex());
    at::Generator copy = host_generator_.clone();
    return new NpuGeneratorImpl(
        device_.index(), std::move(copy), std::make_shared<StreamPositionIndex>());
  }

  // mutable: at::Generator::mutex() is non-const.
  mutable at::Generator host_generator_;
  std::shared_ptr<StreamPositionIndex> index_;
};

std::shared_ptr<StreamPositionIndex> g_default_stream_index =
    std::make_shared<StreamPositionIndex>();

const at::Generator& default_generator(DeviceIndex device) {
  static std::once_flag once;
  static std::vector<at::Generator> generators;
  std::call_once(once, [] {
    for (int i = 0; i < kMaxDevices; ++i) {
      generators.push_back(at::make_generator<NpuGeneratorImpl>(
          static_cast<DeviceIndex>(i),
          at::detail::getDefaultCPUGenerator(),
          g_default_stream_index));
    }
  });
  const DeviceIndex index = device < 0 ? current_device() : device;
  check_device_index(index);
  return generators[index];
}

// ---------------------------------------------------------------------------
// Device guard, streams and events. All work runs synchronously on the host,
// so streams are bookkeeping only and events complete when recorded.
// ---------------------------------------------------------------------------

struct SimEvent {
  bool timing_enabled;
  bool recorded = false;
  double time_ms = 0.0;
};

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

std::atomic<c10::StreamId> g_next_stream_id{1};
thread_local std::array<c10::StreamId, kMaxDevices> tls_current_stream{};

struct NpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  NpuGuardImpl() = default;

  DeviceType type() const override {
    return kNpu;
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kNpu, "Expected an npu device, but got ", device, ".");
    const DeviceIndex previous = current_device();
    if (device.index() != previous) {
      set_current_device(device.index());
    }
    return c10::Device(kNpu, previous);
  }

  c10::Device getDevice() const override {
    return c10::Device(kNpu, current_device());
  }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kNpu, "Expected an npu device, but got ", device, ".");
    set_current_device(device.index());
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < g_device_count.load()) {
      tls_current_device = device.index();
    }
  }

  c10::Stream getStream(c10::Device device) const override {
    const DeviceIndex index = device.index() < 0 ? current_device() : device.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, index), tls_current_stream[index]);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    const DeviceIndex index = device.index() < 0 ? current_device() : device.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, index), 0);
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    const DeviceIndex index = device.index() < 0 ? current_device() : device.index();
    check_device_index(index);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, index), g_next_stream_id++);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/)
      const override {
    return getNewStream(device, 0);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    const DeviceIndex index = stream.device_index();
    const c10::Stream previous = getStream(stream.device());
    tls_current_stream[index] = stream.id();
    return previous;
  }

  DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }

  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }

  void record(
      void** event,
      const c10::Stream& stream,
      const DeviceIndex device_index,
      const c10::EventFlag flag) const override {
    TORCH_CHECK(
        device_index == -1 || device_index == stream.device_index(),
        "Event device index ",
        device_index,
        " does not match recording stream's device index ",
        stream.device_index(),
        ".");
    if (*event == nullptr) {
      *event = new SimEvent{flag == c10::EventFlag::BACKEND_DEFAULT};
    }
    auto* sim_event = static_cast<SimEvent*>(*event);
    sim_event->recorded = true;
    sim_event->time_ms = now_ms();
  }

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}

  bool queryEvent(void* /*event*/) const override {
    return true;
  }

  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }

  void synchronizeStream(const c10::Stream& /*stream*/) const override {}

  void synchronizeEvent(void* /*event*/) const override {}

  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}

  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/)
      const override {}

  double elapsedTime(void* start, void* end, const DeviceIndex /*device_index*/)
      const override {
    TORCH_CHECK(
        start != nullptr && end != nullptr,
        "Both events must be recorded before calculating elapsed time.");
    auto* first = static_cast<SimEvent*>(start);
    auto* second = static_cast<SimEvent*>(end);
    TORCH_CHECK(
        first->timing_enabled && second->timing_enabled,
        "Both events must be created with argument 'enable_timing=True'.");
    return second->time_ms - first->time_ms;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

// ---------------------------------------------------------------------------
// Hooks: what ATen asks the accelerator (availability, pinned memory,
// generators, storage resize).
// ---------------------------------------------------------------------------

void resize_storage_bytes(const c10::Storage& storage, size_t new_nbytes) {
  TORCH_CHECK(
      storage.resizable(),
      "Trying to resize an npu storage that is not resizable.");
  const DeviceIndex device =
      storage.device().has_index() ? storage.device().index() : current_device();
  c10::DeviceGuard guard(c10::Device(kNpu, device));
  c10::DataPtr fresh = g_device_allocator->allocate(new_nbytes);
  const size_t keep = std::min(storage.nbytes(), new_nbytes);
  if (keep > 0 && storage.data() != nullptr) {
    std::memcpy(fresh.get(), storage.data(), keep);
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(new_nbytes);
}

struct NpuHooks final : public at::PrivateUse1HooksInterface {
  void init() const override {}

  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return device_count() > 0;
  }

  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override {
    return true;
  }

  DeviceIndex deviceCount() const override {
    return device_count();
  }

  void setCurrentDevice(DeviceIndex device) const override {
    set_current_device(device);
  }

  DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    const DeviceIndex previous = current_device();
    set_current_device(device);
    return previous;
  }

  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    if (device < 0) {
      return current_device();  // "no device": leave the current one alone
    }
    return exchangeDevice(device);
  }

  bool isPinnedPtr(const void* data) const override {
    return g_pinned_allocator->is_pinned(data);
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    return g_pinned_allocator;
  }

  at::Device getDeviceFromPtr(void* data) const override {
    auto device = g_device_allocator->device_of(data);
    TORCH_CHECK(
        device.has_value(),
        "Pointer ",
        data,
        " does not point into memory allocated on a simulated npu device.");
    return at::Device(kNpu, *device);
  }

  const at::Generator& getDefaultGenerator(DeviceIndex device_index) const override {
    return default_generator(device_index);
  }

  at::Generator getNewGenerator(DeviceIndex device_index) const override {
    const DeviceIndex index = device_index < 0 ? current_device() : device_index;
    check_device_index(index);
    return at::make_generator<NpuGeneratorImpl>(
        index, at::detail::createCPUGenerator(), std::make_shared<StreamPositionIndex>());
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_nbytes) const override {
    resize_storage_bytes(storage, new_nbytes);
  }
};

// ---------------------------------------------------------------------------
// Host aliases: CPU tensors over npu memory, used to run CPU kernels in place.
// ---------------------------------------------------------------------------

void release_alias_keepalive(void* context) {
  delete static_cast<c10::Storage*>(context);
}

// One call's bookkeeping: each npu storage gets exactly one host alias
// storage, so CPU kernels see arguments that share memory as sharing storage
// (their overlap checks depend on it), and outputs that are views of an
// argument map back onto that argument's npu storage.
struct AliasScope {
  std::unordered_map<const c10::StorageImpl*, c10::Storage> host_by_npu;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> npu_by_host;
  // npu storage -> (data pointer, nbytes) when aliased, to detect kernels
  // that reallocated an out= argument's storage.
  std::unordered_map<const c10::StorageImpl*, std::pair<const void*, size_t>> original_extent;

  c10::Storage host_storage_for(const c10::Storage& npu_storage) {
    const c10::StorageImpl* key = npu_storage.unsafeGetStorageImpl();
    auto found = host_by_npu.find(key);
    if (found != host_by_npu.end()) {
      return found->second;
    }
    void* data = npu_storage.nbytes() > 0 ? npu_storage.mutable_data() : nullptr;
    c10::DataPtr alias_ptr(
        data, new c10::Storage(npu_storage), &release_alias_keepalive, c10::Device(c10::kCPU));
    c10::Storage host(
        c10::Storage::use_byte_size_t(),
        npu_storage.nbytes(),
        std::move(alias_ptr),
        c10::GetCPUAllocator(),
        /*resizable=*/true);
    host_by_npu.emplace(key, host);
    npu_by_host.emplace(host.unsafeGetStorageImpl(), npu_storage);
    original_extent.emplace(key, std::make_pair(data, npu_storage.nbytes()));
    return host;
  }

  at::Tensor host_alias(const at::Tensor& npu_tensor) {
    TORCH_CHECK(
        npu_tensor.layout() == c10::kStrided,
        "The simulated npu supports strided tensors only, got layout ",
        npu_tensor.layout(),
        ".");
    if (npu_tensor.numel() > 0) {
      // A kernel reading past the storage would crash the process; fail instead.
      const size_t needed = at::detail::computeStorageNbytes(
          npu_tensor.sizes(), npu_tensor.strides(), npu_tensor.dtype().itemsize(),
          npu_tensor.storage_offset());
      TORCH_CHECK(
          npu_tensor.storage().nbytes() >= needed && npu_tensor.storage().data() != nullptr,
          "npu tensor of shape ",
          npu_tensor.sizes(),
          " needs ",
          needed,
          " bytes but its storage holds ",
          npu_tensor.storage().nbytes(),
          npu_tensor._is_zerotensor() ? " (an unmaterialised zero tensor)" : "",
          ".");
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        host_storage_for(npu_tensor.storage()),
        c10::DispatchKeySet(c10::DispatchKey::CPU),
        npu_tensor.dtype());
    impl->set_sizes_and_strides(
        npu_tensor.sizes(), npu_tensor.strides(), npu_tensor.storage_offset());
    if (npu_tensor.is_conj()) {
      impl->_set_conj(true);
    }
    if (npu_tensor.is_neg()) {
      impl->_set_neg(true);
    }
    return at::Tensor(std::move(impl));
  }

  // Kernels may reallocate an out= argument (resize_output); copy the new
  // host buffer into fresh device memory so the npu storage follows.
  void sync_reallocated_storages() {
    for (auto& [npu_impl, host] : host_by_npu) {
      const auto& [data, nbytes] = original_extent.at(npu_impl);
      const void* host_data = host.nbytes() > 0 ? host.data() : nullptr;
      if (host_data == data && host.nbytes() == nbytes) {
        continue;
      }
      c10::Storage npu_storage = npu_by_host.at(host.unsafeGetStorageImpl());
      const DeviceIndex device = npu_storage.device().index();
      c10::DeviceGuard guard(c10::Device(kNpu, device));
      c10::DataPtr fresh = g_device_allocator->allocate(host.nbytes());
      if (host.nbytes() > 0) {
        std::memcpy(fresh.get(), host_data, host.nbytes());
      }
      npu_storage.set_data_ptr_noswap(std::move(fresh));
      npu_storage.set_nbytes(host.nbytes());
    }
  }

  // Wraps a CPU tensor a kernel returned as an npu tensor: a view of an
  // argument stays a view of that argument's npu storage; fresh memory is
  // adopted as a device allocation on `device`.
  at::Tensor to_npu(const at::Tensor& host_tensor, DeviceIndex device) {
    const c10::StorageImpl* host_impl = host_tensor.storage().unsafeGetStorageImpl();
    auto found = npu_by_host.find(host_impl);
    c10::Storage npu_storage;
    if (found != npu_by_host.end()) {
      npu_storage = found->second;
    } else {
      c10::Storage host_storage = host_tensor.storage();
      c10::DataPtr adopted = g_device_allocator->adopt(host_storage, device);
      npu_storage = c10::Storage(
          c10::Storage::use_byte_size_t(),
          host_storage.nbytes(),
          std::move(adopted),
          g_device_allocator,
          /*resizable=*/true);
      npu_by_host.emplace(host_impl, npu_storage);
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        std::move(npu_storage),
        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        host_tensor.dtype());
    impl->set_sizes_and_strides(
        host_tensor.sizes(), host_tensor.strides(), host_tensor.storage_offset());
    if (host_tensor.is_conj()) {
      impl->_set_conj(true);
    }
    if (host_tensor.is_neg()) {
      impl->_set_neg(true);
    }
    return at::Tensor(std::move(impl));
  }
};

// ---------------------------------------------------------------------------
// Native kernels.
// ---------------------------------------------------------------------------

c10::Device resolve_device(std::optional<c10::Device> device_opt) {
  c10::Device device = device_opt.value_or(c10::Device(kNpu, current_device()));
  TORCH_CHECK(device.type() == kNpu, "Expected an npu device, got ", device, ".");
  if (!device.has_index()) {
    device = c10::Device(kNpu, current_device());
  }
  check_device_index(device.index());
  return device;
}

void check_not_pinned(std::optional<bool> pin_memory) {
  TORCH_CHECK(
      !pin_memory.value_or(false),
      "Only CPU tensors can be pinned; an npu tensor is device memory already.");
}

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  check_not_pinned(pin_memory);
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::kStrided,
      "The simulated npu supports strided tensors only.");
  const c10::DeviceGuard guard(resolve_device(device));
  return at::detail::empty_generic(
      size,
      g_device_allocator,
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  check_not_pinned(pin_memory);
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::kStrided,
      "The simulated npu supports strided tensors only.");
  const c10::DeviceGuard guard(resolve_device(device));
  return at::detail::empty_strided_generic(
      size,
      stride,
      g_device_allocator,
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

at::Tensor as_strided(
    const at::Tensor& self,
    c10::SymIntArrayRef size,
    c10::SymIntArrayRef stride,
    std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset.has_value()) {
    offset = storage_offset->expect_int();
  }
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), offset);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(
    const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(
    const at::Tensor& self,
    c10::SymIntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  // Growing goes through the storage's allocator (ours), on its device.
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

void check_npu_storage(const c10::Storage& storage) {
  TORCH_CHECK(
      storage.device_type() == kNpu,
      "Expected an npu storage for set_ on an npu tensor, got a storage on ",
      storage.device(),
      ".");
}

at::Tensor& set_storage_offset(
    at::Tensor& self,
    c10::Storage source,
    c10::SymInt storage_offset,
    c10::SymIntArrayRef size,
    c10::SymIntArrayRef stride) {
  check_npu_storage(source);
  const c10::DeviceGuard guard(source.device());
  return at::native::set_storage_cpu_(
      self,
      source,
      storage_offset.expect_int(),
      C10_AS_INTARRAYREF_SLOW(size),
      C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  check_npu_storage(source);
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  const c10::DeviceGuard guard(source.device());
  return at::native::set_storage_cpu_(self, source, 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  TORCH_CHECK(
      source.device().type() == kNpu,
      "set_ of an npu tensor needs an npu source tensor, got ",
      source.device(),
      ".");
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  c10::Storage storage(
      c10::Storage::use_byte_size_t(), 0, g_device_allocator->allocate(0), g_device_allocator, true);
  return at::native::set_storage_cpu_(self, storage, 0, {0}, {});
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  // Copies are synchronous whatever non_blocking says.
  AliasScope scope;
  at::Tensor host_src = self.device().type() == kNpu ? scope.host_alias(self) : self;
  at::Tensor host_dst = dst.device().type() == kNpu ? scope.host_alias(dst) : dst;
  TORCH_CHECK(
      host_src.device().is_cpu() && host_dst.device().is_cpu(),
      "The simulated npu can copy only between npu and cpu tensors, got ",
      self.device(),
      " -> ",
      dst.device(),
      ".");
  host_dst.copy_(host_src);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  {
    const c10::DeviceGuard guard(dst.device());
    at::native::resize_(dst, self.sizes(), std::nullopt);
  }
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  AliasScope scope;
  return at::native::_local_scalar_dense_cpu(scope.host_alias(self));
}

// Autograd's "efficient zero tensors": no memory, ZeroTensor key set, so the
// ZeroTensor fallback materialises them before any kernel reads them.
struct ZeroTensorAllocator final : public at::Allocator {
  explicit ZeroTensorAllocator(c10::Device device) : device_(device) {}
  c10::DataPtr allocate(size_t /*nbytes*/) override {
    return c10::DataPtr(nullptr, device_);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t count) const override {
    TORCH_CHECK(count == 0, "A zero tensor has no memory to copy.");
  }
  c10::Device device_;
};

at::Tensor efficient_zero_tensor(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> /*layout*/,
    std::optional<c10::Device> device,
    std::optional<bool> /*pin_memory*/) {
  ZeroTensorAllocator allocator(resolve_device(device));
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) |
      c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(
      size, &allocator, keys, c10::dtype_or_default(dtype), std::nullopt);
}

// torch_npu lists _lazy_clone among its NPU kernels (npu_native_functions.yaml). Through the CPU
// fallback, the CPU kernel's copy-on-write would share the host alias's storage, which the
// simulated device tensor does not own ("Expected storage != nullptr"): a lazy clone is, to
// every observer, a clone.
at::Tensor lazy_clone(const at::Tensor& self) {
  return self.clone();
}

void record_stream(at::Tensor& /*self*/, c10::Stream /*stream*/) {
  // Work runs synchronously: nothing to order.
}

// ---------------------------------------------------------------------------
// CPU fallback.
// ---------------------------------------------------------------------------

// Ops that accept host index tensors alongside device tensors on real
// accelerators (the indices are copied to the device internally).
bool accepts_host_indices(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::index",
      "aten::index_put",
      "aten::index_put_",
      "aten::_index_put_impl_",
      "aten::_unsafe_index",
      "aten::_unsafe_index_put",
  };
  return ops.count(name.name) > 0;
}

struct ArgumentScan {
  std::optional<DeviceIndex> npu_device;
  std::optional<c10::Device> host_tensor_device;  // first non-scalar host tensor
  std::optional<DeviceIndex> second_npu_device;

  void see(const at::Tensor& t) {
    if (!t.defined()) {
      return;
    }
    if (t.device().type() == kNpu) {
      const DeviceIndex index = t.device().index();
      if (!npu_device.has_value()) {
        npu_device = index;
      } else if (*npu_device != index && !second_npu_device.has_value()) {
        second_npu_device = index;
      }
    } else if (t.dim() > 0 && !host_tensor_device.has_value()) {
      // 0-dim host tensors are accepted as scalars, as on CUDA.
      host_tensor_device = t.device();
    }
  }

  void see(const c10::IValue& value) {
    if (value.isTensor()) {
      see(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) {
        see(t);
      }
    } else if (value.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : value.toOptionalTensorList()) {
        if (t.has_value()) {
          see(*t);
        }
      }
    }
  }
};

c10::IValue map_tensors(
    const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    return t.defined() ? c10::IValue(fn(t)) : value;
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> mapped;
    for (const at::Tensor& t : value.toTensorList()) {
      mapped.push_back(t.defined() ? fn(t) : t);
    }
    return mapped;
  }
  if (value.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> mapped;
    for (const std::optional<at::Tensor>& t : value.toOptionalTensorList()) {
      if (t.has_value() && t->defined()) {
        mapped.push_back(fn(*t));
      } else {
        mapped.push_back(t);
      }
    }
    return mapped;
  }
  return value;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  const size_t first = stack->size() - num_arguments;

  ArgumentScan scan;
  std::optional<DeviceIndex> requested_device;
  for (size_t i = 0; i < num_arguments; ++i) {
    c10::IValue& value = (*stack)[first + i];
    scan.see(value);
    if (value.isDevice() && value.toDevice().type() == kNpu) {
      if (value.toDevice().has_index()) {
        requested_device = value.toDevice().index();
      }
    }
  }
  if (scan.second_npu_device.has_value()) {
    TORCH_CHECK(
        false,
        "Expected all tensors to be on the same device, but found at least two devices, npu:",
        static_cast<int>(*scan.npu_device),
        " and npu:",
        static_cast<int>(*scan.second_npu_device),
        "! (when running ",
        schema.operator_name(),
        " on the simulated npu)");
  }
  if (scan.npu_device.has_value() && scan.host_tensor_device.has_value() &&
      !accepts_host_indices(schema.operator_name())) {
    TORCH_CHECK(
        false,
        "Expected all tensors to be on the same device, but found at least two devices, npu:",
        static_cast<int>(*scan.npu_device),
        " and ",
        *scan.host_tensor_device,
        "! (when running ",
        schema.operator_name(),
        " on the simulated npu: host tensors must be moved to the npu first)");
  }
  const DeviceIndex output_device =
      scan.npu_device.value_or(requested_device.value_or(current_device()));

  AliasScope scope;
  // Host alias TensorImpl -> the npu tensor it stands for, so that kernels
  // returning an argument (in-place and out= ops) give back the npu tensor.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> npu_by_alias;
  std::vector<std::pair<at::Tensor, at::Tensor>> written_arguments;  // (npu, alias)
  for (size_t i = 0; i < num_arguments; ++i) {
    c10::IValue& value = (*stack)[first + i];
    const auto* alias_info = schema.arguments()[i].alias_info();
    const bool is_written = alias_info != nullptr && alias_info->isWrite();
    if (value.isDevice() && value.toDevice().type() == kNpu) {
      value = c10::IValue(c10::Device(c10::kCPU));
      continue;
    }
    if (value.isGenerator()) {
      const at::Generator& generator = value.toGenerator();
      if (generator.defined() && generator.device().type() == kNpu) {
        value = c10::IValue(generator.get<NpuGeneratorImpl>()->host_generator());
      }
      continue;
    }
    value = map_tensors(value, [&](const at::Tensor& t) -> at::Tensor {
      if (t.device().type() != kNpu) {
        return t;
      }
      at::Tensor alias = scope.host_alias(t);
      npu_by_alias.emplace(alias.unsafeGetTensorImpl(), t);
      if (is_written) {
        written_arguments.emplace_back(t, alias);
      }
      return alias;
    });
  }

  {
    const c10::DeviceGuard guard(c10::Device(kNpu, output_device));
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }

  scope.sync_reallocated_storages();
  for (auto& [npu_tensor, alias] : written_arguments) {
    // out= kernels may resize their output: carry the new geometry over.
    if (npu_tensor.sizes() != alias.sizes() || npu_tensor.strides() != alias.strides() ||
        npu_tensor.storage_offset() != alias.storage_offset()) {
      npu_tensor.unsafeGetTensorImpl()->set_sizes_and_strides(
          alias.sizes(), alias.strides(), alias.storage_offset());
    }
  }

  const size_t num_returns = schema.returns().size();
  const size_t first_return = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& value = (*stack)[first_return + i];
    value = map_tensors(value, [&](const at::Tensor& t) -> at::Tensor {
      auto found = npu_by_alias.find(t.unsafeGetTensorImpl());
      if (found != npu_by_alias.end()) {
        return found->second;
      }
      if (!t.device().is_cpu()) {
        return t;
      }
      return scope.to_npu(t, output_device);
    });
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
  m.impl("_lazy_clone", lazy_clone);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

// copy_ reaches a PrivateUse1 backend through _copy_from. Without these, the
// Conjugate/Negative fallbacks would materialise a conj/neg source with
// clone(), which calls copy_ -> _copy_from on the same source again: an
// endless recursion. Our _copy_from carries the bits over to the host alias,
// where the CPU copy_ resolves them.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

// ---------------------------------------------------------------------------
// Python-facing helpers (torch.ops.npu_sim.*).
// ---------------------------------------------------------------------------

void configure(int64_t device_count_value, int64_t capacity_bytes) {
  TORCH_CHECK(
      device_count_value >= 1 && device_count_value <= kMaxDevices,
      "TORCHTITAN_NPU_SIM_DEVICES must be between 1 and ",
      kMaxDevices,
      ", got ",
      device_count_value,
      ".");
  TORCH_CHECK(
      capacity_bytes > 0,
      "TORCHTITAN_NPU_SIM_MEMORY_GB must be positive, got ",
      capacity_bytes,
      " bytes.");
  g_device_count = static_cast<int>(device_count_value);
  g_capacity_bytes = capacity_bytes;
}

int64_t op_device_count() {
  return device_count();
}

int64_t op_current_device() {
  return current_device();
}

void op_set_device(int64_t index) {
  set_current_device(index);
}

std::vector<int64_t> op_pinned_memory_stats() {
  return g_pinned_allocator->stats();
}

// torch.Event.elapsed_time rejects subclasses (exact type check), so
// torch.npu.Event computes it from the events' ids, which are SimEvent
// pointers handed out by NpuGuardImpl::record.
double op_event_elapsed_time(int64_t start_id, int64_t end_id) {
  TORCH_CHECK(
      start_id != 0 && end_id != 0,
      "Both events must be recorded before calculating elapsed time.");
  return NpuGuardImpl().elapsedTime(
      reinterpret_cast<void*>(start_id), reinterpret_cast<void*>(end_id), -1);
}

int64_t op_capacity_bytes() {
  return g_capacity_bytes.load();
}

TORCH_LIBRARY(npu_sim, m) {
  m.def("configure(int device_count, int capacity_bytes) -> ()", configure);
  m.def("device_count() -> int", op_device_count);
  m.def("current_device() -> int", op_current_device);
  m.def("set_device(int index) -> ()", op_set_device);
  m.def("pinned_memory_stats() -> int[]", op_pinned_memory_stats);
  m.def("capacity_bytes() -> int", op_capacity_bytes);
  m.def("event_elapsed_time(int start_id, int end_id) -> float", op_event_elapsed_time);
}

// The dispatcher prefers composite kernels over a backend fallback. Two kinds
// would make the npu compute differently from the CPU:
//  * structured ops (add, mse_loss, ...) have CompositeExplicitAutogradNonFunctional
//    kernels that run a meta function, allocate the output on the npu and call
//    the .out variant; some CPU .out kernels then disagree with that meta about
//    the output shape (mse_loss warns that it resized its output);
//  * a few ops (native_layer_norm, native_group_norm, addr, ...) have a
//    CompositeExplicitAutograd "math" kernel for non-CPU backends whose
//    rounding differs from the CPU kernel.
// Sending every op that has a CPU kernel and such a composite kernel straight
// to the fallback runs the CPU kernel itself, so npu results are bit-identical
// to CPU results (the CPU rehearsal comparison relies on it).
void route_structured_ops_to_fallback() {
  static auto* library = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto handle = dispatcher.findOp(name);
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      continue;
    }
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) {
      qualified += "." + name.overload_name;
    }
    library->impl(
        qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  }
}

struct Registration {
  Registration() {
    c10::SetAllocator(kNpu, g_device_allocator);
    at::RegisterPrivateUse1HooksInterface(new NpuHooks());
    route_structured_ops_to_fallback();
  }
};
Registration g_registration;

}  // namespace npu_sim

// Autocast on "npu" with the same op lists and policies as CUDA (what
// torch.autocast(device_type="npu") does with torch_npu). Ops not listed
// fall through to the backend.
namespace at::autocast {
namespace {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NPU_SIM_LOWER_PRECISION_FP(...) \
  KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define NPU_SIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define NPU_SIM_FP32_SET_OPT_DTYPE(...) \
  KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define NPU_SIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(NPU_SIM_LOWER_PRECISION_FP)
  AT_FORALL_FP32(NPU_SIM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(NPU_SIM_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(
      KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(NPU_SIM_PROMOTE)
#undef NPU_SIM_LOWER_PRECISION_FP
#undef NPU_SIM_FP32
#undef NPU_SIM_FP32_SET_OPT_DTYPE
#undef NPU_SIM_PROMOTE
}

}  // namespace
}  // namespace at::autocast
