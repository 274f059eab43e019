"""Casting a model's weights (O0/O2/O3/O5) and its forward's inputs and outputs, reversibly.

Apex rebound ``model.forward``; ampinit uses module hooks (decision 3), which ``close()`` removes. Weights are
converted in place (``param.data = ...``), so every ``Parameter`` object keeps its identity and optimizers that
already hold it stay valid.
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from ampinit._hooks import SessionHook

MasterLookup = Callable[[torch.Tensor], "torch.Tensor | None"]
# (parameter, fp32 value being loaded) -> the half value torch should load instead, or None (see ModelCast).
MasterLoader = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``.

    Recurses into lists, tuples, namedtuples (``PackedSequence`` included), sets, deques and mappings (as Apex's
    applier recursed into every iterable); anything else passes through. Unlike Apex's applier, a namedtuple keeps
    its type and a dict subclass keeps its own type when it can.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return _rebuilt_mapping(value, {k: cast_floating(v, dtype) for k, v in value.items()})
    return value


def _rebuilt_mapping(value: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``value``'s type holding ``items``: a shallow copy given the new values where the mapping takes them.

    Calling ``type(value)(items)`` is not a copy for every mapping: a ``defaultdict`` refuses it, a ``UserDict``
    subclass loses its attributes, and Hugging Face's ``ModelOutput`` (a dataclass over an ``OrderedDict``) reads
    the dict as its first field, which stays bound to the whole dict when that field was ``None``.
    """
    if type(value) is dict:
        return items
    if isinstance(value, MutableMapping):
        try:
            rebuilt = copy.copy(value)
            for key, item in items.items():
                rebuilt[key] = item
        except Exception:  # a mapping that cannot be copied or written: rebuilt from its items below
            pass
        else:
            return rebuilt
    try:
        return cast(Any, type(value))(items)
    except TypeError:
        return items


def _keeps_fp32(module: nn.Module, keep_batchnorm_fp32: bool) -> bool:
    # Apex keeps only *affine* BatchNorm in fp32 (its convert_network rule); non-affine BN buffers are cast.
    return keep_batchnorm_fp32 and isinstance(module, _BatchNorm) and module.affine


