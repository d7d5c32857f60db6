"""The ncd spec grammar (`ncd.lark`), shipped as package data."""

from importlib import resources


def grammar_text() -> str:
    return resources.files(__name__).joinpath("ncd.lark").read_text(encoding="utf-8")
