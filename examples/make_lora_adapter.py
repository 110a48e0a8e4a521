"""Write a random LoRA adapter for SmolLM2-135M in PEFT's format (adapter_config.json and
adapter_model.safetensors), for examples/lora-cpu.yaml. Random weights: it shows the serving
path (load, route, unload), not a trained behaviour.

    python examples/make_lora_adapter.py /tmp/tidal-adapters/demo [--rank 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

LAYERS = 30  # SmolLM2-135M
MODULES = {"q_proj": ("self_attn", 576, 576), "v_proj": ("self_attn", 576, 192)}  # (block, in, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    tensors = {}
    for layer in range(LAYERS):
        for name, (block, fan_in, fan_out) in MODULES.items():
            stem = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((args.rank, fan_in)) * 0.05).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((fan_out, args.rank)) * 0.05).astype(np.float32)
    args.folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M",
              "r": args.rank, "lora_alpha": 2 * args.rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(MODULES)}
    (args.folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(args.folder / "adapter_model.safetensors"))
    print(f"wrote {args.folder}")


if __name__ == "__main__":
    main()
