"""Config: one pydantic tree, YAML + dotted overrides, errors that name the key and what is allowed."""

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, FleetConfig, GRPOConfig, RLOOConfig, load_config
from tests.conftest import cli

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_embedded_default_and_documented():
    cfg = load_config()
    assert cfg.rollout.num_workers >= 2 and cfg.learner.num_ranks == 2 and cfg.reward.num_workers == 1
    assert isinstance(cfg.algorithm, GRPOConfig)
    for section in FleetConfig.model_fields.values():
        cls = section.annotation
        for name, field in getattr(cls, "model_fields", {}).items():
            assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "cfg.yaml"
    f.write_text("rollout:\n  group_size: 4\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(f, ["rollout.group_size=8", "trainer.total_steps=20", "algorithm.name=rloo",
                          "run.dir=/tmp/x", "model.path=/models/m"])
    assert cfg.rollout.group_size == 8 and cfg.trainer.total_steps == 20 and cfg.run.dir == "/tmp/x"
    assert isinstance(cfg.algorithm, RLOOConfig) and cfg.model.path == "/models/m"
    for key in ("trainer.total_steps", "data.prompts_per_step", "rollout.num_workers", "rollout.group_size",
                "rollout.max_new_tokens", "reward.num_workers", "learner.num_ranks", "learner.zero_stage",
                "algorithm.name", "run.dir", "model.path", "trainer.eval_every"):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name)


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.group_sise=8"])
    msg = str(e.value)
    assert "rollout.group_sise" in msg and "unknown key" in msg and "group_size" in msg


