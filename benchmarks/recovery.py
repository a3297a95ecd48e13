"""Recovery after a whole node is SIGKILLed: ringmaster against stock torchrun.

The same tiny job runs twice in this process's lifetime, on 127.0.0.1:

* ringmaster: ``LocalRun`` with 2 active nodes and 1 warm spare; one active
  node (agent and workers, one process group) is SIGKILLed mid-run.
* torchrun: three ``torchrun --nnodes=2:3`` agents with the c10d rendezvous
  whose store lives in a process of its own (torchrun's best case: when the
  killed agent hosts the store, the whole job ends), short rendezvous
  timeouts, ``--max-restarts 3``, the script checkpointing every step; one
  node (torchrun agent and its worker) is SIGKILLed mid-run.

Measured for each: seconds from the SIGKILL to the next completed training
step anywhere in the job, and steps lost (steps completed before the kill that
had to be computed again).

Tier 0 (the restart tier) runs ``examples/train_torchrun.py``, an unmodified
torchrun script with its own checkpoints (every ``TIER0_CHECKPOINT_EVERY``
steps), twice more: under ringmaster (``recovery: restart``: every worker
starts again from a pre-imported standby, rank 0's node hosts the store of
its generation only) and under the same stock torchrun setup as above
(:mod:`_restart_runs`, shared with ``restart_at_size.py``).

Two more rows measure peers that hang instead of dying (:mod:`_stuck_peers`):
a SIGSTOPped worker and a node cut off by a network partition (needs root).

The sharded rows (``examples/train_sharded.py``, FSDP2) kill a node the same
way: ``hsdp`` (2 nodes x 2 ranks, one spare node: the slices come from their
twins), ``tensor_parallel`` (``--mesh tensor=2``: each node one replica split
over its 2 ranks, one spare node: from the twins), ``pipeline`` (``--mesh
pipeline=2``: each node one replica of 2 stages, 1F1B over 4 micro-batches:
from the twins) and ``fsdp`` with redundancy
every step (3 nodes, one spare: from the buddy's copy); the ``ddp`` row beside
them is the same job unsharded.  The
redundancy overhead rows train ``fsdp`` on 3 nodes without a failure, with
copies every step, every ``DEFAULT_EVERY_STEPS`` steps (the default) and
without (twice each, in alternating order), on a wider model
(``SHARDED_WIDTH`` hidden units) and no sleep in the step, and compare the
mean step times.

The ``fsdp_durable`` row is ``fsdp`` without redundancy (a durable checkpoint
every 10 steps): it goes back to the newest checkpoint.  The overhead runs log
the copies' costs (``BuddyCopies.stop``: how long the training thread was
blocked per copy, of which copying to host, and the exchange on its thread).

``--tier0``, ``--stuck`` and ``--sharded`` run those rows alone; ``--sharded``
takes row names to run only those (``ddp hsdp tensor_parallel pipeline
fsdp_redundancy fsdp_durable overhead``).  ``--smoke``, alone or beside those, runs
the same rows as short jobs (:data:`SMOKE`): each setting of the overhead rows once,
torchrun given ``SMOKE.torchrun_patience_s`` to train again.  The last line is a
JSON object.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process forks agents (see orchestrator.etcd.grpc_env)
apply_grpc_environment()

import _restart_runs  # noqa: E402
import _stuck_peers  # noqa: E402

from agents.state.buddy_copies import DEFAULT_EVERY_STEPS  # noqa: E402
from benchmarks._smoke import announce, result_line  # noqa: E402
from orchestrator.process_lifetime import free_port  # noqa: E402

STEPS = 400
KILL_AT = 100
STEP_TIME = 0.02
#: How long torchrun gets to train again after the kill before it counts as not recovered.
TORCHRUN_PATIENCE_S = _restart_runs.TORCHRUN_PATIENCE_S
#: Tier 0: epochs of examples/train_torchrun.py (32 steps each at world size 2)
TIER0_EPOCHS = 6
TIER0_KILL_AT = 105
TIER0_CHECKPOINT_EVERY = 10
#: Sharded rows: steps, the kill, and the model of the redundancy overhead row.
SHARDED_STEPS = 200
SHARDED_KILL_AT = 60
SHARDED_WIDTH = 512
OVERHEAD_STEPS = 300


@dataclass(frozen=True)
class Scale:
    """How long each row's jobs run, where they are killed, how long torchrun is given."""

    steps: int = STEPS
    kill_at: int = KILL_AT
    torchrun_patience_s: float = TORCHRUN_PATIENCE_S
    tier0_epochs: int = TIER0_EPOCHS
    tier0_kill_at: int = TIER0_KILL_AT
    tier0_checkpoint_every: int = TIER0_CHECKPOINT_EVERY
    stuck_steps: int = _stuck_peers.STEPS
    stuck_fault_at: int = _stuck_peers.FAULT_AT
    sharded_steps: int = SHARDED_STEPS
    sharded_kill_at: int = SHARDED_KILL_AT
    sharded_width: int = SHARDED_WIDTH
    overhead_steps: int = OVERHEAD_STEPS
    #: the overhead rows' settings run in both orders (else once each)
    overhead_both_orders: bool = True


