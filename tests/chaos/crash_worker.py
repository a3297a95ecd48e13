"""A training script that always fails at start (for the tests of jobs that cannot go on).

With ``CRASH_PER_NODE=1`` the message names the node, so no two nodes fail
the same way.
"""

import os

where = f" on {os.environ.get('RINGMASTER_NODE')}" if os.environ.get("CRASH_PER_NODE") else ""
raise RuntimeError(f"this script always fails{where}")
