"""Persistence: the database, artifacts, the experiment tracker, API keys and caches."""
