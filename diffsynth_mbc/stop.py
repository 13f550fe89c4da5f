"""`python -m diffsynth_mbc.stop OUTPUT_PATH [--grace S]`: stop a run (see ``diffsynth_mbc.lifecycle.stop_command``).

``bash launchers/stop.sh`` runs this with ``MBC_STOP_PROG`` set, so its usage and errors name the command typed.
"""

import os

from diffsynth_mbc import environment
from diffsynth_mbc.lifecycle.stop_command import main

if __name__ == "__main__":
    raise SystemExit(main(prog=os.environ.get(environment.STOP_PROG) or "python -m diffsynth_mbc.stop"))