def plan(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> dict[int, torch.dtype]:
    """Which parameters and buffers (by ``id``) :class:`ModelCast` would convert, and to what."""
    targets: dict[int, torch.dtype] = {}
    for module in model.modules():
        if _keeps_fp32(module, keep_batchnorm_fp32):
            continue
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                targets[id(tensor)] = dtype
    return targets


class ModelCast:
    """One model's cast to ``dtype``: weights, forward hooks and state-dict hooks, all undoable."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | None,
        keep_batchnorm_fp32: bool,
        output_dtype: torch.dtype | None,
        master_of: MasterLookup,
        guard_device: bool = False,
        load_master: MasterLoader | None = None,
    ) -> None:
        self.model = model
        # Masters that are not tensors of their own (remainder masters) are loaded through this callback.
        self._load_master = load_master
        # Refuse a forward after the model moved devices (the session asks for it when fp32 masters would stay
        # behind, or when a cast policy chose its devices from where the model was).
        self.guard_device = guard_device
        self.dtype = dtype
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.output_dtype = output_dtype
        self._master_of = master_of
        # id(module) -> (module, {attribute name: (is a parameter, dtype before the cast)})
        self._original: dict[int, tuple[nn.Module, dict[str, tuple[bool, torch.dtype]]]] = {}
        self._handles: list[RemovableHandle] = []
        # One parameter and the device it had at initialize(): a forward that finds it elsewhere means the model
        # was moved after initialize(), leaving the fp32 masters (and the optimizer's state) on the old device.
        self._probe: tuple[nn.Module, str, torch.device] | None = None

    # -- apply / undo -------------------------------------------------------------------------------------
    def apply(self) -> None:
        if self.guard_device:
            # Looked up by name at each check: a move between tensor types (to "meta", say) replaces Parameters.
            for owner in self.model.modules():
                name, probe = next(((n, p) for n, p in owner._parameters.items() if p is not None), ("", None))
                if probe is not None:
                    self._probe = (owner, name, probe.device)
                    break
        if self.dtype is not None:
            self._cast_weights(self.dtype)
            self._handles.append(self.model.register_forward_pre_hook(SessionHook(self._cast_inputs), with_kwargs=True))
            to_original = SessionHook(self._state_dict_to_original_dtype)
            into_masters = SessionHook(self._load_into_masters)
            for module in self.model.modules():
                self._handles.append(_register_state_dict_post_hook(module, to_original))
                self._handles.append(_register_load_state_dict_pre_hook(module, into_masters))
        elif self._probe is not None:
            self._handles.append(self.model.register_forward_pre_hook(SessionHook(self._check_device)))
        if self.output_dtype is not None:
            self._handles.append(self.model.register_forward_hook(SessionHook(self._cast_outputs)))

    def undo(self, master_values: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Remove the hooks and give every weight its original dtype back (from its master when it has one)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        restored: set[int] = set()
        with torch.no_grad():
            for module, originals in self._original.values():
                for name, (is_param, dtype) in originals.items():
                    if is_param:
                        param = module._parameters[name]
                        assert param is not None
                        if id(param) in restored:  # a tied weight, already given its master's value
                            continue
                        restored.add(id(param))
                        master = master_values(param)
                        param.data = master.detach().to(dtype) if master is not None else param.data.to(dtype)
                        if param.grad is not None:
                            param.grad = param.grad.to(dtype)
                    else:
                        buffer = module._buffers[name]
                        assert buffer is not None
                        module._buffers[name] = buffer.to(dtype)
        if self._original:
            # The weights got new storage: regroup RNN weights into one cuDNN buffer, or every later forward on
            # CUDA warns that they are "not part of single contiguous chunk of memory" (and runs slower).
            _flatten_rnns(self.model)
        self._original.clear()

    def _cast_weights(self, dtype: torch.dtype) -> None:
        targets = plan(self.model, dtype, self.keep_batchnorm_fp32)
        with torch.no_grad():
            # A tensor shared by several modules (tied weights) is converted once and stays shared.
            original_dtype: dict[int, torch.dtype] = {}
            converted_buffers: dict[int, torch.Tensor] = {}
            for module in self.model.modules():
                originals: dict[str, tuple[bool, torch.dtype]] = {}
                for name, param in module._parameters.items():
                    if param is None or id(param) not in targets:
                        continue
                    if id(param) not in original_dtype:
                        original_dtype[id(param)] = param.dtype
                        param.data = param.data.to(dtype)
                        if param.grad is not None:
                            param.grad = param.grad.to(dtype)
                    originals[name] = (True, original_dtype[id(param)])
                for name, buffer in module._buffers.items():
                    if buffer is None or id(buffer) not in targets:
                        continue
                    originals[name] = (False, buffer.dtype)
                    if id(buffer) not in converted_buffers:
                        converted_buffers[id(buffer)] = buffer.to(dtype)
                    module._buffers[name] = converted_buffers[id(buffer)]
                if originals:
                    self._original[id(module)] = (module, originals)
            _flatten_rnns(self.model)

    # -- hooks ----------------------------------------------------------------------------------------------
    def _check_device(self, module: nn.Module, args: Any) -> None:
        if self._probe is None:
            return
        owner, name, device = self._probe
        param = owner._parameters.get(name)
        if param is not None and param.device != device:
            raise RuntimeError(
                f"{type(module).__name__} was moved from {device} to {param.device} after "
                "amp.initialize(): its fp32 master weights, optimizer state and cast policy stayed with the old "
                "device. Move the model to its device before amp.initialize() (Apex's rule), or deinitialize() "
                "and initialize it again."
            )

    def _cast_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        assert self.dtype is not None
        self._check_device(module, args)
        return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)

    def _cast_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        assert self.output_dtype is not None
        return cast_floating(output, self.output_dtype)

    def _state_dict_to_original_dtype(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        # A checkpoint of a cast model holds what the user's model held: the fp32 master value where one
        # exists (exact, so that resuming is bitwise), otherwise the weight converted back to its original dtype.
        entry = self._original.get(id(module))
        for name, (is_param, dtype) in (entry[1] if entry else {}).items():
            key = prefix + name
            if key not in state_dict:
                continue
            tensor = module._parameters[name] if is_param else module._buffers[name]
            master = self._master_of(tensor) if is_param and tensor is not None else None
            value = master if master is not None else state_dict[key]
            state_dict[key] = value.detach().to(dtype) if value.dtype != dtype else value.detach()

    def _load_into_masters(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The half weight gets its value from torch's own loading (copy_ casts); the master takes the full
        # precision value here, so that a checkpoint resumes bitwise.
        with torch.no_grad():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                master = self._master_of(param)
                value = state_dict.get(prefix + name)
                if master is None or not isinstance(value, torch.Tensor) or value.shape != master.shape:
                    continue
                weight = self._load_master(param, value) if self._load_master is not None else None
                if weight is not None and isinstance(state_dict, MutableMapping):
                    # torch's copy into the half weight would round to nearest-even; the master's own weight
                    # (split with its tie rule) is loaded instead. This dict is torch's per-module copy.
                    state_dict[prefix + name] = weight
                else:
                    master.copy_(value)


def _flatten_rnns(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()


def _register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is None:  # torch < 2.5: the private spelling, which passes the module only when asked to
        return cast(
            RemovableHandle,
            module._register_load_state_dict_pre_hook(hook, with_module=True),  # type: ignore[no-untyped-call]
        )
    handle: RemovableHandle = register(hook)
    return handle


def _register_state_dict_post_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    register = getattr(module, "register_state_dict_post_hook", None)
    if register is None:  # torch < 2.5 has only the private spelling
        return cast(RemovableHandle, module._register_state_dict_hook(hook))  # type: ignore[no-untyped-call]
    # torch tags public hooks with an attribute, which a bound method cannot take: hand it a partial.
    handle: RemovableHandle = register(functools.partial(hook))
    return handle
