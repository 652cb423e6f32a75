from trace_mega.sampler import PromptSampler, SamplerState


def test_epochs_are_permutations_and_resume_continues_the_order():
    s = PromptSampler(7, seed=3)
    seq = [s.next(3) for _ in range(6)]
    flat = [i for b in seq for i in b]
    assert sorted(flat[:7]) == list(range(7)) and sorted(flat[7:14]) == list(range(7))
    # Resume from the saved state after 2 batches: the rest is identical.
    s2 = PromptSampler(7, seed=3)
    s2.next(3), s2.next(3)
    resumed = PromptSampler(7, seed=3, state=SamplerState(**vars(s2.state)))
    assert [resumed.next(3) for _ in range(4)] == seq[2:]
    assert PromptSampler(7, seed=4).next(7) != PromptSampler(7, seed=3).next(7)
