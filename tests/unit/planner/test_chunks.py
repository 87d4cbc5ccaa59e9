"""The planner's lazy stand-in for FSDP's ``_chunk_with_empty`` cuts the chunks upstream's does."""

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from npu_inject.planner.interventions import _Chunks


@pytest.mark.parametrize("shape,chunks,dim", [
    ((10, 3), 4, 0), ((7,), 8, 0), ((16, 4), 16, 0), ((5, 9), 3, 1), ((0, 4), 3, 0), ((1,), 1024, 0),
    ((4096, 7), 1000, 0), ((12,), 5, 0),
])
def test_lazy_chunks_match_upstream(shape, chunks, dim):
    tensor = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    upstream = _chunk_with_empty(tensor, chunks, dim)
    lazy = _Chunks(tensor, chunks, dim)
    assert len(lazy) == len(upstream)
    for index in [*range(len(upstream)), -1, -len(upstream)]:
        expected, got = upstream[index], lazy[index]
        assert got.shape == expected.shape, index
        assert torch.equal(got, expected), index
    with pytest.raises(IndexError):
        lazy[len(upstream)]
