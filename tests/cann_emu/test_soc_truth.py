"""The emulation's operator support per SoC and CANN release, real machines' reports winning over documents
(verification/cann_emu/op_table.json's "variants" and "observed", issue 40).

aclnnIndex on COMPLEX64: hicann/ops-nn's index/index/docs/aclnnIndex.md lists COMPLEX64 in its table and
excludes it on Atlas A2 and A3 in the note below it; real Ascend 910B machines refuse it
(vllm-project/vllm-omni#4911 on 2x Ascend 910B3, vllm-project/vllm#49669, huggingface/diffusers#12979).
Upstream torchtitan's complex RoPE takes that path with the rotary patch off (``rope_cache[positions]``).
Expected values come from CANN's sources and CPU PyTorch, never from the emulation: the message is opbase's
OP_CHECK_DTYPE_NOT_SUPPORT text (as the reports quote it) with ops-nn 9.1.0's list
(index/index/op_api/aclnn_index.cpp, DTYPE_SUPPORT_LIST off regbase), Ascend 950 takes COMPLEX64
(DTYPE_SUPPORT_LIST_REGBASE), and aclnnGridSampler2D takes BFLOAT16 on Atlas A2 from CANN 9.1.0 on
(hicann/ops-cv 9.1.0's op_api; 9.0.0's refuses it).
"""

from __future__ import annotations

import json
import sys

import pytest

from cann_emu_child import REPO, child_json
from verification.cann_emu import BUILD_DIR

# ops-nn 9.1.0 index/index/op_api/aclnn_index.cpp: DTYPE_SUPPORT_LIST, in its order; opbase prints the list
# with a comma after each entry and DT_BF16 as DT_BFLOAT16 (the reports quote such lists).
INDEX_LIST = "[DT_FLOAT,DT_FLOAT16,DT_INT64,DT_INT32,DT_BOOL,DT_INT8,DT_UINT8,DT_BFLOAT16,DT_DOUBLE,DT_INT16,]"
CANN_MESSAGE = f"Tensor self not implemented for DT_COMPLEX64, should be in dtype support list {INDEX_LIST}."
REPORTS = {"https://github.com/vllm-project/vllm-omni/issues/4911", "https://github.com/vllm-project/vllm/pull/49669",
           "https://github.com/huggingface/diffusers/pull/12979"}


def test_complex64_index_is_refused_on_910b2_with_cann_message():
    """Upstream's complex RoPE gather (``freqs_cis[positions]``) through the real torch_npu on the default
    Ascend910B2: 161002 with CANN's message; indexing the real view (what vLLM's fix does) still works."""
    out = child_json(
        """
        import json
        import torch, torch_npu
        angle = torch.arange(8, dtype=torch.float32) / 3
        freqs_cis = torch.polar(torch.ones_like(angle), angle)  # complex64, as upstream's RoPE cache
        positions = torch.tensor([2, 0, 7])
        out = {"soc": torch.npu.get_device_name(0)}
        try:
            freqs_cis.npu()[positions.npu()]
            out["error"] = "no error"
        except RuntimeError as error:
            out["error"] = str(error)
        gathered = torch.view_as_real(freqs_cis.npu())[positions.npu()]
        out["via_real"] = gathered.cpu().tolist()
        out["expected"] = torch.view_as_real(freqs_cis[positions]).tolist()
        print(json.dumps(out))
        """
    )
    assert out["soc"] == "Ascend910B2"
    assert "aclnnIndex" in out["error"] and "161002" in out["error"], out["error"]
    assert CANN_MESSAGE in out["error"], out["error"]
    assert out["via_real"] == out["expected"]


