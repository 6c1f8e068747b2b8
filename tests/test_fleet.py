"""One fleet, loops chosen once: which actors each loop starts, and every check a run makes at load
made by `fleetrl config show` and by `fleetrl train` before anything starts. No actor starts in this file."""

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import FleetConfig, load_config
from orchestrator.loops import loop_for
from tests.conftest import cli


@pytest.mark.parametrize("overrides,loop,roles", [
    ([], "PolicyLoop", ["learner", "rollout", "reward", "controller"]),
    (["algorithm.name=ppo"], "PolicyLoop", ["learner", "critic", "rollout", "reward", "controller"]),
    (["algorithm.name=sft", "trainer.eval_every=0"], "SFTLoop", ["learner", "controller"]),
    (["algorithm.name=sft", "trainer.eval_every=5"], "SFTLoop", ["learner", "rollout", "controller"]),
    (["algorithm.name=dpo", "algorithm.pairs=p.jsonl"], "DPOLoop", ["learner", "rollout", "controller"]),
    (["algorithm.name=dpo"], "DPOLoop", ["learner", "rollout", "reward", "controller"]),  # online: generates
    (["algorithm.name=reward_model", "trainer.eval_every=5"], "RewardModelLoop", ["learner", "controller"]),
    (["algorithm.name=prm", "trainer.eval_every=5"], "PRMLoop", ["learner", "controller"]),
])
def test_each_loop_is_chosen_from_its_algorithm_and_starts_only_what_it_uses(overrides, loop, roles):
    """A loop that never generates starts no engine, reward actor or weight-sync probe; engines only for evals."""
    cfg = load_config(None, overrides)
    chosen = loop_for(cfg)
    assert chosen.__name__ == loop
    assert chosen.roles(cfg).names() == roles


def _fleetrl(*args: str) -> subprocess.CompletedProcess:
    return cli(*args)


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_config_show_refuses_what_a_run_would_refuse(tmp_path):
    """Pairs geometry, the pairs/labels/SFT files a loop reads and the principles file: refused by `config show`
    with exit 2, in one line naming the key or file and line."""
    _refused(_fleetrl("config", "show", "algorithm.name=dpo", "data.prompts_per_step=3", "rollout.group_size=2",
                      "learner.num_ranks=2", "learner.micro_batch_size=3"), "even number of rows", "learner.num_ranks")
    bad = tmp_path / "principles.yaml"
    bad.write_text("principles:\n  - name: x\n    critique: [not, a, string]\n")
    _refused(_fleetrl("config", "show", f"cai.principles={bad}"), "cai.principles", str(bad))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1", "chosen": "2", "rejected": "3"}) + "\n" + '{"prompt": "2+2"}\n')
    _refused(_fleetrl("config", "show", "algorithm.name=dpo", f"algorithm.pairs={pairs}"), f"{pairs}:2")
    _refused(_fleetrl("config", "show", "algorithm.name=sft", f"sft.data={tmp_path}/none.jsonl"), "none.jsonl")


def test_train_prm_is_refused_at_load_without_labels(tmp_path):
    """`fleetrl train algorithm.name=prm` trains a PRM (test_process) or exits 2 at load: nothing is written."""
    _refused(_fleetrl("train", "algorithm.name=prm", f"run.dir={tmp_path}/run"), "prm.labels")
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"prompt": "p", "steps": ["a"], "soft": [1.0]}) + "\n")
    _refused(_fleetrl("train", "algorithm.name=prm", f"prm.labels={labels}", f"run.dir={tmp_path}/run"),
             f"{labels}:1", "missing")
    assert not (tmp_path / "run").exists()


def test_a_pipeline_recipe_is_shown_by_stage_and_refused_without_stage():
    """`config show -c recipe` prints every resolved stage; a command given a recipe needs --stage NAME."""
    r = _fleetrl("config", "show", "-c", "configs/r1.yaml")
    assert r.returncode == 0, r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith("# stage ")]
    assert [h.split()[3] for h in heads] == ["cold_start", "reasoning_rl", "rejection_sft", "all_rl", "preference"]
    r = _fleetrl("config", "show", "-c", "configs/r1.yaml", "--stage", "reasoning_rl")
    assert r.returncode == 0 and "total_steps: 150" in r.stdout and "lr: 5.0e-05" in r.stdout, r.stderr
    _refused(_fleetrl("cai", "revise", "-c", "configs/smollm2_cai.yaml", "--n", "1", "--out", "/dev/null"),
             "pipeline recipe", "--stage")
    _refused(_fleetrl("config", "show", "-c", "configs/r1.yaml", "--stage", "nope"), "'nope'", "cold_start")
    _refused(_fleetrl("config", "show", "--stage", "x"), "not a pipeline recipe")


