"""``openinfer`` console script: generate | serve | router | bench <kind> | env. Subcommands live in their own modules, each
exposing ``add_parser(subparsers)`` that registers its arguments and sets ``func``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

_SUBCOMMANDS = [
    "openinfer.entrypoints.generate_cli",
    "openinfer.server.cli",
    "openinfer.entrypoints.router_cli",
    "openinfer.bench.cli",
    "openinfer.entrypoints.env_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openinfer", description="openinfer: LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _SUBCOMMANDS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("openinfer"):
                continue  # subcommand not built in this tree
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    from openinfer.logging_utils import init_logging

    init_logging()
    logging.getLogger("openinfer").setLevel(args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    try:
        rc = args.func(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        from openinfer.executor.abstract import ExecutorFailed
        from openinfer.layers.kernel_build import KernelBuildError

        # start-up failures that already say what went wrong (the compiler's first error and the opt-out; a worker
        # rank that failed to start, with its error): one line, no traceback
        if not isinstance(e, (KernelBuildError, ExecutorFailed)):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(rc or 0)
