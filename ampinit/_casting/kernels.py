"""The extra autocast kernels: one per aten overload that a device's native lists lack for Apex's semantics.

Each kernel sits on the device's autocast dispatch key (``AutocastCPU``, ``AutocastCUDA``, ...), casts the op's
floating inputs by its policy (``lists.plan`` says which ops get which), and redispatches below autocast. The
kernels are process-wide, like any dispatcher registration: :data:`KERNELS` registers them when the first
``apex`` or ``auto`` policy on a device activates (``auto`` leaves out the overloads ``lists.unchanged`` names),
counts the holders, and removes them with the last one. They cast only where such a policy is the innermost one
on (``scopes.innermost``); elsewhere they behave as the device's native autocast does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._C import DispatchKey, DispatchKeySet

from ampinit._casting import arguments, fused_gelu, scopes
from ampinit._casting.lists import (
    BANNED_BCE_MESSAGE,
    DEFAULT_LISTS,
    NATIVE_BCE_MESSAGE,
    ApexLists,
    Policy,
    plan,
)
from ampinit._types import HALF_DTYPES

if TYPE_CHECKING:
    from ampinit._casting.policy import CastPolicy

# The overloads :meth:`_Kernels.restricted_to` lets sessions register (None: the whole plan).
_Only = frozenset[torch._ops.OpOverload] | None

# Device types whose autocast dispatch key this torch build defines (the keys the extra kernels go to).
AUTOCAST_KEYS: dict[str, str] = {
    device: key
    for device, key in {
        "cpu": "AutocastCPU",
        "cuda": "AutocastCUDA",
        "xpu": "AutocastXPU",
        "mps": "AutocastMPS",
        "hpu": "AutocastHPU",
        "ipu": "AutocastIPU",
        "privateuseone": "AutocastPrivateUse1",
    }.items()
    if hasattr(DispatchKey, key)
}


def _explicit_dtype(op: torch._ops.OpOverload) -> Callable[[tuple[Any, ...], dict[str, Any]], bool] | None:
    """Whether a call passes the op's optional ``dtype`` argument (such calls are left alone, as autocast does).

    None for ops without one, so that their kernels skip the test.
    """
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == "dtype":
            if argument.kwarg_only:
                return lambda args, kwargs: kwargs.get("dtype") is not None
            return lambda args, kwargs: (
                kwargs.get("dtype") is not None or (len(args) > position and args[position] is not None)
            )
    return None


def _tensor_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, ...], frozenset[str]]:
    """Positions and names of the op's Tensor-typed arguments (``Tensor``, ``Tensor?``, ``Tensor[]``...).

    Read once from the schema, so that a call casts only those instead of inspecting every argument.
    """
    positions, names = [], []
    for position, argument in enumerate(op._schema.arguments):
        if "Tensor" in str(argument.type):
            positions.append(position)
            names.append(argument.name)
    return tuple(positions), frozenset(names)


def _apex_policy() -> CastPolicy | None:
    """The innermost policy when it adds Apex's entries, ``"apex"`` or ``"auto"`` (None: behave as the device's
    native autocast). An ``"auto"`` session holds only the kernels of the entries it keeps, so a registered kernel
    casts for both."""
    policy = scopes.innermost()
    return policy if policy is not None and policy.policy != "native" else None


def make_kernel(op: torch._ops.OpOverload, policy: Policy, device_type: str) -> Callable[..., Any]:
    """The autocast kernel of ``op`` on ``device_type``: cast by ``policy``, then run ``op`` below autocast.

    These run on every call of a listed op, so each does the least it can in Python: the schema is read here,
    once, a call only looks at its Tensor-typed arguments, and everything a call needs is a closure variable.
    """
    run = _runner(op, device_type)
    if policy == "promote":
        return _promote_kernel(run)
    if policy == "banned":
        return _banned_kernel(run)
    if op is _GELU and policy == "fp32":
        return _fp32_gelu_kernel(run)
    return _fixed_dtype_kernel(run, lower=policy == "lower")


_GELU = torch.ops.aten.gelu.default


class _Runner(NamedTuple):
    """One op's two ways to run below the device's autocast key: as called, or with its Tensor arguments cast."""

    op: torch._ops.OpOverload
    device_type: str
    below: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    cast: Callable[[torch.dtype, bool, tuple[Any, ...], dict[str, Any]], Any]


def _runner(op: torch._ops.OpOverload, device_type: str) -> _Runner:
    excluded = DispatchKeySet(getattr(DispatchKey, AUTOCAST_KEYS[device_type]))
    guard = torch._C._ExcludeDispatchKeyGuard
    tensor_positions, tensor_names = _tensor_arguments(op)
    cast_all = arguments.cast_all

    def below(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with guard(excluded):
            return op(*args, **kwargs)

    def cast(dtype: torch.dtype, lower: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cast_args = list(args)
        count = len(cast_args)
        for position in tensor_positions:
            if position < count:
                cast_args[position] = cast_all(cast_args[position], dtype, device_type, lower=lower)
        if kwargs:
            kwargs = {
                k: cast_all(v, dtype, device_type, lower=lower) if k in tensor_names else v for k, v in kwargs.items()
            }
        with guard(excluded):
            return op(*cast_args, **kwargs)

    return _Runner(op, device_type, below, cast)


def _fixed_dtype_kernel(run: _Runner, *, lower: bool) -> Callable[..., Any]:
    """``lower`` (to the autocast dtype) or fp32; calls that pass the op's own ``dtype`` are left alone."""
    explicit_dtype = _explicit_dtype(run.op)
    below, cast, device_type = run.below, run.cast, run.device_type

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _apex_policy() is None or (explicit_dtype is not None and explicit_dtype(args, kwargs)):
            return below(args, kwargs)
        return cast(torch.get_autocast_dtype(device_type) if lower else torch.float32, lower, args, kwargs)

    return kernel