def test_out_of_range_and_wrong_type():
    with pytest.raises(ConfigError, match=r"learner\.zero_stage.*less than or equal to 3.*got 5"):
        load_config(None, ["learner.zero_stage=5"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size.*integer"):
        load_config(None, ["rollout.group_size=lots"])


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.name=ppo2"])
    assert "grpo" in str(e.value) and "rloo" in str(e.value)


def test_algorithm_fields_belong_to_their_algorithm():
    with pytest.raises(ConfigError, match="scale_by_std"):
        load_config(None, ["algorithm.name=rloo", "algorithm.scale_by_std=false"])


def test_batch_split_cross_check_explains_itself():
    with pytest.raises(ConfigError, match="learner.num_ranks"):
        load_config(None, ["data.prompts_per_step=3", "rollout.group_size=3", "learner.num_ranks=2"])


def test_yaml_file_errors_name_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_cli_bad_config_exits_2_without_starting_anything():
    r = subprocess.run([sys.executable, "-m", "orchestrator", "train", "rollout.group_size=0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "rollout.group_size" in r.stderr and "greater than or equal to 1" in r.stderr
    assert "ray" not in r.stdout.lower()


def test_cli_config_show_prints_resolved_config():
    r = subprocess.run([sys.executable, "-m", "orchestrator", "config", "show", "rollout.group_size=4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "group_size: 4" in r.stdout


def test_the_fleetrl_script_finds_plugins_of_the_working_directory(smollm2_tokenizer_dir):
    """``env.agent: examples.math_agent:solve`` from the repo root, through the installed ``fleetrl`` script (whose
    ``sys.path[0]`` is its bin directory, not the working directory as under ``python -m``). SmolLM2's tokenizer
    (the agent's chat template is checked at load), not its converted weights: a clean clone has none yet."""
    script = Path(sys.executable).parent / "fleetrl"
    r = subprocess.run([str(script), "config", "show", "-c", "configs/smollm2_agent.yaml",
                        f"model.path={smollm2_tokenizer_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "agent: examples.math_agent:solve" in r.stdout, r.stderr


def test_a_missing_model_of_a_config_that_reads_its_tokenizer_at_load_is_a_clear_error():
    """`configs/smollm2_agent.yaml` checks the model's chat template at load: without `make smollm2` that was
    transformers' hub traceback ("Repo id must be in the form ...", exit 1); now the key and the way to get one."""
    r = cli("config", "show", "-c", "configs/smollm2_agent.yaml", "model.path=.fleetrl/models/not-converted")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "model.path: '.fleetrl/models/not-converted' is not a model directory" in r.stderr


def test_cli_missing_model_path_is_a_clear_error(tmp_path):
    r = cli("train", f"model.path={tmp_path}/nope", f"run.dir={tmp_path}/run")
    assert r.returncode == 2
    assert "model.path" in r.stderr and "not a model directory" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing half-started


@pytest.mark.parametrize("overrides,separate", [
    ([], False),
    (["rollout.mode=one_step_off"], False),  # the update's first pass is the proximal policy; TIS weighs the lag
    (["rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16"], False),
    (["learner.epochs=2"], True),  # the second epoch needs the pre-update logprobs kept from before the first
    (["learner.num_minibatches=2"], True),
    (["algorithm.name=ppo"], True),  # KL-shaped rewards and GAE need them before the update
    (["learner.logprob_pass=always"], True),
])
def test_separate_logprob_pass_only_when_the_batch_is_used_more_than_once(overrides, separate):
    from orchestrator.loops.policy import separate_logprob_pass

    cfg = load_config(None, ["run.dir=/tmp/fleetrl-unused", *overrides])
    assert cfg.engine_dtype == ("bfloat16" if "rollout.dtype=bfloat16" in overrides else "float32")
    assert separate_logprob_pass(cfg) is separate


@pytest.mark.parametrize("algorithm, temperature", [("grpo", 0.7), ("ppo", 0.7), ("rloo", 0.7), ("sft", 1.0),
                                                    ("dpo", 1.0), ("prm", 1.0)])
def test_learner_temperature_is_the_sampling_one_only_for_policy_gradients(algorithm, temperature):
    """PPO-family ratios compare against the policy that sampled at rollout.temperature; SFT, DPO and PRM losses
    are the model's own likelihoods (an NLL at temperature 0.7 would train a sharper model than the data)."""
    from orchestrator.rl.specs import learner_temperature

    cfg = FleetConfig.model_validate({"algorithm": {"name": algorithm}, "rollout": {"temperature": 0.7}})
    assert learner_temperature(cfg) == temperature


@pytest.mark.parametrize("override, why", [
    ("env.name=tests.test_envs:Turn", "not a workers.envs.api.Environment"),   # a class, but not an Environment
    ("env.name=nosuch_pkg.mod:Env", "cannot be imported"),                    # a module that does not import
    ("env.name=nope", "unknown environment 'nope'"),
    ("env.tools=[json:dumps]", "not a workers.envs.tools.Tool"),             # an object that is not a Tool
    ("env.tools=[calculator, tests.broken_plugin:tool]", "ZeroDivisionError"),  # a module that raises on import
])
def test_plugins_that_are_not_what_they_claim_are_config_errors(override, why):
    with pytest.raises(ConfigError, match=why) as e:
        load_config(None, [override])
    assert override.split("=")[0] in str(e.value)


def test_cli_bad_plugin_exits_2_in_one_line_before_any_actor(tmp_path):
    r = cli("train", "env.name=tests.test_envs:Turn", f"run.dir={tmp_path}/run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "env.name" in r.stderr and "tests.test_envs:Turn" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, why", [
    (["rollout.mode=async", "algorithm.tis_cap=null"], "rollout.max_staleness=1 .*algorithm.tis_cap"),
    (["rollout.mode=async", "env.name=tool"], "multi-turn episodes"),
    (["rollout.mode=async", "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling"),
    (["rollout.mode=async", "rollout.stale_policy=keep"], "rollout.stale_policy"),
    (["rollout.mode=one_step_off", "rollout.max_staleness=0"], "max_staleness >= 1"),
])
def test_the_asynchronous_modes_refuse_what_they_cannot_train(overrides, why):
    """What rollout.mode=async cannot do is refused at load, naming the key; with max_staleness 0 (sync's
    samples) it needs no importance correction."""
    with pytest.raises(ConfigError, match=why):
        load_config(None, overrides)
    assert load_config(None, ["rollout.mode=async", "rollout.max_staleness=0", "algorithm.tis_cap=null"])


def test_cli_on_policy_distill_with_another_tokenizer_exits_2_before_any_actor(tmp_path, smollm2_tokenizer_dir):
    """The teacher scores the student's token ids: a teacher with another vocabulary (SmolLM2's tokenizer against
    the embedded model's) is one line and exit 2, before Ray or any actor; so is a teacher that is not a model."""
    from orchestrator.loops.policy import check_same_tokenizer

    r = cli("train", "algorithm.name=on_policy_distill", f"distill.teacher={smollm2_tokenizer_dir}",
            f"run.dir={tmp_path}/run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "distill.teacher" in r.stderr and "same tokenizer" in r.stderr
    assert "ray" not in r.stdout.lower() and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="distill.teacher: give"):
        check_same_tokenizer(load_config(None, ["algorithm.name=on_policy_distill"]))
    check_same_tokenizer(load_config(None, ["algorithm.name=on_policy_distill", f"model.path={smollm2_tokenizer_dir}",
                                            f"distill.teacher={smollm2_tokenizer_dir}"]))


@pytest.mark.parametrize("override", ["rollout.temperature=0.7", "rollout.top_p=0.9"])
def test_on_policy_distill_samples_the_students_own_distribution(override):
    """The teacher's logprobs are at temperature 1; a tempered or truncated student would be compared with another
    distribution than the one it sampled from."""
    with pytest.raises(ConfigError, match="rollout.temperature=1.0 and rollout.top_p=1.0"):
        load_config(None, ["algorithm.name=on_policy_distill", override])
    assert load_config(None, ["algorithm.name=grpo", override])


def test_run_seed_seeds_every_part_and_a_contradicting_section_seed_is_refused():
    cfg = load_config(None, ["run.seed=7"])
    assert (cfg.data.seed, cfg.rollout.seed, cfg.trainer.seed) == (7, 7, 7)
    assert load_config(None, ["run.seed=7", "trainer.seed=7"]).trainer.seed == 7  # saying it twice is fine
    with pytest.raises(ConfigError, match=r"run.seed=7 sets data.seed, rollout.seed and trainer.seed; rollout.seed=3"):
        load_config(None, ["run.seed=7", "rollout.seed=3"])
    resolved = load_config(None, ["run.seed=7"])  # a resolved config (a checkpoint's) loads as it was written
    assert FleetConfig.model_validate(resolved.model_dump()).data.seed == 7


def _commands(parser, path=()):
    """Every command path of the `fleetrl` parser (`train`, `cai revise`, ...) with its parser."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for name, sp in (subs[0].choices.items() if subs else ()):
        yield from _commands(sp, (*path, name))


def test_version_and_each_commands_own_help():
    """`fleetrl --version` is the installed package's; `fleetrl cai revise --help` is `cai revise`'s help (it was
    `cai`'s), for every command and subcommand."""
    from importlib.metadata import version

    from orchestrator.cli.main import _parser

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fleetrl {version('fleetrl')}"
    paths = [path for path, _ in _commands(_parser())]
    assert ("cai", "revise") in paths and ("config", "docs") in paths and ("data", "tool-demos") in paths
    for path in paths:
        r = cli(*path, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: fleetrl {' '.join(path)} "), (path, r.stdout[:80])


def test_every_run_starting_command_takes_verbose():
    """`--verbose` means `run.verbose=true` for every command that starts actors (or a job that does)."""
    from orchestrator.cli.main import parse_args

    needs = {"cai revise": ["--n", "1", "--out", "x"], "cai prefer": ["--n", "1", "--out", "x"]}
    for cmd in ("train", "eval", "rft", "sft", "distill", "prm label", "prm train", "cai revise", "cai prefer",
                "pipeline", "submit"):
        args = parse_args([*cmd.split(), "-c", "x.yaml", *needs.get(cmd, []), "--verbose", "a.b=1"])
        assert args.overrides == ["a.b=1", "run.verbose=true"], cmd
