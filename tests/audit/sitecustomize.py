"""Loaded by every Python process of an audited test job (it is first on PYTHONPATH): records each torch.save.

Each call appends `pid<TAB>rank<TAB>path` to the file named by AUDIT_WRITES_TO, so a test can tell how many
processes wrote checkpoints and which rank they were. Nothing else about the job changes.
"""
import os

if os.environ.get("AUDIT_WRITES_TO"):
    import torch
    import torch.distributed as dist

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        result = _save(obj, f, *args, **kwargs)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "-"
        with open(os.environ["AUDIT_WRITES_TO"], "a") as record:
            record.write(f"{os.getpid()}\t{rank}\t{os.path.abspath(str(f))}\n")
        return result

    torch.save = _recording_save
