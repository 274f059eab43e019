"""The master-step kernels' pointer and block tables: built once for a set of tensors and reused step after step,
built again when any tensor the step touches is reallocated (a checkpoint load gives the optimizer new state
tensors, a new param group brings new tensors), so a cached table never points at memory the step no longer owns.
The grads, which a backward may put anywhere, have a pointer table of their own: fresh grads rebuild only it.
And the optimizer's per-parameter step counts, packed into one tensor for the step (``kernel_step.packed_steps``),
are packed again when the state is replaced or a count is given other memory."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def one_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, half: torch.dtype = torch.float16) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x.to(half)).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.fixture
def builds(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every table the kernels build from now on (the cache starts empty)."""
    built: list[Any] = []
    build = kernels_on_cpu._build_tables
    monkeypatch.setattr(kernels_on_cpu, "_tables_by_storage", {})
    monkeypatch.setattr(kernels_on_cpu, "_grad_tables_by_storage", {})
    monkeypatch.setattr(kernels_on_cpu, "_build_tables", lambda *a: built.append(a) or build(*a))
    return built


def test_tables_are_reused_while_the_tensors_stay(builds: list[Any]) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
    try:
        one_step(model, opt, 0)
        assert len(builds) == 1  # one launch: one list of fp16 weights
        for seed in (1, 2):
            one_step(model, opt, seed)  # each backward gives fresh half grads: only their table may be rebuilt
        assert len(builds) == 1
    finally:
        amp.deinitialize()


