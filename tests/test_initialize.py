"""initialize(): return shapes, argument errors, sessions, and complete undo."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests.conftest import SmallNet, make_problem

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_public_surface_is_pinned() -> None:
    assert sorted(ampinit.__all__) == sorted(
        [
            "AmpSession",
            "AmpStats",
            "DynamicLossScale",
            "LossScaleAtMinimumError",
            "OptLevel",
            "Properties",
            "StuckReport",
            "__version__",
            "clip_grad_norm_",
            "current_session",
            "deinitialize",
            "disable_casts",
            "float_function",
            "half_function",
            "initialize",
            "load_state_dict",
            "master_params",
            "promote_function",
            "register_float_function",
            "register_half_function",
            "register_promote_function",
            "scale_loss",
            "session_of",
            "state_dict",
            "stats",
            "step_was_skipped",
        ]
    )
    for name in amp.__all__:
        assert getattr(amp, name) is getattr(ampinit, name)


class TestReturnShape:
    """Apex's contract: what goes in as a single object or a list comes back the same way."""

    def test_model_only(self) -> None:
        model = SmallNet()
        assert amp.initialize(model, opt_level="O2", verbosity=0) is model
        amp.deinitialize()

    def test_model_and_optimizer(self) -> None:
        model = SmallNet()
        opt = sgd(model)
        assert amp.initialize(model, opt, opt_level="O2", verbosity=0) == (model, opt)
        amp.deinitialize()

    def test_lists(self) -> None:
        a, b = SmallNet(), SmallNet()
        oa, ob = sgd(a), sgd(b)
        models, opts = amp.initialize([a, b], [oa, ob], opt_level="O1", verbosity=0)
        assert models == [a, b] and opts == [oa, ob]
        amp.deinitialize()

    def test_model_list_single_optimizer(self) -> None:
        a, b = SmallNet(), SmallNet()
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        models, out_opt = amp.initialize([a, b], opt, opt_level="O0", verbosity=0)
        assert models == [a, b] and out_opt is opt
        amp.deinitialize()

    def test_single_model_optimizer_list(self) -> None:
        model = SmallNet()
        opt = sgd(model)
        out_model, opts = amp.initialize(model, [opt], opt_level="O0", verbosity=0)
        assert out_model is model and opts == [opt]
        amp.deinitialize()

    def test_model_list_without_optimizers(self) -> None:
        a, b = SmallNet(), SmallNet()
        assert amp.initialize([a, b], opt_level="O3", verbosity=0) == [a, b]
        amp.deinitialize()


