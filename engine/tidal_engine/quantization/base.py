"""What every weight-quantization format provides: a ``QuantizationConfig`` that, per linear
layer, hands out the ``LinearMethod`` (layers/linear.py) that stores and multiplies its weights.

A config comes from the checkpoint's ``config.json`` (``quantization_config``) or from
``--quantization``; ``quantization/__init__.py`` resolves the two. The LM head and the
embedding never ask for a method: they stay in the run dtype.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from tidal_engine.layers.linear import LinearMethod


class QuantizationConfig(ABC):
    """One quantization format, parsed; ``linear_method`` gives each layer its method."""

    name: str  # the --quantization value

    def __init__(self, ignored: Iterable[str] = ()) -> None:
        self.ignored = list(ignored)

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """Parse a checkpoint's ``quantization_config`` (raise ValueError for what is unsupported)."""

    @abstractmethod
    def make_method(self) -> LinearMethod:
        """A fresh method for one quantized linear."""

    def linear_method(self, checkpoint_names: list[str]) -> LinearMethod | None:
        """The method of the linear that loads the HF modules ``checkpoint_names`` (several for a
        merged layer: q/k/v, gate/up); None (plain weights) when the checkpoint left them out."""
        skipped = [self.is_ignored(name) for name in checkpoint_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{self.name}: {', '.join(checkpoint_names)} are merged into one layer, but the "
                             "checkpoint quantizes only some of them")
        return self.make_method()

    def is_ignored(self, module: str) -> bool:
        """Whether the checkpoint keeps ``module`` (an HF module name) unquantized: an exact
        name, a name suffix, or ``re:<pattern>`` (compressed-tensors' spelling)."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False
