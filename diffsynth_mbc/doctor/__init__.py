"""``python -m diffsynth_mbc.doctor``: will this run work on this machine (or an assumed GPU), how fast, how long.

The figures come from the cost model in ``training/plan/`` (``memory``, ``speed``, ``run_length``, ``estimates``),
which the training itself decides by: the doctor only reads it. Here: ``checks`` (the individual checks),
``disk`` and ``advice`` (two of them), ``nccl`` (the all-reduce probe), ``step_probe`` (the measured steps of
``--probe N``), ``report`` and ``cli`` (the command: a table or ``--json``).
"""
