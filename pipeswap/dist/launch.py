"""Run a function on every rank: under torchrun, in local spawned processes, or in this one."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from pipeswap.config_fields import ConfigError
from pipeswap.dist.env import free_port, torchrun_env
from pipeswap.dist.group import backend_for, barrier, init_process_group, leave_process_group
from pipeswap.dist.peers import LOST_PEERS, lost_peers
from pipeswap.dist.signals import LauncherInterrupted, sigterm_interrupts
from pipeswap.errors import PipeswapError, crash_line, debugging

__all__ = ["LaunchResult", "RankFailedError", "run_ranks", "spawn"]

# A rank that failed with a PipeswapError (bad input found on the rank) exits with this
# status and leaves its message for the launcher; any other failure is a crash.
_BAD_INPUT_STATUS = 2
# A rank whose collective failed because a peer had gone: never the cause of a failure.
_LOST_PEERS_STATUS = 3
# How long the other ranks get to end on their own once one has failed (see spawn).
_NOTICE_S = 15.0
_CONFIG_ERROR = "config-error:"


class RankFailedError(PipeswapError):
    """A rank crashed (not bad input): the message names it; the CLI exits with status 1."""

    exit_status = 1


@dataclass(frozen=True)
class LaunchResult:
    """Exit code of every rank (None: killed after the grace period) and each rank's return value."""

    exit_codes: tuple[int | None, ...]
    killed: tuple[int, ...]
    elapsed_s: float
    results: tuple[Any, ...]
    # A failed rank's PipeswapError message; a ConfigError's keeps its {field} placeholders
    # (marked by the prefix below), so the launcher raises it as one again.
    messages: tuple[str | None, ...] = ()
    first_failed: int | None = None  # the rank seen failing first
    interrupted: int | None = None  # the signal that stopped the launcher (it stopped the ranks)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes)

    def describe(self, rank: int) -> str:
        code = self.exit_codes[rank]
        if code is None:
            return f"rank {rank} was killed after the others had failed"
        if code < 0:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        if code == _LOST_PEERS_STATUS:
            return f"rank {rank} {LOST_PEERS}"
        return f"rank {rank} exited with status {code}"

    def raise_failure(self) -> None:
        """Raise one error for a failed launch, naming the rank that failed first; a
        launcher stopped by a signal raises :class:`LauncherInterrupted` with the ranks'
        word on it (where they stopped, their checkpoint), or rank 0's value when every
        rank ended well."""
        if self.interrupted is not None and self.ok:
            raise LauncherInterrupted(self.interrupted, value=self.results[0])
        if self.ok:
            return
        first = self.first_failed
        if first is None:
            first = next(r for r, code in enumerate(self.exit_codes) if code != 0)
        message = self.messages[first] if self.messages else None
        if self.interrupted is not None:
            if message and message.startswith(_CONFIG_ERROR):
                message = str(ConfigError(message.removeprefix(_CONFIG_ERROR)))
            if message:  # the ranks were stopped by SIGTERM, whatever stopped this process
                message = message.replace(
                    "stopped by SIGTERM", f"stopped by {signal.Signals(self.interrupted).name}"
                )
            raise LauncherInterrupted(self.interrupted, message)
        if message and message.startswith(_CONFIG_ERROR):
            raise ConfigError(_named(first, message.removeprefix(_CONFIG_ERROR)))
        if message:
            raise PipeswapError(_named(first, message))
        others = [r for r, code in enumerate(self.exit_codes) if code != 0 and r != first]
        tail = f"; then {', '.join(f'rank {r}' for r in others)} stopped too" if others else ""
        code = self.exit_codes[first]
        where = (
            "its output is above"
            if code is None or code >= 0
            else "a rank killed by a signal says nothing: the system's log says why, as "
            "dmesg does for the out-of-memory killer"
        )
        raise RankFailedError(f"{self.describe(first)}{tail} ({where})")


def _named(rank: int, message: str) -> str:
    return message if message.startswith("rank ") else f"rank {rank}: {message}"


