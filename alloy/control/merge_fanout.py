"""The Ray side of a fanned-out merge: each group of output shards is a Ray task, placed on any node
(``SPREAD``: groups go to different nodes first) with ``merge.threads`` CPUs, and a GPU when the profile has one.

A group task is a streaming generator: it yields the group's progress while the merge runs in a thread of the
task, then its result; a pump thread per group in the coordinating replica forwards each to the coordinator
(:class:`alloy.jobs.merge_fanout.FanoutCoordinator`). Retries are the coordinator's (bounded, and only for
failures another attempt may not meet), so the task itself never retries. Tasks are owned by the coordinating
replica: if it dies, Ray stops them with it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch

from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.merge_fanout import GroupEvent, GroupFailure
from alloy.jobs.merge_group import DETERMINISTIC_CODES, group_services, run_group
from alloy.merge.fanout import GroupResult, GroupSpec
from alloy.merge.recipe import MergeRecipe

logger = logging.getLogger("alloy.merge.fanout")

LOST = "its worker or node was lost"
LoadSettings = Callable[[], Settings]  # called in the task's own process: the node's environment applies


@ray.remote(num_returns="streaming", max_retries=0)
def merge_group_task(load_settings: LoadSettings, spec: GroupSpec, recipe: MergeRecipe):
    settings = load_settings()
    torch.set_num_threads(settings.merge.threads)
    services = group_services(settings)
    events: queue.Queue[Any] = queue.Queue()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = run_group(services, spec, recipe, progress=events.put)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the task's own thread below
            outcome["error"] = exc
        finally:
            events.put(None)

    threading.Thread(target=work, name=f"merge-group-{spec.index}", daemon=True).start()
    while (event := events.get()) is not None:
        yield event
    if "error" in outcome:
        raise outcome["error"]
    result: GroupResult = outcome["result"]
    yield result.model_copy(update={"node": ray.get_runtime_context().get_node_id()})


class RayGroupLauncher:
    """:class:`alloy.jobs.merge_fanout.GroupLauncher` on the connected Ray cluster."""

    def __init__(self, load_settings: LoadSettings, *, num_cpus: float, num_gpus: float = 0.0):
        self.load_settings = load_settings
        self.options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "scheduling_strategy": "SPREAD"}

    @classmethod
    def for_settings(cls, load_settings: LoadSettings, settings: Settings) -> RayGroupLauncher:
        return cls(load_settings, num_cpus=settings.merge.threads, num_gpus=1.0 if settings.profile == "gpu" else 0.0)

    def launch(self, spec: GroupSpec, recipe: MergeRecipe, report: Callable[[GroupEvent], None]) -> Callable[[], None]:
        # A streaming generator of the group's events (Ray's stubs type every .remote() as one ObjectRef).
        generator: Any = merge_group_task.options(**self.options).remote(self.load_settings, spec, recipe)

        def pump() -> None:
            try:
                for ref in generator:
                    event = ray.get(ref)
                    report(event)
                    if isinstance(event, GroupResult):
                        return
                # A task cancelled before it started ends its stream without an item or an error.
                report(GroupFailure(index=spec.index, code=ErrorCode.INTERNAL_ERROR, message=LOST, retryable=True))
            except Exception as exc:  # noqa: BLE001 - every failure becomes the group's GroupFailure
                report(failure_of(spec, exc))

        threading.Thread(target=pump, name=f"merge-group-pump-{spec.index}", daemon=True).start()
        return lambda: _cancel(generator)


def failure_of(spec: GroupSpec, exc: BaseException) -> GroupFailure:
    """A group's failure as the coordinator sees it: an AlloyError with a deterministic code (the recipe, the
    inputs) is final; anything else (a node or worker lost, an I/O error, a crash) may pass on another attempt."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, AlloyError):
        return GroupFailure(
            index=spec.index, code=cause.code, message=cause.message, retryable=cause.code not in DETERMINISTIC_CODES
        )
    # The job's error is client-visible: it says what happened, the log keeps the library's text.
    logger.warning("merge group %s of %s failed: %r", spec.index, spec.job_id, exc)
    lost = isinstance(exc, ray.exceptions.RayError) and not isinstance(exc, ray.exceptions.RayTaskError)
    message = LOST if lost else "it crashed (see the MergeEngine log)"
    return GroupFailure(index=spec.index, code=ErrorCode.INTERNAL_ERROR, message=message, retryable=True)


def _cancel(generator: Any) -> None:
    try:
        ray.cancel(generator, force=True)  # the task's process goes; its node's scratch is the recovery's
    except Exception:  # a finished or lost task has nothing left to cancel
        logger.debug("cancel of a merge group failed", exc_info=True)
