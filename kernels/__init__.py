"""Pure tensor maths of Alloy's merge strategies: torch only, no Ray, no I/O, no pydantic.

One module per strategy (:mod:`kernels.slerp`, :mod:`kernels.linear`, :mod:`kernels.task_arithmetic`,
:mod:`kernels.ties`, :mod:`kernels.dare`, :mod:`kernels.franken`); :mod:`kernels.registry` declares them and their
parameters. Every kernel computes in float32 and never modifies its inputs.
"""

from kernels.errors import InvalidParameterError, KernelError, UnknownStrategyError

__all__ = ["InvalidParameterError", "KernelError", "UnknownStrategyError"]