#: ``--smoke``: every row, its jobs short (one epoch of tier 0: 32 steps).
SMOKE = Scale(
    steps=60,
    kill_at=20,
    torchrun_patience_s=20.0,
    tier0_epochs=1,
    tier0_kill_at=12,
    tier0_checkpoint_every=5,
    stuck_steps=60,
    stuck_fault_at=20,
    sharded_steps=40,
    sharded_kill_at=15,
    sharded_width=64,
    overhead_steps=40,
    overhead_both_orders=False,
)


def _entries(log_dir: Path, by_file: bool) -> list[tuple[float, int, str]]:
    """(time, step, epoch) of every completed step; the epoch is the group that ran it.

    ringmaster's epoch is the generation (workers survive a failure); torchrun's
    is the worker process (every recovery restarts the workers).
    """
    out = []
    for f in log_dir.glob("*.log"):
        for line in f.read_text().splitlines():
            step, generation, _rank, t = line.split()[:4]
            out.append((float(t), int(step), f.stem if by_file else generation))
    return sorted(out)


def _steps_by_time(log_dir: Path) -> list[tuple[float, int]]:
    return [(t, s) for t, s, _ in _entries(log_dir, by_file=True)]


def _measure(log_dir: Path, killed_at: float, by_file: bool) -> tuple[float, int]:
    """(seconds from the kill to the first step of the re-formed group, steps lost)."""
    entries = _entries(log_dir, by_file)
    old_epochs = {e for t, _, e in entries if t <= killed_at}
    last_before = max((s for t, s, _ in entries if t <= killed_at), default=-1)
    after = [(t, s) for t, s, e in entries if t > killed_at and e not in old_epochs]
    if not after:
        return float("inf"), -1
    first_t = after[0][0]
    # steps that had completed before the kill and were computed again afterwards
    resumed = min(s for _, s in after)
    done_late = max((s for t, s, e in entries if e in old_epochs), default=-1)
    lost = max(0, min(last_before, done_late) + 1 - resumed)
    return first_t - killed_at, lost


