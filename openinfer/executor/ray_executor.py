"""The Ray executor: one Ray actor per rank, placed by a placement group with one bundle per rank, so a Ray cluster
spanning machines (``ray start --head`` / ``ray start --address``) runs one deployment.

Ray only places and starts the ranks. Every step then travels exactly as with the multiprocess executor: msgspec
messages over ZeroMQ from the engine to each rank (the actors connect to the engine's node), torch.distributed
between ranks (rendezvous at rank 0's node). A rank whose actor dies or whose serving loop ends fails the
deployment, naming the rank, the same way.
"""
from __future__ import annotations

import logging
import os
import weakref

from openinfer import envs
from openinfer.executor.multiproc import MultiprocExecutor

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = envs.RAY_PLACEMENT_TIMEOUT_S


def _stop_actors(actors: list, placement_group) -> None:
    import ray

    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # already gone
            pass
    try:
        ray.util.remove_placement_group(placement_group)
    except Exception:
        pass


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))  # a running cluster if there is one, else local


class RayExecutor(MultiprocExecutor):
    @property
    def bind_host(self) -> str:
        """The address this node has in the Ray cluster, where every actor (on any node) connects back: not
        0.0.0.0, so a cluster kept on loopback (``ray start --node-ip-address 127.0.0.1``, or
        ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) never listens on an external interface."""
        import ray

        _ensure_ray()
        return ray.util.get_node_ip_address()

    def _start_workers(self, config_json: str, rpc_address: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from openinfer.worker.ray_worker import RayWorkerHost

        _ensure_ray()
        world = len(self._ids)
        gpu = self.config.model.device.type == "cuda"
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * world, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster cannot place {world} ranks of {bundle} within "
                               f"{READY_TIMEOUT_S:.0f} s ({ray.available_resources()} available)") from None
        host = ray.remote(RayWorkerHost)
        self.actors = [host.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
            num_cpus=1, num_gpus=1 if gpu else 0).remote() for r in range(world)]
        self._finalizer = weakref.finalize(self, _stop_actors, self.actors, self._pg)
        ips = ray.get([a.node_ip.remote() for a in self.actors])
        self._pids = ray.get([a.pid.remote() for a in self.actors])
        dist_init = f"tcp://{ips[0]}:{ray.get(self.actors[0].free_port.remote())}"
        self._runs = [a.run.remote(r, config_json, rpc_address, dist_init) for r, a in enumerate(self.actors)]
        self._ips = ips

    def _dead_ranks(self) -> list[tuple[int, str]]:
        import ray

        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        dead = []
        for ref in done:
            r = self._runs.index(ref)
            try:
                code = ray.get(ref)
                what = f"its serving loop ended with code {code}"
            except Exception as e:  # the actor died
                what = f"died: {type(e).__name__}"
            dead.append((r, f"worker rank {r} (Ray actor, pid {self._pids[r]} on {self._ips[r]}) {what}"))
        return dead

    def _stop_workers(self, exit_wait_s: float) -> None:
        import ray

        if exit_wait_s:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=exit_wait_s)
        self._finalizer()
