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


# Inputs of at most this many rows (decode) may go to a method's small-batch kernel.
GEMV_MAX_ROWS = 4


class SmallBatchKernel(ABC):
    """A quantized ``LinearMethod`` with a small-batch (GEMV) kernel besides its general path.

    kernels/gemv_choice.py times the kernel's candidate tile shapes against the general path
    once per weight shape, for one row and for ``GEMV_MAX_ROWS`` rows, and sets the winners on
    the layer (``gemv_config``, ``gemv_config_few``; None: the general path)."""

    gemv_candidates: tuple[Any, ...] = ()
    # Whether the choice times a linear that has an output activation (gate_up: SiLU-and-mul) as
    # the decode step runs it (``run_gemv_activated``, and the general path then the activation
    # kernel); off, each is timed without the activation.
    times_output_activation: bool = False

    @abstractmethod
    def gemv_kind(self, layer: Any) -> str:
        """What the timings depend on besides the shape (format, group size): part of the key."""

    @abstractmethod
    def gemv_weights(self, layer: Any) -> tuple[Any, ...]:
        """The tensors the matmul reads (timing rotates copies of them through L2)."""

    @abstractmethod
    def run_gemv(self, layer: Any, x: Any, weights: tuple[Any, ...], bias: Any, config: Any) -> Any:
        """The small-batch kernel on ``x [M, K]`` with ``weights`` and tile ``config``."""

    @abstractmethod
    def run_general(self, layer: Any, x: Any, weights: tuple[Any, ...], bias: Any) -> Any:
        """The path for any number of rows on this device."""

    def run_gemv_activated(self, layer: Any, x: Any, weights: tuple[Any, ...], bias: Any, config: Any,
                           activation: str) -> Any:
        """``activation`` of the small-batch kernel's output as the decode step makes it: in the
        kernel's epilogue where tile ``config`` folds it, else the activation kernel after it.
        Only where ``times_output_activation``."""
        raise NotImplementedError(f"{type(self).__name__} does not time its output activation")

    def warm_up(self, layer: Any, dtype: Any) -> None:
        """Compile what the general path may run at any row count, before CUDA graphs are
        captured (the choice calls it once per layer). Nothing by default."""

    def small_batch_config(self, layer: Any, rows: int) -> Any:
        """The chosen small-batch kernel tile for ``rows`` input rows, or None (the general path)."""
        if rows == 1:
            return layer.gemv_config
        return getattr(layer, "gemv_config_few", None) if rows <= GEMV_MAX_ROWS else None

    def apply_2d(self, layer: Any, x: Any, bias: Any) -> Any:
        """``x [M, K]``: the chosen small-batch kernel for few rows, else the general path."""
        config = self.small_batch_config(layer, x.shape[0])
        weights = self.gemv_weights(layer)
        if config is not None:
            return self.run_gemv(layer, x, weights, bias, config)
        return self.run_general(layer, x, weights, bias)
