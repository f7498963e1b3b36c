"""Bad input ends in exit 2 and a message naming the file, field or argument and the fix: never a
traceback (exit 1, which a batch job requeues twice as a crash), and, for `train`, before Ray
starts. Each case is a real file or argument given to the real command line, in this process."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nemo_dapo.cli import main
from nemo_dapo.cluster import ray_env

# a case writes its files into a folder and returns the command line and what its message must say
Case = Callable[[Path, Path], tuple[list[str], list[str]]]


def write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def yaml_list(tmp: Path, model: Path):
    path = write(tmp / "list.yaml", "- trainer: {total_training_steps: 3}\n")
    return ["config", "--config", str(path)], [f"config {path}: its top level is a list", "a mapping of sections"]


def yaml_unclosed(tmp: Path, model: Path):
    path = write(tmp / "broken.yaml", "trainer: {total_training_steps: 3\n")
    return ["config", "--config", str(path)], [f"config {path}: not a YAML file", "line 2", "an unclosed bracket"]


def yaml_python_tag(tmp: Path, model: Path):
    path = write(tmp / "tagged.yaml", f"trainer: !!python/object/apply:os.system ['touch {tmp / 'ran'}']\n")
    return ["config", "--config", str(path)], [f"config {path}: not a YAML file", "python/object/apply", "'!!' tag"]


def train_on(data_file: Path, tmp: Path) -> list[str]:
    return ["train", f"data.train_files=[{data_file}]", f"trainer.output_dir={tmp / 'run'}"]


def jsonl_not_utf8(tmp: Path, model: Path):
    path = write(tmp / "latin1.jsonl", '{"prompt": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"))
    return train_on(path, tmp), [f"{path} line 1: not UTF-8 text", "save the file as UTF-8"]


def not_parquet(tmp: Path, model: Path):
    path = write(tmp / "rows.parquet", "prompt,answer\n1+1,2\n")
    return train_on(path, tmp), [f"{path}: not a parquet file pyarrow can read", "give the rows as a .jsonl file"]


def output_dir_is_a_file(tmp: Path, model: Path):
    path = write(tmp / "run", "a file, not a folder\n")
    return ["train", f"trainer.output_dir={path}"], [f"trainer.output_dir={path}: a file is in the way", "move the"]


def plan_storage_zero(tmp: Path, model: Path):
    argv = ["plan", "dapo_qwen2.5_32b", "--storage-gb-per-s", "0"]
    return argv, ["argument --storage-gb-per-s: 0 is not a size: give a number above 0"]


def plan_negative_gpu_memory(tmp: Path, model: Path):
    argv = ["plan", "dapo_qwen2.5_32b", "--gpu-memory-gib", "-5"]
    return argv, ["argument --gpu-memory-gib: -5 is not a size: give a number above 0"]


def bringup_partial_stop(tmp: Path, model: Path):
    run = tmp / "bringup_run"
    run.mkdir()
    stop = '{"step": 2, "signal": "SIGUSR1", "time": 1.0, "checkpoint": null, "progressed": true}\n'
    path = write(run / "preemptions.jsonl", stop + '{"step": 4, "sig')
    return ["bringup", str(run)], [f"{path} line 2: not a stop record", "delete that line"]


def bringup_missing_job_log(tmp: Path, model: Path):
    (tmp / "bringup_run").mkdir()
    log = tmp / "slurm-1.out"
    return ["bringup", str(tmp / "bringup_run"), "--job-log", str(log)], [f"--job-log {log}: no such file"]


def tokenizer_without_chat_template(tmp: Path, model: Path):
    folder = tmp / "base_model"
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("chat_template.jinja", "data"))
    argv = ["train", f"model.path={folder}", f"trainer.output_dir={tmp / 'run'}"]
    return argv, [f"{folder}: its tokenizer has no chat template", "model.path", "chat_template.jinja"]


def pools_of_mixed_devices(tmp: Path, model: Path):
    argv = ["train", "trainer.rollout_pool.nnodes=2", "rollout.num_workers=2", f"trainer.output_dir={tmp / 'run'}"]
    return argv, ["trainer.rollout_pool.n_gpus_per_node=8: both pools have GPUs or neither"]


def pools_through_nemo_run(tmp: Path, model: Path):
    argv = ["launch", "--executor", "slurm", "--dryrun", "trainer.rollout_pool.nnodes=2"]
    return argv, ["trainer.rollout_pool.nnodes=2: two pools need a Slurm heterogeneous job", "slurm/dapo_pools.sbatch"]


CASES: list[Case] = [
    yaml_list,
    yaml_unclosed,
    yaml_python_tag,
    jsonl_not_utf8,
    not_parquet,
    output_dir_is_a_file,
    plan_storage_zero,
    plan_negative_gpu_memory,
    bringup_partial_stop,
    bringup_missing_job_log,
    tokenizer_without_chat_template,
    pools_of_mixed_devices,
    pools_through_nemo_run,
]


def ray_must_not_start(*args, **kwargs):
    raise AssertionError("Ray started: the bad input was not refused first")


@pytest.mark.parametrize("case", CASES, ids=[case.__name__ for case in CASES])
def test_bad_input_exits_2_naming_it_without_a_traceback(case, tmp_path, tiny_model_dir, monkeypatch, capsys):
    argv, named = case(tmp_path, tiny_model_dir)
    monkeypatch.setattr(ray_env, "init_ray", ray_must_not_start)
    try:
        code = main(argv)
    except SystemExit as refused:  # argparse's own refusal of an argument
        code = refused.code
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert [text for text in named if text not in err] == [], err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("case", [jsonl_not_utf8, not_parquet], ids=["jsonl_not_utf8", "not_parquet"])
def test_reading_the_rows_refuses_those_files_alike(case, tmp_path, tiny_model_dir):
    """What `nemo-dapo eval` and a run's data load read the rows with, past the start-up check."""
    from nemo_dapo.data.records import DatasetError, read_records

    argv, named = case(tmp_path, tiny_model_dir)
    with pytest.raises(DatasetError) as refused:
        read_records(argv[1].removeprefix("data.train_files=[").removesuffix("]"))
    assert named[0] in str(refused.value)
