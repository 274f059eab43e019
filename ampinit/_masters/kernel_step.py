"""When a master step takes the Triton kernels, and how the optimizer's state is kept for them.

``optimizer.step()`` of a master-weight optimizer normally runs the optimizer on the fp32 masters and then copies
the masters into the half model weights. For ``torch.optim.Adam``, ``AdamW`` and ``SGD``, whatever their
``foreach``/``fused`` flags, on CUDA with Triton importable, the step is instead
one Triton launch per (weight dtype) list (``ampinit._masters.triton_kernels``): it reads each master grad,
updates the master and the optimizer state, and writes the half weight, so no copy-back pass follows. Remainder
masters take the same kernels, group by group. The optimizer's ``state`` keeps torch's layout (``step``,
``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``), so checkpoints move freely between this path and torch's.

The rule, for both kinds of masters: the optimizer's update is torch's (``ampinit._masters.update.update_of``),
its group takes no option the kernels lack (:func:`group_takes_kernels`: amsgrad, tensor lr or betas,
differentiable), the device has kernels (:func:`kernels_for`), and every tensor is dense,
contiguous, on one device, with a grad of its master's dtype (:func:`kernels_taking`). fp32 masters also leave the
step to torch when its ``step`` has hooks or was wrapped by anyone but an lr scheduler (the remainder and dial steps
never call ``step``: they run its hooks around themselves, :func:`with_step_hooks`).
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from itertools import repeat
from types import ModuleType
from typing import Any, Literal, NamedTuple, Protocol, cast, runtime_checkable

import torch
import torch.optim.optimizer as optim_module

from ampinit._masters.reference import AdamSettings, Masters, SgdSettings
from ampinit._masters.update import Update
from ampinit._scaler import FusedUpdate

#: The one test switch: tests set it to run the kernels on CPU tensors through Triton's interpreter (with
#: TRITON_INTERPRET=1 when ``triton_kernels`` is imported; tests/conftest.py's ``kernels_on_cpu`` does both).
TRITON_ON_CPU = False


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (it ships with torch's CUDA wheels; never with the CPU ones). Asked once:
    the answer does not change in a process, and a failed import is tried again at each call."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def forget_tables() -> None:
    """Drop the launch tables the kernels keep between steps (``triton_kernels``' block and pointer tables,
    ``triton_dial``'s 8-bit maps), where those modules are imported; called when a session closes.

    The tables are device memory keyed by the tensors' data pointers, so they outlived the tensors they describe: a
    process that initialised one session after another kept up to 64 sets per cache. On the H200 check of
    2026-11-27 they were the remainder rows' 11-51 MiB over pure bf16's peak (each variant's peak counted the
    tables of every variant measured before it; a set was then 12 B per block of 1024 elements, 1.5 MB for 124M
    parameters, and is now a few bytes per tensor). Another session still open rebuilds its tables at its next
    step: a table entry per tensor, about 0.3 ms for GPT-2 small's 148 tensors on the CPU, where the block tables'
    Python loop over 121k blocks took 34 ms (on the H100 check of 2026-11-27, the two O2/O5 variants measured right
    after an O1/O4 one, whose turns close their session, were 1.5-7 ms per step slower than their fused twins).
    (So does a step after the caches' 64-entry clear. A CUDA graph that captured amp's kernel step reads the tables
    it was captured with: replaying it after either is not supported, as replaying it after its tensors moved.)
    """
    for name in ("ampinit._masters.triton_kernels", "ampinit._masters.triton_dial"):
        module = sys.modules.get(name)
        if module is not None:
            module.forget_tables()


def kernels_for(device: torch.device) -> ModuleType | None:
    """``ampinit._masters.triton_kernels`` if the kernels run on ``device``, else None (the master step's; tests
    replace it to run the step on another backend)."""
    return _imported_kernels() if _kernels_run_on(device) else None


def scale_update_for(device: torch.device) -> FusedUpdate | None:
    """A dynamic loss scale's one-launch update (``triton_kernels.update_scale_``) where the kernels run on
    ``device``, else None (``LossScaler.update`` then runs torch's three ops). By the kernels' device rule, not
    through :func:`kernels_for`, which answers for the step alone."""
    kernels = _imported_kernels() if _kernels_run_on(device) else None
    return None if kernels is None else cast(FusedUpdate, kernels.update_scale_)


def _kernels_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and TRITON_ON_CPU)


_KERNELS_MODULE = "ampinit._masters.triton_kernels"


def _imported_kernels() -> ModuleType | None:
    """The kernels' module (None without ``triton``), imported at the first step that takes it: then found in
    ``sys.modules``, where an import statement per call cost a microsecond, and a step asks several times."""
    module = sys.modules.get(_KERNELS_MODULE)
    if module is not None:
        return module
    if not triton_available():
        return None
    from ampinit._masters import triton_kernels

    return triton_kernels


@runtime_checkable
class KernelOptimizer(Protocol):
    """An optimizer other than torch's whose step the kernels may take (ampinit's FusedAdam and FusedSGD): it
    names the update it runs, gives a group's settings in the kernels' terms, and keeps the state they use (for
    SGD torch's ``momentum_buffer`` layout). Only the class that defines ``kernel_settings`` is taken at its word,
    as with ``update.MasterUpdate``: a subclass may have changed ``step()``."""

    kernel_update: Literal["adam", "sgd"]

    def kernel_settings(self, group: dict[str, Any]) -> AdamSettings | SgdSettings | None:
        """``group``'s settings, or None where it takes an option the kernels lack (its own step then runs)."""


@runtime_checkable
class KernelAdamState(Protocol):
    """A :class:`KernelOptimizer` whose update is Adam keeps its moments and step count its own way."""

    def kernel_adam_state(
        self, group: dict[str, Any], params: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """``(exp_avgs, exp_avg_sqs, steps)`` of one Adam launch over ``params``: ``steps`` (1-D, one per tensor) is
        the step number each update's bias corrections use."""

    def kernel_count_step(self, group: dict[str, Any], found_inf: torch.Tensor | None) -> None:
        """Count the step of ``group`` that the kernels took (all its launches), unless ``found_inf`` is set."""


def _kernel_optimizer(opt: torch.optim.Optimizer) -> KernelOptimizer | None:
    # The class's own attributes, not isinstance: a runtime Protocol check costs more than the rest of a step's
    # per-group work, and only the defining class counts anyway.
    if "kernel_settings" in vars(type(opt)):
        return cast(KernelOptimizer, opt)
    return None


def kernel_update(opt: torch.optim.Optimizer, update: Update | None) -> Update | None:
    """The update the kernels would run for ``opt`` (``update`` is ``update_of(opt)``), or None."""
    if update in ("adam", "sgd"):
        return update
    own = _kernel_optimizer(opt)
    return None if own is None else own.kernel_update


def _takes_kernels(opt: torch.optim.Optimizer, update: Update | None) -> bool:
    """Whether every group of ``opt`` fits the kernels (the group rule of torch's optimizers, or the optimizer's)."""
    return all(takes_group(opt, update, group) for group in opt.param_groups)


def takes_group(opt: torch.optim.Optimizer, update: Update | None, group: dict[str, Any]) -> bool:
    """Whether ``group`` of ``opt`` fits the kernels (see :func:`group_settings`; for torch's optimizers their rule
    alone, without making the settings, which a step asks for several times)."""
    own = _kernel_optimizer(opt)
    if own is not None:
        return own.kernel_settings(group) is not None
    return group_takes_kernels(update, group)


def group_settings(
    opt: torch.optim.Optimizer, update: Update | None, group: dict[str, Any]
) -> AdamSettings | SgdSettings | None:
    """``group``'s settings in the kernels' terms, or None where it takes an option they lack: a
    :class:`KernelOptimizer` maps its own options (FusedAdam's ``adam_w_mode`` and ``bias_correction``, FusedSGD's
    dampening) and refuses the ones the kernels lack; torch's optimizers take :func:`group_takes_kernels`'s rule
    (``update``: the kernels' update for ``opt``, :func:`kernel_update`). The one rule of every kernel step: fp32
    masters, remainders, the precision dial, and the stand-in without masters."""
    own = _kernel_optimizer(opt)
    if own is not None:
        return own.kernel_settings(group)
    if not group_takes_kernels(update, group):
        return None
    return AdamSettings.of(opt, group) if update == "adam" else SgdSettings.of(group)


def count_group_step(
    opt: torch.optim.Optimizer, update: Update | None, group: dict[str, Any], found_inf: torch.Tensor | None
) -> None:
    """After all the launches of ``group``'s step: a :class:`KernelOptimizer`'s Adam counts the group's step once
    (torch's per-parameter counts advanced in ``adam_inputs``, before the launches that read them)."""
    if kernel_update(opt, update) == "adam" and _kernel_optimizer(opt) is not None:
        cast(KernelAdamState, opt).kernel_count_step(group, found_inf)


def group_takes_kernels(update: Update | None, group: dict[str, Any]) -> bool:
    """Whether ``group`` of an optimizer whose update is ``update`` fits the kernels.

    Not only ``fused=True`` groups: the kernels' per-element math is that of torch's fused kernels, whose results
    differ from its foreach and single-tensor paths in the last fp32 bits, as torch's fused kernels' own do
    (measured in docs/opt-levels.md); a master step without the fp32 grad and copy-back passes is worth that on
    every default optimizer.
    """
    if update not in ("adam", "sgd") or group.get("differentiable"):
        return False
    if not isinstance(group["lr"], float):
        return False
    return update == "sgd" or (not group["amsgrad"] and all(isinstance(b, float) for b in group["betas"]))


#: The tensor types the kernels take (their raw data pointers are the data): no subclass.
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_TENSOR = frozenset((torch.Tensor,))

# Read with ``map`` (a loop in C): the checks below run over every tensor of a step, every step, and a Python
# call per tensor was most of the step's host time (benchmarks/kernel_step_host.py).
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_NUMEL = torch.Tensor.numel
_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_IS_NOT_NONE = functools.partial(operator.is_not, None)
_STEP = operator.itemgetter("step")
_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")
_MASTER_DTYPES = (torch.float32, torch.bfloat16)  # by whether the parameter is a remainder's bf16 weight


def _all_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(_CONTIGUOUS, tensors))


class _Checked(NamedTuple):
    """Parameters and model weights that passed :func:`kernels_taking`'s checks, and what was read of them."""

    params: list[torch.Tensor]
    model: list[torch.Tensor | None]  # each parameter's model weight, or None
    device: torch.device
    master_dtypes: list[torch.dtype]
    pointers: tuple[int, ...]  # the parameters' data pointers
    weight_pointers: tuple[int, ...]  # the model weights' (the Nones of ``model`` left out)
    sizes: tuple[int, ...]  # the parameters' numbers of elements
    model_dtypes: list[torch.dtype | None]  # each parameter's model weight's dtype, or None


#: Per optimizer, the parameters and model weights of its last kernel step that passed every check
#: (:func:`kernels_taking`'s ``owner``). Dropped with the optimizer, or by :func:`forget_states`.
_checked: weakref.WeakKeyDictionary[object, _Checked] = weakref.WeakKeyDictionary()


def kernels_taking(
    params: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    weights: Mapping[int, torch.Tensor],
    remainders: Container[int],
    grads: Sequence[torch.Tensor | None] | None = None,
    *,
    model: Sequence[torch.Tensor | None] | None = None,
    grads_of_weights: bool = False,
    owner: object | None = None,
) -> ModuleType | None:
    """The kernels, if they take every one of ``params`` (the optimizer's, each with a grad), else None.

    Every parameter is on one device (the flag's, when there is one) and is an fp32 master, or a bf16 weight
    whose id is in ``remainders``; it and its grad are dense and contiguous, and so is the model weight
    ``weights`` maps its id to, if any. ``grads`` are what the kernels will read (default: each parameter's own
    grad, of its dtype); a master's may be its model weight's half grad. A caller that has them gives ``model``
    (each parameter's weight by ``weights``, or None) and says with ``grads_of_weights`` that it read the grad
    of every parameter with a weight from that weight, rather than have them found again.

    ``owner`` (the optimizer, for the step's plan): the parameters and model weights that passed these checks at
    its last call are not checked again where they are the same tensors at the same data pointers. What a check
    reads (dtype, device, contiguity, size) changes under the same tensor object only with its memory (a ``.data``
    assignment, ``set_``, a move), which moves its data pointer; the step's pointer tables already take the
    moments' layout on that rule (``triton_kernels._tables``). Not seen: what keeps the address (a ``.data``
    assignment of a transposed view of the same storage, ``as_strided_``, a shrinking ``resize_``), which no
    training code does to a parameter. The grads, fresh tensors each step, are always
    checked. (About a third of the checks' reads: on the H100 checks' hosts each read of a tensor attribute cost
    about 0.1 us, and the plan read the model's worth several times each step.)
    """
    if not params:
        return None
    device = params[0].device if found_inf is None else found_inf.device
    kernels = kernels_for(device)
    if kernels is None:
        return None
    read = list(map(_GRAD, params)) if grads is None else grads
    if any(map(operator.is_, read, repeat(None))):
        return None
    present = cast(list[torch.Tensor], read)
    if model is None:
        model = list(map(weights.get, map(id, params)))
    model_weights = cast(list[torch.Tensor], list(filter(_IS_NOT_NONE, model)))
    if remainders:
        master_dtypes = list(map(_MASTER_DTYPES.__getitem__, map(remainders.__contains__, map(id, params))))
    else:
        master_dtypes = [torch.float32] * len(params)
    # Plain tensors only: the kernels take raw data pointers, and a tensor subclass may have none (an FSDP2 /
    # tensor-parallel DTensor's data_ptr() is 0) or lay its data out otherwise. ``type``, not ``__class__``: a
    # builtin, no attribute read through the tensor (a third of the time), and a subclass cannot dress up as a
    # plain tensor by overriding ``__class__``.
    if not (
        _PLAIN.issuperset(map(type, params))
        and _TENSOR.issuperset(map(type, present))
        and _PLAIN.issuperset(map(type, model_weights))
    ):
        return None
    checked = _checked.get(owner) if owner is not None else None
    pointers = tuple(map(_DATA_PTR, params)) if owner is not None else ()
    weight_pointers = tuple(map(_DATA_PTR, model_weights)) if owner is not None else ()
    if not (
        checked is not None
        and checked.device == device
        and checked.pointers == pointers
        and checked.weight_pointers == weight_pointers
        and checked.master_dtypes == master_dtypes
        and _same_tensors(checked.params, params)
        and _same_tensors(checked.model, model)
    ):
        if not (
            list(map(_DTYPE, params)) == master_dtypes
            and set(map(_DEVICE, params)) == {device}
            and _all_contiguous(params)
            and _all_contiguous(model_weights)
        ):
            return None
        if owner is not None:
            sizes = tuple(map(_NUMEL, params))
            model_dtypes = list(map(getattr, model, repeat("dtype"), repeat(None)))
            _checked[owner] = _Checked(
                list(params), list(model), device, master_dtypes, pointers, weight_pointers, sizes, model_dtypes
            )
    if not (
        set(map(_DEVICE, present)) == {device}
        # Strided only: what the kernels read by pointer (a sparse grad, which torch's grad setter allows a dense
        # parameter, is a COO one; other layouts' is_contiguous() raises).
        and all(map(operator.is_, map(_LAYOUT, present), repeat(torch.strided)))
        and _all_contiguous(present)
        and _grads_are_theirs(params, present, model, grads_of_weights)
    ):
        return None
    return kernels


def _same_tensors(known: Sequence[torch.Tensor | None], tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``tensors`` are the objects ``known``, in order (one identity test each: no tensor is read)."""
    return len(known) == len(tensors) and all(map(operator.is_, known, tensors))


def _grads_are_theirs(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    model: Sequence[torch.Tensor | None],
    grads_of_weights: bool,
) -> bool:
    """Whether each grad has its parameter's dtype or is the parameter's model weight's own (half) grad."""
    if grads_of_weights:
        from_weights = list(map(operator.is_not, model, repeat(None)))
        if all(from_weights):
            return True  # the usual plan: every grad was read from its master's weight
        weights_own: Iterator[bool] = iter(from_weights)
    else:
        weights_own = map(operator.is_, grads, map(getattr, model, repeat("grad"), repeat(None)))
    return all(map(operator.or_, map(operator.eq, map(_DTYPE, grads), map(_DTYPE, params)), weights_own))


def takes_device_flag(opt: torch.optim.Optimizer, update: Update | None) -> bool:
    """Whether ``opt``'s next step is meant for the kernels, which skip on the device from an overflow flag.

    A prediction for the skip decision: a step the kernels then decline (a grad beyond them, a first momentum step
    that may be skipped) reads the flag on the host instead (``OptimizerRecord.step``).
    """
    update = kernel_update(opt, update)
    return _takes_kernels(opt, update) and not _hooked(opt)


def _hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether a step hook (of ``opt``, or global) would run around ``opt``'s step."""
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return True
    return bool(optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks)


def with_step_hooks(opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    """Run ``step`` (a step amp takes without calling the optimizer's own ``step``: remainder masters, the precision
    dial) between torch's optimizer step hooks, as ``Optimizer.step`` runs them (``profile_hook_step``): the global
    and the optimizer's pre-hooks before, its and the global post-hooks after, each given ``(optimizer, args,
    kwargs)``, where ``args`` is ``(optimizer,)`` (amp's step takes no closure). Without a hook, just ``step``."""
    if not _hooked(opt):
        step()
        return
    args: tuple[Any, ...] = (opt,)
    kwargs: dict[str, Any] = {}
    pre = itertools.chain(optim_module._global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values())
    for hook in list(pre):
        result = hook(opt, args, kwargs)
        if result is not None:
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
            else:
                name = type(opt).__name__
                raise RuntimeError(
                    f"{name}.step must return None or a tuple of (new_args, new_kwargs), but got {result}."
                )
    step()
    post = itertools.chain(opt._optimizer_step_post_hooks.values(), optim_module._global_optimizer_post_hooks.values())
    for hook in list(post):
        hook(opt, args, kwargs)


def _plain_step(opt: torch.optim.Optimizer, original: Callable[..., Any]) -> bool:
    """Whether ``original`` is the class's own step (possibly behind an lr scheduler's counter) and no hook is set."""
    if _hooked(opt):
        return False
    if getattr(original, "_wrapped_by_lr_sched", False):
        return True
    return getattr(original, "__func__", None) is type(opt).step


class PlannedGroup(NamedTuple):
    """One param group of a kernel step's plan."""

    group: dict[str, Any]
    snapshot: list[torch.Tensor]  # the group's ``params`` when planned
    sources: list[torch.Tensor]  # per parameter, the tensor whose ``.grad`` the step reads (a master's weight)
    read: list[torch.Tensor | None]  # those grads when planned
    params: list[torch.Tensor]  # the parameters with a grad
    grads: list[torch.Tensor]  # their grads
    launches: list[Launch]  # the group's launches, one per model weight dtype
    # Where the group's grads lie in the list a ``scale_loss`` exit read (and checked): ``(start, end)`` when the
    # group is one launch over that slice, else None (its launch reads their pointers itself).
    span: tuple[int, int] | None = None


class Launch(NamedTuple):
    """One launch of a group's step: the masters whose model weights have one dtype (None: masters without a model
    weight, which write nothing back), those weights and the grads read."""

    weight_dtype: torch.dtype | None
    masters: list[torch.Tensor]
    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    # What the plan read of the masters and weights when it checked them: their sizes and data pointers (the
    # step's pointer tables read the pointers again and take the sizes where those hold:
    # ``triton_kernels._launch_tables``' ``known``). None where the group is split into several launches.
    known: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None


def _launches(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    weight_of: list[torch.Tensor | None],
    half_grads: bool,
    dtype_of: list[torch.dtype | None] | None = None,
) -> list[Launch] | None:
    """A group's launches: ``params`` with ``grads`` split by the dtype of their model weights ``weight_of``
    (``dtype_of``: those dtypes, where the caller has read them).

    ``half_grads``: a master's grad is its weight's, which must have the weight's dtype (None otherwise): a launch
    reads its grads as one dtype, and its grad table's cache knows only the first's. torch's grad setter and
    autograd never give a grad of another dtype, but a ``.data`` swap of the weight after its grad was set does.
    (The masters' own grads were checked against the masters' dtype by :func:`kernels_taking`.)"""
    if dtype_of is None:
        dtype_of = list(map(getattr, weight_of, repeat("dtype"), repeat(None)))
    grad_dtypes = list(map(_DTYPE, grads)) if half_grads else None
    kinds = set(dtype_of)
    if len(kinds) == 1:  # the common case: one launch, no lists to split
        (weight_dtype,) = kinds
        if weight_dtype is None:
            return [Launch(None, params, [], grads)]
        if grad_dtypes is not None and grad_dtypes != dtype_of:
            return None
        return [Launch(weight_dtype, params, cast(list[torch.Tensor], weight_of), grads)]
    launches = []
    for weight_dtype in kinds:
        chosen = [i for i, dtype in enumerate(dtype_of) if dtype == weight_dtype]
        if grad_dtypes is not None and weight_dtype is not None and any(grad_dtypes[i] != weight_dtype for i in chosen):
            return None
        chosen_weights = [] if weight_dtype is None else [cast(torch.Tensor, weight_of[i]) for i in chosen]
        launches.append(Launch(weight_dtype, [params[i] for i in chosen], chosen_weights, [grads[i] for i in chosen]))
    return launches


#: What a kernel step launches on: the kernels, and per param group its parameters with a grad and those grads (a
#: master's: its weight's half grad, with ``half_grads``).
Plan = tuple[ModuleType, list[PlannedGroup]]


def plan_device(planned: Plan) -> torch.device:
    """The device of every tensor a plan launches on (a plan has a parameter with a grad)."""
    return next(group.params[0].device for group in planned[1] if group.params)


def read_dtypes(planned: Plan) -> set[torch.dtype]:
    """The dtypes of the model weights' grads a plan reads (each that of its weight, checked when planned)."""
    return {launch.weight_dtype for group in planned[1] for launch in group.launches if launch.weight_dtype is not None}


def weights_read(planned: Plan) -> int:
    """How many model weights' grads a plan reads (each weight has one master, so each counts once)."""
    return sum(
        len(launch.masters) for group in planned[1] for launch in group.launches if launch.weight_dtype is not None
    )


#: Masters, their model weights and those weights' grads, three lists in one order (as a ``scale_loss`` exit read
#: them).
WeightGrads = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]


def half_grads_plan(
    opt: torch.optim.Optimizer,
    update: Update | None,
    model_of: Mapping[int, torch.Tensor],
    known: WeightGrads | None = None,
) -> Plan | None:
    """The plan of ``opt``'s next step, as it stands after a backward, if that step will take the kernels reading
    the half grads of the model weights (``model_of``: id(master) -> weight) with ``1/scale``: then no fp32 master
    grad is needed. None otherwise.

    A prediction for ``scale_loss``'s exit: a step that turns out otherwise (a wrapped ``step``, a hook added
    since) makes the master grads first (``OptimizerGrads.materialize_master_grads``). The step takes the plan back
    (``step_fp32_masters(planned=...)``) where the same grads still stand, rather than checking every tensor again.
    ``known``: the weights' grads as the caller just read them, taken where the groups hold exactly those masters in
    that order (the grads are not read again).
    """
    if not takes_device_flag(opt, update):
        return None
    return _plan(opt, kernel_update(opt, update), model_of, None, half_grads=True, known=known)


def step_fp32_masters(
    opt: torch.optim.Optimizer,
    update: Update | None,
    model_of: dict[int, torch.Tensor],
    original: Callable[..., Any],
    found_inf: torch.Tensor | None,
    half_grads: bool = False,
    inv_scale: torch.Tensor | None = None,
    planned: Plan | None = None,
    grad_key: tuple[Any, ...] | None = None,
) -> bool:
    """Take ``opt``'s step through the kernels, writing the half weights; False (nothing done) if it can't.

    ``update`` is ``update_of(opt)``; ``model_of`` maps id(master) -> half model parameter. ``found_inf`` is the
    device flag of a step that skips by itself (sync-free mode), or None for a step decided on the host.
    ``half_grads``: the masters' grads are their weights' half grads, still to be multiplied by ``inv_scale``
    (None: by nothing); the grads of parameters without a weight are their own, unscaled. ``planned``: the plan
    :func:`half_grads_plan` made at the backward's end, taken if it still holds (:func:`_plan_holds`);
    ``grad_key``: the finite check's storage key of that plan's grads (``triton_kernels.check_finite_``), whose
    sizes its launches take where the grads' pointers, read again, are the ones it holds.
    """
    update = kernel_update(opt, update)
    if not _takes_kernels(opt, update) or not _plain_step(opt, original):
        return False
    if planned is None or not _plan_holds(planned, opt, update, model_of, found_inf):
        planned, grad_key = _plan(opt, update, model_of, found_inf, half_grads), None
    if planned is None:
        return False
    kernels, plan = planned
    # A step of several launches makes every launch's tables first: one refused (an optimizer state of another
    # dtype or size) refuses the step before any launch has written (one launch refuses before it writes).
    several = len(plan) > 1 or len(plan[0].launches) > 1
    prepared = _prepare_launches(update, kernels, opt, plan, grad_key) if several else None
    opt._opt_called = True  # type: ignore[attr-defined]  # what an lr scheduler's step wrapper records
    for index, planned_group in enumerate(plan):
        group = planned_group.group
        span = planned_group.span
        launch_key = None if grad_key is None or span is None else _slice_key(grad_key, *span)  # as _launch_key
        for at, (weight_dtype, masters, weights, grads, known) in enumerate(planned_group.launches):
            scaled = half_grads and weight_dtype is not None
            run_kernels(
                update, kernels, opt, group, masters, Masters.fp32(masters, weights), found_inf, grads,
                inv_scale if scaled else None, launch_key, known, None if prepared is None else prepared[index][at],
            )  # fmt: skip
        if group["params"]:
            # Every group with parameters counts, as its optimizer's own step counts it: FusedAdam's group ``step``
            # advances also where no parameter of the group has a grad this step (as in Apex; docs/optimizers.md).
            count_group_step(opt, update, group, found_inf)
    return True


def _launch_key(grad_key: tuple[Any, ...] | None, planned_group: PlannedGroup) -> tuple[Any, ...] | None:
    """The storage key of ``planned_group``'s grads within the exit's ``grad_key``, where its launch reads a slice
    of the grads the exit checked (``PlannedGroup.span``)."""
    span = planned_group.span
    return None if grad_key is None or span is None else _slice_key(grad_key, *span)


class Made(NamedTuple):
    """A launch's tables made before the step's first launch (:func:`_prepare_launches`), and the optimizer states
    they were made from (each launch's parameters', found once a step)."""

    tables: Any  # ``kernels.adam_tables`` / ``sgd_tables``' result
    states: list[dict[str, Any]]


def _prepare_launches(
    update: Update | None,
    kernels: ModuleType,
    opt: torch.optim.Optimizer,
    plan: list[PlannedGroup],
    grad_key: tuple[Any, ...] | None,
) -> list[list[Made | None]]:
    """Per planned group, per launch: its tables made as its launch would (``kernels.adam_tables`` /
    ``sgd_tables``, each list checked; a ``ValueError`` here refuses the step before anything is advanced or
    written), or None where the launch makes its own: a state it will start (a first step's moments or momentum
    buffers, zeros of the masters' sizes made by the step) or an optimizer keeping its own state (``FusedAdam``)."""
    out: list[list[Made | None]] = []
    own_state = _kernel_optimizer(opt) is not None
    for planned_group in plan:
        key = _launch_key(grad_key, planned_group)
        row: list[Made | None] = []
        for _, masters, weights, grads, known in planned_group.launches:
            states = _states_of(opt, masters)
            if own_state or not all(states):
                row.append(None)
                continue
            found = cast(list[dict[str, Any]], states)
            view = Masters.fp32(masters, weights)
            if update == "adam":
                moments = list(map(_EXP_AVG, found)), list(map(_EXP_AVG_SQ, found))
                row.append(Made(kernels.adam_tables(grads, view, *moments, grad_key=key, known=known), found))
            elif planned_group.group["momentum"] == 0:
                row.append(Made(kernels.sgd_tables(grads, view, [], grad_key=key, known=known), found))
            elif all(["momentum_buffer" in state for state in found]):
                buffers = [state["momentum_buffer"] for state in found]
                row.append(Made(kernels.sgd_tables(grads, view, buffers, grad_key=key, known=known), found))
            else:
                row.append(None)
        out.append(row)
    return out


def _slice_key(key: tuple[Any, ...], start: int, end: int) -> tuple[Any, ...]:
    """The storage key of tensors ``start:end`` of the list ``key`` is of (``triton_kernels._storage_key`` of one
    list: device, sizes, then the first tensor's dtype and every data pointer; the list is of one dtype)."""
    device, sizes, (dtype, pointers) = key
    if start == 0 and end == len(sizes):
        return key
    return device, sizes[start:end], (dtype, pointers[start:end])


def _plan(
    opt: torch.optim.Optimizer,
    update: Update | None,
    model_of: Mapping[int, torch.Tensor],
    found_inf: torch.Tensor | None,
    half_grads: bool,
    known: WeightGrads | None = None,
) -> Plan | None:
    """The kernels and each group's parameters with a grad and those grads (a master's is its weight's with
    ``half_grads``), or None when any of them is beyond the kernels. ``known``: see :func:`half_grads_plan`."""
    groups = opt.param_groups
    snapshots = [list(group["params"]) for group in groups]
    if half_grads and known is not None and _holds_in_order(snapshots, known[0]):
        _, weights_known, grads_known = known
        bounds = list(itertools.accumulate(map(len, snapshots), initial=0))
        slices = [(weights_known[a:b], grads_known[a:b]) for a, b in itertools.pairwise(bounds)]
    else:
        slices = None
    found = []  # per group: its sources, their grads, the parameters with a grad, those grads and their weights
    for index, snapshot in enumerate(snapshots):
        if slices is not None:  # every parameter a master: its weight is its source
            sources, read = slices[index]
            weight_of: list[torch.Tensor | None] = list(sources)
        else:
            ids = list(map(id, snapshot))
            weight_of = list(map(model_of.get, ids))
            sources = list(map(model_of.get, ids, snapshot)) if half_grads else snapshot  # a master's weight, or itself
            read = list(map(_GRAD, sources))
        if any(map(operator.is_, read, repeat(None))):
            taken = [i for i, g in enumerate(read) if g is not None]
            params, grads = [snapshot[i] for i in taken], [cast(torch.Tensor, read[i]) for i in taken]
            weights = [weight_of[i] for i in taken]
        else:
            params, grads, weights = snapshot, cast(list[torch.Tensor], read), weight_of
        found.append((sources, read, params, grads, weights))
    every_param = list(itertools.chain.from_iterable(entry[2] for entry in found))
    every_grad = list(itertools.chain.from_iterable(entry[3] for entry in found))
    model = list(itertools.chain.from_iterable(entry[4] for entry in found))
    kernels = kernels_taking(
        every_param, found_inf, model_of, (), every_grad, model=model, grads_of_weights=half_grads, owner=opt
    )
    if kernels is None:
        return None
    checked = _checked[opt]  # what kernels_taking read of these parameters and weights (or kept of them)
    plan = []
    start = weights_start = 0  # where the group's parameters, and its weights, start in checked's lists
    for index, (group, snapshot, (sources, read, params, grads, weights)) in enumerate(zip(groups, snapshots, found)):
        end = start + len(params)
        launches = _launches(params, grads, weights, half_grads, checked.model_dtypes[start:end])
        if launches is None:
            return None
        span = None
        if len(launches) == 1:
            (launch,) = launches
            weights_end = weights_start + len(launch.weights)
            state = checked.sizes[start:end], checked.pointers[start:end]
            launches = [launch._replace(known=(*state, checked.weight_pointers[weights_start:weights_end]))]
            if slices is not None and params is snapshot:
                span = (bounds[index], bounds[index + 1])
        weights_start += sum(map(_IS_NOT_NONE, weights))
        start = end
        plan.append(PlannedGroup(group, snapshot, sources, read, params, grads, launches, span))
    for planned in plan:
        if _first_momentum_may_skip(opt, update, planned.group, planned.params, found_inf):
            return None  # a first step that may be skipped on the device: torch's path handles it
    return kernels, plan


def _holds_in_order(snapshots: list[list[torch.Tensor]], tensors: list[torch.Tensor]) -> bool:
    """Whether the groups' parameters ``snapshots``, one after another, are ``tensors`` (the same objects)."""
    if sum(map(len, snapshots)) != len(tensors):
        return False
    return all(map(operator.is_, itertools.chain.from_iterable(snapshots), tensors))


def _first_momentum_may_skip(
    opt: torch.optim.Optimizer,
    update: Update | None,
    group: dict[str, Any],
    params: list[torch.Tensor],
    found_inf: torch.Tensor | None,
) -> bool:
    """Whether an SGD step of ``params`` with momentum, skipped by a device flag, would start a momentum buffer."""
    if update != "sgd" or group["momentum"] == 0 or found_inf is None:
        return False
    return any(["momentum_buffer" not in (state or {}) for state in _states_of(opt, params)])


def _plan_holds(
    planned: Plan, opt: torch.optim.Optimizer, update: Update | None, model_of: Mapping[int, torch.Tensor],
    found_inf: torch.Tensor | None,
) -> bool:  # fmt: skip
    """Whether ``planned`` (made by :func:`half_grads_plan` since the last step) is still the step's: the same groups,
    the same parameters with the same grad tensors, the flag on their device, and no first momentum step that may be
    skipped. Every tensor's other properties were checked when it was planned: only identities are compared here,
    each list in one ``map`` (a model's worth of Python calls per step otherwise).
    """
    _, plan = planned
    groups = opt.param_groups
    if len(plan) != len(groups):
        return False
    for planned_group, current in zip(plan, groups):
        if planned_group.group is not current:
            return False
        params, snapshot = current["params"], planned_group.snapshot
        if len(params) != len(snapshot) or not all(map(operator.is_, params, snapshot)):
            return False
        if not all(map(operator.is_, map(_GRAD, planned_group.sources), planned_group.read)):
            return False
        taken = planned_group.params
        if taken and found_inf is not None and found_inf.device != taken[0].device:
            return False
        if _first_momentum_may_skip(opt, update, current, taken, found_inf):
            return False
    return True


def run_kernels(
    update: Update | None,
    kernels: ModuleType,
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    masters: Masters,
    found_inf: torch.Tensor | None,
    grads: list[torch.Tensor] | None = None,
    inv_scale: torch.Tensor | None = None,
    grad_key: tuple[Any, ...] | None = None,
    known: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None,
    prepared: Made | None = None,
) -> None:
    """``update`` ("adam" or "sgd") on ``masters`` through ``kernels``; ``params`` (the optimizer's own) key the
    optimizer's state and hold the grads, unless ``grads`` (times ``inv_scale``) are given. Adam is one launch;
    SGD two when some momentum buffers start. ``grad_key``: the storage key of ``grads``, read when they were
    checked; ``known``: the masters' sizes and data pointers and the weights' pointers, read when they were checked
    (``triton_kernels.adam_``'s and ``sgd_``'s: taken by a launch over the whole list); ``prepared``: the launch's
    tables and states, made and found earlier in this step (:func:`_prepare_launches`), or None."""
    read = grads if grads is not None else [_grad(p) for p in params]
    tables, states = (None, None) if prepared is None else prepared
    if update == "adam":
        inputs, advanced = adam_inputs(opt, group, params, found_inf, kernels, states)
        try:
            kernels.adam_(
                read, masters, *inputs, inv_scale=inv_scale, found_inf=found_inf, grad_key=grad_key, known=known,
                prepared=tables,
            )  # fmt: skip
        except BaseException:
            # Refused before its launch (an optimizer state of other sizes or precision, found when the launch's
            # tables are built): the counts go back to where the step found them, as the rest of the state is.
            if advanced is not None:
                take_back(advanced, found_inf)
            raise
        return
    settings = group_settings(opt, update, group)
    assert isinstance(settings, SgdSettings)
    for first_step, chosen, buffers in sgd_batches(opt, group, params, states):
        whole = len(chosen) == len(params)  # what was read of the grads and masters is of the whole list
        kernels.sgd_(
            read if whole else [read[i] for i in chosen],
            masters.take(chosen),
            buffers,
            settings,
            first_step=first_step,
            inv_scale=inv_scale,
            found_inf=found_inf,
            grad_key=grad_key if whole else None,
            known=known if whole else None,
            prepared=tables if whole else None,
        )


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


# -- torch's optimizer state, for the kernels and for the remainder step on torch's update -----------------------
def adam_state(opt: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """``param``'s state in torch's Adam layout (``Adam._init_group``), created on first use.

    The moments are fp32 (for a bf16 parameter, those of its fp32 master); the step count is on the parameter's
    device when the group is fused or capturable, as torch keeps it.
    """
    state: dict[str, Any] = opt.state[param]
    if not state:
        on_device = group["capturable"] or group["fused"]
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=param.device)
            if on_device
            else torch.tensor(0.0, dtype=torch.get_default_dtype())
        )
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
    return state


#: What an Adam kernel takes besides grads and masters: ``(exp_avgs, exp_avg_sqs, step_scalars, settings)``.
AdamInputs = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, AdamSettings]


def adam_inputs(
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    kernels: ModuleType | None = None,
    states: list[dict[str, Any]] | None = None,
) -> tuple[AdamInputs, torch.Tensor | None]:
    """What an Adam kernel takes besides grads and masters (:data:`AdamInputs`), and the counts advanced for it.

    The step counts advance here (on the device, not where ``found_inf`` is set), as one tensor (:func:`packed_steps`),
    returned second so that a launch refused after this can :func:`take_back` them (None: a
    :class:`KernelOptimizer`'s, which count after the launches). ``kernels``: the fp32-master kernels, where the
    caller has them (else :func:`kernels_for` the counts' device); ``states``: each parameter's state, every one
    made, where the caller found them in this step (else found here).
    """
    own = _kernel_optimizer(opt)
    if own is not None:
        own_settings = own.kernel_settings(group)
        assert isinstance(own_settings, AdamSettings)
        own_avgs, own_avg_sqs, counts = cast(KernelAdamState, own).kernel_adam_state(group, params)
        own_scalars = _scalars(counts, None, own_settings, kernels, advance=False)  # this update's step numbers
        return (own_avgs, own_avg_sqs, own_scalars.to(params[0].device), own_settings), None
    if states is None:
        found = _states_of(opt, params)
        if all(found):  # every state made (each step but the first): no Python call per parameter
            states = cast(list[dict[str, Any]], found)
        else:
            states = [state or adam_state(opt, group, p) for p, state in zip(params, found)]
    steps = packed_steps(states, params[0].device)
    settings = AdamSettings.of(opt, group)
    # The counts advanced by one, and taken back by the flag (on the device), with the scalars.
    scalars = _scalars(steps, found_inf, settings, kernels, advance=True)
    exp_avgs, exp_avg_sqs = list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states))
    return (exp_avgs, exp_avg_sqs, scalars.to(params[0].device), settings), steps


