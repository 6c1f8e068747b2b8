"""Process supervision and test-time search, the pure parts: Monte-Carlo step labels on a hand-built tree of
outcomes, the PRM loss by hand, the PRM encoding, the step task, UCB against the seed's formula, MCTS selection and
backup, beam search keeping the top-k by PRM score, the aggregations, majority voting, and bad input."""

import math
from types import SimpleNamespace

import pytest
import torch

from learner.algorithms import step_token_rewards
from learner.losses import LossScale, prm_loss
from orchestrator.config import ConfigError, load_config
from orchestrator.evaluation.search.driver import Searcher, parse_methods
from orchestrator.evaluation.search.methods import (
    Node,
    backup,
    best_index,
    mc_labels,
    select_child,
    select_leaf,
    top_k,
    ucb,
)
from orchestrator.loops.process_reward import held_out, load_labels, prm_batch, prm_example, step_targets
from rewards.datasets import DatasetError
from rewards.functions import majority_vote
from rewards.prm import aggregate, encode, split_steps, tagged_steps
from rewards.tasks import ArithmeticTask, ChainTask, Prompt, chain_reward, step_truth


# ---- Monte-Carlo labels -------------------------------------------------------------------------------------------
def test_mc_labels_on_a_hand_built_tree():
    """A 3-step solution. From the prefix ending at step 1, 4 continuations: 2 reach the answer; from step 2 none
    of 4 does; the solution itself (the last step's label) is wrong. Math-Shepherd: soft = success fraction, hard =
    any success."""
    tree = [[True, False, True, False], [False, False, False, False], [False]]
    soft, hard = mc_labels(tree)
    assert soft == [0.5, 0.0, 0.0]
    assert hard == [1, 0, 0]
    soft, hard = mc_labels([[False, False, True], [True, True, True], [True]])
    assert soft == pytest.approx([1 / 3, 1.0, 1.0]) and hard == [1, 1, 1]


# ---- aggregations, votes, selection --------------------------------------------------------------------------------
def test_aggregations():
    s = [0.9, 0.4, 0.8]
    assert aggregate(s, "min") == 0.4
    assert aggregate(s, "last") == 0.8
    assert aggregate(s, "prod") == pytest.approx(0.9 * 0.4 * 0.8)
    assert aggregate([], "min") == 0.0
    with pytest.raises(ValueError, match="valid"):
        aggregate(s, "mean")


def test_majority_vote_and_best_index():
    assert majority_vote(["5", "7", "7", None, "5", "7"]) == 1  # "7" wins 3-2: its first sample
    assert majority_vote(["5", "7", "7", "5"]) == 0  # a tie goes to the answer seen first
    assert majority_vote([None, None]) is None
    assert best_index([0.2, 0.9, 0.9]) == 1
    assert top_k([0.1, 0.7, 0.3, 0.7, 0.5], 3) == [1, 3, 4]


def test_ucb_against_the_formula():
    """UCB = Q(s, a) + c * sqrt(ln N(s) / N(s, a)) (UCT, Kocsis & Szepesvari 2006); an unvisited child first."""
    assert ucb(0.5, 10, 2, 1.4) == pytest.approx(0.5 + 1.4 * math.sqrt(math.log(10) / 2))
    assert ucb(0.0, 10, 0, 1.0) == math.inf
    assert ucb(0.7, 5, 5, 0.0) == 0.7  # c = 0: pure exploitation
    root = Node([], visits=10)
    a = Node(["a"], parent=root, visits=6, value_sum=4.2)  # Q 0.7, few explorations left
    b = Node(["b"], parent=root, visits=2, value_sum=0.8)  # Q 0.4, rarely visited
    root.children = [a, b]
    assert select_child(root, 0.0) is a  # exploitation picks the higher Q
    assert select_child(root, 2.0) is b  # 0.4 + 2 * sqrt(ln 10 / 2) > 0.7 + 2 * sqrt(ln 10 / 6)


def test_select_leaf_and_backup():
    root = Node([])
    child = Node(["x;"], parent=root)
    root.children = [child]
    assert select_leaf(root, 1.0, width=2) is root  # the root can still grow a second child
    assert select_leaf(root, 1.0, width=1) is child
    grandchild = Node(["x;", "y"], parent=child)
    child.children = [grandchild]
    backup(grandchild, 0.6)
    backup(child, 0.2)
    assert (root.visits, root.value_sum) == (2, pytest.approx(0.8))
    assert (child.visits, child.q) == (2, pytest.approx(0.4))
    assert (grandchild.visits, grandchild.q) == (1, pytest.approx(0.6))


