"""The responses kept for GET /v1/responses/{id} (and its input_items) and
`previous_response_id`: in memory, the newest `size` of them and at most MAX_BYTES of their
request bodies (as parsed: the server counts a body's footprint, not its length), the least
recently used evicted first; a response in progress is never evicted (it could no longer be
cancelled, fetched or continued). A response keeps its input and output items, not its engine
run; a continuation shares the item objects of the responses it continues, so it counts their
bytes as its own (they live as long as it does, whether or not those responses are still
kept). The byte bound is what holds memory: `size` alone allowed 1000 bodies of up to
--max-request-bytes (16 MiB) each, and a client reached gigabytes in minutes (a hostile-traffic
trial). Once a response has ended, its output items count too: their logprobs, which its
request's reservation (--max-logprob-memory) no longer covers, outweigh any body."""

from __future__ import annotations

from collections import OrderedDict

from tinyoss.server.protocol import APIError
from tinyoss.server.responses_api import ResponseRun


MAX_BYTES = 256 * 2**20  # request bodies kept at most, summed over the stored responses


def _clip(response_id: str) -> str:
    """An id as a message quotes it: a client's 5 MB id came back whole in the 404."""
    return response_id if len(response_id) <= 100 else response_id[:97] + "..."


class ResponseStore:
    def __init__(self, size: int, max_bytes: int = MAX_BYTES) -> None:
        if size < 0:
            raise ValueError(f"--max-stored-responses={size} is invalid: must be >= 0")
        self.size, self.max_bytes = size, max_bytes
        self._runs: OrderedDict[str, tuple[ResponseRun, int]] = OrderedDict()
        self.bytes = 0  # the stored responses' request bodies

    def __len__(self) -> int:
        return len(self._runs)

    def put(self, run: ResponseRun, nbytes: int) -> None:
        """Keeps `run`, whose request body was `nbytes` long; the oldest go while more than
        `size` responses or `max_bytes` of bodies are kept (the newest always stays)."""
        if not self.size:
            return
        self._runs[run.id] = (run, nbytes)
        self.bytes += nbytes
        run.on_end = self._ended
        self._evict()

    def _ended(self, run: ResponseRun) -> None:
        """A stored response's run is over: its output items count from now on."""
        kept = self._runs.get(run.id)
        if kept is None or kept[0] is not run:  # evicted or deleted meanwhile
            return
        extra = run.footprint()
        self._runs[run.id] = (run, kept[1] + extra)
        self.bytes += extra
        self._evict()

    def _evict(self) -> None:
        """The least recently used that have ended go while more than `size` responses or
        `max_bytes` are kept (the newest always stays)."""
        while len(self._runs) > 1 and (len(self._runs) > self.size
                                       or self.bytes > self.max_bytes):
            newest = next(reversed(self._runs))
            old = next((rid for rid, (run, _) in self._runs.items()
                        if run.status != "in_progress" and rid != newest), None)
            if old is None:  # all in progress: their requests' own limits bound them
                return
            self.bytes -= self._runs.pop(old)[1]

    def held(self, response_id: str) -> int:
        """The bytes `response_id` is counted for (its items, and those it continues)."""
        kept = self._runs.get(response_id)
        return 0 if kept is None else kept[1]

    def get(self, response_id: str, param: str | None = None) -> ResponseRun:
        """The response (now the most recently used), or a 404 naming it (a 400 where it is
        a request's `param`, previous_response_id: OpenAI's answer to an unknown one)."""
        kept = self._runs.get(response_id)
        if kept is None:
            why = (
                f"responses are kept in memory, the newest {self.size} within "
                f"{self.max_bytes // 2**20} MiB, and only those created with store: true"
                if self.size
                else "storing is off on this server (--max-stored-responses 0): no response is "
                "kept"
            )
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise APIError(
                400 if param else 404,
                f"{what} with id {_clip(response_id)!r} not found: {why}.",
                param=param,
                code="previous_response_not_found" if param else "not_found",
            )
        self._runs.move_to_end(response_id)
        return kept[0]

    def delete(self, response_id: str) -> None:
        """Forgets a response that has ended (400 while it runs: cancel it first)."""
        if self.get(response_id).status == "in_progress":
            raise APIError(
                400,
                f"response {_clip(response_id)!r} is still in progress: cancel it "
                f"(POST /v1/responses/{_clip(response_id)}/cancel) or wait for it to end, then "
                "delete it",
                param="response_id",
            )
        self.bytes -= self._runs.pop(response_id)[1]

    def conversation(self, response_id: str) -> list[dict]:
        """The items a request continuing `response_id` comes after (400 while it runs)."""
        run = self.get(response_id, "previous_response_id")
        if run.status == "in_progress":
            raise APIError(
                400,
                f"previous response {_clip(response_id)!r} is still in progress: wait for it to "
                "end",
                param="previous_response_id",
            )
        return run.conversation()
