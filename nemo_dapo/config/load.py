"""Loading: schema defaults <- YAML preset(s) <- dotted command-line overrides.

A preset may list other presets under ``defaults:`` (merged first, in order), so presets
compose (base + model + cluster) instead of repeating each other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import engine_pool_gpus, has_rollout_pool, weight_transfer_path
from nemo_dapo.config.validate import ConfigError, validate

DEFAULT_PRESET = "tiny_cpu"


def conf_dir() -> Path:
    """Where presets live: ``$NEMO_DAPO_CONF_DIR`` or the repository's ``conf/``."""
    return Path(os.environ.get("NEMO_DAPO_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))


def list_presets() -> list[str]:
    return sorted(p.stem for p in conf_dir().glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = conf_dir() / f"{name_or_path}.yaml"
    if not candidate.exists():
        raise ConfigError(f"config {name_or_path!r} not found: give a YAML path or one of {list_presets()}")
    return candidate


def read_preset(name_or_path: str, seen: tuple[str, ...] = ()) -> DictConfig:
    path = preset_path(name_or_path)
    if str(path) in seen:
        raise ConfigError(f"presets include each other in a loop: {' -> '.join(seen + (str(path),))}")
    raw = read_settings(path)
    parents = raw.pop("defaults", [])
    merged = OmegaConf.create()
    for parent in parents:
        merged = OmegaConf.merge(merged, read_preset(str(parent), seen + (str(path),)))
    return OmegaConf.merge(merged, raw)


def read_settings(path: Path) -> DictConfig:
    """One YAML file's settings: a file that does not parse, holds a tag (``!!python/...``: a config
    holds plain values, nothing is constructed) or is not a mapping at the top is refused, naming it."""
    try:
        raw = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"config {path}: not a YAML file of plain settings: {err}\nfix the place named (an unclosed "
            "bracket or quote, a tab in the indentation, a '!!' tag: a config holds plain values only)"
        ) from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(
            f"config {path}: its top level is a list; a config is a mapping of sections to their settings, "
            "e.g. `trainer: {total_training_steps: 3}` (drop the leading '- ')"
        )
    return raw


def load_config(
    name_or_path: str | None = DEFAULT_PRESET, overrides: Sequence[str] = (), placement: bool = True
) -> Config:
    """Typed, validated config; an unknown key or a wrong type names the key.

    ``placement=False``: see :func:`~nemo_dapo.config.validate.validate`.
    """
    try:
        layers = [read_preset(name_or_path)] if name_or_path else []
        given = without_retired(OmegaConf.merge(*layers, OmegaConf.from_dotlist(list(overrides))))
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), given))
    except OmegaConfBaseException as err:
        raise ConfigError(f"config {name_or_path!r}: {err}") from None
    return validate(resolve_auto(cfg), placement)


ASYNC_REPLACED = (
    "the async trainer was replaced by trainer.mode=stream, which is faster per trained sample and "
    "as accurate (docs/benchmarks.md, Three trainers side by side)"
)


def without_retired(given: DictConfig) -> DictConfig:
    """Settings of the retired async trainer: ``trainer.mode=async`` refused with its replacement
    named; ``trainer.parameter_sync_step`` dropped at its default 1 (every config saved with a run
    or checkpoint holds it), refused otherwise."""
    trainer = given.get("trainer") or {}
    if trainer.get("mode") == "async":
        raise ConfigError(
            f"trainer.mode='async': {ASYNC_REPLACED}: set trainer.mode=stream (trainer.max_staleness keeps "
            "its meaning: how many versions a sample may lag the policy that trains on it)"
        )
    if "parameter_sync_step" in trainer:
        if trainer.parameter_sync_step != 1:
            raise ConfigError(
                f"trainer.parameter_sync_step={trainer.parameter_sync_step}: {ASYNC_REPLACED}, and it syncs the "
                "weights after every step: remove the key (trainer.max_staleness bounds how far samples lag)"
            )
        del trainer["parameter_sync_step"]
    return given


# Longest prompt + response for which ``actor.attn_implementation=auto`` picks eager attention on
# CPUs: its [heads, seq, seq] probabilities per layer stay well below the micro-batch's other
# activations up to here (SmolLM2, by arithmetic: 1024 tokens x 512 x 9 heads x 30 layers x 4 bytes,
# 0.6 GB more for a 1024-token micro-batch of 512-token rows; not measured).
EAGER_MAX_SEQUENCE = 512


def resolve_auto(cfg: Config) -> Config:
    """The settings whose ``auto`` depends on the machine or the run, made concrete."""
    cfg = resolve_auto_engines(resolve_auto_prompt_sharing(resolve_auto_attention(resolve_auto_dtype(cfg))))
    cfg = replace(cfg, rollout=replace(cfg.rollout, weight_transfer=weight_transfer_path(cfg)))
    return resolve_nulls(cfg)


