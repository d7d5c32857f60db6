"""The compiler's limits on spec inputs, in one place (docs/language.md, "Limits").

A spec beyond one of them gets a located error naming the limit instead of an internal error, a recursion
overflow or minutes of symbolic work. The values leave every shipped spec far inside them.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .source import Source

MAX_NESTING = 100
"""Levels of nesting of one statement's syntax tree (operators, calls, arguments): deeper specs overflow the
recursive passes (and Python's stack) long before they mean anything."""

MAX_INTEGER_DIGITS = 1000
"""Digits of an integer literal (Python refuses to convert integers of more than a few thousand digits)."""

MAX_EXPONENT = 1024
"""|n| of a power x^n: powers are unrolled into products."""

MAX_POWER_BITS = 1 << 16
"""Bits of a power of a number (2^65536 at most), which is computed exactly."""

MAX_AXIS_SIZE = 2**31 - 1
"""A fixed axis size (and a size override): kernels index with 32-bit integers."""

MAX_SUM_TERMS = 1024
"""Terms of a finite sum `sum(... for i in lo..hi)`, nested sums multiplied: sums are unrolled."""

SYMBOLIC_SECONDS = 30.0
"""Wall-clock seconds each compiler stage may spend on one spec: type-checking, deriving the kernel plan, generating
code (sympy's differentiation and simplification). The shipped specs take at most about 3 s a stage."""

QUOTE_WIDTH = 100
"""Characters of a source line an error message quotes: a window around the column for longer lines."""

MAX_MESSAGE_CHARS = 1000
"""Characters of an error message or hint (spec text quoted in it is shortened in the middle)."""


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut in the middle to at most `limit` characters."""
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[len(text) - keep:]}"


class BudgetExceeded(BaseException):
    """Raised inside the thread whose time budget ran out (a class: CPython raises it asynchronously). Not an
    `Exception`, so that no `except Exception` in the interrupted code swallows it."""


def _importing(frame: FrameType | None) -> bool:
    """Whether the thread is importing a module: an import interrupted half way leaves a broken module behind
    (torch refuses to register its operators twice), so the interruption waits until it is done."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


@contextmanager
def time_budget(seconds: float, on_timeout: Callable[[], Exception]) -> Iterator[None]:
    """Run the block for at most `seconds` of wall-clock time, then raise `on_timeout()` from it.

    Symbolic work (sympy) is pure Python, so a watchdog thread interrupts it between bytecodes (in any thread,
    unlike SIGALRM); code blocked in C stops at its next Python instruction, and an import is left to finish first.
    The watchdog raises again every 50 ms until the block has ended: library code with a bare `except:` may swallow
    one interruption."""
    lock = threading.Lock()
    done = threading.Event()
    state = {"active": True, "fired": False}
    target = threading.get_ident()

    def watch() -> None:
        if done.wait(seconds):
            return
        while True:
            with lock:
                if not state["active"]:
                    return
                if not _importing(sys._current_frames().get(target)):
                    state["fired"] = True
                    _raise_in(target, BudgetExceeded)
            if done.wait(0.05):
                return

    def stop() -> None:
        with lock:
            state["active"] = False
            done.set()
            if state["fired"]:
                _raise_in(target, None)  # a pending exception not yet delivered is withdrawn

    watchdog = threading.Thread(target=watch, name="ncd-time-budget", daemon=True)
    watchdog.start()
    timed_out = False
    try:
        yield
    except BudgetExceeded:
        timed_out = True
    finally:
        try:
            stop()
        except BudgetExceeded:  # delivered while stopping: nothing more is pending once stopped
            timed_out = True
            stop()
    if timed_out:  # raised with the watchdog stopped, so building the error cannot be interrupted
        raise on_timeout()


@contextmanager
def symbolic_budget(source: Source, stage: str) -> Iterator[None]:
    """A compiler stage run on one spec within SYMBOLIC_SECONDS, its errors leaving with the spec's text (for the
    quoted line and caret). Running out of time, or of Python's stack, is a located error at the spec's most
    deeply nested construct, the usual cause."""
    from .errors import LimitExceeded, NcdError, NestingTooDeep
    from .parser import deepest_span

    seconds = SYMBOLIC_SECONDS

    def over_budget() -> Exception:
        return LimitExceeded(deepest_span(source), detail=f"{stage} took longer than the {seconds:g} s the compiler "
                             "allows for one spec (its most deeply nested expression is here)",
                             hint="simplify or split that expression into named definitions (docs/language.md, "
                                  "\"Limits\")").with_source(source)

    try:
        with time_budget(seconds, over_budget):
            yield
    except RecursionError:
        raise NestingTooDeep(deepest_span(source), detail=f"{stage}: the spec nests expressions too deeply to "
                             "compile (its most deeply nested expression is here)").with_source(source) from None
    except NcdError as err:
        if err.source is None:
            err.with_source(source)
        raise
