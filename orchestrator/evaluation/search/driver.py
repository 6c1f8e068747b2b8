"""`fleetrl eval --search METHODS --budgets N1,N2,...`: test-time scaling on the held-out prompts.

Every method generates through the rollout actors' vLLM engines, batched across prompts (and beams, and tree
leaves), and is scored by the `prm-i` / `orm-i` actors; nothing here sees the reference answer except the final
check. For each method and budget N: accuracy, generated tokens per problem and wall seconds, written to
``<out>/search.json`` and drawn as accuracy against generated tokens (one line per method) in ``<out>/search.png``.

Methods (a budget N means):
- ``greedy``: one temperature-0 solution (N is ignored; run once).
- ``majority``: N samples, the most frequent final answer (self-consistency).
- ``orm_best_of_n``: N samples, the one the outcome model (``prm.orm_path``) scores highest.
- ``prm_best_of_n[:min|last|prod]``: N samples, the one whose PRM step scores aggregate highest.
- ``prm_beam``: step-level beam search: N candidate steps per round, ``N // search.expansions`` beams each
  expanded with ``search.expansions`` next steps, the top beams by PRM score kept.
- ``mcts``: N simulations over steps: UCB selection (``search.mcts_c``), one new step per expansion, its value the
  PRM's score of a complete rollout sampled from it (min over its steps; ``search.mcts_value: prm`` uses the new
  step's own score and finishes the most visited path at the end), backed up to the root; the answer is the best
  complete solution seen by PRM score.
- ``revision``: one solution, then up to N - 1 revisions: the PRM reviews the steps, and the model redoes the
  solution from just before the first step scored below ``search.revision_threshold``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.config import ConfigError, FleetConfig
from orchestrator.evaluation.search.methods import Node, backup, best_index, select_leaf, top_k
from rewards.answers import vote_key
from rewards.functions import answer_keys, majority_vote, verdicts
from rewards.prm import AGGREGATIONS, aggregate

log = logging.getLogger("fleetrl")

METHODS = ("greedy", "majority", "orm_best_of_n", "prm_best_of_n", "prm_beam", "mcts", "revision")


@dataclass
class Solution:
    """A complete (or cut) solution of one problem and the tokens its search generated."""

    steps: list[str]
    tokens: int

    @property
    def text(self) -> str:
        return "".join(self.steps)


def parse_methods(text: str) -> list[str]:
    """``"greedy,majority,prm_best_of_n:min"`` -> the list, each checked."""
    out = [m.strip() for m in text.split(",") if m.strip()]
    for m in out:
        base, _, agg = m.partition(":")
        if base not in METHODS or (agg and (base != "prm_best_of_n" or agg not in AGGREGATIONS)):
            raise ConfigError(f"--search {m!r}: methods are {list(METHODS)}; prm_best_of_n takes :min, :last or "
                              ":prod")
    if not out:
        raise ConfigError(f"--search {text!r}: name at least one method of {list(METHODS)}")
    return out


class Searcher:
    """The methods over one set of pools: ``rollouts`` (engines), ``prm`` / ``orm`` (step scorers, optional)."""

    def __init__(self, cfg: FleetConfig, rollouts, prm, orm, tokenizer, separator: str, answer_key=vote_key):
        """``answer_key``: a completion's final answer as a canonical string for majority voting (the task's
        :meth:`rewards.tasks.Task.answer_key`)."""
        from workers.prompts import PromptRenderer

        self.cfg, self.rollouts, self.prm, self.orm = cfg, rollouts, prm, orm
        self.tokenizer, self.sep, self.answer_key = tokenizer, separator, answer_key
        self.renderer = PromptRenderer(tokenizer, cfg.data.prompt_format, cfg.data.system_prompt,
                                       cfg.data.chat_template_kwargs)
        self.calls = 0  # distinct seeds for every generate call

    # ---- generation -----------------------------------------------------------------------------------------
    def _generate(self, prompts, n: int, temperature: float | None = None, prefixes=None, step: bool = False):
        self.calls += 1
        t = self.cfg.rollout.temperature if temperature is None else temperature
        uniq = [replace(p, uid=f"{p.uid}/c{self.calls}/{i}") for i, p in enumerate(prompts)]
        s = self.cfg.search
        return self.rollouts.generate(uniq, n, t, seed=None if t == 0 else self.cfg.rollout.seed + self.calls,
                                      prefixes=prefixes, stop=[self.sep] if step else None,
                                      max_new_tokens=s.step_tokens if step else None)

    def _steps(self, text: str) -> list[str]:
        from rewards.prm import split_steps

        return split_steps(text, self.sep)

    def _solutions(self, prompts, n: int) -> list[list[Solution]]:
        samples = self._generate(prompts, n)
        return [[Solution(self._steps(s.completion_text), len(s.completion_ids)) for s in samples[i * n: (i + 1) * n]]
                for i in range(len(prompts))]

    def prompt_text(self, prompt) -> str:
        return self.renderer.render(prompt.text)[0]

    def _scores(self, pool, prompts, groups: list[list[list[str]]]) -> list[list[list[float]]]:
        """Step scores of every candidate (``groups[i]``: prompt i's candidates' steps), one batched call."""
        flat = [(self.prompt_text(p), steps) for p, grp in zip(prompts, groups) for steps in grp]
        scores = iter(pool.score(flat) if flat else [])
        return [[next(scores) for _ in grp] for grp in groups]

    # ---- methods ----------------------------------------------------------------------------------------------
    def greedy(self, prompts, budget: int) -> list[Solution]:
        samples = self._generate(prompts, 1, temperature=0.0)
        return [Solution(self._steps(s.completion_text), len(s.completion_ids)) for s in samples]

    def majority(self, prompts, budget: int) -> list[Solution]:
        out = []
        for sols in self._solutions(prompts, budget):
            pick = majority_vote(answer_keys(self.answer_key, [s.text for s in sols]))
            out.append(replace(sols[0 if pick is None else pick], tokens=sum(s.tokens for s in sols)))
        return out

    def _best_of_n(self, pool, prompts, budget: int, how: str) -> list[Solution]:
        groups = self._solutions(prompts, budget)
        scores = self._scores(pool, prompts, [[s.steps for s in sols] for sols in groups])
        return [replace(sols[best_index([aggregate(v, how) for v in sc])], tokens=sum(s.tokens for s in sols))
                for sols, sc in zip(groups, scores)]

    def orm_best_of_n(self, prompts, budget: int) -> list[Solution]:
        if self.orm is None:
            raise ConfigError("orm_best_of_n needs an outcome model: set prm.orm_path (`fleetrl prm train "
                              "prm.target=outcome`)")
        return self._best_of_n(self.orm, prompts, budget, "last")

    def prm_best_of_n(self, prompts, budget: int, how: str = "min") -> list[Solution]:
        return self._best_of_n(self._need_prm(), prompts, budget, how)

    def _need_prm(self):
        if self.prm is None:
            raise ConfigError("PRM-guided search needs a PRM: set prm.path (`fleetrl prm train`'s final/)")
        return self.prm

    def _step_round(self, prompts, leaves: list[tuple[int, Node]], n: int) -> list[tuple[int, Node, Node]]:
        """Sample ``n`` next steps for every (prompt index, node); returns (prompt index, parent, new child) with
        the child's step, tokens and terminal flag set (not yet attached or scored)."""
        samples = self._generate([prompts[i] for i, _ in leaves], n, prefixes=[node.tokens for _, node in leaves],
                                 step=True)
        out = []
        for j, (i, node) in enumerate(leaves):
            for s in samples[j * n: (j + 1) * n]:
                ended = not s.completion_text.endswith(self.sep) or len(node.steps) + 1 >= self.cfg.search.max_steps
                ids = [t for t in s.completion_ids if t != self.tokenizer.eos_token_id]
                child = Node(node.steps + [s.completion_text], parent=node, terminal=ended, tokens=node.tokens + ids,
                             generated=len(s.completion_ids))
                out.append((i, node, child))
        return out

    def _score_nodes(self, prompts, made: list[tuple[int, Node, Node]]) -> None:
        """The PRM's scores of the new nodes' steps: ``node.score`` (last step), ``node.path_score`` (aggregated)."""
        prm = self._need_prm()
        flat = [(self.prompt_text(prompts[i]), child.steps) for i, _, child in made]
        for (_, _, child), sc in zip(made, prm.score(flat) if flat else []):
            child.score = sc[-1] if sc else 0.0
            child.path_score = aggregate(sc, self.cfg.search.aggregation)

    def prm_beam(self, prompts, budget: int) -> list[Solution]:
        s = self.cfg.search
        expand = min(s.expansions, budget)
        width = max(1, budget // expand)
        beams = [[Node([], tokens=[])] for _ in prompts]
        finished: list[list[Node]] = [[] for _ in prompts]
        tokens = [0] * len(prompts)
        for _ in range(s.max_steps):
            leaves = [(i, b) for i, bs in enumerate(beams) for b in bs]
            if not leaves:
                break
            made = self._step_round(prompts, leaves, expand)
            self._score_nodes(prompts, made)
            for i, _, child in made:
                tokens[i] += child.generated
            for i in range(len(prompts)):
                cands = [c for j, _, c in made if j == i]
                keep = [cands[k] for k in top_k([c.score for c in cands], width)]
                finished[i] += [c for c in keep if c.terminal]
                beams[i] = [c for c in keep if not c.terminal][: max(0, width - len(finished[i]))]
        return [self._pick(finished[i] or beams[i], tokens[i]) for i in range(len(prompts))]

    def _pick(self, nodes: list[Node], tokens: int) -> Solution:
        if not nodes:
            return Solution([], tokens)
        best = nodes[best_index([n.path_score for n in nodes])]
        return Solution(best.steps, tokens)

    def mcts(self, prompts, budget: int) -> list[Solution]:
        s = self.cfg.search
        roots = [Node([], tokens=[]) for _ in prompts]
        complete: list[list[Node]] = [[] for _ in prompts]
        tokens = [0] * len(prompts)
        for _ in range(budget):
            picked = [(i, select_leaf(root, s.mcts_c, s.expansions)) for i, root in enumerate(roots)]
            for _, leaf in picked:
                if leaf.terminal:  # a finished path: revisit it with its value
                    backup(leaf, leaf.value)
            grow = [(i, leaf) for i, leaf in picked if not leaf.terminal]
            made = self._step_round(prompts, grow, 1)
            self._score_nodes(prompts, made)
            values = self._rollout_values(prompts, made) if s.mcts_value == "rollout" else None
            for k, (i, parent, child) in enumerate(made):
                tokens[i] += child.generated
                parent.children.append(child)
                child.value = child.score if values is None else values[k][0]
                if values is not None:
                    tokens[i] += values[k][2]
                    if values[k][1] is not None:
                        complete[i].append(values[k][1])
                if child.terminal:
                    complete[i].append(child)
                backup(child, child.value)
        unfinished = [i for i in range(len(prompts)) if not complete[i]]
        if unfinished:  # no path reached an end: finish the most visited one with one sample
            ends = self._rollout_values(prompts, [(i, None, self._most_visited(roots[i])) for i in unfinished])
            for i, (_, end, spent) in zip(unfinished, ends):
                tokens[i] += spent
                complete[i].append(end or self._most_visited(roots[i]))
        return [self._pick(complete[i], tokens[i]) for i in range(len(prompts))]

    def _rollout_values(self, prompts, made) -> list[tuple[float, Node | None, int]]:
        """MCTS rollout values: one sampled completion from each new node, scored by the PRM (aggregated); returns
        (value, the complete solution as a terminal node, tokens generated) per node."""
        open_ = [(k, i, child) for k, (i, _, child) in enumerate(made) if not child.terminal]
        out: list[tuple[float, Node | None, int]] = [(c.path_score, None, 0) for _, _, c in made]
        if not open_:
            return out
        samples = self._generate([prompts[i] for _, i, _ in open_], 1, prefixes=[c.tokens for _, _, c in open_])
        ends = [Node(c.steps + self._steps(smp.completion_text), terminal=True) for (_, _, c), smp in
                zip(open_, samples)]
        made_ends = [(i, None, e) for (_, i, _), e in zip(open_, ends)]
        self._score_nodes(prompts, made_ends)
        for (k, _, _), e, smp in zip(open_, ends, samples):
            out[k] = (e.path_score, e, len(smp.completion_ids))
        return out

    @staticmethod
    def _most_visited(root: Node) -> Node:
        node = root
        while node.children:
            node = max(node.children, key=lambda c: c.visits)
        return node

    def revision(self, prompts, budget: int) -> list[Solution]:
        prm, thr = self._need_prm(), self.cfg.search.revision_threshold
        sols = [grp[0] for grp in self._solutions(prompts, 1)]
        tokens = [s.tokens for s in sols]
        prefix_ids = [[] for _ in prompts]
        for _ in range(budget - 1):
            scores = prm.score([(self.prompt_text(p), s.steps) for p, s in zip(prompts, sols)])
            redo = [(i, next((k for k, v in enumerate(sc) if v < thr), None)) for i, sc in enumerate(scores)]
            redo = [(i, k) for i, k in redo if k is not None]
            if not redo:
                break
            keeps = [sols[i].steps[:k] for i, k in redo]
            for (i, _), keep in zip(redo, keeps):
                prefix_ids[i] = self.tokenizer("".join(keep), add_special_tokens=False)["input_ids"] if keep else []
            samples = self._generate([prompts[i] for i, _ in redo], 1, prefixes=[prefix_ids[i] for i, _ in redo])
            for (i, _), keep, smp in zip(redo, keeps, samples):
                sols[i] = Solution(keep + self._steps(smp.completion_text), 0)
                tokens[i] += len(smp.completion_ids)
        return [replace(s, tokens=t) for s, t in zip(sols, tokens)]

    def run(self, method: str, prompts, budget: int) -> list[Solution]:
        base, _, how = method.partition(":")
        fn = getattr(self, base)
        return fn(prompts, budget, how) if how else fn(prompts, budget)


def run_search(cfg: FleetConfig, checkpoint: str | None, methods: list[str], budgets: list[int],
               out: str | None = None, fleet=None) -> dict:
    """Every method at every budget on the held-out prompts; writes ``search.json`` and ``search.png`` in
    ``out`` (default ``<run.dir>/search``) and returns the report. ``fleet``: run on it (kept up); without one the
    command's own fleet is stopped once the methods have run (:meth:`Fleet.for_command`)."""
    from orchestrator.evaluation.evaluate import resolve_model_dir
    from orchestrator.rl.fleet import Fleet, Roles
    from orchestrator.rl.launch import load_tokenizer, make_task
    from orchestrator.rl.reasoning_steps import step_separator
    from workers.prompts import use_chat_template

    cfg = cfg.model_copy(deep=True)
    if checkpoint:
        cfg.model.path = str(resolve_model_dir(checkpoint))
    needs_prm = any(m.split(":")[0] in ("prm_best_of_n", "prm_beam", "mcts", "revision") for m in methods)
    if needs_prm and not cfg.prm.path:
        raise ConfigError("PRM-guided methods need prm.path (the final/ of `fleetrl prm train`)")
    if "orm_best_of_n" in methods and not cfg.prm.orm_path:
        raise ConfigError("orm_best_of_n needs prm.orm_path (`fleetrl prm train prm.target=outcome`)")
    task = make_task(cfg)
    prompts = task.eval_set(cfg.data.eval_size)
    tokenizer = use_chat_template(load_tokenizer(cfg.model.path), cfg.data.chat_template)
    roles = Roles(rollout=True, prm=needs_prm, orm="orm_best_of_n" in methods)
    with Fleet.for_command(fleet, cfg, roles) as serving:
        searcher = Searcher(cfg, serving.rollouts, serving.prm, serving.orm, tokenizer, step_separator(cfg),
                            task.answer_key)
        results = _search(searcher, task, prompts, methods, budgets)
    report = {"model_path": cfg.model.path, "prm": cfg.prm.path, "orm": cfg.prm.orm_path,
              "num_prompts": len(prompts), "temperature": cfg.rollout.temperature, "budgets": budgets,
              "search": cfg.search.model_dump(), "methods": results}
    out_dir = Path(out) if out else Path(cfg.run.dir) / "search"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "search.json").write_text(json.dumps(report, indent=1))
    plot(report, out_dir / "search.png")
    print(f"search report: {out_dir / 'search.json'}, curve: {out_dir / 'search.png'}", flush=True)
    return report


