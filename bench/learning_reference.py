"""Does a preset learn without dynamic sampling, here and in the references? Seeds side by side.

    .venv/bin/python bench/learning_reference.py [--config smollm2_cpu] [--steps 10] [--seeds 1,2,3,4]
        [--systems nemo_dapo,single_process,trl] [--punishment off,on] [key=value ...]

Per system, overlong punishment setting and seed, one run of ``--steps`` steps with dynamic
sampling off (``data.gen_batch_size = data.train_batch_size``: every drawn group is trained on,
the "naive" side of the DAPO paper's ablation), each in a fresh process:

- ``nemo_dapo``: ``nemo-dapo train`` (Ray, vLLM, the torch policy worker);
- ``single_process``: the same trainer, loss and optimizer in one process, HF ``generate``
  instead of vLLM (:mod:`_single_process`);
- ``trl``: TRL's ``GRPOTrainer`` set to the same algorithm (``bench/_trl_reference.py``, run with
  ``.venv-trl/bin/python``, made by ``bench/trl_env.sh``; TRL is not a dependency of nemo-dapo).

Logged per step: training score, mean response length, grad norm, entropy, clip fraction; at the
end, held-out accuracy of the final weights measured the same way for every system
(``nemo_dapo.commands.evaluate``: the preset's held-out problems, mean@4 at temperature 1 by one vLLM
engine), and of the starting model. Writes ``outputs/bench_learning/results.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import fresh_folder

ROOT = Path("outputs/bench_learning")
REPO = Path(__file__).resolve().parents[1]
STEP_METRICS = {  # ours -> what the table calls it
    "critic/score/mean": "score",
    "response_length/mean": "length",
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "actor/pg_clipfrac": "clipfrac",
}


def overrides_for(
    config: str, config_overrides: list[str], steps: int, seed: int, punishment: str, output: Path
) -> list[str]:
    from nemo_dapo.config import load_config

    batch = load_config(config, config_overrides, placement=False).data.train_batch_size
    return [
        "algorithm.filter_groups.enable=false",
        f"data.gen_batch_size={batch}",
        f"reward.overlong_buffer.enable={'true' if punishment == 'on' else 'false'}",
        f"trainer.total_training_steps={steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        "checkpoint.resume=disable",
        f"trainer.output_dir={output}",
        *config_overrides,
    ]


def run_ours(config: str, overrides: list[str], system: str, output: Path) -> Path:
    """One run in this (fresh) process; returns the folder of its final HF weights."""
    from nemo_dapo.config import load_config

    cfg = load_config(config, overrides)
    if system == "nemo_dapo":
        from nemo_dapo.trainer.run import run_training

        run_training(cfg)
        return output / "hf_export"
    sys.path.insert(0, str(REPO / "bench"))
    from _single_process import run_single_process

    run_single_process(cfg, save_to=output / "final")
    return output / "final"


def run_trl(config: str, overrides: list[str], output: Path) -> Path:
    python = REPO / ".venv-trl" / "bin" / "python"
    if not python.exists():
        raise SystemExit("bench/learning_reference.py: run bench/trl_env.sh first (TRL lives in .venv-trl)")
    command = [str(python), str(REPO / "bench" / "_trl_reference.py"), "--config", config, *overrides]
    subprocess.run(command, check=True, cwd=REPO)
    return output / "final"


def step_rows(output: Path) -> list[dict]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [
        {name: row[key] for key, name in STEP_METRICS.items() if key in row}
        for row in rows
        if "critic/score/mean" in row
    ]


def held_out(model: Path, config: str) -> float:
    from nemo_dapo.algo.metric_names import EVAL_ACC
    from nemo_dapo.commands.evaluate import evaluate
    from nemo_dapo.config import load_config
    from nemo_dapo.trainer.assembly import resolve_paths

    cfg = resolve_paths(load_config(config, []))
    metrics = evaluate(
        str(model), cfg.data.val_files, n=4, temperature=1.0, top_p=1.0, max_tokens=cfg.data.max_response_length
    )
    return statistics.mean(v for k, v in metrics.items() if EVAL_ACC.pattern.match(k))


def one_run(config: str, system: str, punishment: str, seed: int, steps: int, extra: list[str]) -> dict:
    output = fresh_folder(ROOT / f"{system}_punish-{punishment}_seed{seed}").resolve()
    overrides = overrides_for(config, extra, steps, seed, punishment, output)
    final = run_trl(config, overrides, output) if system == "trl" else run_ours(config, overrides, system, output)
    return {
        "system": system,
        "punishment": punishment,
        "seed": seed,
        "steps": step_rows(output),
        "held_out_end": held_out(final, config),
    }


def in_fresh_process(*args) -> dict:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(one_run, *args).result()


def table(results: list[dict], start: float) -> str:
    lines = [
        f"held-out mean@4 of the starting model: {start:.3f}",
        "",
        "| system | punishment | held-out end (mean +- std) | per seed | score first->last 3 | length first->last 3 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict]] = {}
    for run in results:
        groups.setdefault((run["system"], run["punishment"]), []).append(run)
    for (system, punishment), runs in groups.items():
        ends = [r["held_out_end"] for r in runs]
        spread = statistics.stdev(ends) if len(ends) > 1 else 0.0

        def edge(key: str, r: dict) -> str:
            values = [s[key] for s in r["steps"] if key in s]
            return f"{statistics.mean(values[:3]):.2f}->{statistics.mean(values[-3:]):.2f}"

        lines.append(
            f"| {system} | {punishment} | {statistics.mean(ends):.3f} +- {spread:.3f} | "
            f"{', '.join(f'{e:.3f}' for e in ends)} | {'; '.join(edge('score', r) for r in runs)} | "
            f"{'; '.join(edge('length', r) for r in runs)} |"
        )
    return "\n".join(lines)


def per_step_table(results: list[dict]) -> str:
    """Each system's per-step means over its seeds, at equal steps: score, length, entropy, grad
    norm, clip fraction (TRL logs one row per generation step, the same steps as ours)."""
    lines = ["| system | punishment | metric | " + " | ".join(f"step {i}" for i in range(1, 11)) + " |"]
    lines.append("| --- | --- | --- |" + " --- |" * 10)
    groups: dict[tuple, list[dict]] = {}
    for run in results:
        groups.setdefault((run["system"], run["punishment"]), []).append(run)
    for (system, punishment), runs in groups.items():
        for metric in STEP_METRICS.values():
            means = []
            for step in range(10):
                values = [
                    r["steps"][step][metric] for r in runs if step < len(r["steps"]) and metric in r["steps"][step]
                ]
                means.append(f"{statistics.mean(values):.2f}" if values else "")
            lines.append(f"| {system} | {punishment} | {metric} (n={len(runs)}) | " + " | ".join(means) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2_cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", default="1,2,3,4")
    parser.add_argument("--systems", default="nemo_dapo,single_process,trl")
    parser.add_argument("--punishment", default="off,on")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    record = ROOT / "results.json"
    saved = json.loads(record.read_text()) if record.exists() else {"runs": []}
    if "start" not in saved:
        from nemo_dapo.config import load_config
        from nemo_dapo.trainer.assembly import resolve_paths

        saved["start"] = held_out(Path(resolve_paths(load_config(args.config, [])).model.path), args.config)
    done = {(r["system"], r["punishment"], r["seed"]) for r in saved["runs"]}
    for punishment in args.punishment.split(","):
        for system in args.systems.split(","):
            for seed in map(int, args.seeds.split(",")):
                if (system, punishment, seed) in done:
                    continue
                run = in_fresh_process(args.config, system, punishment, seed, args.steps, args.overrides)
                saved["runs"].append(run)
                record.write_text(json.dumps(saved, indent=1))  # a long sweep keeps what it measured
                print(f"{system} punishment={punishment} seed={seed}: held-out {run['held_out_end']:.3f}", flush=True)
    print(table(saved["runs"], saved["start"]))
    print()
    print(per_step_table(saved["runs"]))


if __name__ == "__main__":
    main()
