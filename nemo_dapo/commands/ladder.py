"""`nemo-dapo ladder PRESET RUNG`: what one rung of the bring-up ladder submits, checked before it is.

The ladder (docs/cluster.md, "Bring-up ladder") brings a preset up on a new cluster in four short
jobs, each on fewer nodes than the preset was written for: one node, then two. A preset sized for
16 nodes does not fit either as it stands (the 32B preset is TP=8 x PP=2 = 16 ranks; on two
nodes its optimizer is not sharded), so each rung's job is made to fit here:

- rung 1 runs the preset's one-node sibling, a smaller model of the same family at PP=1
  (``ONE_NODE_SIBLINGS``: Qwen2.5-7B for the 32B preset, Qwen3-8B for the 30B-A3B one; the
  preset itself where it fits one node), from the folder ``SMALL_HF_MODEL`` names;
- rungs 2-4 run the preset on ``--nodes`` nodes with the smallest change that makes it fit
  (:func:`~nemo_dapo.config.gpu_fit.fitting_overrides`: the engines' memory share lowered, the
  gradient buffers released only where that alone is not enough).

The rung's final config is the one the batch script builds (the allocation's shape, then the
rung's settings, then the user's overrides); it must pass validation and ``nemo-dapo plan``, or the
rung is refused (exit 2) naming what to change, before anything is queued. On stdout, for
``slurm/bringup_ladder.sh``, one ``key=value`` line each: ``config``, ``nodes``, ``model`` (the
variable naming the model folder), ``require`` (the checks ``nemo-dapo bringup`` must pass),
``drill`` (rung 4's USR1), ``export`` (environment for the job) and ``override`` (in order).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from nemo_dapo.commands.plan import make_plan, render
from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.config.architecture import resolve_architecture
from nemo_dapo.config.capacity import gpu_memory_gib
from nemo_dapo.config.gpu_fit import MIN_HEADROOM_GIB, RESERVE_GIB, fitting_overrides
from nemo_dapo.config.schema import Config

# A preset's model -> the preset of a smaller model of its family that fits one node at PP=1
ONE_NODE_SIBLINGS = {"Qwen2.5-32B": "dapo_qwen2.5_7b", "Qwen3-30B-A3B": "dapo_qwen3_8b"}
SHORT = ("trainer.save_freq=0", "trainer.test_freq=0")


@dataclass(frozen=True)
class Rung:
    """What one rung runs and must show (``nemo-dapo bringup --require``)."""

    number: int
    steps: int
    require: str
    settings: tuple[str, ...] = SHORT
    export: tuple[str, ...] = ()
    drill: str = ""  # "usr1": the ladder signals the job once its first checkpoint exists


RUNGS = {
    1: Rung(1, 3, "steps,stages"),
    2: Rung(2, 3, "steps,stages,fabric", export=("NCCL_DEBUG=INFO",)),
    3: Rung(3, 5, "steps,stages"),
    4: Rung(4, 4, "steps,stages,checkpoint,stop", ("trainer.save_freq=1", "trainer.test_freq=0"), drill="usr1"),
}


def shape_overrides(cfg: Config, nodes: int) -> list[str]:
    """What the batch script adds from its allocation (slurm/dapo_32b.sbatch, start_trainer)."""
    gpus = cfg.trainer.n_gpus_per_node
    shape = [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={gpus}"]
    return shape + ([f"actor.num_workers={nodes * gpus}"] if gpus > 0 else [])


@dataclass(frozen=True)
class Submission:
    config: str
    nodes: int
    model_variable: str
    overrides: list[str]  # the rung's, the fitting ones, then the user's


def rung_config(preset: str, rung: int) -> tuple[str, str]:
    """The preset a rung runs and the variable naming its model folder."""
    if rung != 1:
        return preset, "HF_MODEL"
    cfg = load_config(preset, placement=False)
    if cfg.trainer.n_gpus_per_node == 0 or cfg.trainer.nnodes == 1:
        return preset, "HF_MODEL"
    sibling = ONE_NODE_SIBLINGS.get(resolve_architecture(cfg.model.path).name)
    if sibling is None:
        raise ConfigError(
            f"ladder: rung 1 runs one node, and {preset} is written for {cfg.trainer.nnodes}: no one-node sibling "
            f"of its model is listed ({', '.join(ONE_NODE_SIBLINGS)}): run rung 1 with CONFIG set to a preset of "
            "a smaller model of its family that fits one node"
        )
    return sibling, "SMALL_HF_MODEL"


def plan_rung(preset: str, rung: int, nodes: int, user: list[str]) -> tuple[Submission, str]:
    """The rung's submission and its plan's text; refuses (ConfigError) a rung that cannot run."""
    config, model_variable = rung_config(preset, rung)
    nodes = 1 if rung == 1 else nodes
    try:
        return _plan_rung(config, model_variable, rung, nodes, user)
    except ConfigError as err:
        raise ConfigError(f"ladder: rung {rung} ({config} on {nodes} node(s)) cannot run: {err}") from None


def _plan_rung(config: str, model_variable: str, rung: int, nodes: int, user: list[str]) -> tuple[Submission, str]:
    if model_variable != "HF_MODEL":  # the sibling's model.path reads HF_MODEL, as it will in the job
        os.environ.pop("HF_MODEL", None)
        if os.environ.get(model_variable):
            os.environ["HF_MODEL"] = os.environ[model_variable]
    steps = RUNGS[rung]
    own = [f"trainer.total_training_steps={steps.steps}", *steps.settings]
    base = load_config(config, own, placement=False)
    shape = shape_overrides(base, nodes)
    cfg = load_config(config, [*shape, *own, *user], placement=False)
    fitting: list[str] = []
    if cfg.trainer.n_gpus_per_node > 0:
        gpu = gpu_memory_gib(cfg.trainer.gpu_model or "H800")
        fitting = fitting_overrides(cfg, resolve_architecture(cfg.model.path), gpu, MIN_HEADROOM_GIB) or []
        cfg = load_config(config, [*shape, *own, *fitting, *user], placement=False)
        plan = make_plan(cfg, config, gpu, RESERVE_GIB, MIN_HEADROOM_GIB)
        if plan.problems:
            raise ConfigError(
                "it cannot fit:\n  - "
                + "\n  - ".join(plan.problems)
                + "\nraise NODES, or give overrides after the rung that fit (`nemo-dapo plan` shows the memory)"
            )
        text = render(plan)
    else:
        text = f"{config} on {nodes} node(s) without GPUs: no memory plan"
    load_config(config, [*shape, *own, *fitting, *user])  # placement: the ranks must fit the allocation
    return Submission(config, nodes, model_variable, [*own, *fitting, *user]), text


def run_ladder(args: argparse.Namespace) -> int:
    submission, text = plan_rung(args.preset, args.rung, args.nodes, args.overrides)
    rung = RUNGS[args.rung]
    print(text, file=sys.stderr)
    print(
        f"ladder: rung {args.rung}: {submission.config} on {submission.nodes} node(s), "
        f"overrides {' '.join(submission.overrides)}",
        file=sys.stderr,
    )
    lines = [f"config={submission.config}", f"nodes={submission.nodes}", f"model={submission.model_variable}"]
    lines += [f"require={rung.require}", f"drill={rung.drill}"]
    lines += [f"export={item}" for item in rung.export] + [f"override={item}" for item in submission.overrides]
    print("\n".join(lines))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ladder", help="the job one bring-up rung submits (slurm/bringup_ladder.sh), refused if it cannot fit"
    )
    parser.add_argument("preset", help="the preset being brought up (its rung 1 may run a one-node sibling)")
    parser.add_argument("rung", type=int, choices=sorted(RUNGS), help="1: one node; 2-4: --nodes nodes")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of rungs 2-4")
    parser.add_argument("overrides", nargs="*", help="dotted overrides after the rung's own (they win)")
    parser.set_defaults(fn=run_ladder)
