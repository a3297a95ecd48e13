"""Node loss and drain inside a Slurm allocation: the spare takes the slot, steps go on.

The job of ``recovery.py``'s ringmaster row (examples/train_tiny.py, 2 training
nodes and 1 warm spare, heartbeats every 500 ms) is submitted with
``ringmaster slurm submit`` to a real Slurm cluster on this machine (one
slurmctld, four ``slurmd -N nodeX`` on 127.0.0.1: tests/faults/slurm_cluster.py;
Slurm from ``tests/slurm/install.sh``).  Two rows:

* ``node_loss``: once the job passes ``KILL_AT``, one training node's machine
  dies (its slurmd, its job step's slurmstepd and every process under them
  SIGKILLed; never the batch host, which holds etcd and the controller).
* ``drain``: ``scontrol update state=drain`` on one training node instead.

Measured for each: seconds from the fault to the first completed step of the
next generation, and steps lost (completed before the fault, computed again).
``node_loss`` also gives how long Slurm itself took to mark the node DOWN
(``SlurmdTimeout=5`` here): the swap does not wait for it.

``--smoke`` runs both rows as short jobs (the fault at step 20 of 200).  The
last line is a JSON object; a machine without Slurm (or not root) gets
``"skipped": true`` and the reason.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

apply_grpc_environment()  # before gRPC is imported (this process forks Slurm daemons)

from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.spec.loader import load_job_data  # noqa: E402
from tests.chaos.slurm_jobs import SlurmJob, submit  # noqa: E402
from tests.faults.slurm_cluster import (  # noqa: E402
    SlurmCluster,
    SlurmClusterError,
    slurm_skip_reason,
)

STEPS = 400
KILL_AT = 100
STEP_TIME = 0.02


def _entries(logs: Path) -> list[tuple[float, int, str]]:
    """(time, step, generation) of every completed step, in time order."""
    out = []
    for f in logs.glob("*.log"):
        for line in f.read_text().splitlines():
            step, generation, _rank, at = line.split()[:4]
            out.append((float(at), int(step), generation))
    return sorted(out)


def measure(logs: Path, fault_at: float) -> tuple[float | None, int | None]:
    """(seconds from the fault to the first step of a later generation, steps lost);
    Nones when no later generation stepped (the job ended before the swap)."""
    entries = _entries(logs)
    before = {g for t, _, g in entries if t <= fault_at}
    last_before = max((s for t, s, _ in entries if t <= fault_at), default=-1)
    after = [(t, s) for t, s, g in entries if t > fault_at and g not in before]
    if not after:
        return None, None
    resumed = min(s for _, s in after)
    return after[0][0] - fault_at, max(0, last_before + 1 - resumed)


def _row(cluster: SlurmCluster, fault: str, steps: int, kill_at: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"rm-bench-slurm-{fault}-") as where:
        tmp = Path(where)
        logs = tmp / "steps"
        logs.mkdir()
        spec = load_job_data(
            {
                "name": f"bench-slurm-{fault.replace('_', '-')}",
                "entrypoint": {
                    "script": str(REPO / "examples" / "train_tiny.py"),
                    "args": ["--step-time", str(STEP_TIME), "--step-log", str(logs)],
                    "env": {"RINGMASTER_LOG_EVERY": "100000"},
                },
                "nodes": {"min": 2, "max": 2, "spares": 1},
                "max_steps": steps,
                "checkpoint": {"url": f"file://{tmp}/ckpt"},
                "fault_tolerance": {"heartbeat_interval": "500ms"},
            }
        )
        job = submit(cluster, spec, tmp)
        try:
            status = job.wait_step(kill_at, timeout=300)
            victim = next(n for n in status.active_nodes if n != job.batch_host())
            fault_at = time.time()
            if fault == "node_loss":
                cluster.kill_node(victim)
            else:
                cluster.run(
                    "scontrol", "update", f"nodename={victim}", "state=drain", "reason=benchmark"
                )
            row: dict[str, object] = {}
            if fault == "node_loss":
                cluster.wait_nodes("DOWN", [victim], timeout=120)
                row["slurm_marked_down_s"] = round(time.time() - fault_at, 1)
            fields = job.wait_end(timeout=300)
            if fields.get("JobState") != "COMPLETED":
                raise RuntimeError(f"the job ended {fields.get('JobState')}:\n{job.tail()}")
            recovery, lost = measure(logs, fault_at)
            rounded = None if recovery is None else round(recovery, 3)
            return {"recovery_s": rounded, "steps_lost": lost, **row}
        finally:
            _restore(cluster, job)


def _restore(cluster: SlurmCluster, job: SlurmJob) -> None:
    job.close()
    for name in cluster.names:
        cluster.revive(name)
        cluster.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
    cluster.wait_nodes("IDLE", cluster.names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--kill-at", type=int, default=KILL_AT)
    args = parse(parser, {"steps": 200, "kill_at": 20})
    reason = slurm_skip_reason()
    if reason:
        print(result_line({"skipped": True, "reason": reason}, args.smoke))
        return
    with tempfile.TemporaryDirectory(prefix="rm-bench-slurm-") as root:
        cluster = SlurmCluster(Path(root), nodes=4)
        try:
            cluster.start()
        except SlurmClusterError as e:
            cluster.stop()
            print(result_line({"skipped": True, "reason": f"Slurm did not start: {e}"}, args.smoke))
            return
        try:
            rows = {
                fault: _row(cluster, fault, args.steps, args.kill_at)
                for fault in ("node_loss", "drain")
            }
        finally:
            cluster.stop()
    for fault, row in rows.items():
        print(f"{fault:10s} " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(result_line(rows, args.smoke))


if __name__ == "__main__":
    main()
