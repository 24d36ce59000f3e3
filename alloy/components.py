"""The names every layer agrees on: the Serve application, its components and which engine runs which job kind.

Deployment names are the component names; ``configs/serve*.yaml``, the ingress's handle lookups, the lifecycle's
pool snapshots and health checks all use these constants, so a rename happens here only.
"""

from __future__ import annotations

APP_NAME = "alloy"  # the Serve application (handles are looked up by it at runtime)
RAY_NAMESPACE = "alloy"  # the namespace `alloy start` connects its driver in

MODEL_REGISTRY = "ModelRegistry"
DATASET_REGISTRY = "DatasetRegistry"
EXPERIMENT_TRACKER = "ExperimentTracker"
ARTIFACT_STORE = "ArtifactStore"
MERGE_ENGINE = "MergeEngine"
EVALUATION_ENGINE = "EvaluationEngine"
EVOLUTION_ENGINE = "EvolutionEngine"
INGRESS = "Ingress"

# The job engines: their replica pools are snapshotted for warm starts and may ask for GPUs.
ENGINES = (MERGE_ENGINE, EVALUATION_ENGINE, EVOLUTION_ENGINE)
# Every component behind the ingress (what a cold start health-checks).
BACKENDS = (MODEL_REGISTRY, DATASET_REGISTRY, EXPERIMENT_TRACKER, ARTIFACT_STORE, *ENGINES)
# The engine that runs each job kind (keys are the values of alloy.jobs.records.JobKind).
ENGINE_OF_KIND = {"merge": MERGE_ENGINE, "evaluation": EVALUATION_ENGINE, "evolution": EVOLUTION_ENGINE}
