"""Errors the ranks of a job agree on, instead of one rank failing while the others wait in the next collective.

A block that may fail on some ranks only (a write to a full disk, a file only rank 0 reads) runs under
:func:`together`: afterwards every rank learns whether any rank failed, and if one did every rank raises. Ranks whose
block raised a ``ValueError`` or an ``OSError`` (the user's mistakes and the machine's) raise a :class:`JobError` with
the first failing rank's message; a rank whose block raised anything else (a bug) re-raises it as it is, with its
traceback. A :class:`JobError` is raised alike on every rank, so the CLI prints it on rank 0 only.

Without a process group (one process) the block runs as it is and its exception passes unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["JobError", "agree", "together", "job_rank"]


class JobError(ValueError):
    """An error every rank of the job raises alike (``shared``: the CLI reports it once, on rank 0)."""

    shared = True


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def job_rank() -> int:
    """This process's rank in the job (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and not isinstance(err, ValueError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    if isinstance(err, (ValueError, OSError)):
        return str(err)
    return f"{type(err).__name__}: {err}"


def agree(err: BaseException | None) -> None:
    """A collective of the whole job: every rank passes the exception its block raised (None if it raised none);
    if any rank's block failed, every rank raises (see the module doc). One process: re-raises ``err``."""
    if not _active():
        if err is not None:
            raise err
        return
    msgs: list = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if err is None else _message(err))
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if not failed:
        return
    if err is not None and not isinstance(err, (ValueError, OSError)):
        raise err
    r, m = failed[0]
    raise JobError(m if r == 0 else f"rank {r}: {m}") from err


@contextmanager
def together(main_only: bool = False, *, collective: bool = True):
    """Run the block, then :func:`agree` (see the module doc). ``main_only``: the block is rank 0's; the context
    value tells each rank whether to run it (``with together(main_only=True) as mine: if mine: ...``).
    ``collective=False``: a block this process runs on its own (no agreement; the context value is True)."""
    mine = job_rank() == 0 or not main_only or not collective
    if not collective or not _active():
        yield mine
        return
    err: BaseException | None = None
    try:
        yield mine
    except Exception as e:  # noqa: BLE001 - every failure must reach the agreement
        err = e
    agree(err)
