"""Options and error handling shared by every ``ringmaster`` command.

Options fall back to ``RINGMASTER_*`` environment variables (``--etcd`` ←
``RINGMASTER_ETCD`` ...).  Exit codes: 0 success, 1 runtime failure, 2 bad
input (invalid job file, bad option).

Tables are made to fit an 80-column terminal: short cells never wrap, long
text wraps between words, and a word longer than its column (a path, a URL)
is folded, never cut.  ``--wide`` prints every cell on one line however wide
that makes the table; ``--json`` prints the records themselves.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import click
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table

from orchestrator.api import EtcdError, OrchestratorError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import (
    PASSWORD_ENV_VARIABLE,
    EtcdOptions,
    host_port,
    parse_endpoints,
)
from orchestrator.settings import SETTINGS
from orchestrator.spec.api import SpecError
from orchestrator.spec.job import RendezvousSpec
from orchestrator.state.keys import InvalidKeySegmentError

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def plural(count: int, one: str, many: str | None = None) -> str:
    """``1 recovery``, ``2 recoveries``: a count with its noun in agreement."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


def wide_option(fn: F) -> F:
    """Add ``--wide``: every table cell on one line, however wide the table gets."""
    return click.option(
        "--wide", is_flag=True, help="one line per row, nothing wrapped (for a wide terminal)"
    )(fn)


def json_option(fn: F) -> F:
    """Add ``--json``: the records themselves, one JSON object per line."""
    return click.option("--json", "as_json", is_flag=True, help="one JSON object per line")(fn)


def column(header: str, *, wrap: bool = True, justify: str = "left") -> Column:
    """A table column: ``wrap=False`` for short values that must stay whole on one line.

    A column that wraps breaks between words and folds a single word that is
    longer than the column (a path, a URL): it is never cut off.
    """
    return Column(
        header,
        no_wrap=not wrap,
        overflow="fold",
        justify=justify,  # type: ignore[arg-type]
    )


def table(*columns: Column | str, title: str | None = None, show_header: bool = True) -> Table:
    """A table with thin rules between columns and under the header, and no outer border."""
    return Table(
        *columns,
        title=title,
        title_justify="left",
        show_header=show_header,
        box=box.MINIMAL,
        show_edge=False,
        pad_edge=False,
    )


def print_table(out: Table, wide: bool = False) -> None:
    """Print ``out`` to fit the terminal, or (``wide``) with every cell on one line."""
    if not wide:
        console.print(out)
        return
    for col in out.columns:
        col.no_wrap = True
    width = Measurement.get(console, console.options.update(width=1_000_000), out).maximum
    # a console as wide as the table, writing where the shared one writes
    Console(
        file=console.file,
        width=max(width, console.width),
        force_terminal=console.is_terminal,
        no_color=console.no_color,
    ).print(out)


