"""``python -m diffsynth_mbc.sample``: see ``cli.py``."""

from diffsynth_mbc.sample.cli import main

raise SystemExit(main())