def run_ranks(
    fn: Callable[..., Any],
    nproc: int | None,
    *args: Any,
    device: str,
    timeout_s: float,
    stop_grace_s: float = 5.0,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank of the job; return this process's value.

    - Under torchrun (``RANK`` and ``WORLD_SIZE`` set) with ``nproc`` None: this process is
      one rank; it joins the job's process group and returns its own rank's value.
    - ``nproc`` of 1, or None outside torchrun: ``fn(0, 1, *args)`` here, no process group.
    - ``nproc`` > 1: that many local processes with a rendezvous on 127.0.0.1; rank 0's
      value is returned. When a rank fails the others stop within ``timeout_s``, and one
      :class:`PipeswapError` names the rank that failed first (a :class:`RankFailedError`
      when it crashed rather than refused its input). Stopped by a signal, the ranks
      get ``stop_grace_s`` to end, then :class:`LauncherInterrupted` says what they said
      as they stopped, or holds rank 0's value when every rank ended well.

    The backend is NCCL for ``device`` "cuda" when every local rank has a GPU, else gloo.
    """
    env = torchrun_env()
    if env is not None and nproc is None:
        init_process_group(env, backend=backend_for(device, env.local_ranks), timeout_s=timeout_s)
        try:
            return fn(env.rank, env.world_size, *args)
        finally:
            leave_process_group()
    count = 1 if nproc is None else nproc
    if count < 1:
        raise ConfigError(f"{{nproc}} is {count}; use 1 or more")
    if count == 1:
        return fn(0, 1, *args)
    launched = spawn(
        fn,
        count,
        *args,
        backend=backend_for(device, count),
        timeout_s=timeout_s,
        stop_grace_s=stop_grace_s,
    )
    launched.raise_failure()
    return launched.results[0]


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float,
    grace_s: float | None = None,
    stop_grace_s: float = 5.0,
) -> LaunchResult:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` fresh processes joined in one process group.

    Every rank's return value comes back through a pipe. When a rank exits non-zero, the
    others get ``grace_s`` (default 15 s) to notice and exit on their own, then any still
    running are killed and listed in ``killed``. A rank that exits closes its connections,
    so peers blocked on it fail within moments; one still running after that is stuck (a
    stopped or hung process, or a peer of one) and would end only at its own timeout, so
    waiting for it would delay the report and change nothing in it.

    No rank outlives this process: on SIGINT or SIGTERM it passes the signal on to every
    rank as SIGTERM and gives them ``stop_grace_s`` to end (time to finish a step, write a
    checkpoint and send their results; a second SIGINT stops the wait), kills the rest and
    raises :class:`LauncherInterrupted` with what they sent; if it is killed outright
    (SIGKILL), each rank gets SIGKILL from the kernel (Linux's parent-death signal) or, elsewhere, from its own
    watchdog. Nothing is written to disk.
    """
    grace = _NOTICE_S if grace_s is None else grace_s
    port = free_port()
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(nproc)]
    procs = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, nproc, port, args, pipes[rank][1], backend, timeout_s, os.getpid()),
            name=f"pipeswap-rank{rank}",
        )
        for rank in range(nproc)
    ]
    replies: dict[int, tuple[str, Any]] = {}
    start = time.monotonic()
    killed: list[int] = []
    first_failed: int | None = None
    interrupted: int | None = None
    with sigterm_interrupts():
        try:
            for proc in procs:
                proc.start()
            for _, writer in pipes:
                writer.close()  # the ranks hold the writing ends now
            failed_at: float | None = None
            while any(p.is_alive() for p in procs):
                # Wake as soon as a rank exits (so the first failure is told from the peers
                # that fail a moment later because it is gone) or has its result ready.
                waitables: list[Any] = [p.sentinel for p in procs if p.is_alive()]
                waitables += [pipes[r][0] for r in range(nproc) if r not in replies]
                ready = wait(waitables, 0.25)
                _receive(pipes, ready, replies)
                if failed_at is None:
                    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if failed:
                        failed_at = time.monotonic()
                        first_failed = min(failed, key=lambda r: _cause_order(procs[r].exitcode))
                if failed_at is not None and time.monotonic() - failed_at > grace:
                    for rank, proc in enumerate(procs):
                        if proc.is_alive():
                            proc.kill()
                            killed.append(rank)
                    break
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM (a LauncherInterrupted)
            interrupted = getattr(exc, "signum", signal.SIGINT)
            _stop(procs, stop_grace_s, pipes, replies)
        except BaseException:
            _stop(procs, stop_grace_s, pipes, replies)
            raise
    for proc in procs:
        if proc.pid is not None:  # (a signal may have come before every rank started)
            proc.join()
    _receive(pipes, [reader for reader, _ in pipes if reader.poll()], replies)
    if first_failed is None:
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        first_failed = failed[0] if failed else None
    launched = LaunchResult(
        exit_codes=tuple(None if r in killed else p.exitcode for r, p in enumerate(procs)),
        killed=tuple(killed),
        elapsed_s=time.monotonic() - start,
        results=tuple(_reply(replies, r, "ok") for r in range(nproc)),
        messages=tuple(_reply(replies, r, "error") for r in range(nproc)),
        first_failed=first_failed,
        interrupted=interrupted,
    )
    if interrupted is not None:
        launched.raise_failure()  # a LauncherInterrupted, whatever the ranks did
    return launched


