"""One run of ``examples/train_torchrun.py`` with a whole node SIGKILLed mid-run.

The restart tier's benchmarks (``recovery.py --tier0`` and
``restart_at_size.py``) run the same unmodified torchrun script twice, on
127.0.0.1, and kill a node once it has logged a given step:

* :func:`run_ringmaster`: ``LocalRun`` with 2 active nodes and 1 warm spare
  (``recovery: restart``: every worker starts again from a pre-imported
  standby; rank 0's node hosts the store of its generation only); the node of
  a given rank is killed (agent and workers), rank 0's by default;
* :func:`run_torchrun`: three stock ``torchrun --nnodes=2:3`` agents on the
  c10d rendezvous whose store lives in a process of its own
  (:func:`store_process`: torchrun's best case, since the whole job ends when
  a killed agent hosts the rendezvous store), short rendezvous timeouts,
  ``--max-restarts 3``; the node (agent and worker) of a given rank is
  killed, or of the worker that logged the latest step.  The three agents
  all train until then (world size 3; torchrun has no idle spare: with
  ``--nnodes=2`` a third agent restarted the group at every round here), and
  the two survivors re-form without it.  When the killed
  node is group rank 0, whose agent hosts the workers' store
  (``use_agent_store``), torchrun 2.13's survivors were seen to re-form with
  that dead store's address and never train again.

Both read the script's step log (``--step-log``: ``step time restart pid``
per line, ``rank-<rank>.log``) and measure the seconds from the SIGKILL to
the first step of a worker started after it, and the steps lost
(:func:`measure`).  Runs in the benchmark's own process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.process_lifetime import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_torchrun.py"
#: How long torchrun gets to train again after the kill before it counts as not recovered.
TORCHRUN_PATIENCE_S = 90.0
#: How long a run may take to reach the step at which it is killed.
KILL_PATIENCE_S = 600.0

#: Called every poll while a run is followed (a benchmark's own watch on its files).
Watch = Callable[[], None]


def step_entries(logs: Path) -> list[tuple[float, int, int]]:
    """(time, step, pid) of every step the script logged (``step`` counts completed
    steps, from 1), in time order."""
    out = []
    for f in logs.glob("*.log"):
        for line in f.read_text().splitlines():
            step, t, _restart, pid = line.split()
            out.append((float(t), int(step), int(pid)))
    return sorted(out)


def measure(logs: Path, killed_at: float) -> tuple[float, int]:
    """(seconds from the kill to the first step of a worker started after it, steps lost)."""
    entries = step_entries(logs)
    old = {p for t, _, p in entries if t <= killed_at}
    last_before = max((s for t, s, _ in entries if t <= killed_at), default=0)
    after = [(t, s) for t, s, p in entries if t > killed_at and p not in old]
    if not after:
        return float("inf"), -1
    resumed = min(s for _, s in after)
    return after[0][0] - killed_at, max(0, last_before + 1 - resumed)


def _reached(logs: Path, step: int) -> bool:
    return any(s >= step for _, s, _ in step_entries(logs))


def run_ringmaster(
    tmp: Path,
    name: str,
    args: list[str],
    kill_at: int,
    *,
    until_recovered: bool = False,
    env: dict[str, str] | None = None,
    watch: Watch | None = None,
    victim_rank: int = 0,
) -> dict[str, Any]:
    """The script under ringmaster's restart tier; a node killed at ``kill_at``.

    Args:
        tmp: the run's directory: ``steps/`` (its step log), ``ckpt/`` (checkpoint.url).
        name: the job's name.
        args: the script's arguments (``--step-log`` is added).
        kill_at: the step after which the node is killed.
        until_recovered: end the job once a restarted worker has completed a step
            (else it runs to its end and must succeed).
        env: the job's ``entrypoint.env``.
        watch: called every poll while the run is followed.
        victim_rank: the rank whose node is killed (0: the node that hosts the store).

    Returns:
        ``recovery_s``, ``steps_lost``, ``killed_at`` (wall clock) and the phases of
        ringmaster's ``Recovered`` event (``detect_s``...).
    """
    from orchestrator.local_run import LocalRun
    from orchestrator.spec.entrypoint import resolve_recovery
    from orchestrator.spec.loader import load_job_data
    from orchestrator.state import jobs

    logs = tmp / "steps"
    logs.mkdir()
    spec = load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(SCRIPT),
                "args": [*args, "--step-log", str(logs)],
                "env": env or {},
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "checkpoint": {"url": f"file://{tmp}/ckpt"},
        }
    )
    spec, why = resolve_recovery(spec, REPO)
    assert spec.fault_tolerance.recovery.value == "restart", why
    lines: list[str] = []
    run = LocalRun(spec, printer=lines.append, workdir=str(REPO))
    run.start()
    killed_at = 0.0
    try:
        deadline = time.time() + KILL_PATIENCE_S
        while time.time() < deadline:
            if watch is not None:
                watch()
            status = jobs.read_status(run.client, spec.name)
            if _reached(logs, kill_at) and status and status.active_nodes:
                killed_at = time.time()
                # the plan's members in rank order: rank 0's node hosts the store
                run.kill_node(status.active_nodes[victim_rank])
                break
            time.sleep(0.01)
        assert killed_at, f"step {kill_at} not reached\n" + "\n".join(lines[-40:])
        if until_recovered:
            until = time.time() + KILL_PATIENCE_S
            while time.time() < until and measure(logs, killed_at)[0] == float("inf"):
                if watch is not None:
                    watch()
                time.sleep(0.05)
            phases = _recovered_phases(run.client, spec.name, time.time() + 10)
        else:
            result = run.wait()
            assert result.phase.value == "Succeeded", "\n".join(lines[-40:])
            phases = _recovered_phases(run.client, spec.name, time.time())
    finally:
        run.stop(grace=0.0 if until_recovered else 15.0)
    recovery, lost = measure(logs, killed_at)
    assert recovery != float("inf"), "no step after the kill\n" + "\n".join(lines[-40:])
    return {"recovery_s": recovery, "steps_lost": lost, "killed_at": killed_at, **phases}


def _recovered_phases(client: Any, job: str, until: float) -> dict[str, float]:
    """The phases of the job's ``Recovered`` event (from the survivor's first report of
    the break), waiting for it until ``until``; empty when none came."""
    from orchestrator.state import events

    while True:
        found = [e for e in events.list_events(client, job) if e.type == "Recovered"]
        if found or time.time() >= until:
            break
        time.sleep(0.1)
    phases = found[-1].data.get("phases", {}) if found else {}
    if not phases:
        return {}
    # named as the event's message names them in this tier
    return {
        "detect_s": float(phases["detect"]),
        "relaunch_s": float(phases["rendezvous"]),
        "to_first_output_s": float(phases["restore"]) + float(phases["first_step"]),
    }


def torchrun_nodes(
    port: int, args: list[str], output: Path | None = None, script: Path = SCRIPT
) -> list[subprocess.Popen[bytes]]:
    """Three ``torchrun --nnodes=2:3`` agents running ``script``, on the c10d store at
    ``port``; each in a session of its own (one ``killpg`` takes a whole node), its
    output (its workers' too) in ``output/agent-<i>.log`` (discarded without one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env = {k: v for k, v in env.items() if not k.startswith("RINGMASTER_")}
    if output is not None:
        env["LOGLEVEL"] = "INFO"  # the agents' rendezvous rounds
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2:3",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench",
                "--rdzv-conf=is_host=false,join_timeout=60,last_call_timeout=1,"
                "close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2",
                "--max-restarts=3",
                "--monitor-interval=0.1",
                str(script),
                *args,
            ],
            env=env,
            stdout=subprocess.DEVNULL if output is None else (output / f"agent-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(3)
    ]


