"""What every part of the recorder notes with: the folder the records go into, a line appended to one of its files,
the process's rank and torchrun's restart count, the calling lines outside the installation, and a patch applied to a
module when (if ever) the job imports it. Nothing here imports torch: the recorder loads before the job does."""
import importlib.abc
import importlib.util
import os
import sys

# The folder of the job's records (harness/jobs sets it; without it nothing is recorded).
RECORD_DIR = os.environ.get("JOB_RECORD_DIR")
# The recorder's own folder (sitecustomize.py, this package, plugins/): no frame of it is a caller worth naming.
RECORDER = os.path.dirname(os.path.dirname(__file__))


def _rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def _append(name, line):
    with open(os.path.join(RECORD_DIR, name), "a") as record:
        record.write(line + "\n")


def _restart():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


# The plugins' files (JOB_RECORD_PLUGINS), filled as sitecustomize.py loads them: their frames are the recorder's, not
# the program's, wherever a plugin lives (an exercise's recorder.py is outside this folder).
_PLUGIN_FILES = []


def _installed():
    return sys.base_prefix, sys.prefix, os.path.dirname(os.__file__), RECORDER, *_PLUGIN_FILES


def _stack():
    """The calling frames outside the Python and torch installation (the script's, the repository's), outermost
    first, as [file, line, function]."""
    import traceback

    installed = _installed()
    return [[frame.filename, frame.lineno, frame.name] for frame in traceback.extract_stack()[:-2]
            if not frame.filename.startswith(installed) and "site-packages" not in frame.filename
            and not frame.filename.startswith("<")]


def _caller():
    """The innermost calling frame outside the Python and torch installation: [file, line, function]."""
    import traceback

    installed = _installed()
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(installed) and "site-packages" not in frame.filename:
            return [frame.filename, frame.lineno, frame.name]
    return None


def _training_step(optimizer):
    """Whether an optimizer step trains: a step at a learning rate of 0 does not (torch.distributed.checkpoint takes
    one to give an optimizer its state before it loads a snapshot's), and is not counted."""
    return not all(float(group.get("lr", 1.0)) == 0.0 for group in optimizer.param_groups)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the module `name` as it is imported, if it ever is, before anything imports names from it."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def execute_and_patch(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = execute_and_patch
        return spec


def patch_on_import(name, patch):
    """Call patch(module) once the module `name` is imported, if it ever is: the job pays for no import it skips."""
    sys.meta_path.insert(0, _PatchOnImport(name, patch))
