"""Where the user's code is: frames outside torch and ampdoctor, named ``file:line``."""

from __future__ import annotations

import os
import sys
from types import FrameType, TracebackType

import torch

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # src/ampdoctor/
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_LIBRARY_DIRS = (TORCH_DIR, PACKAGE_DIR)


def is_user_file(filename: str) -> bool:
    """Return whether ``filename`` belongs to neither torch nor ampdoctor.

    >>> is_user_file(__file__), is_user_file("train.py")
    (False, True)
    """
    return not os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def is_own_file(filename: str) -> bool:
    """Return whether ``filename`` is one of ampdoctor's own modules."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR)


def site(frame: FrameType) -> str:
    """Return ``file:line`` of ``frame``."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def user_call_site(depth: int = 2, hops: int = 12) -> str:
    """Return ``file:line`` of the nearest caller outside torch and ampdoctor, looking at most ``hops`` frames up.

    >>> user_call_site(depth=1).endswith(">") or ":" in user_call_site(depth=1)
    True
    """
    frame: FrameType | None = sys._getframe(depth)
    for _ in range(hops):
        if frame is None:
            break
        if is_user_file(frame.f_code.co_filename):
            return site(frame)
        frame = frame.f_back
    return "<unknown>"


def without_own_frames(tb: TracebackType | None, path: str) -> TracebackType | None:
    """Drop runpy's and ampdoctor's own frames, so the traceback reads as `python script.py` prints it."""
    target = os.path.abspath(path)
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    start = next((i for i, t in enumerate(frames) if os.path.abspath(t.tb_frame.f_code.co_filename) == target), 0)
    kept = [t for t in frames[start:] if not is_own_file(t.tb_frame.f_code.co_filename)] or frames
    rebuilt = None
    for t in reversed(kept):
        rebuilt = TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt
