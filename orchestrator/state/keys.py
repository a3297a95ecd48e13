"""The etcd keyspace, in one place.

Everything ringmaster stores lives under ``/ringmaster/``::

    /ringmaster/jobs/<job>/spec              the submitted JobSpec (JSON)
    /ringmaster/jobs/<job>/status            phase, step, world size ... (JSON)
    /ringmaster/jobs/<job>/events/<seq>      event log
    /ringmaster/jobs/<job>/nodes/<node>      node registrations (leased)
    /ringmaster/jobs/<job>/commands/<seq>    user commands to the controller (stop, checkpoint)
    /ringmaster/jobs/<job>/plan              current generation: members and ranks (JSON)
    /ringmaster/jobs/<job>/checkpoint        newest committed checkpoint (url, step, at)
    /ringmaster/jobs/<job>/control           requests to workers (checkpoint seq, stop)
    /ringmaster/jobs/<job>/reports/<gen>/<w> a worker saw generation <gen> break
    /ringmaster/jobs/<job>/node-reports/<gen>/<node>  the same for a node's workers, by its agent
    /ringmaster/jobs/<job>/progress/<w>      last step reached by worker <w> (node-localrank)
    /ringmaster/jobs/<job>/node-progress/<node>  the same for all of a node's workers, by its agent
    /ringmaster/jobs/<job>/done/<w>          worker <w> finished the training loop
    /ringmaster/jobs/<job>/agents/<node>/cmd commands from the controller to a node agent
    /ringmaster/jobs/<job>/pg/<gen>/...      process-group bootstrap store of a generation
    /ringmaster/jobs/<job>/logs/<node>/<lr>/tail last lines of a worker, at its exit (not leased)
    /ringmaster/jobs/<job>/history/<ns>      sampled step, rate and loss over time (bounded)
    /ringmaster/jobs/<job>/recoveries/<run>-<gen>  one record per recovery: cause and phase timings
    /ringmaster/jobs/<job>/runs/<run>        one record per run of the job (submit, resume)
    /ringmaster/jobs/<job>/port-token        the credential its agents' ports ask for (all runs)
    /ringmaster/rdzv/<run_id>/state          rendezvous state (torch elastic backend)
    /ringmaster/rdzv/<run_id>/store/<key>    c10d store keys
    /ringmaster/rdzv/<run_id>/store#queues/<queue>/<item>  c10d store queues (beside the keys)
    /ringmaster/controller/leader            election among the controllers of every job (leased)
    /ringmaster/controller/metrics           their leader's Prometheus endpoint (URL)
    /ringmaster/controller/jobs/<job>/leader   the one election of the job's decider (leased):
                                             its own controllers (--job) and those of every job
    /ringmaster/controller/jobs/<job>/metrics

Names are validated before they become keys, so user input cannot escape its
prefix (no ``/``, no ``..``).
"""

from __future__ import annotations

import re

ROOT = "/ringmaster"

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}\Z")


class InvalidKeySegmentError(ValueError):
    """A name cannot be used as an etcd key segment."""


def segment(name: str, what: str = "name") -> str:
    """Return ``name`` if it is safe as one key segment, else raise.

    Raises:
        InvalidKeySegmentError: for empty names, ``/``, ``..`` or other characters
            outside ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(name, str) or not _SEGMENT_RE.match(name) or ".." in name:
        raise InvalidKeySegmentError(
            f"{what} {name!r} cannot be used as a key: use 1-128 letters, digits, '_', '-' "
            "or '.', starting with a letter or digit, without '..'"
        )
    return name


_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.\-]{0,253}\Z")


def labels(given: dict[str, str]) -> dict[str, str]:
    """Return topology labels if every key is a :func:`segment` and every value is safe.

    Values may be empty; otherwise up to 253 of the characters of segments
    (enough for a Kubernetes node name as ``host``), so no control character
    or ``/`` reaches registrations, logs or rank orderings.

    Raises:
        InvalidKeySegmentError: naming the bad label.
    """
    for key, value in given.items():
        segment(key, "label name")
        if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
            raise InvalidKeySegmentError(
                f"label {key}={value!r}: use up to 253 letters, digits, '_', '-' or '.'"
            )
    return given


def jobs_prefix() -> str:
    return f"{ROOT}/jobs/"


def job_prefix(job: str) -> str:
    return f"{ROOT}/jobs/{segment(job, 'job name')}/"


def job_spec(job: str) -> str:
    return job_prefix(job) + "spec"


def job_status(job: str) -> str:
    return job_prefix(job) + "status"


#: Events kept per job (the oldest go as new ones come: ``orchestrator.state.events``).
EVENTS_KEPT = 1000
#: Recovery records kept per job (the oldest go as new ones come).
RECOVERIES_KEPT = 100


def job_events(job: str) -> str:
    return job_prefix(job) + "events/"


def job_nodes(job: str) -> str:
    return job_prefix(job) + "nodes/"


def job_node(job: str, node: str) -> str:
    return job_nodes(job) + segment(node, "node name")


def job_commands(job: str) -> str:
    return job_prefix(job) + "commands/"


def job_plan(job: str) -> str:
    return job_prefix(job) + "plan"


def job_checkpoint(job: str) -> str:
    """The newest committed checkpoint the workers reported (url, step, time)."""
    return job_prefix(job) + "checkpoint"


def job_control(job: str) -> str:
    return job_prefix(job) + "control"


def job_reports(job: str, generation: int) -> str:
    return job_prefix(job) + f"reports/{int(generation)}/"


def job_node_reports(job: str, generation: int) -> str:
    """Prefix of the break reports that agents write for their workers, one per node."""
    return job_prefix(job) + f"node-reports/{int(generation)}/"


def node_reports(job: str, generation: int, node: str) -> str:
    return job_node_reports(job, generation) + segment(node, "node name")


def stale_report_prefixes(job: str, generation: int) -> list[str]:
    """The report prefixes to drop once ``generation`` is published.

    Those of the generation before it stay (to look at, and for the reports
    still on their way); those two and three back go (the third for reports
    that landed after the second was dropped).
    """
    return [
        prefix(job, g)
        for g in (generation - 2, generation - 3)
        if g >= 1
        for prefix in (job_reports, job_node_reports)
    ]


def job_progress(job: str) -> str:
    return job_prefix(job) + "progress/"


def job_node_progress(job: str) -> str:
    """Prefix of the node progress records: one per node, its workers' progress, by its agent."""
    return job_prefix(job) + "node-progress/"


