"""Alloy's merge engine: recipes (Alloy and mergekit formats), compatibility checks and the streaming executor.
The tensor maths lives in :mod:`kernels`."""
