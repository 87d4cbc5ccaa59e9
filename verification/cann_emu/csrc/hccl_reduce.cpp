// HCCL element types and reductions (HcclDataType, HcclReduceOp of hccl_types.h). Ranks are folded
// in rank order, so every rank of a communicator gets the same bytes; fp16 and bf16 are widened to
// float32 per element, folded, and rounded once (round to nearest even). Integer sums and products
// wrap (two's complement), as unsigned arithmetic of the same width.
#include "hccl_internal.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace cann_emu::hccl {

void raise(int code, const std::string& msg) { throw Failure{code, msg}; }

size_t dtype_bytes(int dtype) {
    switch (dtype) {
        case DT_INT8: case DT_UINT8: case DT_HIF8: case DT_FP8E4M3: case DT_FP8E5M2: case DT_FP8E8M0: return 1;
        case DT_INT16: case DT_UINT16: case DT_FP16: case DT_BFP16: return 2;
        case DT_INT32: case DT_UINT32: case DT_FP32: return 4;
        case DT_INT64: case DT_UINT64: case DT_FP64: return 8;
        case DT_INT128: return 16;
        default: return 0;
    }
}

std::string dtype_label(int dtype) {
    static const char* names[] = {"int8", "int16", "int32", "fp16", "fp32", "int64", "uint64", "uint8",
                                  "uint16", "uint32", "fp64", "bf16", "int128", "?", "hif8", "fp8e4m3",
                                  "fp8e5m2", "fp8e8m0"};
    if (dtype >= 0 && dtype < 18 && dtype != 13) return names[dtype];
    return "dtype " + std::to_string(dtype);
}

std::string op_label(int op) {
    static const char* names[] = {"sum", "prod", "max", "min"};
    return op >= 0 && op < 4 ? names[op] : "reduce op " + std::to_string(op);
}

bool reducible(int dtype, int op) {
    if (op < OP_SUM || op > OP_MIN) return false;
    switch (dtype) {
        case DT_INT8: case DT_INT16: case DT_INT32: case DT_INT64: case DT_UINT8: case DT_UINT16:
        case DT_UINT32: case DT_UINT64: case DT_FP16: case DT_FP32: case DT_FP64: case DT_BFP16:
            return true;
        default:
            return false;
    }
}

namespace {

float bf16_to_float(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);  // stays a (quiet) NaN
    u += 0x7FFF + ((u >> 16) & 1);                          // round to nearest even
    return uint16_t(u >> 16);
}

template <typename T>
T fold(int op, T a, T b) {
    if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        switch (op) {
            case OP_SUM: return T(U(a) + U(b));
            case OP_PROD: return T(U(a) * U(b));
            case OP_MAX: return a < b ? b : a;
            default: return b < a ? b : a;
        }
    } else {
        switch (op) {
            case OP_SUM: return a + b;
            case OP_PROD: return a * b;
            // NaN propagates, as torch.maximum / torch.minimum.
            case OP_MAX: return std::isnan(a) || std::isnan(b) ? NAN : (a < b ? b : a);
            default: return std::isnan(a) || std::isnan(b) ? NAN : (b < a ? b : a);
        }
    }
}

// Stored type S, computed in A: load/store convert.
template <typename S, typename A, A (*load)(S), S (*store)(A)>
void reduce_as(int op, uint64_t count, const std::vector<const char*>& inputs, char* out) {
    for (uint64_t i = 0; i < count; ++i) {
        S s;
        std::memcpy(&s, inputs[0] + i * sizeof(S), sizeof(S));
        A acc = load(s);
        for (size_t r = 1; r < inputs.size(); ++r) {
            std::memcpy(&s, inputs[r] + i * sizeof(S), sizeof(S));
            acc = fold<A>(op, acc, load(s));
        }
        s = store(acc);
        std::memcpy(out + i * sizeof(S), &s, sizeof(S));
    }
}

template <typename T> T same(T x) { return x; }
float half_load(_Float16 h) { return float(h); }
_Float16 half_store(float f) { return _Float16(f); }
float bf_load(uint16_t h) { return bf16_to_float(h); }
uint16_t bf_store(float f) { return float_to_bf16(f); }

}  // namespace

void reduce_ranks(int dtype, int op, uint64_t count, const std::vector<const char*>& inputs, char* out) {
    switch (dtype) {
        case DT_INT8: return reduce_as<int8_t, int8_t, same, same>(op, count, inputs, out);
        case DT_INT16: return reduce_as<int16_t, int16_t, same, same>(op, count, inputs, out);
        case DT_INT32: return reduce_as<int32_t, int32_t, same, same>(op, count, inputs, out);
        case DT_INT64: return reduce_as<int64_t, int64_t, same, same>(op, count, inputs, out);
        case DT_UINT8: return reduce_as<uint8_t, uint8_t, same, same>(op, count, inputs, out);
        case DT_UINT16: return reduce_as<uint16_t, uint16_t, same, same>(op, count, inputs, out);
        case DT_UINT32: return reduce_as<uint32_t, uint32_t, same, same>(op, count, inputs, out);
        case DT_UINT64: return reduce_as<uint64_t, uint64_t, same, same>(op, count, inputs, out);
        case DT_FP32: return reduce_as<float, float, same, same>(op, count, inputs, out);
        case DT_FP64: return reduce_as<double, double, same, same>(op, count, inputs, out);
        case DT_FP16: return reduce_as<_Float16, float, half_load, half_store>(op, count, inputs, out);
        case DT_BFP16: return reduce_as<uint16_t, float, bf_load, bf_store>(op, count, inputs, out);
        default: raise(HCCL_E_NOT_SUPPORT, "reduction " + op_label(op) + " of " + dtype_label(dtype) + " is not emulated");
    }
}

}  // namespace cann_emu::hccl
