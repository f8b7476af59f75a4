"""The executors run fn(*context, job) and give the results in job order, on one process, a local
pool and a local Ray instance the test starts and shuts down; a job's exception reaches the caller
with its own type; closing leaves no worker process behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import executors
from partopt.cli import main
from partopt.errors import PartoptError, SolverError
from partopt.options import Options

INSTANCE = Path(__file__).parent.parent / "instances" / "mlp-2layer.json"


def power_sum(base: int, job: tuple) -> int:
    """sum(base ** k for k in job); job (-1,) fails with the project's own error type."""
    if job == (-1,):
        raise SolverError("job -1 fails on purpose", "job")
    return sum(base ** k for k in job)


def sleepy(seconds: float, job: tuple) -> int:
    """Sleep; job (directory,) first leaves this process's id there, for the test to watch."""
    if job:
        with open(os.path.join(job[0], str(os.getpid())), "w"):
            pass
    time.sleep(seconds)
    return os.getpid()


JOBS = [(k, k + 1) for k in range(12)]
EXPECTED = [3 ** k * 4 for k in range(12)]  # 3^k + 3^(k+1) = 4 · 3^k


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not reaped) is not running
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("workers", [1, 2])
def test_local_results_in_job_order(workers):
    executor = executors.make_executor("local", power_sum, (3,), workers)
    try:
        assert list(executor.map(JOBS)) == EXPECTED
        assert list(executor.map(JOBS[::-1])) == EXPECTED[::-1]  # the pool is reused across maps
    finally:
        executor.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_local_job_exception_keeps_its_type(workers):
    executor = executors.make_executor("local", power_sum, (3,), workers)
    try:
        results = executor.map([(0,), (-1,), (1,)])
        assert next(results) == 1
        with pytest.raises(SolverError, match="job -1 fails on purpose"):
            next(results)
    finally:
        executor.close()


def test_local_pool_runs_in_other_processes_and_close_without_wait_kills_them():
    executor = executors.make_executor("local", sleepy, (0.0,), 2)
    pids = set(executor.map([()] * 8))
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    slow = executors.make_executor("local", sleepy, (60.0,), 2)
    slow.map([(), ()])
    deadline = time.monotonic() + 30
    while not slow.pool._processes and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = set(slow.pool._processes)
    start = time.monotonic()
    slow.close(wait=False)
    executor.close(wait=False)
    assert time.monotonic() - start < 20  # did not wait for the 60 s jobs
    assert workers and not any(_alive(pid) for pid in workers | pids)


def test_close_without_wait_leaves_no_thread_for_the_exit_hook():
    """The pool's manager thread has ended and is off the list the interpreter's exit hook wakes: that hook
    writing to the pipe the ending thread closes was a traceback after a Ctrl-C under load."""
    from concurrent.futures.process import _threads_wakeups

    slow = executors.make_executor("local", sleepy, (60.0,), 2)
    slow.map([(), ()])
    manager = slow.pool._executor_manager_thread
    assert manager in _threads_wakeups
    slow.close(wait=False)
    assert not manager.is_alive() and manager not in _threads_wakeups


def test_unknown_kind_and_bad_worker_count_are_one_line_errors():
    with pytest.raises(PartoptError, match="unknown executor 'dask'"):
        executors.make_executor("dask", power_sum, (3,), 1)
    with pytest.raises(PartoptError, match="workers must be at least 1"):
        executors.make_executor("local", power_sum, (3,), 0)


