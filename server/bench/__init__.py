"""`pagedserve bench`: offline throughput and an HTTP load client. Imported only by that subcommand."""
from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from server.bench import serve, throughput
    parser = argparse.ArgumentParser(prog="pagedserve bench",
                                     description="Benchmarks: offline throughput, or a client against a server.")
    kinds = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module in (("throughput", throughput), ("serve", serve)):
        sub = kinds.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(sub)
        sub.set_defaults(func=module.main)
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
