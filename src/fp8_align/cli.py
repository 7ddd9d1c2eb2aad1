"""The `fp8-align` command line."""

from __future__ import annotations

import argparse
import json
import sys

from fp8_align.doctor import build_report, format_report


def _doctor(args: argparse.Namespace) -> int:
    report = build_report()
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with one sub-command per job."""
    parser = argparse.ArgumentParser(prog="fp8-align", description="Aligned block-FP8 for RL of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report what this environment can run of the FP8 recipe")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fp8-align` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
