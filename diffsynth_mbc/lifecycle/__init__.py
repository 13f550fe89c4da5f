"""The run as processes: the launcher's supervisor, the stop command, the run's lock, signals, /proc checks."""
