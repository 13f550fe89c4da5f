"""Checkpoints: the folder, the saved state, whose files they are, integrity, disk space, the fingerprint, resume."""
