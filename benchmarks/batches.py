"""The random training batch the feature-based benchmarks share: the papers' shapes (1024×14×14 features,
captions of 24 tokens with <END> at 16), a before image with its changed and distractor after images."""

import torch

from pipeline.text import END, START


def feature_batch(b: int, vocab: int = 76, length: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(4, vocab, (2, b, length), generator=g)
    lab[:, :, 0] = START
    lab[:, :, 16] = END
    lab[:, :, 17:] = 0
    return {"before": torch.randn(b, 1024, 14, 14, generator=g), "after": torch.randn(b, 1024, 14, 14, generator=g),
            "distractor": torch.randn(b, 1024, 14, 14, generator=g), "labels": lab[0], "distractor_labels": lab[1],
            "type": torch.zeros(b, dtype=torch.long), "step": torch.tensor(0), "epoch": torch.tensor(0)}
