"""Run a function on every rank: under torchrun, in local spawned processes, or in this one."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from pipeswap.dist.env import free_port, torchrun_env
from pipeswap.dist.group import backend_for, barrier, init_process_group, leave_process_group
from pipeswap.errors import PipeswapError

# A rank that failed with a PipeswapError (bad input found on the rank) exits with this
# status and leaves its message for the launcher; any other failure is a crash.
_BAD_INPUT_STATUS = 2


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
    messages: tuple[str | None, ...] = ()  # a failed rank's PipeswapError message
    first_failed: int | None = None  # the rank seen failing first

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes)

    def describe(self, rank: int) -> str:
        code = self.exit_codes[rank]
        if code is None:
            return f"rank {rank} was killed after the others had failed"
        if code < 0:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        return f"rank {rank} exited with status {code}"

    def raise_failure(self) -> None:
        """Raise one error for a failed launch, naming the rank that failed first."""
        if self.ok:
            return
        first = self.first_failed
        if first is None:
            first = next(r for r, code in enumerate(self.exit_codes) if code != 0)
        message = self.messages[first] if self.messages else None
        if message:
            raise PipeswapError(_named(first, message))
        others = [r for r, code in enumerate(self.exit_codes) if code != 0 and r != first]
        tail = f"; then {', '.join(f'rank {r}' for r in others)} stopped too" if others else ""
        raise RankFailedError(f"{self.describe(first)}{tail} (its output is above)")


def _named(rank: int, message: str) -> str:
    return message if message.startswith("rank ") else f"rank {rank}: {message}"


def run_ranks(
    fn: Callable[..., Any],
    nproc: int | None,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = 60.0,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank of the job; return this process's value.

    - Under torchrun (``RANK`` and ``WORLD_SIZE`` set) with ``nproc`` None: this process is
      one rank; it joins the job's process group and returns its own rank's value.
    - ``nproc`` of 1, or None outside torchrun: ``fn(0, 1, *args)`` here, no process group.
    - ``nproc`` > 1: that many local processes with a rendezvous on 127.0.0.1; rank 0's
      value is returned. When a rank fails the others stop within ``timeout_s``, and one
      :class:`PipeswapError` names the rank that failed first (a :class:`RankFailedError`
      when it crashed rather than refused its input).

    The backend is NCCL for ``device`` "cuda" when every local rank has a GPU, else gloo.
    """
    env = torchrun_env()
    if env is not None and nproc is None:
        init_process_group(
            env, backend=backend_for(device, env.local_ranks), timeout_s=timeout_s
        )
        try:
            return fn(env.rank, env.world_size, *args)
        finally:
            leave_process_group()
    count = 1 if nproc is None else nproc
    if count < 1:
        raise PipeswapError(f"--nproc is {count}; use 1 or more")
    if count == 1:
        return fn(0, 1, *args)
    launched = spawn(fn, count, *args, backend=backend_for(device, count), timeout_s=timeout_s)
    launched.raise_failure()
    return launched.results[0]


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    grace_s: float | None = None,
) -> LaunchResult:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` fresh processes joined in one process group.

    Every rank's return value comes back (pickled through a file). When a rank exits
    non-zero, the others get ``grace_s`` (default ``timeout_s + 15``) to notice and exit
    on their own (they fail once a transfer with the dead rank errors or times out);
    any still running after that are killed and listed in ``killed``. If this process is
    interrupted, every rank is killed before the interrupt goes on.
    """
    grace = timeout_s + 15.0 if grace_s is None else grace_s
    port = free_port()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pipeswap-ranks-") as folder:
        procs = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, nproc, port, args, folder, backend, timeout_s),
                name=f"pipeswap-rank{rank}",
            )
            for rank in range(nproc)
        ]
        start = time.monotonic()
        killed: list[int] = []
        first_failed: int | None = None
        try:
            for proc in procs:
                proc.start()
            failed_at: float | None = None
            while any(p.is_alive() for p in procs):
                # Wake as soon as a rank exits, so the first failure is told from the peers
                # that fail a moment later because it is gone.
                wait([p.sentinel for p in procs if p.is_alive()], timeout=0.25)
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
        except BaseException:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join()
            raise
        for proc in procs:
            proc.join()
        if first_failed is None:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            first_failed = failed[0] if failed else None
        results: list[Any] = []
        messages: list[str | None] = []
        for rank in range(nproc):
            path = Path(folder) / f"{rank}.pkl"
            results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
            error = Path(folder) / f"{rank}.err"
            messages.append(error.read_text() if error.exists() else None)
    return LaunchResult(
        exit_codes=tuple(None if r in killed else p.exitcode for r, p in enumerate(procs)),
        killed=tuple(killed),
        elapsed_s=time.monotonic() - start,
        results=tuple(results),
        messages=tuple(messages),
        first_failed=first_failed,
    )


def _cause_order(code: int | None) -> int:
    """Among ranks seen failing at once, the likeliest cause first: a signal, then bad input."""
    if code is not None and code < 0:
        return 0
    return 1 if code == _BAD_INPUT_STATUS else 2


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    nproc: int,
    port: int,
    args: tuple[Any, ...],
    folder: str,
    backend: str,
    timeout_s: float,
) -> None:
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
        (Path(folder) / f"{rank}.pkl").write_bytes(pickle.dumps(value))
        barrier()
        leave_process_group()
    except BaseException as exc:  # noqa: BLE001 - any failure must end this rank non-zero
        if isinstance(exc, PipeswapError):
            (Path(folder) / f"{rank}.err").write_text(str(exc))
            print(f"rank {rank}: error: {exc}", file=sys.stderr)
        else:
            print(f"rank {rank}: failed:", file=sys.stderr)
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(_BAD_INPUT_STATUS if isinstance(exc, PipeswapError) else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called...").
    os._exit(0)
