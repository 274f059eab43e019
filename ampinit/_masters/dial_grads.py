"""The precision dial on the optimizer side: every ``master_weights`` x ``optimizer_state`` setting steps, and
every setting's checkpoint loads into every other.

Settings (``initialize(master_weights=..., optimizer_state=...)``; the formats are ``ampinit._masters.precision``'s):

- masters: ``True`` (fp32 tensors), ``"remainder"`` (bf16 weight + int16, exact), ``"remainder8"`` (bf16 weight +
  int8, a 24-bit master, stochastically rounded) or ``"stochastic"`` (the bf16 weight alone, the fp32 update
  result stochastically rounded into it);
- moments (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``): ``"fp32"``, ``"bf16"`` (stochastically
  rounded) or ``"8bit"`` (block-wise quantized codes under the moment's key, one fp32 absmax per block under
  ``<key>_absmax``).

A step that is not the exact one of today's classes (fp32 masters or 16-bit remainders, with fp32 moments) is
amp's, in one of two ways, per param group:

- where the group fits the kernels (the fp32-master kernel step's rule: ``kernel_step.group_takes_kernels`` for
  torch's Adam/AdamW/SGD, a ``kernel_step.KernelOptimizer``'s ``kernel_settings`` for ampinit's FusedAdam/FusedSGD,
  and ``kernels_taking``: CUDA, or CPU under the tests' interpreter switch) and no fp32 master was materialised for
  clipping, one ``triton_dial`` launch per list reads grad, master storage and moments once and writes them once,
  with the update math of ``reference.adam_dial_``/``sgd_dial_``; the keys are computed on the device from the
  post-increment counts;
- otherwise chunk by chunk: the chunk's masters and moments are decoded into fp32 temporaries, the optimizer's own
  update runs on them (torch's functional ``adam``/``sgd``, or the optimizer's ``MasterUpdate``), then the moments
  and the masters are encoded back.

Both store the same layout (the optimizer's own: torch's per-parameter ``step``, or FusedAdam's per-group
``group["step"]``, beside amp's ``sr_step``) and draw the same bits for a step (same seed, count and stream), so a
run may move between them (tests/test_dial_paths.py); the fp32 update itself may differ in the last bit (torch's
functional update against the reference's order of ops), so they are not bitwise equal to each other.

Stochastic rounding draws its bits from the session's seed, the tensor's step count after this step (Adam's
``state["step"]``; for other optimizers amp keeps ``state["sr_step"]``, int64) and the stream ``4 * t + purpose``
(``t`` the parameter's position in the param groups): the same on every DDP rank, the same after a resume. A
step skipped on the device (``found_inf`` set) changes nothing, stored state included.

Checkpoints: the optimizer's ``state_dict`` keeps torch's keys with the stored values, plus ``"amp_dial"``
(the setting and the seed). Loading (into a session of any setting, or at O2/O5 with fp32 state) decodes what it
finds, by dtype and keys, into fp32, and encodes it into the loader's setting; where that rounds a value a
``UserWarning`` names the moments that were rounded. The model's ``state_dict`` reports fp32 masters (joined), and
an fp32 master loaded into ``"remainder8"``/``"stochastic"`` is rounded stochastically, with a ``UserWarning``.
"""

from __future__ import annotations

import abc
import functools
import warnings
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, cast

import torch

from ampinit import _torch_kernels
from ampinit._masters import kernel_step, precision
from ampinit._masters import remainder as encoding
from ampinit._masters.grads import OptimizerGrads
from ampinit._masters.kernel_step import adam_state
from ampinit._masters.reference import AdamSettings, Masters, Moments, SgdSettings
from ampinit._masters.remainder_grads import RemainderGrads, _fp32, _in_chunks, loaded_states
from ampinit._masters.update import MasterChunk, Update, dial_setting, own_update, remainder_update

MasterFormat = Literal["fp32", "remainder", "remainder8", "stochastic"]
StateFormat = Literal["fp32", "bf16", "8bit"]

