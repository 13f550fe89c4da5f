"""The latent cache: VAE latents and text embeddings encoded once, read back by training.

``index`` (format, keys, fingerprints; no torch), ``encoder`` (DiffSynth's units on the
pipeline's encoders), ``build`` (sharded encoding over ranks and the merge), ``cli`` (the
``python -m diffsynth_mbc.cache`` command), ``dataset`` (what training reads).
"""
