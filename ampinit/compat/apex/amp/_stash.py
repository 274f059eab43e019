"""Apex's per-optimizer fields that public code touches: ``optimizer._amp_stash`` and
``optimizer._lazy_init_maybe_master_weights()``.

Apex's ``amp.initialize`` put an ``AmpOptimizerState`` on every optimizer and filled it lazily, at the first
``zero_grad()`` or ``scale_loss``, with the parameter lists of its master-weight bookkeeping. Public code reads a few
of its fields (``all_fp32_from_fp16_params`` to clip or checkpoint masters, ``already_patched`` to know the next
step is skipped, ``params_have_scaled_gradients`` under gradient accumulation) and calls
``_lazy_init_maybe_master_weights()`` before loading a checkpoint. Here the stash is a view: every field is read
from the optimizer's session when it is read, so nothing is stored twice.

ampinit creates the fp32 masters in ``initialize`` itself, so the lazy initialisation has always happened:
``lazy_init_called`` starts True, and ``_lazy_init_maybe_master_weights()`` keeps the existing masters (Apex's
would build new masters from the current ones: the same values in new tensors).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import ampinit
from ampinit import AmpSession
from ampinit._types import HALF_DTYPES
from ampinit.compat.apex.amp_C import multi_tensor_l2norm, multi_tensor_scale

__all__ = ["AmpStash", "attach"]

_LAZY_INIT = "_lazy_init_maybe_master_weights"


class AmpStash:
    """``optimizer._amp_stash``: Apex's field names over the optimizer's ampinit session.

    Apex's code set extra fields of its own on the stash; so may any code here (it is an ordinary object).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        #: Apex's flag, set once the masters exist. ampinit builds them in ``initialize``; code that sets the
        #: flag itself (the checkpoint recipe ``_lazy_init_maybe_master_weights(); lazy_init_called = True``) may.
        self.lazy_init_called = True
        # Apex's handles on its kernels, for code that calls them through the stash.
        self.multi_tensor_scale = multi_tensor_scale
        self.multi_tensor_l2norm = multi_tensor_l2norm
        self.dummy_overflow_buf = torch.zeros(1, dtype=torch.int32)

    # -- the step and backward state ------------------------------------------------------------------------
    @property
    def already_patched(self) -> bool:
        """Whether the next ``step()`` is skipped because the last unscale found an overflow (Apex patched
        ``step`` with a one-shot skip then)."""
        optimizer, session = self._owner("already_patched")
        return session.next_step_skipped(optimizer)

    @property
    def params_have_scaled_gradients(self) -> bool:
        """Whether the gradients are still scaled: the last ``scale_loss`` block had ``delay_unscale=True``."""
        optimizer, session = self._owner("params_have_scaled_gradients")
        return session.grads_scaled(optimizer)

    # -- the parameter lists --------------------------------------------------------------------------------
    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the model's half parameters that have fp32 masters (master weights only)."""
        return [half for half, _, _ in self._master_groups("fp16_groups")]

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the fp32 masters of those half parameters, in the same order."""
        return [masters for _, masters, _ in self._master_groups("fp32_from_fp16_groups")]

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the trainable parameters the optimizer updates directly (no master)."""
        return [direct for _, _, direct in self._master_groups("fp32_from_fp32_groups")]

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        """The model's half parameters the optimizer trains (with master weights: those that have masters)."""
        optimizer, session = self._owner("all_fp16_params")
        if session.properties.uses_master_weights:
            return [p for half, _, _ in _master_groups(session, optimizer) for p in half]
        return [p for p in _params(optimizer) if p.dtype in HALF_DTYPES]

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return [p for group in self.fp32_from_fp16_groups for p in group]

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        return [p for group in self.fp32_from_fp32_groups for p in group]

    @property
    def all_fp32_params(self) -> list[torch.Tensor]:
        """Without master weights: the float32 parameters of the optimizer."""
        optimizer, _ = self._owner("all_fp32_params")
        return [p for p in _params(optimizer) if p.dtype == torch.float32]

    def _master_groups(self, field: str) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
        optimizer, session = self._owner(field)
        if not session.properties.uses_master_weights:
            raise AttributeError(
                f"optimizer._amp_stash.{field} exists only with master weights (O2/O5), as in Apex; this session "
                f"runs {session.properties.opt_level} without them: use all_fp16_params / all_fp32_params"
            )
        return _master_groups(session, optimizer)

    def _owner(self, field: str) -> tuple[torch.optim.Optimizer, AmpSession]:
        optimizer = self._optimizer()
        session = None if optimizer is None else ampinit.session_of(optimizer)
        if optimizer is None or session is None:
            raise AttributeError(
                f"optimizer._amp_stash.{field}: the optimizer no longer belongs to an amp session "
                "(its session was closed, or amp.initialize() did not take it)"
            )
        return optimizer, session

    def __repr__(self) -> str:
        return f"AmpStash(lazy_init_called={self.lazy_init_called})"


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _master_groups(
    session: AmpSession, optimizer: torch.optim.Optimizer
) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
    """Per param group: (half model params, their masters, trainable params without a master), in group order."""
    model_of: dict[int, torch.Tensor] = {}
    for model in session.models:
        for param in model.parameters():
            master = session.master_for(param)
            if master is not None:
                model_of[id(master)] = param
    groups = []
    for group in optimizer.param_groups:
        half: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []
        direct: list[torch.Tensor] = []
        for param in group["params"]:
            if id(param) in model_of:
                half.append(model_of[id(param)])
                masters.append(param)
            elif param.requires_grad:
                direct.append(param)
        groups.append((half, masters, direct))
    return groups


def attach(holder: Any, optimizer: torch.optim.Optimizer) -> None:
    """Give ``holder`` (the optimizer the caller passed to ``amp.initialize``, or a LARC wrapping ``optimizer``)
    Apex's ``_amp_stash`` and ``_lazy_init_maybe_master_weights``, as Apex's ``_process_optimizer`` did."""
    stash = AmpStash(optimizer)

    def lazy_init_maybe_master_weights() -> None:
        """Apex built the masters here; ampinit built them in ``initialize``, so they are kept as they are."""
        stash._owner(_LAZY_INIT)

    holder._amp_stash = stash
    setattr(holder, _LAZY_INIT, lazy_init_maybe_master_weights)
