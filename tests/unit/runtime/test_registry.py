"""registry.json and user registries: validation, merging, selection, entry points."""

from __future__ import annotations

import json
import sys

import pytest

from testkit import fake_entry
from npu_inject import registry, settings
from npu_inject import selection as selection_mod
from npu_inject.errors import ConfigError


def write(tmp_path, content: str, name: str = "user.json") -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def test_packaged_registry_loads_and_is_valid():
    catalog = registry.load(None)
    assert {"device", "attention", "triton_guard", "collectives", "checkpoint_staging", "checkpoint_publish"} <= set(catalog.patches)
    for spec in catalog.patches.values():
        assert spec.module.startswith("npu_inject.patches."), spec.id


def test_malformed_json_names_file_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "patches": {\n    "device": {"default": tru}\n  }\n}')
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value).startswith(f"{path}:3:")
    assert "malformed JSON" in str(error.value)


@pytest.mark.parametrize("override, message", [
    ({"default": "yes"}, "key 'default' must be true or false"),
    ({"colour": 1}, "key(s) 'colour' cannot be overridden for existing patch 'device'; allowed: supports, default, "
                    "options"),
    ({"supports": "no_such_range"}, "'supports' names the range 'no_such_range', which no 'ranges' defines"),
    ({"options": {"nope": 1}}, "unknown option 'nope' for patch 'device'"),
    ({"supports": {"torch": "about 2"}}, "supports['torch']='about 2' is not a PEP 440 specifier"),
    ({"supports": {"numpy": ">=1"}}, "'supports' names 'numpy'; allowed: torchtitan, torch, torch_npu"),
])
def test_bad_overrides_name_the_key_and_what_is_allowed(tmp_path, override, message):
    path = write(tmp_path, json.dumps({"patches": {"device": override}}))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert message in str(error.value)
    assert f"{path}: patches['device']" in str(error.value)


def test_unknown_top_level_key_and_schema(tmp_path):
    with pytest.raises(ConfigError, match="unknown top-level key"):
        registry.load(write(tmp_path, '{"patchez": {}}'))
    with pytest.raises(ConfigError, match="this runtime reads schemas 1, 2"):
        registry.load(write(tmp_path, '{"schema": 3, "patches": {}}'))


def test_a_new_entry_states_its_triggers_and_takes_defaults_for_the_rest(tmp_path):
    with pytest.raises(ConfigError, match="missing key.*'triggers'"):
        registry.load(write(tmp_path, json.dumps({"patches": {"mine": {"default": False}}})))
    mine = registry.load(write(tmp_path, json.dumps({"patches": {"mine": {"triggers": ["torchtitan"]}}}),
                               name="ok.json")).patches["mine"]
    assert (mine.module, mine.default, dict(mine.options), mine.requires, mine.runs_on) == (
        "npu_inject.patches.mine", True, {}, (), ("npu", "cpu"))


def test_named_ranges_are_shared_and_merged_over_the_document_default(tmp_path):
    document = {"defaults": {"supports": {"torch": ">=2.14"}}, "ranges": {"npu": {"torch_npu": ">=2.14,<2.16"}},
                "patches": {"a": {"triggers": ["x"], "supports": "npu"}, "b": {"triggers": ["x"]}}}
    catalog = registry.load(write(tmp_path, json.dumps(document)))
    assert dict(catalog.patches["a"].supports) == {"torch": ">=2.14", "torch_npu": ">=2.14,<2.16"}
    assert dict(catalog.patches["b"].supports) == {"torch": ">=2.14"}
    # A later document (a user registry) may name a range an earlier one defined.
    later = registry.Registry(ranges=dict(catalog.ranges), patches=dict(catalog.patches))
    registry.merge_document(later, {"patches": {"b": {"supports": "npu"}}}, "user")
    assert dict(later.patches["b"].supports) == {"torch_npu": ">=2.14,<2.16"}


def test_user_override_changes_toggles_and_options_only(tmp_path):
    base = registry.load(None)
    document = {"patches": {"device": {"default": False}}}
    merged = registry.load(write(tmp_path, json.dumps(document)))
    assert merged.patches["device"].default is False
    assert merged.patches["device"].triggers == base.patches["device"].triggers
    assert merged.sources[-1].endswith("user.json")


