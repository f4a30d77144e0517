"""Deliberate fault injection, for tests and to see for yourself what a failure does.

    VIDTRAIN_FAULT=<point>:<count>[:<rank>]

names the point, the step (or count: cache entries written, sampling steps taken) at which it fires,
and optionally the one rank where it fires. Points named *_kill send this process SIGKILL, *_sigterm
SIGTERM (as a scheduler would), *_hang sleep past parallel.timeout_s; the others raise OSError.
"""

import os
import signal
import time

import torch.distributed as dist

FAULT_ENV = "VIDTRAIN_FAULT"


def active(point: str, count: int) -> bool:
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or spec[0] != point or int(spec[1]) != count:
        return False
    return len(spec) == 2 or int(spec[2]) == dist.get_rank()


def fault(point: str, count: int, hang_s: float = 0.0) -> None:
    if not active(point, count):
        return
    if point.endswith("_kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif point.endswith("_sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
    elif point.endswith("_hang"):
        time.sleep(hang_s)
    else:
        raise OSError(f"injected fault {point} at {count}")
