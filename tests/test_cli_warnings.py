"""The command line reports the warnings a command raised once, after it ran (it once re-recorded each warning
while reporting it, looping until memory ran out)."""

from __future__ import annotations

import warnings

import ncd.cli as cli


def test_a_warning_raised_by_a_command_is_shown_once_and_the_command_returns(monkeypatch, recwarn):
    def run(args) -> int:
        warnings.warn("a warning from the command", RuntimeWarning, stacklevel=1)
        return 0

    parser = cli.build_parser()
    real = parser.parse_args

    def parse(argv):
        args = real(argv)
        args.run = run
        return args

    monkeypatch.setattr(parser, "parse_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["check", "specs/softmax_attention.ncd"]) == 0
    # shown through warnings.showwarning, which pytest records here (recwarn)
    assert [str(w.message) for w in recwarn].count("a warning from the command") == 1
