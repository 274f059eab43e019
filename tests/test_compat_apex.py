"""The Apex aliases: import alias, API surface and return shapes, ``_amp_state`` views, the old ``amp.init`` handle
(its devices and its weight-cast cache), ``fp16_utils``, ``parallel`` (DDP, SyncBatchNorm, LARC), each compared
with Apex's documented behaviour (shared/reference/apex-amp.md) or a plain re-implementation."""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ampinit
from ampinit.compat import apex as compat
from ampinit.compat.apex import amp
from ampinit.compat.apex.amp import amp as apex_amp_module
from ampinit.compat.apex.amp.handle import OLD_API_MESSAGE
from ampinit.compat.apex.fp16_utils import (
    fp16_optimizer,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)
from ampinit.compat.apex.parallel import DistributedDataParallel, convert_syncbn_model, distributed
from ampinit.compat.apex.parallel.LARC import LARC
from tests._device import on_device
from tests.conftest import make_problem


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def alias() -> Iterator[None]:
    compat.install()
    try:
        yield
    finally:
        compat.uninstall()


# -- the import alias -------------------------------------------------------------------------------------------
def test_alias_resolves_apex_names_to_the_compat_modules(alias: None) -> None:
    import amp_C
    import apex
    import apex.amp._amp_state
    from apex import amp as apex_amp
    from apex.amp import _amp_state
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedAdam
    from apex.parallel.LARC import LARC as ApexLARC

    assert apex is compat and apex_amp is amp and amp_C is compat.amp_C
    assert _amp_state is amp._amp_state and apex.amp._amp_state is amp._amp_state  # the object, not the module
    import ampinit.multi_tensor

    assert multi_tensor_applier is compat.multi_tensor_apply.multi_tensor_applier
    assert ampinit.multi_tensor.multi_tensor_applier is multi_tensor_applier and ampinit.multi_tensor.amp_C is amp_C
    assert FusedAdam is ampinit.optimizers.FusedAdam and ApexLARC is LARC


def test_alias_names_missing_modules_and_uninstall_restores(alias: None) -> None:
    with pytest.raises(ModuleNotFoundError, match=re.escape("No module named 'apex.contrib': ampinit's Apex aliases")):
        import apex.contrib
    compat.uninstall()
    assert "apex" not in sys.modules and "amp_C" not in sys.modules and not compat.is_installed()
    with pytest.raises(ModuleNotFoundError):
        import apex  # noqa: F401


def test_alias_says_when_it_shadows_a_real_apex(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "apex"  # type: ignore[operator]
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=re.escape(f"A real apex is installed ({fake / '__init__.py'})")):
        compat.install()
    try:
        import apex

        assert apex is compat
    finally:
        compat.uninstall()
    import apex as real

    assert real.REAL is True
    del sys.modules["apex"]


# -- amp: initialize, scale_loss, return shapes -----------------------------------------------------------------
def test_initialize_returns_apex_shapes_and_accepts_larc() -> None:
    model, x, y = make_problem()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    larc = LARC(base)
    out_model, out_opts = amp.initialize(model, [larc], opt_level="O2", loss_scale="128.0", verbosity=0)
    try:
        assert out_model is model and out_opts == [larc]
        assert ampinit.session_of(base) is ampinit.current_session()
        assert amp._amp_state.opt_properties.opt_level == "O2"
        assert amp._amp_state.loss_scalers[0].loss_scale() == 128.0
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), larc) as scaled:
            scaled.backward()
        larc.step()
        assert all(p.dtype == torch.float32 for p in amp.master_params(larc))
    finally:
        amp._amp_state.loss_scalers  # noqa: B018 (the view is readable until close)
        ampinit.deinitialize()


def test_scale_loss_before_initialize_is_apexs_error() -> None:
    with pytest.raises(RuntimeError, match=re.escape("Invoked `with amp.scale_loss`, but internal Amp state")):
        with amp.scale_loss(torch.ones(()), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)):
            pass


def test_amp_state_views_read_and_write_through_the_session() -> None:
    model, _, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    try:
        state = amp._amp_state
        assert [s.loss_scale() for s in state.loss_scalers] == [65536.0, 65536.0]
        state.loss_scalers[1]._loss_scale = 2.0**10
        state.loss_scalers[1]._unskipped = 7
        assert amp.state_dict() == {
            "loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
            "loss_scaler1": {"loss_scale": 1024.0, "unskipped": 7},
        }
        assert state.loss_scalers[0].dynamic and state.max_loss_scale == 2.0**24 and state.min_loss_scale is None
        assert state.handle.is_active() and state.verbosity == 0
        state.verbosity = 1
        assert ampinit.current_session().verbosity == 1  # type: ignore[union-attr]
    finally:
        ampinit.deinitialize()
    with pytest.raises(AttributeError, match=re.escape("_amp_state has no 'loss_scalers'")):
        amp._amp_state.loss_scalers  # noqa: B018


