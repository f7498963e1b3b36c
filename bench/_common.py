"""Command-line shape shared by the benchmarks."""

import argparse


def bench_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="tiny_cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    return parser
