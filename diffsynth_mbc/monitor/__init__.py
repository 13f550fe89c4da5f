"""Monitor: reads the per-rank files a run writes and shows them (terminal, JSON, HTTP dashboard).

Owns status normalisation, the incremental history reader, the run aggregate, the terminal view,
the HTTP server and the dashboard page (``web/``).

May import only the top-level shared modules (``atomic``, ``run_files``). Never imports torch,
diffsynth, ``data``, ``training`` or ``models``: it must run on a laptop with only the package's
light dependencies.
"""