def test_a_ray_address_without_the_ray_executor_is_refused():
    """Nothing would read it: the local pool has no address."""
    with pytest.raises(PartoptError, match=r"a Ray address \(auto\) is for the ray executor, not local") as info:
        Options(ray_address="auto")
    assert info.value.hint == "add --executor ray, or drop --ray-address"
    assert info.value.where == "ray_address"  # the library names its keyword; the CLI names the flag:
    result = CliRunner().invoke(main, ["solve", str(INSTANCE), "--cluster", "p3.16xlarge", "--ray-address", "auto"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --ray-address: a Ray address (auto)")
    assert Options(ray_address="auto", executor="ray").ray_address == "auto"


def test_missing_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(PartoptError, match=r"ray is not installed.*pip install 'partopt\[ray\]'"):
        executors.make_executor("ray", power_sum, (3,), 1)


@pytest.fixture
def ray_workers_import_tests(monkeypatch):
    """Ray's worker processes import this module (power_sum) by name: put tests/ on their path."""
    pytest.importorskip("ray")
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def test_ray_local_instance_same_results_and_exception_then_shut_down(ray_workers_import_tests, tmp_path):
    import ray

    executor = executors.make_executor("ray", power_sum, (3,), 2)
    try:
        assert ray.is_initialized()
        assert list(executor.map(JOBS)) == EXPECTED
        results = executor.map([(0,), (-1,), (1,)])
        assert next(results) == 1
        with pytest.raises(SolverError, match="job -1 fails on purpose"):
            next(results)
        # a second executor joins the running session: closing it without waiting kills its tasks, not the session
        slow = executors.make_executor("ray", sleepy, (60.0,), 2)
        slow.map([(str(tmp_path),), (str(tmp_path),)])
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(name) for name in os.listdir(tmp_path)]
        slow.close(wait=False)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 2 and not any(_alive(pid) for pid in pids) and ray.is_initialized()
    finally:
        executor.close()
    assert not ray.is_initialized()  # the instance it started is gone


def test_ray_unreachable_or_malformed_address_is_one_line_and_quick():
    pytest.importorskip("ray")
    start = time.monotonic()
    with pytest.raises(PartoptError, match="cannot reach the Ray cluster at 127.0.0.1:1") as info:
        executors.make_executor("ray", power_sum, (3,), 1, address="127.0.0.1:1")  # nothing listens on port 1
    assert "\n" not in info.value.line() and time.monotonic() - start < executors.PROBE_TIMEOUT_S + 1
    with pytest.raises(PartoptError, match="Ray address 'headnode' is not HOST:PORT"):
        executors.make_executor("ray", power_sum, (3,), 1, address="headnode")


def test_ray_auto_without_a_running_cluster_is_one_line(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if os.path.exists("/tmp/ray/ray_current_cluster"):
        pytest.skip("a Ray cluster runs on this machine")
    with pytest.raises(PartoptError, match="cannot start or reach the Ray cluster at auto") as info:
        executors.make_executor("ray", power_sum, (3,), 1, address="auto")
    assert "\n" not in info.value.line() and not ray.is_initialized()


def test_a_pool_started_in_the_background_takes_jobs_once_a_worker_is_up():
    pool = executors.LocalPool(sleepy, (0.0,), 2)
    try:
        began = time.perf_counter()
        pool.start()
        assert time.perf_counter() - began < 0.5  # returns before the workers have imported anything
        deadline = time.perf_counter() + 60
        while not pool.ready():
            assert time.perf_counter() < deadline
            time.sleep(0.05)
        assert all(pid != os.getpid() for pid in pool.map([(), ()]))
    finally:
        pool.close()


def test_a_search_moves_to_the_pool_midway_with_the_same_results(monkeypatch):
    """Pricing that has run here for WARM_S starts the pool in the background and goes on here until a worker
    is up; the results are those of pricing everything here."""
    from partopt import intra
    from partopt.cluster import preset
    from partopt.models import gpt
    from partopt.options import Options
    from partopt.pricing import Job, Pricer, Stats

    monkeypatch.setattr(Pricer, "WARM_S", 1e-9)
    graph = gpt(hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    view = intra.with_batch(graph, 2)
    ops = tuple(op.name for op in view.order if op.layer == 1)
    meshes = [preset("p3.16xlarge", 1).logical_mesh(sub, shape) for sub, shape in
              [((1, 2), (1, 2)), ((1, 2), (2, 1)), ((1, 4), (2, 2)), ((1, 4), (1, 4)), ((1, 8), (2, 4)), ((1, 8), (8, 1))]]
    jobs = {m: Job(2, 4, ops, mesh, "none", None) for m, mesh in enumerate(meshes)}
    with Pricer(graph, Options(workers=1)) as alone:
        expected = {k: (v.time_s, v.sync_s) for k, v in alone.run(jobs, Stats()).items()}
    seen_pool = False
    with Pricer(graph, Options(workers=2)) as pricer:
        deadline = time.perf_counter() + 60
        while not seen_pool:
            assert time.perf_counter() < deadline
            pricer.cache.clear()  # price the same jobs again, here or on the workers
            got = pricer.run(jobs, Stats())
            assert {k: (v.time_s, v.sync_s) for k, v in got.items()} == expected
            seen_pool = pricer.executor is not None and not pricer.booting
    assert seen_pool
