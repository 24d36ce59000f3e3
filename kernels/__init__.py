"""Pure tensor maths of Alloy's merges: torch only, no Ray, no I/O, no pydantic.

:data:`kernels.registry.METHODS` declares every mergekit 0.1.5 merge method under its mergekit name (parameters,
defaults, scopes, input counts, the HTTP strategy family it belongs to) with its per-tensor kernel:
:mod:`kernels.linear`, :mod:`kernels.slerp`, :mod:`kernels.nuslerp`, :mod:`kernels.multislerp`,
:mod:`kernels.karcher`, :mod:`kernels.model_stock`, :mod:`kernels.nearswap`, :mod:`kernels.arcee_fusion`,
:mod:`kernels.sce`, :mod:`kernels.ram`, :mod:`kernels.passthrough`, and :mod:`kernels.gta` (generalized task
arithmetic: task_arithmetic, ties, dare_*, breadcrumbs*, della*), with the sparsifiers in :mod:`kernels.sparsify`.
:func:`kernels.catalogue.method_catalogue` lists them as plain data. :mod:`kernels.franken` holds the layer-name
rules of layer stacking.

Every kernel has the signature ``merge(tensors, base_index, global_params, model_params, generator, owned=False)``,
computes in float32 whatever the input dtype, and modifies an input only when the caller gives it up (``owned``).
A method whose spec says ``computes_in_dtype`` also takes ``dtype=torch.bfloat16`` (or ``float16``) and then does
every step in that dtype, in mergekit's order of operations (what mergekit does for a recipe's ``dtype``); float32
stays the default, bit for bit.
"""

from kernels.errors import InvalidParameterError, KernelError, UnknownStrategyError

__all__ = ["InvalidParameterError", "KernelError", "UnknownStrategyError"]