def resolve_nulls(cfg: Config) -> Config:
    """The settings whose ``null`` stands for a value the run derives, made that value here, so
    the code reads one meaning and the saved config records what ran: ``filter_groups.carry_over``
    (the mode's way), ``rollout.timeout_s`` (``trainer.remote_timeout_s``),
    ``actor.loss_scale_factor`` (``data.max_response_length``), ``rollout.min_engines`` (1 with a
    rollout pool, else every engine) and, in the stream,
    ``rollout.max_inflight`` (every sample the staleness bound admits, over the engines). A value
    that cannot be derived from an invalid config stays null for validation to refuse the cause."""
    filtering, rollout, actor = cfg.algorithm.filter_groups, cfg.rollout, cfg.actor
    if filtering.carry_over is None:
        filtering = replace(filtering, carry_over=cfg.trainer.mode == "stream")
    if rollout.timeout_s is None:
        rollout = replace(rollout, timeout_s=cfg.trainer.remote_timeout_s)
    if rollout.max_inflight is None and cfg.trainer.mode == "stream" and (rollout.num_workers or 0) > 0:
        groups = (cfg.trainer.max_staleness + 1) * cfg.data.train_batch_size
        rollout = replace(rollout, max_inflight=max(rollout.n, -(-groups * rollout.n // rollout.num_workers)))
    if rollout.min_engines is None and rollout.num_workers is not None:
        rollout = replace(rollout, min_engines=1 if has_rollout_pool(cfg) else rollout.num_workers)
    if actor.loss_scale_factor is None:
        actor = replace(actor, loss_scale_factor=float(cfg.data.max_response_length))
    return replace(cfg, algorithm=replace(cfg.algorithm, filter_groups=filtering), rollout=rollout, actor=actor)


def resolve_auto_engines(cfg: Config) -> Config:
    """``rollout.num_workers=null``: on GPUs, the engines' GPUs (the rollout pool's, else the job's:
    trainer.nnodes x trainer.n_gpus_per_node, which the batch scripts set from the allocation) over
    ``rollout.tensor_parallel_size``, what colocation needs; anywhere else left for validation to refuse."""
    gpus, tp = engine_pool_gpus(cfg), cfg.rollout.tensor_parallel_size
    if cfg.rollout.num_workers is not None or gpus == 0 or gpus % tp:
        return cfg
    return replace(cfg, rollout=replace(cfg.rollout, num_workers=gpus // tp))


def resolve_auto_attention(cfg: Config) -> Config:
    """``actor.attn_implementation=auto``: eager for the torch backend on CPUs with short sequences
    (faster there, see the setting's help), sdpa otherwise (the megatron backend ignores it)."""
    if cfg.actor.attn_implementation != "auto":
        return cfg
    sequence = cfg.data.max_sequence_length
    cpu_torch = cfg.actor.backend == "torch" and cfg.trainer.n_gpus_per_node == 0
    eager = cpu_torch and sequence <= EAGER_MAX_SEQUENCE
    return replace(cfg, actor=replace(cfg.actor, attn_implementation="eager" if eager else "sdpa"))


def resolve_auto_prompt_sharing(cfg: Config) -> Config:
    """``actor.shared_prompt_forward=null``: on where it is implemented (the torch backend)."""
    if cfg.actor.shared_prompt_forward is not None:
        return cfg
    return replace(cfg, actor=replace(cfg.actor, shared_prompt_forward=cfg.actor.backend == "torch"))


def resolve_auto_dtype(cfg: Config) -> Config:
    """``model.dtype=auto`` made concrete on the machine that loads the config: bfloat16 for GPU runs
    and on CPUs with bf16 matrix instructions, float32 on other CPUs (see the setting's help)."""
    if cfg.model.dtype != "auto":
        return cfg
    from nemo_dapo.threads import cpu_has_bf16_matmul

    bf16 = cfg.trainer.n_gpus_per_node > 0 or cpu_has_bf16_matmul()
    return replace(cfg, model=replace(cfg.model, dtype="bfloat16" if bf16 else "float32"))


def to_yaml(cfg: Config) -> str:
    """The fully resolved config, saved with every run and checkpoint."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str, source: str = "the saved config") -> Config:
    """A config saved with a run or a checkpoint (``source`` names it), loaded with registry names
    only: whoever could write the file chose what a ``module:name`` there would import, so one is
    refused, naming the key (a user's own config, :func:`load_config`, may name their module)."""
    try:
        given = OmegaConf.create(text)
        if not isinstance(given, DictConfig):
            raise ConfigError(f"{source}: not a mapping of settings")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), without_retired(given)))
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"{source}: {err}") from None
    if ":" in cfg.actor.policy_loss:
        raise ConfigError(
            f"{source}: actor.policy_loss={cfg.actor.policy_loss!r} names a module to import; a config read "
            "from a run or a checkpoint never imports one (whoever could write the folder would choose the code)"
        )
    return validate(resolve_auto(cfg))
