"""A synthetic, verifiable arithmetic task in the verl parquet format.

The embedded default needs a task that a tiny model can partly solve after a short warm-up
and visibly improve on with RL, scored by the same ``math_dapo`` scorer as real maths data
(answers end in ``Answer: N``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arith"


@dataclass(frozen=True)
class ArithmeticSpec:
    max_first: int = 99  # a in [min_first, max_first]
    max_second: int = 9  # b in [min_second, max_second]: one carry at most, learnable by a tiny model
    min_first: int = 0
    min_second: int = 0
    # the user turn; {question} is e.g. "12+7". The tiny model is asked the bare question
    prompt_template: str = "{question}"
    operators: str = "+-"
    num_train: int = 1800
    num_val: int = 200
    seed: int = 0


def make_problem(rng: random.Random, spec: ArithmeticSpec) -> tuple[str, str]:
    """One question and its exact answer."""
    a, b = rng.randint(spec.min_first, spec.max_first), rng.randint(spec.min_second, spec.max_second)
    op = rng.choice(spec.operators)
    result = a + b if op == "+" else a - b
    return f"{a}{op}{b}", str(result)


def solution_text(answer: str) -> str:
    """The response format the warm-up teaches and ``math_dapo`` scores."""
    return f"Answer: {answer}"


def _row(question: str, answer: str, index: int, split: str, template: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": template.format(question=question)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split},
    }


def write_arithmetic_dataset(output_dir: str | Path, spec: ArithmeticSpec = ArithmeticSpec()) -> dict[str, Path]:
    """Write ``train.parquet`` and a disjoint held-out ``val.parquet``; return their paths."""
    rng = random.Random(spec.seed)
    seen: set[str] = set()
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    capacity = (spec.max_first - spec.min_first + 1) * (spec.max_second - spec.min_second + 1) * len(spec.operators)
    if spec.num_train + spec.num_val > capacity:
        raise ValueError(
            f"only {capacity} distinct problems exist for operands up to {spec.max_first}, {spec.max_second}"
        )
    for split, count in (("val", spec.num_val), ("train", spec.num_train)):
        while len(rows[split]) < count:
            question, answer = make_problem(rng, spec)
            if question not in seen:
                seen.add(question)
                rows[split].append(_row(question, answer, len(rows[split]), split, spec.prompt_template))
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_rows in rows.items():
        paths[split] = output_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(split_rows), paths[split])
    return paths
