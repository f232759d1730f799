"""The random training batch the feature-based benchmarks share: the papers' shapes (1024×14×14 features,
captions padded to 24 tokens), a before image with its changed and distractor after images. Caption lengths
(<START> and <END> included) follow CLEVR-Change's training captions: ~8 tokens for a change (5-20), ~6 for a
distractor (5-9); a model that skips padding is timed on the work it really does."""

import torch

from pipeline.text import END, START

CHANGE_LENGTHS = (7, 8, 6, 9, 7, 10, 8, 16, 7, 8, 6, 9, 7, 8, 13, 7)  # mean 8.5, as the synthetic world's 8.1
DISTRACTOR_LENGTHS = (6, 5, 6, 7, 6, 9, 5, 6)  # mean 6.25 (6.3)


def feature_batch(b: int, vocab: int = 76, length: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(4, vocab, (2, b, length), generator=g)
    lab[:, :, 0] = START
    for i in range(b):
        change, distractor = CHANGE_LENGTHS[i % len(CHANGE_LENGTHS)], DISTRACTOR_LENGTHS[i % len(DISTRACTOR_LENGTHS)]
        for k, n in enumerate((change, distractor)):
            lab[k, i, n - 1] = END
            lab[k, i, n:] = 0
    return {"before": torch.randn(b, 1024, 14, 14, generator=g), "after": torch.randn(b, 1024, 14, 14, generator=g),
            "distractor": torch.randn(b, 1024, 14, 14, generator=g), "labels": lab[0], "distractor_labels": lab[1],
            "type": torch.zeros(b, dtype=torch.long), "step": torch.tensor(0), "epoch": torch.tensor(0)}
