"""``python -m diffsynth_mbc.doctor``: will this run work on this machine (or an assumed GPU), and how fast could it go.

``memory`` is the pure memory model, ``checks`` the individual checks, ``nccl`` the all-reduce probe,
``cli`` the command (table or ``--json``).
"""
