"""A runtime script that always fails at start, before ``runtime.init()`` (for
the tests of jobs that cannot go on).

It imports the runtime, so ``fault_tolerance.recovery: auto`` runs it in the
in-process tier; the restart tier's startup failures are tested in
tests/integration/test_restart_tier.py.  With ``CRASH_PER_NODE=1`` the
message names the node, so no two nodes fail the same way.
"""

import os

from agents import runtime  # noqa: F401  (it fails before calling runtime.init())

where = f" on {os.environ.get('RINGMASTER_NODE')}" if os.environ.get("CRASH_PER_NODE") else ""
raise RuntimeError(f"this script always fails{where}")
