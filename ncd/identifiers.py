"""Names from a spec become Python and Triton identifiers in generated code, so each one is checked against a
strict pattern and against every name the generated module could shadow. Spec text reaches generated code
only as checked identifiers and numbers parsed from the AST."""

from __future__ import annotations

import builtins
import keyword
import re

from .ast import Ident
from .errors import InvalidIdentifier

_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# Module-level names of generated code: shadowing any of them would change what the code means.
_GENERATED = {"torch", "triton", "tl", "math", "ncd", "self", "cls", "ctx", "grad", "prev",
              # the generated op module's imports and globals (the spec's name becomes a function there)
              "os", "sys", "Optional", "Tuple", "forward", "backward", "attention", "Attention", "Module",
              "NAME", "ONLINE_MAX", "CAUSAL", "HAS_WEIGHT", "POISON_OUTPUTS", "DETERMINISTIC_BWD", "DS_BUFFER_BYTES",
              "DS_BULK_STORE", "USE_TMA",
              "EXP2_MAPS"}
# Keywords of the spec language itself, reserved everywhere so a name never reads as a statement.
SPEC_KEYWORDS = {"spec", "axis", "const", "in", "param", "out", "basis", "over", "for", "and", "or", "not"}


def identifier_problem(name: str) -> str | None:
    if not _PATTERN.fullmatch(name):
        return "names are 1-64 ASCII letters, digits or '_' and start with a letter"
    if "__" in name:
        return "double underscores are reserved"
    if name in SPEC_KEYWORDS:
        return "it is a keyword of the spec language"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "it is a Python keyword"
    if name in dir(builtins):
        return "it is a Python builtin"
    if name in _GENERATED:
        return "generated code uses this name"
    return None


def check_identifier(ident: Ident) -> None:
    reason = identifier_problem(ident.name)
    if reason is not None:
        raise InvalidIdentifier(ident.span, name=ident.name, reason=reason)
