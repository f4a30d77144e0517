"""Deliberate fault injection, for tests and to see for yourself what a failure does.

    VIDTRAIN_FAULT=<point>_<action>:<count>[:<rank>][,<another>...]

fires at the point when the count matches, on every rank or only the one named. Points: `step` at
that optimizer step's loss, before its backward (on_loss: its update and checkpoint never happen),
`save` after that step's shards are written and before the commit, `cache` after that many cache
entries, `render` before that sampling step of the process. Actions: `kill` (SIGKILL), `sigterm` (as
a scheduler sends), `sigint` (Ctrl-C), `fail` (raise OSError), `deadlock` (wait for a message no
rank sends, until parallel.timeout_s), `pause` (print a line naming the process, then wait for a
signal and handle it as if it had just arrived: a test can act at that point, e.g. start a second
run or signal the launcher, without racing a timer). Five more are named for what they do:
`save_fail` (the storage writer fails like a full disk), `disk_full` (the count-th file this process
writes through `written` fails like a full disk: a cache entry, a clip, an exported file),
`sound_segv` (the child decoding the count-th clip's sound of this process dies of SIGSEGV, as a
decoder's bug would; decode.py asks), `nan_loss` (the step's loss is NaN) and `overflow` (the step's
backward starts from its loss times 1e30: its gradients overflow, its loss stays finite)."""

import contextlib
import errno
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError

FAULT_ENV = "VIDTRAIN_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
writes = 0  # files written through `written` by this process, counted for the disk_full fault


class WriteFailed(OSError):
    """A file could not be written (a full disk, say): the message names the file and the fix."""


def _specs() -> list[list[str]]:
    return [spec.split(":") for spec in os.environ.get(FAULT_ENV, "").split(",") if spec]


def active(name: str, count: int) -> bool:
    return any(
        spec[0] == name and int(spec[1]) == count and (len(spec) == 2 or int(spec[2]) == dist.get_rank())
        for spec in _specs()
    )


@contextlib.contextmanager
def written(path: Path, fix: str):
    """Write `path` (a file, or a folder) as the temporary beside it that this yields, renamed into
    place once complete: a failed write leaves neither a partial `path` nor the temporary, and
    raises WriteFailed naming `path`, the cause and `fix`. The disk_full fault fires after the
    write, before the rename."""
    global writes
    writes += 1
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if active("disk_full", writes):
            raise OSError(errno.ENOSPC, "No space left on device (injected disk_full)")
        # a folder cannot be replaced in one rename: the old one goes once the new is in place
        if path.is_dir():
            os.replace(path, path.with_name(f"{path.name}.old{os.getpid()}"))
            os.replace(tmp, path)
            shutil.rmtree(path.with_name(f"{path.name}.old{os.getpid()}"))
        else:
            os.replace(tmp, path)
    except BaseException as e:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        tmp.unlink(missing_ok=True)
        if isinstance(e, (OSError, SafetensorError)):  # safetensors reports its own write errors
            raise WriteFailed(f"writing {path} failed ({e}): {fix}") from None
        raise


class _ScaledBackward(torch.autograd.Function):
    """The loss unchanged forward; its backward starts from the incoming gradient times `factor`."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


_step_seen = 0  # the last step on_loss saw: the step point fires at a step's first micro-step only


def on_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The training loop's one fault hook, on a micro-step's loss before its backward.

    The training loop's one fault hook: a micro-step's loss of optimizer step `step`, before its
    backward.

    `nan_loss` makes the loss NaN; `overflow` keeps its value (the loop logs it finite) and
    multiplies the gradient its backward starts from by 1e30, as a backward from the loss times 1e30
    would; the `step` point fires at the step's first micro-step, so its update and its checkpoint
    never happen (the checkpoints before it are written, an asynchronous one still in flight)."""
    global _step_seen
    if step != _step_seen:
        _step_seen = step
        fault("step", step)
    if active("nan_loss", step):
        loss = loss * math.nan
    if active("overflow", step):
        loss = _ScaledBackward.apply(loss, 1e30)
    return loss


def fault(point: str, count: int) -> None:
    for name, *_ in _specs():
        action = name.removeprefix(f"{point}_")
        if name == action or not active(name, count):
            continue
        if action in SIGNALS:
            os.kill(os.getpid(), SIGNALS[action])
        elif action == "deadlock":
            dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
        elif action == "pause":
            pause(f"{point} {count}")
        else:
            raise OSError(f"injected fault {point}_{action} at {count}")


def pause(where: str) -> None:
    """Wait until the process handles a signal (SIGTERM, SIGUSR1, Ctrl-C); its handler runs as
    usual. Python's wakeup fd receives a byte for every signal it handles, whichever thread the
    kernel gave it to, and it is set before the line is printed: a signal sent as soon as the line
    is read is never missed."""
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    previous = signal.set_wakeup_fd(woken)
    print(
        f"rank {dist.get_rank()} (pid {os.getpid()}) paused at {where} ({FAULT_ENV})",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.read(wake, 1)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(wake)
        os.close(woken)
