#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd and the client commands) for the tests that start a
# real cluster on this machine (tests/faults/slurm_cluster.py).  A no-op where Slurm is
# installed already; where this is not root, or not a Debian/Ubuntu machine, it says so
# and exits 0: those tests then skip with the reason.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null
then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "tests/slurm/install.sh: Slurm is not installed and this is not root: the Slurm tests will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "tests/slurm/install.sh: no apt-get here: install slurm-wlm by hand; the Slurm tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# slurm-wlm: slurmctld, slurmd, slurm-client; Debian 12 ships 22.05
apt-get install -y -q slurm-wlm
# the packages' own services are not used: the tests start their own daemons
