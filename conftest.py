"""Shared test setup. TRITON_INTERPRET must be set before any Triton kernel is defined,
so Triton kernels run (slowly, correctly) on the CPU here."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
