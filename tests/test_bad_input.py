"""Bad input found by trying the CLI as a new user would: each gets one line naming the key, file or
value and what is allowed, exit 2, before anything starts and with nothing written. In-process (`cli.main`), so
the table costs seconds; the run-time cases (a reward function failing in the actors) are in test_faults."""

import json

import pytest

from orchestrator.cli.main import main


def bad_signature(prompt, completion):  # no metadata
    return 1.0


def raises_on_everything(prompt, completion, metadata):
    raise KeyError("tests")


def returns_text(prompt, completion, metadata):
    return "good"


def good_reward(prompt, completion, metadata, bonus=0.0):
    return 1.0 + bonus


@pytest.fixture(autouse=True, scope="module")
def _close_the_verification_pool():
    """The load-time reward check calls user functions in this process's bounded pool: close it after these
    tests, so later tests see no worker process of ours."""
    yield
    import rewards.bounded as bounded

    if bounded._shared is not None:
        bounded._shared.close()
        bounded._shared = None


@pytest.fixture(autouse=True)
def _refused_before_the_model_is_built(monkeypatch):
    """Every refusal here comes before the embedded model would be built (1.5 min on 2 cores on a clean clone);
    other model directories are checked as a run checks them."""
    from orchestrator.config import EMBEDDED_MODELS
    from orchestrator.rl.launch import ensure_model

    def build(cfg):
        if cfg.model.path in EMBEDDED_MODELS:
            raise AssertionError(f"{cfg.model.path} would be built before the refusal")
        ensure_model(cfg)

    monkeypatch.setattr("orchestrator.cli.main.ensure_model", build)
    monkeypatch.setattr("orchestrator.rl.driver.ensure_model", build)


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv,words", [
    (["train", "reward.functions=[{name: 'tests.test_bad_input:bad_signature'}]"],
     ["reward.functions", "bad_signature", "cannot be called as fn(prompt, completion, metadata)"]),
    (["train", "reward.functions=[{name: 'tests.test_bad_input:good_reward', params: {bonsu: 1}}]"],
     ["good_reward", "bonsu"]),
    (["train", "reward.functions=[{name: 'tests.no_such_module:fn'}]"], ["tests.no_such_module:fn", "does not import"]),
    (["train", "reward.functions=[{name: 'tests.test_bad_input:raises_on_everything'}]"],
     ["reward.functions[0]", "raises_on_everything", "raised on a sample of the task", "KeyError"]),
    (["train", "reward.functions=[{name: 'tests.test_bad_input:returns_text'}]"],
     ["reward.functions[0]", "returned 'good'", "must return a number"]),
    (["train", "reward.functions=[]"], ["reward.functions: empty"]),
    (["config", "show", "rollout.group_size=true"], ["group_size: a number is expected, not the boolean true"]),
    (["config", "show", "algorithm.gamma=0.9"],
     ["algorithm.grpo.gamma: unknown key", "algorithm.name=reinforce_pp|ppo"]),
    (["stop"], ["--address", "RAY_ADDRESS", "does not attach"]),
    (["status"], ["--address http://HOST:8265"]),
    (["scale", "--rollout", "-1", "--address", "127.0.0.1:1"], ["--rollout -1", "at least 1"]),
    (["stop", "--run", "nope", "--address", "127.0.0.1:1"], ["cannot reach the Ray cluster (GCS) at 127.0.0.1:1"]),
    (["status", "--address", "http://127.0.0.1:1"], ["cannot reach the job API at http://127.0.0.1:1"]),
])
def test_bad_input_gets_one_line_and_exit_2(capsys, monkeypatch, tmp_path, argv, words):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, err = _run(capsys, *argv, *([f"run.dir={tmp_path}/run"] if argv[0] == "train" else []))
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_one_address_names_the_cluster_for_every_cluster_command(monkeypatch):
    """`--address` is the cluster's job API (`http://HOST:8265`) or its GCS (`HOST:PORT`) for every cluster command;
    each derives the one it needs with Ray's default ports, and a GCS in RAY_ADDRESS beats a derived one."""
    from orchestrator.cli.jobs import gcs_address, job_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_address("http://head:8265") == "http://head:8265" and gcs_address("http://head:8265") == "head:6379"
    assert job_address("head:7000") == "http://head:8265" and gcs_address("head:7000") == "head:7000"
    assert gcs_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "head:7000")
    assert gcs_address("http://head:8265") == "head:7000" and gcs_address(None) == "head:7000"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert gcs_address(None) == "head:6379" and job_address(None) == "http://head:8265"

def test_kl_coef_alone_is_the_default_algorithms(capsys):
    assert _run(capsys, "config", "show", "algorithm.kl_coef=0.1")[0] == 0


