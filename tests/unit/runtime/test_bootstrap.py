"""The .pth bootstrap in fresh interpreters, exactly as users get it from site-packages."""

from __future__ import annotations

import json
import os
import site
import sysconfig

import pytest

from testkit import REPO, clean_env, run_python

HEAVY = ("torch", "wrapt", "importlib.metadata", "packaging", "npu_inject.runtime", "torchtitan")
PROBE = f"import sys; print(sorted(m for m in {HEAVY!r} + ('npu_inject',) if m in sys.modules))"


def test_pth_is_installed_in_site_packages():
    candidates = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    assert any(os.path.isfile(os.path.join(d, "npu_inject_bootstrap.pth")) for d in candidates), (
        "npu_inject_bootstrap.pth is not in site-packages: install the project (pip install -e .)"
    )


def test_disabled_imports_nothing():
    for value in (None, "0", ""):
        env = clean_env() if value is None else clean_env(TORCHTITAN_NPU=value)
        result = run_python(PROBE, env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.replace("'", '"')) == [], value


def test_enabled_defers_everything_heavy_until_torchtitan():
    result = run_python(PROBE, clean_env(TORCHTITAN_NPU="cpu"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.replace("'", '"')) == ["npu_inject"]


def test_enabled_hooks_fire_on_import():
    code = """
        import torchtitan.tools.utils as utils
        from npu_inject import runtime
        report = runtime.current().report
        print(utils.device_type, report.patches["device"].state, report.patches["attention"].state)
    """
    result = run_python(code, clean_env(TORCHTITAN_NPU="cpu"))
    assert result.returncode == 0, result.stderr
    # attention waits for its own trigger module: lazily, not at torchtitan import
    assert result.stdout.split() == ["cpu", "applied", "pending"]


def test_disabled_runtime_leaves_torchtitan_alone():
    result = run_python("import torchtitan.tools.utils as u; print(u.device_type)", clean_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cuda"  # upstream's choice on a machine without accelerators


@pytest.mark.parametrize("env, message", [
    ({"TORCHTITAN_NPU": "gpu"},
     "npu_inject: configuration error: TORCHTITAN_NPU='gpu' is not valid; use one of '0', '1', 'npu', 'cpu'"),
    ({"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_PATCHES": "+atention"},
     "TORCHTITAN_NPU_PATCHES: unknown patch id 'atention'; did you mean attention?"),
    ({"TORCHTITAN_NPU": "1"},
     "needs torch_npu, which failed to import: No module named 'torch_npu'. To rehearse this run on a "
     "machine without an NPU, set TORCHTITAN_NPU=cpu."),
])
def test_bad_configuration_stops_at_torchtitan_import_with_one_message(env, message):
    result = run_python("import torchtitan; print('imported')", clean_env(**env))
    assert result.returncode != 0
    assert "imported" not in result.stdout
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_user_registry_names_file_line_column(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text('{"patches": {"device": {"default": false,}}}')
    result = run_python("import torchtitan", clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REGISTRY=str(path)))
    assert result.returncode != 0
    assert f"{path}:1:42: malformed JSON" in result.stderr


def test_report_dir_from_environment(tmp_path):
    code = "import torchtitan.tools.utils"
    result = run_python(code, clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REPORT_DIR=str(tmp_path), RANK="3"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report_rank3.json").read_text())
    assert report["rank"] == 3 and report["patches"]["device"]["state"] == "applied"
    assert report["patches"]["cuda_graphs"]["state"] == "pending"


def test_looking_torchtitan_up_activates_nothing():
    """pip, IDEs, pkgutil, test collectors and ``npu-inject doctor`` only look torchtitan up."""
    code = f"""
        import importlib.util, pkgutil
        spec = importlib.util.find_spec("torchtitan")
        assert spec is not None and spec.origin.endswith("__init__.py")
        assert any(m.name == "torchtitan" for m in pkgutil.iter_modules())
        {PROBE}
    """
    # TORCHTITAN_NPU=1 without torch_npu: activating would stop the process with a configuration error.
    result = run_python(code, clean_env(TORCHTITAN_NPU="1"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.replace("'", '"')) == ["npu_inject"]


def test_executing_torchtitan_activates_before_its_code_runs():
    """torch_npu (here: the target's backend import) comes before any torchtitan code executes."""
    code = """
        import sys
        order = []
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name in ("torchtitan.tools", "importlib.metadata") and not order:
                    order.append(("runtime active" if "npu_inject.runtime" in sys.modules else "runtime off", name))
                return None
        sys.meta_path.insert(0, Watch())
        sys.modules.pop("importlib.metadata", None)  # torchtitan/__init__ imports it: see who imports it first
        import torchtitan, torchtitan.tools.utils
        from npu_inject import runtime
        print(order[0][0], type(torchtitan.__loader__).__name__, runtime.current().report.patches["device"].state)
    """
    result = run_python(code, clean_env(TORCHTITAN_NPU="cpu"))
    assert result.returncode == 0, result.stderr
    # the runtime (which imports importlib.metadata itself) was active first; the package keeps its real loader
    assert result.stdout.split() == ["runtime", "active", "SourceFileLoader", "applied"]


def test_python_dash_m_entry_point_runs_cli():
    result = run_python("import runpy; runpy.run_module('npu_inject', run_name='__main__')", clean_env(), cwd=REPO)
    assert result.returncode == 2  # no sub-command given: argparse usage error
    assert "usage: npu-inject" in result.stderr


def test_torch_npu_is_imported_before_any_torchtitan_submodule_on_the_npu_target():
    """On the simulated NPU: the first torchtitan submodule import finds torch_npu already imported."""
    from verification.sim_npu import sim_env

    code = """
        import sys
        seen = []
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("torchtitan.") and not seen:
                    seen.append("torch_npu" in sys.modules)
                return None
        sys.meta_path.insert(0, Watch())
        import torchtitan.tools.utils as utils
        print(seen[0], utils.device_type)
    """
    result = run_python(code, sim_env(clean_env(TORCHTITAN_NPU="1"), devices=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "npu"]
