"""Tree drafting and tree verification on a tiny random target.

- an oracle tree (the true continuation placed on second children, so the accepted path's
  KV must move to consecutive slots) gives plain decoding's greedy tokens, token for token;
- eagle3 static and dynamic trees give plain decoding's greedy tokens;
- the sampled tokens of a tree-verified step follow the target's distribution (chi-square);
- tree shapes: the dynamic tree keeps the most probable nodes, the static one its widths,
  and each drafter row attends only its context and its ancestors;
- the tree controller picks bigger trees only where they pay, and none past break-even;
- what trees do not combine with is refused by name.
"""

import random

import pytest
import torch

from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.spec.chain import SeqKV
from servelm.spec.proposer import Proposal, Proposer
from servelm.spec.tree import draft_tree, path_from_tokens, static_widths, tree_depth

from spec_outputs import assert_same_as, run_checked

MAX_TOKENS = 20
REF = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def engine(hf):
    from tiny_models import make_tiny_engine

    return make_tiny_engine(hf)


@pytest.fixture(scope="module")
def prompts(hf):
    rng = random.Random(1)
    return [[rng.randrange(hf.config.vocab_size) for _ in range(rng.randint(3, 18))]
            for _ in range(6)]


@pytest.fixture(scope="module")
def reference(engine, prompts):
    return [o.outputs[0] for o in _run(engine, prompts, REF)]


def _run(engine, prompts, params=GREEDY):
    return run_checked(engine, prompts, params)


