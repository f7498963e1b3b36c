"""The schema documents itself: help text on every leaf, `config --explain`, and a generated
docs/configuration.md that may not go stale. Validation reads its allowed values from the schema."""

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dapo.algo.advantage import register_adv_est, registered_estimators
from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.config.fields import settings
from nemo_dapo.config.reference import explain, reference_markdown

REPO = Path(__file__).resolve().parents[1]


def test_every_leaf_setting_has_help_text():
    keys = settings()
    assert len(keys) > 100 and "actor.megatron.fp8" in keys and "reward.overlong_buffer.len" in keys
    missing = [k for k, s in keys.items() if len(s.help) < 12]
    assert missing == []


def test_explain_names_help_type_default_choices_and_presets():
    text = explain("actor.clip_ratio_high")
    assert "clip-higher" in text and "arXiv 2503.14476" in text
    assert "type: float    default: 0.28" in text
    assert "dapo_qwen2.5_32b (0.28)" in text and "tiny_cpu (0.28)" in text
    fp8 = explain("actor.megatron.fp8")
    assert "allowed: ['null', 'hybrid', 'e4m3']" in fp8 and "default: null" in fp8
    # a preset that sets the key through its `defaults:` counts, with its own value
    assert "dapo_qwen3_30b_a3b (8)" in explain("actor.megatron.expert_model_parallel_size")


def test_explain_of_an_unknown_key_suggests_the_full_one():
    with pytest.raises(ConfigError, match=r"no such setting; did you mean actor\.clip_ratio_c\?"):
        explain("clip_ratio_c")


def test_cli_explains_and_exits_2_on_unknown_keys():
    run = [sys.executable, "-m", "nemo_dapo.cli", "config"]
    ok = subprocess.run(run + ["--explain", "algorithm.kl_penalty"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and "allowed: ['abs', 'abs+', 'full'," in ok.stdout, ok.stderr
    bad = subprocess.run(run + ["--explain", "actor.nope"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "actor.nope" in bad.stderr


def test_docs_configuration_md_is_generated_from_the_schema():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), (
        "docs/configuration.md is stale: run `nemo-dapo config --reference > docs/configuration.md`"
    )
    assert "| `clip_ratio_c` | float | `10.0` |" in committed


def test_validation_takes_the_allowed_values_from_the_schema():
    with pytest.raises(ConfigError, match=r"actor\.megatron\.fp8_recipe='fp4': choose one of \['blockwise', "):
        load_config("tiny_cpu", ["actor.backend=megatron", "actor.megatron.fp8_recipe=fp4"])
    with pytest.raises(ConfigError, match=r"trainer\.loggers=\['console', 'neptune'\]: choose one of"):
        load_config("tiny_cpu", ["trainer.loggers=[console,neptune]"])
    # null means "take the preset's value" for an optional enumeration without null among its choices
    assert load_config("tiny_cpu", ["algorithm.rollout_correction.rollout_is=null"])


def test_a_registered_estimator_becomes_a_valid_choice():
    name = "test_reference_estimator"
    if name not in registered_estimators():
        register_adv_est(name)(lambda **kwargs: None)
    assert load_config("tiny_cpu", [f"algorithm.adv_estimator={name}"]).algorithm.adv_estimator == name
    assert name in explain("algorithm.adv_estimator")
