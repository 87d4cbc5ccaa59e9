"""restart_store's view of the launcher's store: each torchrun attempt under its own prefix.

Plain torch, no runtime in the way: a store that outlives an attempt (what torchrun 2.14 hands restarted
workers) still holds the dead attempt's keys; seen under the attempt's prefix, a restarted rank waits for its
peer's new key instead of reading the old one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from npu_inject.launcher import attempt_store_prefix


def test_the_prefix_names_torchruns_attempt_and_is_none_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_store_prefix() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt_store_prefix() == "/worker/attempt_1"


def test_a_restarted_attempt_does_not_read_the_dead_attempts_keys(monkeypatch):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dist.PrefixStore(attempt_store_prefix(), store).set("rank_1", "dead address")
    assert store.get(f"{attempt_store_prefix()}/rank_1") == b"dead address"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = dist.PrefixStore(attempt_store_prefix(), store)
    with pytest.raises(dist.DistStoreError):
        restarted.get("rank_1")  # waits for the new attempt's key, as gloo's rendezvous would
    restarted.set("rank_1", "new address")
    assert restarted.get("rank_1") == b"new address"
