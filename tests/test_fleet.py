"""One fleet, loops chosen once: which actors each loop starts, and every check a run makes at load
made by `fleetrl config show` and by `fleetrl train` before anything starts. No actor starts in this file."""

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import FleetConfig, load_config
from orchestrator.loops import loop_for
from orchestrator.rl.fleet import Roles
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


def _after(built: dict[str, FleetConfig], parked: frozenset[str] = frozenset(), **extra):
    """The state of a fleet whose groups of ``built`` are in place (with a controller) but for the ``parked``."""
    from orchestrator.rl.fleet import FleetState

    in_place = (frozenset(built) - parked) | {"controller"}
    return FleetState(built=built, in_place=in_place, parked=parked, **extra)


def test_engines_serve_a_run_without_a_learner_only_with_its_model(tmp_path):
    """A run without a learner (eval, search, PRM labelling) has no learner to push its model into kept engines: it
    keeps them when they hold that model unchanged, or when the model's safetensors can be loaded into them in
    place (:meth:`RolloutPool.load_model`, after a training run pushed into them); else it starts new ones."""
    from orchestrator.rl.fleet import Roles, _engine_weights, plan_serve

    def plan_after(model: Path, first: Roles, then: Roles, *extra: str):
        train = load_config(None, ["rollout.num_workers=1", f"model.path={model}", *extra])
        evaluate = load_config(None, ["rollout.num_workers=1", f"model.path={model}", "run.dir=runs/eval", *extra])
        plan = plan_serve(_after({"rollout": train}, engine_weights=_engine_weights(train, first)), evaluate, then)
        assert not plan.rebuild and plan.stop | plan.keep == {"rollout", "controller"}  # the same engine settings
        assert ("rollout" in plan.start) != ("rollout" in plan.keep)  # kept, or new engines started
        return plan.keep, plan.reload

    safetensors, torch_bin = tmp_path / "st", tmp_path / "bin"
    header = b'{"model.layers.0.self_attn.q_proj.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    for d, file in ((safetensors, "model.safetensors"), (torch_bin, "pytorch_model.bin")):
        d.mkdir()
        (d / file).write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    evaluates, trains = Roles(rollout=True), Roles(learner=True, rollout=True)
    for model in (safetensors, torch_bin):
        assert plan_after(model, evaluates, evaluates) == ({"rollout"}, False)  # an eval after an eval of the model
        assert plan_after(model, trains, trains) == ({"rollout"}, False)  # the learner pushes the new run's model
    assert plan_after(safetensors, trains, evaluates) == ({"rollout"}, True)  # after training: reloaded from disk
    assert plan_after(torch_bin, trains, evaluates) == (set(), False)  # not loadable in place: new engines
    assert plan_after(safetensors, trains, evaluates, "learner.lora.rank=4") == (set(), False)  # adapters in them


def test_a_group_a_run_does_not_use_is_parked_and_a_later_run_that_fits_keeps_it():
    """:func:`plan_serve` between runs: an SFT run without evals parks the RL run's engines and reward actors
    (idle, out of its groups) instead of stopping them, and the next RL run takes them back and keeps them; a
    parked group that does not fit that run, a group holding GPUs and the controller are stopped, never parked."""
    from orchestrator.rl.fleet import plan_serve

    rl = load_config(None, ["rollout.num_workers=1"])
    sft = load_config(None, ["rollout.num_workers=1", "algorithm={}", "algorithm.name=sft"])
    trains, fine_tunes = Roles(learner=True, rollout=True, reward=True), Roles(learner=True)
    after_rl = dict.fromkeys(trains.names(), rl)

    plan = plan_serve(_after(after_rl), sft, fine_tunes)
    assert (plan.keep, plan.park, plan.stop, plan.unpark, plan.start) == \
        ({"learner"}, {"rollout", "reward"}, {"controller"}, set(), ())
    after_sft = _after(after_rl, parked=frozenset({"rollout", "reward"}))
    plan = plan_serve(after_sft, rl, trains)
    assert (plan.unpark, plan.keep, plan.stop, plan.park, plan.start) == \
        ({"rollout", "reward"}, {"learner", "rollout", "reward"}, {"controller"}, set(), ())
    assert not plan.rebuild and not plan.reload  # the same engines; the learner pushes the run's weights
    wider = load_config(None, ["rollout.num_workers=2"])  # another placement: the parked engines do not fit
    plan = plan_serve(after_sft, wider, trains)
    assert (plan.unpark, plan.keep, plan.stop, plan.start) == \
        ({"rollout", "reward"}, {"learner", "reward"}, {"rollout", "controller"}, ("rollout",))
    plan = plan_serve(after_sft, sft, fine_tunes)  # parked groups of roles the run does not use stay parked
    assert (plan.keep, plan.unpark, plan.park, plan.stop) == ({"learner"}, set(), set(), {"controller"})
    gpu = load_config(None, ["rollout.num_workers=1", "rollout.num_gpus=1"])
    plan = plan_serve(_after(dict.fromkeys(trains.names(), gpu)), sft, fine_tunes)
    assert plan.park == {"reward"} and plan.stop == {"rollout", "controller"}  # a parked GPU engine keeps its memory


def test_a_fleet_keeps_no_dead_group_and_no_reward_across_a_judge():
    """An actor that does not answer takes its group with it (stopped, started again); a reward group holding a
    judge's engines (of the run that made it) is never kept nor parked, and neither is one for a run with a judge.
    Kept CPU engines of other engine settings build new engines in their actors."""
    from orchestrator.rl.fleet import plan_serve

    rl = load_config(None, ["rollout.num_workers=1"])
    trains = Roles(learner=True, rollout=True, reward=True)
    built = dict.fromkeys(trains.names(), rl)
    plan = plan_serve(_after(built, dead=frozenset({"rollout"})), rl, trains)
    assert plan.keep == {"learner", "reward"} and "rollout" in plan.stop and plan.start == ("rollout",)
    for state, judge in ((_after(built, judged=True), False), (_after(built), True)):
        plan = plan_serve(state, rl, trains, judge=judge)
        assert plan.keep == {"learner", "rollout"} and "reward" in plan.stop and plan.start == ("reward",)
    plan = plan_serve(_after(built, judged=True), rl, Roles(learner=True))
    assert plan.park == {"rollout"} and plan.stop == {"reward", "controller"}
    small_cache = load_config(None, ["rollout.num_workers=1", "rollout.kv_cache_gib=0.5"])
    plan = plan_serve(_after(built), small_cache, trains)
    assert plan.keep == {"learner", "rollout", "reward"} and plan.rebuild == {"rollout"} and not plan.start


def test_parked_groups_make_room_only_when_the_cluster_has_it():
    """:func:`room_for`: the critic ranks a PPO run adds fit beside the parked groups on a cluster with the CPUs
    free, not on one without (:meth:`Fleet._make_room` then stops the parked groups)."""
    from orchestrator.rl.fleet import room_for

    critic = load_config(None, ["algorithm.name=ppo"])  # learner.num_ranks critic ranks of learner.num_cpus each
    assert room_for(critic, ["critic"], {"CPU": 8.0})
    assert not room_for(critic, ["critic"], {"CPU": 0.5})
    assert not room_for(load_config(None, ["rollout.num_gpus=1"]), ["rollout"], {"CPU": 8.0})  # no GPU at all
    assert room_for(critic, [], {})


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
