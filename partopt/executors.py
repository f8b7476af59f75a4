"""Where the pricing jobs run: in this process, on a local pool of processes, or on a Ray cluster.

Every executor runs `fn(*context, job)` for each job of `map(jobs)` and yields the results in job
order. `fn` must be a module-level function (it is pickled by reference) and `context` (the graph
and the options) is shipped to each worker once, not with every job. The local pool is the
embedded default and needs nothing running; Ray (`pip install 'partopt[ray]'`) spreads the jobs
over a cluster of machines, each of which must have partopt installed.
"""

from __future__ import annotations

import concurrent.futures.process
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator, Protocol, Sequence

from partopt.errors import PartoptError, first_line

KINDS = ("local", "ray")
PROBE_TIMEOUT_S = 5.0  # to open a TCP connection to a Ray cluster's address before handing it to Ray
JobFn = Callable[..., Any]


class Executor(Protocol):
    """Runs pricing jobs; `close` leaves no worker process behind, waiting for running jobs or not."""

    def map(self, jobs: Sequence[tuple]) -> Iterator[object]: ...

    def close(self, wait: bool = True) -> None: ...


def make_executor(kind: str, fn: JobFn, context: tuple, workers: int, address: str | None = None) -> Executor:
    """An executor of `kind` ("local" or "ray") running `fn(*context, job)` on `workers` processes.

    For "ray", `address` is "auto" (the running cluster this machine belongs to), "HOST:PORT", or
    None: start a local Ray instance with `workers` CPUs (shut down again by `close`).
    """
    if workers < 1:
        raise PartoptError(f"workers must be at least 1, got {workers}", "workers")
    if kind == "local":
        return InProcess(fn, context) if workers == 1 else LocalPool(fn, context, workers)
    if kind == "ray":
        return RayExecutor(fn, context, workers, address)
    raise PartoptError(f"unknown executor {kind!r}", "executor", f"use one of {list(KINDS)}")


class InProcess:
    """One worker: the jobs run here, one at a time as the results are consumed."""

    def __init__(self, fn: JobFn, context: tuple):
        self.fn, self.context = fn, context

    def map(self, jobs: Sequence[tuple]) -> Iterator[object]:
        return (self.fn(*self.context, job) for job in jobs)

    def close(self, wait: bool = True) -> None:
        """Nothing to release."""


_WORKER: dict = {}


def _worker_init(fn: JobFn, context: tuple, planner: int) -> None:
    """Pool worker set-up: keep the job function and its context for every later job; exit once the `planner`
    process is gone (a worker's parent is the fork server, which lives as long as its workers do)."""
    _WORKER.update(fn=fn, context=context)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the planner's to handle (it closes its executor)

    def orphaned() -> None:  # a killed planner must not leave its workers running
        while True:
            try:
                os.kill(planner, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=orphaned, daemon=True).start()


def _worker_job(job: tuple) -> object:
    return _WORKER["fn"](*_WORKER["context"], job)


def _worker_up() -> None:
    """A job that only proves a worker has started (`LocalPool.start`)."""


