"""The job file's ``slurm`` section: what the batch script asks Slurm for.

Part of the job spec tree (:mod:`orchestrator.spec.job` holds the rest and
re-exports these names).  Only ``ringmaster slurm script`` / ``submit`` and
the driver inside the allocation read it (:mod:`orchestrator.slurm`); every
other way of running a job ignores it.  Each field has a flag of the same name
on those commands that overrides it.  Pure; runs in every process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["MAX_SIGNAL_GRACE_S", "SlurmSpec", "slurm_time_seconds"]

Problems = list[tuple[str, str]]

#: Slurm keeps ``--signal``'s lead time in 16 bits (sbatch refuses more).
MAX_SIGNAL_GRACE_S = 65535

#: sbatch's ``--time`` forms: minutes, minutes:seconds, hours:minutes:seconds,
#: days-hours, days-hours:minutes, days-hours:minutes:seconds.
_TIME_RE = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
    r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)\Z",
    re.ASCII,
)
#: An environment-module name as ``module load`` takes it (``cuda/12.4``, ``nccl``).
_MODULE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+/@-]*\Z", re.ASCII)
#: Slurm names (partition, account, qos): no spaces, no shell characters.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.:+-]*\Z", re.ASCII)
#: What a line of the batch script must not hold (it is read by a shell).
_UNSAFE = re.compile(r"[\n\r\0]")


def slurm_time_seconds(text: str) -> int | None:
    """Seconds of an sbatch ``--time`` value (``90``: minutes; ``1-12:00:00``), None if
    the text is not one (``UNLIMITED`` and ``INFINITE`` are None too: no limit)."""
    m = _TIME_RE.match(text.strip())
    if m is None:
        return None
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "days" in g:
        return ((g["days"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    if "c" in g:  # hours:minutes:seconds
        return (g["a"] * 60 + g["b"]) * 60 + g["c"]
    return g["a"] * 60 + g.get("b", 0)  # minutes[:seconds]


@dataclass
class SlurmSpec:
    """What the batch script of ringmaster slurm script and submit asks Slurm for.

    The allocation has ``nodes.max + nodes.spares`` nodes, one agent each;
    these fields add the rest.  ``signal_grace``: Slurm signals the batch script
    this long before the allocation's time limit, and the job writes its final
    checkpoint within it; with ``requeue`` the job goes back to the queue after
    that save and resumes from it when it starts again.
    """

    partition: str | None = field(default=None, metadata={"doc": "Slurm partition (-p)."})
    account: str | None = field(default=None, metadata={"doc": "Slurm account (-A)."})
    qos: str | None = field(default=None, metadata={"doc": "Slurm quality of service (--qos)."})
    time: str | None = field(
        default=None,
        metadata={
            "doc": "The allocation's time limit as sbatch takes it (90, 4:00:00, 2-00:00:00)."
        },
    )
    gpus_per_node: int = field(default=0, metadata={"doc": "GPUs of each node (--gpus-per-node)."})
    extra: list[str] = field(
        default_factory=list,
        metadata={"doc": "More #SBATCH options, each as sbatch takes it (--constraint=a100)."},
    )
    modules: list[str] = field(
        default_factory=list,
        metadata={"doc": "Environment modules loaded before anything starts (module load)."},
    )
    setup: list[str] = field(
        default_factory=list,
        metadata={"doc": "Shell lines run after the modules, before ringmaster starts."},
    )
    requeue: bool = field(
        default=True,
        metadata={"doc": "Back to the queue when the allocation ends before the job does."},
    )
    signal_grace: timedelta = field(
        default=timedelta(seconds=120),
        metadata={
            "doc": "How long before the allocation ends the job is told to write its final "
            "checkpoint (sbatch --signal=B:USR1@seconds)."
        },
    )
    exclusive: bool = field(
        default=True, metadata={"doc": "Whole nodes (--exclusive): no other job shares them."}
    )

    def problems(self) -> Problems:
        out: Problems = []
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not _NAME_RE.match(value):
                out.append(
                    (
                        name,
                        f"{value!r} is not a Slurm {name} name (letters, digits, '_', '.', "
                        "'-'; see `sinfo` or `sacctmgr show assoc` for the names here)",
                    )
                )
        if self.time is not None and self.time.strip().upper() not in ("UNLIMITED", "INFINITE"):
            seconds = slurm_time_seconds(self.time)
            if seconds is None:
                out.append(
                    (
                        "time",
                        f"{self.time!r} is not a Slurm time limit: use minutes (90), "
                        "hours:minutes:seconds (4:00:00) or days-hours:minutes:seconds "
                        "(2-00:00:00)",
                    )
                )
            elif seconds <= self.signal_grace.total_seconds():
                out.append(
                    (
                        "signal_grace",
                        f"signal_grace ({self.signal_grace.total_seconds():g}s) "
                        f"must be shorter than the time limit ({self.time}, {seconds}s): the job "
                        "would be told to stop before it starts; shorten it or raise slurm.time",
                    )
                )
        if self.gpus_per_node < 0:
            out.append(("gpus_per_node", f"must be 0 or more, got {self.gpus_per_node}"))
        grace = self.signal_grace.total_seconds()
        if grace < 1 or grace > MAX_SIGNAL_GRACE_S:
            out.append(
                (
                    "signal_grace",
                    f"must be 1s to {MAX_SIGNAL_GRACE_S}s (Slurm's --signal bound), got {grace:g}s",
                )
            )
        for i, option in enumerate(self.extra):
            if not option.startswith("-") or _UNSAFE.search(option):
                out.append(
                    (
                        f"extra[{i}]",
                        f"{option!r} is not an sbatch option: write it as sbatch "
                        "takes it on one line, e.g. --constraint=a100",
                    )
                )
            elif (key := _option_name(option)) in _OWN_OPTIONS:
                out.append(
                    (
                        f"extra[{i}]",
                        f"{key} is set by ringmaster ({_OWN_OPTIONS[key]}); remove it here",
                    )
                )
        for i, name in enumerate(self.modules):
            if not _MODULE_RE.match(name):
                out.append(
                    (
                        f"modules[{i}]",
                        f"{name!r} is not a module name as `module load` takes it (e.g. cuda/12.4)",
                    )
                )
        for i, line in enumerate(self.setup):
            if _UNSAFE.search(line):
                out.append(
                    (
                        f"setup[{i}]",
                        "must be one shell line (no line breaks); give more lines as more items",
                    )
                )
        return out


#: sbatch options the script writes itself, and where their value comes from.
_OWN_OPTIONS = {
    "--nodes": "nodes.max + nodes.spares",
    "-N": "nodes.max + nodes.spares",
    "--ntasks-per-node": "one agent per node",
    "--no-kill": "a lost node must not end the allocation",
    "-k": "a lost node must not end the allocation",
    "--signal": "slurm.signal_grace",
    "--requeue": "slurm.requeue",
    "--no-requeue": "slurm.requeue",
    "--job-name": "the job's name",
    "-J": "the job's name",
    "--output": "the command's --output",
    "-o": "the command's --output",
    "--open-mode": "every run's output in one file",
    "--chdir": "the directory the command runs in",
    "-D": "the directory the command runs in",
}


def _option_name(option: str) -> str:
    """``--nodes=4`` → ``--nodes``; ``-N4`` → ``-N``."""
    return option.split("=", 1)[0] if option.startswith("--") else option[:2]
