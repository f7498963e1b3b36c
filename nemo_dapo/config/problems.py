"""What start-up validation collects: every problem of a config, each naming the key, the value
and what is allowed, reported together so a user fixes a config in one go."""

from __future__ import annotations

from nemo_dapo.errors import ConfigError


class Problems(list):
    """The problems found so far; :meth:`require` adds one where a condition fails."""

    def require(self, ok: bool, key: str, value, allowed: str) -> None:
        if not ok:
            self.append(f"{key}={value!r}: {allowed}")


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