def test_schema_1_registries_load_except_keys_that_moved_into_the_patch_module(tmp_path):
    # Toggles and options in yesterday's format keep working.
    toggles = {"schema": 1, "patches": {"swap_optimizer": {"default": True, "options": {"slices": 8}}}}
    assert registry.load(write(tmp_path, json.dumps(toggles))).patches["swap_optimizer"].options["slices"] == 8
    # A full schema 1 entry listed targets and a description: one message says what to do instead.
    old_entry = {"module": "mine", "triggers": ["torchtitan"], "targets": ["torchtitan.trainer:Trainer.close"],
                 "supports": {}, "requires": [], "default": True, "options": {}, "description": "mine"}
    with pytest.raises(ConfigError) as error:
        registry.load(write(tmp_path, json.dumps({"schema": 1, "patches": {"mine": old_entry}}), name="old.json"))
    assert str(error.value) == (
        f"{tmp_path / 'old.json'}: patches['mine']: key(s) 'targets', 'description' moved out of registries in "
        "schema 2: a patch module states the targets it changes itself, as TARGETS = (...) near its top; a "
        "patch's description is the first line of its module's docstring. Remove the key(s) from the entry")
    with pytest.raises(ConfigError, match="key.s. 'description' moved out of registries"):
        registry.load(write(tmp_path, json.dumps({"patches": {"device": {"description": "mine"}}}), name="d.json"))


def test_option_type_must_match_default(tmp_path):
    catalog = registry.Registry()
    registry.merge_document(catalog, {"patches": {"p": fake_entry("m", options={"slices": 4})}}, "base")
    with pytest.raises(ConfigError, match="option 'slices' must be int like its default 4"):
        registry.merge_document(catalog, {"patches": {"p": {"options": {"slices": "8"}}}}, "user")
    registry.merge_document(catalog, {"patches": {"p": {"options": {"slices": 8}}}}, "user")
    assert catalog.patches["p"].options["slices"] == 8


def make_catalog(**requires) -> registry.Registry:
    catalog = registry.Registry()
    patches = {name: fake_entry(f"m_{name}", requires=list(deps), default=name != "c")
               for name, deps in requires.items()}
    registry.merge_document(catalog, {"patches": patches}, "test")
    return catalog


def test_requirement_cycle_and_missing_requirement_are_errors():
    with pytest.raises(ConfigError, match="requirement cycle between patches: a -> b -> a"):
        registry.validate_graph(make_catalog(a=["b"], b=["a"]))
    with pytest.raises(ConfigError, match="requires unknown patch 'zz'"):
        registry.validate_graph(make_catalog(a=["zz"]))


@pytest.mark.parametrize("selection, expected", [
    ("", {"a": True, "b": True, "c": False}),
    ("all", {"a": True, "b": True, "c": True}),
    ("none", {"a": False, "b": False, "c": False}),
    ("b", {"a": False, "b": True, "c": False}),
    ("a, c", {"a": True, "b": False, "c": True}),
    ("+c", {"a": True, "b": True, "c": True}),
    ("-b", {"a": True, "b": False, "c": False}),
    ("none,+a", {"a": True, "b": False, "c": False}),
    ("all,-a,-b", {"a": False, "b": False, "c": True}),
])
def test_selection_grammar(selection, expected):
    assert selection_mod.select(make_catalog(a=[], b=[], c=[]), selection) == expected


def test_unknown_id_suggests_the_closest():
    with pytest.raises(ConfigError) as error:
        selection_mod.select(registry.load(None), "+atention")
    assert "TORCHTITAN_NPU_PATCHES: unknown patch id 'atention'; did you mean attention?" in str(error.value)


def test_disabling_a_requirement_turns_off_default_dependents_but_not_named_ones():
    catalog = make_catalog(a=[], b=["a"], c=["b"])
    assert selection_mod.select(catalog, "-a") == {"a": False, "b": False, "c": False}
    _, reason = selection_mod.initial_state(catalog.patches["b"], selection_mod.select(catalog, "-a"), "cpu")
    assert reason == "off: requires a, which the selection turned off"
    with pytest.raises(ConfigError, match="patch 'b' requires 'a', which is disabled; enable it \\(\\+a\\)"):
        selection_mod.select(catalog, "-a,+b")
    with pytest.raises(ConfigError, match="patch 'b' requires 'a', which is disabled"):
        selection_mod.select(catalog, "b")


def test_apply_order_puts_requirements_first():
    catalog = make_catalog(a=["b"], b=["c"], c=[])
    assert selection_mod.apply_order(catalog, ["a"]) == ["c", "b", "a"]


