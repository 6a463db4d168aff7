"""What a run tells about itself: the metrics log (``metrics``), one step's metrics from its parts (``step_metrics``,
pure), profiling and phase timing (``profiling``) and the console line (``console``)."""
