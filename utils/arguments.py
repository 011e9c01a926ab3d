"""argparse types for the steps' options: whole numbers and numbers in range, each refused in one line that
says what it must be."""
import argparse


def _whole_number(text, least, says):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{says}, got {value}")
    return value


def positive_int(text):
    """argparse type: a whole number >= 1 (epochs, save interval, batch size, processes)."""
    return _whole_number(text, 1, "must be at least 1")


def non_negative_int(text):
    """argparse type: a whole number >= 0, where 0 turns a thing off (loader processes that read ahead)."""
    return _whole_number(text, 0, "must be 0 or more")


def _number(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value:
        raise argparse.ArgumentTypeError("expected a number, got nan")
    return value


def positive_number(text):
    """argparse type: a number > 0; `inf` is one (e.g. a gradient-norm limit that never clips)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_number(text):
    """argparse type: a finite number >= 0, where 0 turns a thing off (a loss's weight, a capacity factor)."""
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, and finite, got {text}")
    return value


def probability(text):
    """argparse type: a probability of dropping, from 0 (never: exact comparisons) up to, not including, 1."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be from 0 up to (not including) 1, got {text}")
    return value
