"""``python -m diffsynth_mbc.doctor``: will this run work on this machine (or an assumed GPU), how fast, how long.

``memory`` (memory per GPU, ``blocks_to_recompute``), ``speed`` (seconds per step from H100 measurements)
and ``projection`` (run length) are the pure models; ``estimates`` turns a run's options into their
inputs; ``checks`` are the individual checks, ``nccl`` the all-reduce probe, ``probe`` the measured steps
of ``--probe N``, ``report`` and ``cli`` the command (table or ``--json``).
"""