class TestErrors:
    def test_scale_loss_before_initialize(self) -> None:
        model = SmallNet()
        with pytest.raises(RuntimeError, match=re.escape("internal Amp state has not been initialized")):
            with amp.scale_loss(model(torch.randn(4, 8)).sum(), sgd(model)):
                pass

    @pytest.mark.parametrize("wrapper", [nn.DataParallel])
    def test_parallel_wrapper_is_refused(self, wrapper: type) -> None:
        wrapped = wrapper(SmallNet())
        with pytest.raises(
            RuntimeError, match=re.escape("Parallel wrappers should only be applied to the model(s) AFTER")
        ):
            amp.initialize(wrapped, opt_level="O1", verbosity=0)

    def test_same_optimizer_twice(self) -> None:
        model = SmallNet()
        opt = sgd(model)
        with pytest.raises(
            RuntimeError,
            match=re.escape("A given optimizer should only be passed through amp.initialize once."),
        ):
            amp.initialize(model, [opt, opt], opt_level="O1", verbosity=0)

    def test_bad_types(self) -> None:
        with pytest.raises(TypeError, match=re.escape("models must be either a single model or a list of models.")):
            amp.initialize("model", opt_level="O1")
        with pytest.raises(
            TypeError,
            match=re.escape("optimizers must be either a single optimizer or a list of optimizers."),
        ):
            amp.initialize(SmallNet(), "opt", opt_level="O1")

    @pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
    def test_fp16_model_is_refused_unless_allowed(self, level: str) -> None:
        # Apex refused a param or buffer whose type names 'Half' (fp16), unless allow_incoming_model_not_fp32.
        model = SmallNet()
        model.bn.half()
        with pytest.raises(RuntimeError, match=re.escape("you do not need to call .half() on your model")):
            amp.initialize(model, opt_level=level, verbosity=0)
        assert model.fc1.weight.dtype == torch.float32 and ampinit.current_session() is None

    def test_non_float_optimizer_params_are_refused(self) -> None:
        model = SmallNet()
        opt = torch.optim.SGD([torch.zeros(3, dtype=torch.float64, requires_grad=True)], lr=0.1)
        with pytest.raises(TypeError, match=re.escape("Received torch.DoubleTensor")):
            amp.initialize(model, opt, opt_level="O2", verbosity=0)

    def test_cpu_params_are_fine(self) -> None:
        # Apex refused non-CUDA parameters; here O2 on CPU casts the model and keeps CPU fp32 masters that are
        # exactly the weights it was given.
        model = SmallNet()
        original = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt = sgd(model)
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
        try:
            for name, param in model.named_parameters():
                assert param.device.type == "cpu"
                assert param.dtype == (torch.float32 if name.startswith("bn.") else torch.float16), name
            masters = list(amp.master_params(opt))
            assert len(masters) == len(original)
            for master, expected in zip(masters, original.values()):
                assert master.device.type == "cpu" and master.dtype == torch.float32
                assert torch.equal(master, expected)
        finally:
            amp.deinitialize()

    @pytest.mark.parametrize(("bad", "meant"), [("o2", "O2"), ("02", "O2"), (" O5", "O5"), ("o0", "O0")])
    def test_near_miss_level_gets_a_suggestion(self, bad: str, meant: str) -> None:
        with pytest.raises(RuntimeError, match=re.escape(f"Did you mean {meant!r}?")):
            amp.initialize(SmallNet(), opt_level=bad, verbosity=0)

    def test_unknown_level_without_a_near_miss_gets_no_suggestion(self) -> None:
        with pytest.raises(RuntimeError, match="Unexpected optimization level O9") as info:
            amp.initialize(SmallNet(), opt_level="O9", verbosity=0)
        assert "Did you mean" not in str(info.value)

    def test_swapped_arguments_name_what_was_received(self) -> None:
        model = SmallNet()
        opt = sgd(model)
        with pytest.raises(TypeError) as info:
            amp.initialize(opt, model, opt_level="O1", verbosity=0)  # type: ignore[arg-type]
        message = str(info.value)
        assert "models must be either a single model or a list of models. Received torch.optim.sgd.SGD" in message
        assert "are the arguments swapped?" in message
        with pytest.raises(TypeError, match=re.escape("Received builtins.str in the list")):
            amp.initialize([model, "model"], opt_level="O1", verbosity=0)

    def test_scale_loss_message_has_matching_quotes(self) -> None:
        model = SmallNet()
        with pytest.raises(RuntimeError) as info:
            with amp.scale_loss(model(torch.randn(4, 8)).sum(), sgd(model)):
                pass
        message = str(info.value)
        assert message.startswith("Invoked `with amp.scale_loss`, but internal Amp state has not been initialized.")
        assert message.count("`") % 2 == 0 and "'" not in message

    def test_loss_id_out_of_range(self) -> None:
        model, x, _ = make_problem()
        opt = sgd(model)
        amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
        with (
            pytest.raises(
                IndexError,
                match=re.escape("loss_id=2 is out of range: initialize() was called with num_losses=2"),
            ),
            amp.scale_loss(model(x).float().sum(), opt, loss_id=2),
        ):
            pass
        amp.deinitialize()

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True])
    def test_bad_num_losses(self, bad: object) -> None:
        with pytest.raises(ValueError, match=re.escape(f"num_losses must be an int >= 1, got {bad!r}")):
            amp.initialize(SmallNet(), num_losses=bad)  # type: ignore[arg-type]

    def test_dynamic_config_with_initialize_bounds_is_ambiguous(self) -> None:
        with pytest.raises(ValueError, match="set min_scale and max_scale on the DynamicLossScale"):
            amp.initialize(SmallNet(), opt_level="O2", loss_scale=ampinit.DynamicLossScale(), min_loss_scale=1.0)

    def test_model_in_live_session_is_refused(self) -> None:
        model = SmallNet()
        amp.initialize(model, opt_level="O2", verbosity=0)
        with pytest.raises(RuntimeError, match="already belongs to a live amp session"):
            amp.initialize(model, opt_level="O2", verbosity=0)
        amp.deinitialize()
        amp.initialize(model, opt_level="O2", verbosity=0)  # fine once the first session is closed
        amp.deinitialize()

    def test_optimizer_not_passed_to_initialize(self) -> None:
        model, x, _ = make_problem()
        amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
        stranger = sgd(model)
        with pytest.raises(RuntimeError, match=re.escape("was not passed to amp.initialize")):
            with amp.scale_loss(model(x).sum(), stranger):
                pass
        amp.deinitialize()

    def test_closure_on_skipped_step(self) -> None:
        model, x, y = make_problem()
        opt = sgd(model)
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
        with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
            model.fc1.weight.grad[0, 0] = float("inf")
        with pytest.raises(
            RuntimeError, match=re.escape("Currently, Amp does not support closure use with optimizers.")
        ):
            opt.step(lambda: 0.0)
        amp.deinitialize()

    def test_failed_initialize_changes_nothing(self) -> None:
        # The second model is half: the check fails before anything is applied to the first.
        good, bad = SmallNet(), SmallNet().half()
        opt = sgd(good)
        before = {k: v.clone() for k, v in good.state_dict().items()}
        with pytest.raises(RuntimeError):
            amp.initialize([good, bad], opt, opt_level="O2", verbosity=0)
        assert all(p.dtype == torch.float32 for p in good.parameters())
        assert not good._forward_pre_hooks and "step" not in vars(opt)
        for k, v in good.state_dict().items():
            assert torch.equal(v, before[k])
        assert ampinit.current_session() is None


