"""The options shared by the ops that take or give an extra tensor (AddExtraInput,
MakeExtraOutput): how they label themselves."""

from __future__ import annotations

from typing import Optional


class ExtraTensorOptions:
    """``describe`` and ``extra_repr`` from ``channel`` and ``in_place``: the bare class
    name when neither is set."""

    channel: Optional[str]  # both set by the op's constructor
    in_place: bool

    def describe(self) -> str:
        options = self.extra_repr()
        return f"{type(self).__name__}({options})" if options else type(self).__name__

    def extra_repr(self) -> str:
        return ", ".join(([f"channel={self.channel!r}"] if self.channel else [])
                         + (["in_place=True"] if self.in_place else []))
