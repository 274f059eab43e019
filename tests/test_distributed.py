"""Real 2-process gloo jobs on loopback: DDP at every opt level, ranks agreeing on every skip, checkpoint and
resume, no_sync accumulation, FSDP2 with O1/O4 (and the refusal of O2 on sharded parameters, which finds DTensor
without importing it)."""

from __future__ import annotations

import functools
import gc
import os
import re
import socket
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampinit
from ampinit import _distributed
from tests import _dist_worker
from tests._device import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
# gloo otherwise binds to the interface the hostname resolves to; these jobs stay on loopback.
ENV = subprocess_env({**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
JOBS_BUDGET_S = 300  # the module's one job of every scenario, and the torchrun example
# A per-test timeout (pytest-timeout) also counts the module fixture's job in the first test that needs it.
pytestmark = pytest.mark.timeout(JOBS_BUDGET_S + 60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "tests._dist_worker", str(free_port()), str(out), *_dist_worker.SCENARIOS]
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, timeout=JOBS_BUDGET_S)
    return out


def load(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}.{rank}.pt", weights_only=True) for rank in (0, 1)]


@pytest.mark.parametrize("level", _dist_worker.LEVELS)
def test_ddp_matches_one_process_on_the_global_batch(results: Path, level: str) -> None:
    rank0, rank1 = load(results, f"ddp_{level}")
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)  # ranks never drift apart
    assert rank0["amp"] == rank1["amp"]
    reference = _dist_worker.reference(level)
    assert rank0["amp"] == reference["amp"]
    tolerance = {"O0": 1e-5, "O1": 2e-2, "O2": 2e-2, "O3": 2e-2, "O4": 3e-2, "O5": 3e-2}[level]
    for a, r in zip(rank0["params"], reference["params"]):
        torch.testing.assert_close(a.float(), r.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_an_overflow_on_one_rank_skips_on_every_rank(results: Path, level: str) -> None:
    rank0, rank1 = load(results, f"overflow_{level}")
    for rank in (rank0, rank1):
        assert rank["skipped"] and rank["unchanged"] and rank["finite"]
    expected = rank0["scale_before"] / 2 if level == "O2" else rank0["scale_before"]  # O5: static scale
    assert rank0["amp"]["loss_scaler0"]["loss_scale"] == expected
    assert rank0["amp"] == rank1["amp"]
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)


def test_checkpoint_on_rank0_resumes_bitwise_on_all_ranks(results: Path) -> None:
    for rank in load(results, "resume"):
        assert rank["resumed"]["amp"] == rank["uninterrupted"]["amp"]
        for a, b in zip(rank["resumed"]["params"], rank["uninterrupted"]["params"]):
            assert torch.equal(a, b)


def test_delay_unscale_with_no_sync(results: Path) -> None:
    rank0, rank1 = load(results, "no_sync")
    for a, b in zip(rank0["grads"], rank1["grads"]):
        assert torch.equal(a, b)  # the second backward all-reduced the accumulated grads
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", _dist_worker.NO_SYNC_LEVELS)
def test_no_sync_accumulation_without_delay_unscale_keeps_the_ranks_together(results: Path, level: str) -> None:
    rank0, rank1 = load(results, f"no_sync_{level}")
    for a, b in zip(rank0["grads"], rank1["grads"]):
        assert torch.equal(a, b)  # the second backward all-reduced both halves
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)
    assert not rank0["warned"]


def test_no_sync_accumulation_onto_fp32_masters_warns_on_every_rank(results: Path) -> None:
    # O2's first block moved its half grads into the fp32 masters: only delay_unscale=True keeps them for the
    # all-reduce (as in Apex), which the warning says.
    assert all(rank["warned"] for rank in load(results, "no_sync_O2"))


