"""torch.distributed.checkpoint (DCP): asynchronous saves, their errors, checkpoint metadata.

Wraps ``dcp.async_save``, ``CheckpointException`` and ``FileSystemReader``'s metadata (its private
``_StorageInfo`` records). What differs between torch 2.11 and 2.15 is told apart with
``getattr``: ``async_save`` returns a Future, or an ``AsyncSaveResponse`` when the stager stages
in the background.
"""

from __future__ import annotations


def dcp_file_extents(path) -> dict[str, int]:
    """``{file name: bytes DCP wrote into it}`` of a DCP checkpoint directory, from its metadata.

    ``Metadata.storage_data`` maps every saved item to a private ``_StorageInfo`` (file, offset,
    length); read through ``getattr`` here so that a change of that class is fixed in one place.
    """
    from torch.distributed.checkpoint import FileSystemReader

    needed: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    return needed


def async_save(state: dict, writer, group):
    """Start DCP's asynchronous save of ``state`` on ``group`` (gloo: its collectives run in a
    background thread, so not on the training group); the future of the write.

    The state is staged (copied to host memory) before this returns, so training may change it.
    torch 2.11-2.15 return a Future, or an ``AsyncSaveResponse`` (staging and upload futures)
    when the stager stages in the background.
    """
    import torch.distributed.checkpoint as dcp

    response = dcp.async_save(state, storage_writer=writer, process_group=group)
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()
    return getattr(response, "upload_completion", response)


def checkpoint_error_types() -> tuple[type[BaseException], ...]:
    """What a failed DCP save raises: ``CheckpointException`` (a BaseException) or OSError."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (CheckpointException, OSError)


def checkpoint_failure(err: BaseException) -> str:
    """One line for a failed DCP save: the first rank's error (``CheckpointException.failures``
    maps rank -> (exception, traceback))."""
    failures = getattr(err, "failures", None)
    if failures:
        rank = min(failures)
        exc = failures[rank][0]
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(err).__name__}: {err}"
