"""The argument parser of every ``pipeline-train`` command: mistakes end like every config
error, with exit code 2 and one line on stderr. Its own module so that the commands
(``pipeline.launch.cli``, ``pipeline.launch.evaluation``) share it without importing each other."""

from __future__ import annotations

import argparse
import sys
import typing


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes end like every config error: exit code 2 and one line on stderr
    (argparse prints its usage lines first; ``--help`` still shows them)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(attach_negative_values(argv), namespace)


def _is_negative_number(text: str) -> bool:
    if not text.startswith("-") or text.startswith("--"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def attach_negative_values(argv: list[str]) -> list[str]:
    """``--lr -1e-5`` as ``--lr=-1e-5``: argparse takes a token that starts with ``-`` and is not
    a plain integer or decimal (``-1e-5``, ``-inf``) for a flag ("expected one argument"), so a
    negative number right after a ``--flag`` is joined to it and reaches validation as its
    value. Short flags never look like numbers, so nothing else changes meaning."""
    out: list[str] = []
    for token in argv:
        prev = out[-1] if out else ""
        if (_is_negative_number(token) and prev.startswith("--") and prev != "--"
                and "=" not in prev):
            out[-1] = f"{prev}={token}"
        else:
            out.append(token)
    return out
