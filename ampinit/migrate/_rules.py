"""The mapping from Apex names to ampinit and torch names, shared by both codemods."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import cache

import ampinit.amp
import ampinit.optimizers
from ampinit.compat.apex import amp_C
from ampinit.compat.apex.parallel import _ddp_arguments
from ampinit.compat.apex.parallel.distributed import DistributedDataParallel as _ApexDDP

COMPAT = "ampinit.compat.apex"


@dataclass(frozen=True)
class Target:
    """Where an Apex name lives now: ``module.name`` (``name`` may be dotted, e.g. a classmethod)."""

    module: str
    name: str | None = None  # None: the module itself
    note: str | None = None  # why a human should look (makes the site "needs a human")
    info: str | None = None  # reported, no comment in the code

    @property
    def expression(self) -> str:
        return self.module if self.name is None else f"{self.module}.{self.name}"

    @property
    def importable(self) -> bool:
        """Whether ``from module import name`` (or ``import module``) binds it."""
        return self.name is None or "." not in self.name

    @property
    def root_import(self) -> str:
        """The module to ``import`` so that :attr:`expression` resolves."""
        return "torch" if self.module.startswith("torch") else self.module

    @property
    def resolves(self) -> bool:
        """Whether the new home exists in the installed ampinit/torch (the codemod never emits one that does not)."""
        return resolves(self.module, self.name)


@cache
def resolves(module: str, name: str | None = None) -> bool:
    """Whether ``import module`` works and ``module.name`` (``name`` may be dotted) is an attribute of it."""
    try:
        found: object = importlib.import_module(module)
    except ImportError:
        return False
    for part in (name or "").split(".") if name else []:
        if not hasattr(found, part):
            return False
        found = getattr(found, part)
    return True


AMP_NAMES = frozenset(ampinit.amp.__all__)
OPTIMIZER_NAMES = frozenset(ampinit.optimizers.__all__)
AMP_C_NAMES = frozenset(amp_C.__all__)
MULTI_TENSOR_APPLY_NAMES = frozenset({"multi_tensor_applier", "MultiTensorApply"})

DDP = "torch.nn.parallel"
TARGETS: dict[str, Target] = {
    "apex.amp": Target("ampinit", "amp"),
    "apex.optimizers": Target("ampinit", "optimizers"),
    "apex.multi_tensor_apply": Target("ampinit", "multi_tensor"),
    "amp_C": Target("ampinit.multi_tensor", "amp_C"),
    "apex.parallel.DistributedDataParallel": Target(DDP, "DistributedDataParallel"),
    "apex.parallel.distributed.DistributedDataParallel": Target(DDP, "DistributedDataParallel"),
    "apex.parallel.SyncBatchNorm": Target("torch.nn", "SyncBatchNorm"),
    "apex.parallel.convert_syncbn_model": Target("torch.nn", "SyncBatchNorm.convert_sync_batchnorm"),
    "apex.parallel.ReduceOp": Target("torch.distributed", "ReduceOp"),
    "apex.fp16_utils.clip_grad_norm": Target("torch.nn.utils", "clip_grad_norm_"),
    # Apex's 2018-12..2019-10 class of this name (commits be42aad5..1904e48d); see ampinit.compat.apex.optimizers
    "apex.optimizers.FP16_Optimizer": Target(
        f"{COMPAT}.fp16_utils",
        "FP16_Optimizer",
        info="Apex's 2018-12..2019-10 FusedAdam-only FP16_Optimizer becomes apex.fp16_utils' (same constructor, "
        "backward, step); a checkpoint saved by the old class (cur_scale, fp32_groups_flat) does not load into it",
    ),
    **{f"apex.amp.{name}": Target("ampinit.amp", name) for name in AMP_NAMES},
    **{f"apex.optimizers.{name}": Target("ampinit.optimizers", name) for name in OPTIMIZER_NAMES},
    **{f"apex.multi_tensor_apply.{name}": Target("ampinit.multi_tensor", name) for name in MULTI_TENSOR_APPLY_NAMES},
}
for _name in OPTIMIZER_NAMES:
    _module = {"FusedAdam": "fused_adam", "FusedSGD": "fused_sgd", "FusedLAMB": "fused_lamb"}.get(_name)
    if _module:
        TARGETS[f"apex.optimizers.{_module}.{_name}"] = Target("ampinit.optimizers", _name)

#: Modules whose own attributes are checked: a name outside ampinit's surface keeps the compat module.
MODULE_SURFACES: dict[str, frozenset[str]] = {
    "apex.amp": AMP_NAMES,
    "apex.optimizers": OPTIMIZER_NAMES,
    "apex.multi_tensor_apply": MULTI_TENSOR_APPLY_NAMES,
    "amp_C": AMP_C_NAMES,
}

#: Packages with no single new home: their attribute chains are rewritten one by one.
PACKAGES = frozenset({"apex", "apex.parallel", "apex.fp16_utils"})

TO_PYTHON_FLOAT = "apex.fp16_utils.to_python_float"
TO_PYTHON_FLOAT_NAMES = frozenset({TO_PYTHON_FLOAT, "apex.fp16_utils.fp16util.to_python_float"})
DDP_NAMES = frozenset({"apex.parallel.DistributedDataParallel", "apex.parallel.distributed.DistributedDataParallel"})
SYNCBN_NAMES = frozenset({"apex.parallel.SyncBatchNorm"})
CONVERT_SYNCBN = "apex.parallel.convert_syncbn_model"

# Apex DDP arguments: renamed for torch's DDP (delay_allreduce=True -> find_unused_parameters=True), dropped with a
# note, or dropped silently. One table, shared with the Apex layer's DDP class.
# delay_allreduce=True made Apex allreduce, after backward, whichever gradients exist (its overlapping mode expects
# every parameter that fired in the first iteration to fire again), so a model with parameters that get no gradient
# trained under it. torch's DDP averages the same gradients whether it overlaps or not; the one option that keeps
# such a model training is find_unused_parameters=True (without it torch fails on the second iteration). It costs a
# graph traversal per iteration and, where no parameter is unused, one warning per process from torch's reducer
# (TORCH_WARN_ONCE: not one per step) that says the flag can go: that is the faithful equivalent, not dropping it.
DDP_RENAMED = _ddp_arguments.DDP_RENAMED
#: Apex DDP's parameters after ``module``, in order (from the Apex layer's class): positional arguments by name.
DDP_POSITIONAL = tuple(inspect.signature(_ApexDDP.__init__).parameters)[2:]
DDP_DROPPED_SILENTLY = _ddp_arguments.DDP_DROPPED_SILENTLY
DDP_DROPPED_WITH_EFFECT = _ddp_arguments.DDP_DROPPED_WITH_EFFECT

#: Optimizer wrappers that only Apex's amp.initialize (ampinit's Apex layer) accepts: a file that uses one keeps
#: ``amp`` on that layer, where ``ampinit run`` already trains it.
OPTIMIZER_WRAPPERS = ("apex.parallel.LARC",)
WRAPPER_INFO = (
    "this file wraps its optimizer in Apex's LARC, which only the Apex-compatible amp.initialize accepts: amp is kept "
    "on ampinit's Apex layer (ampinit.compat.apex.amp)"
)

#: Apex's per-optimizer amp state, which only the Apex-compatible amp.initialize attaches to an optimizer: a file that
#: reads one keeps ``amp`` on that layer (as with LARC), where the attribute exists.
COMPAT_AMP_ATTRIBUTES = ("_amp_stash", "_lazy_init_maybe_master_weights")
COMPAT_AMP_INFO = (
    "this file reads Apex's per-optimizer amp state (optimizer._amp_stash / _lazy_init_maybe_master_weights), which "
    "ampinit's Apex-compatible amp.initialize attaches: amp is kept on ampinit's Apex layer (ampinit.compat.apex.amp)"
)

SPECIAL_NOTES = {
    "apex.fp16_utils.FP16_Optimizer": (
        "FP16_Optimizer is kept through ampinit's Apex layer; consider amp.initialize(model, optimizer, "
        "opt_level='O2'), which needs no wrapper"
    ),
    "apex.amp._amp_state": "Apex internals: amp.stats() and amp.current_session() are ampinit's public views",
    "apex.amp.init": "the old amp.init() API: prefer amp.initialize(model, optimizer, opt_level='O1')",
    "apex.optimizers.FusedMixedPrecisionLamb": "ampinit has no FusedMixedPrecisionLamb: use FusedLAMB under O2",
}


#: Apex-private attributes that public code touches (issue 15, item 3), with where Apex has them. A file that uses one
#: needs a human until ampinit provides it: :func:`private_attribute_provided` probes for it, so rows need no edit
#: when the compat layer gains them.
PRIVATE_ATTRIBUTES = {
    "_amp_stash": "Apex's per-optimizer amp state",
    "_lazy_init_maybe_master_weights": "Apex's lazy O2 master-weight setup on the optimizer",
    "_scale_seq_len": "the growth interval of Apex's loss scaler",
    "multi_tensor_adam": "FusedAdam's kernel handle (fairseq's subclass checks for it)",
    "_dummy_overflow_buf": "FusedAdam's overflow buffer",
}


@cache
def private_attribute_provided(name: str) -> bool:
    """Whether ampinit's Apex layer has ``name`` where Apex had it (a FusedAdam, an initialized optimizer)."""
    if name in COMPAT_AMP_ATTRIBUTES:
        return True  # attached by the Apex layer's amp.initialize, which such a file keeps (see classify)
    import torch

    from ampinit.compat.apex import optimizers as apex_optimizers
    from ampinit.compat.apex.amp._amp_state import LossScalerView

    parameter = torch.nn.Parameter(torch.zeros(1))
    probes = [apex_optimizers.FusedAdam([parameter]), torch.optim.SGD([parameter], lr=0.1), LossScalerView]
    return any(hasattr(probe, name) for probe in probes)


