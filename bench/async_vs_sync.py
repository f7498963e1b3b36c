"""Wall time per trained sample, synchronous vs asynchronous trainer, on the same preset.

    .venv/bin/python bench/async_vs_sync.py [--config tiny_cpu] [--steps 30] [key=value ...]

Each mode runs ``--steps`` steps (first 3 dropped as warm-up); trained samples per step are
``train_batch_size * n``. Writes ``outputs/bench_async_vs_sync/result.json``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _common import bench_parser, fresh_folder

from nemo_dapo.config import load_config
from nemo_dapo.trainer.assembly import run_training


def measure(config: str, mode: str, steps: int, overrides: list[str], root: Path) -> dict:
    output = root / mode
    fresh_folder(output)
    cfg = load_config(
        config,
        [
            f"trainer.mode={mode}",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            f"trainer.save_freq={steps}",
            "checkpoint.resume=disable",
            f"trainer.output_dir={output}",
            *overrides,
        ],
    )
    run_training(cfg)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["perf/time_per_step"] for r in rows if "perf/time_per_step" in r][3:]
    samples = cfg.data.train_batch_size * cfg.rollout.n * cfg.trainer.parameter_sync_step
    gen_s = [r["timing_s/gen"] for r in rows if "timing_s/gen" in r][3:]
    return {
        "step_s": statistics.mean(step_s),
        "gen_s_on_critical_path": statistics.mean(gen_s),
        "ms_per_trained_sample": 1000 * statistics.mean(step_s) / samples,
    }


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    root = Path("outputs/bench_async_vs_sync")
    result = {mode: measure(args.config, mode, args.steps, args.overrides, root) for mode in ("sync", "async")}
    result["speedup"] = result["sync"]["step_s"] / result["async"]["step_s"]
    (root / "result.json").write_text(json.dumps(result, indent=1))
    for mode in ("sync", "async"):
        r = result[mode]
        print(
            f"{mode:>5}: {r['step_s']:.3f} s/step, {r['ms_per_trained_sample']:.2f} ms per trained sample, "
            f"generation on the critical path {r['gen_s_on_critical_path']:.3f} s/step"
        )
    print(f"async speed-up: {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
