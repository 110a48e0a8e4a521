"""Cross-check against a third-party writer: an INT4 ``pack-quantized`` checkpoint packed by the
`compressed-tensors` package (vLLM's / llm-compressor's format library) loads into logits that
match the weights compressed-tensors itself decompresses, and the same greedy tokens.

The scales and zero points are Tidal's round-to-nearest ones (compressed-tensors has no
calibration of its own; llm-compressor's GPTQ/AWQ do not install on CPU quickly); the
quantization to integers, the packing into int32 words, the tensor names and config.json's
``quantization_config`` are compressed-tensors' own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidal_engine.models.loader import load_model, resolve_model
from tidal_engine.quantization.quantizer import LINEAR_WEIGHT, quantize_int4

from test_quantization import greedy, logits_of, plain_dir  # noqa: F401 - the module's fixture


def write_with_compressed_tensors(src: Path, dst: Path, ref: Path, group_size: int, symmetric: bool) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import load_file, save_file

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size))
    packed: dict[str, torch.Tensor] = {}
    decompressed: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not LINEAR_WEIGHT.match(name):
            packed[name] = decompressed[name] = w
            continue
        _, scale, zero = quantize_int4(w, group_size, symmetric)
        module = {"weight": w.float(), "weight_scale": scale}
        if not symmetric:
            module["weight_zero_point"] = (zero - 8).to(torch.int8)  # signed int4 zero points
        compressed = PackedQuantizationCompressor.compress(module, scheme)
        stem = name.removesuffix(".weight")
        packed.update({f"{stem}.{k}": v.contiguous() for k, v in compressed.items()})
        decompressed[name] = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"].float()
    config = json.loads((src / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"])
    for folder, weights, extra in ((dst, packed, {"quantization_config": quant.model_dump(mode="json")}),
                                   (ref, decompressed, {})):
        folder.mkdir(parents=True)
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_a_compressed_tensors_int4_checkpoint_loads_as_it_decompresses(plain_dir: Path, tmp_path: Path,  # noqa: F811
                                                                       symmetric: bool) -> None:
    write_with_compressed_tensors(plain_dir, tmp_path / "q", tmp_path / "ref", 64, symmetric)
    model = load_model(resolve_model(str(tmp_path / "q")), torch.float32, "cpu")
    reference = load_model(resolve_model(str(tmp_path / "ref")), torch.float32, "cpu")
    assert model.layers[0].mlp.down_proj.method.__class__.__name__ == "PackQuantizedInt4Method"
    prompt = [int(t) for t in torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))]
    got, want = logits_of(model, prompt), logits_of(reference, prompt)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert greedy(model, prompt, 32) == greedy(reference, prompt, 32)
