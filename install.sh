#!/usr/bin/env bash
# Create .venv and install diffsynth-mbc with the torch build this machine's GPUs can run, chosen before
# anything is downloaded (diffsynth_mbc/install.py): a Tesla V100/V100S (compute capability 7.0) gets
# requirements-volta.txt's torch in the same pip resolution; no GPU or a newer one gets the plain install.
#   bash install.sh                   # asks nvidia-smi, says which build it chose, installs
#   bash install.sh --dry_run         # says which build it would choose and prints the commands
#   bash install.sh --torch volta     # choose yourself (e.g. on a machine without the GPUs)
# Environment: PYTHON (default: python3), the Python the virtual environment is made from.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec "${PYTHON:-python3}" -m diffsynth_mbc.install "$@"
