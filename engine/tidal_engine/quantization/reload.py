"""Reading a checkpoint again into a model whose quantized linears were already processed
(the wake from sleep level 2).

A method's ``process_weights_after_loading`` turns the checkpoint's tensors into other ones
(AWQ/GPTQ words repacked, online FP8 quantized), so the checkpoint no longer fits the
parameters the engine runs with. ``checkpoint_layout`` gives each quantized linear fresh
parameters in the checkpoint's layout for the read, processes them again afterwards, and
copies the result into the parameters the model had, which keep their identity and memory
(the weight store's views, the CUDA graphs' addresses). The fresh parameters cost, for a
moment, about one more copy of the quantized linears.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tidal_engine.layers.linear import LinearBase, UnquantizedLinearMethod


@contextmanager
def checkpoint_layout(model: nn.Module, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Inside: the quantized linears hold empty checkpoint-layout parameters (``dtype`` is the
    run dtype the model was built in). On exit: processed again, copied into the originals."""
    kept: dict[LinearBase, dict[str, nn.Parameter]] = {}
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            for module in model.modules():
                if not isinstance(module, LinearBase) or isinstance(module.method, UnquantizedLinearMethod):
                    continue
                processed = {n: p for n, p in module._parameters.items() if n != "bias" and p is not None}
                for name in processed:
                    del module._parameters[name]
                module.method.create_weights(module, module.in_features, module.out_features, None)
                for param in module._parameters.values():
                    if param is not None and not hasattr(param, "weight_loader"):
                        param.weight_loader = module.weight_loader  # type: ignore[attr-defined]
                kept[module] = processed
    finally:
        torch.set_default_dtype(previous_dtype)
    try:
        yield
    except BaseException:
        for module, processed in kept.items():  # the read failed: the model as it was
            for name in [n for n in module._parameters if n != "bias"]:
                del module._parameters[name]
            module._parameters.update(processed)
        raise
    with torch.no_grad():
        for module, processed in kept.items():
            module.method.process_weights_after_loading(module)
            fresh = {n: p for n, p in module._parameters.items() if n != "bias" and p is not None}
            if fresh.keys() != processed.keys():
                raise RuntimeError(f"reprocessing gave parameters {sorted(fresh)}, not {sorted(processed)}")
            for name, original in processed.items():
                if (fresh[name].shape, fresh[name].dtype) != (original.shape, original.dtype):
                    raise RuntimeError(f"reprocessed {name} is {tuple(fresh[name].shape)} {fresh[name].dtype}, "
                                       f"not {tuple(original.shape)} {original.dtype}")
                original.data.copy_(fresh[name].data)
                module._parameters[name] = original
