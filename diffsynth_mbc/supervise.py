"""`python -m diffsynth_mbc.supervise`: run a launch as the owner of its processes (see ``diffsynth_mbc.lifecycle.supervisor``)."""

from diffsynth_mbc.lifecycle.supervisor import main

if __name__ == "__main__":
    raise SystemExit(main())
