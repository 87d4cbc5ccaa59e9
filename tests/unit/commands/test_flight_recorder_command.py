"""`npu-inject flight-recorder`: reads torch_npu's HCCL flight recorder dumps (npu_inject/commands/flight_recorder.py).

The dumps here are written in the layout torch_npu 2.14.0 writes (version 2.4: pg_config, pg_status,
entries with an empty profiling_name); tests/cann_emu/test_debug_outputs.py runs the command on dumps
the real torch_npu wrote.
"""

from __future__ import annotations

import pickle

from npu_inject.commands.cli import main

TORCH = "/site-packages/torch/distributed/distributed_c10d.py"


def _entry(seq: int, state: str = "completed", sizes=((1024,),), dtype: str = "Float", group: str = "group_name_0",
           function: str = "all_reduce"):
    return {"record_id": seq - 1, "pg_id": 0, "process_group": (group, ""), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": [dtype], "output_sizes": [list(s) for s in sizes], "output_dtypes": [dtype],
            "state": state, "is_p2p": False, "timeout_ms": 600000,
            "frames": [{"name": function, "filename": TORCH, "line": 3906},
                       {"name": "wrapper", "filename": "/site-packages/torch/distributed/c10d_logger.py", "line": 83},
                       {"name": "train_step", "filename": "/site-packages/torchtitan/trainer.py", "line": 913}]}


def _dump(entries, ranks="[0, 1]"):
    return {"version": "2.4", "pg_config": {"group_name_0": {"name": "group_name_0", "desc": "", "ranks": ranks}},
            "pg_status": {"0": {"last_enqueued_collective": len(entries)}}, "entries": entries}


def _write(folder, documents: dict[int, dict], prefix: str = "rank_"):
    for rank, document in documents.items():
        (folder / f"{prefix}{rank}").write_bytes(pickle.dumps(document))
        (folder / f"{prefix}{rank}_py_traceback").write_text("thread main:\n  File x.py")  # as torch_npu writes


def test_the_rank_that_did_not_enter_the_next_collective_is_named(tmp_path, capsys):
    _write(tmp_path, {0: _dump([_entry(1), _entry(2), _entry(3, state="scheduled")]),
                      1: _dump([_entry(1), _entry(2)])})
    assert main(["flight-recorder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 dumps (ranks [0, 1])" in out
    assert "DIVERGED at collective #3: entered by ranks [0], not by ranks [1] (their last: #2)" in out
    assert "rank 0: scheduled, input sizes [[1024]]" in out
    # The innermost frame, then the caller's code outside torch.
    assert f"stack: all_reduce ({TORCH}:3906) <- train_step (/site-packages/torchtitan/trainer.py:913)" in out


def test_ranks_that_disagree_on_a_collective_are_a_mismatch(tmp_path, capsys):
    _write(tmp_path, {0: _dump([_entry(1), _entry(2, sizes=((4096,),))]), 1: _dump([_entry(1), _entry(2)])})
    assert main(["flight-recorder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH at collective #2 (sizes differ): rank 0 completed, input sizes [[4096]]" in out
    assert "rank 1 completed, input sizes [[1024]]" in out


def test_uneven_all_to_all_sizes_are_not_a_mismatch_but_different_calls_are(tmp_path, capsys):
    _write(tmp_path, {0: _dump([_entry(1, sizes=((30, 8),), function="all_to_all_single")]),
                      1: _dump([_entry(1, sizes=((34, 8),), function="all_to_all_single")])})
    assert main(["flight-recorder", str(tmp_path)]) == 0
    assert "the ranks agree" in capsys.readouterr().out
    _write(tmp_path, {0: _dump([_entry(1)]), 1: _dump([_entry(1, function="broadcast")])})
    assert main(["flight-recorder", str(tmp_path)]) == 1
    assert "MISMATCH at collective #1 (issued by different functions ['all_reduce', 'broadcast'])" in \
        capsys.readouterr().out


def test_agreeing_ranks_exit_zero_and_in_flight_collectives_are_listed(tmp_path, capsys):
    _write(tmp_path, {r: _dump([_entry(1), _entry(2, state="started")]) for r in (0, 1)}, prefix="hccl_trace_rank_")
    assert main(["flight-recorder", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the ranks agree" in out and "in flight on every rank: #2" in out


def test_missing_dumps_and_foreign_pickles_are_errors_naming_them(tmp_path, capsys):
    assert main(["flight-recorder", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err
    assert main(["flight-recorder", str(tmp_path)]) == 2
    assert "no dump named <prefix><rank>" in capsys.readouterr().err
    (tmp_path / "rank_0").write_bytes(pickle.dumps({"entries": [], "code": pickle.loads}))
    assert main(["flight-recorder", str(tmp_path)]) == 2
    assert "refusing _pickle.loads" in capsys.readouterr().err


def test_an_empty_or_truncated_dump_is_an_error_naming_the_file(tmp_path, capsys):
    _write(tmp_path, {0: _dump([_entry(1)])})
    (tmp_path / "rank_1").write_bytes(b"")
    assert main(["flight-recorder", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"npu-inject flight-recorder: error: {tmp_path / 'rank_1'}: empty file; expected a pickled flight recorder "
        "dump (a dict with 'entries') from torch_npu's ProcessGroupHCCL\n")
    (tmp_path / "rank_1").write_bytes(pickle.dumps(_dump([_entry(1)]))[:30])
    assert main(["flight-recorder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"npu-inject flight-recorder: error: {tmp_path / 'rank_1'}: not a pickle of plain "
                          "containers (") and err.endswith("expected a pickled flight recorder dump (a dict with "
                                                           "'entries') from torch_npu's ProcessGroupHCCL\n"), err


def test_a_rank_without_a_dump_is_named(tmp_path, capsys):
    _write(tmp_path, {0: _dump([_entry(1)], ranks="[0, 1, 2]"), 1: _dump([_entry(1)], ranks="[0, 1, 2]")})
    assert main(["flight-recorder", str(tmp_path)]) == 0
    assert "no dump from ranks [2]" in capsys.readouterr().out


def test_reader_imports_neither_torch_nor_torchtitan():
    import ast
    import npu_inject.commands.flight_recorder as reader

    tree = ast.parse(open(reader.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "argparse", "ast", "glob", "os", "pickle", "re", "sys"}, imported