def test_third_party_entry_point_joins_the_catalog(tmp_path, monkeypatch):
    """A real distribution on sys.path publishing group npu_inject.registry."""
    dist_info = tmp_path / "thirdparty_patches-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-patches\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[npu_inject.registry]\nextra = thirdparty_catalog:REGISTRY\n")
    document = {"patches": {"thirdparty": fake_entry("thirdparty_patch", default=False)}}
    (tmp_path / "thirdparty_catalog.py").write_text(f"REGISTRY = {document!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "thirdparty_catalog", raising=False)
    catalog = registry.load(None)
    assert catalog.patches["thirdparty"].source == "entry point extra = thirdparty_catalog:REGISTRY"
    assert catalog.patches["thirdparty"].default is False


@pytest.mark.parametrize("name, value, message", [
    ("TORCHTITAN_NPU", "gpu", "TORCHTITAN_NPU='gpu' is not valid; use one of '0', '1', 'npu', 'cpu'"),
    ("TORCHTITAN_NPU_STRICT", "yes", "TORCHTITAN_NPU_STRICT='yes' is not valid; use 1 (on) or 0 (off)"),
    ("TORCHTITAN_NPU_REGISTRY", "/nonexistent.json", "TORCHTITAN_NPU_REGISTRY='/nonexistent.json': no such file"),
])
def test_bad_environment_names_the_variable(name, value, message):
    with pytest.raises(ConfigError) as error:
        settings.load({"TORCHTITAN_NPU": "cpu", name: value})
    assert message in str(error.value)


@pytest.mark.parametrize("value, target", [("", None), ("0", None), ("1", "npu"), ("npu", "npu"),
                                           ("cpu", "cpu"), (" CPU ", "cpu")])
def test_target_values(value, target):
    assert settings.load({"TORCHTITAN_NPU": value}).target == target


@pytest.mark.parametrize("patch_id, options, message", [
    ("swap_optimizer", {"slices": 0}, "option 'slices'=0 must be >= 1"),
    ("swap_optimizer", {"slices": -3}, "option 'slices'=-3 must be >= 1"),
    ("rehearsal_dtype", {"compute_dtype": "fp16"}, "option 'compute_dtype'='fp16' must be one of 'auto', 'float32', 'keep'"),
])
def test_option_values_are_range_checked(tmp_path, patch_id, options, message):
    path = write(tmp_path, json.dumps({"patches": {patch_id: {"options": options}}}))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert f"{path}: patches[{patch_id!r}]: {message}" == str(error.value)


def test_option_rules_of_a_new_entry_are_checked(tmp_path):
    entry = fake_entry("m", options={"k": 2}, option_rules={"k": {"min": 1, "max": 4}})
    assert registry.load(write(tmp_path, json.dumps({"patches": {"mine": entry}}))).patches["mine"].options["k"] == 2
    for bad_rule, message in (({"k": {"minimum": 1}}, "option_rules['k'] must be an object with one or more of"),
                              ({"other": {"min": 1}}, "option_rules names 'other', which is not an option")):
        bad = fake_entry("m", options={"k": 2}, option_rules=bad_rule)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            registry.load(write(tmp_path, json.dumps({"patches": {"mine": bad}}), name="bad.json"))


@pytest.mark.parametrize("selection, position, entry", [("+,attention", 1, "+"), ("attention,,device", 2, ""),
                                                        ("device,-", 2, "-")])
def test_selection_names_an_empty_entry(selection, position, entry):
    with pytest.raises(ConfigError) as error:
        selection_mod.select(registry.load(None), selection)
    assert str(error.value) == (f"TORCHTITAN_NPU_PATCHES={selection!r}: entry {position} ({entry!r}) names no patch; "
                                "each comma-separated entry is all, none, ID, +ID or -ID")


@pytest.mark.parametrize("retired, replacement", [("rank_sync", "runtime services now, always on"),
                                                  ("checkpoint_io", "checkpoint_staging")])
def test_retired_ids_say_what_replaced_them(retired, replacement):
    with pytest.raises(ConfigError, match=f"'{retired}' is no longer a patch: .*{replacement}"):
        selection_mod.select(registry.load(None), f"-{retired}")


def test_requirement_cycle_names_the_file_the_cycle_and_each_requirement(tmp_path):
    document = {"patches": {"a": fake_entry("m_a", requires=["b"]), "b": fake_entry("m_b", requires=["a"])}}
    path = write(tmp_path, json.dumps(document))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == (
        f"{path}: requirement cycle between patches: a -> b -> a (patches['a'] requires 'b', patches['b'] "
        "requires 'a'); a patch cannot be applied after itself: remove one of these requirements")


def test_requirement_cycle_across_documents_names_each_file():
    catalog = registry.Registry()
    registry.merge_document(catalog, {"patches": {"x": fake_entry("m_x", requires=["y"])}}, "/site/third.json")
    registry.merge_document(catalog, {"patches": {"y": fake_entry("m_y", requires=["x"])}}, "/home/me/user.json")
    # An override changes where the entry was last touched, not where its requirements were stated.
    registry.merge_document(catalog, {"patches": {"x": {"default": False}}}, "/home/me/later.json")
    with pytest.raises(ConfigError) as error:
        registry.validate_graph(catalog)
    assert str(error.value) == (
        "/site/third.json and /home/me/user.json: requirement cycle between patches: x -> y -> x (patches['x'] in "
        "/site/third.json requires 'y', patches['y'] in /home/me/user.json requires 'x'); a patch cannot be "
        "applied after itself: remove one of these requirements")


@pytest.mark.parametrize("document, message", [
    ({"patchs": {}}, "unknown top-level key(s) 'patchs'; allowed: 'schema', 'ranges', 'defaults', 'patches'; "
                     "did you mean 'patches'?"),
    ({"patches": {"mine": {"triggers": ["x"], "requries": ["device"]}}},
     "patches['mine']: unknown key(s) 'requries'; allowed: triggers, module, supports, requires, default, options, "
     "option_rules, runs_on, packages; did you mean 'requires'?"),
    ({"patches": {"mine": {"triggers": ["x"], "defualt": False, "colour": 1, "optoins": {}}}},
     "patches['mine']: unknown key(s) 'colour', 'defualt', 'optoins'; allowed: triggers, module, supports, requires, "
     "default, options, option_rules, runs_on, packages; did you mean 'default' for 'defualt', 'options' for 'optoins'?"),
    ({"patches": {"device": {"defualt": False}}},
     "patches['device']: key(s) 'defualt' cannot be overridden for existing patch 'device'; allowed: supports, "
     "default, options; did you mean 'default'?"),
    ({"defaults": {"suports": {}}, "patches": {}},
     "'defaults': key(s) 'suports' cannot have a document default; allowed: 'supports' (every other key has its "
     "own default); did you mean 'supports'?"),
])
def test_unknown_keys_name_the_file_and_entry_and_suggest_the_closest(tmp_path, document, message):
    path = write(tmp_path, json.dumps(document))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == f"{path}: {message}"


@pytest.mark.parametrize("entry, message", [
    (fake_entry("m", supports={"torch-npu": ">=2.14"}),
     "'supports' names 'torch-npu'; allowed: torchtitan, torch, torch_npu; did you mean 'torch_npu'?"),
    (fake_entry("m", options={"slices": 2}, option_rules={"slices": {"minimum": 1}}),
     "option_rules['slices'] must be an object with one or more of 'min', 'max', 'choices', got {'minimum': 1}; "
     "did you mean 'min'?"),
    (fake_entry("m", options={"slices": 2}, option_rules={"slice": {"min": 1}}),
     "option_rules names 'slice', which is not an option (options: slices); did you mean 'slices'?"),
])
def test_unknown_names_inside_an_entry_suggest_the_closest(tmp_path, entry, message):
    path = write(tmp_path, json.dumps({"patches": {"mine": entry}}))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == f"{path}: patches['mine']: {message}"


def test_unknown_override_option_suggests_the_closest(tmp_path):
    path = write(tmp_path, json.dumps({"patches": {"swap_optimizer": {"options": {"slice": 8}}}}))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == (f"{path}: patches['swap_optimizer']: unknown option 'slice' for patch "
                                "'swap_optimizer'; allowed: slices; did you mean 'slices'?")


def test_requiring_a_retired_patch_says_what_replaced_it(tmp_path):
    path = write(tmp_path, json.dumps({"patches": {"mine": fake_entry("m", requires=["rank_sync"])}}))
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == (f"{path}: patch 'mine' requires 'rank_sync', which is no longer a patch: "
                                f"{registry.RETIRED_IDS['rank_sync']}")


def test_empty_registry_file_says_so(tmp_path):
    path = write(tmp_path, "\n")
    with pytest.raises(ConfigError) as error:
        registry.load(path)
    assert str(error.value) == f"{path}: empty registry file; a registry is a JSON object with a 'patches' key"


def test_entry_point_that_cannot_load_names_the_entry_point(tmp_path, monkeypatch):
    dist_info = tmp_path / "broken_patches-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-patches\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[npu_inject.registry]\nextra = no_such_catalog_module:REGISTRY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as error:
        registry.load(None)
    assert str(error.value) == (
        "entry point extra = no_such_catalog_module:REGISTRY (distribution broken-patches 1.0): cannot load: "
        "No module named 'no_such_catalog_module'; fix or uninstall the distribution that publishes it")


def test_registry_variable_naming_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError) as error:
        settings.load({"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_REGISTRY": str(tmp_path)})
    assert str(error.value) == (f"TORCHTITAN_NPU_REGISTRY={str(tmp_path)!r}: a directory, not a file; "
                                "point it at a JSON registry file or unset it")
