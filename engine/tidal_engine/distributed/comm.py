"""The collectives the model runs: over the tensor-parallel group and between pipeline stages.

Each is the identity with one rank, so the single-device path pays nothing. On CUDA they
are NCCL calls on the current stream, which CUDA graphs capture (the decode graphs hold
the all-reduces); on CPU they are gloo calls, for the 2-core CI.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tidal_engine.distributed.parallel_state import get_parallel, tp_group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place; returns it)."""
    if get_parallel().tp_size == 1:
        return x
    dist.all_reduce(x, group=tp_group())
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every tensor rank's ``x`` (equal shapes) along the last dimension."""
    tp = get_parallel().tp_size
    if tp == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:
        out = torch.empty((tp, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=tp_group())
        return out.movedim(0, -2).reshape(*x.shape[:-1], tp * x.shape[-1])
    pieces = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(pieces, x, group=tp_group())  # gloo has no all_gather_into_tensor
    return torch.cat(pieces, dim=-1)


def pp_send(tensors: list[torch.Tensor], dst_stage: int) -> None:
    """Send the activations (same shapes on both sides) to this tensor rank of ``dst_stage``.

    On CUDA an NCCL send is queued on the stream: the host goes on at once. Gloo's send is a
    rendezvous (it returns once the receiver has posted its receive), so on CPU the sends are
    posted without waiting and completed before the next ones: this stage can take its next
    micro-batch while the next stage still works on the previous one (a gloo send keeps its
    tensor alive until it is done)."""
    dst = get_parallel().stage_rank(dst_stage)
    wait_pp_sends()
    for t in tensors:
        t = t.contiguous()
        if t.is_cuda:
            dist.send(t, dst=dst)
        else:
            _PENDING_SENDS.append(dist.isend(t, dst=dst))


def wait_pp_sends() -> None:
    """Wait until every activation this stage posted has been received."""
    while _PENDING_SENDS:
        _PENDING_SENDS.pop(0).wait()


_PENDING_SENDS: list[dist.Work] = []


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, src_stage: int) -> list[torch.Tensor]:
    src = get_parallel().stage_rank(src_stage)
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    return out
