"""``n > 1`` fan-out, in one place: the child requests of one user request, and the siblings held back until
the first child has computed the shared prompt. Pure Python.

With prefix caching on, the siblings join once the first child has produced its first token, so they hit its
cached prompt blocks instead of computing the same prefix n times. Each child samples on its own; with a
``seed`` child i uses ``seed + i``, so the n samples are distinct yet reproducible. The fan-in (n children
into one ``RequestOutput``) is the output processor's.
"""
from __future__ import annotations

from openinfer.engine.core_io import EngineCoreRequest
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import MMImage


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class ParentRequest:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_s: float,
                 share_prefix: bool, priority: int = 0, mm_images: list[MMImage] | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.children: list[EngineCoreRequest] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)
            self.children.append(EngineCoreRequest(child_id(request_id, i, params.n), prompt_token_ids,
                                                   child_params, arrival_s, priority, list(mm_images or [])))
        # Siblings the engine core has not seen yet (only with prefix sharing; otherwise all start at once).
        self.held_back: list[EngineCoreRequest] = self.children[1:] if share_prefix else []

    @property
    def first(self) -> EngineCoreRequest:
        return self.children[0]

    def initial(self) -> list[EngineCoreRequest]:
        """The children to hand the engine core now."""
        return self.children[:len(self.children) - len(self.held_back)]

    def child_ids(self) -> list[str]:
        return [c.request_id for c in self.children]

    def release(self) -> list[EngineCoreRequest]:
        """The held-back siblings, once (the first child has its first token: its prompt blocks are cached)."""
        held, self.held_back = self.held_back, []
        return held
