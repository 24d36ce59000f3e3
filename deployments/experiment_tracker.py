"""ExperimentTracker deployment: a thin shell over :class:`alloy.storage.tracker.ExperimentTracker`.

Its buffers are flushed on graceful shutdown (``__del__`` runs after Serve drained the replica), which is the
spec's shutdown step 3.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from deployments.runtime import open_services

logger = logging.getLogger("alloy.storage.tracker")


@serve.deployment(name="ExperimentTracker", max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1})
class ExperimentTrackerDeployment:
    def __init__(self, args: dict[str, Any]):
        self.args, self.services = open_services(args)

    @property
    def tracker(self):
        return self.services.tracker

    def list_experiments(self, offset: int = 0, limit: int = 50):
        return self.tracker.list_experiments(offset=offset, limit=limit)

    def get_experiment(self, experiment_id: str):
        return self.tracker.get_experiment(experiment_id)

    def flush(self) -> int:
        return self.tracker.flush()

    def health(self) -> dict[str, Any]:
        self.tracker  # noqa: B018 - opens the tracker: an import or schema problem shows here
        return {"status": "healthy"}

    def __del__(self):
        if "tracker" not in self.services.__dict__:
            return  # never opened: nothing buffered
        try:
            self.tracker.flush()
        except Exception:
            logger.exception("tracker flush on shutdown failed")
