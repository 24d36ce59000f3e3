"""Job records and the one way a job is run: store, liveness (heartbeat, orphan sweep), runner skeleton."""