def _reply(replies: dict[int, tuple[str, Any]], rank: int, kind: str) -> Any:
    """What rank ``rank`` sent, if it sent ``kind`` ("ok": its value, "error": its message)."""
    sent, value = replies.get(rank, ("none", None))
    return value if sent == kind else None


def _stop(
    procs: list[Any], grace_s: float, pipes: list[Any], replies: dict[int, tuple[str, Any]]
) -> None:
    """SIGTERM every live rank and wait up to ``grace_s`` for them to end, reading what
    they send meanwhile (SIGTERM again changes nothing; SIGINT stops waiting); then kill
    the rest."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    interrupted = False
    try:
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            waitables: list[Any] = [p.sentinel for p in procs if p.is_alive()]
            waitables += [pipes[r][0] for r in range(len(pipes)) if r not in replies]
            _receive(pipes, wait(waitables, 0.25), replies)
    except KeyboardInterrupt:  # Ctrl-C again: stop waiting, and kill what is left first
        interrupted = True
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if interrupted:
        raise KeyboardInterrupt


def _receive(pipes: list[Any], ready: list[Any], replies: dict[int, tuple[str, Any]]) -> None:
    for rank, (reader, _) in enumerate(pipes):
        if rank in replies or reader not in ready:
            continue
        try:
            replies[rank] = pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):  # the rank died before it replied
            replies[rank] = ("died", None)


def _cause_order(code: int | None) -> int:
    """Among ranks seen failing at once, the likeliest cause first: a signal, then bad
    input, then a crash; a rank that only lost its peers last."""
    if code is None or code < 0:
        return 0
    return {_BAD_INPUT_STATUS: 1, _LOST_PEERS_STATUS: 3}.get(code, 2)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    nproc: int,
    port: int,
    args: tuple[Any, ...],
    reply: Any,
    backend: str,
    timeout_s: float,
    launcher_pid: int,
) -> None:
    _die_with(launcher_pid)
    # Ctrl-C reaches every process of the terminal's group: the launcher alone handles it
    # and stops the ranks with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        env = torchrun_env()
        assert env is not None
        init_process_group(env, backend=backend, timeout_s=timeout_s)
        value = fn(rank, nproc, *args)
        _send(reply, ("ok", value))
        barrier()
        leave_process_group()
    except BaseException as exc:  # noqa: BLE001 - any failure must end this rank non-zero
        if isinstance(exc, PipeswapError):
            # The launcher says it, once, in its caller's words (flags on the command line).
            text = _CONFIG_ERROR + exc.message if isinstance(exc, ConfigError) else str(exc)
            try:
                _send(reply, ("error", text))
            except OSError:  # the launcher is gone: this rank's stderr is all there is
                print(f"rank {rank}: error: {exc}", file=sys.stderr)
        elif debugging():
            print(f"rank {rank}: failed:", file=sys.stderr)
            traceback.print_exc()
        elif lost_peers(exc):
            # Never the cause: the launcher names the rank that failed first.
            os._exit(_LOST_PEERS_STATUS)
        else:
            print(f"rank {rank}: crashed: {crash_line(exc)}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(_BAD_INPUT_STATUS if isinstance(exc, PipeswapError) else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called...").
    os._exit(0)


def _send(reply: Any, message: tuple[str, Any]) -> None:
    # Plain pickle copies tensors into the message; the pipe's own pickler would share
    # their memory with the launcher, which fails once this rank has exited.
    reply.send_bytes(pickle.dumps(message))


def _die_with(launcher_pid: int) -> None:
    """Have the kernel SIGKILL this rank when its launcher dies (a watchdog off Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:

        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="pipeswap-launcher-watchdog", daemon=True).start()
    if os.getppid() != launcher_pid:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
