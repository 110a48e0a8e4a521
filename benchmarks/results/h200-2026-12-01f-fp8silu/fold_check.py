"""fp8silu's device check (issue 15): the Qwen3-8B down projection (4096 x 12288), bf16 and FP8,
at one row with each GEMV tile the start-up choice may take, and the FP8 GEMV at 4 rows: (a) whether the GEMV that folds
SiLU-and-mul gives bit for bit the activation kernel followed by the plain GEMV, (b) the time
of the fold against the two kernels it replaces, in a CUDA graph (kernels/gemv_choice.py's
time_in_graph: 32 calls back to back, weights rotated past L2). Prints one line per tile."""

from __future__ import annotations

import torch

from tidal_engine.kernels.gemv_choice import rotation_copies, rotation_sets, time_in_graph
from tidal_engine.kernels.triton.activation import silu_and_mul
from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, gemv
from tidal_engine.kernels.triton.quant_fp8 import FP8_GEMV_CONFIGS, fp8_gemv
from tidal_engine.quantization.fp8 import quantize_rows

torch.manual_seed(0)
n, k = 4096, 12288
w = torch.randn(n, k, device="cuda") * 0.02
gate_up = (torch.randn(1, 2 * k, device="cuda") * 2).to(torch.bfloat16)
q, scale = quantize_rows(w)
wb = w.to(torch.bfloat16)
act_us = time_in_graph(lambda _: silu_and_mul(gate_up), [None]) * 1e6
print(f"silu_and_mul kernel alone, 1 x {2 * k}: {act_us:.2f} us")
for name, rows, configs, copies, run in (
    ("fp8", 1, FP8_GEMV_CONFIGS, rotation_sets((q, scale)),
     lambda x, ws, c, fold: fp8_gemv(x, ws[0], ws[1], None, c, silu_and_mul=fold)),
    ("fp8", 4, FP8_GEMV_CONFIGS, rotation_sets((q, scale)),
     lambda x, ws, c, fold: fp8_gemv(x, ws[0], ws[1], None, c, silu_and_mul=fold)),
    ("bf16", 1, GEMV_CONFIGS, rotation_copies(wb), lambda x, ws, c, fold: gemv(x, ws, None, c, silu_and_mul=fold)),
):
    gate_up = (torch.randn(rows, 2 * k, device="cuda") * 2).to(torch.bfloat16)
    for c in configs:
        activated = silu_and_mul(gate_up)
        try:
            folded = run(gate_up, copies[0], c, True)
            plain = run(activated, copies[0], c, False)
        except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run (start-up skips it too)
            print(f"{name} {rows} row(s) {c}: not run ({str(exc)[:120]})")
            continue
        diff = (folded.float() - plain.float()).abs().max().item()
        t_fold = time_in_graph(lambda ws, c=c: run(gate_up, ws, c, True), copies) * 1e6
        t_two = time_in_graph(lambda ws, c=c: run(silu_and_mul(gate_up), ws, c, False), copies) * 1e6
        t_plain = time_in_graph(lambda ws, c=c: run(activated, ws, c, False), copies) * 1e6
        print(f"{name} {rows} row(s) {c}: bit-equal {torch.equal(folded, plain)} (max diff {diff:.3g}); folded {t_fold:.2f} us, "
              f"activation + GEMV {t_two:.2f} us (GEMV alone {t_plain:.2f}); saves {t_two - t_fold:.2f} us")
    del copies
