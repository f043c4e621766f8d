"""What a run writes and reads: checkpoints, the run directory, logging sinks, exports."""