INDEX_CHILD = f"""
    import ctypes, json, struct
    lib = ctypes.CDLL("{BUILD_DIR / 'libopapi.so'}")
    lib.aclCreateTensor.restype = ctypes.c_void_p
    lib.aclCreateTensorList.restype = ctypes.c_void_p
    lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
    lib.aclrtGetSocName.restype = ctypes.c_char_p
    assert lib.aclrtSetDevice(0) == 0
    COMPLEX64, INT64, FLOAT, BFLOAT16, ND = 16, 9, 0, 27, 2
    def device(data):
        ptr = ctypes.c_void_p()
        assert lib.aclrtMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(len(data), 1)), 0) == 0
        assert lib.aclrtMemcpy(ptr, ctypes.c_size_t(len(data)), data, ctypes.c_size_t(len(data)), 1) == 0
        return ptr
    def tensor(ptr, shape, dtype):
        dims = (ctypes.c_int64 * len(shape))(*shape)
        return ctypes.c_void_p(lib.aclCreateTensor(dims, ctypes.c_uint64(len(shape)), dtype, None,
                               ctypes.c_int64(0), ND, dims, ctypes.c_uint64(len(shape)), ptr))
    out = {{"soc": lib.aclrtGetSocName().decode()}}
    # out = self[indices]: self 4 complex64 values, indices [2, 0, 3]
    values = [1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0]
    self_ = tensor(device(struct.pack("8f", *values)), [4], COMPLEX64)
    index = tensor(device(struct.pack("3q", 2, 0, 3)), [3], INT64)
    result = device(bytes(24))
    indices = ctypes.c_void_p(lib.aclCreateTensorList((ctypes.c_void_p * 1)(index), ctypes.c_uint64(1)))
    ws, ex = ctypes.c_uint64(0), ctypes.c_void_p()
    out["index"] = lib.aclnnIndexGetWorkspaceSize(self_, indices, tensor(result, [3], COMPLEX64),
                                                  ctypes.byref(ws), ctypes.byref(ex))
    out["index_msg"] = lib.aclGetRecentErrMsg().decode() if out["index"] else ""
    if out["index"] == 0:
        assert lib.aclnnIndex(None, ctypes.c_uint64(0), ex, None) == 0
        host = ctypes.create_string_buffer(24)
        lib.aclrtMemcpy(host, ctypes.c_size_t(24), result, ctypes.c_size_t(24), 2)
        out["index_values"] = list(struct.unpack("6f", host.raw))
    # aclnnGridSampler2D on BFLOAT16: input (1, 1, 2, 2), grid (1, 1, 1, 2), out (1, 1, 1, 1)
    input_, grid = device(bytes(8)), device(bytes(4))
    sampled = device(bytes(2))
    out["grid_sample_bf16"] = lib.aclnnGridSampler2DGetWorkspaceSize(
        tensor(input_, [1, 1, 2, 2], BFLOAT16), tensor(grid, [1, 1, 1, 2], BFLOAT16), ctypes.c_int64(0),
        ctypes.c_int64(0), ctypes.c_bool(False), tensor(sampled, [1, 1, 1, 1], BFLOAT16), ctypes.byref(ws),
        ctypes.byref(ex))
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def by_target() -> dict:
    """The two-phase calls on each emulated (SoC, CANN version), straight through ctypes."""
    targets = {("Ascend910B2", "9.1.0"), ("Ascend910_9391", "9.1.0"), ("Ascend950DT_9571", "9.1.0"),
               ("Ascend910B2", "9.0.0")}
    return {(soc, cann): child_json(INDEX_CHILD, soc=soc, extra_env={"CANN_EMU_CANN_VERSION": cann})
            for soc, cann in targets}


@pytest.mark.parametrize("soc", ["Ascend910B2", "Ascend910_9391"])
def test_complex64_index_is_refused_on_atlas_a2_and_a3(by_target, soc):
    """Atlas A2 (the reports, the document's note) and A3 (the document's note): 161002 and CANN's message."""
    out = by_target[(soc, "9.1.0")]
    assert out["soc"] == soc
    assert out["index"] == 161002
    assert f"aclnnIndex: AclNN_Parameter_Error(EZ1001): {CANN_MESSAGE}" in out["index_msg"], out["index_msg"]


def test_complex64_index_is_computed_on_ascend_950(by_target):
    """Ascend 950: its list takes COMPLEX64 (document and op_api; no report says otherwise)."""
    out = by_target[("Ascend950DT_9571", "9.1.0")]
    assert out["index"] == 0, out["index_msg"]
    assert out["index_values"] == [3.0, -3.0, 1.0, -1.0, 4.0, -4.0]


def test_grid_sampler_takes_bfloat16_from_cann_9_1_0_on(by_target):
    """A dtype a release added: aclnnGridSampler2D's BFLOAT16 on Atlas A2, refused by CANN 9.0.0."""
    assert by_target[("Ascend910B2", "9.1.0")]["grid_sample_bf16"] == 0
    assert by_target[("Ascend910B2", "9.0.0")]["grid_sample_bf16"] == 161002


def _load(table: dict, tmp_path):
    sys.path.insert(0, str(REPO / "verification" / "cann_emu"))
    from build import load_op_table  # verification/cann_emu/build.py

    path = tmp_path / "op_table.json"
    path.write_text(json.dumps(table))
    return load_op_table(path)


def test_the_row_names_the_reports_it_follows():
    table = json.loads((REPO / "verification" / "cann_emu" / "op_table.json").read_text())
    observed = table["aclnnIndex"]["observed"]
    assert {seen["source"] for seen in observed} >= REPORTS
    assert any(seen["soc"] == "Ascend910B3" and seen["refused"] == {"self": ["COMPLEX64"]} for seen in observed)


def test_a_report_wins_over_the_document_for_its_soc(tmp_path):
    """A table whose Atlas A2 list takes what a real 910B3 refused does not build; the same dtype in another
    SoC's variant, or a report that names no SoC, does."""
    table = json.loads((REPO / "verification" / "cann_emu" / "op_table.json").read_text())
    index = table["aclnnIndex"]
    assert _load(table, tmp_path)["aclnnIndex"]["observed"] == index["observed"]
    index["args"]["self"] = index["args"]["self"] + ["COMPLEX64"]
    with pytest.raises(SystemExit, match="Ascend910B3.*vllm-omni/issues/4911"):
        _load(table, tmp_path)
    index["observed"] = [dict(seen, soc=None) for seen in index["observed"]]
    _load(table, tmp_path)
