"""Where remainder masters live: a few shared buffers per device (``remainder.new_storages``), not one allocation per
parameter, because CUDA's caching allocator counts up to 1 MiB more than asked for each large tensor (issue 24's
memory rows; docs/precision.md). Each view must still be laid out as its parameter is, and start aligned for the
kernels' vector accesses; training on packed remainders is pinned bitwise by tests/test_remainder_masters.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import remainder as encoding
from ampinit._masters.remainder_grads import RemainderGrads


def storage_start(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def params_of(sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8])
def test_contiguous_parameters_share_one_buffer_in_order_each_view_aligned(dtype: torch.dtype) -> None:
    sizes = [1, 33, 64, 7, 1000, 3]
    params = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes[:4]]
    params += [torch.zeros(10, 100, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.bfloat16)]
    storages = encoding.new_storages(params, dtype)
    assert [s.shape for s in storages] == [p.shape for p in params]
    assert [s.stride() for s in storages] == [p.stride() for p in params]
    assert all(s.dtype == dtype and s.device == p.device for s, p in zip(storages, params))
    assert len({storage_start(s) for s in storages}) == 1  # one allocation
    starts = [s.data_ptr() - storage_start(s) for s in storages]
    assert all(start % encoding.ALIGN_BYTES == 0 for start in starts)
    ends = [start + s.numel() * s.element_size() for start, s in zip(starts, storages)]
    assert all(end <= next_start for end, next_start in zip(ends, starts[1:]))  # in order, no overlap
    # Gaps only to the next aligned start: the buffer is the parameters' bytes plus less than ALIGN_BYTES each.
    assert storages[0].untyped_storage().nbytes() == ends[-1]
    assert ends[-1] - sum(s.numel() * s.element_size() for s in storages) < encoding.ALIGN_BYTES * len(params)


def test_a_write_through_one_view_changes_no_other() -> None:
    storages = encoding.new_storages(params_of([5, 40, 3]), torch.int16)
    for index, storage in enumerate(storages):
        storage.fill_(index + 1)
    assert [sorted(set(s.tolist())) for s in storages] == [[1], [2], [3]]


def test_buffers_hold_at_most_the_limit_and_a_larger_parameter_gets_its_own() -> None:
    itemsize = 2
    limit = 256 * itemsize  # 256 int16 elements per buffer
    params = params_of([100, 100, 100, 300, 50, 256])
    storages = encoding.new_storages(params, torch.int16, limit=limit)
    buffers: dict[int, list[int]] = {}
    for index, storage in enumerate(storages):
        buffers.setdefault(storage_start(storage), []).append(index)
        assert storage.untyped_storage().nbytes() <= max(limit, storage.numel() * itemsize)
    # 100 + 100 (each padded to 32 elements: 128 + 100 fits 256), then 100 starts a new buffer; 300 > 256 is alone;
    # 50 joins the buffer that was open; 256 fills one of its own.
    assert sorted(buffers.values()) == [[0, 1], [2, 4], [3], [5]]
    assert storages[3].untyped_storage().nbytes() == 300 * itemsize


@pytest.mark.parametrize(
    "param",
    [
        torch.zeros(4, 3, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last),
        torch.zeros(6, 4, dtype=torch.bfloat16).t(),
        torch.zeros(0, 8, dtype=torch.bfloat16),
    ],
    ids=["channels_last", "transposed", "empty"],
)
def test_strided_and_empty_parameters_get_a_tensor_of_their_own_layout(param: torch.Tensor) -> None:
    neighbours = params_of([64, 64])
    storages = encoding.new_storages([neighbours[0], param, neighbours[1]], torch.int16)
    assert storages[1].shape == param.shape and storages[1].stride() == param.stride()
    assert storage_start(storages[1]) not in {storage_start(storages[0]), storage_start(storages[2])}
    assert storage_start(storages[0]) == storage_start(storages[2])


class Marked(torch.Tensor):
    """A tensor subclass (as FSDP2's DTensor is one): its storage is not packed beside plain tensors'."""


def test_a_tensor_subclass_gets_a_tensor_of_its_own_as_empty_like_makes() -> None:
    plain = params_of([64, 64])
    marked = torch.zeros(64, dtype=torch.bfloat16).as_subclass(Marked)
    storages = encoding.new_storages([plain[0], marked, plain[1]], torch.int16)
    assert type(storages[1]) is Marked
    assert storage_start(storages[1]) not in {storage_start(storages[0]), storage_start(storages[2])}
    assert storage_start(storages[0]) == storage_start(storages[2])


def test_each_device_gets_its_own_buffers() -> None:
    params = [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16, device="meta")]
    params += [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16, device="meta")]
    storages = encoding.new_storages(params, torch.int16)
    assert [s.device for s in storages] == [p.device for p in params]
    assert storage_start(storages[0]) == storage_start(storages[2])


@pytest.mark.parametrize("limit", [0, -4])
def test_a_limit_that_holds_nothing_is_refused_by_value(limit: int) -> None:
    with pytest.raises(ValueError, match=f"limit={limit}"):
        encoding.new_storages(params_of([4]), torch.int16, limit=limit)


@pytest.mark.parametrize("masters", ["remainder", "remainder8"])
def test_a_sessions_remainders_share_one_allocation(masters: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48), nn.Linear(48, 5))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    kwargs = {"optimizer_state": "bf16"} if masters == "remainder8" else {}
    before = [p.detach().clone() for p in net.parameters()]
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=masters, verbosity=0, **kwargs)
    try:
        session = ampinit.session_of(opt)
        assert session is not None
        grads = session._record_of(opt).grads  # type: ignore[union-attr]
        assert isinstance(grads, RemainderGrads)
        storages = [grads.remainder_of(p) for p in net.parameters()]
        assert all(s is not None for s in storages)
        assert len({storage_start(s) for s in storages if s is not None}) == 1
        # The views hold the model's fp32 values before the cast: all 32 bits with int16 remainders, 24 with int8.
        for param, fp32 in zip(net.parameters(), before):
            master = session.master_for(param)
            assert master is not None
            if masters == "remainder":
                assert torch.equal(master, fp32)
            else:
                torch.testing.assert_close(master, fp32, rtol=2.0**-15, atol=0.0)
    finally:
        ampinit.deinitialize()