def test_handle_exists_only_for_function_casting_levels() -> None:
    model, _, _ = make_problem()
    amp.initialize(model, opt_level="O2", verbosity=0)
    try:
        assert not hasattr(amp._amp_state, "handle")
    finally:
        ampinit.deinitialize()


def test_allow_incoming_model_not_fp32_accepts_a_half_model_at_o2() -> None:
    model, _, _ = make_problem()
    model.half()
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
        # Apex's convert_network leaves affine BatchNorm as it comes: half here, with an fp32 master.
        assert model.fc1.weight.dtype == torch.float16 and model.bn.weight.dtype == torch.float16
        ampinit.deinitialize()
        amp.initialize(model.half(), opt_level="O1", verbosity=0)  # Apex accepted it at O1 too (cast around it)
        assert model.fc1.weight.dtype == torch.float16
        ampinit.deinitialize()
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False


def test_disabled_initialize_is_a_passthrough_every_time() -> None:
    """Apex's ``amp.initialize(..., enabled=False)`` returns its arguments at once (``if not enabled: return
    models, optimizers``), with nothing recorded on the model. A script that calls it again for the same model
    (a second training phase with a new optimizer, with ``enabled=args.fp16`` false) therefore runs under Apex.
    ampinit records the disabled session as the model's owner and refuses the second call ("already belongs to
    a live amp session").

    Found by: the review of the Apex compatibility layer.
    """
    model = nn.Linear(4, 2)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        assert amp.initialize(model, first, enabled=False) == (model, first)
        second = torch.optim.Adam(model.parameters(), lr=0.1)
        assert amp.initialize(model, second, enabled=False) == (model, second)
        loss = model(torch.randn(3, 4)).sum()
        with amp.scale_loss(loss, second) as scaled:
            assert scaled is loss
            scaled.backward()
        second.step()
    finally:
        while ampinit.current_session() is not None:
            ampinit.deinitialize()


# -- the old amp.init() handle API (Apex's L0 tests set up with it) ---------------------------------------------
def test_init_handle_casts_and_deactivates(device: torch.device) -> None:
    x, w = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    # Apex's rule: amp.init() casts CUDA tensors only; ampinit casts the CPU's on a machine without CUDA.
    cast_here = device.type == "cuda" or not torch.cuda.is_available()
    handle = amp.init()
    try:
        assert isinstance(handle, amp.handle.AmpHandle) and handle.is_active() and handle.has_cache
        assert torch.mm(x, w).dtype == (torch.float16 if cast_here else torch.float32)
        with handle._disable_casts():
            assert torch.mm(x, w).dtype == torch.float32
        assert amp._amp_state.handle is handle
        with pytest.raises(RuntimeError, match=re.escape(OLD_API_MESSAGE)):
            handle.scale_loss(torch.ones(()), None)  # type: ignore[arg-type]
    finally:
        handle._deactivate()
    assert not handle.is_active() and torch.mm(x, w).dtype == torch.float32
    noop = amp.init(enabled=False)
    assert not noop.is_active() and torch.mm(x, w).dtype == torch.float32


def _weight_casts(out: torch.Tensor) -> int:
    """How many distinct cast nodes (``ToCopyBackward``) of leaves feed ``out``'s graph.

    Every node reached is held until the count is done. torch 2.11 gives an autograd node a new Python object each
    time it is reached unless one is alive (2.13 keeps one per node), so ids of dropped objects are reused: one
    node could count twice, or two nodes once, depending on the allocator, i.e. on the tests run before.
    """
    seen: dict[int, object] = {}
    casts: set[int] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        feeds_leaf = any("AccumulateGrad" in type(f).__name__ for f, _ in node.next_functions)
        if "ToCopy" in type(node).__name__ and feeds_leaf:
            casts.add(id(node))
        stack.extend(f for f, _ in node.next_functions)
    return len(casts)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_old_api_init_caches_weight_casts_as_apex_did(enable_caching: bool) -> None:
    """Apex's old ``amp.init(enable_caching=True)`` cast a weight once until the next ``scale_loss`` exit (an
    unrolled RNN cell keeps one fp16 copy of its weights, not one per step); ``enable_caching=False`` cast per use.
    Its sessions have no model forward, where ampinit caches, so the compat ``init`` keeps the cache on.

    Found by: the review of the O1/O4 cast policy.
    """
    from ampinit.compat.apex import amp as apex_amp

    handle = apex_amp.init(enable_caching=enable_caching)
    try:
        # On the test device: on a GPU machine the old API casts CUDA tensors only (Apex's rule; the next test).
        layer = on_device(nn.Linear(4, 4))
        x = on_device(g(2, 4))
        out = layer(layer(x))
        assert _weight_casts(out) == (2 if enable_caching else 4)  # weight and bias, once or twice each
    finally:
        handle._deactivate()


