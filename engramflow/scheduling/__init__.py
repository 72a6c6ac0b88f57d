"""The one scheduler and its request: every step of the engine is made by `Scheduler`."""
from engramflow.scheduling.request import Collect, Request, Sink
from engramflow.scheduling.scheduler import QueueFull, Scheduler

__all__ = ["Collect", "QueueFull", "Request", "Scheduler", "Sink"]
