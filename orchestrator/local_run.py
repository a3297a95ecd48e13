"""``ringmaster run``: a whole job on this machine.

Starts (or uses) etcd, submits the job, starts a controller and
``nodes.max + nodes.spares`` node agents as separate processes (each in a
process group of its own, dying with the run: :mod:`orchestrator.process_lifetime`),
streams their output with a prefix, follows the job's events and status, and
stops everything when the job ends (the stop sequence: SIGTERM, a grace,
SIGKILL).  The controller holds the job's checkpoint root while the job runs
(:mod:`orchestrator.checkpoint_root.writer_hold`); once every process is stopped, whatever the
ending, the run removes its lineage's writer marker if it is still there.

``kill_node_at_step`` SIGKILLs one active node once the job reaches that step,
to show a warm spare taking over (a restart-tier job reports no steps: the
run says so and kills nothing).  "Killing a node" kills what a machine's death
would: its agent and every process descended from it, the workers (each in a
group of its own) and whatever they started.

In the restart tier, what the survivors print after a node's death (their
tracebacks from the collective it left) comes after that node's
``NodeFailed`` event, folded into one line per node
(:class:`~orchestrator.observe.consequences.ConsequenceFolder`).

The controller serves Prometheus metrics (on a free port unless
``metrics_port`` says otherwise); the run prints their URL.  With a
:class:`~orchestrator.observe.live_view.LiveView` the run draws a progress bar and
prints worker output and events above it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any

from orchestrator.api import JobPhase
from orchestrator.checkpoint_root.reach import record_event, script_checkpoint
from orchestrator.checkpoint_root.writer_hold import release_root, root_url
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.grpc_env import grpc_environment
from orchestrator.etcd.options import EtcdOptions
from orchestrator.observe.consequences import ConsequenceFolder
from orchestrator.observe.endings import agents_gone_message
from orchestrator.observe.live_view import LiveView
from orchestrator.process_lifetime import kill_tree, start_group, stop_groups
from orchestrator.spec.job import JobSpec, RecoveryMode
from orchestrator.state import events, jobs, keys, runs
from orchestrator.state.records import TrainingTime

Printer = Callable[[str], None]

#: Once every node agent has exited, how long the controller gets to end the job.
AGENTS_GONE_GRACE_S = 5.0

#: The time at the start of a log line (``logging``'s default ``%(asctime)s``).
_LOG_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


@dataclass
class RunResult:
    """How a local run ended."""

    phase: JobPhase
    step: int
    recoveries: int
    wall_s: float
    killed_node: str | None = None
    killed_at_step: int | None = None
    events: list[events.Event] = field(default_factory=list)
    metrics_url: str | None = None
    #: effective training: productive time over the wall time since the first step
    effective_fraction: float = 0.0
    #: where the run's wall time went (the controller's split, ``JobStatus.training_time``)
    training_time: TrainingTime | None = None
    #: the recovery tier the job ran in (``in_process``, ``restart``; empty if it never ran)
    recovery: str = ""
    #: nodes the controller declared failed (killed by this run or from outside)
    failed_nodes: list[str] = field(default_factory=list)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]


def local_node_names(spec: JobSpec) -> list[str]:
    """The nodes a local run starts: ``node-0`` .. (``nodes.max`` + ``nodes.spares``)."""
    return [f"node-{i}" for i in range(spec.nodes.max + spec.nodes.spares)]


def node_labels_from(values: Sequence[str], nodes: Sequence[str]) -> dict[str, dict[str, str]]:
    """``NODE:KEY=VALUE`` strings (``ringmaster run --label``) as labels by node.

    Raises:
        ValueError: a string not of that form, or a node the run does not start.
    """
    out: dict[str, dict[str, str]] = {}
    for value in values:
        node, _, pair = value.partition(":")
        key, eq, label = pair.partition("=")
        if not (node and key and eq and label):
            raise ValueError(f"--label {value!r}: use NODE:KEY=VALUE, e.g. node-1:zone=b")
        if node not in nodes:
            raise ValueError(f"--label {value!r}: this run starts {', '.join(nodes)}, not {node}")
        out.setdefault(node, {})[key] = label
    return out


class LocalRun:
    """Run ``spec`` with local processes; see the module docstring."""

    def __init__(
        self,
        spec: JobSpec,
        etcd: EtcdOptions | None = None,
        kill_node_at_step: int | None = None,
        printer: Printer | None = None,
        workdir: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        controllers: int = 1,
        metrics_port: int | None = 0,
        view: LiveView | None = None,
        resume: jobs.ResumeRequest | None = None,
        node_labels: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.spec = spec
        #: labels of a node's own besides its zone, rack and host (which they may replace)
        self.node_labels = dict(node_labels or {})
        self.resume = resume
        self.etcd_options = etcd
        self.kill_node_at_step = kill_node_at_step
        self.view = view
        default_printer = view.print if view is not None else (lambda line: print(line, flush=True))
        self.print = printer or default_printer
        self.metrics_port = metrics_port
        self.metrics_url: str | None = None
        self._metrics_revision = 0
        self.workdir = workdir or os.getcwd()
        self.timeout = timeout
        self._followed_since: float | None = None
        self.controllers = controllers
        self.procs: dict[str, _Proc] = {}
        self._agents_gone_at: float | None = None
        self._submitted_at = 0.0
        self._embedded: EmbeddedEtcd | None = None
        self._client: EtcdClient | None = None
        self._threads: list[threading.Thread] = []
        #: processes of a name started again (a node's agent after its death)
        self._earlier: list[_Proc] = []
        self._lineage: str | None = None
        #: the run's own scratch directory (torch's compile cache): removed at the end
        self._scratch: str | None = None
        self.folder: ConsequenceFolder | None = None
        if spec.fault_tolerance.recovery is RecoveryMode.RESTART:
            self.folder = ConsequenceFolder(spec.name, self.print, self._print_event)

    # -- processes ---------------------------------------------------------------------

    def _cli_args(self) -> list[str]:
        assert self.etcd_options is not None
        opts = self.etcd_options
        args = ["--etcd", ",".join(opts.endpoints)]
        for flag, value in (
            ("--etcd-ca", opts.ca_cert),
            ("--etcd-cert", opts.cert),
            ("--etcd-key", opts.key),
            ("--etcd-user", opts.user),
        ):
            if value:
                args += [flag, value]
        return [*args, "--etcd-timeout", f"{opts.connect_timeout.total_seconds():g}"]

    def _env(self) -> dict[str, str]:
        env = {**grpc_environment(), **os.environ}
        if self.etcd_options and self.etcd_options.password:
            env["RINGMASTER_ETCD_PASSWORD"] = self.etcd_options.password
        env.setdefault("PYTHONUNBUFFERED", "1")
        if "TORCHINDUCTOR_CACHE_DIR" not in env:  # else torch leaves it in TMPDIR
            self._scratch = self._scratch or tempfile.mkdtemp(prefix="ringmaster-run-")
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(self._scratch, "inductor")
        return env

    def _spawn(self, name: str, args: list[str]) -> _Proc:
        popen = start_group(
            [sys.executable, "-m", "orchestrator.cli", *args, *self._cli_args()],
            cwd=self.workdir,
            env=self._env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        proc = _Proc(name, popen)
        if name in self.procs:  # a node started again: its earlier agent's pipe closes at the end
            self._earlier.append(self.procs[name])
        self.procs[name] = proc
        t = threading.Thread(target=self._pump, args=(name, popen.stdout), daemon=True)
        t.start()
        self._threads.append(t)
        return proc

    def _pump(self, name: str, stream: IO[bytes] | None) -> None:
        """Print a process's output, each line with one ``[name]`` prefix.

        An agent's own log lines already name their node after the time
        (``12:00:00,123 [node-0] registered ...``): that second name is dropped.
        """
        if stream is None:
            return
        again = re.compile(rf"^({_LOG_TIME} )?\[{re.escape(name)}\] ")
        for raw in iter(stream.readline, b""):
            line = again.sub(r"\1", raw.decode(errors="replace").rstrip(), count=1)
            if self.folder is not None:
                self.folder.output(name, line)
            else:
                self.print(f"[{name}] {line}")

    def _print_event(self, ev: events.Event) -> None:
        if self.view is not None:
            self.view.event(ev)
        else:
            self.print(f"[event] {ev.type}: {ev.message}")

    def node_names(self) -> list[str]:
        return local_node_names(self.spec)

    def start(self) -> None:
        """Start etcd, submit the job, start its controllers and agents.

        Raises:
            CheckpointStorageRefusedError: ``checkpoint.url`` is not writable
                (checked first, before anything starts; the restart tier's
                scripts keep checkpoints of their own).
        """
        if self.spec.fault_tolerance.recovery is not RecoveryMode.RESTART:
            jobs.check_checkpoint_url(self.spec)
        if self.etcd_options is None:
            self._embedded = EmbeddedEtcd().start()
            self.etcd_options = EtcdOptions((self._embedded.endpoint,))
            self.print(f"[run] embedded etcd on {self._embedded.endpoint}")
        self._client = connect(self.etcd_options)
        self._submitted_at = time.time()
        jobs.submit(self._client, self.spec, resume=self.resume)
        self._lineage = runs.lineage_id(self._client, self.spec.name)
        self.print(f"[run] submitted job '{self.spec.name}'")
        if self.spec.fault_tolerance.recovery is RecoveryMode.RESTART:
            # every agent of this run starts here, on this machine
            found = script_checkpoint(self.spec, self.workdir, one_machine=True)
            record_event(self._client, self.spec.name, found, source="run")
        if (
            self.kill_node_at_step is not None
            and self.spec.fault_tolerance.recovery is RecoveryMode.RESTART
        ):
            self.print(
                "[run] --kill-node-at-step has no effect on this job: its script reports no "
                "steps (fault_tolerance.recovery is restart); kill a node with `kill -9` instead"
            )
        previous = self._client.get(keys.controller_metrics(self.spec.name))
        self._metrics_revision = previous.mod_revision if previous is not None else 0
        for i in range(self.controllers):
            self.add_controller(f"controller-{i}")
        for i, node in enumerate(self.node_names()):
            self.add_node(node, rack=f"rack-{i // 2}")

    def add_node(self, node: str, rack: str = "rack-0") -> None:
        """Start one more node agent (it joins as a warm spare once the job runs)."""
        own = {"zone": "local", "rack": rack, "host": node, **self.node_labels.get(node, {})}
        labels = ",".join(f"{k}={v}" for k, v in own.items())
        self._spawn(node, ["agent", "--job", self.spec.name, "--node", node, "--labels", labels])

    def add_controller(self, name: str) -> None:
        """Start one more controller (a standby while another leads)."""
        metrics = [] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port)]
        self._spawn(name, ["controller", "--job", self.spec.name, *metrics])

    def kill_node(self, node: str) -> None:
        """SIGKILL a node: its agent, its workers and whatever they started, at once."""
        proc = self.procs[node].popen
        if proc.returncode is None:
            kill_tree(proc.pid)

    def signal_node(self, node: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[node].popen.pid, sig)

    @property
    def etcd_embedded(self) -> bool:
        """Whether the run started its own etcd (it ends with the run)."""
        return self._embedded is not None

    @property
    def client(self) -> EtcdClient:
        """The run's etcd client (between :meth:`start` and :meth:`stop`)."""
        if self._client is None:
            raise RuntimeError("the local run is not started")
        return self._client

    # -- following the job -------------------------------------------------------------

    def _check_metrics_url(self) -> None:
        """Print the leader's metrics URL once it is published (after this run started)."""
        if self.metrics_port is None or self.metrics_url is not None or self._client is None:
            return
        kv = self._client.get(keys.controller_metrics(self.spec.name))
        if kv is not None and kv.mod_revision > self._metrics_revision:
            self.metrics_url = kv.value.decode()
            self.print(f"[run] metrics at {self.metrics_url}")

    def interrupt(self) -> RunResult:
        """Stop the job as ``ringmaster stop`` does, after a SIGINT or SIGTERM to the run.

        Every rank saves at one step and leaves; the run follows the job to its end
        for at most ``fault_tolerance.preemption_grace`` (the processes left then go
        by :meth:`stop`).
        """
        grace = self.spec.fault_tolerance.preemption_grace
        self.print(
            f"[run] interrupted: the job saves and stops (within {grace.total_seconds():g}s, "
            "fault_tolerance.preemption_grace)"
        )
        jobs.request_stop(self.client, self.spec.name)
        self.timeout = grace
        return self.wait()

    def wait(self) -> RunResult:
        assert self._client is not None
        started = time.monotonic()
        self._followed_since = self._followed_since or started  # wall time spans both waits
        seen = 0
        killed: str | None = None
        killed_at: int | None = None
        status = jobs.JobStatus(self.spec.name)
        while time.monotonic() - started < self.timeout.total_seconds():
            status = jobs.read_status(self._client, self.spec.name) or status
            log = events.list_events(self._client, self.spec.name)
            for ev in log[seen:]:
                if self.folder is not None:
                    self.folder.event(ev)
                else:
                    self._print_event(ev)
            seen = len(log)
            if self.folder is not None:
                self.folder.tick()
            self._check_metrics_url()
            if self.view is not None:
                self.view.update(status)
            if (
                self.kill_node_at_step is not None
                and killed is None
                and status.phase is JobPhase.RUNNING
                and status.step >= self.kill_node_at_step
                and status.active_nodes
            ):
                killed = status.active_nodes[0]
                killed_at = status.step
                self.print(f"[run] step {status.step}: SIGKILL {killed} (agent and workers)")
                self.kill_node(killed)
            if status.phase.terminal:
                break
            if self._agents_gone_for() > AGENTS_GONE_GRACE_S:
                mine = [e for e in log if e.time >= self._submitted_at]
                self.print(f"[run] {agents_gone_message(self.spec.name, status, mine)}")
                status.phase = JobPhase.FAILED
                break
            time.sleep(0.1)
        else:
            self.print(f"[run] timed out after {self.timeout.total_seconds():g}s")
        if self.folder is not None:
            self.folder.flush()
        return RunResult(
            phase=status.phase,
            step=status.step,
            recoveries=status.recoveries,
            wall_s=time.monotonic() - self._followed_since,
            killed_node=killed,
            killed_at_step=killed_at,
            events=events.list_events(self._client, self.spec.name),
            metrics_url=self.metrics_url,
            effective_fraction=status.effective_fraction,
            training_time=status.training_time,
            recovery=status.recovery,
            failed_nodes=list(status.failed_nodes),
        )

    def _agents_gone_for(self) -> float:
        """Seconds since the last node agent exited (0 while any runs)."""
        agents = [p for name, p in self.procs.items() if not name.startswith("controller")]
        if not agents or any(p.popen.poll() is None for p in agents):
            self._agents_gone_at = None
            return 0.0
        self._agents_gone_at = self._agents_gone_at or time.monotonic()
        return time.monotonic() - self._agents_gone_at

    def stop(self, grace: float = 15.0) -> None:
        """Let agents finish, then stop what is left (an agent that does not stop in
        time goes as its node would: with every process it started) and stop etcd."""
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            if proc.name.startswith("controller"):
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(deadline - time.monotonic(), 0.1))
        every = [*self._earlier, *self.procs.values()]
        stop_groups([p.popen for p in every], 5.0, whole_tree=True)
        for t in self._threads:
            t.join(timeout=2)
        if self.folder is not None:
            self.folder.flush()
        for proc in every:
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()
        if self._lineage is not None:  # the run's writers are gone, however it ended
            release_root(root_url(self.spec.checkpoint.url, self.workdir), self._lineage)
        if self._client is not None:
            self._client.close()
        if self._embedded is not None:
            self._embedded.stop()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> LocalRun:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run_job(spec: JobSpec, **kwargs: Any) -> RunResult:
    """Start, follow and stop a local run (``ringmaster run``)."""
    with LocalRun(spec, **kwargs) as run:
        return run.wait()