class Seconds(click.ParamType):
    """A duration option in seconds: a finite number above 0 and at most ``maximum``.

    ``float`` alone lets ``nan``, ``inf`` and ``-1`` through, to fail later as
    a traceback (``timedelta(seconds=nan)``) or as a wait that ends at once.
    """

    name = "seconds"

    def __init__(self, maximum: float = 86400.0) -> None:
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                number = math.nan
        if not (math.isfinite(number) and 0 < number <= self.maximum):
            self.fail(
                f"{value!r} is not a number of seconds above 0 and at most {self.maximum:g} "
                "(for example 5 or 0.5)",
                param,
                ctx,
            )
        return number


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def etcd_options(fn: F) -> F:
    """Add the shared etcd connection options to a command."""
    options = [
        click.option(
            "--etcd",
            "etcd_endpoints",
            envvar="RINGMASTER_ETCD",
            help="etcd client endpoints, host:port[,host:port...]  [env RINGMASTER_ETCD]",
        ),
        click.option("--etcd-ca", envvar="RINGMASTER_ETCD_CA", help="CA certificate (TLS)"),
        click.option("--etcd-cert", envvar="RINGMASTER_ETCD_CERT", help="client certificate"),
        click.option("--etcd-key", envvar="RINGMASTER_ETCD_KEY", help="client key"),
        click.option("--etcd-user", envvar="RINGMASTER_ETCD_USER", help="etcd user"),
        click.option(
            "--etcd-password",
            envvar="RINGMASTER_ETCD_PASSWORD",
            help="etcd password (prefer the env variable)",
        ),
        click.option(
            "--etcd-timeout",
            type=Seconds(),
            default=SETTINGS.etcd_connect_timeout.total_seconds(),
            show_default=True,
            help="seconds to wait for etcd to answer, above 0 and at most a day "
            "(default: RINGMASTER_ETCD_CONNECT_TIMEOUT)",
        ),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def build_etcd_options(
    kw: dict[str, Any], default: str | None = None, job: RendezvousSpec | None = None
) -> EtcdOptions | None:
    """EtcdOptions from the shared CLI options; None when no endpoint is given.

    ``job``: the job file's ``rendezvous`` section, for a command given a job file.
    Where the command line (or its environment variable) gives no endpoints, the
    job's ``endpoints`` serve, with its ``tls`` files and ``user`` where the command
    line gives none, and the password from the variable its ``password_env`` names.
    A password variable named by ``RINGMASTER_ETCD_PASSWORD_ENV`` (what the operator
    gives a job's pods for ``password_env``) serves where no password is given.
    """
    text = kw.pop("etcd_endpoints", None)
    source = "--etcd" if _from_command_line("etcd_endpoints") else "RINGMASTER_ETCD"
    if not text:
        text, source = default, "the default etcd endpoint"
    ca, cert, key = kw.pop("etcd_ca", None), kw.pop("etcd_cert", None), kw.pop("etcd_key", None)
    user, password = kw.pop("etcd_user", None), kw.pop("etcd_password", None)
    timeout = kw.pop("etcd_timeout", SETTINGS.etcd_connect_timeout.total_seconds())
    named, where = os.environ.get(PASSWORD_ENV_VARIABLE) or None, PASSWORD_ENV_VARIABLE
    if job is not None and not text and job.endpoints:
        text, source = ",".join(job.endpoints), "the job file's rendezvous.endpoints"
        ca, cert, key = ca or job.tls.ca_cert, cert or job.tls.cert, key or job.tls.key
        user = user or job.user
        if job.password_env:
            named, where = job.password_env, "the job file's rendezvous.password_env"
    if not text:
        return None
    endpoints = _checked_endpoints(text, source)
    if password is None and named:
        password = os.environ.get(named)
        if password is None:
            fail(f"{where} names ${named}, which is not set: set it to the etcd password", 2)
    if password and _from_command_line("etcd_password"):
        click.echo(
            "warning: --etcd-password on the command line is visible to other users of this "
            "machine (ps); set RINGMASTER_ETCD_PASSWORD instead",
            err=True,
        )
    return EtcdOptions(
        endpoints=endpoints,
        ca_cert=ca,
        cert=cert,
        key=key,
        user=user,
        password=password,
        connect_timeout=timedelta(seconds=timeout),
    )


def _checked_endpoints(text: str, source: str) -> tuple[str, ...]:
    """The endpoints of ``text``; a usage error (exit 2) naming ``source`` when one is
    not ``host:port`` or there are none."""
    endpoints = parse_endpoints(text)
    if not endpoints:
        fail(f"{source} gives no etcd endpoint ({text!r}): give host:port[,host:port...]", 2)
    for endpoint in endpoints:
        try:
            host_port(endpoint)
        except EtcdError as e:
            fail(f"{source}: {e} (give host:port[,host:port...])", 2)
    return endpoints


def _from_command_line(param: str) -> bool:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.get_parameter_source(param) is click.core.ParameterSource.COMMANDLINE


def connect_client(kw: dict[str, Any], job: RendezvousSpec | None = None) -> EtcdClient:
    """A client of the etcd the command line gives (or ``job``'s: :func:`build_etcd_options`)."""
    options = build_etcd_options(kw, job=job)
    if options is None:
        where = " or rendezvous.endpoints in the job file" if job is not None else ""
        fail(f"no etcd given: pass --etcd host:port or set RINGMASTER_ETCD{where}", 2)
        raise AssertionError("unreachable")
    return connect(options)


def handle_errors(fn: F) -> F:
    """Turn library errors into one clear line and an exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecError as e:
            click.echo(str(e), err=True)
            sys.exit(2)
        except InvalidKeySegmentError as e:  # a name given on the command line
            fail(str(e), 2)
        except OrchestratorError as e:
            fail(str(e))

    return wrapper  # type: ignore[return-value]