class OracleTree(Proposer):
    """Knows each prompt's greedy continuation and hides it in a tree of 6 nodes:

        root -> 1 (wrong), 2 (t1);  1 -> 6 (wrong);  2 -> 3 (wrong), 4 (t2);  4 -> 5 (t3)

    so the accepted path is nodes 2, 4, 5: none at its chain slot."""

    name = "oracle"

    def __init__(self, continuations: dict, vocab: int):
        self.continuations, self.vocab = continuations, vocab
        self.num_trees = 0

    def propose(self, scheduled):
        out = {}
        for s in scheduled:
            seq = s.seq
            full = self.continuations[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            t = [full[p] if p < len(full) else 0 for p in range(s.start + 1, s.start + 4)]
            wrong = [(x + 1) % self.vocab for x in t]
            tokens = [wrong[0], t[0], wrong[1], t[1], t[2], wrong[0]]
            parents = [0, 0, 2, 2, 4, 1]
            if s.num_spec >= 6:
                self.num_trees += 1
                out[seq.seq_id] = Proposal(tokens, parents=parents)
        return out


def test_oracle_tree_keeps_the_accepted_paths_kv(hf, prompts, reference):
    from tiny_models import make_tiny_engine

    spec = make_tiny_engine(hf, speculative_method="ngram", num_speculative_tokens=6,
                            spec_adaptive=False)
    conts = {tuple(p): list(p) + list(r.token_ids) for p, r in zip(prompts, reference)}
    oracle = spec.runner.proposer = OracleTree(conts, hf.config.vocab_size)
    outs = _run(spec, prompts)
    assert_same_as(reference, outs)
    st = spec.stats
    assert oracle.num_trees > 0
    # three of six nodes accepted on most steps: only possible with the KV moved
    assert st.spec_num_accepted > 0.4 * st.spec_num_proposed
    # fewer steps than tokens: the trees paid
    assert st.num_steps < sum(len(o.outputs[0].token_ids) for o in outs)


def _eagle_tree_engine(hf, engine, path, mode, **kw):
    from servelm.spec.eagle import save_drafter
    from servelm.spec.train_eagle import new_drafter
    from tiny_models import make_tiny_engine

    vocab = torch.arange(0, hf.config.vocab_size, 2)
    drafter = new_drafter(engine.model_config, engine.runner.model.embed_tokens.weight.data,
                          vocab, 0)
    save_drafter(drafter, str(path))
    return make_tiny_engine(hf, speculative_method="eagle3", spec_draft_model=str(path),
                            spec_adaptive=False, num_speculative_tokens=8, spec_tree=mode,
                            **kw)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_greedy_with_an_eagle3_tree_equals_plain_decoding(hf, engine, prompts, reference,
                                                          tmp_path, mode):
    spec = _eagle_tree_engine(hf, engine, tmp_path, mode)
    assert "tree" in spec.runner.proposer.name
    outs = _run(spec, prompts + prompts[:2])  # the repeats hit the prefix cache
    assert_same_as(reference + reference[:2], outs)
    assert spec.runner.proposer.num_trees > 0
    assert spec.stats.spec_num_proposed > 0


class FixedTree(Proposer):
    """The same tree every step: root -> a, b, c; a -> d."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, scheduled):
        return {s.seq.seq_id: Proposal(list(self.tokens), parents=[0, 0, 0, 1])
                for s in scheduled if s.num_spec >= 4}


def test_tree_verified_samples_follow_the_target_distribution():
    """The second token comes from a tree-verified step; its exact marginal is
    sum_t1 p(t1 | prompt) p(t2 | prompt, t1)."""
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    hf = make_tiny_hf_model("llama", num_hidden_layers=2, vocab_size=48, seed=3)
    prompt = [5, 9, 2, 11]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        vocab = p1.shape[0]
        both = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = p1 @ torch.softmax(hf(both).logits[:, -1], -1)
    top = p2.topk(3).indices.tolist()
    engine = make_tiny_engine(hf, speculative_method="ngram", num_speculative_tokens=4,
                              spec_adaptive=False, enable_prefix_caching=False,
                              max_num_seqs=256, num_blocks=1024)
    engine.runner.proposer = FixedTree(top + [top[0]])
    torch.manual_seed(0)
    n_req, per_req = 30, 100
    # max_tokens 6: after the first token the budget leaves room for a 4-node tree
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=per_req)
    outs = LLM(engine=engine).generate([prompt] * n_req, params, use_tqdm=False)
    second = torch.zeros(vocab)
    for o in outs:
        for c in o.outputs:
            second[c.token_ids[1]] += 1
    n = n_req * per_req
    st = engine.stats
    assert 0 < st.spec_num_accepted < st.spec_num_proposed
    expected = p2 * n
    big = expected >= 5
    obs = torch.cat([second[big], second[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    nz = exp > 0
    chi2 = float(((obs[nz] - exp[nz]) ** 2 / exp[nz]).sum())
    df = int(nz.sum()) - 1
    limit = df + 3.1 * (2 * df) ** 0.5 + 8  # ~ the 0.999 quantile for df in the tens
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f} (df {df})"


# -- tree shapes, with a drafter whose next-token scores are a table ----------------------

class TableDrafter:
    """out rows are log-probability rows; step returns the row of each input token and
    records the mask it was given."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.masks = []

    def logits(self, out):
        return out

    def step(self, hidden, tokens, positions, cache, mask=None):
        cache.append(torch.zeros(len(tokens), 1, 2), torch.zeros(len(tokens), 1, 2))
        self.masks.append((mask, tokens.tolist()))
        return self.table[tokens]


def _table(v=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(v, v, generator=g) * 2, -1)


def _all_paths(table, root_row, depth):
    """Every token path of length <= depth with its cumulative log-probability."""
    out = {}
    frontier = [((), root_row, 0.0)]
    for _ in range(depth):
        nxt = []
        for path, row, score in frontier:
            for t in range(table.shape[0]):
                s = score + float(row[t])
                out[path + (t,)] = s
                nxt.append((path + (t,), table[t], s))
        frontier = nxt
    return out


def _eagle2(table, root_row, depth, k, budget, scores):
    """EAGLE-2's selection, written out: per depth the k best of the depth's candidates are
    expanded with their k best children; the `budget` best candidates are kept."""
    def best_children(path, row):
        return [path + (t,) for t in sorted(range(len(row)), key=lambda t: -float(row[t]))[:k]]

    level = best_children((), root_row)
    candidates = list(level)
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda p: -scores[p])[:k]
        level = [c for p in frontier for c in best_children(p, table[p[-1]])]
        candidates += level
    return set(sorted(candidates, key=lambda p: -scores[p])[:budget])


def _paths(tokens, parents):
    paths = []
    for i in range(len(tokens)):
        p, node = [], i + 1
        while node:
            p.append(tokens[node - 1])
            node = parents[node - 1]
        paths.append(tuple(reversed(p)))
    return paths


