"""Training: options, the step plan, the LoRA module, the loop and everything a rank writes.

Owns the options and presets (``options``), step and LR arithmetic (``step_plan``, ``eta``), the
plan command (``plan``), the DiffSynth training module (``lora_module``), the loop in named stages
(``loop``), checkpoints (``checkpoints``), validation, the progress callback (``progress``), the
per-rank status writer (``status_writer``) and stop signals (``stop_signals``).

May import: the top-level shared modules, ``models`` and ``data``. Never imports ``monitor``.
Pure logic (``step_plan``, ``eta``, ``options``) stays free of torch.
"""
