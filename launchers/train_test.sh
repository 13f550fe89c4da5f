#!/usr/bin/env bash
# Test run: configs/train_test.yaml (5,000-row subset, 1 epoch). Flags: see launchers/common.sh.
#   bash launchers/train_test.sh              # every GPU of this machine, DDP
#   bash launchers/train_test.sh --demo       # built-in demo, anywhere
#   bash launchers/train_test.sh --deepspeed --learning_rate 5e-5
MBC_LAUNCHER=${BASH_SOURCE[0]}   # as typed: the commands it prints (resume, help, stop) work where it was started
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mbc_launch configs/train_test.yaml "$@"