def node_progress(job: str, node: str) -> str:
    return job_node_progress(job) + segment(node, "node name")


def job_done(job: str) -> str:
    return job_prefix(job) + "done/"


def job_history(job: str) -> str:
    return job_prefix(job) + "history/"


def job_recoveries(job: str) -> str:
    return job_prefix(job) + "recoveries/"


def job_recovery(job: str, run: int, generation: int) -> str:
    """The record of the recovery that ended with ``generation`` of ``run`` training."""
    return job_recoveries(job) + f"{int(run):04d}-{int(generation):08d}"


def job_port_token(job: str) -> str:
    """The secret an agent of the job asks of every request on its port but the liveness
    status and the watch (:mod:`orchestrator.state.port_credential`).  Created once per job
    and kept across its runs: whoever may read the job's keys may read its agents."""
    return job_prefix(job) + "port-token"


def job_runs(job: str) -> str:
    return job_prefix(job) + "runs/"


def job_run(job: str, run: int) -> str:
    """The record of one run of the job (a submit or a resume starts one)."""
    return job_runs(job) + f"{int(run):04d}"


def run_state(job: str) -> list[str]:
    """Keys and prefixes that belong to one run: cleared when a finished job runs again.

    What stays is the job's story across runs: events, logs, history,
    recoveries and the run records.
    """
    return [
        job_spec(job),
        job_status(job),
        job_plan(job),
        job_checkpoint(job),
        job_control(job),
        job_nodes(job),
        job_commands(job),
        job_prefix(job) + "reports/",
        job_prefix(job) + "node-reports/",
        job_progress(job),
        job_node_progress(job),
        job_done(job),
        job_prefix(job) + "agents/",
        job_prefix(job) + "pg/",
    ]


def agent_commands(job: str, node: str) -> str:
    return job_prefix(job) + f"agents/{segment(node, 'node name')}/cmd/"


def pg_store(job: str, generation: int) -> str:
    return job_prefix(job) + f"pg/{int(generation)}/"


def outer_rounds(job: str, generation: int) -> str:
    """The records of a generation's outer syncs between sites (offers, decisions)."""
    return pg_store(job, generation) + "outer/"


def outer_round(job: str, generation: int, fragment: int, at: int) -> str:
    """One round: fragment ``fragment``'s sync started when ``at`` steps were complete."""
    return outer_rounds(job, generation) + f"f{int(fragment)}/a{int(at)}/"


def job_logs(job: str) -> str:
    return job_prefix(job) + "logs/"


def node_logs(job: str, node: str) -> str:
    return job_logs(job) + f"{segment(node, 'node name')}/"


def worker_logs(job: str, node: str, local_rank: int) -> str:
    return node_logs(job, node) + f"{int(local_rank)}/"


def worker_log_tail(job: str, node: str, local_rank: int) -> str:
    """The last lines a worker printed, written by its agent when the worker exits."""
    return worker_logs(job, node, local_rank) + "tail"


def worker_id(node: str, local_rank: int) -> str:
    """The name of one worker: ``<node>-<local_rank>``."""
    return f"{segment(node, 'node name')}-{int(local_rank)}"


def worker_ids(node: str, nproc: int) -> list[str]:
    """The names of a node's ``nproc`` workers, local rank ascending (the node's name
    checked once: the controller spells every worker of a plan at each tick)."""
    name = segment(node, "node name")
    return [f"{name}-{i}" for i in range(int(nproc))]


def rdzv_prefix(run_id: str) -> str:
    return f"{ROOT}/rdzv/{segment(run_id, 'rendezvous id')}/"


def rdzv_state(run_id: str) -> str:
    return rdzv_prefix(run_id) + "state"


def rdzv_store(run_id: str) -> str:
    return rdzv_prefix(run_id) + "store/"


def _controller(job: str | None) -> str:
    return f"{ROOT}/controller/" + (f"jobs/{segment(job, 'job name')}/" if job else "")


def controller_leader(job: str | None = None) -> str:
    """The election key of ``job`` (None: that of the controllers of every job).

    A job has one: controllers started for the job (``ringmaster controller
    --job``, as the operator and ``ringmaster run`` start them) and controllers
    of every job (for each job they see) campaign on it, so one process at a
    time decides a job, whatever mix runs.  The controllers of every job also
    elect one of them on the key of ``None``, for their own duties (compaction,
    their metrics endpoint).
    """
    return _controller(job) + "leader"


def controller_metrics(job: str | None = None) -> str:
    """Where the leading controller (of ``job``, or of every job) publishes its metrics URL."""
    return _controller(job) + "metrics"
