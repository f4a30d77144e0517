"""Every command's frame: config, process group, run lock, one failure report, exit code, teardown.

The config, the process group and the run lock around the work, one report of any failure across the
ranks, the exit code (0, 1 after a failure, 130 after Ctrl-C), and teardown on every path."""

import contextlib
import datetime
import errno
import fcntl
import gc
import logging
import os
import signal
import socket
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch.distributed as dist
from diffusers.utils import logging as diffusers_logging
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from transformers.utils import logging as transformers_logging

import faults
import model_adapter
import ranks
from config import ConfigError, load_config

log = logging.getLogger("vidtrain")
# set by launch.sh: a folder where every rank writes its exit code, rank 0 its error
EXIT_CODES = "VIDTRAIN_EXIT_CODES"


def run_command(work, config_path: str, overrides: list[str], lock_output_dir: bool = False) -> None:
    """Every command's frame: read the config and check it against its family's options (reading
    nothing of the model but its model_index.json), set up the process group, take the run lock
    (with `lock_output_dir`), run work(cfg, d) on every rank; on any failure (an exception, Ctrl-C,
    DCP's own errors) exactly one rank reports the cause; the process group is destroyed on every
    path; the exit code is 0, 1 after a failure, 130 after Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # torchao (installed for train.optimizer = "adamw8bit") is imported by diffusers in every run;
    # on a machine without Triton or its CUDA kernels it warns at import about kernels AdamW8bit does
    # not use (its step compiles with inductor)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    rank, code = int(os.environ.get("RANK", 0)), 0
    previous_handlers = ranks.PREEMPTION.install()
    try:
        cfg = load_config(config_path, overrides)
        model_adapter.check_config(cfg)
        if EXIT_CODES in os.environ and rank == 0:  # launch.sh keeps torchrun's log there
            (Path(os.environ[EXIT_CODES]) / "output_dir").write_text(cfg.run.output_dir)
        if cfg.run.deterministic:
            ranks.make_deterministic()
        d = ranks.init(cfg.parallel)
        if not d.is_main:
            quiet()
        with run_lock(cfg.run.output_dir, d) if lock_output_dir else contextlib.nullcontext():
            work(cfg, d)
    # noqa: BLE001 - the frame of every command: report once, then clean up
    except BaseException as e:
        code = report(e, rank)
    # Outside the except block, so the traceback and the model it references are gone first.
    shutdown()
    # launch.sh's folder: torchrun does not pass the workers' codes on after a signal
    if EXIT_CODES in os.environ:
        (Path(os.environ[EXIT_CODES]) / f"rank-{rank}").write_text(f"{code}\n")
    # handlers still set: torchrun's SIGTERM after a rank's exit must not kill this one mid-report
    if code:
        sys.exit(code)
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)


def quiet() -> None:
    """Quiet the output of every rank but 0, which speaks for all.

    On every rank but 0, which speaks for all: warnings (ours, Python's, the libraries'), notices
    and progress bars would show once per rank. Errors still show; cache.py relays what only one
    rank sees."""
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()


@contextlib.contextmanager
def run_lock(folder: str, d: ranks.Dist):
    """Hold run.output_dir for this run alone: an exclusive flock on its run.lock on rank 0.

    One writer per run.output_dir: rank 0 holds an exclusive flock on its run.lock, from before any
    compute, with its pid and host written there for a second run's message. The kernel releases a
    flock when its process ends, SIGKILL included: a dead run never holds the folder, its run.lock
    is harmless. Across nodes it holds where the shared filesystem passes flock to its server (NFS,
    GPFS, Lustre with -o flock); where flock is refused, the run warns and goes on unlocked."""
    lock, path = None, Path(folder) / "run.lock"
    # what this launch creates, if it fails its checks
    made = [p for p in (path.parent, path) if not p.exists()]
    with ranks.all_or_none():
        if d.is_main:
            lock = take_lock(path)
    try:
        yield
    except (ConfigError, ranks.StopRun):
        # A check that failed (the config's, the model's, the clips') leaves no trace of a run that
        # never started: the run.lock this launch made goes, still held, and the folder too while it
        # is empty.
        if lock is not None and made:
            path.unlink(missing_ok=True)
            if path.parent in made:
                with contextlib.suppress(OSError):  # not empty: something else was written there
                    path.parent.rmdir()
        raise
    finally:
        if lock is not None:
            lock.close()


def write_problem(folder: Path) -> str | None:
    """Why nothing can be written in `folder`, or None if a file can be made there.

    The folder is made if missing; the reason is a read-only filesystem or permissions. The test
    file is removed again."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vidtrain-writable-"):
            return None
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return e.strerror