def test_dynamic_tree_keeps_the_most_probable_expanded_nodes():
    table = _table()
    drafter = TableDrafter(table)
    kv = SeqKV(0, 1, 2)
    kv.append(torch.zeros(5, 1, 2), torch.zeros(5, 1, 2))  # 5 context positions
    tokens, parents = draft_tree(drafter, table[3:4], kv, 5, 8, "dynamic", 3, 8)
    assert len(tokens) == 8 and all(p < i + 1 for i, p in enumerate(parents))
    depth = tree_depth(8, 8)
    scores = _all_paths(table, table[3], depth)
    chosen = _paths(tokens, parents)
    assert len(set(chosen)) == 8
    # the root's best children are always in it, and no kept node scores below a depth-1
    # candidate that was left out
    assert set(chosen) == _eagle2(table, table[3], depth, 3, 8, scores)
    # each drafter row saw the 5 context rows and exactly its ancestors' rows
    for mask, _ in drafter.masks:
        assert mask[:, :5].all()
        assert (mask[:, 5:].sum(-1) >= 1).all()
    last_mask, last_tokens = drafter.masks[-1]
    assert last_mask.shape[0] == len(last_tokens) <= 3
    assert int(last_mask[0, 5:].sum()) == depth - 1  # its ancestors and itself


def test_static_tree_has_its_widths_and_the_greedy_backbone():
    table = _table(seed=2)
    drafter = TableDrafter(table)
    kv = SeqKV(0, 1, 2)
    tokens, parents = draft_tree(drafter, table[1:2], kv, 0, 8, "static", 4, 8)
    depth = tree_depth(8, 8)
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    widths = static_widths(8, depth, 4)
    assert [depths.count(d) for d in range(1, depth + 1)] == widths
    # the backbone: the first node of each depth is the best child of the one above
    row, node = table[1], 0
    for d in range(1, depth + 1):
        first = next(i for i in range(1, len(depths)) if depths[i] == d)
        assert parents[first - 1] == node and tokens[first - 1] == int(row.argmax())
        row, node = table[tokens[first - 1]], first


def test_path_is_recovered_from_the_emitted_tokens():
    tokens, parents = [1, 0, 3, 2, 4], [0, 0, 1, 1, 2]
    assert path_from_tokens(tokens, parents, [1, 2, 0, 9]) == [1, 4]
    assert path_from_tokens(tokens, parents, [5]) == []


# -- the controller -----------------------------------------------------------------------

def _feed(ctl, c0, cd, cv, n=48, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        d, v = rng.choice([(rng.randint(1, 64), 0), (rng.randint(0, 8), rng.randint(5, 320))])
        ctl.observe_step(c0 + cd * d + cv * v, d, v, 0)


def test_tree_controller_grows_the_tree_where_it_pays_and_stops_past_break_even():
    from servelm.spec.controller import TreeSpecController

    ctl = TreeSpecController(16, depth_for=lambda k: tree_depth(k, 8), prior_acceptance=0.7)
    _feed(ctl, 0.05, 0.002, 0.002)
    for k, acc in ((2, 1.0), (4, 1.6), (8, 2.6), (16, 3.4)):
        for _ in range(10):
            ctl.observe_verify(k, round(acc) if k > 2 else 1)
    small_batch = ctl.draft_len(1)
    assert small_batch >= 8  # a flat step: the bigger tree's extra accepted tokens are free
    assert ctl.draft_len(512) == 0  # compute-bound: no tree pays
    costly = TreeSpecController(16, depth_for=lambda k: tree_depth(k, 8), prior_acceptance=0.7)
    _feed(costly, 0.05, 0.002, 0.02)
    for k, acc in ((2, 1), (4, 2), (8, 3), (16, 3)):
        for _ in range(10):
            costly.observe_verify(k, acc)
    assert costly.draft_len(1) < small_batch


def test_tree_controller_charges_one_draft_step_per_depth():
    from servelm.spec.controller import TreeSpecController

    ctl = TreeSpecController(16, depth_for=lambda k: tree_depth(k, 8))
    assert ctl.draft_steps(16) == tree_depth(16, 8) < 16
    assert ctl.draft_steps(0) == 0


# -- refusals -----------------------------------------------------------------------------

def test_tree_needs_eagle3_and_a_known_shape():
    from servelm.config import SpeculativeConfig

    with pytest.raises(ValueError, match="spec_tree 'dynamic'.*eagle3"):
        SpeculativeConfig("ngram", tree="dynamic")
    with pytest.raises(ValueError, match="spec_tree must be one of"):
        SpeculativeConfig("eagle3", draft_model="x", tree="wide")


def test_tree_refused_by_name_with_deterministic_mode(hf, engine, tmp_path):
    from servelm.protocol import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="deterministic"):
        _eagle_tree_engine(hf, engine, tmp_path, "dynamic", deterministic=True)
