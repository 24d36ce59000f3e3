"""Kernel failures. Plain ``ValueError`` subclasses: kernels know nothing of Alloy's error codes, the service
layer maps them (unknown strategy -> INVALID_STRATEGY, bad parameter -> VALIDATION_FAILED)."""

from __future__ import annotations


class KernelError(ValueError):
    """Base of every error raised by :mod:`kernels`."""


class UnknownStrategyError(KernelError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"unknown merge strategy {name!r}; known: {', '.join(known)}")


class InvalidParameterError(KernelError):
    """A parameter value the strategy cannot use; ``param`` names it."""

    def __init__(self, param: str, msg: str):
        self.param = param
        self.msg = msg
        super().__init__(f"parameter {param!r}: {msg}")
