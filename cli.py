"""The `ncd` command line from a checkout (`python cli.py ...`); the installed `ncd` command runs ncd/cli.py."""

from ncd.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