def test_fresh_grads_get_their_own_table(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grad at a new address is read there (not through a stale pointer): the step equals the reference's."""
    monkeypatch.setattr(kernels_on_cpu, "_grad_tables_by_storage", {})
    from ampinit._masters import reference

    weights = []
    grad_tables = []
    for module in (kernels_on_cpu, reference):
        monkeypatch.setattr(kernels_on_cpu, "adam_", module.adam_)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
        try:
            for seed in range(3):
                keep = [p.grad for p in model.parameters()]  # the old grads stay alive: new ones go elsewhere
                one_step(model, opt, seed)
                del keep
            weights.append([p.detach().clone() for p in model.parameters()])
            grad_tables.append(len(kernels_on_cpu._grad_tables_by_storage))  # before the close lets go of them
        finally:
            amp.deinitialize()
    assert grad_tables[0] >= 2  # step 2 may find step 0's freed addresses again
    for got, want in zip(*weights):
        assert torch.equal(got, want)


def test_a_new_param_group_gets_tables_of_its_own(builds: list[Any]) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
    try:
        one_step(model, opt, 0)
        assert len(builds) == 1
        before = [p.detach().clone() for p in model[2].parameters()]
        opt.add_param_group({"params": list(model[2].parameters())})
        one_step(model, opt, 1)
        assert len(builds) == 2  # the first group's table again, the new group's built
        assert all(not torch.equal(p.detach(), b) for p, b in zip(model[2].parameters(), before))
    finally:
        amp.deinitialize()


def test_step_counts_are_packed_in_torch_layout_and_again_after_a_load(kernels_on_cpu: ModuleType) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
    try:
        one_step(model, opt, 0)
        steps = [s["step"] for s in opt.state.values()]
        assert all(s.dim() == 0 and s.dtype == torch.float32 for s in steps)  # torch's layout, seen from outside
        assert len({s._base is not None and id(s._base) for s in steps}) == 1  # views of one tensor
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        loaded = [s["step"] for s in opt.state.values()]
        one_step(model, opt, 1)
        stepped = [s["step"] for s in opt.state.values()]
        assert [s.item() for s in stepped] == [2.0] * len(stepped)  # the loaded counts advanced, once
        assert all(a is not b for a, b in zip(loaded, stepped))  # packed again: views of a new tensor
        assert len({id(s._base) for s in stepped}) == 1 and stepped[0]._base is not steps[0]._base
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("entry", [0, 2])
def test_a_step_count_given_other_memory_is_packed_again(kernels_on_cpu: ModuleType, entry: int) -> None:
    """A count whose ``.data`` was assigned keeps its identity and (for a view) its ``_base``, not its memory: the
    step advances the count the state holds, from its new value, as torch's step would."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
    try:
        one_step(model, opt, 0)
        state = opt.state[opt.param_groups[0]["params"][entry]]
        state["step"].data = torch.tensor(5.0)
        one_step(model, opt, 1)
        counts = [s["step"].item() for s in opt.state.values()]
        assert counts == [6.0 if i == entry else 2.0 for i in range(len(counts))]
    finally:
        amp.deinitialize()


def test_a_checkpoint_load_rebuilds_the_tables(builds: list[Any]) -> None:
    def train(reload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
        try:
            one_step(model, opt, 0)
            if reload:
                # A checkpoint read back holds new tensors; the old ones stay alive here (held by `saved`), so a
                # stale table would update them and leave the optimizer's own state behind, silently.
                saved = opt.state_dict()
                opt.load_state_dict(copy.deepcopy(saved))
            for seed in (1, 2):
                one_step(model, opt, seed)
            moments = [s["exp_avg"].clone() for s in opt.state.values()]
            return [p.detach().clone() for p in model.parameters()], moments
        finally:
            amp.deinitialize()

    weights, moments = train(reload=True)
    assert len(builds) == 2  # before the load, and after it
    ref_weights, ref_moments = train(reload=False)
    for got, want in zip([*weights, *moments], [*ref_weights, *ref_moments]):
        assert torch.equal(got, want)


def test_the_finite_check_rebuilds_only_the_grads_pointers_when_grads_move(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check launches over grads alone (fresh every backward): its block tables are keyed by sizes, so grads
    at new addresses cost one pointer table, not a table entry per block; and it reads them where they now are."""
    built: list[Any] = []
    build = kernels_on_cpu._tables_on
    monkeypatch.setattr(kernels_on_cpu, "_tables_by_sizes", {})
    monkeypatch.setattr(kernels_on_cpu, "_grad_tables_by_storage", {})
    monkeypatch.setattr(kernels_on_cpu, "_tables_on", lambda *a: built.append(a) or build(*a))
    sizes = (3000, 5, 1024)
    kept = []
    for bad in (None, 2, None, 0):
        grads = [torch.randn(n).bfloat16() for n in sizes]  # the earlier ones kept alive: new addresses
        if bad is not None:
            grads[bad][-1] = float("nan")
        flag = torch.zeros(1)
        kernels_on_cpu.check_finite_(grads, flag)
        assert flag.item() == (0.0 if bad is None else 1.0)
        kept.append(grads)
    assert len(built) == 1 and len(kernels_on_cpu._tables_by_sizes) == 1
    assert len(kernels_on_cpu._grad_tables_by_storage) == 4


@pytest.mark.parametrize(
    ("optimizer", "options"),
    [
        ("adamw", {"master_weights": "remainder", "optimizer_state": "8bit"}),
        ("adamw", {"master_weights": "stochastic", "optimizer_state": "bf16"}),
        ("sgd", {"master_weights": "remainder8", "optimizer_state": "8bit"}),
    ],
)
def test_the_dials_step_rebuilds_only_the_grads_pointers_when_grads_move(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, optimizer: str, options: dict[str, str]
) -> None:
    """The dial's launch (``triton_dial``) keeps the grads out of its block tables, as the fp32-master launch does:
    grads at new addresses every step (the old ones kept alive) build the state's tables once, and each step reads
    the grads where they now are (bitwise the run whose tables are all rebuilt before every step)."""
    from ampinit._masters import triton_dial

    built: list[Any] = []
    build = kernels_on_cpu._build_tables
    monkeypatch.setattr(kernels_on_cpu, "_build_tables", lambda *a: built.append(a) or build(*a))
    # triton_dial took _launch_tables from the interpreted module at its import: the same function object, whose globals
    # (the patched _build_tables, the caches) are the module's.
    assert triton_dial._launch_tables is kernels_on_cpu._launch_tables
    launches: list[int] = []
    name = "adam_dial_" if optimizer == "adamw" else "sgd_dial_"
    step = getattr(triton_dial, name)
    monkeypatch.setattr(triton_dial, name, lambda *a, **k: launches.append(1) or step(*a, **k))
    grad_tables: list[int] = []

    def train(rebuild: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels_on_cpu, "_tables_by_storage", {})
        monkeypatch.setattr(kernels_on_cpu, "_grad_tables_by_storage", {})
        built.clear()
        launches.clear()
        model = make_model()
        make = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        opt = make(model.parameters(), lr=1e-2, **({"momentum": 0.9} if optimizer == "sgd" else {}))
        amp.initialize(model, opt, opt_level="O5", verbosity=0, **options)
        kept = []
        try:
            for seed in range(4):
                if rebuild:
                    kernels_on_cpu._tables_by_storage.clear()
                    kernels_on_cpu._grad_tables_by_storage.clear()
                kept.append([p.grad for p in model.parameters()])  # alive: the next grads go elsewhere
                one_step(model, opt, seed, torch.bfloat16)
            assert len(launches) == 4  # every step took the dial's kernels
            grad_tables.append(len(kernels_on_cpu._grad_tables_by_storage))  # before the close lets go of them
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            return [p.detach().clone() for p in model.parameters()] + [v.clone() for v in state]
        finally:
            amp.deinitialize()

    cached = train(rebuild=False)
    assert len(built) == 1  # the state's tables, once: the grads moved at every step
    assert grad_tables[0] >= 3
    rebuilt = train(rebuild=True)
    assert len(built) == 4
    assert len(cached) == len(rebuilt)
    for got, want in zip(cached, rebuilt):
        assert torch.equal(got, want)


def test_closing_a_session_lets_go_of_the_tables(kernels_on_cpu: ModuleType) -> None:
    """The tables are device memory keyed by data pointers, which outlive their tensors: a closed session's go with
    it (on the H200 check they were what a later session's peak memory carried of every earlier one's)."""
    import sys

    from ampinit._masters import triton_dial

    assert sys.modules[kernels_on_cpu.__name__] is kernels_on_cpu
    caches = (
        kernels_on_cpu._tables_by_storage,
        kernels_on_cpu._grad_tables_by_storage,
        kernels_on_cpu._tables_by_sizes,
        triton_dial._map_tables,
    )
    for options in ({}, {"master_weights": "remainder", "optimizer_state": "8bit"}):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        amp.initialize(model, opt, opt_level="O5", verbosity=0, **options)
        try:
            one_step(model, opt, 0, torch.bfloat16)
            filled = [len(cache) for cache in caches]
            # Every cache the step used holds something: the block and grad tables, the check's (O5 checks its
            # bf16 grads in the kernel), and the 8-bit maps where the moments are 8-bit.
            assert filled[:3] == [1, 1, 1] and filled[3] == (2 if options else 0), filled
        finally:
            amp.deinitialize()
        assert [len(cache) for cache in caches] == [0, 0, 0, 0]


def test_the_step_and_the_finite_check_share_one_block_table(kernels_on_cpu: ModuleType) -> None:
    """The block tables depend on the sizes alone: an O5 step's launch and its grads' check (same sizes) hold one
    copy of them on the device, not one each."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O5", verbosity=0)
    try:
        one_step(model, opt, 0, torch.bfloat16)
        (step_tables,) = kernels_on_cpu._tables_by_storage.values()
        (check_tables,) = kernels_on_cpu._tables_by_sizes.values()
        assert step_tables.first_blocks is check_tables.first_blocks
        assert step_tables.numels is check_tables.numels
        assert step_tables.pointers.numel() == 4 * len(list(model.parameters()))  # moments, masters, weights
    finally:
        amp.deinitialize()