#: The moments the dial stores, and the purpose of their random bits (0 is the weight's).
MOMENT_PURPOSES = {"exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2}
ABSMAX_SUFFIX = "_absmax"
#: amp's per-parameter step count where torch keeps none per parameter (SGD, ampinit's fused optimizers).
SR_STEP = "sr_step"
#: The key the dial adds to an optimizer's ``state_dict``.
DIAL_KEY = "amp_dial"


@dataclass(frozen=True)
class Dial:
    """One session's precision setting; ``seed`` is the stochastic rounding's 32-bit seed."""

    masters: MasterFormat
    state: StateFormat
    seed: int

    @property
    def exact(self) -> bool:
        """Whether today's exact classes step it (fp32 or 16-bit remainder masters, fp32 moments)."""
        return self.state == "fp32" and self.masters in ("fp32", "remainder")


def session_seed() -> int:
    """The stochastic rounding's seed of a session started now: ``torch.initial_seed()``'s low 32 bits, so that
    ``torch.manual_seed`` makes a run repeatable."""
    return torch.initial_seed() & 0xFFFFFFFF


def grads_for(optimizer: torch.optim.Optimizer, master_weights: bool, dial: Dial) -> OptimizerGrads:
    """The amp-side state of ``optimizer`` under ``dial``."""
    if dial.masters == "fp32" and dial.state == "fp32":
        grads = OptimizerGrads(optimizer, master_weights)
    elif dial.masters == "remainder" and dial.state == "fp32":
        grads = RemainderGrads(optimizer)
    elif dial.masters == "fp32":
        grads = CompressedStateGrads(optimizer, dial)
    else:
        grads = DialGrads(optimizer, dial)
    return grads


def decode_moment(key: str, state: dict[str, Any]) -> torch.Tensor | None:
    """The fp32 value of moment ``key`` in ``state`` (any setting's), or None if absent. Read by dtype and keys:
    fp32 (or any float) as is, bf16 widened, uint8 codes with ``<key>_absmax`` dequantized."""
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        return None
    if value.dtype == torch.uint8:
        absmax = state.get(key + ABSMAX_SUFFIX)
        if not isinstance(absmax, torch.Tensor):
            raise ValueError(f"an 8-bit moment {key!r} needs its block scales under {key + ABSMAX_SUFFIX!r}")
        qmap = precision.QuantMap.build(signed=key != "exp_avg_sq", device=value.device)
        return precision.dequantize_blockwise(value, absmax.to(value.device, torch.float32), qmap)
    return value.to(torch.float32, copy=True)


class StateStore:
    """One optimizer's moments in the dial's format: decode, encode, its ``state_dict`` entry and its loader.

    Every optimizer of a session with masters has one (with fp32 moments it only decodes what a load brings).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dial: Dial, *, own_step: bool = False) -> None:
        self.optimizer = optimizer
        self.dial = dial
        self.seed = dial.seed
        # own_step: a session without masters, whose optimizer steps its parameters itself: a loaded 8-bit moment
        # is decoded into its parameter's dtype (torch casts the codes to it as if they were values); the rest is
        # left as torch's load_state_dict made it.
        self.own_step = own_step
        self._maps: dict[tuple[bool, torch.device], precision.QuantMap] = {}
        self._loading: dict[str, Any] | None = None
        self._handles = [
            optimizer.register_state_dict_post_hook(self._add_dial),
            optimizer.register_load_state_dict_pre_hook(self._remember_loaded),
            optimizer.register_load_state_dict_post_hook(self._encode_loaded),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- random bits ------------------------------------------------------------------------------------------
    def random_key(self, step: torch.Tensor, stream: int) -> torch.Tensor:
        """The random key of a tensor at ``step`` (after this step) and ``stream``: the encoders draw each slice's
        bits from it (``precision.tensor_bits``), never the whole tensor's at once."""
        return precision.keys(self.seed, step.detach().reshape(()), torch.tensor(stream, dtype=torch.int64))

    # -- moments ----------------------------------------------------------------------------------------------
    def open(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Decode ``state``'s stored moments into fp32 tensors, in place; return what was stored (for a skip)."""
        stored: dict[str, torch.Tensor] = {}
        if self.dial.state == "fp32":
            return stored
        for key in MOMENT_PURPOSES:
            value = decode_moment(key, state)
            if value is None:
                continue
            stored[key] = state[key]
            absmax = state.pop(key + ABSMAX_SUFFIX, None)
            if absmax is not None:
                stored[key + ABSMAX_SUFFIX] = absmax
            state[key] = value
        return stored

    def close(
        self,
        state: dict[str, Any],
        stored: dict[str, torch.Tensor],
        step: torch.Tensor,
        position: int,
        flag: torch.Tensor | None,
    ) -> None:
        """Encode ``state``'s fp32 moments into the dial's format; where ``flag`` is set, keep ``stored``.

        Each moment's fp32 value and its previous stored form are let go as soon as it is encoded (``stored`` is
        emptied as it is read), so that encoding the next moment does not find them still live."""
        if self.dial.state == "fp32":
            return
        for key, purpose in MOMENT_PURPOSES.items():
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            stream = 4 * position + purpose
            encoded = self.encode(key, value, step, stream)
            kept = {name: stored.pop(name) for name in (key, key + ABSMAX_SUFFIX) if name in stored}
            if flag is not None and key in kept:
                if kept[key].dtype != encoded[key].dtype:
                    # Not in the dial's format: fp32 moments the optimizer held before this session (stepped
                    # before initialize, or under another setting). A skipped step keeps them encoded; mixing them
                    # in raw would store fp32 (code numbers, for 8 bits).
                    kept = self.encode(key, kept[key].float(), step, stream)
                raised = flag.to(value.device) != 0
                for name, new in encoded.items():
                    torch.where(raised, kept[name], new, out=new)  # in place: no second copy of the moment
            del value, kept
            state.update(encoded)

    def encode(self, key: str, value: torch.Tensor, step: torch.Tensor, stream: int) -> dict[str, torch.Tensor]:
        """Moment ``key``'s fp32 ``value`` in the dial's format, as state entries."""
        if self.dial.state == "fp32":
            return {key: value}
        if self.dial.state == "bf16":
            stored = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
            precision.encode_bf16_keyed_(stored, value, self.random_key(step, stream))
            return {key: stored}
        codes, absmax = precision.quantize_blockwise(value, self.quant_map(key, value.device))
        return {key: codes, key + ABSMAX_SUFFIX: absmax}

    def zeros(self, key: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Moment ``key`` at zero, ``like``'s shape and device, in the dial's format, as state entries: what
        :meth:`encode` gives for fp32 zeros (rounding keeps a zero, and an all-zero block quantizes to the code of
        0 with absmax 0), made without them. Only for bf16 or 8-bit moments (fp32 ones are stored as they are)."""
        if self.dial.state == "bf16":
            return {key: torch.zeros_like(like, dtype=torch.bfloat16)}
        codes, absmax = precision.quantized_zeros(like.shape, self.quant_map(key, like.device))
        return {key: codes, key + ABSMAX_SUFFIX: absmax}

    def quant_map(self, key: str, device: torch.device) -> precision.QuantMap:
        """The 8-bit map of moment ``key`` on ``device`` (signed but for ``exp_avg_sq``), built once per session."""
        signed = key != "exp_avg_sq"
        qmap = self._maps.get((signed, device))
        if qmap is None:
            qmap = self._maps[(signed, device)] = precision.QuantMap.build(signed, device)
        return qmap

    # -- state_dict -------------------------------------------------------------------------------------------
    def _add_dial(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.dial.exact:
            return state_dict  # torch's own layout, as before the dial: nothing is rounded, no seed to keep
        state_dict[DIAL_KEY] = {"master_weights": self.dial.masters, "optimizer_state": self.dial.state}
        state_dict[DIAL_KEY]["seed"] = self.seed
        return state_dict

    def _remember_loaded(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        self._loading = state_dict

    def _encode_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        # torch cast every loaded tensor but the step to its parameter's dtype (8-bit codes included): the
        # moments are taken again from the loaded dict, decoded, and encoded into this setting.
        loaded, self._loading = self._loading, None
        if loaded is None:
            return
        seed = loaded.get(DIAL_KEY, {}).get("seed")
        if isinstance(seed, int):
            self.seed = seed
        rounded: set[str] = set()
        for position, param, saved in loaded_states(loaded, optimizer):
            if saved is not None:
                rounded |= self._load_entry(optimizer.state[param], saved, param, position)
        if rounded:
            warnings.warn(
                f"optimizer_state={self.dial.state!r} rounded the loaded {', '.join(sorted(rounded))}: the checkpoint "
                "held finer moments than this setting stores (docs/precision.md says what each setting keeps)",
                UserWarning,
                stacklevel=3,
            )

    def _load_entry(self, state: dict[str, Any], saved: dict[str, Any], param: torch.Tensor, position: int) -> set[str]:
        rounded: set[str] = set()
        for key in [k for k in state if k.endswith(ABSMAX_SUFFIX)]:
            del state[key]
        count = saved.get(SR_STEP)
        if isinstance(count, torch.Tensor):
            # torch cast it to the parameter's dtype: a bf16 count stops at 256, and the random bits would repeat.
            state[SR_STEP] = count.to(device=param.device, dtype=torch.int64, copy=True)
        step = state.get("step", state.get(SR_STEP))
        if self.own_step:
            for key in MOMENT_PURPOSES:
                if _is_8bit(key, saved):
                    value = decode_moment(key, saved)
                    assert value is not None
                    state[key] = value.to(device=param.device, dtype=param.dtype)
            return rounded
        for key, purpose in MOMENT_PURPOSES.items():
            if self.dial.state == "8bit" and _is_8bit(key, saved):
                # Stored as this setting stores it: taken as is (decoding and quantizing again may move a block's
                # absmax, the signed map's negative end being short of -1).
                for name in (key, key + ABSMAX_SUFFIX):
                    state[name] = saved[name].to(device=param.device, copy=True)
                continue
            value = decode_moment(key, saved)
            if value is None:
                continue
            value = value.to(param.device)
            at = step if isinstance(step, torch.Tensor) else torch.zeros((), dtype=torch.int64)
            entries = self.encode(key, value, at, 4 * position + purpose)
            decoded = decode_moment(key, entries)
            if decoded is None or not torch.equal(decoded, value):
                rounded.add(key)
            state.update(entries)
        for key in ("max_exp_avg_sq",):
            value = saved.get(key)
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device=param.device, dtype=torch.float32, copy=True)
        return rounded


def moments_for_own_step(optimizer: torch.optim.Optimizer) -> None:
    """Put ``optimizer``'s moments back in the layout its own ``step`` reads (a session closing): each in its
    parameter's dtype, bf16 moments widened and 8-bit ones decoded (their ``_absmax`` scales dropped). Moments
    already in their parameter's dtype are left as they are (no copy). A parameter whose state changes gets a new
    state dict: torch's ``state_dict()`` hands out the live ones, and a checkpoint taken before the close keeps
    what it holds."""
    for param, state in list(optimizer.state.items()):
        if not isinstance(param, torch.Tensor) or not param.is_floating_point():
            continue
        changed: dict[str, Any] = {}
        for key in (*MOMENT_PURPOSES, "max_exp_avg_sq"):
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if _is_8bit(key, state):
                decoded = decode_moment(key, state)
                assert decoded is not None
                changed[key] = decoded.to(param.dtype)
            elif value.is_floating_point() and value.dtype != param.dtype and value.shape == param.shape:
                changed[key] = value.to(param.dtype)
        if changed:
            dropped = {key + ABSMAX_SUFFIX for key in changed}
            optimizer.state[param] = {k: changed.get(k, v) for k, v in state.items() if k not in dropped}


def _is_8bit(key: str, state: dict[str, Any]) -> bool:
    value = state.get(key)
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and key + ABSMAX_SUFFIX in state


class _DialStep(abc.ABC):
    """The step of the two dial classes below: one ``triton_dial`` launch per list where the group fits the
    kernels, else chunk by chunk over decoded masters and moments."""

    optimizer: torch.optim.Optimizer
    dial: Dial
    store: StateStore
    update: Update | None
    # The mixed random-key streams (``precision.mixed_streams`` of 4 * t + purpose) of the last launch per device
    # and purposes, with the positions they were made for: made on the device once, not once per step.
    _streams: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.Tensor]]

    def _dial_step(self, found_inf: torch.Tensor | None, write_back: Callable[[list[torch.Tensor]], None]) -> None:
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # as an lr scheduler's step wrapper records
        flag = None if found_inf is None else found_inf.reshape(())
        positions = {id(p): t for t, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        own = own_update(self.optimizer)
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    if group["params"]:  # FusedAdam's group count advances without grads too, as its own step's
                        kernel_step.count_group_step(self.optimizer, self.update, group, found_inf)
                    continue
                if self._dial_kernels_step(group, params, positions, found_inf):
                    continue
                chunks = self._dial_chunks(group, params, positions, flag, write_back)
                if own is not None:
                    own.update_masters(group, chunks, flag)
                    continue
                for chunk in chunks:
                    if self.update == "adam":
                        self._adam(group, chunk, flag)  # type: ignore[attr-defined]
                    else:
                        self._sgd(group, chunk, flag)  # type: ignore[attr-defined]

    def _dial_chunks(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        positions: dict[int, int],
        flag: torch.Tensor | None,
        write_back: Callable[[list[torch.Tensor]], None],
    ) -> Iterator[MasterChunk]:
        # A chunk holds whole parameters: the update needs each one's fp32 master, grad and moments at once (16 B
        # per element of the largest tensor). Only the decoding and encoding around it go in bounded slices
        # (``precision.SLICE_ELEMENTS``); slicing the update itself would need the optimizer's update per slice.
        for some in _in_chunks(params):
            if self.update == "adam":
                for p in some:
                    self._adam_state(group, p)
            stored = [self.store.open(self.optimizer.state[p]) for p in some]
            chunk = MasterChunk(some, [self._decode_master(p) for p in some], [self._step_grad(p) for p in some])
            yield chunk
            for param, master, old in zip(some, chunk.masters, stored):
                state = self.optimizer.state[param]
                step = self._count(state, param, flag)
                self.store.close(state, old, step, positions[id(param)], flag)
                self._encode_master(param, master, step, positions[id(param)])
            write_back(some)

    def _adam_state(self, group: dict[str, Any], param: torch.Tensor) -> None:
        """``param``'s state in torch's Adam layout (``kernel_step.adam_state``), its moments in the dial's format
        from the start.

        torch's layout makes them fp32 zeros; stored at once as the dial stores zeros (exactly what encoding them
        would store), one parameter at a time before anything of the chunk is decoded, so that a first step does
        not hold fp32 zeros beside their decoded copies (8 B per element of its largest tensor beyond a later
        step, whose stored moments are 16-bit or 8-bit)."""
        state = self.optimizer.state[param]
        if state:
            return
        adam_state(self.optimizer, group, param)
        self._stored_as_zeros(state)

    def _stored_as_zeros(self, state: dict[str, Any]) -> None:
        """A state's fp32 zero moments, just made, replaced by the dial's stored zeros (what encoding them stores)."""
        if self.dial.state != "fp32":
            for key in ("exp_avg", "exp_avg_sq"):
                state.update(self.store.zeros(key, state[key]))

    # -- the one-pass kernels ---------------------------------------------------------------------------------
    def _dial_kernels_step(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        positions: dict[int, int],
        found_inf: torch.Tensor | None,
    ) -> bool:
        """Step ``group`` through ``triton_dial`` if it fits the kernels (``kernel_step``'s rule), one launch per
        batch of :meth:`_kernel_batches`; False (nothing done) if it does not."""
        if not self._takes_kernels(group, params, found_inf):
            return False
        from ampinit._masters import triton_dial

        update = self._kernel_update()
        for batch, masters_of in self._kernel_batches(params):
            if update == "adam":
                self._adam_kernel(triton_dial, group, batch, masters_of, positions, found_inf)
            else:
                self._sgd_kernels(triton_dial, group, batch, masters_of, positions, found_inf)
        # A KernelOptimizer's Adam counts its step per group, once for all of the group's launches, as its own
        # update_masters does on the chunked path.
        kernel_step.count_group_step(self.optimizer, self.update, group, found_inf)
        return True

    def _takes_kernels(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> bool:
        if self._kernel_settings(group) is None:
            return False
        if kernel_step.kernels_taking(params, found_inf, *self._kernel_storage()) is None:
            return False
        # A first momentum step skipped on the device would leave a zero buffer that the next step reads as a
        # buffer (kernel_step's fp32 path declines it too): the chunked step takes it.
        first = any("momentum_buffer" not in self.optimizer.state.get(p, {}) for p in params)
        return not (self._kernel_update() == "sgd" and group["momentum"] != 0 and found_inf is not None and first)

    def _kernel_update(self) -> Update | None:
        """The update the kernels run for this optimizer: torch's (``self.update``), or the one a
        ``kernel_step.KernelOptimizer`` (ampinit's FusedAdam/FusedSGD) names; None where they have none."""
        return kernel_step.kernel_update(self.optimizer, self.update)

    def _kernel_settings(self, group: dict[str, Any]) -> AdamSettings | SgdSettings | None:
        """``group``'s settings in the kernels' terms (``kernel_step.group_settings``: a group takes the dial's
        kernels exactly where it would take the fp32-master ones), or None: its chunked update then runs."""
        update = self._kernel_update()
        return None if update is None else kernel_step.group_settings(self.optimizer, update, group)

    @abc.abstractmethod
    def _factor_for(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """What a launch over ``params`` multiplies their grads by (``amp.clip_grad_norm_``), if anything."""

    @abc.abstractmethod
    def _kernel_storage(self) -> tuple[dict[int, torch.Tensor], Container[int]]:
        """``kernel_step.kernels_taking``'s model weights by master id and the ids of bf16 parameters with masters."""

    @abc.abstractmethod
    def _kernel_batches(self, params: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], MastersOf]]:
        """``params`` in launches, each with how to view its masters (and whether that needs the weight's keys).

        The masters' lists hold the parameters themselves, not detached handles: the kernels read data pointers
        only (as ``kernel_step``'s fp32-master launch does), and a ``detach()`` per tensor per step was as many
        aten ops (on a GPU, host work the device waits on) as the rest of the step."""

    def _adam_kernel(
        self,
        kernels: ModuleType,
        group: dict[str, Any],
        params: list[torch.Tensor],
        masters_of: MastersOf,
        positions: dict[int, int],
        found_inf: torch.Tensor | None,
    ) -> None:
        # A first step's state made one parameter at a time with its moments already in the dial's format: made by
        # adam_inputs, all the parameters' fp32 zeros would be alive at once (8 B per parameter of the model, beyond
        # the steady state's 2 or 4) until re-stored below. Every later step finds no parameter without state.
        own = kernel_step._kernel_optimizer(self.optimizer)
        for p in kernel_step.stateless(self.optimizer, params):
            if own is None:
                self._adam_state(group, p)
            else:
                # The optimizer's own layout (an ampinit FusedAdam's), made for this parameter alone.
                cast(kernel_step.KernelAdamState, own).kernel_adam_state(group, [p])
                self._stored_as_zeros(self.optimizer.state[p])
        # The state exists in the optimizer's own layout after this (torch's, with the per-parameter step counts
        # advanced on the device; a KernelOptimizer's, whose group count advances after the launches).
        (_, _, scalars, settings), advanced = kernel_step.adam_inputs(self.optimizer, group, params, found_inf)
        for p in params:
            self._stored_in_dial(self.optimizer.state[p], p, positions)
        sr_advanced = None
        if self.update == "adam":
            # adam_inputs packed the counts (their entries are views of one tensor): taken as they are, no copy.
            steps = kernel_step.packed_steps([self.optimizer.state[p] for p in params], params[0].device)
        else:
            # The chunked path's count for the random bits (``_count``), so that a run may move between the two.
            steps = sr_advanced = self._advanced_sr_steps(params, found_inf)
        moment_purposes = (MOMENT_PURPOSES["exp_avg"], MOMENT_PURPOSES["exp_avg_sq"])
        try:
            keys = self._keys(steps, params, positions, masters_of, moment_purposes)
            kernels.adam_dial_(
                [_grad(p) for p in params],
                masters_of.view(keys.get(0)),
                self._moments("exp_avg", params, keys),
                self._moments("exp_avg_sq", params, keys),
                scalars,
                settings,
                inv_scale=self._factor_for(params),
                found_inf=found_inf,
            )
        except BaseException:
            # Refused before its launch (a state of another format or size, found when its tables are built): the
            # counts go back to where the step found them (the moments were only re-stored, their values kept).
            if advanced is not None:
                kernel_step.take_back(advanced, found_inf)
            if sr_advanced is not None:
                _take_back_sr(sr_advanced, found_inf)
            raise

    def _sgd_kernels(
        self,
        kernels: ModuleType,
        group: dict[str, Any],
        params: list[torch.Tensor],
        masters_of: MastersOf,
        positions: dict[int, int],
        found_inf: torch.Tensor | None,
    ) -> None:
        steps = self._advanced_sr_steps(params, found_inf)
        with_buffers = group["momentum"] != 0
        buffer_purposes = (MOMENT_PURPOSES["momentum_buffer"],) if with_buffers else ()
        all_keys = self._keys(steps, params, positions, masters_of, buffer_purposes)
        masters = masters_of.view(all_keys.get(0))
        settings = self._kernel_settings(group)
        assert isinstance(settings, SgdSettings)
        # sgd_batches gives a starting buffer fp32 zeros; stored in the dial's format before the launch reads it.
        launched = False
        try:
            for first_step, chosen, _ in kernel_step.sgd_batches(self.optimizer, group, params):
                some = [params[i] for i in chosen]
                for p in some:
                    self._stored_in_dial(self.optimizer.state[p], p, positions)
                # Every step but a first one for some of the buffers is one launch over all of them: nothing to pick.
                whole = len(chosen) == len(params)
                keys = all_keys if whole else {purpose: row[chosen] for purpose, row in all_keys.items()}
                kernels.sgd_dial_(
                    [_grad(p) for p in some],
                    masters if whole else masters.take(chosen),
                    self._moments("momentum_buffer", some, keys) if with_buffers else Moments.fp32([]),
                    settings,
                    first_step=first_step,
                    inv_scale=self._factor_for(some),
                    found_inf=found_inf,
                )
                launched = True
        except BaseException:
            # A launch refused (see _adam_kernel). The buffers found in opt.state launch first (sgd_batches), so a
            # refused state has stepped nothing and made no buffer; a failure after that launch (a starting
            # buffer's batch) leaves its parameters stepped: the counts stay, as torch's per-group step leaves a
            # group.
            if not launched:
                _take_back_sr(steps, found_inf)
            raise

    def _advanced_sr_steps(self, params: list[torch.Tensor], found_inf: torch.Tensor | None) -> torch.Tensor:
        """amp's ``sr_step`` of each of ``params`` advanced on the device (not where ``found_inf`` is set), as one
        1-D tensor whose elements the states' entries are views of (:func:`_packed_sr_steps`)."""
        counts = _packed_sr_steps([self.optimizer.state[p] for p in params], params[0].device)
        if found_inf is None:
            counts.add_(1)
        else:
            counts.add_((found_inf.reshape(()) == 0).to(torch.int64))
        return counts

    def _stored_in_dial(self, state: dict[str, Any], param: torch.Tensor, positions: dict[int, int]) -> None:
        """Moments torch's layout just created (fp32 zeros) re-stored in the dial's format (exactly: zeros)."""
        if self.dial.state == "fp32":
            return
        for key, purpose in MOMENT_PURPOSES.items():
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                zero_step = torch.zeros((), dtype=torch.int64, device=param.device)
                state.update(self.store.encode(key, value, zero_step, 4 * positions[id(param)] + purpose))

    def _keys(
        self,
        steps: torch.Tensor,
        params: list[torch.Tensor],
        positions: dict[int, int],
        masters_of: MastersOf,
        moment_purposes: tuple[int, ...],
    ) -> dict[int, torch.Tensor]:
        """The random keys of one launch by purpose (one per parameter each, from its post-increment step count, on
        the device): the weight's (0) where the masters round stochastically, the moments' where they are bf16.

        All of them in one computation over a ``[purposes, tensors]`` table of mixed streams kept on the device, so
        that a step runs the same few integer ops for any number of tensors and purposes."""
        purposes = ((0,) if masters_of.keyed else ()) + (moment_purposes if self.dial.state == "bf16" else ())
        if not purposes:
            return {}
        device = steps.device
        places = tuple(positions[id(p)] for p in params)
        cached = self._streams.get((device, purposes))
        if cached is None or cached[0] != places:
            streams = torch.tensor([[4 * t + purpose for t in places] for purpose in purposes], dtype=torch.int64)
            cached = self._streams[(device, purposes)] = (places, precision.mixed_streams(streams).to(device))
        keys = precision.keys_of_mixed(self.store.seed, steps, cached[1])
        return dict(zip(purposes, keys.unbind()))

    def _moments(self, key: str, params: list[torch.Tensor], keys: dict[int, torch.Tensor]) -> Moments:
        """Moment ``key`` of ``params`` in the dial's stored format (the state dicts' own tensors); ``keys`` holds
        the bf16 moments' random keys by purpose (:meth:`_keys`)."""
        states = [self.optimizer.state[p] for p in params]
        values = [s[key] for s in states]
        if self.dial.state == "bf16":
            return Moments.bf16(values, keys[MOMENT_PURPOSES[key]])
        if self.dial.state == "8bit":
            absmax = [s[key + ABSMAX_SUFFIX] for s in states]
            return Moments.eight_bit(values, absmax, self.store.quant_map(key, params[0].device))
        return Moments.fp32(values)

    def _sr_step(self, state: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
        count = state.get(SR_STEP)
        if count is None:
            count = state[SR_STEP] = torch.zeros((), dtype=torch.int64, device=param.device)
        return count

    def _count(self, state: dict[str, Any], param: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
        """This step's count for the random bits: Adam's ``step`` (already advanced), else amp's ``sr_step``."""
        if self.update == "adam":
            step: torch.Tensor = state["step"]
            return step
        count = self._sr_step(state, param)
        count.add_(1 if flag is None else (flag.to(count.device) == 0).to(torch.int64))
        return count

    def _decode_master(self, param: torch.Tensor) -> torch.Tensor:
        return param.detach()

    def _step_grad(self, param: torch.Tensor) -> torch.Tensor:
        return _fp32(param.grad)

    def _encode_master(self, param: torch.Tensor, master: torch.Tensor, step: torch.Tensor, position: int) -> None:
        return None


class DialGrads(_DialStep, RemainderGrads):
    """Masters kept in or as the bf16 weight (``"remainder"``, ``"remainder8"``, ``"stochastic"``), any moments.

    The gradient flow is ``RemainderGrads``'s (bf16 grads unscaled in place); the per-weight storage is an int16
    or int8 remainder, or nothing (``"stochastic"``); a step takes ``triton_dial`` or the chunked path (see the
    module docstring).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dial: Dial) -> None:
        self.dial = dial
        self._positions: dict[int, int] = {}
        super().__init__(optimizer)
        self.update = remainder_update(optimizer, dial_setting(dial.masters, dial.state))
        self.store = StateStore(optimizer, dial)
        self._streams = {}

    def create_masters(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Give every trainable bf16 parameter its storage, from its fp32 value before the cast if known (the
        store, not ``RemainderGrads``'s fp32 hook, takes loaded moments)."""
        for group in self.optimizer.param_groups:
            self._add_group(group, fp32_values or {})

    def _new_storages(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where the bits beyond each bf16 weight live: int16 or int8 remainders (packed, as ``RemainderGrads``'s),
        or nothing (an empty tensor each) for "stochastic"."""
        if self.dial.masters == "remainder":
            return encoding.new_storages(params, encoding.REMAINDER_DTYPE)
        if self.dial.masters == "remainder8":
            return encoding.new_storages(params, precision.REMAINDER8_DTYPE)
        return [torch.empty(0, dtype=precision.REMAINDER8_DTYPE, device=p.device) for p in params]

    def _store_first(self, param: torch.Tensor, master: torch.Tensor, storage: torch.Tensor) -> None:
        # The first rounding draws the bits of step 0: reproducible under the seed.
        self._split(param.detach(), master, storage, torch.zeros(()), self._position(param))

    def _position(self, param: torch.Tensor) -> int:
        # Param groups only grow (add_param_group appends), so the table is rebuilt only for a parameter it lacks.
        position = self._positions.get(id(param))
        if position is None:
            flat = (p for g in self.optimizer.param_groups for p in g["params"])
            self._positions = {id(p): t for t, p in enumerate(flat)}
            position = self._positions[id(param)]
        return position

    def _split(
        self, weight: torch.Tensor, master: torch.Tensor, storage: torch.Tensor, step: torch.Tensor, position: int
    ) -> None:
        """Store fp32 ``master`` (scratch) as bf16 ``weight`` and ``storage``, SR bits from ``step``."""
        if self.dial.masters == "remainder":
            encoding.split_(master, weight, storage)
        elif self.dial.masters == "remainder8":
            precision.split8_keyed_(master, weight, storage, self.store.random_key(step, 4 * position))
        else:
            precision.encode_bf16_keyed_(weight, master, self.store.random_key(step, 4 * position))

    def _joined(self, param: torch.Tensor) -> torch.Tensor:
        entry = self._remainders.get(id(param))
        return param.detach() if entry is None else self._join(param, entry[1])

    def _join(self, weight: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
        if self.dial.masters == "remainder":
            return encoding.join(weight.detach(), storage)
        if self.dial.masters == "remainder8":
            return precision.join8(weight.detach(), storage)
        return weight.detach().float()

    # -- masters --------------------------------------------------------------------------------------------
    def master_for(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._remainders.get(id(param))
        if entry is None:
            return None
        if self._agreed is not None:
            self._follow(id(param))
        return self._join(param, entry[1])

    def load_master(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        entry = self._remainders.get(id(param))
        if entry is None or value.shape != param.shape:
            return None
        master = value.detach().to(device=param.device, dtype=torch.float32, copy=True)
        weight = torch.empty_like(param.detach())
        storage = torch.empty_like(entry[1])
        self._split(weight, master.clone(), storage, torch.zeros(()), self._position(param))
        if not torch.equal(self._join(weight, storage).view(torch.int32), master.view(torch.int32)):
            warnings.warn(
                f"master_weights={self.dial.masters!r} rounded loaded fp32 masters stochastically to "
                f"{'24' if self.dial.masters == 'remainder8' else '16'} bits: the checkpoint held finer masters than "
                "this setting keeps (docs/precision.md)",
                UserWarning,
                stacklevel=2,
            )
        entry[1].copy_(storage)
        if self._agreed is not None:
            self._loaded_weights[id(param)] = weight
        return weight

    def restore_model_params(self) -> None:
        super().restore_model_params()
        self.store.remove()

    # -- the step -------------------------------------------------------------------------------------------
    def step_in_amp_kernels(self, original: Callable[..., Any], found_inf: torch.Tensor | None) -> bool:
        """Every step is amp's, in the kernels or chunked (see the module docstring), between the optimizer's step
        hooks; always True."""
        kernel_step.with_step_hooks(self.optimizer, lambda: self._dial_step(found_inf, lambda params: None))
        return True

    def _takes_kernels(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> bool:
        # The kernels read the bf16 grads: materialised fp32 masters and grads (clipped, maybe) take the chunked step.
        return not self._materialised and super()._takes_kernels(group, params, found_inf)

    def _kernel_storage(self) -> tuple[dict[int, torch.Tensor], Container[int]]:
        return {}, self._remainders

    def _kernel_batches(self, params: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], MastersOf]]:
        stored = [p for p in params if id(p) in self._remainders]
        direct = [p for p in params if id(p) not in self._remainders]  # fp32 parameters: their own masters
        if stored:
            keyed = self.dial.masters != "remainder"  # the 16-bit remainder is exact: no random bits
            yield stored, MastersOf(functools.partial(self._stored_masters, stored), keyed)
        if direct:
            yield direct, MastersOf(lambda keys: Masters.fp32(direct), keyed=False)

    def _stored_masters(self, params: list[torch.Tensor], keys: torch.Tensor | None) -> Masters:
        storages = [self._remainders[id(p)][1] for p in params]
        if self.dial.masters == "remainder":
            return Masters.remainder(params, storages)
        assert keys is not None  # MastersOf.keyed asked for them
        if self.dial.masters == "remainder8":
            return Masters.remainder8(params, storages, keys)
        return Masters.stochastic(params, keys)

    def _decode_master(self, param: torch.Tensor) -> torch.Tensor:
        return self._step_master(param)

    def _step_grad(self, param: torch.Tensor) -> torch.Tensor:
        return RemainderGrads._step_grad(self, param)

    def _factor_for(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        return RemainderGrads._factor_for(self, params)

    def _encode_master(self, param: torch.Tensor, master: torch.Tensor, step: torch.Tensor, position: int) -> None:
        entry = self._remainders.get(id(param))
        if entry is not None:
            self._split(param.detach(), master, entry[1], step, position)


class CompressedStateGrads(_DialStep, OptimizerGrads):
    """fp32 masters (``master_weights=True``) with bf16 or 8-bit moments: the optimizer's own ``step()`` cannot
    read them, so amp takes every step: in ``triton_dial``, which writes the model weights, or chunk by chunk,
    then copying the masters into the model weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, dial: Dial) -> None:
        super().__init__(optimizer, master_weights=True)
        self.dial = dial
        self.update = remainder_update(optimizer, dial_setting(True, dial.state))
        self.store = StateStore(optimizer, dial)
        self._streams = {}

    def step_in_amp_kernels(self, original: Callable[..., Any], found_inf: torch.Tensor | None) -> bool:
        """The step on the fp32 masters: in the kernels, which write the model weights, or chunked, then the copy
        into the model, between the optimizer's step hooks; always True."""
        kernel_step.with_step_hooks(self.optimizer, lambda: self._dial_step(found_inf, self._write_weights))
        return True

    def _kernel_storage(self) -> tuple[dict[int, torch.Tensor], Container[int]]:
        return self._model_of, ()

    def _factor_for(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        return None  # the exit wrote the fp32 master grads, which a clip multiplies in place

    def _kernel_batches(self, params: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], MastersOf]]:
        # One launch per model weight dtype; masters without a model weight (None) write nothing back.
        dtype_of = {id(p): self._model_of[id(p)].dtype if id(p) in self._model_of else None for p in params}
        for weight_dtype in dict.fromkeys(dtype_of.values()):
            chosen = [p for p in params if dtype_of[id(p)] == weight_dtype]
            weights = [self._model_of[id(p)] for p in chosen] if weight_dtype is not None else []
            yield chosen, MastersOf(functools.partial(_fp32_masters, chosen, weights), keyed=False)

    def _write_weights(self, masters: list[torch.Tensor]) -> None:
        pairs = [(self._model_of[id(m)], m) for m in masters if id(m) in self._model_of]
        _torch_kernels.copy_([w for w, _ in pairs], [m for _, m in pairs])

    def restore_model_params(self) -> None:
        super().restore_model_params()
        self.store.remove()

    # The functional updates of RemainderGrads, on the fp32 masters the param groups hold.
    _adam = RemainderGrads._adam
    _sgd = RemainderGrads._sgd


def _fp32_masters(masters: list[torch.Tensor], weights: list[torch.Tensor], keys: torch.Tensor | None) -> Masters:
    """fp32 masters (no random bits) writing the model ``weights``."""
    return Masters.fp32(masters, weights)


def _take_back_sr(counts: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """Undo ``_advanced_sr_steps``' advance of ``counts`` (one up, or none where ``found_inf`` is raised)."""
    if found_inf is None:
        counts.sub_(1)
    else:
        counts.sub_((found_inf.reshape(()) == 0).to(torch.int64))


def _packed_sr_steps(states: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """amp's ``sr_step`` counts of ``states`` (int64, 0 where absent) as one 1-D tensor on ``device`` whose
    elements the states' entries are views of: advancing and reading them is then one op each, not one per tensor
    (``kernel_step.packed_steps`` does the same for Adam's ``step``). Entries that are not views of one tensor in
    this order (a first step, a loaded ``state_dict``, another set of parameters with grads) are packed again,
    values kept."""
    views = [state.get(SR_STEP) for state in states]
    first = views[0]
    base: torch.Tensor | None = None if first is None else first._base
    if (
        base is not None
        and base.device == device
        and base.dim() == 1
        and base.numel() == len(views)
        and all(v is not None and v._base is base and v.storage_offset() == i for i, v in enumerate(views))
    ):
        return base
    zero = torch.zeros((), dtype=torch.int64, device=device)
    packed = torch.stack([zero if v is None else v.reshape(()).to(device=device, dtype=torch.int64) for v in views])
    for state, view in zip(states, packed.unbind()):
        state[SR_STEP] = view
    return packed


@dataclass(frozen=True)
class MastersOf:
    """How one launch views its masters (``view``, given the weight's random keys, None where ``keyed`` is
    False), and whether it needs them: remainder8 and stochastic masters round with random bits, the others not."""

    view: Callable[[torch.Tensor | None], Masters]
    keyed: bool


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad
