"""The ``MBC_*`` environment variables: each name spelled here once, with who sets it and who reads it. No torch.

The launchers (``launchers/common.sh``) and the supervisor set most of them for the processes they start; a
process started by hand runs without them.
"""

RUN_ID = "MBC_RUN_ID"                   # the launch's run id: every rank and the cache build of one launch share it
RUN_LOCKS = "MBC_RUN_LOCKS"             # the lock files the launcher holds for the run's folders (os.pathsep-joined)
LAUNCHER_PID = "MBC_LAUNCHER_PID"       # the supervisor's pid, which every rank watches
LAUNCHER_START = "MBC_LAUNCHER_START"   # ... and its start time, so that a reused pid is never taken for it
RUN_LOG = "MBC_RUN_LOG"                 # the launcher's log file, which a rank follows once its launcher is gone
PROGRESS_TTY = "MBC_PROGRESS_TTY"       # the launcher's terminal: rank 0 draws the live progress bar there
PROGRESS_LOG = "MBC_PROGRESS_LOG"       # the launcher's log file: rank 0 writes plain progress lines there
STOP_PROG = "MBC_STOP_PROG"             # how ``stop.sh`` names itself in the stop command's usage and errors
SLURM_JOB = "MBC_SLURM_JOB"             # launchers/train.sbatch: the SLURM job the run is in (a SIGTERM there is the
                                        # scheduler's: the ranks end 'preempted')
# Fault injection, for tests of what the run does when things go wrong:
FAULT_NONFINITE_LOSS = "MBC_FAULT_NONFINITE_LOSS"     # RANK:STEP,STEP,...: that rank's loss is NaN at those steps
FAULT_SLOW_CHECKPOINT_S = "MBC_FAULT_SLOW_CHECKPOINT_S"   # [RANK:]SECONDS each checkpoint save is delayed by

LAUNCH_VARIABLES = (RUN_ID, PROGRESS_TTY, PROGRESS_LOG)   # what a launch passes to its ranks about itself
