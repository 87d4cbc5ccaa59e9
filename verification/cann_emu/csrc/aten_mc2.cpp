// MC2 operators: a collective and a matmul as one operator, the pair torch_npu's npu_all_gather_base_mm and
// npu_mm_reduce_scatter_base call (aclnnAllGatherMatmul, aclnnMatmulReduceScatter; torch_npu 2.14.0 takes the
// non-V2 entry points for non-quantized calls without comm_mode). Signatures, parameter order and constraints
// from hicann/ops-transformer mc2/all_gather_matmul/docs/aclnnAllGatherMatmul.md and
// mc2/matmul_reduce_scatter/docs/aclnnMatmulReduceScatter.md; dtypes from op_table.json.
//
// The communication runs over this emulation's HCCL on the communicator the `group` name designates
// (HcclGetCommName's name), inside an Mc2Scope: CANN_EMU_COUNTS lists it as "<operator>:<HCCL call>", not as a
// standalone collective. The matmul accumulates in FP32 and rounds once (the cube unit). What a real MC2 kernel
// adds -- the pipelining of communication with the matmul tiles -- changes timing, not values, and cannot be
// seen here.
#include "aten_support.h"

#include <cstring>

using namespace cann_emu;

extern "C" {
int HcclAllGather(void* send, void* recv, uint64_t send_count, int dtype, void* comm, aclrtStream stream);
int HcclReduceScatter(void* send, void* recv, uint64_t recv_count, int dtype, int op, void* comm, aclrtStream stream);
int HcclGetRankSize(void* comm, uint32_t* size);
}

namespace {

constexpr int kHcclFp16 = 3, kHcclBf16 = 11, kHcclSum = 0;  // HcclDataType, HcclReduceOp (hccl_types.h)

// The ranks an MC2 group may have: Atlas A2 2/4/8 (HCCS full mesh), A3 also 16 and 32 (double ring).
bool mc2_world_size(uint32_t n) {
    bool a3 = config().soc.rfind("Ascend910_93", 0) == 0;
    return n == 2 || n == 4 || n == 8 || (a3 && (n == 16 || n == 32));
}

// Shape rules both documents share: x1 (m, k) not transposed, x2 (k, n), k in [256, 65535).
aclnnStatus check_mc2_shapes(const char* op, const aclTensor* x1, const aclTensor* x2) {
    if (x1->view.size() != 2 || x2->view.size() != 2) return invalid(op, "x1 and x2 must be 2-D");
    if (x1->view[1] != x2->view[0]) return invalid(op, "x1's k and x2's k differ");
    if (x1->view[1] < 256 || x1->view[1] >= 65535) return invalid(op, "k must be in [256, 65535)");
    if (x1->strides[1] != 1 && x1->view[1] > 1) return invalid(op, "x1 must not be transposed");
    if (x1->dtype != x2->dtype) return invalid(op, "x1 and x2 must have the same dtype");
    return 0;
}

// The communicator named group and its size; 161002 naming op when there is none or its size is not MC2's.
aclnnStatus mc2_group(const char* op, const char* group, void** comm, uint32_t* size) {
    if (!group) return check_present(op, "group", group);
    *comm = hccl_comm_named(group);
    if (!*comm) return invalid(op, std::string("group '") + group + "' names no live HCCL communicator");
    HcclGetRankSize(*comm, size);
    if (!mc2_world_size(*size))
        return invalid(op, "the group has " + std::to_string(*size) + " ranks; MC2 takes 2, 4 or 8 (Atlas A3: also "
                               "16 and 32)");
    return 0;
}

aclnnStatus check_modes(const char* op, int64_t comm_turn, int64_t stream_mode) {
    if (comm_turn != 0) return invalid(op, "commTurn must be 0");
    if (stream_mode != 1) return invalid(op, "streamMode must be 1 (ACL_STOP_ON_FAILURE)");
    return 0;
}

int hccl_dtype(int acl) { return acl == ACL_BF16 ? kHcclBf16 : kHcclFp16; }

at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
    return at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

void check_hccl(int rc, const char* op, const char* call) {
    if (rc) throw std::runtime_error(std::string(call) + " inside " + op + " failed with HCCL error " +
                                     std::to_string(rc));
}

bool all_zero(const at::Tensor& t) { return !t.defined() || t.numel() == 0 || !t.ne(0).any().item<bool>(); }

}  // namespace

