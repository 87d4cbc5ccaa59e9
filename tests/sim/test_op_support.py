"""The stand-in and the CANN emulation share one operator-support table (verification/cann_emu/op_table.json).

The stand-in's fused kernels refuse the dtypes CANN's documents refuse for the aclnn operator torch_npu
2.14.0 calls, as the emulation does (161002 naming the operator). Expected dtypes are read from the
table here and cross-checked with CANN's wording for one row (aclnnRmsNorm's rstd is FLOAT only).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLE = REPO_ROOT / "verification" / "cann_emu" / "op_table.json"


def test_every_kernel_maps_to_a_row_and_arguments_the_table_has(sim_child_env):
    code = """
        import json
        from torch_npu import _op_support
        rows = _op_support.table()
        out = {"table": str(_op_support.TABLE), "missing": []}
        for kernel, (operator, names) in _op_support.KERNELS.items():
            operators = [operator] if isinstance(operator, str) else [operator({"input_layout": l}) for l in ("BSND", "TND")]
            for name in operators:
                for argument in names.values():
                    if argument not in rows.get(name, {}).get("args", {}):
                        out["missing"].append(f"{kernel}: {name}.{argument}")
        print(json.dumps(out))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=sim_child_env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert Path(out["table"]) == TABLE
    assert out["missing"] == []


def test_fused_kernels_refuse_what_cann_refuses_and_run_what_it_accepts(sim_child_env):
    table = json.loads(TABLE.read_text())
    assert table["aclnnRmsNorm"]["args"]["x"] == ["FLOAT", "FLOAT16", "BFLOAT16"]
    assert table["aclnnMoeTokenUnpermute"]["args"]["sortedIndices"] == ["INT32"]
    code = """
        import json, torch, torch_npu
        out = {}
        def attempt(name, call):
            try:
                call()
                out[name] = "ran"
            except RuntimeError as error:
                out[name] = str(error)
        x = torch.randn(2, 4, 8, device="npu")
        gamma = torch.ones(8, device="npu")
        attempt("rms_norm_float32", lambda: torch_npu.npu_rms_norm(x, gamma))
        attempt("rms_norm_float64", lambda: torch_npu.npu_rms_norm(x.double(), gamma.double()))
        attempt("swiglu_int32", lambda: torch_npu.npu_swiglu(torch.ones(2, 8, dtype=torch.int32, device="npu")))
        tokens = torch.randn(4, 8, device="npu")
        indices = torch.tensor([[0], [1], [0], [1]], device="npu")
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
        out["sorted_indices_dtype"] = str(sorted_indices.dtype)
        attempt("unpermute_int64_indices",
                lambda: torch_npu.npu_moe_token_unpermute(permuted, sorted_indices.long()))
        attempt("unpermute_int32_indices",
                lambda: torch_npu.npu_moe_token_unpermute(permuted, sorted_indices.int()))
        print(json.dumps(out))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=sim_child_env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["rms_norm_float32"] == "ran"
    assert "aclnnRmsNorm refuses x (self) of dtype DOUBLE" in out["rms_norm_float64"]
    assert "161002" in out["rms_norm_float64"]
    assert "aclnnSwiGlu refuses x (self) of dtype INT32" in out["swiglu_int32"]
    assert "aclnnMoeTokenUnpermute refuses sortedIndices (sorted_indices) of dtype INT64" in out["unpermute_int64_indices"]
    assert out["unpermute_int32_indices"] == "ran"