def test_amp_init_casts_cuda_only_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old ``amp.init()`` casts CUDA only where CUDA is available, as Apex did; the CPU elsewhere.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apex_amp_module.cast_devices() == ["cuda"]  # Apex never cast CPU tensors
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert apex_amp_module.cast_devices() == ["cpu"]


# -- fp16_utils ------------------------------------------------------------------------------------------------
def test_fp16_helpers_follow_apex() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.LayerNorm(3), nn.BatchNorm1d(3, affine=False))
    compat.fp16_utils.convert_network(net, torch.half)
    assert [net[0].weight.dtype, net[1].weight.dtype, net[2].weight.dtype, net[3].running_mean.dtype] == [
        torch.half,
        torch.float32,
        torch.half,
        torch.half,
    ]
    half_net = compat.fp16_utils.network_to_half(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    assert half_net[1][1].weight.dtype == torch.float32  # affine BN back in fp32, as in Apex
    assert half_net(torch.randn(2, 3)).dtype == torch.float16  # the input is halved by tofp16
    assert compat.fp16_utils.to_python_float(torch.tensor([2.5])) == 2.5
    model = nn.Linear(3, 2).half()
    model_params, masters = compat.fp16_utils.prep_param_lists(model)
    assert [m.dtype for m in masters] == [torch.float32] * 2 and all(m.requires_grad for m in masters)
    model(torch.randn(1, 3).half()).sum().backward()
    compat.fp16_utils.model_grads_to_master_grads(model_params, masters)
    assert all(torch.equal(m.grad, p.grad.float()) for p, m in zip(model_params, masters))  # type: ignore[arg-type, union-attr]
    for m in masters:
        m.data.add_(1)
    compat.fp16_utils.master_params_to_model_params(model_params, masters)
    assert all(torch.equal(p, m.half()) for p, m in zip(model_params, masters))
    _, (flat,) = compat.fp16_utils.prep_param_lists(model, flat_master=True)
    assert flat.numel() == 8 and flat.grad is not None


def test_dynamic_loss_scaler_schedule() -> None:
    scaler = compat.fp16_utils.DynamicLossScaler(init_scale=8.0, scale_window=2)
    fates = []
    for overflow in (False, True, False, False, True):
        scaler.update_scale(overflow)
        fates.append(scaler.loss_scale)
    # Apex's rule: grow when (iter - last_overflow) % window == 0, halve (not below 1) on overflow.
    assert fates == [8.0, 4.0, 4.0, 8.0, 4.0]
    assert scaler.has_overflow([nn.Parameter(torch.ones(1)).requires_grad_()]) is False


def test_fp16_optimizer_matches_hand_written_master_weights() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    with pytest.warns(fp16_optimizer.DeprecatedFeatureWarning, match=re.escape("FP16_Optimizer is deprecated")):
        opt = compat.fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 128.0)
    x, y = torch.randn(16, 8).half(), torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        ref_opt.zero_grad()
        half_w = [r.detach().half().requires_grad_() for r in reference]
        (nn.functional.mse_loss(nn.functional.linear(x, *half_w).float(), y) * 128.0).backward()
        for r, h in zip(reference, half_w):
            r.grad = h.grad.float() / 128.0  # type: ignore[union-attr]
        ref_opt.step()
    for master, ref in zip(opt.fp32_from_fp16_groups[0], reference):
        torch.testing.assert_close(master, ref)
    assert set(opt.state_dict()) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }


