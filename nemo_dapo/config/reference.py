"""The schema read as documentation: every leaf setting with its help, type, default and choices.

One walk over the dataclasses of ``config/schema.py`` serves three readers: start-up validation
(the allowed values), ``nemo-dapo config --explain KEY`` and the generated
``docs/configuration.md`` (``nemo-dapo config --reference``; a test fails when the file is stale).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

from omegaconf import OmegaConf

from nemo_dapo.config.schema import Config

REFERENCE_HEADER = """# Configuration reference

Generated from `nemo_dapo/config/schema.py` by `nemo-dapo config --reference > docs/configuration.md`;
do not edit by hand (a test compares the two). One setting: `nemo-dapo config --explain KEY`.
Set any key in a preset under `conf/` or on the command line (`actor.clip_ratio_high=0.28`).
"""


@dataclass(frozen=True)
class Setting:
    """One leaf of the schema, e.g. ``actor.clip_ratio_high``."""

    key: str
    type_name: str
    default: Any
    help: str
    declared_choices: Any  # a tuple, a function returning the names of a registry, or None

    @property
    def choices(self) -> tuple | None:
        found = self.declared_choices
        return tuple(found()) if callable(found) else found

    def value_in(self, cfg: Config) -> Any:
        value = cfg
        for part in self.key.split("."):
            value = getattr(value, part)
        return value

    def allowed_text(self) -> str:
        """The choices as validation names them: declared order with null, else sorted."""
        choices = self.choices
        if None in choices:
            return str(["null" if c is None else c for c in choices])
        return str(sorted(map(str, choices)))


def _type_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union:
        return f"{_type_name(args[0])} or null"
    if typing.get_origin(annotation) is list:
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _walk(cls: type, prefix: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            yield from _walk(annotation, f"{prefix}{field.name}.")
            continue
        yield Setting(f"{prefix}{field.name}", _type_name(annotation), _default(field), field.metadata.get("help", ""),
                      field.metadata.get("choices"))


@lru_cache(maxsize=1)
def settings() -> dict[str, Setting]:
    """Every leaf setting by dotted key, in schema order."""
    return {s.key: s for s in _walk(Config, "")}


def section_help() -> dict[str, str]:
    """The help text of every nested group (``actor.megatron``, ...), by dotted key."""
    found: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[field.name]):
                found[prefix + field.name] = field.metadata.get("help", "")
                walk(hints[field.name], f"{prefix}{field.name}.")

    walk(Config, "")
    return found


def _shown(value: Any) -> str:
    """A value as YAML and the command line spell it (true, null, "left")."""
    return json.dumps(value)


def presets_setting(key: str) -> dict[str, Any]:
    """Presets in conf/ that set ``key`` (themselves or through their ``defaults:``), with the value."""
    from nemo_dapo.config.load import list_presets, read_preset

    found = {}
    for name in list_presets():
        value = OmegaConf.select(read_preset(name), key, default="<unset>")
        if value != "<unset>":
            found[name] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    return found


def explain(key: str) -> str:
    """What ``nemo-dapo config --explain KEY`` prints."""
    from nemo_dapo.config.validate import ConfigError

    known = settings()
    if key not in known:
        nearby = [k for k in known if k.startswith(key + ".") or k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
        hint = f" did you mean {', '.join(nearby[:8])}?" if nearby else " `nemo-dapo config --reference` lists all."
        raise ConfigError(f"config --explain {key}: no such setting;{hint}")
    setting = known[key]
    lines = [setting.key, textwrap.fill(setting.help, 100, initial_indent="  ", subsequent_indent="  "), f"  type: {setting.type_name}    default: {_shown(setting.default)}"]
    if setting.choices is not None:
        lines.append(f"  allowed: {setting.allowed_text()}")
    presets = presets_setting(key)
    listed = ", ".join(f"{name} ({_shown(value)})" for name, value in presets.items())
    lines.append(textwrap.fill(f"set by presets: {listed or 'none'}", 100, initial_indent="  ",
                               subsequent_indent="    "))
    return "\n".join(lines)


def reference_markdown() -> str:
    """``docs/configuration.md``: one table per group, every leaf with type, default and help."""
    groups: dict[str, list[Setting]] = {}
    for setting in settings().values():
        groups.setdefault(setting.key.rsplit(".", 1)[0], []).append(setting)
    helps = section_help()
    parts = [REFERENCE_HEADER]
    for group, members in groups.items():
        parts.append(f"\n## `{group}`\n\n{helps[group]}\n\n| key | type | default | description |\n| --- | --- | --- | --- |")
        for s in members:
            allowed = f" Allowed: {', '.join('null' if c is None else f'`{c}`' for c in s.choices)}." \
                if s.choices is not None else ""
            text = (s.help + allowed).replace("|", "\\|").replace("<", "&lt;")
            parts.append(f"| `{s.key.rsplit('.', 1)[1]}` | {s.type_name} | `{_shown(s.default)}` | {text} |")
    return "\n".join(parts) + "\n"
