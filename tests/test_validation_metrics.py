"""Validation over distinct problems: a held-out file's copies of a problem fold into one problem
sampled rollout.val.n times, and mean@n / pass@k average over problems.

The held-out set loads as training loads it (``load_data``), answers are scored by the real
``math_dapo`` scorer; the generations come from a scripted responder (an engine's output format,
with a known number of right answers per problem) so the metrics can be computed by hand.
"""

import logging
from math import comb

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_dapo.config import load_config
from nemo_dapo.data import RLDataset
from nemo_dapo.rollout.base import Generation
from nemo_dapo.trainer.assembly import load_data, reward_manager
from nemo_dapo.trainer.validation import validation_metrics

N = 4
RIGHT_OF_N = {"4": 1, "7": 0, "9": 2}  # right answers among the N samples of each problem (by ground truth)
COPIES = {"4": 3, "7": 1, "9": 2}  # rows of each problem in the file


def row(question: str, answer: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "data_source": "toy",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0},
    }


@pytest.fixture
def held_out_file(tmp_path):
    problems = {"4": "2+2", "7": "3+4", "9": "4+5"}
    rows = [row(problems[answer], answer) for answer in ("4", "7", "4", "9", "4", "9")]
    assert {a: sum(r["reward_model"]["ground_truth"] == a for r in rows) for a in COPIES} == COPIES
    path = tmp_path / "held_out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class ScriptedResponder:
    """Answers each prompt with ``RIGHT_OF_N[answer]`` right samples, the rest wrong; counts prompts."""

    def __init__(self, tokenizer, answer_of_prompt: dict[tuple[int, ...], str]):
        self.tokenizer, self.answer_of_prompt, self.prompts_asked = tokenizer, answer_of_prompt, 0

    def generate(self, prompts, sampling, stop=None) -> list[Generation]:
        self.prompts_asked += len(prompts)
        return [self._samples(self.answer_of_prompt[tuple(ids)], sampling.n) for ids in prompts]

    def _samples(self, answer: str, n: int) -> Generation:
        right = RIGHT_OF_N[answer]
        texts = [f"Answer: {answer}" if sample < right else "Answer: 0" for sample in range(n)]
        ids = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return Generation(token_ids=ids, log_probs=[[0.0] * len(t) for t in ids], finish_reasons=["stop"] * n)


def config(tiny_model_dir, path, *overrides: str):
    files = [f"model.path={tiny_model_dir}", f"data.train_files=[{path}]", f"data.val_files=[{path}]"]
    return load_config("tiny_cpu", [*files, "data.max_prompt_length=256", f"rollout.val.n={N}", *overrides])


def validate(cfg, tokenizer, val_data) -> tuple[dict[str, float], int]:
    answers = {tuple(val_data[i]["prompt_ids"]): val_data[i]["ground_truth"] for i in range(len(val_data))}
    responder = ScriptedResponder(tokenizer, answers)
    with reward_manager(cfg) as reward:
        metrics = validation_metrics(responder, val_data, cfg, tokenizer, reward, weight_version=0)
    return metrics, responder.prompts_asked


def by_hand(groups: list[int]) -> dict[str, float]:
    """mean@N and pass@k over the groups, each ``c`` right of N: the formulas of docs/algorithm.md §12."""
    metrics = {f"val-core/toy/acc/mean@{N}": sum(c / N for c in groups) / len(groups)}
    for k in (1, 2, 4):
        metrics[f"val-aux/toy/pass@{k}"] = sum(1 - comb(N - c, k) / comb(N, k) for c in groups) / len(groups)
    return metrics


def test_validation_folds_copies_into_distinct_problems(tiny_model_dir, held_out_file):
    cfg = config(tiny_model_dir, held_out_file)
    data = load_data(cfg)
    assert [data.val[i]["index"] for i in range(len(data.val))] == [0, 1, 3]  # each problem's first row
    assert len(data.train) == 6  # training keeps every row (data.drop_duplicate_prompts: false)
    metrics, prompts_asked = validate(cfg, data.tokenizer, data.val)
    assert prompts_asked == 3  # 3 problems x N samples, not 6 rows x N
    expected = by_hand([RIGHT_OF_N[a] for a in ("4", "7", "9")])
    assert metrics == pytest.approx(expected)
    assert expected[f"val-core/toy/acc/mean@{N}"] == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)
    assert expected["val-aux/toy/pass@2"] == pytest.approx((1 / 2 + 0 + 5 / 6) / 3)

    every_row = RLDataset(held_out_file, data.tokenizer, max_prompt_length=256)  # the mutation: no folding
    unfolded, _ = validate(cfg, data.tokenizer, every_row)
    per_row = [RIGHT_OF_N[every_row[i]["ground_truth"]] for i in range(len(every_row))]
    assert unfolded == pytest.approx(by_hand(per_row))
    assert unfolded[f"val-core/toy/acc/mean@{N}"] != pytest.approx(metrics[f"val-core/toy/acc/mean@{N}"])


def test_training_drops_copies_when_asked(tiny_model_dir, held_out_file):
    train = load_data(config(tiny_model_dir, held_out_file, "data.drop_duplicate_prompts=true")).train
    assert [train[i]["index"] for i in range(len(train))] == [0, 1, 3]


def test_fewer_samples_than_copies_is_warned(tiny_model_dir, held_out_file, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_dapo.data"):
        load_data(config(tiny_model_dir, held_out_file, "rollout.val.n=2"))
    assert (
        "the evaluation data held a problem 3 times; its 3 distinct problems are sampled rollout.val.n=2 times "
        "each: set rollout.val.n=3 for the estimate the copies gave (mean@3)"
    ) in caplog.text
