"""Process groups with real processes: nothing a child started outlives it.

Each child here starts a helper of its own that ignores SIGTERM (as a data
server that traps it might) and prints the helper's pid; the test then checks,
by pid, that the helper is gone after the stop sequence, after its parent
exited, after its parent's SIGKILL (``PR_SET_PDEATHSIG``, through the launcher)
and after an emulated machine death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agents.node.worker_process import WorkerProcess, stop_workers
from orchestrator.process_lifetime import (
    die_with_parent,
    exit_status,
    kill_tree,
    start_group,
    stop_groups,
    wait_exit,
)
from tests.faults.processes import still_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

#: A helper that only SIGKILL ends (it prints nothing; it sleeps).
HELPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _script(then: str, pid_file: Path | None = None) -> list[str]:
    """A Python child that starts :data:`HELPER`, prints its pid (or writes it to
    ``pid_file``), then runs ``then``."""
    tell = (
        f"open({str(pid_file)!r}, 'w').write(str(helper.pid))"
        if pid_file
        else ("print(helper.pid, flush=True)")
    )
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        helper = subprocess.Popen([sys.executable, "-c", {HELPER!r}])
        {tell}
        """
    )
    return [sys.executable, "-c", code + then]


def _helper_pid(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip(), "the child printed no helper pid"
    return int(line)


def test_the_stop_sequence_kills_the_group_the_child_ignoring_sigterm_too() -> None:
    proc = start_group(_script("time.sleep(600)"), stdout=subprocess.PIPE)
    helper = _helper_pid(proc)
    assert os.getpgid(proc.pid) == proc.pid and os.getsid(proc.pid) == proc.pid
    assert os.getpgid(helper) == proc.pid  # the helper is in the child's group
    assert stop_groups([proc], grace=5.0) == [-signal.SIGTERM]
    assert still_running([helper]) == []
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_child_that_exited_is_seen_unreaped_and_its_leftovers_killed() -> None:
    proc = start_group(_script("sys.exit(3)"), stdout=subprocess.PIPE)
    helper = _helper_pid(proc)
    assert wait_exit(proc, 30) == 3
    assert proc.returncode is None  # not reaped: its group id stays its own
    assert exit_status(proc) == 3
    assert still_running([helper], timeout=0.2) == [helper]  # left behind
    assert stop_groups([proc], grace=5.0) == [3]
    assert still_running([helper]) == []
    assert proc.stdout is not None
    proc.stdout.close()


def test_children_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    # the parent starts a tied child in a group of its own, then waits to be killed
    parent_code = textwrap.dedent(
        """
        import sys, time
        from orchestrator.process_lifetime import start_group
        child = start_group([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=dict(os.environ)
    )
    child = _helper_pid(parent)
    assert os.getsid(child) == child != os.getsid(parent.pid)
    parent.kill()  # the parent alone: its child is in another group
    parent.wait()
    assert still_running([child]) == []
    assert parent.stdout is not None
    parent.stdout.close()


def test_the_launcher_keeps_the_pid_and_reports_a_missing_program() -> None:
    proc = subprocess.Popen(
        die_with_parent([sys.executable, "-c", "import os; print(os.getpid())"]),
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=30)
    assert int(out) == proc.pid and proc.returncode == 0
    with pytest.raises(FileNotFoundError):
        die_with_parent(["no-such-program-here"])


def test_kill_tree_takes_descendants_in_sessions_of_their_own() -> None:
    # a "node": the root starts a worker in a session of its own, whose helper is in it
    root_code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        worker = subprocess.Popen({_script("time.sleep(600)")!r}, start_new_session=True,
                                  stdout=subprocess.PIPE)
        print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
        time.sleep(600)
        """
    )
    root = subprocess.Popen(
        [sys.executable, "-c", root_code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert root.stdout is not None
    worker, helper = (int(x) for x in root.stdout.readline().split())
    assert os.getsid(worker) != os.getsid(root.pid)
    kill_tree(root.pid)
    assert root.wait(30) == -signal.SIGKILL
    assert still_running([worker, helper]) == []
    root.stdout.close()


def test_a_worker_process_stops_as_a_group(tmp_path: Path) -> None:
    for i in range(2):
        os.mkfifo(tmp_path / f"helper-{i}")  # read once the worker wrote it: no polling
    workers = [
        WorkerProcess.start(
            _script(then, tmp_path / f"helper-{i}"),
            env=dict(os.environ),
            cwd=str(tmp_path),
            local_rank=i,
            error_file=tmp_path / f"error-{i}.json",
            shipper=None,
        )
        for i, then in enumerate(["sys.exit(0)", "time.sleep(600)"])
    ]
    done, running = workers
    helpers = [int((tmp_path / f"helper-{i}").read_text()) for i in range(2)]
    assert wait_exit(done.proc, 30) == 0
    assert running.running() and done.exit_code() == 0
    assert still_running(helpers, timeout=0.2) == helpers  # the exited worker's is left
    assert stop_workers(workers, grace=5.0) == [0, -signal.SIGTERM]
    assert still_running([running.pid, *helpers]) == []
