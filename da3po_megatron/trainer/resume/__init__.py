"""What a run keeps in its ``run_dir``, checks on resume and protects: checkpoints (``checkpoint``, ``best``), the
driver's part of a checkpoint (``run_state``), the run record and config drift (``config_drift``, ``async_resume``),
the run-directory lock (``lock``) and the launch history (``history``)."""
