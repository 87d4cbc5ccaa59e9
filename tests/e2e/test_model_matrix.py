"""Every row of the model coverage matrix (tools/model_table.py ROWS) trains or stops clearly.

The README's model table is rendered from the same rows (tests/unit/tools/test_model_table.py
checks it). Two depths:

* ``-m e2e`` (CI): the rows' ``ci`` targets train for CI_STEPS steps on 2 ranks
  and the loss falls; every stopping row stops on both targets. Rows with no CI
  target are trained by other e2e tests (named in ROWS).
* ``-m models``: every training row on both targets for 10 steps, loss falling:
  ``.venv/bin/python -m pytest tests/e2e/test_model_matrix.py -m models``

A stopping row runs torchtitan's own config resolution (what ``torchtitan.train``
does before anything else) for every stopping config of one target in one
interpreter, and checks the SystemExit is model_guard's one line, not an
ImportError from inside torchtitan.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from testkit import DETERMINISTIC, REPO, clean_env, parse_losses, run_python, sim_npu_env, torchrun
from tools.model_table import ROWS, TARGETS

CI_STEPS = 3
FULL_STEPS = 10
SHORT = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--validator.no-enable",
         "--checkpoint.no-enable"]


def target_env(target: str) -> dict[str, str]:
    return clean_env(TORCHTITAN_NPU="cpu") if target == "rehearsal" else sim_npu_env()


def train_row(row, target: str, steps: int, dump: str, extra=()) -> dict[int, float]:
    args = ["--module", row.module, "--config", row.config, "--training.steps", str(steps), *SHORT,
            *DETERMINISTIC, "--dump_folder", dump, *row.extra, *extra]
    result = torchrun(args, target_env(target), nproc=2, timeout=row.timeout_s)
    assert result.returncode == 0, result.stdout[-5000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, steps + 1)), result.stdout[-3000:]
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    assert losses[steps] < losses[1], f"{row.config} on {target}: loss does not fall: {losses}"
    with open(os.path.join(dump, "npu_inject", "report_rank0.json"), encoding="utf-8") as handle:
        patches = json.load(handle)["patches"]
    fallbacks = {patch_id: record["fallbacks"] for patch_id, record in patches.items() if record["fallbacks"]}
    print(f"{row.config} on {target}: losses {losses}; fallbacks {fallbacks}")
    masks_patch = {"muse_glimmer": "muse_glimmer_masks", "qwen3_5": "qwen3_5_masks"}.get(row.module)
    if masks_patch is not None:
        assert patches[masks_patch]["state"] == "applied", patches[masks_patch]
    if masks_patch is not None or row.module == "gpt_oss":  # masks and sinks on the fused kernel, no fallback
        assert not patches["attention"]["fallbacks"], patches["attention"]
    return losses


CHECK_STOPS = """
import json, sys
from torchtitan.config import ConfigManager
stops = {}
for module, config in json.loads(sys.argv[1]):
    try:
        ConfigManager().parse_args(["--module", module, "--config", config])
    except SystemExit as exc:
        stops[config] = str(exc)
    else:
        stops[config] = None
print("STOPS " + json.dumps(stops))
"""


def stops_on(target: str) -> dict[str, str | None]:
    rows = [[row.module, row.config] for row in ROWS if not row.trains]
    code = CHECK_STOPS.replace("json.loads(sys.argv[1])", repr(rows))
    result = run_python(code, env=target_env(target), cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("STOPS ")]
    return json.loads(line[len("STOPS "):])


@pytest.mark.parametrize("target", TARGETS)
def test_unsupported_rows_stop_with_one_clear_line(target):
    stops = stops_on(target)
    for row in ROWS:
        if row.trains:
            continue
        message = stops[row.config]
        assert message is not None, f"{row.config} on {target} did not stop"
        print(f"{row.config} on {target}: {message}")
        assert message.startswith("npu_inject model_guard: ") and row.stop in message, message
        assert "\n" not in message and ("npu-inject's models extra" in message or "target" in message), message


@pytest.mark.parametrize("row,target", [(row, target) for row in ROWS if row.trains for target in row.ci],
                         ids=lambda value: getattr(value, "config", value))
def test_row_trains_in_ci(row, target, tmp_path):
    train_row(row, target, CI_STEPS, str(tmp_path / "dump"), row.ci_extra)


@pytest.mark.models
@pytest.mark.parametrize("row,target", [(row, target) for row in ROWS if row.trains for target in TARGETS],
                         ids=lambda value: getattr(value, "config", value))
def test_row_trains_ten_steps(row, target, tmp_path):
    train_row(row, target, FULL_STEPS, str(tmp_path / "dump"))


@pytest.mark.models
def test_muse_glimmer_fused_masks_match_independent_sdpa_attention(tmp_path):
    """Muse Glimmer's masks on the fused kernel train exactly like plain SDPA with its own mask mods.

    Also the answer to its flat loss: both curves are the same (7.6246 -> 7.5999 over 10
    steps), so the slow fall is the model (its final norm's gain starts at 0), not the runtime.
    """
    from testkit import reference_attention_env

    (row,) = [row for row in ROWS if row.module == "muse_glimmer"]
    fused = train_row(row, "rehearsal", FULL_STEPS, str(tmp_path / "fused"))
    sdpa_env = reference_attention_env()
    sdpa_env["TORCHTITAN_NPU_PATCHES"] = "-attention,-selective_ac,-muse_glimmer_masks,+sdpa_reference_attention"
    args = ["--module", row.module, "--config", row.config, "--training.steps", str(FULL_STEPS), *SHORT,
            *DETERMINISTIC, "--dump_folder", str(tmp_path / "sdpa")]
    result = torchrun(args, sdpa_env, nproc=2)
    assert result.returncode == 0, result.stdout[-5000:]
    sdpa = parse_losses(result.stdout)
    worst = max(abs(fused[step] - sdpa[step]) / sdpa[step] for step in sdpa)
    print(f"muse_glimmer fused {fused}\nsdpa {sdpa}\nmax relative difference {worst:.2e}")
    assert sorted(sdpa) == sorted(fused) and worst <= 1e-4
