"""`nemo-dapo` command line (also `python -m nemo_dapo.cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import import_module

from nemo_dapo.config import DEFAULT_PRESET, list_presets, load_config, to_yaml
from nemo_dapo.errors import InputError, RemoteCallError, TrainingDiverged
from nemo_dapo.trainer.checkpoint import CheckpointWriteError
from nemo_dapo.trainer.preemption import Preempted

# Sub-commands that live in their own light modules, each exposing ``add_parser(subparsers)``
# (heavy imports stay inside their handlers so `nemo-dapo --help` stays fast).
PLUGIN_COMMANDS = (
    "nemo_dapo.commands.plan",
    "nemo_dapo.commands.ladder",
    "nemo_dapo.commands.plot",
    "nemo_dapo.commands.bringup",
    "nemo_dapo.commands.nemo_run_launcher",
)


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from nemo_dapo.commands.selfcheck import run_selfcheck

    return 0 if run_selfcheck() else 1


def _cmd_train(args: argparse.Namespace) -> int:
    from nemo_dapo.trainer.run import run_training

    summary = run_training(load_config(args.config, args.overrides))
    print(
        json.dumps(
            {k: summary[k] for k in ("initial_val_acc", "final_val_acc", "steps", "wall_s", "hf_export")}, indent=1
        )
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from nemo_dapo.commands.evaluate import evaluate

    metrics = evaluate(
        args.model,
        args.data,
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        max_prompt_length=args.max_prompt_length,
    )
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from nemo_dapo.trainer.export import base_model_of, export_hf

    tokenizer = args.tokenizer or base_model_of(args.checkpoint)
    print(export_hf(args.checkpoint, tokenizer, args.output, overwrite=args.overwrite))
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from nemo_dapo.model.gguf_import import import_gguf

    print(import_gguf(args.gguf_file, args.output, overwrite=args.overwrite))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from nemo_dapo.config.reference import explain, reference_markdown

    if args.explain:
        print(explain(args.explain))
    elif args.reference:
        print(reference_markdown(), end="")
    else:
        print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    print("\n".join(list_presets()))
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    from nemo_dapo.algo.metric_names import catalog_markdown

    print(catalog_markdown(), end="")
    return 0


OVERWRITE_HELP = "write into a non-empty folder, replacing the files written (other files are kept)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-dapo", description="DAPO reinforcement learning for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run DAPO training (default preset: the tiny CPU run)")
    train.add_argument("--config", default=DEFAULT_PRESET, help="preset name in conf/ or a YAML path")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    train.set_defaults(fn=_cmd_train)
    evaluate = sub.add_parser("eval", help="acc/mean@n and pass@k of a model on a verl-format dataset")
    evaluate.add_argument("--model", required=True, help="Hugging Face model folder")
    evaluate.add_argument("--data", required=True, nargs="+", help="parquet/jsonl files")
    evaluate.add_argument("--n", type=int, default=32, help="samples per distinct problem (repeated rows fold)")
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--top-p", type=float, default=0.7)
    evaluate.add_argument("--max-tokens", type=int, default=20480, help="response budget (capped by the model)")
    evaluate.add_argument("--max-prompt-length", type=int, default=2048)
    evaluate.set_defaults(fn=_cmd_eval)
    export = sub.add_parser("export", help="checkpoint -> Hugging Face folder (weights + tokenizer)")
    export.add_argument("checkpoint", help="a checkpoints/global_step_N folder")
    export.add_argument("output", help="folder to write")
    export.add_argument("--tokenizer", help="folder holding the tokenizer files (default: the base model's)")
    export.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    export.set_defaults(fn=_cmd_export)
    gguf = sub.add_parser("import-gguf", help="a local GGUF file (Llama / Qwen2 / Qwen3) -> Hugging Face folder")
    gguf.add_argument("gguf_file", help="the .gguf file (any quantization; weights are dequantized to fp32)")
    gguf.add_argument("output", help="folder to write (config, safetensors, tokenizer, provenance.json)")
    gguf.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    gguf.set_defaults(fn=_cmd_import_gguf)
    sub.add_parser("selfcheck", help="check the DAPO math against hand-computed values").set_defaults(fn=_cmd_selfcheck)
    config = sub.add_parser("config", help="print the resolved, validated config, or explain a setting")
    config.add_argument("--config", default=DEFAULT_PRESET, help="preset name in conf/ or a YAML path")
    config.add_argument(
        "--explain",
        metavar="KEY",
        help="help, type, default, allowed values and the presets setting KEY (e.g. actor.clip_ratio_high)",
    )
    config.add_argument(
        "--reference", action="store_true", help="every setting as markdown (the source of docs/configuration.md)"
    )
    config.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio_high=0.3")
    config.set_defaults(fn=_cmd_config)
    sub.add_parser("presets", help="list the presets in conf/").set_defaults(fn=_cmd_presets)
    sub.add_parser("metrics", help="every logged metric: how its parts combine and what it means").set_defaults(
        fn=_cmd_metrics
    )
    for module in PLUGIN_COMMANDS:
        import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except InputError as err:  # a config, data or model the user gave: the message, no traceback
        print(f"nemo-dapo: {err}", file=sys.stderr)
        return 2
    except CheckpointWriteError as err:  # nothing lost: the message says what is left to resume from
        print(f"nemo-dapo: {err}", file=sys.stderr)
        return 1
    except RemoteCallError as err:  # a worker died or hung: the checkpoints are whole, resume from them
        print(
            f"nemo-dapo: {err}\nnemo-dapo: the run stopped; its checkpoints are intact: run the same "
            "command again (checkpoint.resume=auto) to continue from the last one",
            file=sys.stderr,
        )
        return 1
    except TrainingDiverged as err:  # the last checkpoint predates the non-finite steps
        print(f"nemo-dapo: {err}", file=sys.stderr)
        return 1
    except Preempted as stop:  # a checkpoint was saved (if a step was trained): the batch script requeues
        print(f"nemo-dapo: {stop}", file=sys.stderr)
        return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