def test_a_fleet_keeps_for_the_next_run_only_the_actors_that_fit_it():
    """What Fleet.serve compares: another algorithm, learning rate or starting model of the same shape keeps every
    group (the ranks load the new run; the engines get its weights); other ranks, engine placement or reward
    functions do not keep theirs, and other engine settings keep CPU rollout actors with new engines."""
    from orchestrator.rl.fleet import engine_key, fit_keys

    base = fit_keys(load_config(None, []))

    def changed(*overrides: str) -> set[str]:
        other = fit_keys(load_config(None, list(overrides)))
        return {role for role in base if other[role] != base[role]}

    assert changed("algorithm={}", "algorithm.name=sft", "learner.lr=0.1", "data.seed=3") == set()
    # CPU engines: other engine settings keep the rollout actors, which build new engines (engine_key); GPU: not
    assert changed("rollout.kv_cache_gib=0.5", "rollout.cpu_threads=7") == {"feedback"}  # judges: not rebuilt
    assert engine_key(load_config(None, ["rollout.kv_cache_gib=0.5"])) != engine_key(load_config(None, []))
    assert "rollout" in changed("rollout.num_workers=1")  # another placement: new actors
    gpu = fit_keys(load_config(None, ["rollout.num_gpus=1"]))["rollout"]
    assert gpu != fit_keys(load_config(None, ["rollout.num_gpus=1", "rollout.kv_cache_gib=0.5"]))["rollout"]
    def distill(*other: str):
        return load_config(None, ["algorithm.name=on_policy_distill", "distill.teacher=runs/t/final", *other])

    assert fit_keys(distill("distill.teacher_workers=2"))["teacher"] != fit_keys(distill())["teacher"]
    for other in (["distill.teacher=runs/u/final"], ["rollout.kv_cache_gib=0.5"]):  # the same actors, new engines
        assert fit_keys(distill(*other))["teacher"] == fit_keys(distill())["teacher"]
        assert engine_key(distill(*other), "teacher") != engine_key(distill(), "teacher")
    same = distill("learner.lr=0.1", "rollout.num_workers=1")
    assert fit_keys(same)["teacher"] == fit_keys(distill())["teacher"]
    assert engine_key(same, "teacher") == engine_key(distill(), "teacher")
    assert changed("learner.num_ranks=1") == {"learner", "critic"}
    assert changed("learner.zero_stage=3") == set()  # ranks load a run of any ZeRO stage (test_invariance)
    assert changed("reward.functions=[{name: math}, {name: format}]") == {"reward"}
    calc = load_config(None, ["model.path=.fleetrl/models/calc-base"])
    assert engine_key(calc) != engine_key(load_config(None, []))  # another model shape (vocabulary): new engines


def test_engines_serve_a_run_without_a_learner_only_with_its_model(monkeypatch, tmp_path):
    """A run without a learner (eval, search, PRM labelling) has no learner to push its model into kept engines: it
    keeps them when they hold that model unchanged, or when the model's safetensors can be loaded into them in
    place (:meth:`RolloutPool.load_model`, after a training run pushed into them); else it starts new ones."""
    from orchestrator.rl.fleet import Fleet, Roles, _engine_weights

    fleet = Fleet.__new__(Fleet)
    fleet.learner = fleet.critic = fleet.envs = fleet.feedback = fleet.prm = fleet.orm = fleet.controller = None
    fleet.teacher = None
    fleet.rewards, fleet.parked = None, {}
    monkeypatch.setattr(Fleet, "_dead", lambda self, roles, timeout_s=60.0: set())
    monkeypatch.setattr(Fleet, "_stop", lambda self, role: None)

    def kept_after(model: Path, first: Roles, then: Roles, *extra: str) -> set[str]:
        train = load_config(None, ["rollout.num_workers=1", f"model.path={model}", *extra])
        evaluate = load_config(None, ["rollout.num_workers=1", f"model.path={model}", "run.dir=runs/eval", *extra])

        class Engines:  # the group's attributes _keep touches
            cfg, restarts, recovery_s = train, 0, 0.0

        fleet.rollouts, fleet.built = Engines(), {"rollout": train}
        fleet.engine_weights = _engine_weights(train, first)
        kept, rebuild = fleet._keep(evaluate, then, None)
        assert not rebuild  # the same engine settings
        return kept

    safetensors, torch_bin = tmp_path / "st", tmp_path / "bin"
    header = b'{"model.layers.0.self_attn.q_proj.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    for d, file in ((safetensors, "model.safetensors"), (torch_bin, "pytorch_model.bin")):
        d.mkdir()
        (d / file).write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    evaluates, trains = Roles(rollout=True), Roles(learner=True, rollout=True)
    for model in (safetensors, torch_bin):
        assert kept_after(model, evaluates, evaluates) == {"rollout"}  # an eval after an eval of the same model
        assert kept_after(model, trains, trains) == {"rollout"}  # the learner pushes the new run's model
    assert kept_after(safetensors, trains, evaluates) == {"rollout"}  # after training: reloaded from disk
    assert kept_after(torch_bin, trains, evaluates) == set()  # not loadable in place: new engines
    assert kept_after(safetensors, trains, evaluates, "learner.lora.rank=4") == set()  # adapters in the engines


