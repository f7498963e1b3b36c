"""Where does a training step's time go? Per-stage seconds, generation share, weight-sync time,
tokens/s and peak memory of the tiny preset (or any preset) on this machine, side by side with
the same loop in a single process.

    .venv/bin/python bench/step_breakdown.py [--config tiny_cpu] [--steps 30] [--no-baseline]
        [--seeds 1,2,3] [key=value ...]

Runs the real trainer for ``--steps`` steps (first 3 dropped as warm-up), samples the memory
of the whole process tree (driver, Ray, vLLM, policy workers) every 2 s, then the baseline of
:mod:`_single_process` (HF ``generate`` + the same trainer, loss and optimizer in one process)
on the same config; prints both and their ratio and writes ``step_breakdown.json``. Memory is
the proportional set size summed over the tree: resident sizes would count pages the processes
share (Ray's object store, the mapped model files) once per process. ``--seeds`` runs both sides
once per seed and reports the ratio of mean step times.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil
from _common import bench_parser, fresh_folder

from nemo_dapo.config import load_config
from nemo_dapo.trainer.run import run_training

# reading a process's proportional set size walks its page tables: every 0.2 s over the ~10
# processes of a real-model run that took most of a core from the 2 the run computes on
SAMPLE_EVERY_S = 2.0
STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync_weights")


class TreeMemory(threading.Thread):
    """Peak resident memory of this process and all its descendants."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_bytes = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._stop_event.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            time.sleep(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._stop_event.set()


def summarise(metrics_file: Path, skip: int) -> dict:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [r for r in rows if "perf/time_per_step" in r][skip:]
    per_stage = {s: statistics.mean(r.get(f"timing_s/{s}", 0.0) for r in steps) for s in STAGES}
    step_s = statistics.mean(r["perf/time_per_step"] for r in steps)
    tokens = statistics.mean(r["perf/total_num_tokens"] for r in steps)
    response_tokens = statistics.mean(r["response_length/mean"] for r in steps)
    return {
        "steps_measured": len(steps),
        "step_s": step_s,
        "stage_s": per_stage,
        "gen_share": per_stage["gen"] / step_s,
        "weight_sync_s": per_stage["sync_weights"],
        "tokens_per_s": tokens / step_s,
        "tokens_per_step": tokens,
        "response_length_mean": response_tokens,
        "gen_rounds_per_step": statistics.mean(r.get("dapo/num_gen_batches", 1.0) for r in steps),
        # the update's cost per trained token: comparable between runs whose samples differ in length
        "update_s_per_1k_tokens": 1000 * per_stage["update_actor"] / tokens,
    }


def measured_run(side: str, config: str, output: Path, steps: int, extra: list[str]) -> dict:
    """One side (``ours`` or ``single_process``) for ``steps`` steps into ``output``, in a fresh
    process: a run in this one would inherit the memory and threads a previous run left behind
    (a run after a single-process run read 4-5 GiB more at its peak)."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_measured_here, side, config, output, steps, extra).result()


def _measured_here(side: str, config: str, output: Path, steps: int, extra: list[str]) -> dict:
    if side == "ours":
        run = run_training
    else:
        from _single_process import run_single_process as run
    overrides = [
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.save_freq={steps}",
        "checkpoint.resume=disable",
        f"trainer.output_dir={output}",
        *extra,
    ]
    fresh_folder(output)
    memory = TreeMemory()
    memory.start()
    started = time.time()
    run(load_config(config, overrides))
    memory.stop()
    report = summarise(output / "metrics.jsonl", skip=3)
    # the run's final checkpoint and weights: 2 GB on smollm2_cpu, 8 of them in a 4-seed sitting
    for written in ("checkpoints", "hf_export"):
        shutil.rmtree(output / written, ignore_errors=True)
    report.update({"wall_s": time.time() - started, "peak_memory_gib": memory.peak_bytes / 2**30})
    return report


def print_report(name: str, report: dict) -> None:
    print(
        f"{name}: step {report['step_s']:.3f} s over {report['steps_measured']} steps "
        f"({report['gen_rounds_per_step']:.2f} generation rounds/step, {report['tokens_per_step']:.0f} tokens/step)"
    )
    for stage, seconds in report["stage_s"].items():
        print(f"  {stage:<13} {seconds:7.3f} s  {100 * seconds / report['step_s']:5.1f} %")
    print(
        f"  generation share {100 * report['gen_share']:.1f} %, weight sync {1000 * report['weight_sync_s']:.1f} ms, "
        f"{report['tokens_per_s']:.0f} tokens/s, peak memory (all processes) {report['peak_memory_gib']:.2f} GiB, "
        f"update {report['update_s_per_1k_tokens']:.2f} s per 1000 trained tokens"
    )


def side_by_side(config: str, output: Path, steps: int, extra: list[str], baseline: bool) -> dict:
    """Our run and, unless ``baseline`` is false, the single-process loop on the same config."""
    report = {"ours": measured_run("ours", config, output, steps, extra)}
    print_report("nemo-dapo (Ray + vLLM)", report["ours"])
    if baseline:
        report["single_process"] = measured_run("single_process", config, output / "single_process", steps, extra)
        print_report("single process (HF generate, same loop)", report["single_process"])
        report["step_ratio"] = report["ours"]["step_s"] / report["single_process"]["step_s"]
        print(f"our step / single-process step = {report['step_ratio']:.2f}")
    return report


def over_seeds(runs: dict[int, dict]) -> dict:
    """The ratio of mean step times over seeds. Each side samples its own trajectory (a rambling
    sample costs HF ``generate`` the whole batch's decoding), so one seed's ratio moves with it."""
    ours = statistics.mean(r["ours"]["step_s"] for r in runs.values())
    single = statistics.mean(r["single_process"]["step_s"] for r in runs.values())
    return {"ours_step_s_mean": ours, "single_process_step_s_mean": single, "step_ratio_of_means": ours / single}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--no-baseline", action="store_true", help="skip the single-process loop")
    parser.add_argument("--seeds", default="", help="comma-separated trainer.seed values, each run on both sides")
    args = parser.parse_args()
    output = Path("outputs/bench_step_breakdown")
    report = {"config": args.config, "overrides": args.overrides}
    if not args.seeds:
        report.update(side_by_side(args.config, output, args.steps, args.overrides, not args.no_baseline))
    else:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        runs = {}
        for seed in seeds:
            print(f"--- trainer.seed={seed}")
            extra = [*args.overrides, f"trainer.seed={seed}"]
            runs[seed] = side_by_side(args.config, output / f"seed_{seed}", args.steps, extra, not args.no_baseline)
        report["seeds"] = runs
        if not args.no_baseline:
            report.update(over_seeds(runs))
            print(f"over seeds {seeds}: our step / single-process step = {report['step_ratio_of_means']:.2f}")
    output.mkdir(parents=True, exist_ok=True)
    (output / "step_breakdown.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