def run_ringmaster(tmp: Path, scale: Scale) -> dict[str, float]:
    from orchestrator.local_run import LocalRun
    from orchestrator.spec.loader import load_job_data

    logs = tmp / "steps"
    logs.mkdir()
    spec = load_job_data(
        {
            "name": "bench-recovery",
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": ["--step-time", str(STEP_TIME), "--step-log", str(logs)],
                "env": {"RINGMASTER_LOG_EVERY": "100000"},
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "max_steps": scale.steps,
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )
    lines: list[str] = []
    with LocalRun(spec, printer=lines.append, workdir=str(REPO)) as run:
        from orchestrator.state import jobs

        killed_at = 0.0
        while True:
            status = jobs.read_status(run._client, spec.name)
            if status and status.step >= scale.kill_at and status.active_nodes:
                node = status.active_nodes[0]
                killed_at = time.time()
                run.kill_node(node)
                break
            time.sleep(0.01)
        result = run.wait()
    assert result.phase.value == "Succeeded", "\n".join(lines[-40:])
    recovery, lost = _measure(logs, killed_at, by_file=False)
    return {"recovery_s": recovery, "steps_lost": lost}


def _sharded_run(
    tmp: Path,
    name: str,
    args: list[str],
    *,
    nodes: int,
    nproc: int,
    steps: int,
    kill_at: int | None,
    checkpoint_every: int = 0,
    env: dict[str, str] | None = None,
) -> tuple[Path, float, list[str]]:
    """One ``train_sharded.py`` job; returns its step logs, the kill time and its output."""
    from orchestrator.local_run import LocalRun
    from orchestrator.spec.loader import load_job_data
    from orchestrator.state import jobs

    logs = tmp / name
    logs.mkdir()
    spec = load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_sharded.py"),
                "args": [*args, "--step-log", str(logs)],
                "env": {"OMP_NUM_THREADS": "1", **(env or {})},
            },
            "nodes": {"min": nodes, "max": nodes, "spares": 1 if kill_at is not None else 0},
            "nproc_per_node": nproc,
            "max_steps": steps,
            "checkpoint": {
                "url": f"file://{tmp}/{name}-ckpt",
                **({"every_steps": checkpoint_every} if checkpoint_every else {}),
            },
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )
    lines: list[str] = []
    killed_at = 0.0
    with LocalRun(spec, printer=lines.append, workdir=str(REPO)) as run:
        while kill_at is not None:
            status = jobs.read_status(run._client, spec.name)
            if status and status.step >= kill_at and status.active_nodes:
                killed_at = time.time()
                run.kill_node(status.active_nodes[0])
                break
            time.sleep(0.01)
        result = run.wait()
    assert result.phase.value == "Succeeded", "\n".join(lines[-40:])
    return logs, killed_at, lines


def _mean_step_s(logs: Path) -> float:
    """Mean seconds per step of rank 0 over the middle half of the run (periodic costs
    included, start-up and the end left out)."""
    times = sorted(
        float(t)
        for f in logs.glob("*.log")
        for _step, _gen, rank, t in (line.split()[:4] for line in f.read_text().splitlines())
        if rank == "0"
    )
    a, b = len(times) // 4, 3 * len(times) // 4
    return (times[b] - times[a]) / (b - a)


#: The sharded recovery rows: name, train_sharded.py's arguments, nodes, workers per
#: node, durable checkpoint every (0: none).
SHARDED_ROWS = (
    ("ddp", ["--sharding", "ddp"], 2, 2, 0),
    ("hsdp", ["--sharding", "hsdp"], 2, 2, 0),
    ("tensor_parallel", ["--mesh", "tensor=2"], 2, 2, 0),  # replicate 2 x tensor 2
    ("pipeline", ["--mesh", "pipeline=2"], 2, 2, 0),  # replicate 2 x pipeline 2 (1F1B)
    ("fsdp_redundancy", ["--sharding", "fsdp", "--redundancy-every-steps", "1"], 3, 1, 0),
    ("fsdp_durable", ["--sharding", "fsdp", "--redundancy-every-steps", "0"], 3, 1, 10),
)
#: Worker log lines of the buddy copies' totals (:meth:`BuddyCopies.stop`).
_COPY_COSTS = re.compile(
    r"redundancy: (\d+) copies, the training thread blocked ([\d.]+) ms per copy "
    r"\(([\d.]+) ms copying to host\), (\d+) exchanges of ([\d.]+) ms each"
)


def _copy_costs(lines: list[str]) -> dict[str, float]:
    """Mean ms per copy over the workers' last generations: blocked, copying, exchange."""
    found = [m.groups() for line in lines if (m := _COPY_COSTS.search(line))]
    if not found:
        return {}
    copies = sum(int(f[0]) for f in found)
    exchanges = sum(int(f[3]) for f in found)
    return {
        "blocked_ms": round(sum(int(f[0]) * float(f[1]) for f in found) / copies, 3),
        "copy_ms": round(sum(int(f[0]) * float(f[2]) for f in found) / copies, 3),
        "exchange_ms": round(sum(int(f[3]) * float(f[4]) for f in found) / max(1, exchanges), 3),
    }


