"""Validation / evaluation: acc/mean@n and pass@k per data source (docs/algorithm.md §12 reports acc/mean@32),
the trainer's validation pass over the held-out set, and how training rounds sample beside it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import comb

import numpy as np

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import group_rows
from nemo_dapo.config import Config
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.settings import val_sampling
from nemo_dapo.trainer.stages import score_batch


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k: ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


def accuracy_metrics(
    accs: Sequence[bool], data_sources: Sequence[str], uids: Sequence, n: int, family: mn.Metric = mn.VAL_ACC
) -> dict[str, float]:
    """``val-core/<source>/acc/mean@n`` (or ``eval/...``: ``family``) and ``val-aux/<source>/pass@k``
    for k = 1, 2, 4, ... <= n, each the mean over the groups ``uids`` forms (one per problem)."""
    metrics: dict[str, float] = {}
    by_source: dict[str, list[list[bool]]] = {}
    for rows in group_rows(uids).values():
        by_source.setdefault(data_sources[rows[0]], []).append([bool(accs[r]) for r in rows])
    for source, groups in sorted(by_source.items()):
        metrics[family.of(source=source, n=n)] = float(np.mean([np.mean(g) for g in groups]))
        k = 1
        while k <= n:
            metrics[mn.VAL_PASS.of(source=source, k=k)] = float(np.mean([pass_at_k(len(g), sum(g), k) for g in groups]))
            k *= 2
    return metrics


def mean_val_accuracy(metrics: dict[str, float]) -> float | None:
    """The mean of the ``val-core/<source>/acc/mean@k`` entries of one validation, None without any."""
    accs = [v for k, v in metrics.items() if mn.VAL_ACC.pattern.match(k)]
    return float(np.mean(accs)) if accs else None


def validation_metrics(
    rollout, val_data, cfg: Config, tokenizer, reward, weight_version: int, stop: Callable[[], bool] | None = None
) -> dict[str, float]:
    """Every held-out problem ``rollout.val.n`` times (greedy unless ``rollout.val.do_sample``),
    scored: the ``val-core`` / ``val-aux`` metrics of :func:`accuracy_metrics`, over distinct
    problems (``val_data`` holds one row per problem: :func:`~nemo_dapo.trainer.assembly.load_data`). ``stop``: see
    :meth:`~nemo_dapo.cluster.groups.RolloutGroup.generate`."""
    val = cfg.rollout.val
    items = [val_data[i] for i in range(len(val_data))]
    generations = rollout.generate([it["prompt_ids"] for it in items], val_sampling(cfg), stop=stop)
    batch = batch_from_items(items, generations, "val", tokenizer.pad_token_id, weight_version)
    score_batch(batch, reward, tokenizer)
    return accuracy_metrics(batch["acc"], batch["data_source"], batch["uid"], val.n, mn.VAL_ACC)
