"""The recorder's parts, one module for each thing it records or injects; ../sitecustomize.py reads the environment
and loads the ones a job asks for, in order. The folder above this one is on the job's PYTHONPATH, so the package is
imported as `recording`. Each module's docstring says what it records and into which file of JOB_RECORD_DIR."""
