"""The compiler's limits on spec inputs, in one place (docs/language.md, "Limits").

A spec beyond one of them gets a located error naming the limit instead of an internal error, a recursion
overflow or minutes of symbolic work. The values leave every shipped spec far inside them.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
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


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def _block_frame(frame: FrameType) -> FrameType:
    """The frame whose code holds the block: a generator-based context manager (contextlib's) enters us from its
    own frame, which is off the stack while the block runs, so frames of generators and of contextlib are
    passed over."""
    while frame.f_back is not None and (frame.f_code.co_flags & inspect.CO_GENERATOR
                                        or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    return frame


class time_budget:  # lower case: used as a context manager, like contextlib's
    """Run the block for at most `seconds` of wall-clock time, then raise `on_timeout()` from it.

    Symbolic work (sympy) is pure Python, so a watchdog thread interrupts it between bytecodes (in any thread,
    unlike SIGALRM); code blocked in C stops at its next Python instruction, and an import is left to finish first.
    The watchdog raises again every 50 ms while the block runs: library code with a bare `except:` may swallow one
    interruption. It stops when the block ends, or when the frame that entered the block has left the thread's
    stack: an interruption that lands after the block's last instruction, on entering `__exit__`, escapes the
    `with` statement as a bare BudgetExceeded, and must not be followed by more. The watchdog holds off while the
    thread is in `__exit__`; a caller that must never see the bare exception calls `__exit__` again on it."""

    def __init__(self, seconds: float, on_timeout: Callable[[], Exception]) -> None:
        self.seconds, self.on_timeout = seconds, on_timeout
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.active = self.fired = False
        self.entered_in: FrameType | None = None

    def __enter__(self) -> None:
        self.target = threading.get_ident()
        self.entered_in = _block_frame(sys._getframe(1))
        self.active = True
        threading.Thread(target=self._watch, name="ncd-time-budget", daemon=True).start()

    def _watch(self) -> None:
        if self.done.wait(self.seconds):
            return
        while True:
            with self.lock:
                now = sys._current_frames().get(self.target)
                if not self.active or self.entered_in is None or not _on_stack(self.entered_in, now):
                    return
                if not _importing(now) and not self._leaving(now):
                    self.fired = True
                    _raise_in(self.target, BudgetExceeded)
            del now
            if self.done.wait(0.05):
                return

    @staticmethod
    def _leaving(frame: FrameType | None) -> bool:
        """Whether the thread is on its way out of the block (an interruption there would escape it)."""
        leaving = (time_budget.__exit__.__code__, time_budget._stop.__code__)
        return frame is not None and (frame.f_code in leaving or frame.f_code.co_filename == contextlib.__file__)

    def _stop(self) -> None:
        with self.lock:
            self.active = False
            self.entered_in = None
            self.done.set()
            if self.fired:
                _raise_in(self.target, None)  # a pending exception not yet delivered is withdrawn

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        timed_out = kind is not None and issubclass(kind, BudgetExceeded)
        while True:
            try:
                self._stop()
                break
            except BudgetExceeded:  # delivered while stopping: nothing more is pending once stopped
                timed_out = True
        if timed_out:  # raised with the watchdog stopped, so building the error cannot be interrupted
            raise self.on_timeout() from None


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

    budget = time_budget(seconds, over_budget)
    try:
        with budget:
            yield
    except BudgetExceeded:  # landed on entering budget.__exit__: stop the watchdog, raise the located error
        budget.__exit__(BudgetExceeded, None, None)
    except RecursionError:
        raise NestingTooDeep(deepest_span(source), detail=f"{stage}: the spec nests expressions too deeply to "
                             "compile (its most deeply nested expression is here)").with_source(source) from None
    except NcdError as err:
        if err.source is None:
            err.with_source(source)
        raise