def _search(searcher: Searcher, task, prompts: list, methods: list[str], budgets: list[int]) -> dict[str, list[dict]]:
    """Per method, a row for each budget (greedy: one): accuracy, generated tokens per problem, seconds."""
    results: dict[str, list[dict]] = {}
    for method in methods:
        for budget in ([1] if method == "greedy" else budgets):
            t0 = time.perf_counter()
            sols = searcher.run(method, prompts, budget)
            ok = verdicts(task.verifier_fn, [(searcher.prompt_text(p), s.text, p.metadata)
                                             for p, s in zip(prompts, sols)])
            row = {"budget": budget, "accuracy": sum(ok) / len(ok),
                   "tokens_per_problem": sum(s.tokens for s in sols) / len(sols),
                   "seconds": round(time.perf_counter() - t0, 2)}
            results.setdefault(method, []).append(row)
            log.info("search %s N=%d: %s", method, budget, row)
            print(f"{method:>20} N={budget:<4} accuracy {row['accuracy']:.3f}  tokens/problem "
                  f"{row['tokens_per_problem']:.1f}  {row['seconds']:.1f}s", flush=True)
    return results


def plot(report: dict, path: Path) -> None:
    """Accuracy against generated tokens per problem, one line per method, each point labelled with its N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, rows in report["methods"].items():
        xs, ys = [r["tokens_per_problem"] for r in rows], [r["accuracy"] for r in rows]
        ax.plot(xs, ys, marker="o", label=method)
        for r in rows:
            ax.annotate(str(r["budget"]), (r["tokens_per_problem"], r["accuracy"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"test-time compute: {Path(report['model_path']).name}, {report['num_prompts']} problems")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
