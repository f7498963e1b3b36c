"""The schema read as documentation: ``nemo-dapo config --explain KEY`` and docs/configuration.md.

``nemo-dapo config --reference > docs/configuration.md`` regenerates the file; a test fails
when the committed one is stale.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from omegaconf import OmegaConf

from nemo_dapo.config.fields import Setting, section_help, settings
from nemo_dapo.config.load import list_presets, read_preset
from nemo_dapo.errors import ConfigError

REFERENCE_HEADER = """# Configuration reference

Generated from `nemo_dapo/config/schema.py` by `nemo-dapo config --reference > docs/configuration.md`;
do not edit by hand (a test compares the two). One setting: `nemo-dapo config --explain KEY`.
Set any key in a preset under `conf/` or on the command line (`actor.clip_ratio_high=0.28`).
"""


def _shown(value: Any) -> str:
    """A value as YAML and the command line spell it (true, null, "left")."""
    return json.dumps(value)


def presets_setting(key: str) -> dict[str, Any]:
    """Presets in conf/ that set ``key`` (themselves or through their ``defaults:``), with the value."""
    found = {}
    for name in list_presets():
        value = OmegaConf.select(read_preset(name), key, default="<unset>")
        if value != "<unset>":
            found[name] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    return found


def explain(key: str) -> str:
    """What ``nemo-dapo config --explain KEY`` prints."""
    known = settings()
    if key not in known:
        nearby = [k for k in known if k.startswith(key + ".") or k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
        hint = f" did you mean {', '.join(nearby[:8])}?" if nearby else " `nemo-dapo config --reference` lists all."
        raise ConfigError(f"config --explain {key}: no such setting;{hint}")
    setting = known[key]
    lines = [
        setting.key,
        textwrap.fill(setting.help, 100, initial_indent="  ", subsequent_indent="  "),
        f"  type: {setting.type_name}    default: {_shown(setting.default)}",
    ]
    if setting.choices is not None:
        lines.append(f"  allowed: {setting.allowed_text()}")
    if setting.bounds is not None:
        lines.append(f"  {setting.bounds_text()}")
    presets = presets_setting(key)
    listed = ", ".join(f"{name} ({_shown(value)})" for name, value in presets.items())
    lines.append(
        textwrap.fill(f"set by presets: {listed or 'none'}", 100, initial_indent="  ", subsequent_indent="    ")
    )
    return "\n".join(lines)


def _allowed_markdown(setting: Setting) -> str:
    """The choices as the reference lists them. A registry users extend is not listed (the page
    would depend on what was imported): ``--explain`` shows its names at run time."""
    if setting.bounds is not None:
        return f" {setting.bounds_text().capitalize()}."
    if setting.declared_choices is None:
        return ""
    if callable(setting.declared_choices):
        return " Allowed: a registered name (`nemo-dapo config --explain` lists them)."
    return f" Allowed: {', '.join('null' if c is None else f'`{c}`' for c in setting.choices)}."


def reference_markdown() -> str:
    """``docs/configuration.md``: one table per group, every leaf with type, default and help."""
    groups: dict[str, list[Setting]] = {}
    for setting in settings().values():
        groups.setdefault(setting.key.rsplit(".", 1)[0], []).append(setting)
    helps = section_help()
    parts = [REFERENCE_HEADER]
    for group, members in groups.items():
        parts.append(
            f"\n## `{group}`\n\n{helps[group]}\n\n| key | type | default | description |\n| --- | --- | --- | --- |"
        )
        for s in members:
            allowed = _allowed_markdown(s)
            text = (s.help + allowed).replace("|", "\\|").replace("<", "&lt;")
            parts.append(f"| `{s.key.rsplit('.', 1)[1]}` | {s.type_name} | `{_shown(s.default)}` | {text} |")
    return "\n".join(parts) + "\n"
