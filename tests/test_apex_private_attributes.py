"""Apex-private attributes that public training code touches, run as that code runs: unchanged under the Apex
aliases (what ``ampinit run`` installs) and after ``ampinit migrate --to ampinit``. Each script below is written
the way Apex-era projects wrote it (fairseq's FusedAdamV2, the master-weights checkpoint recipe of NVIDIA's and
fairseq's trainers, Megatron-style loss-scaler tuning); the expected values come from Apex's code, written out
in the tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ampinit.compat.apex as compat_apex
from ampinit.migrate import migrate_source

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def aliases() -> Iterator[None]:
    compat_apex.install()
    try:
        yield
    finally:
        compat_apex.uninstall()


def run_script(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "legacy_script"}
    exec(compile(source, "legacy_script.py", "exec"), namespace)
    return namespace


def migrated(source: str) -> str:
    result = migrate_source(source, "ampinit")
    assert not re.search(r"^\s*(from|import) (apex|amp_C)\b", result.migrated, re.MULTILINE), result.migrated
    return result.migrated


# -- a loss scaler's _scale_seq_len, _overflow_buf and update_scale() --------------------------------------------
SCALER_SCRIPT = """
import torch
from apex import amp

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
amp._amp_state.loss_scalers[0]._scale_seq_len = 10
SCALES = []
for _ in range(10):
    loss = model(torch.randn(8, 4)).float().mean() * 1e-3  # small: no fp16 overflow at the default scale
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    SCALES.append(amp._amp_state.loss_scalers[0].loss_scale())
scaler = amp._amp_state.loss_scalers[0]
SEQ_LEN = scaler._scale_seq_len
scaler.clear_overflow_state()
scaler._overflow_buf.fill_(1.)
SKIP = scaler.update_scale()
AFTER = (scaler.loss_scale(), scaler._unskipped)
"""


def check_scaler_script(namespace: dict[str, Any]) -> None:
    # Apex: the scale doubles when _unskipped reaches _scale_seq_len (10 clean unscale steps), not before.
    assert namespace["SCALES"] == [2.0**16] * 9 + [2.0**17]
    assert namespace["SEQ_LEN"] == 10
    # Apex's update_scale reads the raised flag, halves the scale, resets the count and asks for a skip.
    assert namespace["SKIP"] is True and namespace["AFTER"] == (2.0**16, 0)


@pytest.mark.usefixtures("aliases", "session_cleanup")
def test_loss_scaler_fields_under_the_aliases() -> None:
    check_scaler_script(run_script(SCALER_SCRIPT))


@pytest.mark.usefixtures("session_cleanup")
def test_loss_scaler_fields_after_migration() -> None:
    check_scaler_script(run_script(migrated(SCALER_SCRIPT)))


def test_loss_scaler_fields_under_ampinit_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCALER_SCRIPT + "print(SCALES[-2:], SEQ_LEN, SKIP, AFTER)\n")
    result = subprocess.run(
        [sys.executable, "-m", "ampinit", "run", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[65536.0, 131072.0] 10 True (65536.0, 0)"


# -- BERT's allreduce_post_accumulation step: its own flag as _overflow_buf, update_scale() by hand ----------------
# NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/run_pretraining.py, take_optimizer_step(): the blocks
# use delay_overflow_check=True (Apex then decides nothing), the script checks the allreduced grads with amp_C into
# its own int32 buffer, assigns it as the scaler's _overflow_buf and calls update_scale(), then steps only if clean.
BERT_SCRIPT = """
import torch
import amp_C
from apex import amp
from apex.amp import _amp_state

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", verbosity=0)
_amp_state.loss_scalers[0]._scale_seq_len = 3
overflow_buf = torch.IntTensor([0])
gen = torch.Generator().manual_seed(1)
SCALES, SKIPS = [], []
for i in range(8):
    x = torch.randn(8, 4, generator=gen)
    if i == 4:
        x[0, 0] = float("inf")  # an overflow
    loss = model(x).float().pow(2).mean() * 1e-3
    with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
        scaled_loss.backward()
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    overflow_buf.zero_()
    amp_C.multi_tensor_scale(65536, overflow_buf, [master_grads, master_grads], 1.0)
    scaler = _amp_state.loss_scalers[0]
    old_overflow_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overfloat_buf = old_overflow_buf  # (sic), as in the original
    if had_overflow == 0:
        optimizer.step()
    else:
        for param in optimizer._amp_stash.all_fp32_from_fp16_params:
            param.grad = None
    for param in model.parameters():
        param.grad = None
    SKIPS.append(bool(had_overflow))
    SCALES.append(_amp_state.loss_scalers[0].loss_scale())