// output (m * rank_size, n) = gatherOut @ x2, gatherOut (m * rank_size, k) = all-gather of x1 in rank order.
CANN_API aclnnStatus aclnnAllGatherMatmulGetWorkspaceSize(const aclTensor* x1, const aclTensor* x2,
                                                          const aclTensor* bias, const char* group,
                                                          int64_t gather_index, int64_t comm_turn,
                                                          int64_t stream_mode, const aclTensor* output,
                                                          const aclTensor* gather_out, uint64_t* ws,
                                                          aclOpExecutor** ex) {
    const char* op = "aclnnAllGatherMatmul";
    if (int rc = check_args(op, {{"x1", x1}, {"x2", x2}, {"bias", bias, true}, {"output", output},
                                 {"gatherOut", gather_out, true}}))
        return rc;
    if (int rc = check_mc2_shapes(op, x1, x2)) return rc;
    if (int rc = check_modes(op, comm_turn, stream_mode)) return rc;
    if (gather_index != 0) return invalid(op, "gatherIndex must be 0 (gather x1)");
    void* comm = nullptr;
    uint32_t size = 0;
    if (int rc = mc2_group(op, group, &comm, &size)) return rc;
    int64_t m = x1->view[0], k = x1->view[1], n = x2->view[1];
    if (output->view != std::vector<int64_t>{m * size, n}) return invalid(op, "output must be (m * rank_size, n)");
    bool gathered_out = gather_out && !gather_out->view.empty() && gather_out->view[0] != 0;
    if (gathered_out && gather_out->view != std::vector<int64_t>{m * size, k})
        return invalid(op, "gatherOut must be (m * rank_size, k) or empty");
    return aten_executor(
        op,
        [op, comm, size, dtype = x1->dtype, a = hold(x1), b = hold(x2), c = hold(bias), o = hold(output),
         g = gathered_out ? hold(gather_out) : Held()] {
            if (!all_zero(view(c))) throw std::runtime_error("bias must be zero or null on Atlas A2/A3");
            at::Tensor shard = view(a).contiguous();
            at::Tensor gathered = at::empty({shard.size(0) * size, shard.size(1)}, shard.options());
            {
                Mc2Scope scope(op);
                check_hccl(HcclAllGather(shard.data_ptr(), gathered.data_ptr(), shard.numel(), hccl_dtype(dtype),
                                         comm, nullptr),
                           op, "HcclAllGather");
            }
            view(o).copy_(product(gathered, view(b)));
            if (g) view(g).copy_(gathered);
        },
        ws, ex);
}
CANN_EMU_LAUNCH(aclnnAllGatherMatmul)

// output (m / rank_size, n): rank r's rows of the sum over ranks of x1 @ x2.
CANN_API aclnnStatus aclnnMatmulReduceScatterGetWorkspaceSize(const aclTensor* x1, const aclTensor* x2,
                                                              const aclTensor* bias, const char* group,
                                                              const char* reduce_op, int64_t comm_turn,
                                                              int64_t stream_mode, const aclTensor* output,
                                                              uint64_t* ws, aclOpExecutor** ex) {
    const char* op = "aclnnMatmulReduceScatter";
    if (int rc = check_args(op, {{"x1", x1}, {"x2", x2}, {"bias", bias, true}, {"output", output}})) return rc;
    if (int rc = check_mc2_shapes(op, x1, x2)) return rc;
    if (int rc = check_modes(op, comm_turn, stream_mode)) return rc;
    if (!reduce_op || std::strcmp(reduce_op, "sum") != 0) return invalid(op, "reduceOp must be \"sum\"");
    void* comm = nullptr;
    uint32_t size = 0;
    if (int rc = mc2_group(op, group, &comm, &size)) return rc;
    int64_t m = x1->view[0], n = x2->view[1];
    if (m % size) return invalid(op, "m must be a multiple of rank_size");
    if (output->view != std::vector<int64_t>{m / size, n}) return invalid(op, "output must be (m / rank_size, n)");
    return aten_executor(
        op,
        [op, comm, size, dtype = x1->dtype, a = hold(x1), b = hold(x2), c = hold(bias), o = hold(output)] {
            if (!all_zero(view(c))) throw std::runtime_error("bias must be zero or null on Atlas A2/A3");
            at::Tensor full = product(view(a), view(b)).contiguous();
            at::Tensor mine = at::empty({full.size(0) / size, full.size(1)}, full.options());
            {
                Mc2Scope scope(op);
                check_hccl(HcclReduceScatter(full.data_ptr(), mine.data_ptr(), mine.numel(), hccl_dtype(dtype),
                                             kHcclSum, comm, nullptr),
                           op, "HcclReduceScatter");
            }
            view(o).copy_(mine);
        },
        ws, ex);
}
CANN_EMU_LAUNCH(aclnnMatmulReduceScatter)
