"""Where does the start of a run go? The phases of `nemo-dapo train` around one short step, and
a vLLM engine's import, build and first log-prob request with and without its sampler's compile.

    .venv/bin/python bench/start_split.py [--runs 3] [--config tiny_cpu] [key=value ...]

Driver side: one-step runs of the tiny preset (no validation), each a fresh process, timed at
the trainer's own calls (Ray's start, the workers asked for, the data read, each group ready,
the training, the export, Ray's shutdown) and at the process's end; medians over ``--runs``.
Engine side: fresh processes that import vLLM, build an in-process engine as a rollout worker
does, and time its first and second request for one greedy token with its log-prob, once as
nemo-dapo runs CPU engines (no TorchDynamo) and once with vLLM's compile of the sampler's rank
function, alternated. Prints both tables and writes ``outputs/bench_start_split/start_split.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("init_ray", "launch_workers", "load_data", "wait_ready actor", "wait_ready rollout", "fit", "shutdown_ray")
RUN = ["trainer.total_training_steps=1", "data.train_batch_size=8", "data.gen_batch_size=12"]
RUN += ["actor.ppo_mini_batch_size=4", "data.val_files=[]", "trainer.save_freq=0"]


def timed_driver(args: list[str]) -> None:
    """In this process: `nemo-dapo train` with a line per phase boundary on stderr."""
    start = time.perf_counter()

    def mark(what: str) -> None:
        print(f"SPLIT {time.perf_counter() - start:.3f} {what}", file=sys.stderr, flush=True)

    def timed(owner, name: str, label: str | None = None) -> None:
        function = getattr(owner, name)

        def wrapper(*a, **k):
            owner_name = getattr(a[0], "name", "") if a and isinstance(a[0], WorkerGroup) else ""
            label_now = label or f"{name} {owner_name}".strip()
            mark(f"{label_now} begin")
            try:
                return function(*a, **k)
            finally:
                mark(f"{label_now} end")

        setattr(owner, name, wrapper)

    import nemo_dapo.cli as cli
    import nemo_dapo.cluster.ray_env as ray_env
    import nemo_dapo.trainer.assembly as assembly
    from nemo_dapo.cluster.worker_group import WorkerGroup
    from nemo_dapo.trainer.fit import DAPOTrainer

    mark("imported")
    for owner, name in ((ray_env, "init_ray"), (ray_env, "shutdown_ray"), (assembly, "launch_workers")):
        timed(owner, name)
    timed(assembly, "load_data")
    timed(WorkerGroup, "wait_ready")
    timed(DAPOTrainer, "fit", "fit")
    sys.argv = ["nemo-dapo", *args]
    cli.main()


def driver_phases(config: str, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, __file__, "--driver", "train", "--config", config]
        command += [f"trainer.output_dir={folder}/run", *RUN, *overrides]
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
        total = time.perf_counter() - began
    assert done.returncode == 0, done.stderr[-3000:]
    marks = {}
    for line in done.stderr.splitlines():
        if line.startswith("SPLIT "):
            _, seconds, what = line.split(" ", 2)
            marks[what] = float(seconds)
    phases = {"python + imports": marks["imported"]}
    phases.update({name: marks[f"{name} end"] - marks[f"{name} begin"] for name in PHASES})
    phases["after shutdown (process exit)"] = total - marks["shutdown_ray end"]
    phases["whole run"] = total
    return phases


def timed_engine(model: str) -> None:
    """In this process: import vLLM, build an engine, two one-token requests with log-probs."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    began = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    imported = time.perf_counter()
    llm = LLM(model=model, max_model_len=128, block_size=32, enforce_eager=True, logprobs_mode="processed_logprobs")
    built = time.perf_counter()
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    times = []
    for _ in range(2):
        request = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=[0])], one, use_tqdm=False)
        times.append(time.perf_counter() - request)
    result = {"import": imported - began, "build": built - imported, "first request": times[0]}
    print("ENGINE " + json.dumps({**result, "second request": times[1]}), flush=True)


def engine_phases(model: str, compiled: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    if not compiled:
        env["TORCHDYNAMO_DISABLE"] = "1"  # what rollout.vllm_worker.compiles_nothing sets
    command = [sys.executable, __file__, "--engine", model]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ENGINE "))
    return json.loads(line.removeprefix("ENGINE "))


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    if sys.argv[1:2] == ["--driver"]:
        return timed_driver(sys.argv[2:])
    if sys.argv[1:2] == ["--engine"]:
        return timed_engine(sys.argv[2])
    import argparse

    from nemo_dapo.model.tiny import ensure_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", default="tiny_cpu")
    parser.add_argument("overrides", nargs="*")
    options = parser.parse_args()
    model = str(ensure_tiny_model())
    driver = medians([driver_phases(options.config, options.overrides) for _ in range(options.runs)])
    sides: dict[str, list] = {"no compile (nemo-dapo)": [], "vLLM's compile": []}
    for _ in range(options.runs):
        sides["no compile (nemo-dapo)"].append(engine_phases(model, compiled=False))
        sides["vLLM's compile"].append(engine_phases(model, compiled=True))
    engine = {side: medians(rows) for side, rows in sides.items()}
    print(f"`nemo-dapo train --config {options.config}`, one step, medians of {options.runs} runs (s):")
    for name, seconds in driver.items():
        print(f"  {name:32s} {seconds:6.2f}")
    print(f"a vLLM engine in a fresh process (tiny model), medians of {options.runs} runs (s):")
    print(f"  {'':18s}" + "".join(f"{side:>24s}" for side in engine))
    for key in next(iter(engine.values())):
        print(f"  {key:18s}" + "".join(f"{engine[side][key]:24.3f}" for side in engine))
    out = Path("outputs/bench_start_split")
    out.mkdir(parents=True, exist_ok=True)
    (out / "start_split.json").write_text(json.dumps({"driver": driver, "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
