"""Reading, validating, templating, truncating, filtering and collating verl-format prompt data."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from shared_paths import AIME_2024, AIME_2025
from torch.utils.data import DataLoader

from nemo_dapo.data import DatasetError, ResumableBatchSampler, RLDataset, collate_prompts, read_records, render_prompt
from nemo_dapo.model.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def good_row(question: str = "What is 1 + 1?", answer: str = "2") -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "data_source": "toy",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0},
        "ability": "MATH",
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_reads_aime_2024():
    records = read_records(AIME_2024)
    assert len(records) == 960  # 30 problems x 32 copies
    problems = {record.messages[-1]["content"] for record in records}
    assert len(problems) == 30
    assert all(isinstance(record.ground_truth, str) and record.ground_truth for record in records)
    assert {record.data_source for record in records} == {"math_dapo"}
    assert all(record.messages[0]["role"] == "user" for record in records)
    assert records[0].location == f"{AIME_2024} row 0"


def test_dataset_items_are_templated_prompts(tokenizer):
    dataset = RLDataset(AIME_2024, tokenizer, max_prompt_length=4096)
    assert len(dataset) == 960
    item = dataset[7]
    assert set(item) == {"prompt_ids", "raw_prompt", "ground_truth", "data_source", "extra_info", "index"}
    assert item["index"] == 7
    expected_text = render_prompt(tokenizer, item["raw_prompt"])
    assert expected_text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(item["prompt_ids"]) == expected_text
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert item["prompt_ids"][0] == im_start  # no extra BOS in front of the template's own tokens
    assert item["prompt_ids"].count(im_start) == 2  # user turn + generation prompt, not doubled
    assert item["ground_truth"] == read_records(AIME_2024)[7].ground_truth


def test_concatenated_files_keep_running_row_index(tokenizer):
    dataset = RLDataset([AIME_2024, AIME_2025], tokenizer, max_prompt_length=4096)
    assert len(dataset) == 1920
    assert dataset[960]["index"] == 960
    assert dataset[960]["data_source"] == "aime2025"


def test_items_are_copies(tmp_path, tokenizer):
    dataset = RLDataset(write_jsonl(tmp_path / "toy.jsonl", [good_row()]), tokenizer)
    dataset[0]["prompt_ids"].append(-1)
    dataset[0]["raw_prompt"][0]["content"] = "changed"
    assert dataset[0]["prompt_ids"][-1] != -1
    assert dataset[0]["raw_prompt"][0]["content"] == "What is 1 + 1?"


@pytest.fixture
def long_and_short_file(tmp_path):
    rows = [good_row("short?"), good_row("a much longer question " * 20), good_row("tiny")]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


def full_prompt_ids(files, tokenizer) -> list[list[int]]:
    dataset = RLDataset(files, tokenizer, max_prompt_length=100_000)
    return [dataset[i]["prompt_ids"] for i in range(len(dataset))]


def test_left_truncation_keeps_last_tokens(long_and_short_file, tokenizer):
    full = full_prompt_ids(long_and_short_file, tokenizer)
    limit = len(full[0]) + 1
    assert len(full[1]) > limit
    dataset = RLDataset(long_and_short_file, tokenizer, max_prompt_length=limit)
    assert dataset[1]["prompt_ids"] == full[1][-limit:]
    assert tokenizer.decode(dataset[1]["prompt_ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert dataset[0]["prompt_ids"] == full[0]


def test_right_truncation_keeps_first_tokens(long_and_short_file, tokenizer):
    full = full_prompt_ids(long_and_short_file, tokenizer)
    dataset = RLDataset(long_and_short_file, tokenizer, max_prompt_length=12, truncation="right")
    assert dataset[1]["prompt_ids"] == full[1][:12]


def test_error_truncation_names_the_row(long_and_short_file, tokenizer):
    full = full_prompt_ids(long_and_short_file, tokenizer)
    with pytest.raises(DatasetError, match=r"mixed\.jsonl row 1 .*max_prompt_length=20"):
        RLDataset(long_and_short_file, tokenizer, max_prompt_length=20, truncation="error")
    assert len(full[1]) > 20 and len(full[0]) <= 20 and len(full[2]) <= 20


def test_filter_drops_overlong_prompts_and_logs_counts(long_and_short_file, tokenizer, caplog):
    full = full_prompt_ids(long_and_short_file, tokenizer)
    limit = max(len(full[0]), len(full[2]))
    assert len(full[1]) > limit
    with caplog.at_level(logging.INFO, logger="nemo_dapo.data.dataset"):
        dataset = RLDataset(long_and_short_file, tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 2]
    assert [dataset[i]["prompt_ids"] for i in range(len(dataset))] == [full[0], full[2]]
    assert "Dropped 1 of 3 prompts" in caplog.text


def test_filter_refuses_to_drop_everything(long_and_short_file, tokenizer):
    with pytest.raises(DatasetError, match="every prompt is longer"):
        RLDataset(long_and_short_file, tokenizer, max_prompt_length=2, filter_overlong_prompts=True)


def test_rejects_unknown_truncation_mode(long_and_short_file, tokenizer):
    with pytest.raises(ValueError, match="truncation='middle'"):
        RLDataset(long_and_short_file, tokenizer, truncation="middle")


def without(row: dict, key: str) -> dict:
    return {name: value for name, value in row.items() if name != key}


BAD_JSONL_ROWS = {
    "missing prompt": (without(good_row(), "prompt"), r"field 'prompt' is missing; each row needs prompt=\["),
    "prompt is a string": ({**good_row(), "prompt": "What is 1 + 1?"}, r"field 'prompt' must be a list, got str"),
    "prompt is a list of strings": ({**good_row(), "prompt": ["hi"]}, r"field 'prompt\[0\]' must be a message"),
    "empty prompt": ({**good_row(), "prompt": []}, r"field 'prompt' is an empty list"),
    "message without content": ({**good_row(), "prompt": [{"role": "user"}]}, r"field 'prompt\[0\]\.content'"),
    "unknown role": (
        {**good_row(), "prompt": [{"role": "robot", "content": "x"}]},
        r"field 'prompt\[0\]\.role' is 'robot'",
    ),
    "missing ground truth": (
        {**good_row(), "reward_model": {"style": "rule"}},
        r"field 'reward_model\.ground_truth' is missing; each row needs reward_model=\{'ground_truth': str\}",
    ),
    "ground truth is a number": (
        {**good_row(), "reward_model": {"ground_truth": 42}},
        r"field 'reward_model\.ground_truth' must be a string, got int",
    ),
    "empty ground truth": (
        {**good_row(), "reward_model": {"ground_truth": ""}},
        r"field 'reward_model\.ground_truth' is empty \(''\); every row needs the answer",
    ),
    "whitespace ground truth": (
        {**good_row(), "reward_model": {"ground_truth": " \n"}},
        r"field 'reward_model\.ground_truth' is empty",
    ),
    "missing data_source": (without(good_row(), "data_source"), r"field 'data_source' is missing"),
    "extra_info is a list": ({**good_row(), "extra_info": [1]}, r"field 'extra_info' must be an object"),
    "row is not an object": (["not", "a", "row"], r"expected an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL_ROWS))
def test_malformed_jsonl_row_names_file_row_and_field(tmp_path, case):
    bad_row, expected_message = BAD_JSONL_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [good_row(), bad_row, good_row()])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl row 1 \(line 2\): {expected_message}"):
        read_records(path)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)


def test_train_on_a_malformed_row_exits_2_with_the_message_alone(tmp_path, capsys):
    from nemo_dapo.cli import main

    path = write_jsonl(tmp_path / "bad.jsonl", [good_row(), without(good_row(), "prompt")])
    code = main(["train", f"data.train_files=[{path}]", f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl row 1 (line 2): field 'prompt' is missing" in err, err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything ran


def test_malformed_parquet_missing_ground_truth(tmp_path):
    rows = [good_row(), {**good_row(), "reward_model": {"ground_truth": None, "style": "rule"}}]
    path = write_parquet(tmp_path / "aime.parquet", rows)
    with pytest.raises(DatasetError, match=r"aime\.parquet row 1: field 'reward_model\.ground_truth' is missing"):
        read_records(path)


def test_malformed_parquet_missing_prompt_column(tmp_path):
    path = write_parquet(tmp_path / "noprompt.parquet", [without(good_row(), "prompt")])
    with pytest.raises(DatasetError, match=r"noprompt\.parquet row 0: field 'prompt' is missing"):
        read_records(path)


def test_malformed_parquet_wrong_ground_truth_type(tmp_path):
    rows = [{**good_row(), "reward_model": {"ground_truth": 7}}]
    path = write_parquet(tmp_path / "ints.parquet", rows)
    with pytest.raises(DatasetError, match=r"ints\.parquet row 0: field 'reward_model\.ground_truth' must be a string"):
        read_records(path)


def test_jsonl_blank_lines_are_skipped_and_bad_json_reports_line(tmp_path):
    path = tmp_path / "gappy.jsonl"
    path.write_text(json.dumps(good_row()) + "\n\n" + json.dumps(good_row("q2", "5")) + "\n")
    records = read_records(path)
    assert [record.ground_truth for record in records] == ["2", "5"]
    assert records[1].location.endswith("gappy.jsonl row 1 (line 3)")
    path.write_text(json.dumps(good_row()) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"gappy\.jsonl row 1 \(line 2\): invalid JSON"):
        read_records(path)


def test_rejects_unknown_extension_and_missing_file(tmp_path):
    csv_path = tmp_path / "data.csv"
    csv_path.write_text("prompt\n")
    with pytest.raises(DatasetError, match="unsupported file extension '.csv'"):
        read_records(csv_path)
    with pytest.raises(DatasetError, match="not found"):
        read_records(tmp_path / "absent.parquet")


def test_optional_fields_may_be_absent(tmp_path):
    row = {"prompt": [{"role": "user", "content": "q"}], "data_source": "toy", "reward_model": {"ground_truth": "1"}}
    (record,) = read_records(write_jsonl(tmp_path / "minimal.jsonl", [row]))
    assert record.extra_info == {} and record.ability is None and record.reward_style is None


def test_collate_left_pads():
    common = {"raw_prompt": [], "data_source": "toy"}
    items = [
        {**common, "prompt_ids": [5, 6, 7], "ground_truth": "1", "extra_info": {}, "index": 4},
        {**common, "prompt_ids": [8], "ground_truth": "2", "extra_info": {"k": 1}, "index": 9},
    ]
    batch = collate_prompts(items, pad_token_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7], [0, 0, 8]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1]]))
    assert batch["input_ids"].dtype == torch.long
    assert batch["ground_truth"] == ["1", "2"]
    assert batch["index"] == [4, 9]
    assert batch["extra_info"] == [{}, {"k": 1}]
    assert batch["prompt_ids"] == [[5, 6, 7], [8]]


def test_dataset_collate_uses_tokenizer_pad_id(long_and_short_file, tokenizer):
    dataset = RLDataset(long_and_short_file, tokenizer)
    batch = dataset.collate([dataset[0], dataset[1]])
    short_length = len(dataset[0]["prompt_ids"])
    width = batch["input_ids"].shape[1]
    assert width == len(dataset[1]["prompt_ids"])
    assert batch["input_ids"][0, : width - short_length].eq(tokenizer.pad_token_id).all()
    assert batch["input_ids"][0, width - short_length :].tolist() == dataset[0]["prompt_ids"]
    assert batch["attention_mask"].sum(dim=1).tolist() == [short_length, width]


def test_dataloader_with_resumable_sampler(tmp_path, tokenizer):
    rows = [good_row(f"question {number}?", str(number)) for number in range(6)]
    dataset = RLDataset(write_jsonl(tmp_path / "six.jsonl", rows), tokenizer)
    sampler = ResumableBatchSampler(len(dataset), batch_size=4, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=dataset.collate)
    (batch,) = list(loader)
    assert batch["index"] == [0, 1, 2, 3]
    assert batch["ground_truth"] == ["0", "1", "2", "3"]
    assert batch["input_ids"].shape[0] == 4
    assert sampler.state_dict() == {"epoch": 1, "position": 0, "seed": 0}


# ----------------------------------------------------------------- repeated problems
def test_repeated_rows_are_counted_and_logged(tmp_path, tokenizer, caplog):
    rows = [good_row("a?", "1"), good_row("b?", "2"), good_row("a?", "1"), good_row("c?", "3"), good_row("a?", "1")]
    rows[2]["extra_info"] = {"index": 9}  # verl's copies differ in extra_info: still the same problem
    path = write_parquet(tmp_path / "repeats.parquet", rows)
    with caplog.at_level(logging.INFO, logger="nemo_dapo.data"):
        dataset = RLDataset(path, tokenizer)
    assert len(dataset) == 5 and [dataset[i]["index"] for i in range(5)] == [0, 1, 2, 3, 4]
    assert (dataset.duplicates.distinct, dataset.duplicates.most_copies, dataset.duplicates.first_rows) == (
        3,
        3,
        [0, 1, 3],
    )
    assert f"{path}: 5 rows hold 3 distinct problems (data_source, prompt and ground truth), one of them 3 times" in (
        caplog.text
    )
    assert "every row kept" in caplog.text


def test_files_without_repeats_log_nothing(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="nemo_dapo.data"):
        RLDataset(write_jsonl(tmp_path / "distinct.jsonl", [good_row("a?"), good_row("b?")]), tokenizer)
    assert "distinct problems" not in caplog.text


def test_drop_duplicates_keeps_first_rows_and_their_indices(tmp_path, tokenizer):
    questions = ["a?", "b?", "a?", "c?", "b?", "a?"]
    path = write_jsonl(tmp_path / "six.jsonl", [good_row(q, q[0]) for q in questions])
    every_row = RLDataset(path, tokenizer)
    dataset = RLDataset(path, tokenizer, drop_duplicates=True)
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 1, 3]
    assert [dataset[i]["prompt_ids"] for i in range(3)] == [every_row[row]["prompt_ids"] for row in (0, 1, 3)]
    assert dataset.position_of(3) == 2 and dataset.row_id(2) == 3
    with pytest.raises(DatasetError, match=r"row 2 of the data files is not in .* data\.drop_duplicate_prompts"):
        dataset.position_of(2)
    assert len(every_row) == 6  # the mutation: without dropping, every copy is a prompt


def test_each_problem_is_tokenized_once_kept_or_dropped(tmp_path, tokenizer, monkeypatch):
    rendered = []
    real_template = tokenizer.apply_chat_template

    def counting_template(messages, **kwargs):
        rendered.append(messages[-1]["content"])
        return real_template(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting_template)
    path = write_jsonl(tmp_path / "copies.jsonl", [good_row("a?"), good_row("b?")] * 50)
    RLDataset(path, tokenizer, drop_duplicates=True)
    assert rendered == ["a?", "b?"]
    rendered.clear()
    every_row = RLDataset(path, tokenizer)
    assert rendered == ["a?", "b?"] and len(every_row) == 100
    assert every_row[98]["prompt_ids"] == every_row[0]["prompt_ids"] != every_row[1]["prompt_ids"]


def test_copies_of_an_overlong_prompt_are_all_filtered(tmp_path, tokenizer):
    rows = [good_row("short?"), good_row("a much longer question " * 20)] * 2
    dataset = RLDataset(write_jsonl(tmp_path / "long.jsonl", rows), tokenizer, 40, filter_overlong_prompts=True)
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 2]


def test_same_prompt_with_another_answer_is_its_own_problem_and_warned(tmp_path, tokenizer, caplog):
    rows = [good_row("q?", "2"), good_row("q?", "3"), good_row("q?", "2"), {**good_row("q?", "2"), "data_source": "x"}]
    path = write_jsonl(tmp_path / "conflict.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="nemo_dapo.data"):
        dataset = RLDataset(path, tokenizer, drop_duplicates=True)
    assert [(dataset[i]["index"], dataset[i]["ground_truth"]) for i in range(len(dataset))] == [
        (0, "2"),
        (1, "3"),
        (3, "2"),  # another data source: its own problem
    ]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING).getMessage()
    assert f"1 prompts appear with more than one ground truth (the first: {path} row 0 (line 1) and {path} row 1" in (
        warning
    )


def test_aime_files_fold_into_their_distinct_problems(tokenizer):
    records = read_records([AIME_2024, AIME_2025])
    first_rows: dict[tuple, int] = {}
    for row, record in enumerate(records):
        key = (record.data_source, record.messages[-1]["content"], record.ground_truth)
        first_rows.setdefault(key, row)
    dataset = RLDataset([AIME_2024, AIME_2025], tokenizer, max_prompt_length=4096, drop_duplicates=True)
    assert len(dataset) == 60 and dataset.duplicates.most_copies == 32
    assert [dataset[i]["index"] for i in range(60)] == sorted(first_rows.values())
