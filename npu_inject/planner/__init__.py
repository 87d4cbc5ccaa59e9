"""npu-inject plan: will a torchtitan job fit the NPUs' memory, how fast will it go, which layout is best.

Answered before the job is queued, on any machine: torchtitan builds the job and runs one training
step on fake tensors with a fake process group, through this runtime's patches; what the step
allocates is replayed through a model of torch_npu's caching allocator, and what it computes and
communicates is timed by a model of the hardware (``hardware.json``). docs/planner.md says how,
and what the model cannot know.
"""
