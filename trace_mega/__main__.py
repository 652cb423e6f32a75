"""`python -m trace_mega ...` (and `torchrun ... -m trace_mega ...`): the `trace-mega` command."""

from trace_mega.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