def _fp32_gelu_kernel(run: _Runner) -> Callable[..., Any]:
    """Apex's fp32 ``gelu``: for a half input, by ``fused_gelu``'s one-pass kernels where they give these bits."""
    unfused = _fixed_dtype_kernel(run, lower=False)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _apex_policy() is not None and len(args) == 1:
            result = fused_gelu.gelu(args[0], kwargs.get("approximate", "none"))
            if result is not None:
                return result
        return unfused(*args, **kwargs)

    return kernel


def _promote_kernel(run: _Runner) -> Callable[..., Any]:
    """Mixed floating inputs are cast to the widest of them."""
    below, cast, device_type = run.below, run.cast, run.device_type

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _apex_policy() is not None:
            dtypes = arguments.floating_dtypes((*args, *kwargs.values()), device_type)
            if len(dtypes) > 1:
                return cast(arguments.widest(dtypes), False, args, kwargs)
        return below(args, kwargs)

    return kernel


def _banned_kernel(run: _Runner) -> Callable[..., Any]:
    """Apex's banned ops (``binary_cross_entropy``): refused on half inputs unless ``allow_banned``, then fp32."""
    below, cast, device_type = run.below, run.cast, run.device_type

    def kernel(*args: Any, **kwargs: Any) -> Any:
        policy = _apex_policy()
        if policy is None:  # what the device's own autocast kernel does
            if device_type != "cpu":
                raise RuntimeError(NATIVE_BCE_MESSAGE)
            return cast(torch.float32, False, args, kwargs)
        dtypes = arguments.floating_dtypes((*args, *kwargs.values()), device_type)
        if any(dtype in HALF_DTYPES for dtype in dtypes):
            if not policy.allow_banned:
                # A deliberate refusal, with Apex's exception type and message (code may catch either).
                raise NotImplementedError(BANNED_BCE_MESSAGE)
            return cast(torch.float32, False, args, kwargs)
        return below(args, kwargs)

    return kernel


class _Held(NamedTuple):
    """One device type's registered kernels and what every session sharing them must agree on."""

    library: torch.library.Library
    lists: ApexLists
    only: _Only
    left_out: frozenset[str]
    holder: str  # the first holder's policy, for a refusal's message
    holders: int


