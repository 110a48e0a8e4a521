"""Compile Triton kernels ahead of their first launch, many at once.

Triton compiles a kernel the first time a launch needs a specialization it has not built;
at start-up the engine's kernels come one after another (a forward pass meets them layer
by layer), so an empty cache costs the sum of the compiles. ``CompileAhead`` turns that
into a parallel job: inside ``dry_run()`` a launch from this thread is not launched but
handed, once per specialization, to a pool of threads that compiles it (Triton's own
``run(..., warmup=True)``: the same key, the in-memory and on-disk cache the real launch
then finds). Triton's passes and ``ptxas`` run outside the GIL, so the compiles overlap.

A dry pass runs the caller's code for real apart from the Triton launches: torch ops run
on whatever the skipped kernels left in their outputs. Only code whose control flow and
torch indexing never depend on a Triton kernel's output may run dry (a model's forward
pass with made-up inputs does; a sampler does not). A compile that fails here is only
logged: the real launch compiles it again and raises where it always did.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def arg_signature(value: Any) -> Hashable:
    """What Triton specializes a (non-constexpr) launch argument on, or finer: a tensor's dtype
    and 16-byte alignment, an integer's width, ``== 1`` and divisibility by 16, anything else
    by value. Finer than Triton at worst means one specialization compiled twice."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        return ("int", width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("float",)
    if value is None:
        return ("none",)
    return exact_value(value)


def exact_value(value: Any) -> Hashable:
    try:
        hash(value)
        return ("value", type(value).__name__, value)
    except TypeError:
        return ("repr", repr(value))


def launch_key(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """One key per (kernel, specialization) as far as can be told from the call: constexpr
    parameters and launch options (``num_warps``...) by value, the others by ``arg_signature``."""
    names: list[str] = list(getattr(fn, "arg_names", None) or [])
    constexprs = {p.name for p in getattr(fn, "params", []) if getattr(p, "is_constexpr", False)}
    parts: list[Hashable] = []
    for i, value in enumerate(args):
        name = names[i] if i < len(names) else f"#{i}"
        parts.append((name, exact_value(value) if name in constexprs else arg_signature(value)))
    for name in sorted(kwargs):
        by_value = name in constexprs or name not in names
        parts.append((name, exact_value(kwargs[name]) if by_value else arg_signature(kwargs[name])))
    return (id(fn), tuple(parts))


CompileFn = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def triton_warmup(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Compile (or load from the cache) what ``fn[grid](*args, **kwargs)`` would launch:
    Triton's warm-up path, which the dry-run patch passes straight through."""
    return fn.run(*args, grid=None, warmup=True, **kwargs)


_original_run: Callable[..., Any] | None = None  # JITFunction.run while a dry run has it patched
_active: CompileAhead | None = None
_patch_lock = threading.Lock()


class CompileAhead:
    """A pool of compile threads and the specializations handed to it.

    ``with ahead.dry_run(): ...`` collects, ``ahead.wait()`` returns once every compile has
    finished; ``close()`` ends the pool. ``compile_fn`` is what a worker runs for a launch
    (Triton's warm-up by default; tests give their own)."""

    enabled = True  # False: every phase compiles its own kernels as it meets them (benchmarks)

    def __init__(self, workers: int | None = None, compile_fn: CompileFn | None = None,
                 thread_setup: Callable[[], None] | None = None) -> None:
        self.workers = workers or default_workers()
        self._compile = compile_fn or triton_warmup
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tidal-compile",
                                        initializer=thread_setup)
        self._seen: set[Hashable] = set()
        self._kernels: set[int] = set()
        self._futures: list[Future[Any]] = []
        self._owner: int | None = None
        self.submitted = 0
        self.skipped = 0  # launches whose specialization was already handed over
        self.failed = 0
        self.wait_seconds = 0.0

    def submit(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        key = launch_key(fn, args, kwargs)
        if key in self._seen:
            self.skipped += 1
            return
        self._seen.add(key)
        if id(fn) not in self._kernels:
            self._kernels.add(id(fn))
            _create_device_cache(fn)
        self.submitted += 1
        self._futures.append(self._pool.submit(self._compile, fn, args, kwargs))

    @contextmanager
    def dry_run(self) -> Iterator[CompileAhead]:
        """Triton launches from this thread are handed to the pool instead of launched."""
        global _active
        with _patch_lock:
            if _active is not None:
                raise RuntimeError("a dry run is already under way")
            _install_patch()
            _active = self
            self._owner = threading.get_ident()
        try:
            yield self
        finally:
            with _patch_lock:
                _active = None
                self._owner = None
                _remove_patch()

    def wait(self) -> None:
        started = time.perf_counter()
        futures, self._futures = self._futures, []
        for future in futures:
            try:
                future.result()
            except Exception as exc:  # the real launch compiles again and raises there
                self.failed += 1
                logger.debug("compile ahead failed: %s", exc)
        self.wait_seconds += time.perf_counter() - started

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_device_cache(fn: Any) -> None:
    """Create a Triton kernel's per-device cache here, before the workers use it: two workers
    creating it at once would each get a dict, and one dict's kernels would be lost (only to
    be loaded again from the disk cache at their first launch)."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        return
    try:
        from triton.runtime.driver import driver

        caches[driver.active.get_current_device()]
    except Exception as exc:  # a kernel of another kind, or no driver: the workers create it
        logger.debug("no device cache created for %s: %s", fn, exc)


def _install_patch() -> None:
    """Route ``JITFunction.run`` through the active dry run for the dry run's thread only
    (other threads launch as usual). Undone by ``_remove_patch`` when the dry run ends, so
    launches outside start-up pay nothing."""
    global _original_run
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        ahead = _active
        if ahead is None or warmup or ahead._owner != threading.get_ident():
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        ahead.submit(self, args, kwargs)
        return None

    _original_run = original
    JITFunction.run = run  # type: ignore[method-assign]


def _remove_patch() -> None:
    global _original_run
    if _original_run is None:
        return
    from triton.runtime.jit import JITFunction

    JITFunction.run = _original_run  # type: ignore[method-assign]
    _original_run = None


def prepare_triton() -> None:
    """Triton's one-off set-up (the hash of its own build, the backend) in this thread, so
    the workers do not each compute it at once."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            key = getattr(__import__(module, fromlist=["triton_key"]), "triton_key", None)
        except ImportError:
            continue
        if key is not None:
            key()
            return


def prepare_triton_in_background() -> threading.Thread:
    """``prepare_triton`` on a thread, started now: most of it is hashing Triton's 400+ MB
    library, file reads and hashing that run without the GIL, so it overlaps the weights'
    loading instead of delaying the first kernel. Join it before the first Triton use.
    Triton is imported here, in the caller's thread (it is needed next anyway)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    thread = threading.Thread(target=_prepare_quietly, name="tidal-triton-key", daemon=True)
    thread.start()
    return thread


def _prepare_quietly() -> None:
    try:
        prepare_triton()
    except Exception as exc:  # the first compile computes it again and reports any error
        logger.debug("preparing Triton failed: %s", exc)


def device_thread_setup(device: Any) -> Callable[[], None] | None:
    """Pool threads compile for ``device``, or for this thread's current CUDA device when it
    names none: Triton reads the calling thread's current device. Call from the dry run's thread."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()

    def setup() -> None:
        torch.cuda.set_device(index)

    return setup


__all__ = ["CompileAhead", "arg_signature", "default_workers", "device_thread_setup", "exact_value", "launch_key",
           "prepare_triton", "prepare_triton_in_background", "triton_warmup"]
