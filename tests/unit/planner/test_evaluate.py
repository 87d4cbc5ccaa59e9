"""A pipeline's recordings evaluated once per profile: another microbatch count is another point on their line."""

from __future__ import annotations

from types import SimpleNamespace

from npu_inject.planner import job


def test_another_microbatch_count_of_the_same_recordings_is_not_replayed_again(monkeypatch):
    replayed, lines = [], []
    monkeypatch.setattr(job, "_evaluate", lambda roles, **kwargs: replayed.append(roles) or ("plan", roles))
    monkeypatch.setattr(job, "_more_microbatches", lambda fewer, more, counts: lines.append(counts) or counts)
    recording = job.Recording(["--module", "llama3"], 8, (None,), [{0: "fewer"}, {0: "more"}], 1.0, (8, 16, 512))
    profile, other = SimpleNamespace(name="A2"), SimpleNamespace(name="A3")
    assert job.evaluate(recording, profile=profile, efficiency={"overhead": 0.1}) == (8, 16, 512)
    assert job.evaluate_microbatches(recording, 256, profile=profile, efficiency={"overhead": 0.1}) == (8, 16, 256)
    assert len(replayed) == 2 and lines == [(8, 16, 512), (8, 16, 256)]  # the two counts replayed once
    job.evaluate(recording, profile=other, efficiency={"overhead": 0.1})  # another profile: replayed for it
    job.evaluate(recording, profile=profile, efficiency={"overhead": 0.2})  # another efficiency: likewise
    assert len(replayed) == 6