def _start_context(fn: JobFn) -> multiprocessing.context.BaseContext:
    """How workers start: forked from a fork server that imported `fn`'s module once and never ran a solver
    (a worker is up in milliseconds once the server is, where a spawned one imports partopt itself), or spawned
    where there is no fork server. Never forked from this process: the solvers' threads in it must not be
    copied mid-lock."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([fn.__module__])  # heeded when the server starts: once per process
    return context


def prepare(fn: JobFn) -> None:
    """Start the fork server of `_start_context` now, in the background (it imports partopt, about 0.75 s here),
    so that a pool started later forks its workers at once. Nothing where workers are spawned."""
    context = _start_context(fn)
    if context.get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


class LocalPool:
    """Worker processes on this machine, started by `start` or at the first `map`, and kept for later ones."""

    def __init__(self, fn: JobFn, context: tuple, workers: int):
        self.fn, self.context, self.workers = fn, context, workers
        self.pool: ProcessPoolExecutor | None = None
        self.started: list = []  # `_worker_up` futures: one done means a worker takes jobs
        self.launch: threading.Thread | None = None  # submits them (`start`)

    def start(self) -> None:
        """Start the workers now and return at once: the first pool of a process waits for its fork server to
        import partopt (about 0.75 s here) while the caller goes on; `ready` says when a worker can take jobs."""
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=_start_context(self.fn),
                                            initializer=_worker_init, initargs=(self.fn, self.context, os.getpid()))
            # each submit starts one worker, and the first waits for the fork server: off the caller's thread
            self.launch = threading.Thread(target=self._launch, args=(self.pool,), daemon=True)
            self.launch.start()

    def _launch(self, pool: ProcessPoolExecutor) -> None:
        self.started = [pool.submit(_worker_up) for _ in range(self.workers)]

    def ready(self) -> bool:
        """Whether a worker started by `start` can take jobs (`map` before then waits for one)."""
        return self.pool is not None and any(f.done() for f in self.started)

    def map(self, jobs: Sequence[tuple]) -> Iterator[object]:
        self.start()
        return self.pool.map(_worker_job, jobs, chunksize=1)

    def close(self, wait: bool = True) -> None:
        """Queued jobs are cancelled; running ones finish first, or without `wait` die with their workers."""
        if self.pool is None:
            return
        self.launch.join()  # every worker started, so that each is stopped below
        pool, self.pool = self.pool, None
        # the pool's own process table and manager thread: ProcessPoolExecutor.terminate_workers only arrives
        # in Python 3.14
        processes = list((pool._processes or {}).values())
        manager = pool._executor_manager_thread
        pool.shutdown(wait=wait, cancel_futures=True)
        if not wait:
            for process in processes:
                process.terminate()
            for process in processes:
                process.join()
            if manager is not None:
                # it ends once it sees its workers gone, closing its wake-up pipe, which the interpreter's exit
                # hook may be writing to at that moment (checked, then sent: a traceback after a Ctrl-C under
                # load); so it ends here, off that hook's list
                manager.join(timeout=10)
                concurrent.futures.process._threads_wakeups.pop(manager, None)


_RAY_CONTEXT: dict = {}


def _ray_job(fn: JobFn, context: list, job: tuple) -> object:
    """A Ray task: fetch the context from the object store once per worker process, then run the job.
    The context comes wrapped in a list so that Ray passes its reference, not a fresh copy per task."""
    import ray

    (ref,) = context
    key = ref.binary()
    if key not in _RAY_CONTEXT:
        _RAY_CONTEXT.clear()  # one planner's context at a time
        _RAY_CONTEXT[key] = ray.get(ref)
    return fn(*_RAY_CONTEXT[key], job)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise PartoptError("ray is not installed", "executor ray",
                           "pip install 'partopt[ray]', or use the local executor") from None
    return ray


def _probe(address: str) -> None:
    """Fail in seconds on an address nothing listens at: Ray itself retries for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise PartoptError(f"Ray address {address!r} is not HOST:PORT", "--ray-address",
                           "give auto, HOST:PORT (the head's GCS port, 6379 by default) or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise PartoptError(f"cannot reach the Ray cluster at {address}: {err.strerror or err}", "--ray-address",
                           "start one with `ray start --head`, check the address, or use the local executor") from None


class RayExecutor:
    """One Ray task per job; the context is put in the object store once."""

    def __init__(self, fn: JobFn, context: tuple, workers: int, address: str | None):
        ray = self.ray = _import_ray()
        self.fn = fn
        self.owned = not ray.is_initialized()  # a session someone else opened is theirs to close
        if self.owned:
            if address not in (None, "auto"):
                _probe(address)
            try:
                if address is None:
                    ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR",
                             log_to_driver=False)
                else:
                    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as err:
                where = "local Ray instance" if address is None else f"Ray cluster at {address}"
                raise PartoptError(f"cannot start or reach the {where}: {first_line(err)}",
                                   "executor ray" if address is None else "--ray-address",
                                   "start one with `ray start --head`, check the address, "
                                   "or use the local executor") from None
        self.context = [ray.put(context)]
        self.task = ray.remote(num_cpus=1)(_ray_job)
        self.pending: set = set()  # tasks submitted and not yet collected

    def map(self, jobs: Sequence[tuple]) -> Iterator[object]:
        refs = [self.task.remote(self.fn, self.context, job) for job in jobs]
        self.pending.update(refs)
        return self._results(refs)

    def _results(self, refs: list) -> Iterator[object]:
        for ref in refs:
            try:
                result = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as err:
                raise err.cause from None  # the job's own exception, as the local executors raise it
            finally:
                self.pending.discard(ref)
            yield result

    def close(self, wait: bool = True) -> None:
        """Without `wait`, jobs not yet finished are cancelled (their worker processes killed)."""
        if self.pending:
            if wait:
                self.ray.wait(list(self.pending), num_returns=len(self.pending))
            else:
                for ref in self.pending:
                    self.ray.cancel(ref, force=True)
            self.pending = set()
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()
            self.owned = False
