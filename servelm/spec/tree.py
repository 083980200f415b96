"""Tree drafting and tree verification: several candidates per depth, verified in one step.

    propose:  the chain proposer's catch-up gives the drafter's output at the root (the
              token fed this step), then per depth the drafter's top-k children of a frontier
              of nodes, run as one drafter step with a tree mask (each node sees the context
              and its ancestors); the tree is cut to the slot budget
    verify:   the target scores every node in one step: node i's row at position
              start + depth(i), KV slot start + i, and a [Q, Q] ancestor mask in the prefill
              attention (servelm/attention/tree_mask.py); the walk down the accepted path is
              sampling/verify.py's
    after:    the accepted nodes' KV moves to consecutive slots (start + 1 ..), so the
              engine's rollback to start + 1 + accepted keeps exactly the path

Two tree shapes, both a function of the slot budget N (so the scheduler's one number, the
controller's choice, fixes size and depth, depth = tree_depth(N)):
- static ("top-k per depth"): a backbone of each depth's best child plus, at the shallow
  depths, the next-ranked children of the previous depth's nodes, up to top-k per depth;
  where the nodes go does not depend on the drafter's confidence.
- dynamic (EAGLE-2): per depth the top-k nodes by cumulative draft probability are
  expanded with their top-k children; at the end the N nodes of highest cumulative
  probability are kept (a child never scores above its parent, so the kept set is a tree).

Owns: tree shapes, the tree proposer, refusing setups the tree path does not cover. Never:
the chain itself (servelm/spec/chain.py), the acceptance rules (servelm/sampling/verify.py),
the rows' positions, masks and KV compaction (servelm/attention/tree_mask.py, which the
runner calls: the runner sits beside spec/ and may not import it).

Structured outputs: a sequence with a grammar gets a chain (its masks are computed per chain
position; there are no masks per tree node), so the two combine.
"""

from __future__ import annotations

import math

import torch

from servelm.spec.chain import ChainProposer, _SeqState
from servelm.spec.proposer import Proposal

TREE_MODES = ("static", "dynamic")


class UnsupportedTreeError(ValueError):
    """A setup tree verification cannot run in, named."""


# -- tree shapes ---------------------------------------------------------------------------

def is_chain(parents: list[int]) -> bool:
    return all(p == i for i, p in enumerate(parents))


def tree_depth(budget: int, max_depth: int) -> int:
    """Depth drafted for a budget of `budget` nodes: about 1.5 sqrt(N) (a chain for 1..3)."""
    return max(1, min(max_depth, budget, round(1.5 * math.sqrt(budget))))


def static_widths(budget: int, depth: int, topk: int) -> list[int]:
    """Nodes per depth 1..depth: one each (the backbone), the rest to the shallowest depths,
    at most top-k per depth."""
    widths = [1] * depth
    left = budget - depth
    for d in range(depth):
        extra = min(left, topk - 1)
        widths[d] += extra
        left -= extra
    return widths


