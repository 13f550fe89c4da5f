#!/usr/bin/env bash
# Full run: configs/train_full.yaml (170,180 rows, 5 epochs). Flags: see launchers/common.sh.
#   bash launchers/train_full.sh --detach     # in the background; a second launch is refused
#   MASTER_ADDR=10.0.0.1 NUM_MACHINES=2 MACHINE_RANK=0 bash launchers/train_full.sh --multinode
MBC_LAUNCHER=${BASH_SOURCE[0]}   # as typed: the commands it prints (resume, help, stop) work where it was started
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mbc_launch configs/train_full.yaml "$@"
