"""A job's progress on the terminal: one line, redrawn in place (rich), fed by the job's live events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from alloy.wire import JobStreamEvent

if TYPE_CHECKING:  # rich loads only when a bar is drawn
    from rich.progress import Progress, TaskID


def describe(data: dict[str, Any]) -> str:
    """The text after the bar: tensors and bytes for merges, generation and fitness for evolutions."""
    parts = []
    if data.get("tensors_total"):
        parts.append(f"tensors {data.get('tensors_done') or 0}/{data['tensors_total']}")
    if data.get("bytes_done"):
        parts.append(f"{data['bytes_done'] / 1e6:.1f} MB")
    if data.get("generation") is not None and "generations" in data:
        parts.append(f"gen {data['generation']}/{data.get('generations') or '?'}")
    if data.get("best_fitness") is not None:
        parts.append(f"best {data['best_fitness']:.4g}")
    if data.get("median_fitness") is not None:
        parts.append(f"median {data['median_fitness']:.4g}")
    return "  ".join(parts)


class ProgressDisplay:
    """Context manager; a no-op when disabled. Only this object draws, so the line is never printed twice."""

    def __init__(self, job_id: str, enabled: bool = True):
        self.job_id = job_id
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressDisplay:
        if self.enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

            progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TextColumn("{task.fields[detail]}")
            )
            progress.start()
            self._progress = progress
            self._task = progress.add_task(f"{self.job_id[:12]} CREATED", total=100, detail="")
        return self

    def update(self, event: JobStreamEvent) -> None:
        if self._progress is None or self._task is None:  # disabled: nothing is drawn
            return
        data = event.data
        state = data.get("to_state") or data.get("state") or ""
        fields: dict[str, Any] = {"description": f"{self.job_id[:12]} {state}"}
        if event.event == "progress":
            fields["detail"] = describe(data)
            if data.get("percent") is not None:
                fields["completed"] = float(data["percent"])
        if event.event == "end":  # the final job view: its figures replace the last (throttled) snapshot
            fields["detail"] = describe(data)
            if state == "COMPLETED":
                fields["completed"] = 100
        self._progress.update(self._task, **fields)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
