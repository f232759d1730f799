import numpy as np

from pipeline.retrieval import both_directions, ranks, retrieval_metrics


def test_ranks_hand_made_with_ties_counted_against_the_model():
    sim = np.array([
        [0.9, 0.1, 0.2],   # gt 0 best: rank 1
        [0.5, 0.5, 0.5],   # gt 1 tied with two others: rank 3, not 1
        [0.8, 0.9, 0.7],   # gt 2 behind two: rank 3
    ])
    assert ranks(sim).tolist() == [1, 3, 3]
    m = retrieval_metrics(sim, ks=(1, 2, 3))
    assert m["R@1"] == 1 / 3 and m["R@2"] == 1 / 3 and m["R@3"] == 1.0
    assert m["MedianR"] == 3 and abs(m["MeanR"] - 7 / 3) < 1e-12


def test_explicit_ground_truth_and_both_directions():
    sim = np.array([[0.1, 0.7], [0.6, 0.2]])
    assert ranks(sim, gt=np.array([1, 0])).tolist() == [1, 1]
    d = both_directions(sim)
    assert d["text_to_pair"]["R@1"] == 0.0 and d["pair_to_text"]["MedianR"] == 2.0