def sharded_rows(only: list[str] | None = None, scale: Scale = Scale()) -> dict[str, object]:
    """The ddp / hsdp / fsdp recovery rows and the redundancy overhead.

    Args:
        only: names of :data:`SHARDED_ROWS` and/or ``overhead`` to run (default: all).
        scale: the jobs' steps, the kill and the overhead rows' model.
    """
    common = ["--step-time", str(STEP_TIME)]
    rows: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, args, nodes, nproc, checkpoint_every in SHARDED_ROWS:
            if only and name not in only:
                continue
            logs, killed_at, _ = _sharded_run(
                tmp,
                f"bench-{name.replace('_', '-')}",
                [*args, *common],
                nodes=nodes,
                nproc=nproc,
                steps=scale.sharded_steps,
                kill_at=scale.sharded_kill_at,
                checkpoint_every=checkpoint_every,
            )
            recovery, lost = _measure(logs, killed_at, by_file=False)
            rows[f"{name}_recovery_s"] = round(recovery, 3)
            rows[f"{name}_steps_lost"] = lost
        if only and "overhead" not in only:
            return _vs_ddp(rows)
        # the settings alternate (1, 10, 0, 0, 10, 1): a load that drifts during the
        # runs (the machine is shared) weighs on each setting alike
        order = (1, DEFAULT_EVERY_STEPS, 0)
        times: dict[int, list[float]] = {every: [] for every in order}
        for i, every in enumerate(order + order[::-1] if scale.overhead_both_orders else order):
            logs, _, lines = _sharded_run(
                tmp,
                f"bench-overhead-{every}-{i}",
                [
                    *("--sharding", "fsdp", "--redundancy-every-steps", str(every)),
                    *("--width", str(scale.sharded_width)),
                ],
                nodes=3,
                nproc=1,
                steps=scale.overhead_steps,
                kill_at=None,
                env={"RINGMASTER_LOG_LEVEL": "INFO"},  # the copies' costs (BuddyCopies.stop)
            )
            times[every].append(_mean_step_s(logs))
            for key, ms in _copy_costs(lines).items():
                rows[f"redundancy_every_{every}_{key}"] = ms
        steps = {every: sum(t) / len(t) for every, t in times.items()}
    rows["fsdp_step_s"] = round(steps[0], 5)
    rows["fsdp_redundancy_step_s"] = round(steps[1], 5)
    rows["redundancy_overhead"] = round(steps[1] / steps[0] - 1, 3)
    rows["redundancy_default_every_steps"] = DEFAULT_EVERY_STEPS
    rows["fsdp_redundancy_default_step_s"] = round(steps[DEFAULT_EVERY_STEPS], 5)
    rows["redundancy_default_overhead"] = round(steps[DEFAULT_EVERY_STEPS] / steps[0] - 1, 3)
    return _vs_ddp(rows)


def _vs_ddp(rows: dict[str, object]) -> dict[str, object]:
    """Each sharded row's time to the next step as a ratio to the ddp row's."""
    ddp = rows.get("ddp_recovery_s")
    for name in ("hsdp", "tensor_parallel", "pipeline"):
        mine = rows.get(f"{name}_recovery_s")
        if isinstance(ddp, float) and isinstance(mine, float) and ddp > 0:
            rows[f"{name}_vs_ddp"] = round(mine / ddp, 2)
    return rows


def _print_sharded(rows: dict[str, object]) -> None:
    for name, *_ in SHARDED_ROWS:
        if f"{name}_recovery_s" not in rows:
            continue
        print(
            f"{name:16s} {rows[f'{name}_recovery_s']:.2f}s to the next step, "
            f"{rows[f'{name}_steps_lost']} lost"
        )
    if "fsdp_step_s" not in rows:
        return
    for every in (1, DEFAULT_EVERY_STEPS):
        if f"redundancy_every_{every}_blocked_ms" in rows:
            print(
                f"redundancy every {every}: the training thread blocked "
                f"{rows[f'redundancy_every_{every}_blocked_ms']} ms per copy "
                f"({rows[f'redundancy_every_{every}_copy_ms']} ms copying to host), "
                f"exchange {rows[f'redundancy_every_{every}_exchange_ms']} ms on its thread"
            )
    print(
        f"redundancy every step: {rows['fsdp_redundancy_step_s']:.4f}s per step against "
        f"{rows['fsdp_step_s']:.4f}s without ({float(str(rows['redundancy_overhead'])):+.1%})"
    )
    print(
        f"redundancy every {DEFAULT_EVERY_STEPS} steps (the default): "
        f"{rows['fsdp_redundancy_default_step_s']:.4f}s per step "
        f"({float(str(rows['redundancy_default_overhead'])):+.1%})"
    )


