"""Data: the catalogue -> metadata -> (latent cache) stages, and what loads a training sample.

Owns catalogue parsing and validation (``catalog``, ``selection``), the convert command
(``convert``), media header probing (``probe``), the MBC dataset adapter (``dataset``), the demo
data (``demo``, ``demo_data``) and the latent cache (``cache/``).

May import: the top-level shared modules (``atomic``, ``errors``, ``run_files``) and ``models``.
Never imports ``training`` or ``monitor``. Pure logic (catalogue rules) stays free of torch.
"""
