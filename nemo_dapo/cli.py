"""`nemo-dapo` command line (also `python -m nemo_dapo.cli`)."""

from __future__ import annotations

import argparse
import sys

from nemo_dapo.config import DEFAULT_PRESET, ConfigError, list_presets, load_config, to_yaml


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from nemo_dapo.selfcheck import run_selfcheck

    return 0 if run_selfcheck() else 1


def _cmd_config(args: argparse.Namespace) -> int:
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    print("\n".join(list_presets()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-dapo", description="DAPO reinforcement learning for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="check the DAPO math against hand-computed values").set_defaults(fn=_cmd_selfcheck)
    config = sub.add_parser("config", help="print the resolved, validated config")
    config.add_argument("--config", default=DEFAULT_PRESET, help="preset name in conf/ or a YAML path")
    config.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio_high=0.3")
    config.set_defaults(fn=_cmd_config)
    sub.add_parser("presets", help="list the presets in conf/").set_defaults(fn=_cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"nemo-dapo: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