WEIGHT = [p.detach().float().clone() for p in model.parameters()]
"""


def check_bert_script(namespace: dict[str, Any]) -> None:
    # Apex: one update_scale() per iteration, the script's buffer deciding: doubles after 3 clean calls, halves at
    # the overflow, and the step after the skipped one is taken.
    assert namespace["SKIPS"] == [False] * 4 + [True] + [False] * 3
    assert namespace["SCALES"] == [2.0**16, 2.0**16, 2.0**17, 2.0**17, 2.0**16, 2.0**16, 2.0**16, 2.0**17]
    # The same weights as fp32 SGD over the batches that were stepped.
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for i in range(8):
        x = torch.randn(8, 4, generator=gen)
        if i == 4:
            continue
        optimizer.zero_grad()
        (reference(x).pow(2).mean() * 1e-3).backward()
        optimizer.step()
    for ours, theirs in zip(namespace["WEIGHT"], reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=2e-3)


@pytest.mark.usefixtures("aliases", "session_cleanup")
def test_bert_overflow_buf_and_update_scale_under_the_aliases() -> None:
    check_bert_script(run_script(BERT_SCRIPT))


@pytest.mark.usefixtures("session_cleanup")
def test_bert_overflow_buf_and_update_scale_after_migration() -> None:
    check_bert_script(run_script(migrated(BERT_SCRIPT)))


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_update_scale_by_hand_after_deferred_blocks_of_a_static_scale(skip_nonfinite: bool) -> None:
    # A static scale: the hand-made decision of deferred blocks skips a non-finite step where the session skips
    # them (ampinit's default), and leaves it to the step as Apex did with skip_nonfinite=False (Apex: a static
    # scale's update_scale() never skips, and its step took the inf).
    from ampinit import amp
    from ampinit.compat.apex.amp import _amp_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0, skip_nonfinite=skip_nonfinite, verbosity=0)
    try:
        with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), optimizer, delay_overflow_check=True) as scaled:
            scaled.backward()
            model.weight.grad[0, 0] = float("inf")
        assert _amp_state.loss_scalers[0].update_scale() is False  # Apex: a static scale never asks for a skip
        optimizer.step()
        assert amp.step_was_skipped(optimizer) is skip_nonfinite
        assert bool(torch.isfinite(model.weight).all()) is skip_nonfinite
        assert _amp_state.loss_scalers[0].loss_scale() == 128.0
    finally:
        amp.deinitialize()


# -- optimizer._amp_stash and optimizer._lazy_init_maybe_master_weights() ----------------------------------------
STASH_SCRIPT = """
import torch
from apex import amp


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level="O2", verbosity=0)


