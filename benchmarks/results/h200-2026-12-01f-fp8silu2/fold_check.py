"""fp8silu's device check for branch fp8silu2 (issue 15): SiLU-and-mul folded into the gate_up
projection's GEMV epilogue. At the Qwen3-8B gate_up shape (24576 x 4096), bf16 and FP8, one row
(and FP8 at 4 rows), every GEMV tile whose rows hold gate/up pairs: (a) whether the folded GEMV
gives bit for bit the plain GEMV followed by the activation kernel, (b) its time against those
two kernels, in a CUDA graph (kernels/gemv_choice.py's time_in_graph: 32 calls back to back,
weights rotated past L2). Prints one line per tile."""

from __future__ import annotations

import torch

from tidal_engine.kernels.gemv_choice import rotation_copies, rotation_sets, time_in_graph
from tidal_engine.kernels.triton.activation import silu_and_mul
from tidal_engine.kernels.triton.gemv import GEMV_CONFIGS, gemv
from tidal_engine.kernels.triton.quant_fp8 import FP8_GEMV_CONFIGS, fp8_gemv
from tidal_engine.quantization.fp8 import quantize_rows

torch.manual_seed(0)
n, k = 24576, 4096
w = torch.randn(n, k, device="cuda") * 0.02
q, scale = quantize_rows(w)
wb = w.to(torch.bfloat16)
for name, rows, configs, copies, run in (
    ("fp8", 1, FP8_GEMV_CONFIGS, rotation_sets((q, scale)),
     lambda x, ws, c, fold: fp8_gemv(x, ws[0], ws[1], None, c, silu_and_mul=fold)),
    ("fp8", 4, FP8_GEMV_CONFIGS, rotation_sets((q, scale)),
     lambda x, ws, c, fold: fp8_gemv(x, ws[0], ws[1], None, c, silu_and_mul=fold)),
    ("bf16", 1, GEMV_CONFIGS, rotation_copies(wb), lambda x, ws, c, fold: gemv(x, ws, None, c, silu_and_mul=fold)),
):
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    for c in configs:
        if c.block_n % 2:
            continue
        try:
            folded = run(x, copies[0], c, True)
            plain = silu_and_mul(run(x, copies[0], c, False))
        except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run (start-up skips it too)
            print(f"{name} {rows} row(s) {c}: not run ({str(exc)[:120]})")
            continue
        diff = (folded.float() - plain.float()).abs().max().item()
        t_fold = time_in_graph(lambda ws, c=c: run(x, ws, c, True), copies) * 1e6
        t_two = time_in_graph(lambda ws, c=c: silu_and_mul(run(x, ws, c, False)), copies) * 1e6
        t_plain = time_in_graph(lambda ws, c=c: run(x, ws, c, False), copies) * 1e6
        print(f"{name} {rows} row(s) {c}: bit-equal {torch.equal(folded, plain)} (max diff {diff:.3g}); folded {t_fold:.2f} us, "
              f"GEMV + activation {t_two:.2f} us (GEMV alone {t_plain:.2f}); saves {t_two - t_fold:.2f} us")
    del copies
