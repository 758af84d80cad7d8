"""How the command-line tools end on a user's problem: one line naming it and the fix, no traceback.

A project error (``errors.SmartInfError``) or an operating-system error (a full disk, a missing file, a refused
permission) anywhere in the exception's cause chain is the user's problem: the tool prints
``TOOL: error: MESSAGE`` on stderr and exits 1. Anything else is a bug and keeps its traceback, as does every
error when ``HYDRA_FULL_ERROR=1`` is set (Hydra's own switch, so one variable serves the whole CLI).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_smartinf.errors import SmartInfError

VERBOSE = "HYDRA_FULL_ERROR"
EXIT_USER_ERROR = 1


def user_error(err: BaseException) -> BaseException | None:
    """The first project or OS error in ``err``'s chain of causes (``raise ... from``) and contexts, if any."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, (SmartInfError, OSError)):
            return link
        link = link.__cause__ or link.__context__
    return None


def one_line(err: BaseException) -> str:
    """The message on one line (``OSError(errno, msg)`` keeps ``msg``; a plain OS error keeps its file name)."""
    if isinstance(err, SmartInfError) and isinstance(err, OSError) and err.strerror:
        text = err.strerror
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


@contextmanager
def reporting(tool: str) -> Iterator[None]:
    """Run the tool's body; a user's problem ends it with one line on stderr and exit status 1."""
    try:
        yield
    except Exception as err:
        found = user_error(err)
        if found is None or os.environ.get(VERBOSE) == "1":
            raise
        print(f"{tool}: error: {one_line(found)} (the traceback: {VERBOSE}=1)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