def train(model, optimizer, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(16, 4, generator=gen)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


model, optimizer = build()
STASH = optimizer._amp_stash
LAZY_INIT_CALLED = STASH.lazy_init_called
train(model, optimizer, 3, seed=1)
checkpoint = {
    "model": model.state_dict(),
    "optimizer": optimizer.state_dict(),
    "amp": amp.state_dict(),
    "master params": [p.detach().clone() for p in amp.master_params(optimizer)],
}
FIRST = (model, optimizer)

# Gradient accumulation: scaled grads are pending after a delay_unscale block, and not after the last block.
loss = model(torch.randn(16, 4)).float().pow(2).mean()
with amp.scale_loss(loss, optimizer, delay_unscale=True) as scaled_loss:
    scaled_loss.backward()
SCALED_AFTER_DELAY = STASH.params_have_scaled_gradients
loss = model(torch.randn(16, 4)).float().pow(2).mean()
with amp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
SCALED_AFTER_LAST = STASH.params_have_scaled_gradients
optimizer.zero_grad()

# An overflow: the next step is patched to be skipped, and the skip is one-shot.
before = [p.detach().clone() for p in model.parameters()]
loss = model(torch.randn(16, 4)).float().pow(2).mean() * float("inf")
with amp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
PATCHED_AFTER_OVERFLOW = STASH.already_patched
optimizer.step()
PATCHED_AFTER_STEP = STASH.already_patched
UNCHANGED_BY_SKIP = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

# The resume recipe of Apex-era trainers, on a fresh model and optimizer.
model, optimizer = build()
optimizer._lazy_init_maybe_master_weights()
optimizer._amp_stash.lazy_init_called = True
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
amp.load_state_dict(checkpoint["amp"])
for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"]):
    param.data.copy_(saved_param.data)
train(model, optimizer, 3, seed=2)
RESUMED = [p.detach().clone() for p in model.parameters()]
"""

# The uninterrupted reference for the resume: the same script without the interruption.
UNINTERRUPTED_SCRIPT = STASH_SCRIPT[: STASH_SCRIPT.index("FIRST = ")] + (
    "train(model, optimizer, 3, seed=2)\nUNINTERRUPTED = [p.detach().clone() for p in model.parameters()]\n"
)


def check_stash_script(namespace: dict[str, Any], uninterrupted: list[torch.Tensor]) -> None:
    stash = namespace["STASH"]
    model, optimizer = namespace["FIRST"]
    linear1, bn, linear2 = model
    half = [linear1.weight, linear1.bias, linear2.weight, linear2.bias]
    # Apex's lists with master weights: the half params, their fp32 masters in the same order, and the params the
    # optimizer updates directly (O2 keeps batchnorm in fp32), per group and flattened.
    assert namespace["LAZY_INIT_CALLED"] is True
    assert [id(p) for p in stash.all_fp16_params] == [id(p) for p in half]
    assert all(p.dtype == torch.float16 for p in stash.all_fp16_params)
    masters = stash.all_fp32_from_fp16_params
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == 4
    for master, model_param in zip(masters, half):
        assert torch.equal(master.detach().half(), model_param.detach())  # the model holds the rounded master
    assert {id(p) for p in masters} <= {id(p) for p in optimizer.param_groups[0]["params"]}
    assert [id(p) for p in stash.all_fp32_from_fp32_params] == [id(bn.weight), id(bn.bias)]
    assert len(stash.fp16_groups) == len(stash.fp32_from_fp16_groups) == len(stash.fp32_from_fp32_groups) == 1
    assert namespace["SCALED_AFTER_DELAY"] is True and namespace["SCALED_AFTER_LAST"] is False
    assert namespace["PATCHED_AFTER_OVERFLOW"] is True and namespace["PATCHED_AFTER_STEP"] is False
    assert namespace["UNCHANGED_BY_SKIP"] is True
    # Resuming from the checkpoint trains exactly as the uninterrupted run.
    for resumed, reference in zip(namespace["RESUMED"], uninterrupted):
        torch.testing.assert_close(resumed, reference, rtol=0, atol=0)


@pytest.mark.usefixtures("aliases", "session_cleanup")
def test_amp_stash_and_lazy_init_under_the_aliases() -> None:
    uninterrupted = run_script(UNINTERRUPTED_SCRIPT)["UNINTERRUPTED"]
    check_stash_script(run_script(STASH_SCRIPT), uninterrupted)


@pytest.mark.usefixtures("session_cleanup")
def test_amp_stash_and_lazy_init_after_migrate() -> None:
    """A file that reads the stash keeps amp on the Apex layer, which attaches it: it runs as it did with Apex."""
    uninterrupted = run_script(migrated(UNINTERRUPTED_SCRIPT))["UNINTERRUPTED"]
    result = migrate_source(STASH_SCRIPT, "ampinit")
    assert "from ampinit.compat.apex import amp" in result.migrated, result.migrated
    assert not result.needs_human, [site.message for site in result.needs_human]
    check_stash_script(run_script(migrated(STASH_SCRIPT)), uninterrupted)


@pytest.mark.usefixtures("aliases", "session_cleanup")
def test_amp_stash_without_master_weights_and_after_close() -> None:
    from apex import amp  # type: ignore[import-not-found]

    import ampinit

    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    stash = optimizer._amp_stash
    assert stash.all_fp16_params == [] and [id(p) for p in stash.all_fp32_params] == [id(model.weight), id(model.bias)]
    with pytest.raises(AttributeError, match="exists only with master weights"):
        stash.all_fp32_from_fp16_params  # noqa: B018
    stash.skip_patched = False  # Apex's stash took fields of the caller's own, and so does this one
    assert stash.skip_patched is False
    ampinit.deinitialize()
    with pytest.raises(AttributeError, match="no longer belongs to an amp session"):
        optimizer._lazy_init_maybe_master_weights()


# -- FusedAdam.multi_tensor_adam and _dummy_overflow_buf (fairseq's FusedAdamV2) -------------------------------
FUSED_ADAM_SCRIPT = """
import torch
from apex.optimizers import FusedAdam
from apex.multi_tensor_apply import multi_tensor_applier


class FusedAdamV2(FusedAdam):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version of apex.")

    def step(self, closure=None):
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            g_16, p_16, orig_p_16, m_16, v_16 = [], [], [], [], []
            g_32, p_32, m_32, v_32 = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p.data, dtype=torch.float)
                if p.dtype == torch.float16:
                    g_16.append(p.grad.data.float())
                    p_16.append(p.data.float())
                    orig_p_16.append(p.data)
                    m_16.append(state["exp_avg"])
                    v_16.append(state["exp_avg_sq"])
                else:
                    g_32.append(p.grad.data)
                    p_32.append(p.data)
                    m_32.append(state["exp_avg"])
                    v_32.append(state["exp_avg_sq"])
            for lists in ([g_16, p_16, m_16, v_16], [g_32, p_32, m_32, v_32]):
                if lists[0]:
                    multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, lists, group["lr"],
                                         beta1, beta2, group["eps"], group["step"], self.adam_w_mode,
                                         bias_correction, group["weight_decay"])
            for orig_p, p in zip(orig_p_16, p_16):
                orig_p.copy_(p.data)
