"""`python -m diffsynth_mbc.doctor`: preflight checks (see ``diffsynth_mbc.doctor.cli``)."""

from diffsynth_mbc.doctor.cli import main

if __name__ == "__main__":   # the NCCL probe spawns processes that import this module again
    raise SystemExit(main())
