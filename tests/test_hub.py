"""Your model, your data, your reward code: Hub model and dataset ids resolved offline from a Hub cache written by
hand, TRL's data formats read as they are, TRL-signature reward functions called per group."""

import json

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.data import load_pairs, load_sft_rows
from orchestrator.rl.launch import resolve_hub_ids
from rewards.datasets import DatasetError, DatasetTask, Splits
from rewards.worker import RewardWorker
from tests.hub_cache import add_dataset, add_repo, gsm8k_rows


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache in a temp HF_HOME, offline (huggingface_hub reads its constants at import: patched)."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


MODEL_FILES = {"config.json": json.dumps({"architectures": ["Qwen2ForCausalLM"]}).encode(),
               "model.safetensors": b"x"}


def test_a_hub_model_id_resolves_to_its_cached_snapshot_and_is_recorded(hub):
    snap = add_repo(hub, "HuggingFaceTB/SmolLM2-135M-Instruct", MODEL_FILES, commit="c0ffee" * 6 + "beef")
    cfg = resolve_hub_ids(load_config(None, ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"]))
    assert cfg.model.path == str(snap) and (snap / "config.json").exists()
    assert cfg.model.source == "HuggingFaceTB/SmolLM2-135M-Instruct@" + "c0ffee" * 6 + "beef"
    # the teacher, the reward model and eval's checkpoint take ids too; local paths are left alone
    cfg = resolve_hub_ids(load_config(None, ["distill.teacher=HuggingFaceTB/SmolLM2-135M-Instruct",
                                             "model.path=/models/local"]))
    assert cfg.distill.teacher == str(snap) and cfg.model.path == "/models/local" and cfg.model.source is None
    from orchestrator.evaluation.evaluate import resolve_model_dir

    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == snap


def test_an_id_that_cannot_be_had_is_one_line_naming_the_key_the_id_and_the_variable(hub, monkeypatch):
    with pytest.raises(ConfigError) as e:
        resolve_hub_ids(load_config(None, ["model.path=org/not-cached"]))
    msg = str(e.value)
    assert "model.path" in msg and "'org/not-cached'" in msg and "HF_HUB_OFFLINE" in msg and "HF_HOME" in msg
    add_repo(hub, "org/m", MODEL_FILES)
    with pytest.raises(ConfigError, match=r"model.path: Hub model 'org/m' \(revision 'v9'\)"):
        resolve_hub_ids(load_config(None, ["model.path=org/m", "model.revision=v9"]))
    import huggingface_hub
    from huggingface_hub import errors

    response = type("Response", (), {"status_code": 401, "headers": {}, "request": None, "url": "u"})()
    for exc, says in ((errors.GatedRepoError("gated", response=response), "HF_TOKEN"),
                      (errors.RepositoryNotFoundError("missing", response=response), "does not exist")):
        def raise_(*a, _exc=exc, **k):
            raise _exc
        monkeypatch.setattr(huggingface_hub, "snapshot_download", raise_)
        with pytest.raises(ConfigError, match=says) as e:
            resolve_hub_ids(load_config(None, ["reward.model.path=org/rm"]))
        assert "reward.model.path" in str(e.value) and "'org/rm'" in str(e.value)


def test_a_hub_dataset_id_with_config_split_and_eval_split(hub):
    snap = add_dataset(hub, "openai/gsm8k", "main", {"train": gsm8k_rows(30), "test": gsm8k_rows(6, 500)})
    cfg = resolve_hub_ids(load_config(None, ["data.path=openai/gsm8k", "data.config=main", "data.eval_split=test",
                                             "data.prompt_field=question"]))
    assert cfg.data.path == str(snap) and cfg.data.source.startswith("openai/gsm8k@")
    task = DatasetTask(cfg.data.path, "question", "answer", False, 400, 0, splits=Splits("main", "train", "test"))
    assert len(task.train_rows) == 30 and len(task.eval_rows) == 6
    first = task.eval_set(1)[0]
    assert first.text == "What is 500 plus 501?" and first.metadata["answer"] == "1001"  # '#### N' reduced
    with pytest.raises(DatasetError, match="validation"):
        DatasetTask(cfg.data.path, "question", "answer", False, 5, 0, splits=Splits("main", "validation"))
    with pytest.raises(ConfigError, match="data.eval_split.*data.eval_path.*give one"):
        load_config(None, ["data.eval_split=test", "data.eval_path=x.jsonl"])


def test_trl_sft_and_preference_formats_from_files_and_dataset_directories(tmp_path):
    import datasets

    pc = tmp_path / "pc.jsonl"
    pc.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n" + json.dumps(
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}) + "\n")
    assert load_sft_rows(pc) == [
        {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 3).save_to_disk(str(tmp_path / "disk"))
    assert len(load_sft_rows(tmp_path / "disk")) == 3
    user = [{"role": "user", "content": "q"}]
    implicit = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list([{"chosen": [*user, {"role": "assistant", "content": "good"}],
                                 "rejected": [*user, {"role": "assistant", "content": "bad"}]}]).to_parquet(implicit)
    (row,) = load_pairs(implicit)
    assert row["prompt"] == user and row["chosen"] == [{"role": "assistant", "content": "good"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "answer": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: .*'completion'"):
        load_sft_rows(bad)


# TRL-signature reward functions, named by import path from this module
def trl_accuracy(completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.split()[-1:] == [str(a)]) for t, a in zip(texts, answer)]


def trl_math(prompts, completions, answer, **kwargs):
    """The `math` rule in TRL's signature: equal to `math` on every sample only if each sample gets its own prompt,
    completion and answer (a misaligned column would show)."""
    from rewards.functions import math_reward

    return [math_reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]


def trl_seen(completions, prompts, completion_ids, trainer_state, **kwargs):
    """1 for every sample of a group of 2 whose prompt is a message list, and the step and token count."""
    assert len(completions) == 2, "called once per group"
    return [100.0 * trainer_state.global_step + len(ids) + 0.5 * isinstance(p, list)
            for p, ids in zip(prompts, completion_ids)]


def trl_abstains(completions, **kwargs):
    return [None, 1.0]


def trl_wrong_length(completions, **kwargs):
    return [1.0]


def trl_no_kwargs(completions):
    return [0.0] * len(completions)


def test_trl_reward_functions_run_unchanged_per_group():
    msgs = [{"role": "user", "content": "2+2?"}]
    conv = {"answer": "9", "_prompt_messages": msgs}
    items = [("p1", "so 4", {"answer": "4"}), ("p1", "so 5", {"answer": "4"}), ("p2", "9", conv), ("p2", "8", conv)]
    extras = [([1, 2], 3), ([1], 3), ([1, 2, 3], 3), ([], 3)]
    w = RewardWorker([("tests.test_hub:trl_accuracy", 1.0, {}), ("math", 1.0, {}),
                      ("tests.test_hub:trl_seen", 0.0, {}), ("tests.test_hub:trl_abstains", 2.0, {})],
                     timeout_s=10, strict=False)
    out = w.score(items, extras)
    assert out.errors == 0 and out.timeouts == 0
    assert [r.components["tests.test_hub:trl_accuracy"] for r in out.results] == [1.0, 0.0, 1.0, 0.0]
    assert [r.components["tests.test_hub:trl_seen"] for r in out.results] == [302.0, 301.0, 303.5, 300.5]
    # None is no score: left out of the sum and of the components
    assert "tests.test_hub:trl_abstains" not in out.results[0].components
    assert [r.reward for r in out.results] == [2.0, 2.0, 2.0, 2.0]
    narrow = RewardWorker([("tests.test_hub:trl_no_kwargs", 1.0, {})], timeout_s=10, strict=False).score(items, extras)
    assert narrow.errors == 0  # a function without **kwargs gets only the keywords it names
    bad = RewardWorker([("tests.test_hub:trl_wrong_length", 1.0, {})], timeout_s=10, strict=False).score(items, extras)
    assert bad.errors == 4 and "not a list of 2 scores" in bad.first_error  # each group's call failed: 2 x 2


def test_a_trl_reward_binds_at_load_and_cannot_be_the_verifier():
    cfg = load_config(None, ["reward.functions=[{name: 'tests.test_hub:trl_accuracy'}, {name: math}]"])
    assert [f.name for f in cfg.reward.functions] == ["tests.test_hub:trl_accuracy", "math"]
    with pytest.raises(ConfigError, match="TRL's batched signature"):
        load_config(None, ["data.verifier=tests.test_hub:trl_accuracy"])
    with pytest.raises(ConfigError, match="cannot take"):
        load_config(None, ["reward.functions=[{name: 'tests.test_hub:trl_no_kwargs', params: {a: 1}}]"])
    # only a run with a TRL-signature function ships token ids and policy versions to its reward actors
    from orchestrator.rl.pools import sends_token_ids

    assert sends_token_ids(cfg) and not sends_token_ids(load_config(None, []))
    assert not sends_token_ids(load_config(None, ["reward.functions=[{name: 'tests.test_bad_input:good_reward'}]"]))


@pytest.mark.parametrize("text", ["### Final answer\n159", "### Final Answer:\n159", "**Final Answer**\n\n159",
                                  "Final answer\n159"])
def test_the_math_rule_reads_a_final_answer_heading(text):
    from rewards.functions import math_reward

    assert math_reward("", text, {"answer": "159"}) == 1.0


@pytest.mark.e2e
def test_train_with_a_hub_model_a_hub_dataset_and_a_trl_reward(tmp_path, embedded_model):
    """Only this test guards Hub ids end to end: `fleetrl train` on the shared fleet with the embedded model cached as
    a Hub model id, a Hub dataset id in GSM8K's layout (config `main`, a `test` split for evals), a TRL-signature
    reward beside `math`; 2 steps, no reward errors, the resolved revisions recorded in config.yaml and summary."""
    import random

    import yaml

    from tests.hub_cache import add_model_dir
    from tests.test_e2e import run_fleetrl

    home = tmp_path / "hf"
    snap = add_model_dir(home, "fleetrl/arith-base", embedded_model)
    rng = random.Random(0)
    rows = [{"question": f"{a}+{b}=", "answer": f"the sum\n#### {a + b}"}
            for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(80))]
    add_dataset(home, "fleetrl/sums", "main", {"train": rows[:64], "test": rows[64:]})
    run_dir = tmp_path / "run"
    metrics = run_fleetrl(run_dir, "model.path=fleetrl/arith-base", "data.path=fleetrl/sums", "data.config=main",
                          "data.prompt_field=question", "data.eval_split=test", "data.eval_size=16",
                          "reward.functions=[{name: 'tests.test_hub:trl_math'}, {name: math}]",
                          "trainer.total_steps=2", "trainer.eval_every=2", "rollout.num_workers=1",
                          "learner.num_ranks=1", "learner.zero_stage=0", env={"HF_HOME": str(home)})
    steps = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in steps] == [0, 1] and all(m["reward/errors"] == 0 for m in steps), steps
    # the TRL-signature function got every sample's own prompt, completion and answer column
    assert all(m["reward/tests.test_hub:trl_math"] == m["reward/math"] for m in steps), steps
    assert all(m["reward/math"] > 0 for m in steps)
    assert "eval/accuracy" in metrics[-1]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == str(snap) and saved["model"]["source"] == f"fleetrl/arith-base@{snap.name}"
    assert saved["data"]["source"].startswith("fleetrl/sums@") and saved["data"]["config"] == "main"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_source"] == saved["model"]["source"] and summary["data_source"] == saved["data"]["source"]
