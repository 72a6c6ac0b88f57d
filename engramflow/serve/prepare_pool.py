"""The worker threads that turn request bodies into settings, so the event loop never does.

Parsing, prompt writing, tokenization (which releases the GIL), image fetching, decoding and
preprocessing all run here; the event loop that carries every stream and `/health` only awaits
the result. The pool is bounded: past `workers + queue` requests being prepared, a new one is
refused at once (429, retry soon) instead of piling up.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engramflow.serve.errors import ApiError


class PreparePool:
    def __init__(self, workers: int, queue: int):
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engramflow-prepare")
        self.limit = workers + queue
        self.busy = 0  # touched on the event loop only

    async def run(self, fn, *args):
        if self.busy >= self.limit:
            raise ApiError(429, f"{self.busy} requests are being prepared; retry shortly", code="prepare_queue_full",
                           headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self.busy += 1
        fut = self.executor.submit(fn, *args)
        # counted until the work ends, even when its client left and the await below was cancelled
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(fut)

    def _done(self) -> None:
        self.busy -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