def take_back(steps: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """Undo :func:`adam_inputs`' advance of ``steps`` (one count up, then ``found_inf`` down): exact, the counts
    being whole numbers far below 2**24."""
    steps.sub_(1.0)
    if found_inf is not None:
        steps.add_(found_inf)


def _scalars(
    steps: torch.Tensor,
    found_inf: torch.Tensor | None,
    settings: AdamSettings,
    kernels: ModuleType | None,
    advance: bool,
) -> torch.Tensor:
    """:func:`step_scalars` of ``steps`` advanced by one (``advance``), the counts then taken back by ``found_inf``
    (a flagged step does not count; its scalars are unused). Where the kernels run (``kernels``, else
    :func:`kernels_for` the counts' device): the counts' ``add_``, torch's float64 ``pow`` and one launch for the
    rest (``triton_kernels.step_scalars_``), three launches where the torch ops took eight (seven without a flag),
    each 10-25 us of host time on the H100 checks' hosts; with :data:`POWERS_IN_LAUNCH` on CUDA, one launch
    (``triton_kernels.advance_step_scalars_``)."""
    if kernels is None:
        kernels = kernels_for(steps.device)
    if kernels is None:
        if advance:
            steps.add_(1.0)
        if found_inf is not None:
            steps.sub_(found_inf)  # a one-element flag broadcasts: no reshape op
        return step_scalars(steps, settings.beta1, settings.beta2, settings.lr)
    betas = _betas(steps.device, settings.beta1, settings.beta2)
    if POWERS_IN_LAUNCH and advance and steps.device.type == "cuda":
        return cast(torch.Tensor, kernels.advance_step_scalars_(steps, betas, settings.lr, found_inf))
    if advance:
        steps.add_(1.0)
    powers = torch.pow(betas, steps)
    return cast(torch.Tensor, kernels.step_scalars_(powers, settings.lr, steps, found_inf))


#: Whether an Adam step on CUDA advances its counts and computes their powers in the step scalars' launch
#: (``triton_kernels.advance_step_scalars_``: one launch where the counts' ``add_``, torch's ``pow`` and the scalars'
#: launch are three; the seventeenth session's second H100 check ran the master step with it: 11 device operations
#: a step instead of 13). Off until a GPU check has compared its bits with torch's ``pow``
#: (``tests/test_step_scalars_on_device.py``): libdevice's ``pow`` is the function torch's CUDA ``pow`` calls, but
#: Triton links the libdevice it ships, which need not be the one torch's CUDA build linked, and that check ran the
#: comparison on Triton's interpreter by mistake (a module-scoped fixture had rebuilt the kernels for it), where
#: libdevice has no implementation.
POWERS_IN_LAUNCH = False


#: ``[[beta1], [beta2]]`` in float64 by ``(device, beta1, beta2)``, filled on the device (no host-to-device copy):
#: made on an optimizer's first step, kept while its betas stay (a few optimizers' worth at most).
_BETAS: dict[tuple[torch.device, float, float], torch.Tensor] = {}
_MAX_BETAS = 16


def _betas(device: torch.device, beta1: float, beta2: float) -> torch.Tensor:
    """``[[beta1], [beta2]]`` in float64 on ``device`` (cached: :data:`_BETAS`)."""
    betas = _BETAS.get((device, beta1, beta2))
    if betas is None:
        betas = torch.empty((2, 1), dtype=torch.float64, device=device)
        betas[0].fill_(beta1)
        betas[1].fill_(beta2)
        if len(_BETAS) >= _MAX_BETAS:
            _BETAS.clear()
        _BETAS[device, beta1, beta2] = betas
    return betas


def step_scalars(steps: torch.Tensor, beta1: float, beta2: float, lr: float) -> torch.Tensor:
    """``reference.adam_step_scalars(steps, ...)`` of the 1-D counts ``steps``, the same bits in five kernels where
    the reference takes ten (each a launch, ~5 us of host time on a GPU): both powers in one ``pow`` (it widens the
    counts to float64 exactly, as ``double()`` does), both corrections in one subtraction, and each column written
    into the fp32 table by the op that computes it in float64 (rounded once on the store, as ``float()`` rounds),
    with no ``stack`` or cast after."""
    device = steps.device
    betas = _betas(device, beta1, beta2)
    bias_correction1, bias_correction2 = (1 - torch.pow(betas, steps)).unbind()
    scalars = torch.empty((len(steps), 2), dtype=torch.float32, device=device)
    step_size, bias_correction2_sqrt = scalars.unbind(1)
    torch.mul(bias_correction1.reciprocal(), lr, out=step_size)  # what ``lr / bias_correction1`` runs
    torch.sqrt(bias_correction2, out=bias_correction2_sqrt)
    return scalars


def packed_steps(states: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """The ``step`` counts of ``states`` as one 1-D tensor whose elements the states' ``step`` entries are views of.

    torch keeps a 0-d step count per parameter; advancing 150 of them one by one, and stacking them to compute the
    bias corrections, cost more host time than the rest of the step (0.6 and 0.2 ms on CPU). Views of one tensor
    keep torch's layout (each entry a 0-d tensor of its dtype and device, in ``state_dict`` and checkpoints) and
    make both one op. Entries that are not views of one tensor in this order (a first step, a loaded
    ``state_dict``, another set of parameters with grads) are packed again, values kept.

    The packed counts live on ``device`` (the parameters'), also where torch keeps them on the host (a foreach or
    single-tensor group): the bias corrections are then computed where the kernels read them, with no copy from
    the host per step, and a device overflow flag can hold a count back. torch's own Adam takes counts on the
    device in any mode (``state_dict`` keeps them there; loading keeps a count where it was saved).
    """
    views = list(map(_STEP, states))
    base: torch.Tensor | None = views[0]._base
    if (
        base is not None
        and base.device == device
        and base.dim() == 1
        and base.numel() == len(views)
        and _views_in_order(views, base)
    ):
        return base
    packed = torch.stack([view.reshape(()).to(device) for view in views])
    for state, view in zip(states, packed.unbind()):
        state["step"] = view
    return packed


def _views_in_order(views: list[torch.Tensor], base: torch.Tensor) -> bool:
    # Each entry's data where base's element of its index lies: then advancing base advances the entries (an
    # entry given other memory, ``.data`` assigned or reallocated, has another address). One read per entry.
    start, size = base.data_ptr(), base.element_size()
    return list(map(torch.Tensor.data_ptr, views)) == list(range(start, start + size * len(views), size))


class _FoundStates(NamedTuple):
    """What :func:`_states_of` found for ``params``, and ``opt.state``'s keys and values then."""

    keys: list[torch.Tensor]
    values: list[dict[str, Any]]
    params: list[torch.Tensor]
    found: list[dict[str, Any] | None]


#: Per optimizer, the last :class:`_FoundStates` by the id of its first parameter (one per launch's list). They hold
#: the parameters (fp32 masters) and their state: :func:`forget_states` lets them go when the masters go, and an
#: optimizer's entries are dropped past ``_MAX_FOUND`` (parameters replaced, new groups).
_found_states: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, _FoundStates]] = weakref.WeakKeyDictionary()
_MAX_FOUND = 16