class _Kernels:
    """The extra autocast kernels, one ``torch.library.Library`` per device type, reference-counted.

    All the sessions holding a device's kernels share them, so they must agree on Apex's lists, on the overloads
    left out (``cast_policy="auto"``'s measured set), and on the restriction of :meth:`restricted_to`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: dict[str, _Held] = {}
        self._only: _Only = None

    def registered(self) -> dict[str, int]:
        """Device type -> how many active policies hold its kernels."""
        with self._lock:
            return {device: held.holders for device, held in self._libraries.items()}

    @contextlib.contextmanager
    def restricted_to(self, overloads: Collection[torch._ops.OpOverload]) -> Iterator[None]:
        """Inside the block, ``"apex"`` sessions register only ``overloads`` of each device's plan.

        "Native autocast plus a chosen few of Apex's entries", for ``benchmarks/cast_list_effect.py``, which
        measures what each entry changes. Not a user option: the lists stay Apex's. A session opened inside
        keeps its kernels until it closes, and sessions with and without the restriction cannot be open at once
        (the same refusal as for differing lists).
        """
        bad = next((op for op in overloads if not isinstance(op, torch._ops.OpOverload)), None)
        if bad is not None:
            raise TypeError(f"restricted_to() takes aten overloads (torch.ops.aten.<op>.<overload>), got {bad!r}")
        with self._lock:
            if self._only is not None:
                raise RuntimeError("KERNELS.restricted_to() is already in force: restrictions do not nest")
            self._only = frozenset(overloads)
        try:
            yield
        finally:
            with self._lock:
                self._only = None

    def acquire(
        self,
        device_type: str,
        lists: ApexLists = DEFAULT_LISTS,
        *,
        left_out: frozenset[str] = frozenset(),
        holder: str = "cast_policy='apex'",
        dtype: torch.dtype | None = None,
    ) -> None:
        """Hold ``device_type``'s kernels: Apex's ``lists`` less the overloads named in ``left_out`` (``str(op)``).

        ``holder`` says which policy asks (``"cast_policy='auto' (torch.bfloat16)"``), for the refusal when the
        kernels already registered differ; ``dtype`` is what it casts to, for the fused gelu's check.
        """
        if (
            dtype is not None
            and fused_gelu.runs_on_type(device_type)
            and _registers_fp32_gelu(device_type, lists, self._only, left_out)
        ):
            # Now, at initialize(), rather than at the first gelu: the check reads its verdict on the host. Before
            # the kernels are taken, so that nothing is held if it fails.
            fused_gelu.prepare(device_type, dtype)
        self._acquire(device_type, lists, left_out, holder)

    def _acquire(self, device_type: str, lists: ApexLists, left_out: frozenset[str], holder: str) -> None:
        with self._lock:
            held = self._libraries.get(device_type)
            if held is None:
                library = _register(device_type, lists, self._only, left_out)
                self._libraries[device_type] = _Held(library, lists, self._only, left_out, holder, 1)
            else:
                self._share(device_type, held, lists, left_out, holder)
                return
        # Outside the lock: a reset runs torch's own callbacks.
        _forget_compiled_graphs()

    def _share(self, device_type: str, held: _Held, lists: ApexLists, left_out: frozenset[str], holder: str) -> None:
        """Count one more holder of the kernels ``held`` (under the lock), refusing one that disagrees."""
        if held.only != self._only:
            raise RuntimeError(
                f"An O1/O4 session is open on {device_type!r} with "
                f"{'all' if held.only is None else 'a restricted set of'} Apex's kernels; KERNELS.restricted_to() "
                "changes which are registered, so close that session first."
            )
        if held.lists != lists:
            raise RuntimeError(
                f"apex.amp.lists differ from those of the O1/O4 session already open on {device_type!r}: "
                "the lists are read at initialize() and shared by all open sessions. Close the open session "
                "before initializing with edited lists, or edit them before the first initialize()."
            )
        if held.left_out != left_out:
            differing = ", ".join(sorted(held.left_out ^ left_out))
            raise RuntimeError(
                f"An O1/O4 session with {holder} cannot open on {device_type!r} while one with {held.holder} is "
                f"open there: they register different sets of Apex's kernels (differing: {differing}), and a "
                "device's kernels are shared by all its sessions. Close the open session first, or initialize "
                "with the same cast_policy and dtype."
            )
        self._libraries[device_type] = held._replace(holders=held.holders + 1)

    def release(self, device_type: str) -> None:
        with self._lock:
            held = self._libraries[device_type]
            if held.holders > 1:
                self._libraries[device_type] = held._replace(holders=held.holders - 1)
                return
            del self._libraries[device_type]
            held.library._destroy()  # type: ignore[no-untyped-call]
        _forget_compiled_graphs()


def _forget_compiled_graphs() -> None:
    """Drop torch.compile's compiled code: the kernels on the autocast key changed.

    A graph captured with AOT autograd (``aot_eager``, inductor) has the autocast kernels' casts traced into it,
    and Dynamo guards on the autocast state, not on which kernels the dispatcher holds. Without this, a model
    compiled under one cast policy (say ``"native"``) kept its casts in a later session with another
    (``"apex"``: softmax in fp16 where the eager model gives fp32), and a graph traced with the kernels ran
    after they were gone. Nothing to do while nothing imported Dynamo.
    """
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


def _registers_fp32_gelu(device_type: str, lists: ApexLists, only: _Only, left_out: frozenset[str]) -> bool:
    return (
        plan(AUTOCAST_KEYS[device_type], lists).get(_GELU) == "fp32"
        and (only is None or _GELU in only)
        and str(_GELU) not in left_out
    )


def _register(
    device_type: str, lists: ApexLists, only: _Only = None, left_out: frozenset[str] = frozenset()
) -> torch.library.Library:
    key = AUTOCAST_KEYS[device_type]
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():
            # Replacing the banned ops' native kernel (binary_cross_entropy: fp32 on CPU, an error on CUDA) is
            # the point; the dispatcher warns about it, once per process, and restores the native kernel when
            # the library is destroyed. The plan overrides no other native kernel.
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for op, policy in plan(key, lists).items():
                if (only is not None and op not in only) or str(op) in left_out:
                    continue
                library.impl(op, make_kernel(op, policy, device_type), key)  # type: ignore[no-untyped-call]
    except BaseException:
        library._destroy()  # type: ignore[no-untyped-call]
        raise
    return library


KERNELS = _Kernels()
