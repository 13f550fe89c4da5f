"""Models: finding the Wan2.2-TI2V-5B files, building DiffSynth's Wan pipeline (real or tiny demo),
and running its units outside a training step.

Shared by ``data`` (the latent cache encodes with the pipeline's VAE and text encoder) and
``training``. May import only the top-level shared modules; never ``data``, ``training`` or
``monitor``.
"""