# ---- the step task and the PRM layout ------------------------------------------------------------------------------
def test_chain_task_steps_and_verifier():
    task = ChainTask(max_operand=20, terms=4)
    (text, meta), = task.draw_train(__import__("random").Random(0), 1)
    terms = meta["terms"]
    assert text == "+".join(map(str, terms)) + "="
    assert meta["steps"] == [str(sum(terms[:k + 1])) for k in range(1, 4)] and meta["answer"] == meta["steps"][-1]
    solution = task.solution(meta)
    assert split_steps(solution, ";") == [s + ";" for s in meta["steps"][:-1]] + [meta["steps"][-1]]
    assert chain_reward(text, solution, meta) == 1.0
    assert chain_reward(text, solution + "1", meta) == 0.0
    wrong_middle = f"{meta['steps'][0]};999;{meta['steps'][2]}"
    assert chain_reward(text, wrong_middle, meta) == 1.0  # the outcome is right; the process is not
    assert step_truth(split_steps(wrong_middle, ";"), meta) == [True, False, True]
    eval_keys = {p.text for p in task.eval_set(50)}
    assert not eval_keys & {t for t, _ in task.draw_train(__import__("random").Random(1), 500)}


def test_split_steps():
    assert split_steps("42;49;70", ";") == ["42;", "49;", "70"]
    assert split_steps("42;49;", ";") == ["42;", "49;"]
    assert split_steps("a\n\nb", "\n") == ["a\n", "b"]
    with pytest.raises(ValueError, match="separator"):
        split_steps("x", "")


class CharTokenizer:
    """One token per character (the embedded models' tokenizers work this way)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_prm_encoding_and_targets():
    tok = CharTokenizer()
    ids, positions = tagged_steps(tok, ["12;", "7"], tag=0)
    assert ids == [ord("1"), ord("2"), ord(";"), 0, ord("7"), 0] and positions == [3, 5]
    row = {"prompt": "5+7+0=", "steps": ["12;", "7"], "soft": [0.25, 0.0], "hard": [1, 0], "correct": False}
    ex = prm_example(tok, row, tag=0, target="soft")
    assert ex.prompt_ids == encode(tok, "5+7+0=", [], 0)[0] == [1] + [ord(c) for c in "5+7+0="]
    assert ex.loss_mask == [0, 0, 0, 1, 0, 1] and ex.targets == [0, 0, 0, 0.25, 0, 0.0]
    assert step_targets(row, "hard") == [1.0, 0.0]
    assert step_targets(row, "outcome") == [None, 0.0]  # an ORM learns the final outcome only
    outcome = prm_example(tok, row, tag=0, target="outcome")
    assert outcome.loss_mask == [0, 0, 0, 0, 0, 1]
    batch = prm_batch([ex], 2, pad_id=0)
    assert batch.targets[0, 3] == 0.25 and batch.response_mask[1].sum() == 0  # the filler row trains nothing


def test_prm_loss_by_hand_and_only_on_tags():
    """BCE of p = exp(logp) at the masked (tag) positions; other positions get exactly zero gradient."""
    logp = torch.log(torch.tensor([[0.8, 0.5, 0.3], [0.6, 0.9, 0.2]])).requires_grad_(True)
    targets = torch.tensor([[1.0, 0.0, 0.25], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    loss, m = prm_loss(logp, targets, mask, LossScale(2, 3, 3))

    def bce(p, y):
        return -(y * math.log(p) + (1 - y) * math.log(1 - p))

    expected = (bce(0.8, 1.0) + bce(0.3, 0.25) + bce(0.2, 1.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["prm/accuracy"].item() == pytest.approx(2 / 3)  # 0.8 vs 1 and 0.3 vs 0.25 right, 0.2 vs 1 wrong
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).all()


def test_step_rewards_on_step_end_tokens():
    rewards = step_token_rewards(torch.tensor([[0.5, 0.2], [0.9, 0.0]]), torch.tensor([[1, 3], [2, -1]]),
                                 torch.ones(2, 4))
    assert torch.allclose(rewards, torch.tensor([[0.0, 0.5, 0.0, 0.2], [0.0, 0.0, 0.9, 0.0]]))


# ---- beam search keeps the top-k by PRM score -----------------------------------------------------------------------
class ScriptedRollouts:
    """Next steps by a fixed script: from any prefix, the n samples are the steps ``"a;", "b;", ...`` (or, two
    steps deep, the final steps ``"A", "B", ...``); records what was continued."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, temperature, seed, prefixes=None, stop=None, max_new_tokens=None):
        self.calls.append([bytes(p).decode() for p in prefixes])
        out = []
        for pre in prefixes:
            depth = bytes(pre).decode().count(";")
            for j in range(n):
                text = (chr(ord("a") + j) + ";") if depth < 1 else chr(ord("A") + j)
                out.append(SimpleNamespace(completion_text=text, completion_ids=list(text.encode())))
        return out


