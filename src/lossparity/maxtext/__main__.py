"""``python -m lossparity.maxtext <MaxText arguments> [--lp-mode M] [--lp-mtp-convention C]``.

Strips the ``--lp-*`` options, installs the objective into MaxText's train module and runs MaxText's own
``train`` main with the remaining arguments. Without ``--lp-mode`` the mode is ``per_sample``, or what
the config's ``calculate_per_token_loss`` says in a MaxText release that has that field. A refusal or a
bad ``--lp-*`` option is one line on stderr and exit status 2, before any step.
"""

from __future__ import annotations

import sys

from . import MaxTextRefusal, install, split_argv


def main(argv: list[str] | None = None) -> int:
    """Run MaxText's train main under lossparity; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rest, opts = split_argv(args)
    except ValueError as err:
        print(f"lossparity.maxtext: {err}", file=sys.stderr)
        return 2
    try:
        from absl import app  # noqa: PLC0415 (MaxText and absl are optional)
        from maxtext.trainers.pre_train import train  # noqa: PLC0415
    except ImportError as err:
        print(f"lossparity.maxtext: MaxText is not importable ({err}); install maxtext first", file=sys.stderr)
        return 2
    mode = opts.get("mode")
    handle = install(mode, mtp_convention=opts.get("mtp-convention", "own")) if mode != "per_token" else None
    if handle is not None:
        print(f"lossparity.maxtext: objective {mode or 'per_sample (or the config calculate_per_token_loss)'}")
    else:
        print("lossparity.maxtext: objective per_token (MaxText unchanged)")

    def run(absl_argv: list[str]) -> None:
        try:
            train.main(absl_argv)
        except MaxTextRefusal as err:
            print(str(err), file=sys.stderr)
            sys.exit(2)

    try:
        app.run(run, argv=[sys.argv[0], *rest])
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    finally:
        if handle is not None:
            handle.uninstall()  # leave MaxText as found (a caller may run it again in this process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
