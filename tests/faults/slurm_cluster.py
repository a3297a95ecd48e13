"""A real Slurm cluster on this machine: one slurmctld and a few ``slurmd -N nodeX``.

Debian's ``slurm-wlm`` (22.05 here; ``tests/slurm/install.sh`` installs it)
runs a whole cluster on 127.0.0.1: every daemon has its own port, pid file
and spool directory under one temporary root, ``AuthType=auth/none`` (no
munge), ``ProctrackType=proctrack/linuxproc`` (no cgroups),
``SelectType=select/cons_tres``, a short ``KillWait`` and ``SlurmdTimeout``,
and a two-level switch topology (``topology/tree``: node1-2 under s1, node3-4
under s2, both under top) so agents get labels from it.  The daemons run in
the foreground as this process's children; :meth:`SlurmCluster.stop` cancels
every job, stops them, and kills whatever a job left behind.

A node's loss is a machine's death: :meth:`SlurmCluster.kill_node` SIGKILLs the
node's slurmd, its job steps' slurmstepd and every process they started; the
node comes back with :meth:`SlurmCluster.revive`.

:func:`slurm_skip_reason` says why a test cannot run here (not installed, not
root); a cluster that does not come up raises :class:`SlurmClusterError` with
the daemons' log tails.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from orchestrator.process_lifetime import free_ports, kill_tree, start_group, stop_groups

__all__ = ["SlurmCluster", "SlurmClusterError", "find_program", "slurm_skip_reason"]

DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
INSTALL = "tests/slurm/install.sh"


class SlurmClusterError(RuntimeError):
    """The cluster did not start (the message has the daemons' log tails)."""


def find_program(name: str) -> str | None:
    """Where ``name`` is: on PATH, or in an sbin directory (daemons live there, off a
    user's PATH)."""
    extra = os.pathsep.join(("/usr/sbin", "/usr/local/sbin", "/sbin"))
    return shutil.which(name) or shutil.which(name, path=extra)


def slurm_skip_reason() -> str | None:
    """Why a real Slurm cluster cannot run here, or None."""
    missing = [c for c in (*DAEMONS, *CLIENTS) if find_program(c) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} not found): run {INSTALL} as root "
            "(apt-get install slurm-wlm)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps as the job's user"
    return None


