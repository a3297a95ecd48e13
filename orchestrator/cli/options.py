"""Options and error handling shared by every ``ringmaster`` command.

Options fall back to ``RINGMASTER_*`` environment variables (``--etcd`` ←
``RINGMASTER_ETCD`` ...).  Exit codes: 0 success, 1 runtime failure, 2 bad
input (invalid job file, bad option).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console

from orchestrator.api import OrchestratorError, SpecError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions, parse_endpoints
from orchestrator.settings import SETTINGS

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


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
            type=float,
            default=SETTINGS.etcd_connect_timeout.total_seconds(),
            show_default=True,
            help="seconds to wait for etcd to answer (default: RINGMASTER_ETCD_CONNECT_TIMEOUT)",
        ),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def build_etcd_options(kw: dict[str, Any], default: str | None = None) -> EtcdOptions | None:
    """EtcdOptions from the shared CLI options; None when no endpoint is given."""
    text = kw.pop("etcd_endpoints", None) or default
    ca, cert, key = kw.pop("etcd_ca", None), kw.pop("etcd_cert", None), kw.pop("etcd_key", None)
    user, password = kw.pop("etcd_user", None), kw.pop("etcd_password", None)
    timeout = kw.pop("etcd_timeout", SETTINGS.etcd_connect_timeout.total_seconds())
    if not text:
        return None
    if password and _from_command_line("etcd_password"):
        click.echo(
            "warning: --etcd-password on the command line is visible to other users of this "
            "machine (ps); set RINGMASTER_ETCD_PASSWORD instead",
            err=True,
        )
    return EtcdOptions(
        endpoints=parse_endpoints(text),
        ca_cert=ca,
        cert=cert,
        key=key,
        user=user,
        password=password,
        connect_timeout=timedelta(seconds=timeout),
    )


def _from_command_line(param: str) -> bool:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.get_parameter_source(param) is click.core.ParameterSource.COMMANDLINE


def connect_client(kw: dict[str, Any]) -> EtcdClient:
    options = build_etcd_options(kw)
    if options is None:
        fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
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
        except OrchestratorError as e:
            fail(str(e))

    return wrapper  # type: ignore[return-value]
