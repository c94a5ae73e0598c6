"""A job for the supervised launcher's loop tests: no torch, no MPI calls, one behaviour per mode.

``python supervised_worker.py MODE LEDGER [RESUME_ARG]`` under ``lightning-recover launch --supervise``:

* ``stall``: the first attempt commits steps 0-4 to LEDGER (0.5 s each), then hangs with
  no further progress; a relaunch must carry the resume argument, and then redoes the steps
  from the checkpoint's (3, from ``step-00000003.ckpt``) to 5 and ends normally.
* ``raise``: every attempt leaves as a rank whose program raised (marker, then SIGKILL,
  as lightning_recover.runtime.lifecycle's crash hook does).
* ``die``: every attempt is killed by a signal after its communicator would be up.
* ``finish``: ends normally.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from lightning_recover.runtime.lifecycle import mark_status

mode, ledger = sys.argv[1], sys.argv[2]
attempt = int(os.environ["LIGHTNING_RECOVER_ATTEMPT"])
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
mark_status("started", rank)


def commit(steps: range, keep_below: int | None = None) -> None:
    lines = []
    if keep_below is not None and os.path.exists(ledger):
        lines = [line for line in open(ledger) if json.loads(line)["step"] < keep_below]
    with open(ledger, "w") as f:
        f.writelines(lines)
    for step in steps:
        time.sleep(0.2)
        with open(ledger, "a") as f:
            f.write(json.dumps({"step": step, "step_time_s": 0.5}) + "\n")


if mode == "stall":
    if attempt == 0:
        commit(range(5))
        time.sleep(600)  # hung: the stall watchdog must end it
    if sys.argv[3:] != ["++ckpt_path=last"]:
        sys.exit(f"attempt {attempt} was not given the resume argument: {sys.argv[3:]}")
    commit(range(3, 6), keep_below=3)
    mark_status("ok", rank)
elif mode == "raise":
    mark_status("raised", rank, "ValueError\nValueError: bad lr\n")
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "finish":
    mark_status("ok", rank)
elif mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    sys.exit(f"unknown mode {mode!r}")
