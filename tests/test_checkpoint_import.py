"""``ampinit.checkpoints``: Transformer Engine and Megatron-LM 16-bit-remainder checkpoints, and torch's plain AdamW
state, resumed in ampinit sessions.

The checkpoints are built here from the documented layouts (docs/precision.md), not with those libraries: the
remainder encoding below is written from Transformer Engine's kernel (``AdamFunctorMasterParamRemainder``: the
master's two int16 halves ``hi:lo``, the weight ``hi + 1`` where ``lo < 0``), and the step after loading is
checked against a plain fp32-master AdamW step written in this file.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit.checkpoints import from_megatron, from_transformer_engine

LR, WEIGHT_DECAY = 1e-2, 0.05
STEPS_BEFORE = 3


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns of ``x`` as non-negative int64."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def as_int16(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values read as int16."""
    return torch.where(values >= 2**15, values - 2**16, values).to(torch.int16)


def te_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer Engine's (bf16 param, int16 remainder) of an fp32 master, as its kernel writes them."""
    bits = bits_of(master)
    hi, lo = bits >> 16, bits & 0xFFFF
    lo_negative = lo >= 0x8000  # lo read as int16 is negative
    weight = as_int16((hi + lo_negative.to(torch.int64)) & 0xFFFF).view(torch.bfloat16)
    return weight, as_int16(lo)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def trained_fp32(seed: int) -> tuple[Mlp, torch.optim.AdamW, torch.Tensor, torch.Tensor]:
    """A few fp32 AdamW steps: the run whose fp32 state the foreign checkpoints hold; a few masters made ties."""
    torch.manual_seed(seed)
    net = Mlp()
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for _ in range(STEPS_BEFORE):
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        bits = net.fc1.weight.view(torch.int32).view(-1)
        bits[:6] = (bits[:6] & ~0xFFFF) | 0x8000  # exact ties, upper halves of either parity
    return net, optimizer, x, y