"""


def adam_reference(param: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float) -> torch.Tensor:
    """AdamW (Apex's adam_w_mode=1) on a float32 copy of ``param``, rounded to its dtype after every step, as
    fairseq's FusedAdamV2 does for half parameters."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    p = param.detach().clone()
    m = torch.zeros_like(p, dtype=torch.float32)
    v = torch.zeros_like(p, dtype=torch.float32)
    for t, grad in enumerate(grads, start=1):
        w = p.float()
        g = grad.float()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + wd * w
        p = (w - lr * update).to(param.dtype)
    return p


def check_fused_adam_script(namespace: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(6, 5, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen).half()),
    ]
    start = [p.detach().clone() for p in params]
    optimizer = namespace["FusedAdamV2"](params, lr=1e-2, weight_decay=0.1)
    assert optimizer._dummy_overflow_buf.dtype == torch.int32 and optimizer._dummy_overflow_buf.item() == 0
    grads: list[list[torch.Tensor]] = [[], []]
    for _ in range(4):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            grads[i].append(p.grad.clone())
        optimizer.step()
    assert optimizer.param_groups[0]["step"] == 4
    for p, p0, g in zip(params, start, grads):
        expected = adam_reference(p0, g, lr=1e-2, wd=0.1)
        tolerance = {"rtol": 1e-6, "atol": 1e-6} if p.dtype == torch.float32 else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(p.detach(), expected, **tolerance)


@pytest.mark.usefixtures("aliases")
def test_fairseq_fused_adam_subclass_under_the_aliases() -> None:
    check_fused_adam_script(run_script(FUSED_ADAM_SCRIPT))


def test_fairseq_fused_adam_subclass_after_migration() -> None:
    check_fused_adam_script(run_script(migrated(FUSED_ADAM_SCRIPT)))


def test_every_fused_optimizer_carries_apexs_kernel_handles() -> None:
    import ampinit.optimizers as optimizers
    from ampinit.compat.apex import amp_C

    param = [torch.nn.Parameter(torch.zeros(2))]
    expected = {
        optimizers.FusedAdam: [
            "multi_tensor_adam",
            "multi_tensor_adam_capturable",
            "multi_tensor_adam_capturable_master",
        ],
        optimizers.FusedSGD: ["multi_tensor_sgd"],
        optimizers.FusedLAMB: ["multi_tensor_l2norm", "multi_tensor_lamb"],
        optimizers.FusedNovoGrad: ["multi_tensor_novograd"],
        optimizers.FusedAdagrad: ["multi_tensor_adagrad"],
    }
    for cls, names in expected.items():
        kwargs = {"lr": 0.1} if cls is optimizers.FusedSGD else {}
        optimizer = cls(param, **kwargs)
        assert [getattr(optimizer, n) for n in names] == [getattr(amp_C, n) for n in names], cls
        assert optimizer._dummy_overflow_buf.tolist() == [0]
