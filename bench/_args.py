"""Argument types the benchmarks share: a nonsense count or size is refused by argparse, with
the option's name, before anything is measured."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(floor: int) -> Callable[[str], int]:
    """A whole number >= ``floor``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give a whole number >= {floor}, got {text!r}"
                                             ) from None
        if value < floor:
            raise argparse.ArgumentTypeError(f"must be >= {floor}, got {value}")
        return value

    parse.__name__ = f"whole number >= {floor}"  # argparse names a type by it
    return parse


def finite(*, above: float | None = None, at_least: float | None = None
           ) -> Callable[[str], float]:
    """A finite number > ``above`` or >= ``at_least``."""
    bound = f"> {above:g}" if above is not None else f">= {at_least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give a finite number {bound}, got {text!r}"
                                             ) from None
        if not math.isfinite(value) or (above is not None and value <= above) or (
                at_least is not None and value < at_least):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {value:g}")
        return value

    parse.__name__ = f"finite number {bound}"
    return parse
