"""Whether a checkpoint on disk can load, read as cheaply as the launcher can afford.

``--snapshot-resume-from`` is an explicit choice: the launcher checks the checkpoints it
names before any worker starts (``resume_problem``), so that a damaged one is one line that
names it, not a traceback from every rank. What is checked without reading the tensors: the
DCP ``.metadata`` loads, names a snapshot (``meta/0``), and every byte range it lists lies
in a file that exists. Damage inside a data file (same size, other bytes) only the workers'
load finds. Imports torch (``torch.distributed.checkpoint``) when called.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

__all__ = ["checkpoint_problem"]


def checkpoint_problem(path: Path) -> str:
    """What is wrong with the DCP checkpoint at ``path`` (one line), or ``""``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # a damaged .metadata raises whatever unpickling raises
        return f"its .metadata does not load: {_describe(exc)}"
    if "meta/0" not in metadata.state_dict_metadata:
        return "not a rallypoint.snapshot checkpoint (its .metadata holds no meta/0)"
    needed: dict[str, int] = {}  # each data file: the end of the last range it holds
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(end, needed.get(name, 0))
    for name, end in sorted(needed.items()):
        try:
            size = os.path.getsize(path / name)
        except OSError as exc:
            return f"its data file {name} cannot be read ({exc.strerror or exc})"
        if size < end:
            return f"its data file {name} is truncated ({size} bytes; its .metadata lists {end})"
    return _metas_problem(path, [k for k in metadata.state_dict_metadata if k.startswith("meta/")])


def _metas_problem(path: Path, keys: list[str]) -> str:
    """What is wrong with the ranks' skeletons (``meta/<rank>``: small, what each rank
    reads first), or ``""``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from rallypoint._snapshot._layout import decode_meta

    head: dict[str, object] = dict.fromkeys(keys, b"")
    try:
        with warnings.catch_warnings():  # DCP warns on every no_dist load: our choice
            warnings.simplefilter("ignore")
            load(head, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as exc:  # not an Exception
        return f"its {', '.join(keys)} do not load: {_describe(exc)}"
    for key in keys:
        try:
            decode_meta(head[key])
        except Exception as exc:
            return f"its {key} does not load: {_describe(exc)}"
    return ""


def _describe(exc: BaseException) -> str:
    """What failed, in one line (DCP wraps each rank's exception with its traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
