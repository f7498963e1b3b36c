"""``nemo-dapo export`` and ``import-gguf`` never delete a folder the user named: a non-empty one is
refused (exit 2) unless ``--overwrite``, which replaces the model (all its weight files: an
older model's shards never mix with the new ones) and the files the command writes, nothing else."""

import torch

from nemo_dapo.cli import main
from nemo_dapo.trainer.checkpoint import CheckpointManager


def a_checkpoint(root, model_dir):
    def write(folder):
        model = folder / "policy" / "model"
        model.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (model / name).write_bytes((model_dir / name).read_bytes())

    return CheckpointManager(root).save(3, write)


def test_export_refuses_a_non_empty_folder_and_overwrite_keeps_other_files(tmp_path, tiny_model_dir, capsys):
    checkpoint = a_checkpoint(tmp_path / "checkpoints", tiny_model_dir)
    out = tmp_path / "my_models"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    (out / "config.json").write_text("{}")
    for old in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (out / old).write_text("an older model's weights")
    code = main(["export", str(checkpoint), str(out), "--tokenizer", str(tiny_model_dir)])
    err = capsys.readouterr().err
    assert code == 2 and f"{out}: exists and is not empty" in err and "--overwrite" in err, err
    assert len(list(out.iterdir())) == 5  # nothing touched
    assert main(["export", str(checkpoint), str(out), "--tokenizer", str(tiny_model_dir), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "a user's own file"
    assert (out / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()  # replaced
    # the Megatron loader reads the files the folder's index names (else model.safetensors), as
    # transformers does: a stray shard is not read
    import json

    from safetensors.torch import save_file

    from nemo_dapo.policy.megatron.model import read_hf_weights

    names = set(read_hf_weights(str(tiny_model_dir)))
    save_file({"stray.weight": torch.zeros(2)}, out / "model-00002-of-00002.safetensors")
    assert set(read_hf_weights(str(out))) == names
    index = {"weight_map": {name: "model.safetensors" for name in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(read_hf_weights(str(out))) == names
    fresh = tmp_path / "fresh"
    assert main(["export", str(checkpoint), str(fresh), "--tokenizer", str(tiny_model_dir)]) == 0
    assert not list(tmp_path.glob(".*.tmp"))  # no staging folder left behind


def test_import_gguf_refuses_a_non_empty_folder_before_reading_anything(tmp_path, capsys):
    out = tmp_path / "models"
    out.mkdir()
    (out / "keep.bin").write_bytes(b"precious")
    assert main(["import-gguf", str(tmp_path / "missing.gguf"), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.bin").read_bytes() == b"precious"
