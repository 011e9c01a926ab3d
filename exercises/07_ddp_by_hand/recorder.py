"""Recorder plugin of exercise 7 (DDP by hand): two measurements of the collectives' recorder (JOB_RECORD_COLLECTIVES)
that cost time a benchmark of the same job would see, switched on.

Named in JOB_RECORD_PLUGINS (by this file's path), it makes
  - each asynchronous all_reduce run on a copy of the tensor it was given, copied back into the tensor at its first
    wait (by its Work, or a future chained to it): a write into the tensor before that wait is seen whatever the
    timing (`written` in collectives.jsonl's "wait" lines; sitecustomize's _NotedWork says how);
  - each "step" line of collectives.jsonl list, as `held`, the tensors given to collectives still alive as the step
    begins (a list of buckets in flight never emptied keeps every step's).
"""
import sitecustomize

sitecustomize._OPTIONS.update(copy_in_flight=True, note_held=True)