class SlurmCluster:
    """One slurmctld and ``nodes`` slurmd on 127.0.0.1; see the module docstring."""

    def __init__(self, root: Path, nodes: int = 4, cpus: int = 2, kill_wait: int = 10) -> None:
        self.root = root
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.kill_wait = kill_wait
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.ctld: subprocess.Popen[bytes] | None = None
        self.slurmd: dict[str, subprocess.Popen[bytes]] = {}
        *ports, self._ctld_port = free_ports(len(self.names) + 1)  # all distinct
        self._ports = dict(zip(self.names, ports, strict=True))

    # -- configuration -----------------------------------------------------------------

    def write_config(self) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in self.names)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        user = getpass.getuser()
        host = os.uname().nodename
        lines = [
            f"ClusterName=rm{os.getpid()}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self._ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "TopologyPlugin=topology/tree",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ReturnToService=2",
            "SlurmdTimeout=5",
            "SlurmctldTimeout=5",
            "MessageTimeout=5",
            f"KillWait={self.kill_wait}",
            "InactiveLimit=0",
            "MinJobAge=300",
            *(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self._ports[n]} "
                f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                for n in self.names
            ),
            f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=NO",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        half = (len(self.names) + 1) // 2
        racks = {"s1": self.names[:half], "s2": self.names[half:]}
        topology = [f"SwitchName={s} Nodes={','.join(ns)}" for s, ns in racks.items() if ns]
        topology.append(f"SwitchName=top Switches={','.join(s for s, ns in racks.items() if ns)}")
        (self.root / "topology.conf").write_text("\n".join(topology) + "\n")

    # -- daemons -----------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the configuration, start the daemons, wait until every node is idle.

        Raises:
            SlurmClusterError: a daemon exited or the nodes did not come up in time.
        """
        self.write_config()
        log = open(self.root / "log" / "slurmctld.out", "ab")  # noqa: SIM115 - the child's
        with log:
            self.ctld = start_group(
                [_program("slurmctld"), "-D", "-i"],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=log,
            )
        for name in self.names:
            self._start_slurmd(name)
        self.wait_nodes("IDLE", self.names, timeout)
        return self

    def _start_slurmd(self, name: str) -> None:
        log = open(self.root / "log" / f"slurmd-{name}.out", "ab")  # noqa: SIM115
        with log:
            self.slurmd[name] = start_group(
                [_program("slurmd"), "-D", "-N", name],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=log,
            )

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what any job left behind."""
        if self.ctld is not None and self.ctld.poll() is None:
            self.run("scancel", "--user", getpass.getuser(), check=False)
            deadline = time.monotonic() + self.kill_wait + 15
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).strip():
                time.sleep(0.5)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                kill_tree(pid)
        stop_groups([p for p in [*self.slurmd.values(), self.ctld] if p is not None], 10.0)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -----------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, stdin: str | None = None) -> str:
        """A Slurm client command against this cluster; its standard output."""
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=60, input=stdin
        )
        if check and done.returncode != 0:
            raise SlurmClusterError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        """``node -> STATE`` as sinfo prints it (``IDLE``, ``MIXED``, ``DOWN*``...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return {
            parts[0]: parts[1].upper()
            for parts in (line.split() for line in out.splitlines())
            if len(parts) == 2
        }

    def wait_nodes(self, state: str, names: list[str], timeout: float = 60.0) -> None:
        """Wait until each of ``names`` is in ``state`` (``IDLE``, ``DOWN``...).

        Raises:
            SlurmClusterError: with the daemons' log tails, when they are not in time.
        """
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.ctld is not None and self.ctld.poll() is not None:
                break
            states = self.node_states()
            if all(states.get(n, "").rstrip("*~#") == state for n in names):
                return
            time.sleep(0.3)
        raise SlurmClusterError(
            f"nodes {names} not {state} within {timeout:g}s (now {states}):\n{self.log_tails()}"
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, NodeList...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        fields: dict[str, str] = {}
        for token in out.split():
            key, eq, value = token.partition("=")
            if eq and key not in fields:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until the Slurm job is in one of ``states``; its fields."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.3)
        raise AssertionError(f"Slurm job {job_id} not in {states} within {timeout:g}s: {fields}")

    def release(self, job_id: str) -> None:
        """Let a pending job start now, past the two minutes Slurm holds a requeued job
        back (``BeginTime``).

        Its last run's nodes must be idle, and its new launch credential must be
        stamped in a later second than the old one's revocation: slurmd compares the
        two in whole seconds and kills a launch that is not later ("Job credential
        revoked").  Nothing observable marks that second; the clock is the event.
        """
        self.wait_nodes("IDLE", self.names)
        later = int(time.time()) + 2
        while time.time() < later:
            time.sleep(0.1)
        self.run("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)

    # -- faults ------------------------------------------------------------------------

    def kill_node(self, name: str) -> list[int]:
        """A machine's death: SIGKILL the node's slurmd, its steps' slurmstepd and every
        process they started, at once.  Returns the pids killed (the roots)."""
        roots = [self.slurmd[name].pid, *self._stepds_of(name)]
        for pid in roots:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        for pid in roots:
            with contextlib.suppress(ProcessLookupError):
                kill_tree(pid)
        self.slurmd[name].wait()
        return roots

    def revive(self, name: str, timeout: float = 60.0) -> None:
        """Start a killed node's slurmd again and wait until it is back in service."""
        if self.slurmd[name].poll() is None:
            return
        self._start_slurmd(name)
        with contextlib.suppress(SlurmClusterError):
            self.run("scontrol", "update", f"nodename={name}", "state=resume")
        self.wait_nodes("IDLE", [name], timeout)

    def _stepds_of(self, name: str) -> list[int]:
        """The slurmstepd processes running steps on node ``name`` (their tasks carry
        ``SLURMD_NODENAME``)."""
        parents = _parents()
        out: set[int] = set()
        for pid in _processes_with_env("SLURMD_NODENAME", name, str(self.conf)):
            up = parents.get(pid)
            while up and _comm(up) == "slurmstepd":
                out.add(up)
                up = parents.get(up)
        return sorted(out)

    def leftovers(self) -> list[int]:
        """Processes of this cluster's jobs still alive (tasks, and the slurmstepd above
        them): none once every job has ended."""
        parents = _parents()
        tasks = set(_processes_with_env("SLURM_CONF", str(self.conf), None))
        stepds = {
            up
            for pid in tasks
            if (up := parents.get(pid)) and _comm(up) == "slurmstepd"  # type: ignore[arg-type]
        }
        ours = {p.pid for p in [*self.slurmd.values(), self.ctld] if p is not None}
        helpers = {pid for pid in tasks if parents.get(pid) in ours}  # slurmctld's slurmscriptd
        return sorted((tasks | stepds) - ours - helpers)

    def describe(self, pids: list[int]) -> list[str]:
        """``pid state ppid: command`` of each of ``pids`` (for a test's failure message)."""
        out = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
            out.append(f"{pid} {state} {ppid}: {args.strip() or _comm(pid)}")
        return out

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


def _program(name: str) -> str:
    found = find_program(name)
    if found is None:
        raise SlurmClusterError(f"{name} is not installed: run {INSTALL} as root")
    return found


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for pid in _pids():
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            out[pid] = int(stat[stat.rfind(")") + 2 :].split()[1])
    return out


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _processes_with_env(key: str, value: str, conf: str | None) -> list[int]:
    """Processes whose environment has ``key=value`` (and ``SLURM_CONF=conf`` when given)."""
    want = f"{key}={value}".encode()
    also = f"SLURM_CONF={conf}".encode() if conf is not None else None
    out = []
    for pid in _pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env and (also is None or also in env):
            out.append(pid)
    return out