def test_a_group_a_run_does_not_use_is_parked_and_a_later_run_that_fits_keeps_it(monkeypatch):
    """:meth:`Fleet._keep` between runs: an SFT run without evals parks the RL run's engines and reward actors
    (idle, out of its groups) instead of stopping them, and the next RL run keeps them; a parked group that does not
    fit that run, and a group holding GPUs, are stopped."""
    from orchestrator.rl.fleet import _ATTR, Fleet, Roles

    stopped: list[str] = []

    def stop(self, role):
        if getattr(self, _ATTR[role]) is not None:
            stopped.append(role)
        setattr(self, _ATTR[role], None)
        self.built.pop(role, None)

    monkeypatch.setattr(Fleet, "_dead", lambda self, roles, timeout_s=60.0: set())
    monkeypatch.setattr(Fleet, "_stop", stop)
    rl = load_config(None, ["rollout.num_workers=1"])
    sft = load_config(None, ["rollout.num_workers=1", "algorithm={}", "algorithm.name=sft"])
    trains, fine_tunes = Roles(learner=True, rollout=True, reward=True), Roles(learner=True)

    class Group:  # the attributes _keep touches
        cfg, restarts, recovery_s, judge = rl, 0, 0.0, None

    def fleet_after_rl(first: FleetConfig = rl) -> Fleet:
        fleet = Fleet(first, Roles())  # no actor: the groups are set by hand
        fleet.learner, fleet.rollouts, fleet.rewards = Group(), Group(), Group()
        fleet.built = dict.fromkeys(trains.names(), first)
        return fleet

    fleet = fleet_after_rl()
    engines = fleet.rollouts
    assert fleet._keep(sft, fine_tunes, None)[0] == {"learner"} and not stopped
    assert set(fleet.parked) == {"rollout", "reward"} and fleet.groups().keys() == {"learner"}
    assert fleet._keep(rl, trains, None) == ({"learner", "rollout", "reward"}, set())
    assert fleet.rollouts is engines and not fleet.parked and not stopped
    fleet._keep(sft, fine_tunes, None)
    wider = load_config(None, ["rollout.num_workers=2"])  # another placement: the parked engines do not fit
    assert fleet._keep(wider, trains, None)[0] == {"learner", "reward"} and stopped == ["rollout"]
    stopped.clear()
    gpu = load_config(None, ["rollout.num_workers=1", "rollout.num_gpus=1"])
    fleet = fleet_after_rl(gpu)
    fleet._keep(sft, fine_tunes, None)  # a parked GPU engine would keep its memory from the learner
    assert stopped == ["rollout"] and set(fleet.parked) == {"reward"}
    import ray  # a new group the cluster has no room for beside the parked ones: they are stopped

    critic = load_config(None, ["algorithm.name=ppo"])  # learner.num_ranks critic ranks of learner.num_cpus each
    for free, parked in ((8.0, {"reward"}), (0.5, set())):
        monkeypatch.setattr(ray, "available_resources", lambda free=free: {"CPU": free})
        fleet._make_room(critic, ["critic"], wait_s=0.3)
        assert set(fleet.parked) == parked
    assert stopped == ["rollout", "reward"]


def test_cpu_engines_get_the_cores_when_they_generate_alone():
    """rollout.cpu_threads unset: a sync run's engines share the launching machine's cores; engines that generate
    beside the learner (one_step_off) or on GPUs get 1; a set value wins. The thread count is part of what an
    engine was built with (a run with another one gets new engines, in the same actors)."""
    import os

    from orchestrator.rl.fleet import engine_key
    from orchestrator.rl.specs import engine_threads

    cores = os.cpu_count()
    assert engine_threads(load_config(None, ["rollout.num_workers=1"])) == cores
    assert engine_threads(load_config(None, [f"rollout.num_workers={cores}"])) == 1
    assert engine_threads(load_config(None, ["rollout.num_workers=1", "rollout.mode=one_step_off"])) == 1
    assert engine_threads(load_config(None, ["rollout.num_workers=1", "rollout.num_gpus=1"])) == 1
    assert engine_threads(load_config(None, ["rollout.num_workers=1", "rollout.cpu_threads=3"])) == 3
    one = load_config(None, ["rollout.num_workers=1"])
    assert engine_key(one) != engine_key(load_config(None, ["rollout.num_workers=1", "rollout.cpu_threads=7"]))
