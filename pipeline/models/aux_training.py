"""Learning change captioning from an auxiliary composed-query retrieval task (Hosseinzadeh & Wang, CVPR 2021 §4).

A training scheme, not an architecture: ``AuxiliaryTraining`` holds any primary captioner built through the
model factory (DUDA in the paper) and a TIRG retrieval network (``pipeline.models.tirg``), and couples them
in two stages alternated batch by batch (even ``step``: stage 1, odd: stage 2):

1. **Primary → auxiliary.** The captioner generates a caption for the changed pair (A, B); its per-step
   softmax word distributions P (Eq. 3) become soft embeddings E = P·W_emb (Eq. 4), so the retrieval loss
   back-propagates into the captioner. The auxiliary network composes k(A, E) and must pick B from the
   candidate set S with the batch-based classification loss (Eq. 6). Ĉ is the captioner's greedy caption
   ("Ĉ is obtained by picking the word with the highest probability at each time step"); P keeps the
   gradient, the choice of the argmax words does not. L_pri is the captioner's own objective on the real
   pairs.
2. **Auxiliary → primary.** The auxiliary network composes R = k(A, E_C) from the ground-truth caption
   (Eq. 7), encodes the candidates Ĩ_j = g(I_j) (Eq. 8), weighs them ω = softmax(S̃·R) (Eq. 9) and softly
   selects B̂ (Eq. 10); the captioner is trained on (A, B̂) with the ground-truth caption (Eq. 11).
   **How B̂ feeds the captioner:** Eq. 10 forms B̂ in the retrieval space (Σ ω_j Ĩ_j), but DUDA, like any
   captioner on feature maps, cannot read a retrieval vector. We apply the same weights ω to the candidates'
   *feature maps*, B̂ = Σ ω_j I_j: this is the "soft selection from the candidate set" the paper describes
   (a one-hot ω returns exactly the candidate's map), it keeps the captioner unchanged, and the captioning
   loss reaches the auxiliary network through ω. ``soft_select`` implements both forms (Eq. 10 literally in
   the tests, maps in training).

L_final = (1 − γ)·L_pri + γ·L_aux (Eq. 14), in both stages. L_aux is Eq. 6 over S_i: in stage 1 for the
generated caption's query, in stage 2 for the ground-truth query R (−log ω_B: Eq. 9's ω is Eq. 6's softmax).
The paper states Eq. 14 once for the training, not per stage; without L_aux in stage 2 the auxiliary network
would learn to read ground-truth captions only through the captioning loss, ω would stay near uniform, and
the captioner would be taught the marginal caption on a blur of ~β scenes (review A1). In both stages L_pri
is the captioner's full objective, for DUDA both the changed and the distractor pair.

**When B̂ is fed (our choice, ``b_hat_min_omega``).** The cycle (A, C) → B̂ → Ĉ ≈ C presumes an auxiliary
network that retrieves B; the paper makes the same argument for its curriculum (harder sets "once the model
has learned this task"). Stage 2 feeds (A, B̂) when the batch's mean ω on B reaches ``b_hat_min_omega``,
otherwise the true (A, B) (0 = always B̂, the paper read literally).

**Candidate sets (Eq. 13).** The "random images" of sample i are other samples' targets B_j (j ≠ i), drawn
without replacement from the batch; B_i is always in S_i. Before epoch ξ: S_i = n−1 random ∪ {B_i} (with
n = β this is exactly Eq. 6's batch); from ξ on: S_i = n−2 random ∪ {A_i, B_i}, so a caption that does not
say what changed can no longer tell B from A. ``candidates: easy`` keeps the easy set throughout (the paper's
Table 4 ablation). The draws use the global torch RNG (seeded by the run, saved in the resume state).

The retrieval task is posed on the changed pairs only: a distractor pair's "modification" is a viewpoint
change that its caption ("no change") cannot describe, so (A, "no change") → distractor view is not a
composed query. Distractor pairs still train the captioner through its own objective. On plain pairs (a
dataset without distractor partners, ``pipeline.data``: CLEVR-DC) the same holds: the task is posed on the
batch's changed pairs (``changed``), its candidates drawn among them, B̂ fed in their rows; ``no_change``
pairs train the captioner only. A batch with fewer changed pairs than a candidate set needs skips L_aux
(L_final = (1 − γ)·L_pri; the step logs no ``l_aux``).

Not specified by the paper (our choices, in config): n (default β, Eq. 6's batch), γ (default 0.5), the
auxiliary network's sizes (TIRG's 512-d space), ``b_hat_min_omega``. ξ is the paper's fixed epoch (Eq. 13),
to be set where L_aux on the easy set has become small (§4.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline import distributed as ddp
from pipeline.errors import PipelineError
from pipeline.models.common import CaptionModel
from pipeline.models.tirg import TIRG
from pipeline.text import END, START

CANDIDATE_MODES = ("curriculum", "easy", "hard")
SELECTIONS = ("soft", "straight_through")


def at_least_float32(x: torch.Tensor) -> torch.dtype:
    """Similarities and softmaxes in float32 under bf16 autocast (float64 stays float64, for gradchecks)."""
    return torch.promote_types(x.dtype, torch.float32)


# ------------------------------------------------------------------------------------------------------
# Losses and the soft selection, as functions of plain tensors (pinned by tests/test_aux.py)
# ------------------------------------------------------------------------------------------------------
def batch_classification_loss(queries: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 6: mean over i of −log softmax_j ⟨q_i, t_j⟩ at j = i. ``queries`` = k(A_i, E_i), ``targets`` = g(B_i)."""
    dt = at_least_float32(queries)
    logits = (queries.to(dt).unsqueeze(1) * targets.to(dt).unsqueeze(0)).sum(-1)  # [β, β]; elementwise: no autocast
    return F.cross_entropy(logits, torch.arange(len(queries), device=queries.device))


