"""An error in one line: the reason a step stops with, for what torch raises when a file or a snapshot cannot be
used (reason), and the error a snapshot check raises in words (UnusableSnapshot)."""
import re


class UnusableSnapshot(Exception):
    """What makes a snapshot unusable, in words (reason() shows the message alone, with no type)."""


def reason(error):
    """An error in one line, for the one line a step stops with: `Type: first line of its message` (the type alone when
    there is no message; for a distributed checkpoint's failure, the first failing rank's own error)."""
    if isinstance(error, UnusableSnapshot):
        return str(error)
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint.CheckpointException: {rank: (error, tb)}
    if failures:
        rank, (cause, _) = next(iter(sorted(failures.items())))
        # What makes a snapshot unusable is the same for every rank that reads it: said once, without a rank.
        return reason(cause) if isinstance(cause, UnusableSnapshot) else f"rank {rank}: {reason(cause)}"
    lines = str(error).strip().splitlines() or [""]
    message = lines[0]
    if message.startswith("Cannot use ``weights_only=True`` with TorchScript archives"):
        # torch advises loading it with weights_only=False, which runs the program it holds: not a snapshot's load.
        message = ("not a file of tensors torch.load can read safely (a TorchScript archive: a saved program, not a "
                   "snapshot)")
    elif message.startswith("Weights only load failed"):
        # torch.load's long advice to load with weights_only=False is wrong here: a snapshot is tensors and plain
        # containers, and a file that names code must not be loaded. What it found is the part to show.
        said = re.search(r"WeightsUnpickler error: ([^\n]+)", str(error))
        found = [said[1]] if said else [line.strip() for line in lines[1:]
                                         if line.strip() and not re.match(r"\s*(?:Please|Check|\(\d\))", line)]
        found = [part.split(" was not an allowed global")[0].split(". Please use")[0] for part in found]
        message = "not a file of tensors torch.load can read safely" + (f" ({found[0]})" if found else "")
    elif message.startswith("Error(s) in loading state_dict for") and len(lines) > 1:
        message = f"it holds another model than this {message.split()[-1].rstrip(':')}: " + _state_dict_mismatch(lines[1:])
    elif message.startswith("Missing key in checkpoint state_dict: "):  # a sharded snapshot (DCP) lacks one
        message = f"it holds another model than this run's: it has no {message.split(': ', 1)[1].rstrip('.')}"
    elif message.startswith("Size mismatch between saved"):
        message = f"it holds another model than this run's: its {message.rsplit(' for ', 1)[-1]} has another shape"
    if isinstance(error, OSError) and error.strerror:
        message = error.strerror + (f": {error.filename}" if error.filename else "")
    if not message and isinstance(error, EOFError):
        message = "the file ends too early (empty, or cut short)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _state_dict_mismatch(lines, most=3):
    """load_state_dict's complaints, shortened: `missing a, b, c (+9 more); unexpected d (+2 more); ...`."""
    parts = []
    for line in lines:
        kind, _, rest = line.strip().partition(":")
        keys = re.findall(r'"([^"]+)"', rest)
        if keys:
            more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
            parts.append(f"{kind.split()[0].lower()} {', '.join(keys[:most])}{more}")
        elif kind.startswith("size mismatch"):
            parts.append(f"{kind}: another shape")
    return "; ".join(parts[:3]) or lines[0].strip()
