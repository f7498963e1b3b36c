"""`nemo-dapo plot`: curves from metrics.jsonl land as readable PNG files in RUN_DIR/plots/."""

import json
import math

import matplotlib.image

from nemo_dapo.cli import main
from nemo_dapo.commands.plot import matching, read_metrics

EXPECTED = ("reward.png", "accuracy.png", "response_length.png", "entropy.png", "clip_fraction.png", "timing.png")


def write_run(run_dir, steps=40):
    """Metrics as the Tracker writes them: one line per step, validation on its own line."""
    lines = [{"step": 0, "time": 0.0, "val-core/arith/acc/mean@4": 0.2}]
    for step in range(1, steps + 1):
        progress = step / steps
        lines.append(
            {
                "step": step,
                "time": float(step),
                "critic/score/mean": -1 + 1.5 * progress,
                "critic/rewards/mean": -1 + 1.4 * progress,
                "critic/acc/mean": 0.2 + 0.6 * progress,
                "response_length/mean": 100 + 50 * math.sin(step),
                "response_length/max": 300.0,
                "response_length/min": 10.0,
                "actor/entropy": 1.0 - 0.5 * progress,
                "actor/pg_clipfrac": 0.02,
                "actor/pg_clipfrac_lower": 0.001,
                "timing_s/gen": 10.0,
                "timing_s/reward": 0.5,
                "timing_s/old_log_prob": 2.0,
                "timing_s/update_actor": 5.0 + step % 3,
                "timing_s/sync_weights": 1.0,
            }
        )
        if step % 10 == 0:
            lines.append({"step": step, "time": float(step), "val-core/arith/acc/mean@4": 0.2 + 0.5 * progress})
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"step": 41, "critic/sc'  # killed mid-write
    (run_dir / "metrics.jsonl").write_text(text)


def test_reader_keeps_validation_points_and_skips_a_partial_line(tmp_path):
    write_run(tmp_path)
    series, skipped = read_metrics(tmp_path / "metrics.jsonl")
    assert skipped == 1
    assert [step for step, _ in series["val-core/arith/acc/mean@4"]] == [0, 10, 20, 30, 40]
    assert len(series["critic/score/mean"]) == 40 and "time" not in series
    assert matching(series, ("critic/acc/mean", "val-core/*")) == ["critic/acc/mean", "val-core/arith/acc/mean@4"]


def test_plot_writes_every_curve_as_png(tmp_path, capsys):
    write_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0
    for name in EXPECTED:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 10_000, name  # a drawn figure, not an empty canvas
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 400 and image.shape[1] >= 800
        assert image[..., :3].std() > 0.05  # not a blank image
    assert str(tmp_path / "plots" / "timing.png") in capsys.readouterr().out


def test_only_curves_with_data_are_drawn(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/entropy": 0.5}) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["entropy.png"]


def test_missing_metrics_file_is_reported(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err
