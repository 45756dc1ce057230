"""Serving: continuous batching (`Scheduler`) and the OpenAI-compatible server (`specdec-fast
serve`), whose engine runs in a child process (`engine_process.ProcessEngine`) or on a thread
of the server (`service.Service`), with routes, guardrails, shadow and canary modes, and
the load generator behind `specdec-fast bench --url`."""

from specdec_fast.serving.scheduler import (
    Completion,
    Handle,
    QueueFull,
    Request,
    RouteCounters,
    Scheduler,
    SchedulerStopped,
    StepCounters,
)

__all__ = [
    "Completion",
    "Handle",
    "QueueFull",
    "Request",
    "RouteCounters",
    "Scheduler",
    "SchedulerStopped",
    "StepCounters",
]
