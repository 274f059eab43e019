"""The master-weight wing: how grads reach an optimizer's masters under amp, and how its step updates them.

``OptimizerRecord`` (``ampinit._optimizer_record``) holds one ``OptimizerGrads`` per optimizer; the rest is
beneath it. Nothing here imports ``ampinit.optimizers``: an optimizer whose update amp may run declares it
(``update.MasterUpdate``).

===================  =========================================================================================
``grads``            ``OptimizerGrads``: one optimizer's gradient flow under amp at every level (fp32 masters,
                     the stash, unscaling into master grads, the copy back), and the masters following the model
``remainder``        the remainder encoding: an fp32 master as its bf16 weight plus 16 low bits
``precision``        the precision dial's formats: random bits, stochastic rounding, 8-bit remainders and moments
``remainder_grads``  ``RemainderGrads``: ``master_weights="remainder"``, its gradient flow and its chunked step
``dial_grads``       the dial on the optimizer side: ``grads_for`` picks the class of a setting; the chunked step
                     over decoded masters and moments (``DialGrads``, ``CompressedStateGrads``); ``StateStore``,
                     the moments' format and the checkpoint loader that re-encodes any setting's state
``update``           which update an optimizer's step runs (the one classifier), and the ``MasterUpdate`` protocol
``kernel_step``      when a step takes the Triton kernels (the one rule, ``kernels_for``, the test switch), and
                     torch's optimizer-state layout the kernels keep
``reference``        the master step in plain torch ops: the reference the kernels match bit for bit
``triton_kernels``   the Triton kernels (imported only when a step takes them)
``triton_dial``      the dial's Triton step over every storage of masters and moments (imported as those are)
===================  =========================================================================================
"""

from ampinit._masters.dial_grads import Dial, StateStore, grads_for, moments_for_own_step, session_seed
from ampinit._masters.grads import OptimizerGrads
from ampinit._masters.remainder_grads import RemainderGrads
from ampinit._masters.update import MasterChunk, MasterUpdate, dial_setting, remainder_update

__all__ = [
    "Dial",
    "MasterChunk",
    "MasterUpdate",
    "OptimizerGrads",
    "RemainderGrads",
    "StateStore",
    "dial_setting",
    "grads_for",
    "moments_for_own_step",
    "remainder_update",
    "session_seed",
]
