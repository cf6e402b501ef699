"""The KV connector on many ranks: names and the per-replica view of the ranks' reports. Pure Python.

Each data-parallel replica is an engine of its own to the other instance (its own scheduler, block ids and
``remote_engine_id``, as vLLM names DP ranks' engines ``<engine_id>_dp<rank>``); each rank of a replica runs its
own NIXL agent over its own KV stores (its tensor-parallel shard) and its own side channel. Tensor-parallel rank i
of a decoder reads from rank i of the producer at the same tensor_parallel_size (across sizes, from the ranks
tp_slices.py names), so a prompt has moved once *every* rank of the replica reports it, and a held prompt may be
freed once every rank's reader said it is done - ``KVOutputAggregator`` turns the ranks' step reports into that.
"""
from __future__ import annotations

from openinfer.step_io import KVConnectorOutput


def replica_engine_id(engine_id: str, dp_rank: int, dp_size: int) -> str:
    """The engine id a data-parallel replica advertises (the base id itself without data parallelism)."""
    return engine_id if dp_size == 1 else f"{engine_id}_dp{dp_rank}"


def agent_name(replica_id: str, tp_rank: int, tp_size: int) -> str:
    """A rank's NIXL agent name: unique across every instance's ranks (the replica's id itself at one rank)."""
    return replica_id if tp_size == 1 else f"{replica_id}_tp{tp_rank}"


class KVOutputAggregator:
    """One replica's ranks' connector reports -> the replica's (vLLM's KVOutputAggregator): a read is finished once
    every rank finished it, failed once every rank reported and one failed; a held prompt is read once every rank
    heard its reader. Ranks may report a request in different steps; a lone rank's report passes straight on."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._recv: dict[str, tuple[int, str]] = {}  # request -> (ranks reported, first failure or "")
        self._sent: dict[str, int] = {}

    def merge(self, outs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        if self.num_ranks == 1:
            return outs[0]
        present = [o for o in outs if o is not None]
        if not present:
            return None
        merged = KVConnectorOutput(bytes_received=sum(o.bytes_received for o in present),
                                   seconds_receiving=max(o.seconds_receiving for o in present))
        for o in present:
            for rid in o.finished_recving:
                self._count_recv(rid, "", merged)
            for rid, why in o.failed_recving.items():
                self._count_recv(rid, why, merged)
            for rid in o.finished_sending:
                n = self._sent.get(rid, 0) + 1
                if n == self.num_ranks:
                    self._sent.pop(rid, None)
                    merged.finished_sending.append(rid)
                else:
                    self._sent[rid] = n
            merged.sending_started += [r for r in o.sending_started if r not in merged.sending_started]
        return merged

    def _count_recv(self, rid: str, why: str, merged: KVConnectorOutput) -> None:
        n, failed = self._recv.get(rid, (0, ""))
        n, failed = n + 1, failed or why
        if n < self.num_ranks:
            self._recv[rid] = (n, failed)
            return
        self._recv.pop(rid, None)
        if failed:
            merged.failed_recving[rid] = failed
        else:
            merged.finished_recving.append(rid)
