"""Apex's ``DistributedDataParallel`` arguments and what each becomes on torch's DDP: the one table.

The compat ``apex.parallel.DistributedDataParallel`` (which runs them) and the codemod (which rewrites calls to
torch's DDP) both read it. Each argument is handled one of four ways:

* ``keyword``: torch's DDP has the same option under another name (``torch_name``);
* ``converted``: torch's DDP has the option in other units; the compat class converts it, the codemod drops it;
* ``hook``: it changes the reduction, which torch's DDP can only do with a communication hook: the compat class
  registers one, the codemod drops it and says so;
* ``no_effect``: it only tuned Apex's own bucketing or streams (or Apex itself ignored it): accepted and dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Handling = Literal["keyword", "converted", "hook", "no_effect"]


@dataclass(frozen=True)
class ApexDDPArgument:
    default: object  # Apex's default
    handling: Handling
    reason: str  # why it is handled so, in a sentence a user reads in a warning or a migration note
    torch_name: str | None = None  # for "keyword" and "converted": torch's DDP argument


APEX_DDP_ARGUMENTS: Mapping[str, ApexDDPArgument] = MappingProxyType(
    {
        "message_size": ApexDDPArgument(
            10000000, "converted", "bucket size; torch's DDP uses bucket_cap_mb (MiB) instead", "bucket_cap_mb"
        ),
        "delay_allreduce": ApexDDPArgument(
            False,
            "keyword",
            "Apex users set it for models with parameters that get no gradient; torch's DDP needs "
            "find_unused_parameters=True for those (it fails on the second iteration otherwise)",
            "find_unused_parameters",
        ),
        "gradient_average": ApexDDPArgument(
            True, "hook", "torch's DDP always averages; for a sum, register a comm hook"
        ),
        "gradient_predivide_factor": ApexDDPArgument(
            1.0, "hook", "torch's DDP divides by the world size after the allreduce; register a comm hook"
        ),
        "allreduce_always_fp32": ApexDDPArgument(
            False, "hook", "torch's DDP reduces in the gradients' dtype; register a comm hook to reduce in fp32"
        ),
        "shared_param": ApexDDPArgument(None, "no_effect", "deprecated in Apex; torch's DDP handles shared parameters"),
        "allreduce_trigger_params": ApexDDPArgument(
            None, "no_effect", "Apex's bucket management; torch's DDP decides bucket readiness itself"
        ),
        "retain_allreduce_buffers": ApexDDPArgument(
            False, "no_effect", "Apex's bucket management; torch's DDP manages its buckets itself"
        ),
        "num_allreduce_streams": ApexDDPArgument(
            1, "no_effect", "Apex's stream scheduling; torch's DDP manages its communication streams itself"
        ),
        "allreduce_communicators": ApexDDPArgument(
            None, "no_effect", "Apex's stream scheduling; torch's DDP uses the process group's communicator"
        ),
        "gradient_average_split_factor": ApexDDPArgument(
            None, "no_effect", "deprecated in Apex, which ignores it; use gradient_predivide_factor"
        ),
        "prof": ApexDDPArgument(False, "no_effect", "Apex's NVTX ranges; use torch.profiler"),
    }
)


def _with(*handlings: Handling) -> dict[str, ApexDDPArgument]:
    return {name: arg for name, arg in APEX_DDP_ARGUMENTS.items() if arg.handling in handlings}


#: Views for the codemod: renamed keywords, arguments dropped with a note, arguments dropped silently.
DDP_RENAMED: Mapping[str, str] = MappingProxyType(
    {name: arg.torch_name for name, arg in _with("keyword").items() if arg.torch_name is not None}
)
DDP_DROPPED_WITH_EFFECT: Mapping[str, str] = MappingProxyType({n: a.reason for n, a in _with("hook").items()})
DDP_DROPPED_SILENTLY: Mapping[str, str] = MappingProxyType(
    {n: a.reason for n, a in _with("converted", "no_effect").items()}
)
#: For the compat class: Apex-only arguments it accepts without effect, with their Apex defaults.
NO_EFFECT: Mapping[str, ApexDDPArgument] = MappingProxyType(_with("no_effect"))