def test_duplicate_yaml_keys_are_refused(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  group_size: 4\n  group_size: 8\n")
    code, err = _run(capsys, "config", "show", "-c", str(cfg))
    assert code == 2 and "key 'group_size' is given twice" in err and "line 3" in err, err


def test_data_commands_check_n_and_write_nothing_half(capsys, tmp_path):
    out = tmp_path / "rows.jsonl"
    code, err = _run(capsys, "data", "cold-start", "--n", "-1", "--out", str(out))
    assert code == 2 and "--n -1" in err and not out.exists(), err
    assert _run(capsys, "data", "cold-start", "--n", "3", "--out", str(out))[0] == 0
    assert len(out.read_text().splitlines()) == 3 and not list(tmp_path.glob(".*.tmp"))


def test_export_refuses_a_file_a_non_empty_dir_and_a_truncated_weights_file(capsys, tmp_path):
    import torch
    from safetensors.torch import save_file

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    save_file({"w": torch.arange(4096.0)}, str(final / "model.safetensors"))
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    code, err = _run(capsys, "export", str(tmp_path / "run"), "--out", str(taken))
    assert code == 2 and "a file is there" in err, err
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, err = _run(capsys, "export", str(tmp_path / "run"), "--out", str(full))
    assert code == 2 and "not empty" in err and "--force" in err and (full / "keep.txt").exists(), err
    assert _run(capsys, "export", str(tmp_path / "run"), "--out", str(full), "--force")[0] == 0
    assert sorted(p.name for p in full.iterdir()) == ["config.json", "model.safetensors"]
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, err = _run(capsys, "export", str(tmp_path / "run"), "--out", str(tmp_path / "new"))
    assert code == 2 and "not a whole safetensors file" in err and not (tmp_path / "new").exists(), err


def test_model_dirs_a_run_cannot_load_are_refused_at_load(capsys, tmp_path):
    """A config.json without weights, a model that is not a causal LM, a corrupt config.json."""
    cases = {"empty": ('{"architectures": ["Qwen2ForCausalLM"]}', "has a config.json but no weights"),
             "bert": ('{"architectures": ["BertForMaskedLM"]}', "BertForMaskedLM, not a causal LM"),
             "corrupt": ('{"architectures": ', "not a readable JSON config")}
    for name, (config, words) in cases.items():
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text(config)
        if name == "bert":
            (model / "model.safetensors").write_bytes(b"")
        code, err = _run(capsys, "train", f"model.path={model}", f"run.dir={tmp_path}/run")
        assert code == 2 and "model.path" in err and words in err and "Traceback" not in err, (name, err)
    assert not (tmp_path / "run").exists()


def test_a_broken_checkpoint_is_named_before_the_run_dir_is_touched(capsys, tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "trainer_state.json").write_text('{"step": 2, "policy_ver')  # truncated
    code, err = _run(capsys, "train", "--resume", "auto", f"run.dir={tmp_path}/run")
    assert code == 2 and "trainer_state.json is missing or broken" in err and str(step) in err, err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]  # no config.yaml, no logs/


def test_a_dataset_line_that_is_not_utf8_is_named(capsys, tmp_path, smollm2_tokenizer_dir):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "3"}\n')
    code, err = _run(capsys, "train", f"data.path={data}", "data.prompt_field=prompt", f"run.dir={tmp_path}/run",
                     f"model.path={smollm2_tokenizer_dir}")  # a dataset needs a tokenizer; the embedded model is built
    assert code == 2 and f"{data}:2: not UTF-8" in err and "Traceback" not in err, err


def test_an_actor_that_died_starting_is_summarized_with_its_cause_and_no_colour_codes():
    """What the console prints for an actor whose constructor raised (Ray's first line is generic)."""
    from orchestrator.telemetry.console import error_summary

    class ActorDiedError(Exception):
        pass

    text = ("The actor died because of an error raised in its creation task, \x1b[36mray::reward-0:RewardWorker."
            "__init__()\x1b[39m (pid=7, ip=127.0.0.1)\n  File 'x.py', line 3, in f\n    import nope\n"
            "ModuleNotFoundError: No module named 'nope'")
    out = error_summary(ActorDiedError(text))
    assert out == ("ActorDiedError: The actor died because of an error raised in its creation task, ray::reward-0:"
                   "RewardWorker.__init__() (pid=7, ip=127.0.0.1) (cause: ModuleNotFoundError: No module named "
                   "'nope')"), out


@pytest.mark.parametrize("override,words", [
    ("rollout.kv_cache_gib=1000", ["rollout.kv_cache_gib=1000.0", "GiB free"]),
    ("learner.num_ranks=64", ["learner.num_ranks=64", "cores"]),
])
def test_a_private_instance_that_cannot_fit_this_machine_is_refused_before_ray(capsys, monkeypatch, tmp_path,
                                                                                 override, words):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import ray

    code, err = _run(capsys, "train", override, "data.prompts_per_step=64", f"run.dir={tmp_path}/run")
    assert code == 2 and all(w in err for w in words) and not ray.is_initialized(), err
    assert not (tmp_path / "run").exists()


def test_a_stage_that_starts_from_a_stage_that_does_not_exist_is_refused(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {{run: {{dir: {tmp_path}/run}}}}\nstages:\n"
                      "  - {name: a, kind: rl}\n"
                      f"  - {{name: b, kind: rl, overrides: {{model.path: {tmp_path}/run/05-nope/final}}}}\n")
    code, err = _run(capsys, "config", "show", "-c", str(recipe))
    assert code == 2 and "stage 2 (b): model.path" in err and "not an earlier stage's final" in err, err
    assert "01-a/final" in err and not (tmp_path / "run").exists()
