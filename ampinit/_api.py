"""``initialize`` and the module-level functions that act on a session (orchestration layer)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import torch
from torch import nn

from ampinit import _registry
from ampinit._distributed import is_sharded
from ampinit._loss_scale import DynamicLossScale
from ampinit._masters import dial_setting, remainder_update
from ampinit._opt_levels import Properties
from ampinit._options import DEFAULT_MAX_LOSS_SCALE, AmpOptions, OptimizerStateName, resolve_options
from ampinit._session import AmpSession, AmpStats
from ampinit._setup import planned_dtypes
from ampinit._types import HALF_DTYPES, MODEL_DTYPES, CastPolicyName, Optimizers, OptLevel

# What initialize returns has the shape it was given: a model or a list of models, and so for optimizers.
_Models = TypeVar("_Models", bound="nn.Module | Sequence[nn.Module]")
_Optimizers = TypeVar("_Optimizers", bound="torch.optim.Optimizer | Sequence[torch.optim.Optimizer]")

_PARALLEL_WRAPPERS: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
_NOT_INITIALIZED = (
    "Invoked `with amp.scale_loss`, but internal Amp state has not been initialized.  "
    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called before `with amp.scale_loss`."
)


# The two overloads give the return type its input's shape; typing needs each to spell out the whole signature,
# so the three signatures below repeat one another by necessity (and must change together).
# opt_level: the overloads take the OptLevel literal, so that mypy flags opt_level="O6" where it is written; the
# implementation takes any str (a level read from a config file) and refuses an unknown one at runtime, by name.
@overload
def initialize(
    models: _Models,
    optimizers: None = None,
    enabled: bool = True,
    opt_level: OptLevel = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | str | None = None,
    loss_scale: float | str | DynamicLossScale | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE,
    *,
    patch_torch_functions_type: torch.dtype | None = None,
    cast_policy: CastPolicyName = "auto",
    allow_banned: bool = False,
    sync_free: bool | None = None,
    skip_nonfinite: bool = True,
    allow_half_model: bool = False,
    stuck_weights_every: int | None = None,
    optimizer_state: OptimizerStateName = "fp32",
) -> _Models: ...


@overload
def initialize(
    models: _Models,
    optimizers: _Optimizers,
    enabled: bool = True,
    opt_level: OptLevel = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | str | None = None,
    loss_scale: float | str | DynamicLossScale | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE,
    *,
    patch_torch_functions_type: torch.dtype | None = None,
    cast_policy: CastPolicyName = "auto",
    allow_banned: bool = False,
    sync_free: bool | None = None,
    skip_nonfinite: bool = True,
    allow_half_model: bool = False,
    stuck_weights_every: int | None = None,
    optimizer_state: OptimizerStateName = "fp32",
) -> tuple[_Models, _Optimizers]: ...


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Optimizers | None = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | str | None = None,
    loss_scale: float | str | DynamicLossScale | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE,
    *,
    patch_torch_functions_type: torch.dtype | None = None,
    cast_policy: CastPolicyName = "auto",
    allow_banned: bool = False,
    sync_free: bool | None = None,
    skip_nonfinite: bool = True,
    allow_half_model: bool = False,
    stuck_weights_every: int | None = None,
    optimizer_state: str = "fp32",
) -> Any:
    """Prepare models and optimizers for mixed-precision training at ``opt_level``.

    Apex's signature, defaults and return shape: give a model (or a list of models) and optionally an optimizer
    (or a list), get back the same shape: ``model``, ``(model, optimizer)``, ``([m1, m2], [o1, o2])``...

    Args:
        models: the ``nn.Module`` (or list) to prepare. Pass it *before* wrapping it in DistributedDataParallel.
        optimizers: the optimizer (or list) that trains them; required for training.
        enabled: ``False`` returns everything untouched and makes ``scale_loss`` a pass-through.
        opt_level: ``"O0"`` (fp32) ... ``"O5"`` (bf16 model, fp32 masters); see docs/opt-levels.md.
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale: overrides of
            the level's properties (``None`` keeps the level's value). Apex's strings are accepted: ``"True"``,
            ``"False"``, ``"128.0"``, ``"dynamic"``. ``loss_scale`` also takes a :class:`DynamicLossScale`.
            ``master_weights="remainder"`` (bf16 models) keeps each fp32 master as the bf16 weight plus its low 16
            bits: 2 bytes per parameter instead of 4, no copy-back pass; ``"remainder8"`` keeps 8 of them (a
            24-bit master, the dropped bits stochastically rounded), ``"stochastic"`` none (the bf16 weight itself,
            updated with stochastic rounding). See docs/precision.md.
        cast_model_outputs: dtype for the model's floating outputs (default: fp32 when the model is cast).
        num_losses: how many losses (``loss_id`` values) get their own loss scaler.
        verbosity: 0 silences ampinit's log messages, 1 logs the option table and overflows.
        min_loss_scale, max_loss_scale: floor and ceiling of the dynamic loss scale.
        patch_torch_functions_type: the O1/O4 cast dtype (``torch.float16`` or ``torch.bfloat16``).
        cast_policy: O1/O4 op lists: ``"apex"`` gives Apex's cast semantics on every device, i.e. PyTorch's
            autocast lists plus the Apex-list ops the device's lists lack (what ``apex.amp.initialize``, ``amp.init``
            and ``ampinit run`` use); ``"auto"`` (default) is ``"apex"`` less the entries measured to change no
            result on the device at the cast dtype, which run as native autocast runs them (on CUDA: ``gelu``,
            nearest ``F.interpolate``, the ``padding="same"`` convolutions, ``nll_loss_nd``, ``linalg_norm``; on
            the CPU none: there it is ``"apex"``); ``"native"`` keeps PyTorch's lists only.
            See docs/cast-policy.md.
        allow_banned: under O1/O4, compute ``binary_cross_entropy`` on half inputs in fp32 instead of raising
            (Apex's ``allow_banned``).
        sync_free: where a dynamic scale's skips are decided. ``None`` (default): on the device wherever reading
            the overflow flag would make the host wait (an accelerator; on the CPU nothing waits, and the host
            decides), except with ``DynamicLossScale(raise_at_min=True)``, which needs the host. ``True``: on the
            device everywhere (``raise_at_min`` is then refused). ``False``: on the host, one sync per step, Apex's
            way. A device decision goes straight into optimizers that can skip inside their own kernel
            (``torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)``, ``ampinit.optimizers``, amp's master and kernel
            steps); other optimizers still read it once per step. Its overflow line is written when the flag
            reaches the host, a step or two later (or at ``stats()``/``close()``). A static scale is always decided
            on the device.
        skip_nonfinite: ``True`` (default): at every level, an ``optimizer.step()`` whose gradients from
            ``scale_loss`` hold inf/NaN is skipped (weights and optimizer state unchanged), also with a static
            loss scale and at O0/O3/O4. ``False``: a static loss scale behaves as in Apex, which never checks:
            every step is taken, inf/NaN included (O0/O3/O4 then do nothing at ``scale_loss``). A dynamic
            scale always skips overflowing steps, whatever this is.
        allow_half_model: accept models whose weights or buffers are already fp16 (Apex's
            ``_amp_state.allow_incoming_model_not_fp32``). By default an fp16 model is refused, as in Apex,
            because it usually means ``.half()`` was called by mistake before ``initialize``; bf16 and fp32
            weights are always accepted.
        stuck_weights_every: ``N`` measures, at every N-th ``step()`` of each optimizer, the fraction of each
            parameter tensor's elements whose nonzero update left the weight's bits unchanged (rounded away in
            its dtype): ``amp.stats().stuck_weights``, and a log line naming the tensors at 50% or more. Measuring
            steps snapshot the weights and masters and read the counts once; other steps pay nothing. ``None``
            (default): off.
        optimizer_state: how the moments of Adam/AdamW (``exp_avg``, ``exp_avg_sq``) and SGD's momentum are
            stored between steps: ``"fp32"`` (torch's), ``"bf16"`` (stochastically rounded) or ``"8bit"``
            (block-wise quantized). Not fp32 needs master weights (O2/O5, or a ``master_weights`` setting).
            The random bits of stochastic rounding are seeded from ``torch.initial_seed()`` here and saved in the
            optimizer's ``state_dict``, so runs repeat and resume bitwise. See docs/precision.md.

    Returns:
        The models and optimizers, in the shape they were given (lists stay lists; Apex refuses tuples, and so
        does this, although the type accepts any sequence). Optimizers are the same objects; with master
        weights their param groups now hold fp32 masters.
    """
    options = resolve_options(
        enabled=enabled,
        opt_level=opt_level,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        patch_torch_functions_type=patch_torch_functions_type,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        cast_policy=cast_policy,
        allow_banned=allow_banned,
        sync_free=sync_free,
        skip_nonfinite=skip_nonfinite,
        allow_half_model=allow_half_model,
        stuck_weights_every=stuck_weights_every,
        optimizer_state=optimizer_state,
    )
    model_list, models_were_list = _as_list(
        models, nn.Module, "models must be either a single model or a list of models."
    )
    optimizer_list, optimizers_were_list = _as_optimizer_list(optimizers)
    _check_objects(model_list, optimizer_list, options)
    session = AmpSession(model_list, optimizer_list, options)
    _registry.register(session, [*model_list, *optimizer_list])
    return _same_shape(models, optimizers, model_list, optimizer_list, models_were_list, optimizers_were_list)


# -- argument checks --------------------------------------------------------------------------------------------
def _check_objects(models: list[nn.Module], optimizers: list[torch.optim.Optimizer], options: AmpOptions) -> None:
    """Refuse models and optimizers that the session could not take, before anything is changed."""
    _check_ownership(models, optimizers)
    if not options.enabled:
        return
    _check_models(models, options.allow_half_model)
    _check_sharding(models, options.properties)
    _check_sparse(models, options.properties)
    _check_optimizers(optimizers)
    _check_master_params_not_shared(models, optimizers, options.properties)
    if options.properties.remainder_masters or options.optimizer_state != "fp32":  # optimizers it has no update for
        setting = dial_setting(options.properties.master_weights, options.optimizer_state)
        for opt in optimizers:
            remainder_update(opt, setting)


def _as_list(value: Any, kind: type, message: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list) and all(isinstance(v, kind) for v in value):
        return list(value), True
    wrong = next((v for v in value if not isinstance(v, kind)), value) if isinstance(value, list) else value
    received = f"{type(wrong).__module__}.{type(wrong).__qualname__}"
    hint = ""
    if isinstance(wrong, (nn.Module, torch.optim.Optimizer)):
        hint = " (are the arguments swapped? The order is amp.initialize(models, optimizers, ...))"
    raise TypeError(f"{message} Received {received}{' in the list' if wrong is not value else ''}{hint}")


def _as_optimizer_list(optimizers: Any) -> tuple[list[torch.optim.Optimizer], bool]:
    if optimizers is None:
        return [], False
    optimizer_list, were_list = _as_list(
        optimizers,
        torch.optim.Optimizer,
        "optimizers must be either a single optimizer or a list of optimizers.",
    )
    seen: set[int] = set()
    for opt in optimizer_list:
        if id(opt) in seen:
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
        seen.add(id(opt))
    return optimizer_list, were_list


def _check_models(models: list[nn.Module], allow_half_model: bool = False) -> None:
    for model in models:
        if isinstance(model, _PARALLEL_WRAPPERS):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model)}. Parallel wrappers should only be applied to the "
                "model(s) AFTER \nthe model(s) have been returned from amp.initialize."
            )
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, tensor in named:
                if tensor.dtype == torch.float16 and not allow_half_model:
                    raise RuntimeError(
                        f"Found {kind} {name} with type {tensor.type()}, expected torch.FloatTensor.\n"
                        "When using amp.initialize, you do not need to call .half() on your model\n"
                        "before passing it, no matter what optimization level you choose.\n"
                        "To train a model that is fp16 on purpose, pass allow_half_model=True (Apex: set "
                        "amp._amp_state.allow_incoming_model_not_fp32 = True)."
                    )


def _check_sharding(models: list[nn.Module], properties: Properties) -> None:
    casts_weights = properties.model_dtype in HALF_DTYPES or properties.uses_master_weights
    if not casts_weights or not any(is_sharded(p) for m in models for p in m.parameters()):
        return
    raise RuntimeError(
        f"opt_level {properties.opt_level} casts the model's weights (and keeps fp32 master weights outside it), "
        "which cannot work with parameters sharded by FSDP2 (fully_shard): FSDP owns those shards. Use FSDP2's "
        "own mixed precision instead, fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)): its sharded fp32 parameters are the master copy, the O2/O5 equivalent at "
        "scale. Combine it with opt_level='O1' or 'O4' (a cast policy and loss scaling on top); not with 'O0', which "
        "casts the model's inputs back to fp32 after FSDP's hook cast them to its param_dtype."
    )


def _check_sparse(models: list[nn.Module], properties: Properties) -> None:
    """Master weights take dense grads: an embedding with sparse grads is refused at O2/O5, where its fp32 master
    would be handed a sparse half grad (the levels without masters check and unscale sparse grads' values)."""
    if not properties.uses_master_weights:
        return
    for model in models:
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
                raise ValueError(
                    f"opt_level {properties.opt_level} keeps fp32 master weights, which take dense gradients only: "
                    f"{name or 'the model'} is {type(module).__name__}(sparse=True), whose gradient is sparse. "
                    "Construct it with sparse=False, or use O1/O4 (fp32 weights), which take sparse gradients."
                )


def _check_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if param.dtype not in MODEL_DTYPES:
                    raise TypeError(
                        f"Optimizer's parameters must be float32, float16 or bfloat16 tensors. Received {param.type()}"
                    )


def _check_master_params_not_shared(
    models: list[nn.Module], optimizers: list[torch.optim.Optimizer], properties: Properties
) -> None:
    """With master weights, refuse a half parameter listed twice in the optimizers (two optimizers, or twice in one).

    Each listing would get its own fp32 master (or the second none), stepped by one optimizer only: the model
    weight would take one update per step (whichever copy-back came last) where plain torch applies both. fp32
    parameters (BatchNorm kept fp32, parameters outside the models) have no master and may be shared, as in torch.
    """
    if not properties.uses_master_weights:
        return
    planned = planned_dtypes(models, properties)
    owner: dict[int, int] = {}  # id(param) -> the index of the first optimizer that lists it
    for index, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for param in group["params"]:
                if planned.get(id(param), param.dtype) not in HALF_DTYPES:
                    continue
                first = owner.get(id(param))
                if first is None:
                    owner[id(param)] = index
                    continue
                where = f"twice in optimizer {index}" if first == index else f"in optimizers {first} and {index}"
                raise RuntimeError(
                    f"Parameter {_param_name(models, param)} appears {where} ({type(opt).__name__}). With master "
                    f"weights (opt_level {properties.opt_level}) each listing would get its own fp32 master, stepped "
                    "by its own optimizer only, so the model would not train as plain torch does (one of the "
                    "updates would be lost). List each parameter in one optimizer, once (param groups take "
                    "different hyperparameters)."
                )


def _param_name(models: list[nn.Module], param: torch.Tensor) -> str:
    """``param``'s name in the models (prefixed by the model's position when there are several), or its shape."""
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            if p is param:
                return repr(f"{i}.{name}" if len(models) > 1 else name)
    return f"of shape {tuple(param.shape)}"


def _check_ownership(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    for obj in (*models, *optimizers):
        owner = _owner(obj)
        # A disabled session changed nothing (Apex's enabled=False returns its arguments at once), so it does not
        # hold its objects: initialize may take them again, and the new session becomes their owner.
        if owner is not None and not owner.closed and owner.enabled:
            kind = "model" if isinstance(obj, nn.Module) else "optimizer"
            raise RuntimeError(
                f"This {kind} ({type(obj).__name__}) already belongs to a live amp session ({owner!r}). "
                "Call ampinit.deinitialize() (or session.close()) before initializing it again."
            )


def _same_shape(
    models: Any,
    optimizers: Any,
    model_list: list[nn.Module],
    optimizer_list: list[torch.optim.Optimizer],
    models_were_list: bool,
    optimizers_were_list: bool,
) -> Any:
    out_models: Any = model_list if models_were_list else model_list[0]
    if optimizers is None:
        return out_models
    out_optimizers: Any = optimizer_list if optimizers_were_list else optimizer_list[0]
    return out_models, out_optimizers


# -- module-level functions (Apex's global API) --------------------------------------------------------------------
def current_session() -> AmpSession | None:
    """The most recent open session (the one module-level functions act on), or ``None``."""
    session = _registry.current()
    return session if isinstance(session, AmpSession) else None


def session_of(obj: nn.Module | torch.optim.Optimizer) -> AmpSession | None:
    """The open session that owns ``obj`` (a model or an optimizer), or ``None``."""
    return _owner(obj)


def _owner(obj: object) -> AmpSession | None:
    session = _registry.owner_of(obj)
    return session if isinstance(session, AmpSession) else None


def _require_session(what: str) -> AmpSession:
    session = current_session()
    if session is None:
        raise RuntimeError(f"{what} needs an amp session: call ampinit.initialize(model, optimizer, ...) first.")
    return session


def scale_loss(
    loss: torch.Tensor,
    optimizers: Optimizers,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Context manager yielding ``loss`` times the loss scale; call ``backward()`` on what it yields.

    On exit the gradients of ``optimizers``' parameters are unscaled (into fp32 master grads with master
    weights) and checked for inf/NaN; an overflow makes the next ``optimizer.step()`` a skipped step and
    backs the dynamic scale off.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer (or list) whose parameters receive this backward's gradients.
        loss_id: which loss scaler to use, in ``[0, num_losses)``.
        model: unused, reserved (Apex's signature).
        delay_unscale: leave the gradients scaled, to accumulate several backward passes; the last block
            before ``step()`` must not set it.
        delay_overflow_check: decide the skip and the scale update at ``optimizer.step()`` instead of here.
    """
    session = _session_for_optimizers(optimizers)
    return session.scale_loss(loss, optimizers, loss_id, model, delay_unscale, delay_overflow_check)


def _session_for_optimizers(optimizers: object) -> AmpSession:
    opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    owners = {id(s): s for s in (_owner(o) for o in opts) if s is not None}
    if len(owners) > 1:
        raise RuntimeError("scale_loss was given optimizers from different amp sessions; use one block per session.")
    if owners:
        return next(iter(owners.values()))
    session = current_session()
    if session is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return session


def disable_casts() -> contextlib.AbstractContextManager[None]:
    """A region where the O1/O4 cast policy does not apply; restored on exit, also when the body raises."""
    return _require_session("disable_casts()").disable_casts()


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state in Apex's format (``{'loss_scaler0': {'loss_scale': ..., 'unskipped': ...}}``)."""
    return _require_session("amp.state_dict()").state_dict(destination)


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore :func:`state_dict` output (also Apex's) into the current session's loss scalers."""
    _require_session("amp.load_state_dict()").load_state_dict(state_dict)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` updates: the fp32 masters with master weights, else the model's own.

    ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)`` therefore clips the unscaled
    gradients the step will use: the fp32 master grads that amp's kernel step reads from the half grads are
    written when this is first iterated. Where the masters live in the bf16 weights (``master_weights="remainder"``,
    ``"remainder8"``, ``"stochastic"``) they are fp32 tensors made when asked, with fp32 grads, which the next step
    takes as its masters and grads. :func:`clip_grad_norm_` clips the same grads without making either.
    """
    _check_optimizer_like(optimizer, "master_params")
    session = _owner(optimizer)
    if session is not None:
        yield from session.master_params(optimizer)
        return
    for group in optimizer.param_groups:
        yield from group["params"]


def clip_grad_norm_(
    optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients ``optimizer``'s next step applies to a total norm of at most ``max_norm``, and return
    their total norm before clipping (as torch's ``clip_grad_norm_`` does).

    The same result as Apex's pattern, ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm,
    norm_type, error_if_nonfinite)``, at every level: call it where that goes, after the ``scale_loss`` block (the
    last one when accumulating) and before ``optimizer.step()``.

    Where O2/O5's step takes amp's kernels (CUDA), no fp32 master grad is written: the norm is taken from the half
    grads and the clip joins the multiplier the kernels apply to them (18 bytes per parameter less traffic, 4 less
    memory). With the masters in the bf16 weights (``master_weights="remainder"``, ``"remainder8"``,
    ``"stochastic"``) no fp32 master is made either, and the step stays in the kernels. Norms of order 1, 2 and inf
    with a power-of-two loss scale (every dynamic scale, and 1) give Apex's pattern's bits this way; other orders
    and scales run that pattern. See docs/opt-levels.md, "Clipping".

    Raises ``ValueError`` for a ``max_norm`` that is not a number >= 0 or a ``norm_type`` that is not a number,
    before anything is read or written.
    """
    _check_optimizer_like(optimizer, "clip_grad_norm_")
    limit, order = _number(max_norm, "max_norm"), _number(norm_type, "norm_type")
    if not limit >= 0.0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping, only the norm). Received {max_norm!r}")
    session = _owner(optimizer)
    if session is not None:
        total = session.clip_grad_norm_(optimizer, limit, order, error_if_nonfinite)
        if total is not None:
            return total
    return torch.nn.utils.clip_grad_norm_(list(master_params(optimizer)), limit, order, error_if_nonfinite)


def _check_optimizer_like(optimizer: object, what: str) -> None:
    # Anything with param_groups passes (Apex's LARC and FP16_Optimizer wrappers are not torch Optimizers).
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"amp.{what} takes the optimizer (a torch.optim.Optimizer, with param_groups), got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )


def _number(value: object, name: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number. Received {value!r}") from None


def deinitialize() -> None:
    """Close the most recent session (see :meth:`AmpSession.close`); a no-op when there is none."""
    session = current_session()
    if session is not None:
        session.close()


def stats() -> AmpStats:
    """Counters of the current session: steps, skipped steps, the last step's fate, scales per loss, and the last
    stuck-weight measurement (``initialize(stuck_weights_every=N)``)."""
    return _require_session("amp.stats()").stats()


def step_was_skipped(optimizer: torch.optim.Optimizer | None = None) -> bool:
    """Whether the last ``optimizer.step()`` (of ``optimizer``, or of any) skipped because of inf/NaN grads."""
    session = _owner(optimizer) if optimizer is not None else None
    return (session or _require_session("amp.step_was_skipped()")).step_was_skipped(optimizer)
