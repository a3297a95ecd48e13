"""A pre-imported standby, as a real process: one launch request, then it is the worker."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from agents.node.warm_standby import WarmWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_standby_runs_the_script_as_main_with_the_requests_env_argv_and_cwd(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import os, sys, atexit\n"
        "out = open('left-open.txt', 'w'); out.write('buffered')\n"  # never closed
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "print(__name__, sys.argv[1:], os.environ.get('RANK'), os.getcwd(),\n"
        "      sys.path[0] == os.path.dirname(os.path.abspath(__file__)),\n"
        "      'torch' in sys.modules, 'STANDBY_ONLY' in os.environ, sys.stdin.read() == '')\n"
        "raise SystemExit(int(os.environ['CODE']))\n"
    )
    env = dict(os.environ, STANDBY_ONLY="1")
    standby = WarmWorker(env, str(tmp_path))
    assert standby.alive()
    time.sleep(0.2)
    request_env = {k: v for k, v in os.environ.items()} | {"RANK": "3", "CODE": "7"}
    proc = standby.launch([str(script), "--lr", "0.1"], request_env, str(script.parent))
    assert not standby.alive()
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read().decode()
    assert proc.wait(30) == 7, out
    assert f"__main__ ['--lr', '0.1'] 3 {script.parent} True True False True" in out, out
    assert "atexit ran" in out
    assert (script.parent / "left-open.txt").read_text() == "buffered"
    with pytest.raises(RuntimeError):
        standby.launch([str(script)], request_env, str(tmp_path))


def test_an_error_prints_the_scripts_traceback_only_and_exits_1(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    standby = WarmWorker(dict(os.environ), str(tmp_path))
    proc = standby.launch([str(script)], dict(os.environ), str(tmp_path))
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read().decode()
    assert proc.wait(30) == 1
    assert out.splitlines()[-1] == "ValueError: boom", out
    assert "warm_worker" not in out and "runpy" not in out, out


def test_a_discarded_standby_is_gone(tmp_path: Path) -> None:
    standby = WarmWorker(dict(os.environ), str(tmp_path), python=sys.executable)
    standby.discard()
    assert standby.proc.returncode is not None and not standby.alive()