def store_process(port: int) -> subprocess.Popen[bytes]:
    """torchrun's c10d rendezvous store in a process of its own (no node hosts it)."""
    store = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, datetime, torch.distributed as d;"
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False,"
            " timeout=datetime.timedelta(seconds=600));"
            "print('ready', flush=True); time.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
    )
    assert store.stdout is not None
    store.stdout.readline()
    return store


def run_torchrun(
    tmp: Path,
    args: list[str],
    kill_at: int,
    *,
    patience: float = TORCHRUN_PATIENCE_S,
    watch: Watch | None = None,
    victim_rank: int | None = None,
) -> dict[str, Any]:
    """The script under stock torchrun; a node killed at ``kill_at``.

    Args:
        tmp: the run's directory: ``steps/`` (its step log), ``ckpt/`` (the script's
            ``--checkpoint-dir``).
        args: the script's arguments (``--step-log`` and ``--checkpoint-dir`` are added).
        kill_at: the step after which the node is killed.
        patience: seconds after the kill for a restarted worker to complete a step.
        watch: called every poll while the run is followed.
        victim_rank: the rank whose node is killed (None: the node of the worker that
            logged the latest step).

    Returns:
        ``recovery_s`` (inf: no step within ``patience``), ``steps_lost`` and
        ``killed_at`` (wall clock).
    """
    logs = tmp / "steps"
    logs.mkdir()
    port = free_port()
    store = store_process(port)
    nodes = torchrun_nodes(
        port, [*args, "--step-log", str(logs), "--checkpoint-dir", str(tmp / "ckpt")], tmp
    )
    killed_at, killed_agent = 0.0, ""
    try:
        deadline = time.time() + KILL_PATIENCE_S
        while time.time() < deadline:
            if watch is not None:
                watch()
            victim = _victim(nodes, logs, victim_rank)
            if _reached(logs, kill_at) and victim is not None:
                node, worker = victim
                killed_agent = f"agent-{nodes.index(node)}"
                killed_at = time.time()
                os.killpg(node.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
                break
            time.sleep(0.01)
        until = time.time() + patience
        while time.time() < until and killed_at:
            if watch is not None:
                watch()
            if measure(logs, killed_at)[0] != float("inf"):
                break
            if all(n.poll() is not None for n in nodes):
                break
            time.sleep(0.05)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
        store.kill()
        store.wait()
        kill_leftovers(str(logs))
    assert killed_at, f"step {kill_at} not reached under torchrun"
    recovery, lost = measure(logs, killed_at)
    out: dict[str, Any] = {"recovery_s": recovery, "steps_lost": lost, "killed_at": killed_at}
    if recovery == float("inf"):
        out["why"] = _last_errors(tmp)
        out["restart_counts"] = restart_counts(tmp, killed_agent)
    return out


def kill_leftovers(marker: str) -> int:
    """SIGKILL every process whose command line holds ``marker`` (the run's own step-log
    directory); returns how many.  torchrun's workers run in sessions of their own: a
    worker stuck in ``init_process_group`` outlives its agent's ``killpg`` and would hold
    its memory through the next runs (seen: four 0.5 GB workers left from two runs)."""
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
    return killed


def restart_counts(output: Path, killed: str) -> dict[str, int]:
    """Each surviving torchrun agent's last ``restart_count`` (from its INFO log; not the
    ``killed`` one's).  The workers' store keys are prefixed with it
    (``/worker/attempt_<n>``): agents that disagree start workers that wait for each
    other under different prefixes."""
    counts = {}
    for f in sorted(output.glob("agent-*.log")):
        if f.stem == killed:
            continue
        found = re.findall(r"restart_count=(\d+)", f.read_text(errors="replace"))
        if found:
            counts[f.stem] = int(found[-1])
    return counts


def _last_errors(output: Path) -> list[str]:
    """Where each torchrun agent was when it was given up on: its last log line of its
    own (``I``/``W``/``E`` and a date), and its workers' last error line after that."""
    found = []
    for f in sorted(output.glob("agent-*.log")):
        lines = f.read_text(errors="replace").splitlines()
        own = [i for i, line in enumerate(lines) if re.match(r"[IWE]\d{4} ", line)]
        if not own:
            continue
        last = own[-1]
        errors = [line for line in lines[last:] if "Error" in line and "frame #" not in line]
        tail = f"; then {errors[-1].strip()[:200]}" if errors else ""
        found.append(f"{f.stem}: {lines[last].strip()[:300]}{tail}")
    return found


def _victim(
    nodes: list[subprocess.Popen[bytes]], logs: Path, rank: int | None
) -> tuple[subprocess.Popen[bytes], int] | None:
    """The torchrun agent whose worker logs ``rank``'s steps now (None: the worker that
    logged the latest step), and that worker's pid."""
    if rank is None:
        entries = step_entries(logs)
        worker = entries[-1][2] if entries else -1
    else:
        log = logs / f"rank-{rank}.log"
        lines = log.read_text().splitlines() if log.exists() else []
        worker = int(lines[-1].split()[3]) if lines else -1
    parent = parent_pid(worker)
    return next(((n, worker) for n in nodes if n.pid == parent), None)


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (-1 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
