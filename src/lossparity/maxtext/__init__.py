"""lossparity inside the real MaxText trainer (docs/maxtext.md); imports neither torch nor, until
:func:`install` runs, MaxText.

- ``python -m lossparity.maxtext <MaxText's usual arguments> --lp-mode per_sample``: MaxText's own
  ``train`` main with the objective of the mode (the ``--lp-*`` arguments are lossparity's; MaxText's
  config refuses unknown keys, so they never reach it).
- :func:`install`: the same for a program (or a fork) that calls MaxText's ``train`` functions itself.
"""

from __future__ import annotations

from ._hook import MAXTEXT_MODES, MTP_CONVENTIONS, Installed, MaxTextRefusal, check_config, install

__all__ = ["MAXTEXT_MODES", "MTP_CONVENTIONS", "Installed", "MaxTextRefusal", "check_config", "install", "split_argv"]


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split a command line into MaxText's arguments and lossparity's ``--lp-NAME VALUE`` /
    ``--lp-NAME=VALUE`` options (``{"mode": ..., "mtp-convention": ...}``); raises ``ValueError`` naming
    an unknown option, a missing value or a value outside its choices."""
    choices = {"mode": MAXTEXT_MODES, "mtp-convention": MTP_CONVENTIONS}
    rest: list[str] = []
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--lp-"):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len("--lp-") :].partition("=")
        if name not in choices:
            raise ValueError(f"unknown option --lp-{name} (known: {', '.join('--lp-' + c for c in choices)})")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"--lp-{name} needs a value ({', '.join(choices[name])})")
            value = argv[i + 1]
            i += 1
        if value not in choices[name]:
            raise ValueError(f"--lp-{name}: expected one of {', '.join(choices[name])}, got {value!r}")
        opts[name] = value
        i += 1
    return rest, opts