def take_lock(path: Path):
    """The open run.lock, flocked; a ConfigError naming the holder when another process holds it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # not truncated before it is ours: the holder's pid and host stay readable
        lock = path.open("a+")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError(
            f"run.output_dir = {path.parent} cannot be written ({e.strerror}): choose a folder this "
            "user can write for run.output_dir"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a run that has not written its pid yet"
        lock.close()
        raise ConfigError(
            f"run.output_dir = {path.parent} is in use by another run: {holder} (its {path.name}); "
            "wait for it to end or stop it, or choose another run.output_dir"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        log.warning(
            "cannot lock %s (%s): this filesystem refuses flock, so nothing stops a second run from "
            "writing into the same run.output_dir",
            path,
            e,
        )
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    lock.flush()
    return lock


def report(error: BaseException, rank: int) -> int:
    """Report a failure at most once across ranks; return the exit code."""
    if isinstance(error, ranks.Preempted):
        if rank == 0:
            log.info("stopped by a signal: %s", error)
        return 0
    # Raised alike on every rank, or (a failed write of rank 0's files) on rank 0 alone.
    if isinstance(error, (ConfigError, ranks.StopRun, CheckpointException, faults.WriteFailed)):
        if rank == 0:
            message = f"error: {first_failure(error) if isinstance(error, CheckpointException) else error}"
            log.error("%s", message)
            # launch.sh prints it again, last, below torchrun's own report
            if EXIT_CODES in os.environ:
                (Path(os.environ[EXIT_CODES]) / "error").write_text(f"{message}\n")
        return 1
    if isinstance(error, KeyboardInterrupt):
        if rank == 0:
            log.error(
                "interrupted: stopped without a checkpoint (SIGTERM or SIGUSR1 save one before stopping)"
            )
        return 130
    if timed_out(error):  # before peer_failed: this rank's own timeout also closes its connections
        if not first_to_report("timeout"):
            return 1
        try:  # raised, so that the traceback torchrun prints is this one
            raise TimeoutError(
                f"rank {rank}: a collective waited longer than parallel.timeout_s: another rank "
                "hangs, or the ranks disagree on what runs next; raise parallel.timeout_s if a step, "
                f"a save or a validation legitimately takes longer ({error})"
            ) from None
        except TimeoutError as explained:
            return report_unexpected(explained)
    if peer_failed(error):
        if rank == 0:
            log.error("stopping: another rank failed (torchrun reports its error)")
        return 1
    return report_unexpected(error)


def report_unexpected(error: BaseException) -> int:
    """Called while `error` is being handled: torchrun prints it once, with its traceback."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        ErrorHandler().record_exception(error)
    else:
        log.error("%s", "".join(traceback.format_exception(error)).rstrip())
    return 1


def first_failure(error: CheckpointException) -> str:
    """DCP's exception holds every failing rank's traceback: the lowest rank's cause."""
    rank, (cause, _) = sorted(error.failures.items())[0]
    return f"rank {rank}: {type(cause).__name__}: {cause}"


def shutdown() -> None:
    """FSDP2 processes sometimes abort at exit unless the model is collected before the group goes."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def peer_failed(error: BaseException) -> bool:
    """Whether a collective broke because another rank died.

    That rank reports the cause; this one stays quiet."""
    lost = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
    return any(text in str(error) for text in lost)


def timed_out(error: BaseException) -> bool:
    """Whether an error is this rank's own collective timeout.

    gloo raises a RuntimeError ("Timed out waiting ...") and NCCL a DistBackendError on a timeout; a
    collective waited on after one that timed out in the background (the preemption flag's) raises
    "Application timeout caused pair closure": this rank's own timeout too, not a lost peer (else it
    exits quietly, the hung rank sees its connection close and does too, and nobody reports it)."""
    return isinstance(error, RuntimeError) and any(
        text in str(error) for text in ("Timed out", "timed out", "timeout")
    )


def first_to_report(what: str) -> bool:
    """Whether this rank is the first to report a collective timeout, as the job's store elects.

    Several ranks may time out in the same collective: the job's store (torchrun's, which outlives
    the collective) elects the first of them to report it."""
    if "MASTER_ADDR" not in os.environ:
        return True
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
        return store.add(f"vidtrain/{run}/{what}", 1) == 1
    # the store itself is gone (DistError is a RuntimeError): better twice than never
    except RuntimeError:
        return True
