"""``--to torch``: O0/O1 code with one model, one optimizer and one loss, rewritten to native torch.amp.

``amp.initialize`` becomes a ``torch.amp.GradScaler``; the forward pass and loss (the statements just before
each ``scale_loss`` block, back to the last ``zero_grad``/``step``) go under ``torch.autocast``; the
``scale_loss`` block becomes ``scaler.scale(loss).backward()``; ``optimizer.step()`` becomes
``scaler.step(optimizer); scaler.update()``; clipping ``amp.master_params(optimizer)`` becomes
``scaler.unscale_(optimizer)`` and clipping the optimizer's parameters; ``amp.state_dict()`` becomes
``scaler.state_dict()`` and ``amp.load_state_dict(s)`` loads either format through a function written into the file.

``amp.initialize`` directly under ``if <flag>:``, or with an ``opt_level`` variable (or argparse value, see
:mod:`ampinit.migrate._argparse`) that holds O0 or O1, gets a GradScaler created on every path with ``enabled=``
that flag (a disabled GradScaler is a pass-through, so the same calls are right on both paths). The loop may sit in
another function or method of the file where the GradScaler is reachable (:mod:`ampinit.migrate._reach`).
Helper modules that only use ``float_function``/``disable_casts``, and an unused amp import, are handled by
:mod:`ampinit.migrate._helper_modules` and here.

Anything without a native equivalent is refused with a reason per site (O2/O3 master weights or half models,
several models, optimizers or losses, ``delay_unscale``, static loss scales, loss-scale bounds, Apex internals),
and then the file is left unchanged: ``--to ampinit`` handles it.

The work is three steps, one module each:

=================  ===================================================================================
``_analysis.py``   what the file does with amp, collected once (:class:`~._analysis.Analysis`)
``_refusals.py``   the table of reasons to refuse (one row each: the nodes, the test, the reason text, an
                   example file), run in one loop over the analysis
``_predicates.py`` the nodes a row applies to and the tests over one node that the rows name
``_rewrite.py``    where autocast goes, and the rewrite of a file no row refused
``_examples.py``   the example file of each row: the tests run every one
=================  ===================================================================================
"""

from __future__ import annotations

import libcst as cst
from libcst.metadata import MetadataWrapper

from ampinit.migrate import _cst
from ampinit.migrate._helper_modules import HELPER_USES, migrate_helper_module
from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import apex_bindings
from ampinit.migrate._to_torch._analysis import APEX_SIGNATURE, SCALE_LOSS_SIGNATURE, Analysis
from ampinit.migrate._to_torch._refusals import REFUSALS, run
from ampinit.migrate._to_torch._rewrite import _Plan, _Rewrite, plan_rewrite, rewrite_to_torch

__all__ = ["APEX_SIGNATURE", "SCALE_LOSS_SIGNATURE", "migrate_module_to_torch"]


def migrate_module_to_torch(source: str) -> tuple[str, list[Site], bool]:
    """Rewrite the amp part of one module to torch.amp. Returns (source, sites, refused)."""
    module = cst.parse_module(source)
    bindings = apex_bindings(module)
    amp_locals = [local for local, q in bindings.items() if q == "apex.amp"]
    packages = [local for local, q in bindings.items() if q == "apex"]
    if not amp_locals:
        if packages and "apex.amp" in source:
            return source, [Site(1, "apex.amp is used through `import apex`: use --to ampinit", True)], True
        return source, [], False
    if len(amp_locals) > 1:
        return source, [Site(1, "apex.amp is imported under several names: use --to ampinit", True)], True
    wrapper = MetadataWrapper(module)
    analysis = Analysis(wrapper, amp_locals[0])
    uses = {name for name, _ in analysis.uses}
    if uses and uses <= HELPER_USES and analysis.references == len(analysis.uses):
        line = min((analysis.line(i) for i in analysis.imports), default=1)
        helper = _cst.fresh_name(["amp_float_function", "_amp_float_function"], analysis.names)
        code, sites = migrate_helper_module(module, amp_locals[0], uses, helper, line)
        return code, sites, False
    if analysis.references == 0:
        unused = module.visit(_Rewrite(_Plan(analysis.amp), "", "", has_torch=True))
        lines = sorted(analysis.line(i) for i in analysis.imports) or [1]
        return unused.code, [Site(lines[0], "amp is imported but never used here: the import is removed")], False
    refusals = run(analysis, REFUSALS)
    if refusals:
        return source, [found.site for found in refusals], True
    return rewrite_to_torch(module, wrapper, plan_rewrite(analysis), analysis)
