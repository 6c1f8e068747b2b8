"""The pure parts of step-level labelling and test-time search: no actors, no engines (unit-tested directly).

- Math-Shepherd labels from Monte-Carlo continuations (:func:`mc_labels`);
- self-consistency (:func:`rewards.functions.majority_vote`);
- best-of-N by a score (:func:`best_index`);
- step-level beam search's selection (:func:`top_k`);
- MCTS over steps: the tree (:class:`Node`), UCB selection with the seed's formula
  ``UCB = Q(s, a) + c * sqrt(ln N(s) / N(s, a))`` (:func:`ucb`, :func:`select_leaf`) and backup (:func:`backup`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def mc_labels(continuations: list[list[bool]]) -> tuple[list[float], list[int]]:
    """Math-Shepherd step labels of one solution. ``continuations[k]``: whether each of the K completions sampled
    from the prefix ending at step k reached the right answer (for the last step: the solution's own outcome).
    Soft label: the fraction that did; hard label: 1 when any did."""
    soft = [sum(c) / len(c) if c else 0.0 for c in continuations]
    hard = [int(any(c)) for c in continuations]
    return soft, hard


def best_index(scores: list[float]) -> int:
    """The highest score's index (ties: the first)."""
    if not scores:
        raise ValueError("best_index of no scores")
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def top_k(scores: list[float], k: int) -> list[int]:
    """Indices of the ``k`` highest scores, best first (ties: the earlier index)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


@dataclass
class Node:
    """One partial solution in an MCTS tree: the steps from the root, visit count N, value sum W (Q = W / N)."""

    steps: list[str]
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0
    terminal: bool = False
    score: float = 0.0  # the PRM's score of this node's last step
    path_score: float = 0.0  # the PRM's step scores of the whole path, aggregated (search.aggregation)
    value: float = 0.0  # this node's own value when it was made (backed up once; a finished node's revisits)
    tokens: list[int] = field(default_factory=list)  # token ids of all steps (the prefix to continue)
    generated: int = 0  # tokens generated to make this node

    @property
    def q(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0


def ucb(q: float, parent_visits: int, visits: int, c: float) -> float:
    """``Q(s, a) + c * sqrt(ln N(s) / N(s, a))``; an unvisited child is +inf (tried first)."""
    if visits == 0:
        return math.inf
    return q + c * math.sqrt(math.log(max(parent_visits, 1)) / visits)


def select_child(node: Node, c: float) -> Node:
    """The child with the highest UCB (ties: the first)."""
    values = [ucb(ch.q, node.visits, ch.visits, c) for ch in node.children]
    return node.children[best_index(values)]


def select_leaf(root: Node, c: float, width: int) -> Node:
    """Walk down by UCB from the root to a node that can still grow (fewer than ``width`` children) or is
    terminal."""
    node = root
    while not node.terminal and len(node.children) >= width:
        node = select_child(node, c)
    return node


def backup(node: Node, value: float) -> None:
    """Add one visit with ``value`` to the node and every ancestor."""
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent
