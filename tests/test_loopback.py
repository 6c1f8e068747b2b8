"""Loopback unless asked: the private Ray instance a run starts when `run.ray_address` is unset, and its learner
ranks' rendezvous, listen on 127.0.0.1 only, so nobody who can reach the machine can attach a driver to it
(docs/cluster.md says what a cluster, which listens beyond the machine, needs instead)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env
from tests.test_e2e import ROOT

PRIVATE_RUN = """
import json, os, psutil, ray
from ray._private import ray_constants
from orchestrator.config import load_config
from orchestrator.rl.launch import init_ray

init_ray(load_config(None, []))  # run.ray_address unset: the private instance a run starts

@ray.remote
class Actor:  # a worker process with its own gRPC server, like the fleet's actors
    def pid(self):
        return os.getpid()

actor = Actor.remote()
ray.get(actor.pid.remote())

from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

@ray.remote(num_cpus=0.01)
class Rank:  # two learner ranks' rendezvous, as a private run's learner group joins (learner.worker)
    def join(self, rank):
        import torch
        import torch.distributed as dist
        from learner.worker import _join_on_one_machine
        _join_on_one_machine(rank, 2, "127.0.0.1", "gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total)

pg = placement_group([{"CPU": 0.01}] * 2)
ray.get(pg.ready())
ranks = [Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
         .remote() for i in range(2)]
assert ray.get([r.join.remote(i) for i, r in enumerate(ranks)]) == [2.0, 2.0]
tree = [psutil.Process(), *psutil.Process().children(recursive=True)]  # GCS, raylet, agents, workers
listening = sorted({(p.name(), c.laddr.ip, c.laddr.port) for p in tree for c in p.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN})
print(json.dumps({"node_ip": ray.util.get_node_ip_address(), "listening": listening,
                  "restored": ray_constants.ENABLE_RAY_CLUSTER and ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
                  not in os.environ}))
ray.shutdown()
"""


@pytest.mark.own_fleet
def test_a_private_ray_instance_listens_on_loopback_only():
    env = subprocess_env(PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", PRIVATE_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for name, _, _ in out["listening"]}
    assert {"gcs_server", "raylet"} <= names and len(out["listening"]) >= 5, out  # the instance's servers, found
    wide = [x for x in out["listening"] if x[1] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not wide, f"listening beyond loopback: {wide}"
    assert out["node_ip"] == "127.0.0.1" and out["restored"], out  # the driver's own Ray setting is put back