def path_from_tokens(tokens: list[int], parents: list[int], emitted: list[int]) -> list[int]:
    """The accepted nodes, from the tokens that followed the root (verification never emits
    a child's token after rejecting it, so the walk stops where the path did)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(tokens, parents), start=1):
        children.setdefault(p, {})[tok] = i
    node, path = 0, []
    for tok in emitted:
        nxt = children.get(node, {}).get(tok)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


# -- drafting -----------------------------------------------------------------------------

def _candidates(drafter, out: torch.Tensor, k: int) -> tuple[list, list]:
    """out [F, H] -> per row, the top-k (log probability, target id)."""
    logp = torch.log_softmax(drafter.logits(out).float(), dim=-1)
    vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    ids = drafter.to_target(ids) if hasattr(drafter, "to_target") else ids
    return vals.tolist(), ids.tolist()


def draft_tree(drafter, root_out: torch.Tensor, kv, start: int, budget: int, mode: str,
               topk: int, max_depth: int) -> tuple[list[int], list[int]]:
    """A tree of at most `budget` nodes under the root (the token at position start, whose
    drafter output is root_out [1, H]) -> (tokens, parents), parents before children. Appends
    the expanded nodes' KV to `kv` (the caller truncates it)."""
    depth = tree_depth(budget, max_depth)
    widths = static_widths(budget, depth, topk) if mode == "static" else None
    # candidates: token, parent candidate (-1: the root), cumulative log p, depth
    tok, par, score, dep = [], [], [], []
    row_of: dict[int, int] = {}  # expanded candidate -> its drafter KV row
    frontier, outs = [-1], root_out  # outs' row i: frontier[i]'s drafter output
    real_end = kv.end
    for d in range(1, depth + 1):
        vals, ids = _candidates(drafter, outs, topk)
        level = []
        for f, row_v, row_i in zip(frontier, vals, ids):
            base = 0.0 if f < 0 else score[f]
            for v, t in zip(row_v, row_i):
                level.append(len(tok))
                tok.append(int(t))
                par.append(f)
                score.append(base + v)
                dep.append(d)
        if mode == "static":
            for c in level[widths[d - 1]:]:
                dep[c] = -1  # never selected
            if d == depth:
                break
            # the next depth takes the first children in parent order: expand only those
            keep = level[:min(widths[d - 1], -(-widths[d] // topk))]
        else:
            if d == depth:
                break
            keep = sorted(level, key=lambda c: -score[c])[:topk]
        # the kept nodes' parents' rows in the last drafter output (the frontier's order)
        parent_outs = outs[[frontier.index(par[c]) for c in keep]]
        outs = _expand(drafter, kv, keep, tok, par, row_of, real_end, start + d - 1,
                       parent_outs)
        frontier = keep
    return _select(tok, par, score, dep, budget, mode)


def _expand(drafter, kv, nodes, tok, par, row_of, real_end, position,
            parent_outs) -> torch.Tensor:
    """One drafter step over `nodes` (one depth): input = the parent's output and the
    node's token; each row sees the context and its expanded ancestors -> outputs."""
    device = parent_outs.device
    first = kv.end - kv.start  # rows of the drafter cache, from its start
    for i, c in enumerate(nodes):
        row_of[c] = first + i
    mask = torch.zeros(len(nodes), first + len(nodes), dtype=torch.bool, device=device)
    mask[:, :real_end - kv.start] = True
    for i, c in enumerate(nodes):
        while c >= 0:
            mask[i, row_of[c]] = True
            c = par[c]
    tokens = torch.tensor([tok[c] for c in nodes], device=device)
    positions = torch.full((len(nodes),), position, device=device)
    return drafter.step(parent_outs, tokens, positions, kv, mask=mask)


def _select(tok, par, score, dep, budget, mode) -> tuple[list[int], list[int]]:
    """Keep `budget` candidates, reorder them parents first -> (tokens, parents)."""
    alive = [c for c in range(len(tok)) if dep[c] > 0]
    if mode == "static":
        chosen = alive[:budget]
    else:  # a child scores at most its parent; ties: the shallower first
        chosen = sorted(alive, key=lambda c: (-score[c], dep[c]))[:budget]
    picked = set(chosen)
    chosen = [c for c in chosen if _closed(c, par, picked)]
    chosen.sort(key=lambda c: (dep[c], c))
    index = {c: i + 1 for i, c in enumerate(chosen)}
    return [tok[c] for c in chosen], [0 if par[c] < 0 else index[par[c]] for c in chosen]


def _closed(c: int, par: list[int], picked: set) -> bool:
    while par[c] >= 0:
        c = par[c]
        if c not in picked:
            return False
    return True


# -- the proposer -------------------------------------------------------------------------

class TreeProposer(ChainProposer):
    """Drafts a tree per sequence (module docstring) over a chain proposer's drafter."""

    def __init__(self, drafter, mode: str = "dynamic", topk: int = 4, max_depth: int = 8,
                 name: str = "eagle3"):
        if mode not in TREE_MODES:
            raise ValueError(f"spec_tree must be one of {TREE_MODES}, got {mode!r}")
        if topk < 1 or max_depth < 1:
            raise ValueError(f"tree topk and depth must be >= 1, got {topk}, {max_depth}")
        super().__init__(drafter)
        self.mode, self.topk, self.max_depth = mode, topk, max_depth
        self.name = f"{name} ({mode} tree)"
        self.num_trees = 0  # proposals that were trees, not chains

    def depth_for(self, budget: int) -> int:
        """Drafter steps a budget costs (the controller's draft-cost model)."""
        return tree_depth(budget, self.max_depth)

    @torch.inference_mode()
    def observe(self, works: list, query_start_loc: list[int], aux: list[torch.Tensor]) -> None:
        feats = self.drafter.features(aux)
        for i, w in enumerate(works):
            st = self._state(w.seq)
            self._resolve(st, w.seq)  # a step without drafts may follow a tree
            rows = feats[query_start_loc[i]:query_start_loc[i + 1]]
            parents = getattr(w, "parents", None)
            if parents is None:
                self._keep(st, w.start, rows)
                continue
            fed = len(w.tokens) - len(w.drafts)  # the root is the last fed token
            self._keep(st, w.start, rows[:fed])
            st.pending = (w.start + fed - 1, rows[fed - 1:], list(w.drafts), list(parents))

    def _resolve(self, st: _SeqState, seq) -> None:
        """Last step's tree: keep the features of the path the target accepted."""
        if st.pending is None:
            return
        root, rows, tokens, parents = st.pending
        st.pending = None
        path = path_from_tokens(tokens, parents, seq.token_ids[root + 1:])
        self._keep(st, root, rows[[0] + path])

    @torch.inference_mode()
    def propose(self, scheduled: list) -> dict[int, Proposal]:
        out = {}
        for s in scheduled:
            st = self._state(s.seq)
            self._resolve(st, s.seq)
            if s.seq.params.structured is not None or s.num_spec < 2:
                drafts = self._chain(s.seq, s.start, s.num_spec)
                if drafts:
                    out[s.seq.seq_id] = Proposal(drafts)
                continue
            root_out = self._catch_up(st, s.seq, s.start)
            if root_out is None:
                continue
            real_end = st.kv.end
            tokens, parents = draft_tree(self.drafter, root_out, st.kv, s.start, s.num_spec,
                                         self.mode, self.topk, self.max_depth)
            self._finish(st, s.start, real_end)
            if tokens:
                chain = is_chain(parents)
                self.num_trees += not chain
                out[s.seq.seq_id] = Proposal(tokens, parents=None if chain else parents)
        return out


def check_tree_setup(backend, kv_cache, model_config, deterministic: bool) -> None:
    """Refuse, by name, what the tree mask path does not cover."""
    why = None
    if getattr(backend, "name", "") != "torch":
        why = f"the {getattr(backend, 'name', '?')} attention backend (torch's takes the mask)"
    elif kv_cache.is_mla:
        why = "an MLA (latent) KV cache"
    elif deterministic:
        why = "--deterministic (its per-row kernel takes no mask)"
    elif model_config.sliding_window or model_config.attn_logit_softcapping:
        why = "sliding-window or soft-capped attention layers"
    if why is not None:
        raise UnsupportedTreeError(f"spec_tree: tree verification does not run with {why}; "
                                   "use chain drafting (--spec-tree off)")


def build_tree_speculation(chain_proposer, spec_config, backend, model_config,
                           deterministic: bool):
    """(TreeProposer over the chain proposer's drafter, TreeSpecController) for
    --spec-tree; refuses what the tree path does not cover."""
    from servelm.spec.controller import TreeSpecController

    check_tree_setup(backend, backend.kv_cache, model_config, deterministic)
    proposer = TreeProposer(chain_proposer.drafter, spec_config.tree, spec_config.tree_topk,
                            name=chain_proposer.name)
    return proposer, TreeSpecController(spec_config.num_tokens, spec_config.adaptive,
                                        depth_for=proposer.depth_for)