class ScriptedPRM:
    """Scores a step by a table; a path's steps are scored one by one."""

    table = {"a;": 0.2, "b;": 0.9, "c;": 0.5, "d;": 0.7, "A": 0.3, "B": 0.8, "C": 0.1, "D": 0.6}

    def score(self, items):
        return [[self.table[s] for s in steps] for _, steps in items]


class ByteTokenizer:
    eos_token_id = -1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode())}

    def apply_chat_template(self, *a, **k):
        raise AssertionError("raw prompts only")


def test_prm_beam_keeps_top_k_by_prm_score():
    cfg = load_config(None, ["data.task=chain", "data.prompt_format=raw", "search.expansions=4", "search.max_steps=2"])
    rollouts = ScriptedRollouts()
    searcher = Searcher(cfg, rollouts, ScriptedPRM(), None, ByteTokenizer(), ";")
    prompt = Prompt("p", "1+2=", {})
    (solution,) = searcher.prm_beam([prompt], budget=8)  # 8 candidates per round: 2 beams x 4 expansions
    assert sorted(rollouts.calls[1]) == ["b;", "d;"]  # the two best first steps (0.9, 0.7) were expanded
    assert solution.steps == ["b;", "B"]  # min over steps: b;B = 0.8 beats d;B = 0.7
    assert solution.tokens == 4 * 2 + 8 * 1  # round 1: 4 steps of 2 tokens; round 2: 8 final steps of 1 token


# ---- answers, bad input ---------------------------------------------------------------------------------------------
def test_majority_votes_on_the_tasks_final_answer():
    chain, arithmetic = ChainTask(), ArithmeticTask()
    assert chain.answer_key("15;22;42") == "42" and chain.answer_key("15;22;40+2=42") == "42"
    assert arithmetic.answer_key("<think>1;2</think> 7") == "7" and arithmetic.answer_key("7.0") == "7"
    assert arithmetic.answer_key("no number") is None and arithmetic.answer_key("3 + 4") is None


def test_bad_search_methods():
    assert parse_methods("greedy, prm_best_of_n:last,mcts") == ["greedy", "prm_best_of_n:last", "mcts"]
    for bad in ("beam", "majority:min", "prm_best_of_n:mean", ""):
        with pytest.raises(ConfigError, match="--search"):
            parse_methods(bad)


def test_bad_label_rows(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text('{"prompt": "1+1=", "steps": ["2"], "soft": [1.0], "hard": [1], "correct": true}\n'
                    '{"prompt": "1+2=", "steps": ["3"], "soft": [1.0], "correct": true}\n')
    with pytest.raises(DatasetError, match=r"labels.jsonl:2: .*missing \['hard'\]"):
        load_labels(path)
    path.write_text('{"prompt": "1+1=", "steps": ["1;", "2"], "soft": [1.0], "hard": [1], "correct": true}\n')
    with pytest.raises(DatasetError, match=r"labels.jsonl:1: steps, soft and hard"):
        load_labels(path)


def test_held_out_split_is_by_prompt():
    rows = [{"prompt": f"{i}+1="} for i in range(2000)]
    share = sum(held_out(r, 0.1) for r in rows) / len(rows)
    assert 0.07 < share < 0.13
    assert held_out(rows[5], 0.1) == held_out(dict(rows[5]), 0.1)


def test_overrides_may_follow_options():
    from orchestrator.cli.main import parse_args

    args = parse_args(["prm", "label", "-c", "configs/chain.yaml", "prm.prompts=8", "--out=x.jsonl", "prm.samples=2"])
    assert args.overrides == ["prm.prompts=8", "prm.samples=2"] and args.out == "x.jsonl"
    with pytest.raises(SystemExit):
        parse_args(["prm", "label", "--bogus"])
    with pytest.raises(SystemExit):
        parse_args(["export", "src", "--out", "o", "a=1"])  # export takes no overrides


def test_slow_bf16_warning_names_the_keys():
    from orchestrator.telemetry.console import slow_bf16_warning

    cfg = load_config(None, ["rollout.dtype=bfloat16", "learner.mixed_precision=bfloat16"])
    avx2 = "processor : 0\nflags : fpu sse avx2\n"
    warning = slow_bf16_warning(cfg, avx2)
    assert "rollout.dtype, learner.mixed_precision" in warning and "learner.mixed_precision=null" in warning
    assert slow_bf16_warning(cfg, "flags : avx2 avx512_bf16\n") is None
    assert slow_bf16_warning(cfg, "flags : avx2 amx_bf16 amx_tile\n") is None
    assert slow_bf16_warning(load_config(None, []), avx2) is None  # float32: nothing to say
