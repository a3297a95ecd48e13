"""ringmaster beside its peers: the same small DDP job under four systems, one run.

The job (``benchmarks/_peers/common.py``): examples/train_tiny.py's MLP, data
order and global batch of 64, SGD with momentum, and a sleep of
``--step-time`` inside each step for the per-step work.  2 nodes train; a
node is one process group (agent and worker, or torchft's replica group).

Systems (wiring and why in docs/peers.md):

* ``ringmaster``: in-process hot-swap (``benchmarks/_peers/ringmaster_job.py``),
  2 active nodes and 1 warm spare, no periodic checkpoints (a replacement gets
  the state from a live peer).
* ``tier0``: ringmaster's restart tier running the plain torchrun script
  ``benchmarks/_peers/ddp_job.py`` unchanged (``recovery: restart``), 2 active
  nodes and 1 warm spare; the script checkpoints every ``--ckpt-every`` steps.
* ``torchft``: a Lighthouse and one replica group (one process) per node,
  torchft's Manager, DDP and Optimizer wrappers on gloo, as in its DDP example.
  It has no spares: every live replica group trains.
* ``torchrun``: stock ``torchrun --nnodes=2`` agents on the c10d rendezvous
  with its store in a process of its own (as ``benchmarks/recovery.py``), the
  script checkpointing every ``--ckpt-every`` steps; it has no spares.
* ``ddp``: the same torchrun script under torchrun with no fault tolerance
  (no restarts, no checkpoints): the steady-state yardstick.

Measured, all on this machine in this run:

1. steady state: steps/s at ``--step-time`` and at 10 ms, against ``ddp``;
2. one node SIGKILLed (all of its processes) at step ``--kill-at``, and
   started again at once as the system expects (ringmaster: a new agent, a
   spare; torchft: a new replica group that heals from a live one; torchrun:
   a new agent that joins the next rendezvous): seconds from the kill to the
   first completed step that started after it, steps lost (completed before
   the kill, computed again after), and whether the final parameters equal
   those of the same system's fault-free run;
3. goodput: for ``--window`` seconds from the first completed step, a node is
   killed every ``--periods`` seconds (at half a period, then every period)
   and started again; effective training = steps gained times the system's own
   fault-free step time / window (from the first completed step): the same as
   ringmaster's own "effective training since the first step" (productive step
   time over the wall time since the first step; start-up is left out of both).
   Each kill's time to the next step is listed, with the worst and the mean;
   for ringmaster also whether a warm spare stood ready at the kill and the
   phases of the job's own ``Recovered`` event.

A kill is timed from the moment the node's processes are all dead (the kill
has returned): a step that started while they were being killed can still
complete, and is not a step "after" the kill.

``--smoke`` runs the smallest configuration that goes through every row's
code (:data:`SMOKE`): every system, each row once (steady state, one
failure, one goodput run), 30 steps of 20 ms and a goodput window of 6 s.

The last line is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process forks agents (see orchestrator.etcd.grpc_env)
apply_grpc_environment()

from benchmarks._restart_runs import parent_pid, store_process  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.process_lifetime import free_port  # noqa: E402

#: the workers' scripts: a directory of their own, since a script's directory comes first
#: on its sys.path and benchmarks/checkpoint.py would shadow ringmaster's checkpoint package
JOBS = REPO / "benchmarks" / "_peers"
SYSTEMS = ("ringmaster", "tier0", "torchft", "torchrun")
#: seconds a run may take to finish (or, after a kill, to train again) before it is given up
PATIENCE_S = 90.0
#: the Lighthouse's --heartbeat_timeout_ms (main() sets it from its flag)
TORCHFT_HEARTBEAT_TIMEOUT_MS = 5000
#: steps ignored at the start of a steady-state run (startup, first quorum, warm-up)
WARM_STEPS = 20
#: ``--smoke``: every system through every row once, at the smallest size (the 10 ms
#: steady state is the 20 ms one's runs, not run again; a 6 s goodput window, one kill)
SMOKE = {
    "steps": WARM_STEPS + 10,
    "fast_steps": WARM_STEPS + 10,
    "kill_at": WARM_STEPS + 2,
    "step_time": 0.02,
    "fast_step_time": 0.02,
    "ckpt_every": 5,
    "rounds": 1,
    "fast_rounds": 1,
    "periods": "6",
    "window": 6.0,
    "max_kills": 1,
}


# -- step logs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    step: int
    t_start: float
    t_end: float
    world: int
    pid: int


def read_log(directory: Path) -> list[Entry]:
    out = []
    for f in directory.glob("*.log"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                s, a, b, w, p = parts
                out.append(Entry(int(s), float(a), float(b), int(w), int(p)))
    return sorted(out, key=lambda e: e.t_end)


def after_kill(entries: list[Entry], killed_at: float) -> tuple[float, int]:
    """(seconds from the kill to the first completed step started after it, steps lost)."""
    later = [e for e in entries if e.t_start >= killed_at]
    if not later:
        return float("inf"), -1
    before = max((e.step for e in entries if e.t_end <= killed_at), default=-1)
    resumed = min(e.step for e in later)
    return min(e.t_end for e in later) - killed_at, max(0, before + 1 - resumed)


def step_intervals(entries: list[Entry], warm: int = WARM_STEPS) -> list[float]:
    """Seconds between the first completions of consecutive steps (after ``warm``)."""
    first: dict[int, float] = {}
    for e in entries:
        first.setdefault(e.step, e.t_end)
    return [first[s + 1] - first[s] for s in sorted(first) if s >= warm and s + 1 in first]


def between_steps(entries: list[Entry], warm: int = WARM_STEPS) -> float:
    """Median seconds a worker spends between the end of one step and the start of the next
    (ringmaster's step boundary; ~0 for the others, whose per-step control is in the step)."""
    by_pid: dict[int, list[Entry]] = {}
    for e in entries:
        if e.step >= warm:
            by_pid.setdefault(e.pid, []).append(e)
    gaps = [b.t_start - a.t_end for xs in by_pid.values() for a, b in itertools.pairwise(xs)]
    return statistics.median(gaps) if gaps else float("nan")


def step_period(entries: list[Entry], warm: int = WARM_STEPS) -> float:
    """Seconds per step of a fault-free run, from the first completion of each step."""
    first: dict[int, float] = {}
    for e in entries:
        first.setdefault(e.step, e.t_end)
    steps = sorted(s for s in first if s >= warm)
    if len(steps) < 2:
        return float("nan")
    return (first[steps[-1]] - first[steps[0]]) / (steps[-1] - steps[0])


# -- the systems ------------------------------------------------------------------------


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and parent_pid(int(d.name)) == pid:
            out.append(int(d.name))
    return out


@dataclass
class System:
    """One system running the job in ``tmp``; nodes are named, oldest first."""

    tmp: Path
    steps: int
    step_time: float
    ckpt_every: int
    logs: Path = field(init=False)
    started: dict[str, float] = field(init=False, default_factory=dict)
    lines: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.logs = self.tmp / "steps"
        self.logs.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        raise NotImplementedError

    def training(self) -> list[str]:
        """Nodes that train now, the longest-running first."""
        raise NotImplementedError

    def kill(self, node: str) -> None:
        raise NotImplementedError

    def replace(self, node: str) -> None:
        """Start the killed node again, the way the system expects it back."""
        raise NotImplementedError

    def finished(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def finals(self) -> list[Path]:
        return sorted(self.tmp.glob("final.pt*"))

    def recoveries(self, expected: int) -> list[dict[str, object]]:
        """The system's own account of each recovery, oldest first (none for most)."""
        return []

    def warm_spares(self) -> list[str] | None:
        """The warm spares standing ready now (None: the system has no spares)."""
        return None

    def _by_age(self, nodes: list[str]) -> list[str]:
        return sorted(nodes, key=lambda n: self.started.get(n, 0.0))


class Ringmaster(System):
    """LocalRun: embedded etcd, a controller, 2 active agents and 1 spare."""

    restart_tier = False

    def spec_data(self) -> dict[str, object]:
        return {
            "name": "bench-peers",
            "entrypoint": {
                "script": str(JOBS / "ringmaster_job.py"),
                "args": [
                    "--steps",
                    str(self.steps),
                    "--step-time",
                    str(self.step_time),
                    "--step-log",
                    str(self.logs),
                    "--out",
                    str(self.tmp / "final.pt"),
                ],
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "max_steps": self.steps,
            "checkpoint": {"url": f"file://{self.tmp}/ckpt", "every_steps": 0},
            "fault_tolerance": {"recovery": "in_process", "heartbeat_interval": "500ms"},
        }

    def start(self) -> None:
        from orchestrator.local_run import LocalRun
        from orchestrator.spec.loader import load_job_data

        self.run = LocalRun(
            load_job_data(self.spec_data()),
            printer=self.lines.append,
            workdir=str(REPO),
            metrics_port=None,
        )
        self.run.start()
        now = time.time()
        self.started = {n: now for n in self.run.node_names()}
        self._spawned = len(self.started)

    def training(self) -> list[str]:
        from orchestrator.state import jobs

        status = jobs.read_status(self.run.client, self.run.spec.name)
        return self._by_age(list(status.active_nodes)) if status else []

    def kill(self, node: str) -> None:
        self.run.kill_node(node)
        self.started.pop(node, None)

    def replace(self, node: str) -> None:
        name = f"node-{self._spawned}"  # a fresh name: the dead one's lease may still live
        self._spawned += 1
        self.run.add_node(name, rack="rack-0")
        self.started[name] = time.time()

    def finished(self) -> bool:
        from orchestrator.state import jobs

        status = jobs.read_status(self.run.client, self.run.spec.name)
        if not (status and status.phase.terminal):
            return False
        # the phase ends before rank 0 has written its final parameters and exited; a
        # spare started late (at a kill near the end) may still be starting: not waited for
        members = set(status.active_nodes)
        agents = [
            p
            for n, p in self.run.procs.items()
            if not n.startswith("controller") and (n in members or not members)
        ]
        return all(p.popen.poll() is not None for p in agents)

    def recoveries(self, expected: int) -> list[dict[str, object]]:
        """The job's ``Recovered`` events (message, phases), each with the ``Generation``
        event it ended (which says who replaced whom, and any wait for a spare), waiting
        up to 5 s for ``expected`` of them."""
        from orchestrator.state import events

        deadline = time.time() + 5.0
        while True:
            found = events.list_events(self.run.client, self.run.spec.name)
            recovered = [e for e in found if e.type == "Recovered"]
            if len(recovered) >= expected or time.time() >= deadline:
                break
            time.sleep(0.1)
        plans = {e.data.get("generation"): e.message for e in found if e.type == "Generation"}
        return [
            {
                "message": e.message,
                "plan": plans.get(e.data.get("generation"), ""),
                "phases": e.data.get("phases", {}),
            }
            for e in recovered
        ]

    def warm_spares(self) -> list[str] | None:
        from orchestrator.state import jobs

        status = jobs.read_status(self.run.client, self.run.spec.name)
        return list(status.spare_nodes) if status else []

    def stop(self) -> None:
        for proc in self.run.procs.values():
            _kill_group(proc.popen.pid)
        self.run.stop(grace=0.1)


class Tier0(Ringmaster):
    """The plain torchrun script under ringmaster's restart tier."""

    restart_tier = True

    def spec_data(self) -> dict[str, object]:
        return {
            "name": "bench-peers-tier0",
            "entrypoint": {
                "script": str(JOBS / "ddp_job.py"),
                "args": [
                    "--steps",
                    str(self.steps),
                    "--step-time",
                    str(self.step_time),
                    "--checkpoint-every",
                    str(self.ckpt_every),
                    "--step-log",
                    str(self.logs),
                    "--out",
                    str(self.tmp / "final.pt"),
                ],
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "checkpoint": {"url": f"file://{self.tmp}/ckpt"},
            "fault_tolerance": {"recovery": "restart", "max_restarts": 1000},
        }


class Torchft(System):
    """A Lighthouse and one replica group (one process) per node; no spares."""

    def start(self) -> None:
        self.port = free_port()
        self.lighthouse = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "torchft_lighthouse"),
                # torchft's README: the lighthouse for DDP
                "--min_replicas",
                "1",
                "--quorum_tick_ms",
                "100",
                "--join_timeout_ms",
                "10000",
                "--heartbeat_timeout_ms",
                str(TORCHFT_HEARTBEAT_TIMEOUT_MS),
                "--bind",
                f"127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for group in range(2):
            self._launch(f"replica-{group}")

    def _launch(self, node: str) -> None:
        env = dict(
            os.environ, OMP_NUM_THREADS="1", TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}"
        )
        out = open(self.tmp / f"{node}.out", "ab")  # noqa: SIM115
        self.procs[node] = subprocess.Popen(
            [
                sys.executable,
                str(JOBS / "torchft_job.py"),
                "--replica-group",
                node.rsplit("-", 1)[1],
                "--steps",
                str(self.steps),
                "--step-time",
                str(self.step_time),
                "--step-log",
                str(self.logs),
                "--out",
                str(self.tmp / "final.pt"),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.started[node] = time.time()

    def training(self) -> list[str]:
        return self._by_age([n for n, p in self.procs.items() if p.poll() is None])

    def kill(self, node: str) -> None:
        _kill_group(self.procs[node].pid)
        self.procs[node].wait()
        self.started.pop(node, None)

    def replace(self, node: str) -> None:
        self._launch(node)

    def finished(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def stop(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            _kill_group(p.pid)
            p.wait()


class Torchrun(System):
    """Stock torchrun: 2 agents (``--nnodes=2``), c10d store in a process of its own.

    With ``fault_tolerant=False`` it is plain DDP: no restarts, no checkpoints.
    """

    fault_tolerant = True

    def start(self) -> None:
        self.port = free_port()
        self.store = store_process(self.port)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._spawned = 0
        for _ in range(2):
            self._launch()

    def _launch(self) -> None:
        node = f"agent-{self._spawned}"
        self._spawned += 1
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env = {k: v for k, v in env.items() if not k.startswith("RINGMASTER_")}
        args = ["--steps", str(self.steps), "--step-time", str(self.step_time)]
        args += ["--step-log", str(self.logs), "--out", str(self.tmp / "final.pt")]
        if self.fault_tolerant:
            args += ["--checkpoint-every", str(self.ckpt_every)]
            args += ["--checkpoint-dir", str(self.tmp / "ckpt")]
        out = open(self.tmp / f"{node}.out", "ab")  # noqa: SIM115
        self.procs[node] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                "--rdzv-id=peers",
                # the short timeouts of benchmarks/recovery.py: torchrun at its quickest
                "--rdzv-conf=is_host=false,join_timeout=60,last_call_timeout=1,"
                "close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2",
                f"--max-restarts={1000 if self.fault_tolerant else 0}",
                "--monitor-interval=0.1",
                str(JOBS / "ddp_job.py"),
                *args,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.started[node] = time.time()

    def training(self) -> list[str]:
        return self._by_age([n for n, p in self.procs.items() if p.poll() is None])

    def kill(self, node: str) -> None:
        agent = self.procs[node]
        workers = _children(agent.pid)
        _kill_group(agent.pid)  # the agent and, in its group, its workers
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
        agent.wait()
        self.started.pop(node, None)
        del self.procs[node]

    def replace(self, node: str) -> None:
        self._launch()

    def finished(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            for w in _children(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGKILL)
            _kill_group(p.pid)
            p.wait()
        self.store.kill()
        self.store.wait()


class PlainDDP(Torchrun):
    fault_tolerant = False


FACTORIES: dict[str, Callable[..., System]] = {
    "ringmaster": Ringmaster,
    "tier0": Tier0,
    "torchft": Torchft,
    "torchrun": Torchrun,
    "ddp": PlainDDP,
}


# -- measurements -----------------------------------------------------------------------


def _wait_first_step(system: System, timeout: float = PATIENCE_S) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        entries = read_log(system.logs)
        if entries:
            return entries[0].t_end
        time.sleep(0.05)
    raise RuntimeError(f"no step within {timeout:g}s:\n" + "\n".join(system.lines[-30:]))


def _wait_finished(system: System, timeout: float = PATIENCE_S) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if system.finished():
            return True
        time.sleep(0.1)
    return False


def steady(
    name: str, tmp: Path, steps: int, step_time: float, ckpt_every: int
) -> dict[str, object]:
    """A fault-free run: its step time and its final parameters."""
    system = FACTORIES[name](tmp, steps, step_time, ckpt_every)
    t0 = time.time()
    system.start()
    try:
        finished = _wait_finished(system, PATIENCE_S + steps * step_time * 3)
    finally:
        system.stop()
    entries = read_log(system.logs)
    period = step_period(entries)
    done = len({e.step for e in entries})
    intervals = step_intervals(entries)
    return {
        "period_s": period,
        "median_step_s": statistics.median(intervals) if intervals else float("nan"),
        "between_steps_s": between_steps(entries),
        "steps_per_s": 1 / period if period == period else None,
        "finished": finished and done == steps,
        "startup_s": (entries[0].t_end - t0) if entries else None,
        "finals": system.finals(),
    }


def compare(finals: list[Path], reference: list[Path]) -> tuple[bool | None, float | None]:
    """(bitwise equal, largest absolute difference) of every final file against the first
    reference; (None, None) when either side wrote none."""
    import torch

    if not finals or not reference:
        return None, None
    ref = torch.load(reference[0], weights_only=True)
    equal, worst = True, 0.0
    for f in finals:
        got = torch.load(f, weights_only=True)
        for k, v in ref.items():
            equal = equal and torch.equal(v, got[k])
            worst = max(worst, (v - got[k]).abs().max().item())
    return equal, worst


def single_failure(
    name: str,
    tmp: Path,
    steps: int,
    step_time: float,
    ckpt_every: int,
    kill_at: int,
    reference: list[Path],
) -> dict[str, object]:
    system = FACTORIES[name](tmp, steps, step_time, ckpt_every)
    system.start()
    killed_at, victim, spares = 0.0, "", None
    try:
        deadline = time.time() + PATIENCE_S
        while time.time() < deadline and not killed_at:
            entries = read_log(system.logs)
            nodes = system.training()
            if entries and max(e.step for e in entries) >= kill_at and len(nodes) >= 2:
                victim = nodes[0]
                spares = system.warm_spares()
                system.kill(victim)
                killed_at = time.time()  # every process of the node is dead
                system.replace(victim)
            time.sleep(0.01)
        finished = _wait_finished(system, PATIENCE_S + steps * step_time * 3)
        recovered = system.recoveries(1) if killed_at else []
    finally:
        system.stop()
    entries = read_log(system.logs)
    recovery, lost = after_kill(entries, killed_at) if killed_at else (float("inf"), -1)
    equal, diff = compare(system.finals(), reference) if finished else (None, None)
    return {
        "victim": victim,
        "next_step_s": recovery,
        "steps_lost": lost,
        "finished": finished,
        "final_equal": equal,
        "final_max_abs_diff": diff,
        "spare_warm": None if spares is None else bool(spares),
        "events": recovered,
    }


def goodput(
    name: str,
    tmp: Path,
    step_time: float,
    ckpt_every: int,
    window: float,
    period: float,
    own_period: float,
) -> dict[str, object]:
    system = FACTORIES[name](tmp, 10**6, step_time, ckpt_every)
    system.start()
    kills: list[float] = []
    spare_warm: list[bool] = []
    try:
        t0 = _wait_first_step(system)
        end = t0 + window
        due = t0 + period / 2
        while time.time() < end:
            if time.time() >= due:
                nodes = system.training()
                if nodes:
                    spares = system.warm_spares()
                    system.kill(nodes[0])
                    kills.append(time.time())  # every process of the node is dead
                    system.replace(nodes[0])
                    if spares is not None:
                        spare_warm.append(bool(spares))
                due += period
            time.sleep(0.02)
        recovered = system.recoveries(len(kills))
    finally:
        system.stop()
    if os.environ.get("PEERS_DEBUG"):
        shown = ("[event]", "controller", "rejoined", "generation")
        print("\n".join(line for line in system.lines if any(w in line for w in shown)))
        for r in recovered:
            print("RECOVERED", json.dumps(r))
    entries = [e for e in read_log(system.logs) if e.t_end <= end]
    gained = max((e.step for e in entries), default=-1) + 1
    per_kill = [after_kill(entries, k) for k in kills]
    lost = sum(max(lost, 0) for _, lost in per_kill)
    times = [r for r, _ in per_kill]
    done = [r for r in times if r != float("inf")]
    return {
        "kills": len(kills),
        "steps": gained,
        "steps_lost": lost,
        # inf (no step after it within the window) becomes null in the JSON
        "next_step_each_s": [round(r, 3) if r != float("inf") else r for r in times],
        "worst_next_step_s": max(times) if times else None,
        "mean_next_step_s": statistics.fmean(done) if done else None,
        "spare_warm_at_kill": spare_warm if spare_warm else None,
        "events": recovered,
        "effective": gained * own_period / window,
    }


# -- the report -------------------------------------------------------------------------

CANNOT = {
    ("torchrun", "spare"): "no warm spares",
    ("torchft", "spare"): "no spares (every replica trains)",
    ("torchft", "durable"): "no durable checkpoints",
    ("ringmaster", "durable"): "off here (live-peer recovery)",
}


def _each_kill(g: dict[str, object]) -> str:
    """Each kill's seconds to the next step, the worst and the mean, and (systems with
    spares) whether a warm spare stood ready at each kill."""
    each = g["next_step_each_s"]
    assert isinstance(each, list)
    text = "next step after each kill: " + ", ".join(_seconds(r) for r in each)
    text += f" (worst {_seconds(g['worst_next_step_s'])}, mean {_seconds(g['mean_next_step_s'])})"
    warm = g.get("spare_warm_at_kill")
    if isinstance(warm, list) and not all(warm):
        cold = [str(i + 1) for i, w in enumerate(warm) if not w]
        text += f"; no warm spare ready at kill {', '.join(cold)}"
    return text


def _seconds(v: object) -> str:
    """``1.23 s``; ``never`` (no step after it within the window); ``-`` (no figure)."""
    text = _fmt(v)
    return text if text in ("never", "-") else f"{text} s"


def _fmt(v: object, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "never" if v == float("inf") else format(v, spec)
    return str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of work per step")
    p.add_argument("--fast-step-time", type=float, default=0.01)
    p.add_argument(
        "--steps", type=int, default=200, help="steps of the fault-free and single-failure runs"
    )
    p.add_argument("--fast-steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=80)
    p.add_argument("--ckpt-every", type=int, default=10, help="the torchrun script's checkpoints")
    p.add_argument("--window", type=float, default=100.0, help="goodput window, seconds")
    p.add_argument("--periods", default="60,15", help="seconds between kills, one goodput run each")
    p.add_argument(
        "--max-kills",
        type=int,
        default=4,
        help="a goodput run lasts at most this many kill periods (the 15 s run: 60 s)",
    )
    p.add_argument("--rounds", type=int, default=2, help="steady-state runs per system")
    p.add_argument("--fast-rounds", type=int, default=1, help="the same at --fast-step-time")
    p.add_argument(
        "--torchft-heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="the Lighthouse's --heartbeat_timeout_ms (5000: its default, which torchft's "
        "README keeps)",
    )
    p.add_argument("--keep", action="store_true", help="keep the runs' step logs and outputs")
    p.add_argument("--skip", default="", help="comma-separated: fast, single, goodput")
    args = parse(p, SMOKE)
    global TORCHFT_HEARTBEAT_TIMEOUT_MS
    TORCHFT_HEARTBEAT_TIMEOUT_MS = args.torchft_heartbeat_timeout_ms
    systems = [s for s in args.systems.split(",") if s]
    skip = set(args.skip.split(","))
    periods = [float(x) for x in args.periods.split(",") if x]
    windows = {p: min(args.window, args.max_kills * p) for p in periods}
    if "goodput" not in skip:
        shown = ", ".join(f"{w:g} s with a kill every {p:g} s" for p, w in windows.items())
        print(
            f"goodput windows shortened to {shown} so that the whole run fits make bench "
            "(--window 300 --max-kills 20 for 5 minutes each)"
        )
    load = os.getloadavg()
    cores = os.cpu_count()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {cores} cores")
    out: dict[str, object] = {"step_time_s": args.step_time, "load_avg_start": round(load[0], 2)}
    started = time.time()

    scratch = Path(tempfile.mkdtemp(prefix="peers-"))

    def tmp() -> Path:
        return Path(tempfile.mkdtemp(dir=scratch))

    def steady_rounds(steps: int, step_time: float, rounds: int) -> dict[str, dict[str, object]]:
        """Every system ``--rounds`` times, interleaved; each keeps its fastest round (the
        machine is shared: a slow round says more about the neighbours than the system)."""
        best: dict[str, dict[str, object]] = {}
        for _ in range(rounds):
            for name in ["ddp", *systems]:
                r = steady(name, tmp(), steps, step_time, args.ckpt_every)
                earlier = best.get(name, {}).get("rounds", [])
                assert isinstance(earlier, list)
                rates = [*earlier, r["steps_per_s"]]
                if name not in best or (r["period_s"] or 1e9) < (best[name]["period_s"] or 1e9):  # type: ignore[operator]
                    best[name] = r
                best[name]["rounds"] = rates
                print(
                    f"steady {name:10s} {step_time * 1000:.0f} ms: {_fmt(r['steps_per_s'])} "
                    f"steps/s, median step {_fmt(r['median_step_s'] * 1000)} ms, "  # type: ignore[operator]
                    f"between steps {_fmt(r['between_steps_s'] * 1000)} ms "  # type: ignore[operator]
                    f"(startup {_fmt(r['startup_s'])} s)",
                    flush=True,
                )
        return best

    ref = steady_rounds(args.steps, args.step_time, args.rounds)
    base = ref["ddp"]["period_s"]
    assert isinstance(base, float)
    fast: dict[str, dict[str, object]] = {}
    same = (args.fast_steps, args.fast_step_time) == (args.steps, args.step_time)
    if "fast" not in skip and same and args.fast_rounds <= args.rounds:
        fast = ref  # the same runs (--smoke): not run twice
    elif "fast" not in skip:
        fast = steady_rounds(args.fast_steps, args.fast_step_time, args.fast_rounds)
    single: dict[str, dict[str, object]] = {}
    if "single" not in skip:
        for name in systems:
            reference = ref[name]["finals"]
            assert isinstance(reference, list)
            single[name] = r = single_failure(
                name, tmp(), args.steps, args.step_time, args.ckpt_every, args.kill_at, reference
            )
            print(
                f"single failure {name:10s}: next step {_fmt(r['next_step_s'])} s, "
                f"{r['steps_lost']} lost, final equal {r['final_equal']} "
                f"(max diff {_fmt(r['final_max_abs_diff'], '.2g')})"
                + (
                    ""
                    if r["spare_warm"] is None
                    else f", warm spare at the kill: {r['spare_warm']}"
                ),
                flush=True,
            )
            for e in r["events"]:  # type: ignore[attr-defined]
                print(f"    {e['plan']}\n    {e['message']}", flush=True)
    good: dict[str, dict[str, dict[str, object]]] = {}
    if "goodput" not in skip:
        for period in periods:
            for name in systems:
                own = ref[name]["period_s"]
                assert isinstance(own, float)
                w = windows[period]
                g = goodput(name, tmp(), args.step_time, args.ckpt_every, w, period, own)
                good.setdefault(name, {})[f"{period:g}"] = g
                print(
                    f"goodput {name:10s} kill every {period:g}s: {g['effective']:.1%} effective, "
                    f"{g['steps']} steps, {g['kills']} kills, {g['steps_lost']} lost; "
                    f"{_each_kill(g)}",
                    flush=True,
                )
                for e in g["events"]:  # type: ignore[attr-defined]
                    print(f"    {e['plan']}\n    {e['message']}", flush=True)
    load = os.getloadavg()
    print(
        f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"{time.time() - started:.0f}s in all"
    )

    # the table
    cols = [
        "system",
        "next step after kill",
        "steps lost",
        "final = fault-free",
        *[f"goodput, kill/{p:g}s" for p in periods],
        f"steps/s @{args.step_time * 1000:.0f}ms (vs ddp)",
        f"cost/step @{args.step_time * 1000:.0f}ms",
        f"cost/step @{args.fast_step_time * 1000:.0f}ms",
        "warm spare",
        "durable ckpt",
    ]
    rows = []
    for name in ["ddp", *systems]:
        s = single.get(name, {})
        own = ref[name]["period_s"]
        assert isinstance(own, float)
        cells = [name]
        if name == "ddp":
            cells += ["no fault tolerance", "-", "-", *["-" for _ in periods]]
        else:
            eq = s.get("final_equal")
            diff = s.get("final_max_abs_diff")
            cells += [
                _seconds(s.get("next_step_s")) if s else "not measured",
                _fmt(s.get("steps_lost")),
                "bitwise"
                if eq
                else (f"no (max diff {diff:.1e})" if isinstance(diff, float) else "-"),
                *[
                    f"{gp['effective']:.1%} ({gp['steps']} steps, worst kill "
                    f"{_seconds(gp['worst_next_step_s'])})"
                    if (gp := good.get(name, {}).get(f"{p:g}"))
                    else "not measured"
                    for p in periods
                ],
            ]
        cells.append(f"{1 / own:.2f} ({base / own:.1%})")
        mp, mb = ref[name]["median_step_s"], ref["ddp"]["median_step_s"]
        assert isinstance(mp, float) and isinstance(mb, float)
        cells.append(f"{(mp - mb) * 1000:+.2f} ms" if name != "ddp" else f"{mb * 1000:.1f} ms/step")
        if name in fast and "ddp" in fast:
            fp, fb = fast[name]["median_step_s"], fast["ddp"]["median_step_s"]
            assert isinstance(fp, float) and isinstance(fb, float)
            cells.append(
                f"{(fp - fb) * 1000:+.2f} ms" if name != "ddp" else f"{fb * 1000:.1f} ms/step"
            )
        else:
            cells.append("-")
        cells.append(CANNOT.get((name, "spare"), "1" if name in ("ringmaster", "tier0") else "-"))
        cells.append(
            CANNOT.get(
                (name, "durable"),
                f"every {args.ckpt_every} steps" if name in ("tier0", "torchrun") else "-",
            )
        )
        rows.append(cells)
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")

    def num(v: object) -> object:
        """JSON-safe: NaN and infinity (no step within the window) become null; five
        significant digits (a difference of 1e-07 stays one)."""
        if isinstance(v, list):
            return [num(x) for x in v]
        if isinstance(v, float):
            return None if v != v or v == float("inf") else float(f"{v:.5g}")
        return v

    for name in ["ddp", *systems]:
        out[f"{name}_steps_per_s"] = num(ref[name]["steps_per_s"])
        out[f"{name}_vs_ddp"] = num(base / ref[name]["period_s"])  # type: ignore[operator]
        out[f"{name}_rounds_steps_per_s"] = [num(r) for r in ref[name]["rounds"]]  # type: ignore[attr-defined]
        out[f"{name}_median_step_ms"] = num(ref[name]["median_step_s"] * 1000)  # type: ignore[operator]
        if name in fast:
            out[f"{name}_fast_steps_per_s"] = num(fast[name]["steps_per_s"])
            if name != "ddp":
                extra = fast[name]["median_step_s"] - fast["ddp"]["median_step_s"]  # type: ignore[operator]
                out[f"{name}_fast_cost_per_step_ms"] = num(extra * 1000)
                out[f"{name}_fast_between_steps_ms"] = num(fast[name]["between_steps_s"] * 1000)  # type: ignore[operator]
        if name != "ddp":
            extra = ref[name]["median_step_s"] - ref["ddp"]["median_step_s"]  # type: ignore[operator]
            out[f"{name}_cost_per_step_ms"] = num(extra * 1000)
            out[f"{name}_between_steps_ms"] = num(ref[name]["between_steps_s"] * 1000)  # type: ignore[operator]
        for k, v in single.get(name, {}).items():
            out[f"{name}_single_{k}"] = num(v)
        for period_key, g in good.get(name, {}).items():
            for k, v in g.items():
                out[f"{name}_goodput{period_key}_{k}"] = num(v)
    out["load_avg_end"] = round(load[0], 2)
    out["windows_s"] = {f"{p:g}": w for p, w in windows.items()}
    out["total_s"] = round(time.time() - started, 1)
    if args.keep:
        print(f"step logs and outputs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(result_line(out, args.smoke))


if __name__ == "__main__":
    main()
