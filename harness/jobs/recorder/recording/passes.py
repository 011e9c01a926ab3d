"""The pass over a DataLoader under way, as the parts that fill a line of samples.jsonl share it (samples.py writes
the line; the others note into `_now` what the pass saw). No torch here: the other parts import it."""

_passes = [0]  # passes over a DataLoader begun by this process
# What the pass under way has seen (its keys, and who notes them):
#   in_pass: a pass is under way (samples.py); batch: the size of its batch (samples.py);
#   in_ddp: calls of a DistributedDataParallel's forward under way, bypass: the first stack that called the model
#   inside one directly, mesh: this rank's coordinates in a named device mesh (models.py);
#   loss, samples, losses: the losses backward() was called on (losses.py); draws: the dropout draws (draws.py);
#   reduce_scatter_dtypes (sharded.py); positions and scores: step 9's ring (context.py); routes: step 10's
#   (routes.py); rank: this process's rank as its last pass ended (samples.py, for exits.py).
_now = dict(in_pass=False, in_ddp=0, batch=0, loss=0.0, samples=0, bypass=None, rank=None, mesh=None, draws={},
            reduce_scatter_dtypes=set())
