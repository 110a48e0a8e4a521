"""The multiprocess executor: one worker process per rank, plans over ZeroMQ.

Structure (N = tensor × pipeline ranks; docs/parallelism.md):

- the executor binds, per rank, a PUSH socket (plans and RPCs to the worker) and a PULL
  socket (its replies), on ``ipc://`` paths in a private temporary folder;
- each worker process (``spawn``ed, titled "tidal-worker rank R", on ``cuda:R`` with CUDA)
  joins the torch.distributed world and its tensor-parallel group (gloo on CPU, nccl on
  CUDA; distributed/parallel_state.py), builds its shard of the model and says it is ready;
- every rank gets every plan; only the output rank (tensor rank 0 of the last pipeline
  stage: rank 0 without pipeline parallelism) sends step results back (the others take
  theirs, to keep their histories, and stay silent);
- messages are msgspec msgpack: ``ExecuteMsg`` (a ``StepPlan``), ``RpcMsg`` (a method name,
  and its arguments pickled: LoRA adapters travel as pickled ``LoRAAdapter``s), ``ShutdownMsg``;
  replies are ``ResultMsg`` (the driver's ``StepResult``), ``RpcReplyMsg``, ``ErrorMsg``;
- a worker's main thread receives and executes plans in order, never waiting for the
  device; a sender thread takes each step's result (waiting for the device) and sends it,
  so step N+1 is launched as soon as it arrives, while N still runs (async scheduling). An
  RPC runs after every earlier step has completed.
- ``execute`` sends and returns at once; ``result()`` reads replies (buffering other steps'
  results) until its own arrives, and checks every 100 ms that the workers are alive: a
  dead worker is a ``RuntimeError`` naming it, never a hang.

Workers die with their parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux; only when the
executor is built on the main thread, since the signal fires when the *thread* that
started the child exits), plus a watchdog thread that exits when the parent pid changes.
They ignore SIGTERM/SIGINT (the parent's to handle: it drains, then shuts them down).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import socket
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

import msgspec
import torch

from tidal_engine.engine.process_utils import die_with_parent, ignore_termination_signals, parent_alive, set_process_title
from tidal_engine.executor.base import Executor, PendingStep
from tidal_engine.executor.plan import StepPlan, StepResult

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a waiting executor checks that its workers are alive
READY_TIMEOUT_S = 600.0  # model load + KV allocation + CUDA graph capture
WATCHDOG_S = 0.5


# ---- messages ------------------------------------------------------------------------
class ExecuteMsg(msgspec.Struct, tag="x"):
    plan: StepPlan


class RpcMsg(msgspec.Struct, tag="r"):
    call_id: int
    method: str
    payload: bytes  # pickle of (args, kwargs)


class ShutdownMsg(msgspec.Struct, tag="s"):
    pass


class ReadyMsg(msgspec.Struct, tag="ready"):
    rank: int
    pid: int
    num_kv_blocks: int


class ResultMsg(msgspec.Struct, tag="res"):
    result: StepResult


class RpcReplyMsg(msgspec.Struct, tag="rr"):
    call_id: int
    payload: bytes  # pickle of the return value


class ErrorMsg(msgspec.Struct, tag="err"):
    kind: str  # "step", "rpc" or "startup"
    ident: int  # step_id or call_id
    message: str


ToWorker = ExecuteMsg | RpcMsg | ShutdownMsg
FromWorker = ReadyMsg | ResultMsg | RpcReplyMsg | ErrorMsg

_ENCODER = msgspec.msgpack.Encoder()
_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
_FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)


class WorkerDiedError(RuntimeError):
    pass


# ---- the executor side ---------------------------------------------------------------
class _MPPendingStep(PendingStep):
    def __init__(self, executor: "MultiprocExecutor", step_id: int) -> None:
        self._executor = executor
        self.step_id = step_id
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._executor._wait_step(self.step_id)
        return self._result


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: Any,
        source: Any = None,
        device: Any = None,
        dtype: Any = None,
        **worker_kwargs: Any,
    ) -> None:
        import zmq

        from tidal_engine.executor.uniproc import resolve_worker_args

        source, device, dtype = resolve_worker_args(config, source, device, dtype)
        self.config = config
        self.tp_size = int(getattr(config, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(config, "pipeline_parallel_size", 1) or 1)
        self.world_size = self.tp_size * self.pp_size
        self.output_rank = self.world_size - self.tp_size  # the last stage samples and answers
        _check_split(source.arch_config, self.tp_size, self.pp_size, device)
        from tidal_engine.lora.manager import create_lora_registry

        # The core's adapter registry (no device slots); each worker has its own slots.
        self.lora_manager = create_lora_registry(source.arch_config, config)
        self._dead: str | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._results: dict[int, StepResult | ErrorMsg] = {}
        self._replies: dict[tuple[int, int], RpcReplyMsg | ErrorMsg] = {}
        self._call_ids = 0
        self._tmpdir = tempfile.mkdtemp(prefix="tidal-mp-")
        self._ctx = zmq.Context()
        self._zmq = zmq
        self._to: list[Any] = []
        self._from: list[Any] = []
        self._poller = zmq.Poller()
        for rank in range(self.world_size):
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(f"ipc://{self._tmpdir}/to-{rank}")
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(f"ipc://{self._tmpdir}/from-{rank}")
            self._poller.register(pull, zmq.POLLIN)
            self._to.append(push)
            self._from.append(pull)
        dist_port = _free_port()
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(self.world_size):
            proc = ctx.Process(
                target=_worker_main,
                name=f"tidal-worker-{rank}",
                kwargs=dict(
                    rank=rank,
                    tp_size=self.tp_size,
                    pp_size=self.pp_size,
                    config=config,
                    source=_picklable_or_none(source),
                    device=str(device),
                    dtype=str(dtype).removeprefix("torch."),
                    to_addr=f"ipc://{self._tmpdir}/to-{rank}",
                    from_addr=f"ipc://{self._tmpdir}/from-{rank}",
                    dist_init=f"tcp://127.0.0.1:{dist_port}",
                    parent_pid=os.getpid(),
                    use_pdeathsig=use_pdeathsig,
                    worker_kwargs=worker_kwargs,
                ),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        self.worker_pids = [p.pid for p in self._procs]
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs), self._tmpdir)
        try:
            blocks = []
            for rank in range(self.world_size):
                msg = self._recv(rank, timeout_s=READY_TIMEOUT_S)
                if isinstance(msg, ErrorMsg):
                    raise RuntimeError(f"worker rank {rank} failed to start:\n{msg.message}")
                if not isinstance(msg, ReadyMsg):
                    raise RuntimeError(f"worker rank {rank}: unexpected first message {msg!r}")
                blocks.append(msg.num_kv_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = min(blocks)

    # ---- transport -----------------------------------------------------------------
    def _recv(self, rank: int, timeout_s: float | None = None) -> FromWorker:
        """The next message from ``rank``; raises if a worker dies (or the timeout passes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sock = self._from[rank]
        while True:
            if sock.poll(POLL_MS, self._zmq.POLLIN):
                return _FROM_WORKER.decode(sock.recv())
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"worker rank {rank} did not answer within {timeout_s:.0f} s")

    def _send_all(self, msg: Any) -> None:
        self.check_health()
        data = _ENCODER.encode(msg)
        for push in self._to:
            push.send(data)

    def _pump(self, rank: int) -> None:
        """Read one message from ``rank`` into the buffers."""
        msg = self._recv(rank)
        if isinstance(msg, ResultMsg):
            self._results[msg.result.step_id] = msg.result
        elif isinstance(msg, RpcReplyMsg):
            self._replies[(rank, msg.call_id)] = msg
        elif isinstance(msg, ErrorMsg):
            if msg.kind == "step":
                self._results[msg.ident] = msg
            elif msg.kind == "rpc":
                self._replies[(rank, msg.ident)] = msg
            else:
                raise RuntimeError(f"worker rank {rank}: {msg.message}")

    def _wait_step(self, step_id: int) -> StepResult:
        with self._lock:
            while step_id not in self._results:
                self._pump(self.output_rank)  # only it returns the step results
            got = self._results.pop(step_id)
        if isinstance(got, ErrorMsg):
            cause = self._dead_peer()
            if cause is not None:  # the output rank failed because another rank left its collectives
                last = got.message.strip().splitlines()[-1] if got.message.strip() else ""
                self._dead = f"{cause}; rank {self.output_rank} then failed step {step_id}: {last}"
                logger.error("%s", self._dead)
                raise WorkerDiedError(self._dead)
            raise RuntimeError(f"step {step_id} failed in worker rank {self.output_rank}:\n{got.message}")
        return got

    def _dead_peer(self, grace_s: float = 2.0) -> str | None:
        """A rank other than the driver that died (waiting ``grace_s`` for its exit to show)."""
        if self.world_size == 1:
            return None
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self._procs):
                if rank != self.output_rank and not proc.is_alive():
                    return f"worker rank {rank} (pid {proc.pid}) died ({_how(proc.exitcode)})"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    # ---- the interface -------------------------------------------------------------
    def execute(self, plan: StepPlan) -> PendingStep:
        with self._lock:
            self._send_all(ExecuteMsg(plan))
        return _MPPendingStep(self, plan.step_id)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        with self._lock:
            self._call_ids += 1
            call_id = self._call_ids
            self._send_all(RpcMsg(call_id, method, pickle.dumps((args, kwargs))))
            answers: list[Any] = []
            errors: list[str] = []
            for rank in range(self.world_size):
                while (rank, call_id) not in self._replies:
                    self._pump(rank)
                reply = self._replies.pop((rank, call_id))
                if isinstance(reply, ErrorMsg):
                    errors.append(f"rank {rank}: {reply.message}")
                    answers.append(None)
                else:
                    answers.append(pickle.loads(reply.payload))
        if errors:
            raise RuntimeError(f"collective_rpc {method!r} failed:\n" + "\n".join(errors))
        return answers

    def add_lora(self, adapter: Any) -> None:
        self.collective_rpc("add_lora", adapter)

    def remove_lora(self, name: str) -> None:
        self.collective_rpc("remove_lora", name)

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if self._closed:
            raise RuntimeError("the executor is shut down")
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._dead = f"worker rank {rank} (pid {proc.pid}) died ({_how(proc.exitcode)})"
                logger.error("%s", self._dead)
                raise WorkerDiedError(self._dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            data = _ENCODER.encode(ShutdownMsg())
            for push in self._to:
                try:
                    push.send(data, flags=self._zmq.NOBLOCK)
                except Exception:  # noqa: BLE001 - the worker may be gone already
                    pass
            deadline = time.monotonic() + 5.0
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self._finalizer()  # kills whatever is left, removes the socket folder
            for sock in self._to + self._from:
                sock.close(linger=0)
            self._ctx.term()


def _how(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _check_split(arch: Any, tp_size: int, pp_size: int, device: torch.device) -> None:
    """Refuse, before any process starts, a model that cannot be split this way or more
    GPUs than this machine has."""
    from tidal_engine.distributed.partition import check_tensor_parallel, layer_range

    check_tensor_parallel(arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, tp_size)
    layer_range(arch.num_hidden_layers, pp_size, 0)
    if device.type == "cuda" and tp_size * pp_size > torch.cuda.device_count():
        raise ValueError(f"tensor {tp_size} × pipeline {pp_size} needs {tp_size * pp_size} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")


def _kill_all(procs: list[Any], tmpdir: str) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)
    shutil.rmtree(tmpdir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _picklable_or_none(source: Any) -> Any:
    try:
        pickle.dumps(source)
        return source
    except Exception:  # noqa: BLE001 - the worker resolves the model itself then
        return None


# ---- the worker process ----------------------------------------------------------------
def _exit_after(outbox: "queue.Queue[Any]", push: Any, pull: Any, ctx: Any) -> None:
    """Deliver what is queued (an error message), then end the process. Every socket is
    closed first: ``term()`` waits for open sockets, and this rank would never exit."""
    outbox.put(None)
    outbox.join()
    pull.close(linger=0)
    push.close(linger=5000)
    ctx.term()  # returns once the error message is delivered (or after the 5 s linger)
    os._exit(1)


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    if use_pdeathsig:
        die_with_parent()  # PR_SET_PDEATHSIG: SIGKILL when the parent (thread) exits
    if not parent_alive(parent_pid):  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_S)
            if not parent_alive(parent_pid):
                os._exit(1)

    threading.Thread(target=watch, name="tidal-parent-watch", daemon=True).start()


def _worker_main(
    rank: int,
    tp_size: int,
    pp_size: int,
    config: Any,
    source: Any,
    device: str,
    dtype: str,
    to_addr: str,
    from_addr: str,
    dist_init: str,
    parent_pid: int,
    use_pdeathsig: bool,
    worker_kwargs: dict[str, Any],
) -> None:
    _die_with_parent(parent_pid, use_pdeathsig)
    # SIGTERM/SIGINT are the parent's (a Pod deletion signals the whole process group, and
    # the engine drains first): workers stop on ShutdownMsg, or die with their parent.
    ignore_termination_signals()
    set_process_title(f"tidal-worker rank {rank}")
    import zmq

    world_size = tp_size * pp_size
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(to_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(from_addr)
    outbox: queue.Queue[Any] = queue.Queue()

    def sender() -> None:  # the only user of `push`
        while True:
            item = outbox.get()
            try:
                if item is None:
                    return
                if isinstance(item, tuple):  # (step_id, WorkerStep)
                    step_id, step = item
                    try:
                        result = step.result()
                        msg: Any = ResultMsg(result) if rank == tp_size * (pp_size - 1) else None
                    except Exception:  # noqa: BLE001 - reported to the executor
                        msg = ErrorMsg("step", step_id, traceback.format_exc())
                        if world_size > 1:  # this rank's state has left the others': stop (the executor sees it)
                            logger.error("worker rank %d: step %d failed:\n%s", rank, step_id, msg.message)
                            push.send(_ENCODER.encode(msg))
                            os._exit(1)
                else:
                    msg = item
                if msg is not None:
                    push.send(_ENCODER.encode(msg))
            finally:
                outbox.task_done()

    threading.Thread(target=sender, name="tidal-worker-sender", daemon=True).start()
    try:
        if source is None:
            from tidal_engine.models.loader import resolve_model

            source = resolve_model(config.model, getattr(config, "cache_dir", None))
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank if world_size > 1 else (dev.index or 0))
            torch.cuda.set_device(dev)
        if dev.type == "cpu" and world_size > 1:  # ranks share the cores: don't oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        from tidal_engine.distributed.parallel_state import init_parallel

        init_parallel(tp_size, pp_size, rank, "nccl" if dev.type == "cuda" else "gloo", dist_init)
        # Same seed on every rank: the tensor ranks sample the same gathered logits with the
        # same random numbers, so they agree on every token without a broadcast.
        torch.manual_seed(getattr(config, "seed", 0))
        from tidal_engine.worker.worker import Worker

        worker = Worker(config, source, dev, getattr(torch, dtype), rank=rank, world_size=world_size, **worker_kwargs)
    except Exception:  # noqa: BLE001
        outbox.put(ErrorMsg("startup", 0, traceback.format_exc()))
        _exit_after(outbox, push, pull, ctx)
    outbox.put(ReadyMsg(rank, os.getpid(), worker.num_kv_blocks()))
    while True:
        msg = _TO_WORKER.decode(pull.recv())
        if isinstance(msg, ExecuteMsg):
            try:
                step = worker.execute(msg.plan)
            except Exception:  # noqa: BLE001 - with one rank, this step fails and the worker keeps serving
                outbox.put(ErrorMsg("step", msg.plan.step_id, traceback.format_exc()))
                if world_size > 1:
                    _exit_after(outbox, push, pull, ctx)  # the other ranks wait in a collective this rank never joins
                continue
            outbox.put((msg.plan.step_id, step))
        elif isinstance(msg, RpcMsg):
            outbox.join()  # every earlier step has completed (and been reported)
            try:
                args, kwargs = pickle.loads(msg.payload)
                value = getattr(worker, msg.method)(*args, **kwargs)
                outbox.put(RpcReplyMsg(msg.call_id, pickle.dumps(value)))
            except Exception:  # noqa: BLE001
                outbox.put(ErrorMsg("rpc", msg.call_id, traceback.format_exc()))
        else:  # ShutdownMsg
            break
    outbox.put(None)
    outbox.join()
    try:
        from tidal_engine.distributed.parallel_state import destroy_parallel

        destroy_parallel()
    except Exception:  # noqa: BLE001
        pass
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
