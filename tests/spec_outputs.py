"""Checks the speculative tests share: a run that leaves the engine as it found it, and
outputs equal to a reference's up to a near-tie the reference's logprobs explain."""

from servelm.llm import LLM


def run_checked(engine, prompts, params):
    """Generate, then check the engine's invariants and that every KV block is free again."""
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


def assert_same_as(reference, outs):
    """Each output's tokens equal the reference's; a first difference must be a near-tie
    (both tokens in the reference's top logprobs, within 1e-3), after which it may differ."""
    for ref, out in zip(reference, outs, strict=True):
        ids = out.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ref.token_ids, ids)):
            if x != y:  # a near-tie decided by float order: the reference's logprobs say
                top = dict(ref.logprobs[i].top)
                assert y in top and abs(top[x] - top[y]) < 1e-3, f"diverged at {i}"
                break
        else:
            assert len(ids) == len(ref.token_ids)
