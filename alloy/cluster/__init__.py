"""The cluster lifecycle without Ray: persisted state, start and stop sequences, recovery, dependency checks."""