def te_checkpoint(net: Mlp, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What ``FusedAdam(master_weights=True, store_param_remainders=True)`` saves for this fp32 state."""
    model_state: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, (name, param) in enumerate(net.named_parameters()):
        weight, remainder = te_split(param.detach())
        model_state[name] = weight
        saved = optimizer.state[param]
        state[index] = {"exp_avg": saved["exp_avg"].clone(), "exp_avg_sq": saved["exp_avg_sq"].clone()}
        state[index]["master_param"] = remainder
    group = {"lr": LR, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": WEIGHT_DECAY}
    group |= {"step": STEPS_BEFORE, "params": list(range(len(state)))}
    return model_state, {"state": state, "param_groups": [group]}


def reference_step(
    net: Mlp, optimizer: torch.optim.Optimizer, weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """One step of fp32 masters (``net``'s fp32 parameters, ``optimizer``'s state) with grads of a bf16 model."""
    model = copy.deepcopy(net).bfloat16()
    with torch.no_grad():
        for p, weight in zip(model.parameters(), weights):
            p.copy_(weight)
    masters = [p.detach().clone().requires_grad_() for p in net.parameters()]
    stepper = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    stepper.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    for master, p in zip(masters, model.parameters()):
        assert p.grad is not None
        master.grad = p.grad.float()
    stepper.step()
    return [m.detach() for m in masters]


def resume_and_step(
    master_weights: bool | str,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer]:
    """Load into a fresh O5 session: (masters after loading, bf16 weights after loading, masters after a step)."""
    torch.manual_seed(99)  # a different initialisation: everything must come from the checkpoint
    net = Mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.5, weight_decay=0.0)
    net, optimizer = amp.initialize(net, optimizer, opt_level="O5", master_weights=master_weights, verbosity=0)
    session = ampinit.session_of(optimizer)
    assert session is not None
    try:
        net.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        # At master_weights=True master_for gives the live master, which the step below updates: copies.
        loaded = [m.detach().clone() if (m := session.master_for(p)) is not None else None for p in net.parameters()]
        weights = [p.detach().clone() for p in net.parameters()]
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(nn.functional.mse_loss(net(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        stepped = [session.master_for(p) for p in net.parameters()]
        assert all(m is not None for m in loaded + stepped)
        return [m for m in loaded if m is not None], weights, [m for m in stepped if m is not None], optimizer
    finally:
        session.close()


# -- the encoding -----------------------------------------------------------------------------------------------
HIGH = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x7FC0, 0x7FFF, 0x8000, 0x8001, 0xBF80]
HIGH += [0xFF7F, 0xFF80, 0xFFFF]
LOW = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]


def test_te_remainders_give_every_fp32_master_bit_for_bit() -> None:
    """Zeros, subnormals, ties of either parity, the largest finite values, infinities and NaNs (whose weight
    wraps to -0.0 in TE's encoding): the rebuilt master is the one TE split."""
    bits = torch.tensor([(h << 16) | lo for h in HIGH for lo in LOW], dtype=torch.int64)
    masters = from_bits(bits)
    weight, remainder = te_split(masters)
    optimizer_state = {"state": {0: {"master_param": remainder}}, "param_groups": [{"params": [0]}]}
    optimizer_state["state"][0] |= {"exp_avg": torch.zeros(len(bits)), "exp_avg_sq": torch.zeros(len(bits))}
    optimizer_state["param_groups"][0]["step"] = 1
    model_state, _ = from_transformer_engine({"w": weight}, optimizer_state, ["w"])
    assert torch.equal(bits_of(model_state["w"]), bits)


# -- Transformer Engine into a session ----------------------------------------------------------------------------
@pytest.mark.parametrize("master_weights", ["remainder", True])
def test_te_checkpoint_resumes_exactly_and_steps_like_fp32_masters(master_weights: bool | str) -> None:
    net, fp32_optimizer, x, y = trained_fp32(0)
    te_model, te_optim = te_checkpoint(net, fp32_optimizer)
    model_state, optimizer_state = from_transformer_engine(te_model, te_optim, [n for n, _ in net.named_parameters()])

    loaded, weights, stepped, optimizer = resume_and_step(master_weights, model_state, optimizer_state, x, y)
    for got, want in zip(loaded, net.parameters()):
        assert same_bits(got, want.detach())
    if master_weights == "remainder":
        # ampinit's remainder weights round as TE does (ties away from zero): the same bf16 weights.
        for got, want in zip(weights, te_model.values()):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for got, want in zip(stepped, reference_step(net, fp32_optimizer, weights, x, y)):
        assert same_bits(got, want)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (LR, WEIGHT_DECAY)


def test_te_fp32_masters_and_absent_masters_are_taken_as_they_are() -> None:
    """``store_param_remainders=False`` saves fp32 masters; ``master_weights=False`` none (the weight is all)."""
    net, fp32_optimizer, _, _ = trained_fp32(1)
    te_model, te_optim = te_checkpoint(net, fp32_optimizer)
    names = [n for n, _ in net.named_parameters()]
    te_optim["state"][0]["master_param"] = net.fc1.weight.detach().clone()
    del te_optim["state"][1]["master_param"]
    model_state, optimizer_state = from_transformer_engine(te_model, te_optim, names)
    assert same_bits(model_state["fc1.weight"], net.fc1.weight.detach())
    assert same_bits(model_state["fc1.bias"], te_model["fc1.bias"].float())
    assert same_bits(model_state["fc2.weight"], net.fc2.weight.detach())
    for index, p in enumerate(net.parameters()):
        assert torch.equal(optimizer_state["state"][index]["exp_avg_sq"], fp32_optimizer.state[p]["exp_avg_sq"])
        assert torch.equal(optimizer_state["state"][index]["step"], fp32_optimizer.state[p]["step"])


def test_te_param_names_can_come_from_named_param_groups() -> None:
    net, fp32_optimizer, _, _ = trained_fp32(2)
    te_model, te_optim = te_checkpoint(net, fp32_optimizer)
    te_optim["param_groups"][0]["param_names"] = list(te_model)
    model_state, _ = from_transformer_engine(te_model, te_optim)
    for name, p in net.named_parameters():
        assert same_bits(model_state[name], p.detach())


# -- Megatron-LM ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["int16", "dp_zero-float", "fp32-masters"])
def test_megatron_state_converts_like_its_te_state(layout: str) -> None:
    """Per-parameter state gathered flat: int16 remainders under ``fp32_param``, the ``dp_zero`` format's
    float-valued remainders under ``param``, or real fp32 masters (``store_param_remainders=False``)."""
    net, fp32_optimizer, x, y = trained_fp32(3)
    te_model, te_optim = te_checkpoint(net, fp32_optimizer)
    names = list(te_model)
    param_state: dict[str, dict[str, torch.Tensor]] = {}
    for index, (name, p) in enumerate(net.named_parameters()):
        saved = te_optim["state"][index]
        master = {
            "int16": saved["master_param"],
            "dp_zero-float": saved["master_param"].float(),
            "fp32-masters": p.detach().clone(),
        }[layout]
        key = "fp32_param" if layout == "int16" else "param"
        param_state[name] = {key: master.flatten(), "exp_avg": saved["exp_avg"].flatten()}
        param_state[name]["exp_avg_sq"] = saved["exp_avg_sq"].flatten()
    groups = [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": WEIGHT_DECAY, "params": [0, 1, 2, 3]}]
    model_state, optimizer_state = from_megatron(
        te_model,
        param_state,
        step=STEPS_BEFORE,
        param_groups=groups,
        param_names=names,
        remainders=layout != "fp32-masters",
    )
    _, weights, stepped, _ = resume_and_step("remainder", model_state, optimizer_state, x, y)
    for name, p in net.named_parameters():
        assert same_bits(model_state[name], p.detach())
    for got, want in zip(stepped, reference_step(net, fp32_optimizer, weights, x, y)):
        assert same_bits(got, want)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_megatron_decoupled_weight_decay_is_passed_on_not_forced(adam_w_mode: bool) -> None:
    """Megatron gives its ``decoupled_weight_decay`` to FusedAdam as ``adam_w_mode`` and does not save it."""
    model, optim, names = _te()
    param_state = {name: {k: v for k, v in optim["state"][i].items()} for i, name in enumerate(names)}
    for entry in param_state.values():
        entry["param"] = entry.pop("master_param")
    groups = [{"params": [0, 1, 2, 3], "lr": LR, "weight_decay": WEIGHT_DECAY}]
    groups[0]["decoupled_weight_decay"] = not adam_w_mode  # the torch groups' own value does not decide
    _, optimizer_state = from_megatron(
        model, param_state, step=1, param_groups=groups, param_names=names, remainders=True, adam_w_mode=adam_w_mode
    )
    assert optimizer_state["param_groups"][0]["decoupled_weight_decay"] is adam_w_mode
    _, default = from_megatron(model, param_state, step=1, param_groups=groups, param_names=names, remainders=True)
    assert default["param_groups"][0]["decoupled_weight_decay"] is True  # Megatron's default


# -- torch's plain AdamW ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("master_weights", ["remainder", True])
def test_plain_adamw_state_resumes_without_conversion(master_weights: bool | str) -> None:
    net, fp32_optimizer, x, y = trained_fp32(4)
    loaded, weights, stepped, _ = resume_and_step(
        master_weights, net.state_dict(), copy.deepcopy(fp32_optimizer.state_dict()), x, y
    )
    for got, want in zip(loaded, net.parameters()):
        assert same_bits(got, want.detach())
    for got, want in zip(stepped, reference_step(net, fp32_optimizer, weights, x, y)):
        assert same_bits(got, want)


# -- errors ------------------------------------------------------------------------------------------------------------
def _te() -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    net, fp32_optimizer, _, _ = trained_fp32(5)
    te_model, te_optim = te_checkpoint(net, fp32_optimizer)
    return te_model, te_optim, list(te_model)


def _break(case: str, model: dict[str, torch.Tensor], optim: dict[str, Any], names: list[str]) -> list[str]:
    state = optim["state"]
    if case == "names-missing":
        return names[:-1]
    if case == "name-unknown":
        return [*names[:-1], "fc3.bias"]
    if case == "remainder-shape":
        state[0]["master_param"] = state[0]["master_param"][:-1]
    elif case == "remainder-dtype":
        state[0]["master_param"] = state[0]["master_param"].to(torch.int32)
    elif case == "remainder-of-fp32-weight":
        model["fc1.weight"] = model["fc1.weight"].float()
    elif case == "moment-missing":
        del state[1]["exp_avg_sq"]
    elif case == "moment-dtype":
        state[1]["exp_avg"] = state[1]["exp_avg"].bfloat16()
    elif case == "no-step":
        del optim["param_groups"][0]["step"]
    elif case == "no-bias-correction":
        optim["param_groups"][0]["bias_correction"] = False
    elif case == "no-state":
        del optim["state"]
    return names


ERRORS = {
    "names-missing": "param_names has 3 names but the optimizer state's param groups hold 4 parameters",
    "name-unknown": "param_names[3] is 'fc3.bias', which is not a key of model_state",
    "remainder-shape": "optimizer_state['state'][0] (model key 'fc1.weight')['master_param'] has shape (31, 8), "
    "its parameter (32, 8)",
    "remainder-dtype": "['master_param'] is torch.int32: expected int16 remainders or an fp32 master",
    "remainder-of-fp32-weight": "holds int16 remainders but its parameter is torch.float32",
    "moment-missing": "optimizer_state['state'][1] (model key 'fc1.bias') has no tensor 'exp_avg_sq'",
    "moment-dtype": "['exp_avg'] is torch.bfloat16: FusedAdam's state_dict() saves its moments in float32",
    "no-step": "has state but its param group's 'step' is None",
    "no-bias-correction": "param_groups[0] has bias_correction=False",
    "no-state": "optimizer_state has no 'state'",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_te_checkpoints_that_do_not_fit_are_named(case: str) -> None:
    model, optim, names = _te()
    names = _break(case, model, optim, names)
    with pytest.raises(ValueError, match=re.escape(ERRORS[case])):
        from_transformer_engine(model, optim, names)


def test_te_without_param_names_asks_for_them() -> None:
    model, optim, _ = _te()
    with pytest.raises(ValueError, match=re.escape("param_names is needed")):
        from_transformer_engine(model, optim)
    with pytest.raises(TypeError, match=re.escape("optimizer_state must be a mapping (a state_dict), got list")):
        from_transformer_engine(model, [optim])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.full((32, 8), 0.25), "holds 0.25, which is no int16 remainder"),
        (torch.full((32, 8), 40000.0), "holds 40000.0, which is no int16 remainder"),
        (torch.zeros(7), "has shape (7,): expected its parameter's (32, 8) or 256 elements flat"),
    ],
)
def test_megatron_values_that_are_no_remainders_are_named(value: torch.Tensor, message: str) -> None:
    model, optim, names = _te()
    param_state = {name: {k: v for k, v in optim["state"][i].items()} for i, name in enumerate(names)}
    for entry in param_state.values():
        entry["param"] = entry.pop("master_param")
    param_state["fc1.weight"]["param"] = value
    with pytest.raises(ValueError, match=re.escape(f"param_state['fc1.weight']['param'] {message}")):
        from_megatron(
            model, param_state, step=1, param_groups=[{"params": [0, 1, 2, 3]}], param_names=names, remainders=True
        )