def _tier0_args(scale: Scale) -> list[str]:
    return [
        "--epochs",
        str(scale.tier0_epochs),
        "--step-time",
        str(STEP_TIME),
        "--checkpoint-every",
        str(scale.tier0_checkpoint_every),
    ]


def run_torchrun(tmp: Path, scale: Scale) -> dict[str, float]:
    logs = tmp / "steps"
    logs.mkdir()
    ckpt = tmp / "ckpt.pt"
    port = free_port()
    store = _restart_runs.store_process(port)
    args = [
        "--steps",
        str(scale.steps),
        "--ckpt",
        str(ckpt),
        "--steplog-dir",
        str(logs),
        "--step-time",
        str(STEP_TIME),
    ]
    script = REPO / "benchmarks" / "_torchrun_job.py"  # its own script: a tiny model
    nodes = _restart_runs.torchrun_nodes(port, args, script=script)
    killed_at = 0.0
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            done = [s for _, s in _steps_by_time(logs)]
            if done and max(done) >= scale.kill_at:
                # a node that trains (one that joined late may wait outside the round)
                victim, worker = _training_node(nodes, logs)
                killed_at = time.time()
                os.killpg(victim.pid, signal.SIGKILL)  # the whole node: agent and worker
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
                break
            time.sleep(0.01)
        # wait for the job to complete a step again, up to its patience
        until = time.time() + scale.torchrun_patience_s
        while time.time() < until and killed_at:
            if _measure(logs, killed_at, by_file=True)[0] != float("inf"):
                time.sleep(2)  # let it run a little past recovery
                break
            if all(n.poll() is not None for n in nodes):
                break
            time.sleep(0.1)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
        store.kill()
        store.wait()
        _restart_runs.kill_leftovers(str(logs))
    recovery, lost = _measure(logs, killed_at, by_file=True)
    completed = max((s for _, s in _steps_by_time(logs)), default=-1) + 1
    return {"recovery_s": recovery, "steps_lost": lost, "completed": completed}