def test_fp16_optimizer_skips_on_overflow_with_a_dynamic_scale(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(2, 1).half()
    with pytest.warns(fp16_optimizer.DeprecatedFeatureWarning):
        opt = compat.fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    before = [p.clone() for p in model.parameters()]
    opt.backward(model(torch.full((1, 2), float("inf")).half()).float().sum())
    with caplog.at_level("INFO", logger="ampinit"):
        opt.step()
    assert opt.overflow and opt.loss_scale == 32768.0 and opt.clip_master_grads(1.0) == -1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "Gradient overflow.  Skipping step, reducing loss scale to 32768.0" in caplog.text


def test_to_python_float_returns_item_unchanged() -> None:
    """Apex's ``fp16util.to_python_float(t)`` is ``return t.item()`` (``t[0]`` without ``item``): an integer
    tensor gives a Python int and a bool tensor a bool, as ``Tensor.item()`` does. ImageNet-style scripts pass
    counts through it (``correct = to_python_float(pred.eq(target).sum())``) and format them with ``{:d}``,
    which raises ``ValueError`` for a float. ampinit wrapped the result in ``float()``.

    Found by: the review of the Apex compatibility layer.
    """
    count = to_python_float(torch.tensor(5))
    assert type(count) is int and count == 5
    assert f"{count:d}" == "5"
    assert type(to_python_float(torch.tensor(True))) is bool
    assert type(to_python_float(torch.tensor(2.5))) is float and to_python_float(torch.tensor(2.5)) == 2.5


def test_flat_master_of_a_network_to_half_model_with_batchnorm() -> None:
    """Apex's ``prep_param_lists(model, flat_master=True)`` is ``_flatten_dense_tensors([p.data for p in
    model_params]).float()``; it re-raises only if the flattening fails, and on torch >= 1.5 ``torch.cat`` promotes
    mixed dtypes, so a ``network_to_half`` model (half Linear, fp32 BatchNorm) gets one float32 flat master, and
    ``model_grads_to_master_grads`` / ``master_params_to_model_params`` work on it. ampinit raised TypeError.

    Found by: the review of the Apex compatibility layer.
    """
    torch.manual_seed(0)
    model = network_to_half(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    model_params, (flat,) = prep_param_lists(model, flat_master=True)
    assert {p.dtype for p in model_params} == {torch.float16, torch.float32}
    assert flat.dtype == torch.float32 and flat.numel() == 12 + 4 + 4 + 4 and flat.grad is not None
    torch.testing.assert_close(flat.detach(), torch.cat([p.detach().float().reshape(-1) for p in model_params]))
    model(torch.randn(5, 3)).float().sum().backward()
    model_grads_to_master_grads(model_params, [flat], flat_master=True)
    assert flat.grad is not None
    torch.testing.assert_close(flat.grad, torch.cat([p.grad.float().reshape(-1) for p in model_params]))  # type: ignore[union-attr]
    with torch.no_grad():
        flat.add_(1.0)
    master_params_to_model_params(model_params, [flat], flat_master=True)
    offset = 0
    for p in model_params:
        n = p.numel()
        assert torch.equal(p, flat[offset : offset + n].view_as(p).to(p.dtype))
        offset += n


# -- parallel --------------------------------------------------------------------------------------------------
def test_larc_matches_the_formula() -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    zero = nn.Parameter(torch.zeros(3))
    p.grad, zero.grad = torch.randn(5), torch.randn(3)
    expected_grad = p.grad.clone()
    wd, lr, tc = 0.01, 0.5, 0.02
    adaptive = min(tc * p.norm() / (expected_grad.norm() + p.norm() * wd + 1e-8) / lr, 1.0)
    expected = p.detach() - lr * (expected_grad + wd * p.detach()) * adaptive
    zero_expected = zero.detach() - lr * zero.grad  # a zero-norm weight is left to the plain step (no decay)
    opt = LARC(torch.optim.SGD([p, zero], lr=lr, weight_decay=wd), trust_coefficient=tc)
    opt.step()
    torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(zero.detach(), zero_expected)
    assert opt.param_groups[0]["weight_decay"] == wd


def test_sync_batchnorm_options_and_conversion() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    nn.init.normal_(model[1].weight)
    converted = compat.parallel.convert_syncbn_model(model, channel_last=True)
    assert isinstance(converted[1], compat.parallel.SyncBatchNorm) and converted[1].channel_last
    torch.testing.assert_close(converted[1].weight, model[1].weight)
    bn = compat.parallel.SyncBatchNorm(4, fuse_relu=True, channel_last=True)
    x, z = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4)
    reference = torch.relu(nn.functional.batch_norm(x.movedim(-1, 1), None, None, training=True).movedim(1, -1) + z)
    torch.testing.assert_close(bn(x, z), reference)


def test_ddp_explains_apex_only_arguments_once_and_honours_the_reduction(gloo_group: None) -> None:
    distributed._warned.clear()
    message = "these Apex-only arguments are accepted and have no effect: num_allreduce_streams=2"
    with pytest.warns(UserWarning, match=re.escape(message)):
        ddp = compat.parallel.DistributedDataParallel(
            nn.Linear(3, 1), num_allreduce_streams=2, gradient_predivide_factor=4.0
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.parallel.DistributedDataParallel(nn.Linear(3, 1), num_allreduce_streams=2)  # explained already
    x = torch.randn(5, 3)
    ddp(x).sum().backward()
    reference = nn.Linear(3, 1)
    reference.load_state_dict(ddp.module.state_dict())
    reference(x).sum().backward()
    # world size 1: divide by 4 before the sum and by 1/4 after it gives the plain gradient back.
    torch.testing.assert_close(ddp.module.weight.grad, reference.weight.grad)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)


def test_one_table_of_apex_ddp_arguments() -> None:
    """The table the compat DDP and the codemod share covers Apex's signature (apex/parallel/distributed.py at
    e13873de, written out here) with Apex's defaults, and the compat class takes exactly those arguments."""
    from ampinit.compat.apex.parallel import _ddp_arguments as table

    apex_signature = {
        "message_size": 10000000,
        "delay_allreduce": False,
        "shared_param": None,
        "allreduce_trigger_params": None,
        "retain_allreduce_buffers": False,
        "allreduce_always_fp32": False,
        "num_allreduce_streams": 1,
        "allreduce_communicators": None,
        "gradient_average": True,
        "gradient_predivide_factor": 1.0,
        "gradient_average_split_factor": None,
        "prof": False,
    }
    assert {name: arg.default for name, arg in table.APEX_DDP_ARGUMENTS.items()} == apex_signature
    parameters = inspect.signature(distributed.DistributedDataParallel.__init__).parameters
    assert {n: p.default for n, p in parameters.items() if n not in ("self", "module")} == apex_signature
    assert table.DDP_RENAMED == {"delay_allreduce": "find_unused_parameters"}
    assert set(table.DDP_DROPPED_WITH_EFFECT) == {
        "gradient_average",
        "gradient_predivide_factor",
        "allreduce_always_fp32",
    }
    assert set(table.DDP_DROPPED_SILENTLY) == set(apex_signature) - set(table.DDP_RENAMED) - set(
        table.DDP_DROPPED_WITH_EFFECT
    )
    assert set(table.NO_EFFECT) == set(table.DDP_DROPPED_SILENTLY) - {"message_size"}


def test_convert_syncbn_model_keeps_the_dtype_of_a_half_batchnorm() -> None:
    """Apex's ``convert_syncbn_model`` sets ``mod.weight.data = module.weight.data.clone().detach()`` (and the
    same for the bias) and hands over the running statistics: the SyncBatchNorm has the BatchNorm's dtype. ampinit
    copied a half BatchNorm's weights into new float32 parameters while keeping its half running statistics, so
    the converted layer of a ``.half()`` model failed in its forward ("mixed dtype").

    Found by: the review of the Apex compatibility layer.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).half().eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 5, 5).half()
    expected = model(x)
    converted = convert_syncbn_model(model).eval()
    bn = converted[1]
    assert bn.weight.dtype == bn.bias.dtype == bn.running_mean.dtype == torch.float16
    assert torch.equal(converted(x), expected)


def test_ddp_disable_and_enable_allreduce(gloo_group: None) -> None:
    """Apex's ``DistributedDataParallel`` has ``disable_allreduce()`` and ``enable_allreduce()`` (they set
    ``self._disable_allreduce``, which its forward and its backward hooks check): gradient-accumulation loops
    call ``disable_allreduce()`` on the micro-batches that must not communicate. ampinit's class had neither
    method (AttributeError).

    One process shows the difference through Apex's reduction rule: with ``gradient_average=False`` and
    ``gradient_predivide_factor=2`` a reduced gradient is the local one divided by 2; a gradient that is not
    reduced is the local one.

    Found by: the review of the Apex compatibility layer.
    """
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ddp = DistributedDataParallel(model, gradient_average=False, gradient_predivide_factor=2.0)
    x = torch.randn(4, 3)
    local = torch.autograd.grad(model(x).sum(), model.weight)[0]

    ddp.disable_allreduce()
    ddp(x).sum().backward()
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, local)

    model.weight.grad = None
    ddp.enable_allreduce()
    ddp(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, local / 2)
