"""The model coverage matrix: one debug config per torchtitan 0.3.0 family x target.

``ROWS`` is the single list both tests/e2e/test_model_matrix.py (which runs every
row) and the table in docs/models.md (rendered here) come from;
tests/unit/tools/test_model_table.py checks the document holds exactly what ``render()`` gives.

A row either trains (loss falls over the run) or stops at start-up with
model_guard's one line; ``stop`` is the part of that line the test looks for.

Usage: python tools/model_table.py            # print the table
       python tools/model_table.py --check    # exit 1 when docs/models.md differs
       python tools/model_table.py --write    # rewrite the table in docs/models.md
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: the repository root holds tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import doc_blocks  # noqa: E402

DOC = os.path.join(doc_blocks.REPO, "docs", "models.md")
BEGIN, END = doc_blocks.markers("model-table", "tools/model_table.py")
TARGETS = ("rehearsal", "sim_npu")
# CI trains each family on one target, the simulated NPUs (the code path an NPU runs); llama3 covers the
# rehearsal's and `-m models` trains every row on both.
CI_TRAINS_ON = ("sim_npu",)


@dataclass(frozen=True)
class Row:
    family: str
    module: str
    config: str
    stop: str | None = None  # None: trains on both targets; else what model_guard's line says
    note: str = ""
    ci: tuple[str, ...] = TARGETS  # targets the e2e (CI) run covers; the `models` marker runs all
    extra: tuple[str, ...] = ()  # training flags this row needs beyond the common short run
    ci_extra: tuple[str, ...] = ()  # flags for its CI run only (a cheaper run of a costly row; later flags win)
    ci_elsewhere: tuple[tuple[str, str], ...] = ()  # (target, e2e test file) training this row in CI instead
    timeout_s: int = 600  # torchrun timeout for one run of this row (10 steps on a loaded 2-core machine)

    @property
    def trains(self) -> bool:
        return self.stop is None


ROWS = (
    Row("llama3", "llama3", "llama3_debugmodel", ci=(),
        ci_elsewhere=(("rehearsal", "test_train_rehearsal.py"), ("sim_npu", "test_train_sim_npu.py"))),
    Row("llama3 (SFT)", "llama3", "sft_debugmodel", ci=CI_TRAINS_ON, note="tests/assets/sft_test (tools/make_sft_assets.py)"),
    Row("qwen3", "qwen3", "qwen3_debugmodel", ci=CI_TRAINS_ON),
    # the rehearsal's EP 2 loss parity runs with -m e2e_long; CI trains it on simulated NPUs with EP 2
    Row("qwen3 MoE", "qwen3", "qwen3_moe_debug", ci=(),
        ci_elsewhere=(("sim_npu", "test_moe_train.py, EP 2"),),
        note="64 experts: the slowest MoE row on a CPU"),
    Row("deepseek_v3", "deepseek_v3", "deepseek_v3_debugmodel", ci=(),
        ci_elsewhere=(("rehearsal", "test_moe_train.py"), ("sim_npu", "test_moe_train.py, EP 2"))),
    Row("gpt_oss", "gpt_oss", "gpt_oss_debugmodel", ci=CI_TRAINS_ON,
        note="its attention sinks go to the fused kernel's sink argument (docs/models.md)"),
    Row("muse_glimmer", "muse_glimmer", "muse_glimmer_debugmodel", ci=CI_TRAINS_ON,
        note="loss falls slowly: the final norm's gain starts at 0 (logits are 0 at step 1)"),
    Row("qwen3_5", "qwen3_5", "qwen35_debugmodel", ci=CI_TRAINS_ON,
        note="248k vocabulary (most of its parameters are embedding and output), so CI trains it 3 steps at "
             "seq_len 128, batch 1; tests/assets/cc12m_test (tools/make_mm_assets.py)", timeout_s=2400,
        ci_extra=("--training.seq_len", "128", "--training.local_batch_size", "1")),
    Row("kimi_k2_7", "kimi_k2_7", "kimi_k2_5_debugmodel", stop="optimizes with DistMuon",
        note="torchtitan's DistMuon takes CUDA parameters only (no NPU/CPU DistMuon here); its torchvision "
             "and tests/assets/cc12m_test are in place"),
    Row("flux", "flux", "flux_debugmodel", stop="needs transformers",
        note="then FLUX.1-dev's autoencoder and tests/assets/cc12m_test"),
    Row("llama3 float8", "llama3", "llama3_debugmodel_float8", stop="trains in float8"),
    Row("deepseek_v3 MXFP8", "deepseek_v3", "deepseek_v3_debugmodel_mxfp8", stop="trains in MXFP8",
        note="Ascend 950 MXFP8 (npu_dynamic_mx_quant + npu_quant_matmul) not implemented"),
    Row("qwen3 NVFP4", "qwen3", "qwen3_debugmodel_nvfp4", stop="trains in NVFP4"),
)


def cell(row: Row, target: str) -> str:
    if row.trains:
        elsewhere = dict(row.ci_elsewhere).get(target)
        if elsewhere:
            return f"trains (CI: tests/e2e/{elsewhere})"
        return "trains" + (" (CI)" if target in row.ci else "")
    return f"stops: `{row.stop}` (CI)" if target in row.ci else f"stops: `{row.stop}`"


def render() -> str:
    lines = [
        "| family | config | rehearsal | 2 simulated NPUs | note |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        lines.append(f"| {row.family} | `--module {row.module} --config {row.config}` | "
                     f"{cell(row, 'rehearsal')} | {cell(row, 'sim_npu')} | {row.note} |")
    return "\n".join([BEGIN, *lines, END])


if __name__ == "__main__":
    sys.exit(doc_blocks.main(render, DOC, BEGIN, END, __doc__.splitlines()[0]))