def _training_node(
    nodes: list[subprocess.Popen[bytes]], logs: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """A torchrun agent whose worker logs steps, and that worker's pid."""
    for f in logs.glob("*.log"):
        worker = int(f.stem)
        parent = _restart_runs.parent_pid(worker)
        for n in nodes:
            if n.pid == parent:
                return n, worker
    raise RuntimeError("no training torchrun worker found")


def _tier0(scale: Scale) -> dict[str, object]:
    """The tier-0 row: the plain torchrun script under ringmaster and under torchrun."""
    args, kill_at, patience = _tier0_args(scale), scale.tier0_kill_at, scale.torchrun_patience_s
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        rm = _restart_runs.run_ringmaster(Path(a), "bench-tier0", args, kill_at)
        print(
            f"tier 0, ringmaster (restart): {rm['recovery_s']:.2f}s to the next step, "
            f"{rm['steps_lost']} lost"
        )
        tr = _restart_runs.run_torchrun(Path(b), args, kill_at, patience=patience)
        if tr["recovery_s"] == float("inf"):
            print(f"tier 0, torchrun: no step within {patience:g}s of the kill")
        else:
            print(
                f"tier 0, torchrun: {tr['recovery_s']:.2f}s to the next step, "
                f"{tr['steps_lost']} lost"
            )
    recovered = tr["recovery_s"] != float("inf")
    speedup = (tr["recovery_s"] if recovered else patience) / rm["recovery_s"]
    return {
        "tier0_recovery_s": round(rm["recovery_s"], 3),
        "tier0_steps_lost": rm["steps_lost"],
        "tier0_torchrun_recovery_s": round(tr["recovery_s"], 3) if recovered else None,
        "tier0_torchrun_steps_lost": tr["steps_lost"] if recovered else None,
        "tier0_speedup": round(speedup, 2) if recovered else None,
        "tier0_speedup_at_least": None if recovered else round(speedup, 1),
    }


def _stuck_peer_rows(scale: Scale) -> dict[str, object]:
    """The SIGSTOP and partition rows (:mod:`_stuck_peers`): a peer that hangs."""
    out: dict[str, object] = {}
    for name, run in (
        ("sigstop", _stuck_peers.run_sigstop),
        ("partition", _stuck_peers.run_partition),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            row = run(Path(tmp), _measure, steps=scale.stuck_steps, fault_at=scale.stuck_fault_at)
        if "skipped" in row:
            print(f"{name}: not measured: {row['skipped']}")
            out[f"{name}_recovery_s"] = None
            continue
        print(
            f"{name}: {row['recovery_s']:.2f}s to the next step (target {row['target_s']:g}s), "
            f"{row['steps_lost']} lost, the survivors' stuck step ended by {row['ended_by']}"
        )
        out[f"{name}_recovery_s"] = round(row["recovery_s"], 3)
        out[f"{name}_steps_lost"] = row["steps_lost"]
        out[f"{name}_ended_by"] = row["ended_by"]
        out[f"{name}_target_s"] = row["target_s"]
    return out


def main() -> None:
    argv = sys.argv[1:]
    smoke = "--smoke" in argv
    argv = [a for a in argv if a != "--smoke"]
    scale = SMOKE if smoke else Scale()
    if smoke:
        announce(f"{scale}")
    if argv == ["--tier0"]:  # the tier-0 row alone
        print(result_line(_tier0(scale), smoke))
        return
    if argv == ["--stuck"]:  # the SIGSTOP and partition rows alone
        print(result_line(_stuck_peer_rows(scale), smoke))
        return
    if argv[:1] == ["--sharded"]:  # the sharded rows alone, or only the ones named
        sharded = sharded_rows(argv[1:] or None, scale)
        _print_sharded(sharded)
        print(result_line(sharded, smoke))
        return
    if argv:
        raise SystemExit(
            f"recovery.py: unknown arguments {argv}; it takes --tier0, --stuck or "
            "--sharded [rows], and --smoke beside any of them (or alone)"
        )
    patience = scale.torchrun_patience_s
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        rm = run_ringmaster(Path(a), scale)
        print(f"ringmaster: {rm['recovery_s']:.2f}s to the next step, {rm['steps_lost']} lost")
        tr = run_torchrun(Path(b), scale)
        if tr["recovery_s"] == float("inf"):
            print(
                f"torchrun:   no step within {patience:g}s of the kill, "
                f"{tr['completed']}/{scale.steps} steps completed"
            )
        else:
            print(
                f"torchrun:   {tr['recovery_s']:.2f}s to the next step, {tr['steps_lost']} lost, "
                f"{tr['completed']}/{scale.steps} steps completed"
            )
    recovered = tr["recovery_s"] != float("inf")
    # torchrun that never trained again within its patience: the ratio is at least this
    speedup = (tr["recovery_s"] if recovered else patience) / rm["recovery_s"]
    tier0 = _tier0(scale)
    stuck = _stuck_peer_rows(scale)
    sharded = sharded_rows(scale=scale)
    _print_sharded(sharded)
    print(
        result_line(
            {
                "recovery_s": round(rm["recovery_s"], 3),
                "steps_lost": rm["steps_lost"],
                "torchrun_recovery_s": round(tr["recovery_s"], 3) if recovered else None,
                "torchrun_recovered_within_s": None if recovered else patience,
                "torchrun_steps_lost": tr["steps_lost"] if recovered else None,
                "speedup": round(speedup, 2) if recovered else None,
                "speedup_at_least": None if recovered else round(speedup, 1),
                **tier0,
                **stuck,
                **sharded,
            },
            smoke,
        )
    )


if __name__ == "__main__":
    main()
