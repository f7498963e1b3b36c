"""The DAPO paper's ablation stack (its Table 1) on one preset: naive GRPO, then each technique
added in the paper's order up to DAPO, plus DAPO with the GSPO and CISPO losses.

    .venv/bin/python bench/ablation.py [--config tiny_cpu] [--seeds 3] [--budget 12288] [--rows 0,5] [key=value ...]

Every row gets the same budget of generated samples (``trainer.total_generated_samples``), not
of steps: dynamic sampling generates more samples per step than the rows without it. Per row,
over the seeds: held-out accuracy at the end (mean +- std), entropy of the last step, generated
samples and wall time; writes ``outputs/bench_ablation/ablation.json`` and ``ablation.png`` (held-out
accuracy against generated samples, mean over seeds).

Soft overlong punishment *replaces* overlong filtering in the stack, as in the paper, whose
final DAPO does not filter: a truncated sample is punished, not hidden.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from _common import bench_parser, fresh_folder

from nemo_dapo.config import load_config
from nemo_dapo.trainer.run import run_training
from nemo_dapo.trainer.validation import mean_val_accuracy

NAIVE = {
    "actor.clip_ratio_high": 0.2,
    "actor.loss_agg_mode": "seq-mean-token-mean",
    "algorithm.overlong_filtering": False,
    "reward.overlong_buffer.enable": False,
    "algorithm.filter_groups.enable": False,
}
STEPS = [
    ("+ overlong filtering", {"algorithm.overlong_filtering": True}),
    ("+ clip-higher", {"actor.clip_ratio_high": 0.28}),
    ("+ soft overlong punishment", {"algorithm.overlong_filtering": False, "reward.overlong_buffer.enable": True}),
    ("+ token-level loss", {"actor.loss_agg_mode": "token-mean"}),
    ("+ dynamic sampling (DAPO)", {"algorithm.filter_groups.enable": True}),
]
LOSS_ROWS = [
    (
        "DAPO + gspo",
        {
            "actor.policy_loss": "gspo",
            "actor.loss_agg_mode": "seq-mean-token-mean",
            "actor.clip_ratio_low": 3e-4,
            "actor.clip_ratio_high": 4e-4,
        },
    ),
    ("DAPO + cispo", {"actor.policy_loss": "cispo"}),
]
PAPER_AIME = {
    "naive GRPO": 30,
    "+ overlong filtering": 36,
    "+ clip-higher": 38,
    "+ soft overlong punishment": 41,
    "+ token-level loss": 42,
    "+ dynamic sampling (DAPO)": 50,
}  # Qwen2.5-32B, AIME 2024 avg@32


def rows() -> list[tuple[str, dict]]:
    """(name, overrides) in the paper's order: each row adds one technique to the previous."""
    stack, current = [("naive GRPO", dict(NAIVE))], dict(NAIVE)
    for name, change in STEPS:
        current = {**current, **change}
        stack.append((name, current))
    return stack + [(name, {**current, **change}) for name, change in LOSS_ROWS]


def run_row(config: str, settings: dict, seed: int, budget: int, output: Path, extra: list[str]) -> dict:
    overrides = [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in settings.items()]
    overrides += [
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"trainer.total_generated_samples={budget}",
        "trainer.total_training_steps=100000",
        "trainer.save_freq=0",
        "checkpoint.resume=disable",
        f"trainer.output_dir={output}",
        *extra,
    ]
    fresh_folder(output)
    started = time.time()
    summary = run_training(load_config(config, overrides))
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    curve = [
        (r["rollout/generated_samples"], mean_val_accuracy(r))
        for r in records
        if mean_val_accuracy(r) is not None and "rollout/generated_samples" in r
    ]
    steps = [r for r in records if "actor/entropy" in r]
    return {
        "final_val_acc": summary["final_val_acc"],
        "initial_val_acc": summary["initial_val_acc"],
        "entropy_end": steps[-1]["actor/entropy"],
        "generated_samples": summary["generated_samples"],
        "steps": summary["steps"],
        "wall_s": time.time() - started,
        "curve": [(0.0, summary["initial_val_acc"]), *curve],
    }


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| row | held-out acc (end) | entropy (end) | generated samples | steps | wall s/run | paper AIME |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        lines.append(
            f"| {name} | {mean_std([r['final_val_acc'] for r in runs])} | "
            f"{mean_std([r['entropy_end'] for r in runs])} | "
            f"{statistics.mean(r['generated_samples'] for r in runs):.0f} | "
            f"{statistics.mean(r['steps'] for r in runs):.1f} | "
            f"{statistics.mean(r['wall_s'] for r in runs):.0f} | "
            f"{PAPER_AIME.get(name, '-')} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for name, runs in results.items():
        points = min(len(r["curve"]) for r in runs)
        xs = [statistics.mean(r["curve"][i][0] for r in runs) for i in range(points)]
        ys = [statistics.mean(r["curve"][i][1] for r in runs) for i in range(points)]
        axis.plot(xs, ys, marker="o", label=name)
    axis.set_xlabel("generated samples")
    axis.set_ylabel("held-out accuracy (mean over seeds)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=12288, help="generated samples per run")
    parser.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
    args = parser.parse_args()
    root = Path("outputs/bench_ablation")
    indices = range(len(rows())) if args.rows is None else [int(i) for i in args.rows.split(",")]
    results: dict[str, list[dict]] = {}
    for index in indices:
        name, settings = rows()[index]
        results[name] = [
            run_row(args.config, settings, seed, args.budget, root / f"row{index}_seed{seed}", args.overrides)
            for seed in range(1, args.seeds + 1)
        ]
        print(f"{name}: {mean_std([r['final_val_acc'] for r in results[name]])}", flush=True)
        # after every row, so a long sweep that stops early keeps what it measured
        (root / "ablation.json").write_text(
            json.dumps(
                {"config": args.config, "budget": args.budget, "seeds": args.seeds, "results": results}, indent=1
            )
        )
    plot(results, root / "ablation.png")
    print(table(results))


if __name__ == "__main__":
    main()