def forget_states(opt: torch.optim.Optimizer) -> None:
    """Drop what :func:`_states_of` and :func:`kernels_taking` kept for ``opt`` (its masters are going back to the
    model's parameters)."""
    _found_states.pop(opt, None)
    _checked.pop(opt, None)


def stateless(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` whose optimizer state is not made yet (all of them at a first step, none after): found
    by :func:`_states_of`, with no Python call per parameter once every state exists."""
    found = _states_of(opt, params)
    if all(found):
        return []
    return [p for p, state in zip(params, found) if not state]


def _states_of(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, Any] | None]:
    """``opt.state``'s entry of each of ``params`` (None where it has none), found by ``id``: a lookup by tensor
    runs ``Tensor.__hash__``, a Python call per parameter per step.

    Kept from the last step over the same parameters while ``opt.state`` holds the same keys mapped to the same
    dicts, in the same order (compared by identity, which is all a lookup relies on: ``opt.state[p] = {}``, a
    deleted entry, ``load_state_dict`` each change a value or a key): three loops in C instead of an index of all
    state rebuilt each step. What the dicts hold is read again by the caller."""
    state = opt.state
    kept = _found_states.get(opt)
    if kept is None:
        kept = _found_states[opt] = {}
    first = id(params[0]) if params else 0
    last = kept.get(first)
    if (
        last is not None
        and len(state) == len(last.keys)
        and len(params) == len(last.params)
        and all(map(operator.is_, params, last.params))
        and all(map(operator.is_, state, last.keys))
        and all(map(operator.is_, state.values(), last.values))
    ):
        return last.found
    by_id: dict[int, dict[str, Any]] = dict(zip(map(id, state), state.values()))
    found = list(map(by_id.get, map(id, params)))
    if first not in kept and len(kept) >= _MAX_FOUND:
        kept.clear()
    kept[first] = _FoundStates(list(state), list(state.values()), list(params), found)
    return found


def sgd_batches(
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    states: list[dict[str, Any]] | None = None,
) -> Iterator[tuple[bool, list[int], list[torch.Tensor]]]:
    """``(first_step, indices into params, momentum buffers)`` per SGD kernel launch.

    With momentum, the parameters without a buffer get torch's ``momentum_buffer`` (fp32) and their own launch
    (the kernel sets a first step's buffer to the grad). Without momentum the buffer lists are empty.

    The parameters that have a buffer come first, and the starting buffers are made only when the caller asks for
    the next batch: the launch over buffers found in ``opt.state`` is the one its tables may refuse (a buffer of
    another dtype or size put there), and a step refused there has then stepped no parameter and made no buffer
    (a buffer left behind would turn the retried step's first momentum step into a later one: ``momentum * 0 +
    (1 - dampening) * grad`` where torch's first step takes the grad itself). The starting buffers are made
    together, so a failed allocation leaves none. ``states``: each parameter's state, where the caller found them in
    this step (else found here).
    """
    momentum = group["momentum"]
    found_states = _states_of(opt, params) if states is None else states
    first = [momentum != 0 and "momentum_buffer" not in (state or {}) for state in found_states]
    later = [i for i, is_first in enumerate(first) if not is_first]
    if later:
        found = cast(list[dict[str, Any]], found_states)  # with momentum, each of these has a buffer
        yield False, later, [found[i]["momentum_buffer"] for i in later] if momentum != 0 else []
    starting = [i for i, is_first in enumerate(first) if is_first]
    if starting:
        buffers = [torch.zeros_like(params[i], dtype=torch.float32) for i in starting]
        for i, buffer in zip(starting, buffers):
            opt.state[params[i]]["momentum_buffer"] = buffer
        yield True, starting, buffers