@pytest.mark.parametrize("level", list(_dist_worker.FSDP_LEVELS))
def test_fsdp2_matches_plain_autocast_on_one_process(results: Path, level: str) -> None:
    rank0, rank1 = load(results, f"fsdp_{level}")
    assert rank0["amp"] == rank1["amp"]
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)
    reference = _dist_worker.autocast_reference(level)
    assert rank0["amp"]["loss_scaler0"] == {"loss_scale": reference["scale"], "unskipped": _dist_worker.FSDP_STEPS}
    # Both trainings round the same forward to the same dtype, so they differ by a few of its rounding errors: 2 eps
    # of each tensor's total update (seen: 0.44 eps). A missed unscale or a sum instead of a mean of the
    # ranks' grads is off by the whole update.
    eps = torch.finfo(_dist_worker.FSDP_LEVELS[level]).eps
    torch.manual_seed(0)
    initial = [p.detach() for p in _dist_worker.Net().parameters()]
    for a, r, start in zip(rank0["params"], reference["params"], initial):
        torch.testing.assert_close(a, r, rtol=0, atol=2 * eps * (r - start).abs().max().item())
    # Each rank's loss is on its half of the global batch: their mean is the reference's loss.
    global_losses = [(a + b) / 2 for a, b in zip(rank0["losses"], rank1["losses"])]
    torch.testing.assert_close(global_losses, reference["losses"], rtol=eps, atol=0)


def test_fsdp2_shards_are_left_to_the_optimizer_on_the_kernel_path(results: Path) -> None:
    """O4 on the step's CUDA path (amp's Triton kernels, interpreted on CPU): the kernels stand in for optimizers that
    cannot take the device flag, but read raw data pointers, and a DTensor shard's is 0. They leave the shards to
    the optimizer's own step, which trains exactly as on the CPU path."""
    for kernel_path, plain in zip(load(results, "fsdp_O4_kernel_path"), load(results, "fsdp_O4")):
        assert kernel_path["losses"] == plain["losses"]
        for a, b in zip(kernel_path["params"], plain["params"]):
            assert torch.equal(a, b)


def test_fsdp2_refuses_weight_casting_levels(results: Path) -> None:
    for rank in load(results, "fsdp_O2"):
        assert "cannot work with parameters sharded by FSDP2" in rank["refused"]
        assert "MixedPrecisionPolicy" in rank["refused"]


