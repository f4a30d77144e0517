"""Deliberate fault injection, for tests and to see for yourself what a failure does.

    VIDTRAIN_FAULT=<point>_<action>:<count>[:<rank>]

fires at the point when the count matches, on every rank or only the one named. Points: `step` after
that optimizer step, `save` after that step's shards are written and before the commit, `cache` after
that many cache entries, `render` before that sampling step of the process. Actions: `kill` (SIGKILL),
`sigterm` (as a scheduler sends), `sigint` (Ctrl-C), `fail` (raise OSError), `deadlock` (wait for a
message no rank sends, until parallel.timeout_s). Two more are named for what they
do: `save_fail` (the storage writer fails like a full disk) and `nan_loss` (the step's loss is NaN)."""

import os
import signal

import torch
import torch.distributed as dist

FAULT_ENV = "VIDTRAIN_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}


def active(name: str, count: int) -> bool:
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or spec[0] != name or int(spec[1]) != count:
        return False
    return len(spec) == 2 or int(spec[2]) == dist.get_rank()


def fault(point: str, count: int) -> None:
    action = os.environ.get(FAULT_ENV, "").split(":")[0].removeprefix(f"{point}_")
    if not active(f"{point}_{action}", count):
        return
    if action in SIGNALS:
        os.kill(os.getpid(), SIGNALS[action])
    elif action == "deadlock":
        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    else:
        raise OSError(f"injected fault {point}_{action} at {count}")
