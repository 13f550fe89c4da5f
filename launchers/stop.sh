#!/usr/bin/env bash
# Stop the training running on OUTPUT_PATH as Ctrl-C would (every rank checkpoints, writes `stopped`,
# exits 0), then forcibly after --grace seconds (default 120).
#   bash launchers/stop.sh runs/test/lora [--grace 300]
# Only the run's own launcher, accelerate and ranks are signalled (recorded pid and command line).
# Exit codes: 0 stopped, 1 had to be killed, 2 usage or a lock that is not a regular file, 3 nothing was running there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # finds the project's Python
# Its usage and errors name this script, as typed (from another folder too).
MBC_STOP_PROG="bash $(printf '%q' "${BASH_SOURCE[0]}")" exec "$PYTHON" -m diffsynth_mbc.stop "$@"