@pytest.mark.parametrize("level", LEVELS)
def test_close_restores_everything(level: str) -> None:
    model, x, y = make_problem()
    opt = sgd(model)  # momentum state exercises the state hand-over; Adam's eps underflows in pure fp16 (O3)
    params_before = list(model.parameters())
    hooks_before = (dict(model._forward_pre_hooks), dict(model._forward_hooks), dict(model._state_dict_hooks))
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    session = ampinit.current_session()
    assert session is not None
    session.close()
    session.close()  # idempotent
    assert ampinit.current_session() is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    assert (
        dict(model._forward_pre_hooks),
        dict(model._forward_hooks),
        dict(model._state_dict_hooks),
    ) == hooks_before
    assert not {"step", "zero_grad", "add_param_group"} & set(vars(opt))
    assert list(opt.param_groups[0]["params"]) == params_before  # masters handed back
    assert all(p in opt.state for p in params_before)
    assert not torch.is_autocast_enabled("cpu")
    # No precision is lost: the fp32 weights equal what the session's model.state_dict() reported.
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    # The optimizer still trains the restored model in plain fp32.
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()


def test_sessions_on_distinct_models_coexist() -> None:
    a, x, y = make_problem(0)
    b, _, _ = make_problem(1)
    oa, ob = sgd(a), sgd(b)
    amp.initialize(a, oa, opt_level="O2", verbosity=0)
    first = ampinit.current_session()
    amp.initialize(b, ob, opt_level="O3", loss_scale=128.0, verbosity=0)
    second = ampinit.current_session()
    assert first is not None and second is not None and first is not second
    assert ampinit.session_of(oa) is first and ampinit.session_of(b) is second
    for model, opt in ((a, oa), (b, ob)):
        with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0  # module-level: the most recent session
    assert first.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
    second.close()
    assert ampinit.current_session() is first
    first.close()


def test_disabled_is_a_passthrough() -> None:
    model, x, y = make_problem()
    opt = sgd(model)
    out = amp.initialize(model, opt, enabled=False, opt_level="O2")
    assert out == (model, opt)
    loss = (model(x) - y).pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert amp.state_dict() == {}
    amp.deinitialize()


def test_session_as_context_manager() -> None:
    model = SmallNet()
    amp.initialize(model, opt_level="O4", verbosity=0)
    session = ampinit.current_session()
    assert session is not None and torch.is_autocast_enabled("cpu")
    with session:
        pass
    assert session.closed and not torch.is_autocast_enabled("cpu")


def test_option_table_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="ampinit"):
        amp.initialize(SmallNet(), opt_level="O2", loss_scale="128.0")
    text = caplog.text
    assert "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights." in text
    assert re.search(r"loss_scale\s+: 128.0", text)
    amp.deinitialize()
    caplog.clear()
    with caplog.at_level("INFO", logger="ampinit"):
        amp.initialize(SmallNet(), opt_level="O2", verbosity=0)
    assert caplog.text == ""
    amp.deinitialize()


def test_ddp_wrapped_model_is_refused() -> None:
    # A DDP instance needs a process group to construct; the refusal only looks at the type, so a bare
    # instance is enough to pin the message.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Incoming model is an instance of <class 'torch.nn.parallel.distributed.DistributedDataParallel'>. "
            "Parallel wrappers should only be applied to the model(s) AFTER \n"
            "the model(s) have been returned from amp.initialize."
        ),
    ):
        amp.initialize(ddp, opt_level="O2", verbosity=0)


def test_close_refused_in_another_thread_can_be_retried_from_the_initializing_thread() -> None:
    """``close()`` from a thread other than the one that called ``initialize`` raises, and its message says to
    close from the initializing thread. Doing so must then restore everything (docs/api.md: ``close()`` undoes
    everything, autocast state restored).

    Got: the refused ``close()`` had already marked the session closed and undone the rest (hooks, optimizer
    methods), so the retry was a no-op; the initializing thread stayed in autocast with the policy in force and
    the extra autocast kernels stayed registered in the process for good.

    Found by: the review of the O1/O4 cast policy.
    """
    from ampinit._casting import kernels, scopes

    autocast_before = torch.is_autocast_enabled("cpu")
    kernels_before = kernels.KERNELS.registered()
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    session = amp.current_session()
    assert session is not None
    errors: list[BaseException] = []

    def close_elsewhere() -> None:
        try:
            session.close()
        except RuntimeError as err:
            errors.append(err)

    try:
        thread = threading.Thread(target=close_elsewhere)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "thread that called initialize()" in str(errors[0])
    finally:
        session.close()  # the retry the message asks for
    assert torch.is_autocast_enabled("cpu") == autocast_before
    assert not scopes.thread_scopes()
    assert kernels.KERNELS.registered() == kernels_before
    assert torch.mm(g(2, 2), g(2, 2)).dtype == torch.float32
