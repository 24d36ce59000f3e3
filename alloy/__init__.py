"""Alloy: model merge and evolution service on Ray.

``alloy`` holds the plain-Python services (configuration, persistence, registries, the merge executor,
evaluation); ``kernels`` the tensor maths; ``deployments`` and ``serve_app`` the Ray Serve shell;
``evolution`` the Ray Tune search.
"""

__version__ = "0.1.0"
