"""argparse value types shared by the command line (cli.py) and the training script (train.py).

Each one raises ``argparse.ArgumentTypeError`` with the bad value and what to give instead, so that
argparse exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import math

import torch


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows "(default: X)" after every option that has a default; options whose default depends
    on the device (None here) say so in their help text instead of "(default: None)"."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action, argparse._StoreTrueAction) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse's default prints the whole usage
    block first): ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def bool_arg(s: str) -> bool:
    low = s.lower()
    if low in ("1", "true", "yes", "on", "y", "t"):
        return True
    if low in ("0", "false", "no", "off", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"{s!r} is not a bool: use true or false")


def positive_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be a positive integer")
    return n


def nonnegative_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be 0 or more")
    return n


def device_arg(s: str) -> str:
    """A device string that exists on this machine (checked now, not at the first tensor)."""
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{s!r}: no CUDA GPU is available here (torch {torch.__version__}, CUDA build: "
                f"{torch.version.cuda or 'none'}); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{s!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise argparse.ArgumentTypeError(f"{s!r}: the {dev.type} backend is not available here; use cpu")
    return s


def _float(s: str) -> float:
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number")
    return x


def positive_float(s: str) -> float:
    x = _float(s)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be a positive number")
    return x


def nonnegative_float(s: str) -> float:
    x = _float(s)
    if x < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be 0 or more")
    return x


def unit_float(s: str) -> float:
    """A number in [0, 1]."""
    x = _float(s)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be between 0 and 1")
    return x


def positive_int_list(s: str) -> tuple[int, ...]:
    """Comma-separated positive integers, e.g. ``16,64,128``."""
    return tuple(positive_int(x.strip()) for x in s.split(","))