def candidate_logits(queries: torch.Tensor, pool: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """⟨q_i, Ĩ_j⟩ for the candidates j ∈ S_i: ``pool`` [P, d] encoded images, ``sets`` [β, n] pool indices."""
    dt = at_least_float32(queries)
    return (queries.to(dt).unsqueeze(1) * pool.to(dt)[sets]).sum(-1)


def candidate_loss(queries: torch.Tensor, pool: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """Eq. 6 over each sample's candidate set (the target B_i is column 0 of ``sets``)."""
    logits = candidate_logits(queries, pool, sets)
    return F.cross_entropy(logits, torch.zeros(len(sets), dtype=torch.long, device=logits.device))


def soft_select(weights: torch.Tensor, sets: torch.Tensor, *pools: torch.Tensor) -> torch.Tensor:
    """Eq. 10: B̂_i = Σ_j ω_ij · item[S_ij], the items being the concatenation of ``pools`` (encoded images
    Ĩ, or feature maps; passed in parts so that large maps are never copied into one tensor). ω is scattered
    into a [β, P] matrix, so each pool is read once, never gathered n times per sample."""
    total = sum(p.size(0) for p in pools)
    w = weights.new_zeros(sets.size(0), total).scatter_add(1, sets, weights)
    out, start = None, 0
    for p in pools:
        part = w[:, start:start + p.size(0)].to(p.dtype) @ p.flatten(1)
        out = part if out is None else out + part
        start += p.size(0)
    return out.view(sets.size(0), *pools[0].shape[1:])


def candidate_sets(batch_size: int, n: int, hard: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Eq. 13 as pool indices: the pool is [A_1..A_β, B_1..B_β] (A_i at i, B_i at β+i).

    Row i: column 0 is B_i; if ``hard`` column 1 is A_i; the rest are other samples' B_j, j ≠ i, drawn
    without replacement."""
    n_random = n - 2 if hard else n - 1
    if n_random < 0 or n_random > batch_size - 1:
        raise ValueError(f"{n} candidates need {n_random} other samples, the batch has {batch_size - 1}")
    draw = torch.rand(batch_size, batch_size, generator=generator)
    draw.fill_diagonal_(2.0)  # never pick one's own B as a "random" image
    others = draw.argsort(1)[:, :n_random] + batch_size
    own = torch.arange(batch_size).unsqueeze(1)
    cols = [own + batch_size] + ([own] if hard else []) + [others]
    return torch.cat(cols, 1)


# ------------------------------------------------------------------------------------------------------
# What the scheme needs from a primary captioner
# ------------------------------------------------------------------------------------------------------
def _duda_caption(m, l_bef, l_aft, l_diff, max_len: int):
    """Ĉ = DUDA's greedy caption, then P = the softmax at each step of a teacher-forced pass along Ĉ (word t's
    distribution given Ĉ_<t, with gradient). Both passes run the speaker without dropout, so Ĉ is exactly the
    argmax of P (Eq. 3); the detector's features are the training pass's. Only public forwards are used."""
    sp = m.speaker
    was_training = sp.training
    sp.eval()
    try:
        words = sp.greedy(l_bef.detach(), l_diff.detach(), l_aft.detach(), max_len)
        lengths = caption_lengths(words)
        words = words[:, :int(lengths.max())]  # nothing after the last <END> is read: skip those steps
        start = torch.full_like(words[:, :1], START)
        logits, _ = sp(l_bef, l_diff, l_aft, torch.cat([start, words], 1))
    finally:
        sp.train(was_training)
    return F.softmax(logits, 2, dtype=at_least_float32(logits)), lengths


def duda_word_distributions(m, before: torch.Tensor, after: torch.Tensor, max_len: int):
    """DUDA's generated caption of (before, after): P [B, T, |V|] and lengths [B] (see ``_duda_caption``)."""
    l_bef, l_aft, l_diff, _, _ = m.detector(before, [after])[0]
    return _duda_caption(m, l_bef, l_aft, l_diff, max_len)


def duda_loss_and_distributions(m, batch: dict, max_len: int):
    """DUDA's own objective and the word distributions of its caption of (before, after), sharing the change
    detector's pass: the pooled features of the pairs are taken from the detector call inside
    ``training_loss`` (a forward hook, checked to have seen exactly this batch's before and after), so the
    1024×14×14 maps are not attended twice. Falls back to a fresh detector pass if DUDA ever calls it
    differently."""
    seen = []

    def hook(_, args, out):
        bef, afts = args
        if bef is batch["before"] and afts and afts[0] is batch["after"]:
            seen.append(out[0])

    handle = m.detector.register_forward_hook(hook)
    try:
        loss, parts = m.training_loss(batch)
    finally:
        handle.remove()
    l_bef, l_aft, l_diff = seen[0][:3] if len(seen) == 1 else m.detector(batch["before"], [batch["after"]])[0][:3]
    return (loss, parts, *_duda_caption(m, l_bef, l_aft, l_diff, max_len))


def caption_lengths(tokens: torch.Tensor) -> torch.Tensor:
    """Length of each row up to and including its first <END> (the whole row if none)."""
    is_end = tokens == END
    last = torch.full_like(tokens[:, 0], tokens.size(1) - 1)
    return torch.where(is_end.any(1), is_end.float().argmax(1), last) + 1


# Per primary class: (word_distributions, loss_and_distributions). A captioner can instead define the
# methods ``word_distributions(before, after, max_len)`` (and optionally ``loss_and_distributions(batch,
# max_len)``) itself; DUDA's live here so that the spine's model file stays untouched.
ADAPTERS = {"DUDA": (duda_word_distributions, duda_loss_and_distributions)}


def word_distributions(primary, before, after, max_len):
    """Eq. 3: the primary's generated caption of (before, after) as P [B, T, |V|] and lengths [B]."""
    if hasattr(primary, "word_distributions"):
        return primary.word_distributions(before, after, max_len)
    if type(primary).__name__ not in ADAPTERS:
        raise PipelineError(f"primary captioner {type(primary).__name__} exposes no word distributions: give it a "
                            f"word_distributions(before, after, max_len) method or an adapter in {__name__}.ADAPTERS")
    return ADAPTERS[type(primary).__name__][0](primary, before, after, max_len)


def loss_and_distributions(primary, batch, max_len):
    """The primary's own objective on the batch and Eq. 3 for its pairs (before, after)."""
    if hasattr(primary, "loss_and_distributions"):
        return primary.loss_and_distributions(batch, max_len)
    if type(primary).__name__ in ADAPTERS:
        return ADAPTERS[type(primary).__name__][1](primary, batch, max_len)
    loss, parts = primary.training_loss(batch)
    return (loss, parts, *word_distributions(primary, batch["before"], batch["after"], max_len))


def label_embedding_inputs(labels: torch.Tensor):
    """Ground-truth captions ``<START> w.. <END> 0..`` → the words the text encoder reads (w.. <END>) and lengths."""
    words = labels[:, 1:]
    return words, (words > 0).sum(1).clamp(min=1)


class AuxiliaryTraining(CaptionModel):
    optimizer_options = {"fused": True}  # as the primary models' (pipeline.models.duda)

    def __init__(self, vocab_size: int, feat_dim: int, primary: str = "duda", primary_model: dict | None = None,
                 embed_dim: int = 512, word_dim: int = 512, img_hidden: int = 256, text_dropout: float = 0.1,
                 gamma: float = 0.5, n_candidates: int | None = None, xi: int = 30, candidates: str = "curriculum",
                 b_hat_min_omega: float = 0.0, selection: str = "soft"):
        super().__init__()
        from pipeline.models import build_model, lookup

        if (lookup(primary) or ("", ""))[1] == type(self).__name__:
            raise PipelineError(f"model.primary: {primary!r} is itself an auxiliary-training method")
        if candidates not in CANDIDATE_MODES:
            raise PipelineError(f"model.candidates: {candidates!r}, expected one of {CANDIDATE_MODES}")
        if not 0.0 <= gamma <= 1.0:
            raise PipelineError(f"model.gamma: {gamma} outside [0, 1]")
        if selection not in SELECTIONS:
            raise PipelineError(f"model.selection: {selection!r}, expected one of {SELECTIONS}")
        if not 0.0 <= b_hat_min_omega <= 1.0:
            raise PipelineError(f"model.b_hat_min_omega: {b_hat_min_omega} outside [0, 1]")
        self.primary = build_model(primary, vocab_size, feat_dim, dict(primary_model or {}))
        self.aux = TIRG(vocab_size, feat_dim, embed_dim, word_dim, img_hidden, text_dropout)
        self.gamma, self.n_candidates, self.xi, self.mode = gamma, n_candidates, xi, candidates
        self.b_hat_min_omega, self.selection = b_hat_min_omega, selection

    # -- schedule ------------------------------------------------------------------------------------
    def hard_set(self, epoch: int) -> bool:
        """Eq. 13: the hard set (A among the candidates) from epoch ξ on."""
        return self.mode == "hard" or (self.mode == "curriculum" and epoch >= self.xi)

    def sets_for(self, batch_size: int, epoch: int, device) -> torch.Tensor:
        n = batch_size if self.n_candidates is None else self.n_candidates
        hard = self.hard_set(epoch)
        if n > batch_size or n < (2 if hard else 1):
            raise PipelineError(f"model.n_candidates = {n} needs a batch of at least {n} pairs "
                                f"(train.batch_size is {batch_size}); candidates are drawn from the batch")
        return candidate_sets(batch_size, n, hard).to(device)

    # -- the two stages ------------------------------------------------------------------------------
    def training_loss(self, batch):
        step, epoch = int(batch["step"]), int(batch["epoch"])
        hard = self.hard_set(epoch)
        stage = self.primary_to_auxiliary if step % 2 == 0 else self.auxiliary_to_primary
        loss_pri, aux, parts = stage(batch, epoch)
        loss = (1 - self.gamma) * loss_pri + self.gamma * aux  # Eq. 14
        return loss, {"stage": 1 + step % 2, "hard_set": int(hard), "l_pri": loss_pri.item(), **parts}

    def aux_rows(self, batch, epoch: int) -> tuple[torch.Tensor | None, bool]:
        """(rows, posed): the batch rows the retrieval task is posed on (None: all of them; partner mode, where
        every row is a changed pair) and whether it can be posed (plain pairs: enough changed pairs for a
        candidate set)."""
        changed = batch.get("changed")
        if changed is None or bool(changed.all()):
            return None, True
        rows = changed.nonzero().squeeze(1)
        need = self.n_candidates or (2 if self.hard_set(epoch) else 1)  # n, or the changed pairs themselves
        return rows, len(rows) >= need

    @staticmethod
    def whole(batch) -> dict:
        """The retrieval task's inputs over the whole batch: candidate sets are drawn from all its pairs, and the
        composition's batch normalisation sees all of them, when several processes share the batch
        (``pipeline.distributed``; every process then computes the same auxiliary term)."""
        return {k: ddp.gather(batch[k]) for k in ("before", "after", "labels", "changed") if k in batch}

    def primary_to_auxiliary(self, batch, epoch: int):
        loss_pri, parts, probs, lengths = loss_and_distributions(self.primary, batch, batch["labels"].size(1) - 1)
        batch, probs, lengths = self.whole(batch), ddp.gather(probs), ddp.gather(lengths)
        rows, posed = self.aux_rows(batch, epoch)
        a, b_img = batch["before"], batch["after"]
        if not posed:
            return loss_pri, loss_pri.new_zeros(()), parts
        if rows is not None:  # plain pairs: the task is posed on the changed ones
            a, b_img, probs, lengths = a[rows], b_img[rows], probs[rows], lengths[rows]
        phi = self.aux.encode_images(torch.cat([a, b_img]))
        beta = a.size(0)
        query = self.aux.compose(phi[:beta], self.aux.text.soft_embed(probs), lengths)
        sets = self.sets_for(beta, epoch, a.device)
        logits = candidate_logits(query, self.aux.candidates(phi), sets)
        l_aux = F.cross_entropy(logits, torch.zeros(beta, dtype=torch.long, device=a.device))
        acc = (logits[:, :1] > logits[:, 1:]).all(1).float().mean()  # ties count against the model
        return loss_pri, l_aux, {**parts, "l_aux": l_aux.item(), "aux_r1_generated": acc.item()}

    def selection_weights(self, omega: torch.Tensor) -> torch.Tensor:
        """The weights that form B̂ (Eq. 10). ``soft``: ω itself. ``straight_through`` (our option): the forward
        pass selects the arg-max candidate exactly (one-hot), the backward pass is ω's, so the captioner reads
        a real candidate's map instead of a blend (with the hard set, a blend with A weakens B̂ − A)."""
        if self.selection == "soft":
            return omega
        one_hot = F.one_hot(omega.argmax(1), omega.size(1)).to(omega.dtype)
        return one_hot + (omega - omega.detach())  # the bracket is exactly 0: one_hot is kept bit for bit

    def auxiliary_to_primary(self, batch, epoch: int):
        local, batch = batch, self.whole(batch)
        rows, posed = self.aux_rows(batch, epoch)
        if not posed:
            loss_pri, parts = self.primary.training_loss(local)
            return loss_pri, loss_pri.new_zeros(()), parts
        a, b_img, labels = batch["before"], batch["after"], batch["labels"]
        if rows is not None:  # plain pairs: the task is posed on the changed ones
            a, b_img, labels = a[rows], b_img[rows], labels[rows]
        beta = a.size(0)
        words, lengths = label_embedding_inputs(labels)
        phi = self.aux.encode_images(torch.cat([a, b_img]))
        r = self.aux.compose(phi[:beta], self.aux.text.embed_tokens(words), lengths)  # Eq. 7
        sets = self.sets_for(beta, epoch, a.device)
        logits = candidate_logits(r, self.aux.candidates(phi), sets)  # Eq. 8-9
        l_aux = F.cross_entropy(logits, torch.zeros(beta, dtype=torch.long, device=a.device))  # −log ω_B
        omega = F.softmax(logits, 1)
        omega_b = omega[:, 0].mean().item()
        feed = omega_b >= self.b_hat_min_omega
        after = local["after"]
        if feed:  # Eq. 10 on feature maps; on plain pairs B̂ goes in the changed pairs' rows, the others stay
            b_hat = soft_select(self.selection_weights(omega), sets, a, b_img).to(b_img.dtype)
            after = ddp.rows(b_hat if rows is None else batch["after"].index_copy(0, rows, b_hat))  # this process's
        loss_pri, parts = self.primary.training_loss({**local, "after": after})  # Eq. 11
        acc = (logits[:, :1] > logits[:, 1:]).all(1).float().mean()
        return loss_pri, l_aux, {**parts, "l_aux": l_aux.item(), "omega_b": omega_b, "b_hat_fed": int(feed),
                                 "aux_r1_gt": acc.item()}

    # -- inference -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        return self.primary.generate(before, after, max_len)

    @torch.no_grad()
    def retrieval_queries(self, before: torch.Tensor, labels: torch.Tensor | None = None, after: torch.Tensor | None = None,
                          max_len: int = 24) -> torch.Tensor:
        """Normalised composed queries k(A, ·): from ground-truth ``labels`` (E_C = W_emb[C]), or, given
        ``after``, from the captioner's own soft caption of (A, B) (E = P·W_emb, as in stage 1)."""
        phi_a = self.aux.encode_images(before)
        if labels is not None:
            words, lengths = label_embedding_inputs(labels)
            return self.aux.compose(phi_a, self.aux.text.embed_tokens(words), lengths)
        probs, lengths = word_distributions(self.primary, before, after, max_len)
        return self.aux.compose(phi_a, self.aux.text.soft_embed(probs), lengths)

    @torch.no_grad()
    def retrieval_gallery(self, maps: torch.Tensor) -> torch.Tensor:
        return self.aux.candidates(self.aux.encode_images(maps))