def target_for(qualified: str) -> Target:
    """The new home of an Apex name; anything unmapped stays reachable through ampinit's Apex layer."""
    found = TARGETS.get(qualified)
    if found is not None:
        return found
    module, _, name = qualified.rpartition(".")
    if qualified in ("amp_C", "apex_C"):
        return Target(COMPAT, qualified)
    if module in ("amp_C", "apex_C"):  # ``from amp_C import multi_tensor_l2norm``
        return Target(f"{COMPAT}.{module}", name)
    new_module = COMPAT + module[len("apex") :] if module.startswith("apex") else COMPAT
    note = SPECIAL_NOTES.get(qualified)
    info = None if note else "no ampinit or torch equivalent: kept through ampinit's Apex layer (ampinit.compat.apex)"
    return Target(new_module, name, note=note, info=info)


def compat_target(qualified: str, unknown: list[str]) -> Target:
    """The compat home of a module whose ampinit counterpart lacks some of the names the code uses."""
    module, _, name = qualified.rpartition(".")
    new_module = COMPAT + module[len("apex") :] if module.startswith("apex") else COMPAT
    notes = [SPECIAL_NOTES.get(f"{qualified}.{attr}") for attr in unknown]
    reason = "; ".join(n for n in notes if n) or "names outside ampinit's API"
    return Target(
        new_module,
        name or qualified,
        note=f"this code uses {qualified}.{', '.join(sorted(unknown))}, which only ampinit's Apex layer has ({reason})",
    )