def ddp_example_first_loss() -> float:
    """Rank 0's first loss in examples/distributed/train_ddp.py, computed here in plain fp32 torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 1))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000))
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), x[:, :4].sum(dim=1, keepdim=True)).item()


def test_ddp_example_under_torchrun() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "examples/distributed/train_ddp.py", "--opt-level", "O2", "--steps", "30",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    checksums = dict(re.findall(r"^rank (\d) of 2: parameter checksum (\S+)$", result.stdout, re.MULTILINE))
    assert sorted(checksums) == ["0", "1"], result.stdout
    assert float(checksums["0"]) == float(checksums["1"])  # DDP kept the ranks' parameters identical
    first = re.search(r"step +0 +loss ([0-9.]+)", result.stdout)
    assert first is not None, result.stdout
    # O2 runs the forward in fp16: the first loss is fp32's to fp16's precision.
    assert float(first.group(1)) == pytest.approx(ddp_example_first_loss(), rel=torch.finfo(torch.float16).eps)


def test_the_flag_handed_to_the_backend_outlives_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend thread may drop its reference to a collective's tensor after the caller resumed; if it is the last
    one during interpreter shutdown the process aborts (see ampinit/_distributed.py). So the tensor ampinit hands
    to ``all_reduce`` must stay alive in Python after the session, and after ampinit's own reference is gone."""
    handed: list[weakref.ref[torch.Tensor]] = []

    def all_reduce(tensor: torch.Tensor, op: Any) -> None:
        handed.append(weakref.ref(tensor))

    monkeypatch.setattr(_distributed, "world_size", lambda: 2)
    monkeypatch.setattr(_distributed.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(_distributed, "_EXCHANGE", {})
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampinit.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with ampinit.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    finally:
        ampinit.deinitialize()
    _distributed._EXCHANGE.clear()
    del model, optimizer
    gc.collect()
    assert handed and all(ref() is not None for ref in handed)


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@functools.cache
def seeded_reference(case: str) -> dict[str, Any]:
    """One process training rank 0's broadcast weights, and those weights; once per case (both wrappers use it)."""
    return {**_dist_worker.seeded_reference(case), "start": _dist_worker.broadcast_weights(case)}


@pytest.mark.parametrize("wrapper", list(_dist_worker.WRAPPERS))
@pytest.mark.parametrize("case", list(_dist_worker.SEEDED_CASES))
def test_ranks_seeded_differently_train_rank0s_broadcast_model(results: Path, case: str, wrapper: str) -> None:
    """Apex built its masters at the first backward, after DDP broadcast rank 0's weights; masters built at
    initialize, from each rank's own weights, made the ranks train different models at O2/O5."""
    rank0, rank1 = load(results, f"seeds_{case}_{wrapper}")
    assert_bitwise(rank0["params"], rank1["params"])
    assert_bitwise(rank0["masters"], rank1["masters"])
    assert rank0["amp"] == rank1["amp"]
    reference = seeded_reference(case)
    assert rank0["amp"] == reference["amp"]
    assert not any(torch.equal(a, s) for a, s in zip(rank0["params"], reference["start"]))  # every weight trained
    # The two half batches' gradients summed by DDP, against one batch's: a few roundings of the level's dtype
    # apart (as in test_ddp_matches_one_process_on_the_global_batch). A rank training its own seed's masters is
    # off by the whole difference between the two initial models.
    tolerance = 1e-5 if case == "O0" else 3e-2
    for a, r in zip(rank0["masters"], reference["masters"]):
        torch.testing.assert_close(a, r, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", ["O2", "O5", "remainder"])
def test_apex_reducer_broadcast_is_followed_by_the_masters(results: Path, case: str) -> None:
    """``apex.parallel.Reducer(model)`` broadcast rank 0's weights with ``dist.broadcast``, which writes them without
    bumping their version counters: the masters made at initialize did not follow, and each rank went on training
    its own seed's model."""
    rank0, rank1 = load(results, f"reducer_{case}")
    assert_bitwise(rank0["params"], rank1["params"])
    assert_bitwise(rank0["masters"], rank1["masters"])
    assert rank0["amp"] == rank1["amp"]


@pytest.mark.parametrize("case", _dist_worker.SEEDED_RESUME_CASES)
def test_a_checkpoint_every_rank_loads_before_the_wrap_resumes_bitwise(results: Path, case: str) -> None:
    """The loaded fp32 masters survive DDP's broadcast of the weights every rank loaded (it writes them again)."""
    rank0, rank1 = load(results, f"seeded_resume_{case}")
    for rank in (rank0, rank1):
        assert_bitwise(rank["resumed"]["masters"], rank["uninterrupted"]["masters"])
        assert_bitwise(rank["resumed"]["params"], rank["uninterrupted"]["params"])
        assert rank["resumed"]["amp"] == rank["uninterrupted"]["amp"]
    assert_bitwise(rank0["resumed"]["masters"], rank1["resumed"]["masters"])


@pytest.mark.parametrize("case", list(_dist_worker.DIAL_CASES))
def test_ranks_seeded_differently_round_alike_under_the_dial(results: Path, case: str) -> None:
    """Stochastic rounding draws its bits from the session's seed: each rank's own ``torch.initial_seed()`` made
    DDP ranks round the same averaged update differently, so their weights and moments drifted apart."""
    rank0, rank1 = load(results, f"dial_{case}")
    assert_bitwise(rank0["params"], rank1["params"])
    assert_bitwise(rank0["masters"], rank1["masters"])
    assert rank0["amp"] == rank1["amp"]
    assert rank0["optimizer"]["amp_dial"] == rank1["optimizer"]["amp_dial"]  # the seed included
    state0, state1 = rank0["optimizer"]["state"], rank1["optimizer"]["state"]
    assert state0.keys() == state1.keys() and state0
    for index, entry in state0.items():
        assert entry.keys() == state1[index].keys()
        for key, value in entry.items():
            assert torch.equal(value, state1[index][key]), (index, key)
    assert not any(torch.equal(a, b) for a, b in zip(rank0["params"], _dist_worker.broadcast_weights("O5")))


@pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")
def test_dtensor_is_found_under_either_spelling() -> None:
    """The FSDP2 refusal finds torch's DTensor class, looked up lazily, under the spelling every supported torch has.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    from torch.distributed._tensor import DTensor  # the one spelling torch 2.4 to 2.14 all have

    # Looked up lazily (importing it eagerly costs `import ampinit` half a second): once any code has imported
    # DTensor, the FSDP2 refusal sees it.
    assert _distributed._dtensor_type() is DTensor
