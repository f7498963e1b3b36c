"""The two trainers side by side on one preset: sync and stream.

    .venv/bin/python bench/trainer_modes.py [--config tiny_cpu] [--steps 30] [--seeds 1]
        [--modes sync,stream] [key=value ...]

Every mode trains the same number of samples (``--steps`` x ``train_batch_size`` x ``n``); the
first 3 steps are dropped from the timings as warm-up. Per mode, over the seeds: seconds per step,
ms per trained sample, trained response tokens per second of wall time, the engines' busy
fraction (stream: the time they spent stepping; sync: not measured by the engines, given as
generation's share of the step), the stream's starved fraction (its engines
held no sample) and its busy share of the time they had samples, the response length, and
held-out accuracy at the end. Writes ``outputs/bench_trainer_modes/result.json``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _common import bench_parser, fresh_folder

from nemo_dapo.config import load_config
from nemo_dapo.trainer.run import run_training
from nemo_dapo.trainer.validation import mean_val_accuracy


def measure(config: str, mode: str, steps: int, seed: int, overrides: list[str], root: Path) -> dict:
    output = root / f"{mode}_seed{seed}"
    fresh_folder(output)
    cfg = load_config(
        config,
        [
            f"trainer.mode={mode}",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            f"trainer.save_freq={steps}",
            f"trainer.seed={seed}",
            f"data.seed={seed}",
            "checkpoint.resume=disable",
            f"trainer.output_dir={output}",
            *overrides,
        ],
    )
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "perf/time_per_step" in r][3:]
    step_s = statistics.mean(r["perf/time_per_step"] for r in timed)
    tokens = sum(r["response_length/mean"] * cfg.data.train_batch_size * cfg.rollout.n for r in timed)
    busy = [r.get("stream/engine_busy", r["timing_s/gen"] / r["perf/time_per_step"]) for r in timed]
    starved = statistics.mean(r["stream/engine_starved"] for r in timed) if mode == "stream" else None
    return {
        "step_s": step_s,
        "ms_per_trained_sample": 1000 * step_s / (cfg.data.train_batch_size * cfg.rollout.n),
        "trained_tokens_per_s": tokens / sum(r["perf/time_per_step"] for r in timed),
        "engine_busy": statistics.mean(busy),
        "engine_starved": starved,
        "engine_busy_fed": statistics.mean(busy) / (1 - starved) if starved is not None and starved < 1 else None,
        "response_length": statistics.mean(r["response_length/mean"] for r in timed),
        "generated_samples": rows[-1].get("rollout/generated_samples"),
        "final_val_acc": mean_val_accuracy(rows[-1]),
        "initial_val_acc": summary["initial_val_acc"],
    }


def mean(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if r[key] is not None]
    if not values:
        return "-"
    spread = f" +- {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread}"


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--modes", default="sync,stream")
    args = parser.parse_args()
    root = Path("outputs/bench_trainer_modes")
    modes = args.modes.split(",")
    result = {
        mode: [measure(args.config, mode, args.steps, seed, args.overrides, root) for seed in range(1, args.seeds + 1)]
        for mode in modes
    }
    (root / "result.json").write_text(json.dumps({"config": args.config, "steps": args.steps, **result}, indent=1))
    columns = {
        "s/step": "step_s",
        "ms per trained sample": "ms_per_trained_sample",
        "trained tokens/s": "trained_tokens_per_s",
        "response length": "response_length",
        "engine busy": "engine_busy",
        "engine starved": "engine_starved",
        "busy while fed": "engine_busy_fed",
        "held-out acc (end)": "final_val_acc",
    }
    print("| mode | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for mode in modes:
        print(f"| {mode} | " + " | ".join(mean(result[mode], key) for key in columns.values()) + " |")


if __name__ == "__main__":
    main()
