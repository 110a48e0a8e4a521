"""Tensor and pipeline parallelism: which rank this process is, its groups, and the collectives.

``parallel_state`` holds the process-wide layout (tensor- and pipeline-parallel sizes and
ranks, the torch.distributed groups); ``comm`` has the few collectives the model needs
(all-reduce and all-gather over the tensor-parallel group, send/recv between pipeline
stages); ``partition`` is the pure arithmetic of who holds which heads, rows and layers.
With one rank nothing is initialised and every collective is the identity.
"""

from tidal_engine.distributed.parallel_state import ParallelLayout, get_parallel, init_parallel, destroy_parallel

__all__ = ["ParallelLayout", "destroy_parallel", "get_parallel", "init_parallel"]
