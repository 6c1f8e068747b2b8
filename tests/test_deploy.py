"""deploy/: the recipes parse and agree with the code (metric names, config schema, custom resources), and the
collective weight push of workers/nccl_sync.py: bucket planning, packing, a real gloo broadcast between two
ranks (the push into real vLLM engines runs end to end in tests/test_e2e.py, GDPO case, rollout.weight_sync=collective,
whose engine-vs-learner logprob check shows the pushed weights arrived)."""

import json
import re
import threading
from pathlib import Path

import pytest
import torch
import yaml

from orchestrator.config import load_config
from workers import nccl_sync as ns
from workers import weight_buckets as wb

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GPU_CONFIG = DEPLOY / "configs" / "qwen2.5-7b-8gpu.yaml"


# ---- recipes ---------------------------------------------------------------------------------------------------
def _yaml(name: str) -> list:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def _start_resources(group: dict) -> dict:
    """KubeRay's rayStartParams.resources is a shell-quoted JSON string: '"{\\"rollout_gpu\\": 4}"'."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(raw.strip('"').replace('\\"', '"')) if raw else {}


def test_every_yaml_parses():
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert {"cluster.yaml", "kuberay-raycluster.yaml", "kuberay-rayjob.yaml", "prometheus.yml",
            GPU_CONFIG.name} <= {f.name for f in files}
    for f in files:
        assert list(yaml.safe_load_all(f.read_text())), f


def test_cluster_launcher_node_types_offer_the_resources_the_config_asks_for():
    from ray.autoscaler._private.util import prepare_config, validate_config

    (cluster,) = _yaml("cluster.yaml")
    validate_config(prepare_config(cluster))  # Ray's own cluster-launcher schema (unknown keys are errors)
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    offered = {k for t in types.values() for k in t["resources"]}
    cfg = load_config(GPU_CONFIG)
    wanted = set(cfg.rollout.resources) | set(cfg.learner.resources) | set(cfg.reward.resources)
    assert wanted <= offered, wanted - offered
    assert all("RAY_AUTH_MODE=token" in " ".join(cluster[k]) for k in ("head_start_ray_commands",
                                                                         "worker_start_ray_commands"))
    assert any("[gpu]" in c for c in cluster["setup_commands"])


def test_kuberay_manifests_match_the_config():
    (cluster,) = _yaml("kuberay-raycluster.yaml")
    (job,) = _yaml("kuberay-rayjob.yaml")
    assert (cluster["kind"], job["kind"]) == ("RayCluster", "RayJob")
    cfg = load_config(GPU_CONFIG)
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token"} and spec["rayVersion"] == "2.60.0"
        offered: dict = {}
        for group in spec["workerGroupSpecs"]:
            for k, v in _start_resources(group).items():
                offered[k] = offered.get(k, 0) + v * group["replicas"]
        assert offered.get("rollout_gpu", 0) >= cfg.rollout.num_workers * cfg.rollout.resources["rollout_gpu"]
        assert offered.get("learner_gpu", 0) >= cfg.learner.num_ranks * cfg.learner.resources["learner_gpu"]
    # the job runs the config that ships in the image (deploy/ is copied to /app/deploy)
    config_in_image = job["spec"]["entrypoint"].split(" -c ")[1].split()[0]
    assert config_in_image == "/app/" + str(GPU_CONFIG.relative_to(ROOT))


def test_dockerfile_installs_the_gpu_extra_on_the_pinned_ray():
    text = (DEPLOY / "Dockerfile.gpu").read_text()
    assert '".[gpu]"' in text and "rayproject/ray:2.60.0" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"ray[default]==2.60.0"' in pyproject and re.search(r"^gpu = \[", pyproject, re.M)
    for copied in re.findall(r"^COPY --chown=\S+ (\S+) ", text, re.M):
        if copied != "pyproject.toml":
            assert (ROOT / copied).exists(), copied


def test_grafana_dashboard_queries_every_metric_with_rays_prefix():
    dash = json.loads((DEPLOY / "grafana-fleetrl.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    text = "\n".join(exprs)
    from orchestrator.telemetry.controller import METRICS

    docs = (ROOT / "docs" / "cluster.md").read_text()
    for name in METRICS:  # the dashboard queries, and docs/cluster.md names, every metric the controller exports
        assert f"`{name}`" in docs, name
        assert re.search(rf"\bray_{name}(_bucket|_sum|_count)?\{{", text), name
    # histogram -> quantiles over buckets; counters -> rates; every query filters on the run variable
    assert 'histogram_quantile(0.95, sum by (le, run) (rate(ray_fleetrl_step_seconds_bucket{run=~"$run"}' in text
    assert "rate(ray_fleetrl_generated_tokens_total{" in text and "rate(ray_fleetrl_reward_errors_total{" in text
    assert all('{run=~"$run"}' in e for e in exprs)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "label_values(ray_fleetrl_step, run)" in variables["run"]["definition"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"] if p["type"] != "row")


# ---- bucket planning -------------------------------------------------------------------------------------------
SPECS = [("a", (10,), "float32"), ("b", (3, 5), "bfloat16"), ("c", (100,), "float32"), ("d", (1,), "int64"),
         ("e", (2, 2), "float16")]


def test_plan_buckets_keeps_order_and_respects_the_cap():
    plans = wb.plan_buckets(SPECS, cap_bytes=512)
    assert [n for p in plans for n in p.names] == [s[0] for s in SPECS]
    # c (400 B) ends at 400; d would start at the next 256-byte boundary, 512: past the cap
    assert [p.names for p in plans] == [("a", "b"), ("c",), ("d", "e")]
    assert all(p.nbytes <= 512 for p in plans)
    for p in plans:
        assert all(off % wb.ALIGN == 0 for off in p.offsets)
        ends = [off + wb.tensor_nbytes(n, s, d) for n, s, d, off in zip(p.names, p.shapes, p.dtypes, p.offsets)]
        assert all(end <= nxt for end, nxt in zip(ends, p.offsets[1:]))  # no overlap
        assert p.nbytes >= ends[-1]
    assert plans[0].offsets == (0, 256) and plans[0].nbytes == 512  # 40 B, then 30 B at the next boundary


def test_plan_buckets_oversized_tensor_gets_its_own_bucket():
    plans = wb.plan_buckets([("small", (4,), "float32"), ("big", (1000,), "float32"), ("tail", (4,), "float32")],
                            cap_bytes=1024)
    assert [p.names for p in plans] == [("small",), ("big",), ("tail",)]
    assert plans[1].nbytes == 4096 and plans[1].offsets == (0,)
    assert [p.names for p in wb.plan_buckets(SPECS, cap_bytes=10**9)] == [tuple(s[0] for s in SPECS)]
    assert wb.plan_buckets([], cap_bytes=1) == []


@pytest.mark.parametrize("specs,cap,message", [
    (SPECS, 0, "bucket cap must be > 0"),
    ([("w", (2,), "complex64")], 64, "w: unsupported dtype 'complex64'"),
    ([("w", (2,), "float32"), ("w", (2,), "float32")], 64, "'w' appears twice"),
    ([("w", (-1, 2), "float32")], 64, "w: negative dimension"),
])
def test_plan_buckets_rejects_bad_input(specs, cap, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        wb.plan_buckets(specs, cap)


def _tensors(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 100).to(getattr(torch, d)) for n, s, d in specs}


def test_pack_unpack_round_trip_all_dtypes():
    tensors = _tensors(SPECS)
    for plan in wb.plan_buckets(SPECS, cap_bytes=600):
        buf = wb.pack_bucket(plan, [tensors[n] for n in plan.names])
        assert buf.dtype == torch.uint8 and buf.numel() == plan.nbytes
        for name, view in wb.unpack_bucket(plan, buf):
            assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name]), name
            assert view.data_ptr() - buf.data_ptr() == plan.offsets[plan.names.index(name)]  # a view, no copy


def test_pack_refuses_an_ungathered_shard():
    (plan,) = wb.plan_buckets([("w", (4, 4), "float32")], 1024)
    with pytest.raises(ValueError, match=r"w: planned float32\[4, 4\], got torch.float32\[0\].*gathered"):
        wb.pack_bucket(plan, [torch.empty(0)])


def test_param_specs_use_zero3_full_shapes_and_skip_tied_duplicates():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(32, 16), "norm": torch.nn.LayerNorm(16),
                                 "head": torch.nn.Linear(16, 32, bias=False)})
    model["head"].weight = model["embed"].weight  # tied, as with tie_word_embeddings
    assert wb.param_specs(model.named_parameters()) == [
        ("embed.weight", (32, 16), "float32"), ("norm.weight", (16,), "float32"), ("norm.bias", (16,), "float32")]
    shard = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    shard.ds_shape = torch.Size([32, 16])  # what DeepSpeed ZeRO-3 leaves on a rank outside a gather
    assert wb.param_specs([("w", shard)]) == [("w", (32, 16), "bfloat16")]


def test_group_layout():
    # learner at 0, then engine e's W workers at 1 + e*W ... 1 + e*W + W-1
    assert ns.group_world_size(num_engines=4, workers_per_engine=2) == 9
    assert [ns.engine_rank_offset(e, 2) for e in range(4)] == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="weight sync backend 'mpi'"):
        ns.weight_communicator("mpi", "127.0.0.1", 1, 0, 2, "cpu")


# ---- a real collective -----------------------------------------------------------------------------------------
def test_broadcast_and_receive_over_gloo():
    """Learner rank 0 and one receiver in a real 2-rank gloo group (threads of this process)."""
    tensors = _tensors(SPECS, seed=1)
    plans = wb.plan_buckets(SPECS, cap_bytes=300)
    assert len(plans) > 2
    host, port, sock = ns.open_endpoint("127.0.0.1")
    got, errors = [], []

    def receiver():
        try:
            comm = ns.weight_communicator("gloo", host, port, 1, 2, "cpu")
            got.extend((n, t.clone()) for n, t in ns.receive_buckets(comm, plans, "cpu"))
        except Exception as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    comm = ns.weight_communicator("gloo", host, port, 0, 2, "cpu", listen_socket=sock)
    sent = ns.broadcast_weights(comm, plans, tensors)
    t.join(timeout=60)
    assert not errors, errors
    assert sent == sum(p.nbytes for p in plans)
    assert [n for n, _ in got] == [s[0] for s in SPECS]
    assert all(torch.equal(t, tensors[n]) for n, t in got)


class _PartialReloadWorker(ns.NcclWeightSyncExtension):
    """A stand-in vLLM worker whose reload stops after two tensors (the extension's methods are the real ones)."""

    rank, device = 0, "cpu"

    class model_runner:  # noqa: N801 - mirrors the vLLM worker attribute
        class model_config:  # noqa: N801
            dtype = torch.float32

        @staticmethod
        def get_model():
            return object()

    def reload_weights(self, weights_iterator):
        next(weights_iterator), next(weights_iterator)


def test_a_failed_reload_still_drains_the_broadcast():
    """If the engine's reload stops early, the receiver still takes every bucket (so the learner and the other
    engines do not hang in the collective) and then reports the mismatch."""
    tensors = _tensors(SPECS, seed=2)
    plans = wb.plan_buckets(SPECS, cap_bytes=300)
    host, port, sock = ns.open_endpoint("127.0.0.1")
    sent = []
    sender = threading.Thread(target=lambda: sent.append(ns.broadcast_weights(
        ns.weight_communicator("gloo", host, port, 0, 2, "cpu", listen_socket=sock), plans, tensors)))
    sender.start()
    worker = _PartialReloadWorker()
    assert worker.fleetrl_init_weight_group(host, port, ns.engine_rank_offset(0, 1), 2, backend="gloo") == 1
    with pytest.raises(RuntimeError, match=f"reload consumed 2 of the {len(SPECS)} pushed tensors"):
        worker.fleetrl_receive_weights(plans)
    sender.join(timeout=60)
    assert not sender.is_alive() and sent == [sum(p.nbytes for p in plans)]
    with pytest.raises(RuntimeError, match="before fleetrl_init_weight_group"):
        _PartialReloadWorker().fleetrl_receive_weights(plans)
