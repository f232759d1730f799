"""CLIP4IDC / CLIP-FT: the intra/inter split, OpenAI weights layout, losses, retrieval protocol, decoding."""

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.clip4idc_adapt import pair_text_metrics, rsum
from pipeline.errors import PipelineError
from pipeline.models.clip4idc import (CLIP4IDC, CLIP4IDCAdapt, Captioner, ClipBPE, ClipShape, PairEncoder,
                                      load_openai, openai_key_map, openai_layout_shapes)
from pipeline.text import END, START, UNK

SMALL = dict(vision_width=32, vision_layers=4, vision_heads=2, embed_dim=16, text_width=16, text_layers=2,
             text_heads=2)
CAP = dict(layers=2, heads=2, ffn=32, dropout=0.1)


def pixels(b, seed):
    return torch.randint(0, 256, (b, 3, 224, 224), generator=torch.Generator().manual_seed(seed)).float()


def labels(b, vocab, seed, length=9):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(4, vocab, (b, length), generator=g)
    lab[:, 0] = START
    for i in range(b):  # captions of different lengths, padded with 0 after <END>
        end = 3 + i % (length - 4)
        lab[i, end], lab[i, end + 1:] = END, 0
    return lab


def triplet_batch(b=3, vocab=20, seed=0):
    return {"before": pixels(b, seed), "after": pixels(b, seed + 1), "distractor": pixels(b, seed + 2),
            "labels": labels(b, vocab, seed), "distractor_labels": labels(b, vocab, seed + 1)}


# ------------------------------------------------------------------------------------------ intra / inter
def test_intra_layers_never_mix_the_two_images_and_inter_layers_do():
    torch.manual_seed(0)
    enc = PairEncoder(ClipShape(**SMALL), n_intra=2).eval()
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o.detach().clone()))
             for k, layer in enumerate(enc.layers)]
    before, after = pixels(2, 0), pixels(2, 1)
    after2 = after.clone()
    after2[:, :, 100:140, 60:120] = 255 - after2[:, :, 100:140, 60:120]  # a local change in image B only
    enc(before, after)
    first = dict(outs)
    enc(before, after2)
    t = ClipShape(**SMALL).n_tokens
    for k in range(2):  # intra layers: outputs [2B, T, W], rows 0..B-1 are image A, alone
        assert first[k].shape == (4, t, 32)
        torch.testing.assert_close(outs[k][:2], first[k][:2], rtol=0, atol=0)
        assert not torch.allclose(outs[k][2:], first[k][2:])
    for k in (2, 3):  # inter layers: one joint sequence [B, 2T, W]; image A's tokens now see image B
        assert first[k].shape == (2, 2 * t, 32)
        assert (outs[k][:, :t] - first[k][:, :t]).abs().amax() > 1e-4
    for h in hooks:
        h.remove()


def test_type_embedding_tells_the_captioning_encoder_which_image_a_token_came_from():
    torch.manual_seed(0)
    t, dim = 5, 16
    visual = torch.randn(2, 2 * t, dim)
    swapped = torch.cat([visual[:, t:], visual[:, :t]], 1)  # the after image's tokens first
    plain = Captioner(20, dim=dim, **CAP).eval()
    # No positions of its own: without the embedding, swapping the images only swaps the memory's halves.
    m, ms = plain.memory(visual), plain.memory(swapped)
    torch.testing.assert_close(ms, torch.cat([m[:, t:], m[:, :t]], 1))
    typed = Captioner(128, dim=128, type_embedding=0.3, **CAP)
    assert 0.25 < typed.type_embedding.std().item() < 0.35 and typed.type_embedding.shape == (2, 128)
    typed = Captioner(20, dim=dim, type_embedding=0.3, **CAP).eval()
    m, ms = typed.memory(visual), typed.memory(swapped)
    assert (ms - torch.cat([m[:, t:], m[:, :t]], 1)).abs().amax() > 1e-2
    # It trains with the captioner (its optimiser group), frozen encoder or not.
    model = CLIP4IDC(20, clip=SMALL, n_intra=4, joint_position=False, freeze_encoder=True, type_embedding=0.3, **CAP)
    assert any(p is model.captioner.type_embedding for p in model.param_groups(1e-3)[0]["params"])
    model.training_loss(triplet_batch())[0].backward()
    assert model.captioner.type_embedding.grad.abs().sum() > 0


def test_split_sets_layer_counts_and_the_joint_embeddings():
    s = ClipShape(**SMALL)
    enc = PairEncoder(s, n_intra=3, joint_position=True)
    assert enc.split.tolist() == [3, 1, 1] and enc.joint_position.shape == (2 * s.n_tokens, 32)
    ft = PairEncoder(s, n_intra=4, joint_position=False)
    assert ft.split.tolist() == [4, 0, 0] and not hasattr(ft, "joint_position")
    assert ft(pixels(1, 0), pixels(1, 1)).shape == (1, 2 * s.n_tokens, 16)
    with pytest.raises(PipelineError):
        PairEncoder(s, n_intra=5)


# ------------------------------------------------------------------------------------------ OpenAI layout
def _openai_visual(sd, x, shape):
    """Reference: OpenAI's ViT forward written from its state dict with torch.nn.functional only."""
    w = shape.vision_width
    x = (x / 255 - torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)) / \
        torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    x = F.conv2d(x, sd["visual.conv1.weight"], stride=shape.patch_size).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(x.size(0), 1, -1), x], 1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (w,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _openai_blocks(sd, x, "visual.transformer.resblocks", shape.vision_layers, shape.vision_heads, None)
    return F.layer_norm(x[:, 0], (w,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]


def _openai_blocks(sd, x, prefix, layers, heads, mask):
    d = x.size(-1)
    for i in range(layers):
        p = f"{prefix}.{i}."
        y = F.layer_norm(x, (d,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]).transpose(0, 1)
        y = F.multi_head_attention_forward(y, y, y, d, heads, sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"],
                                           None, None, False, 0.0, sd[p + "attn.out_proj.weight"],
                                           sd[p + "attn.out_proj.bias"], training=False, need_weights=False,
                                           attn_mask=mask)[0]
        x = x + y.transpose(0, 1)
        y = F.linear(F.layer_norm(x, (d,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"]),
                     sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        x = x + F.linear(y * torch.sigmoid(1.702 * y), sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x


def _openai_text(sd, ids, shape):
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"][:ids.size(1)]
    n = ids.size(1)
    mask = torch.full((n, n), float("-inf")).triu(1)
    x = _openai_blocks(sd, x, "transformer.resblocks", shape.text_layers, shape.text_heads, mask)
    x = F.layer_norm(x, (shape.text_width,), sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(ids.size(0)), ids.argmax(-1)] @ sd["text_projection"]


def random_openai_state(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, s in openai_layout_shapes(shape).items():
        t = torch.randn(s, generator=g) * 0.02
        if ".ln_" in k or k.startswith("ln_") or "ln_final" in k:
            t = (1.0 if k.endswith("weight") else 0.0) + t
        sd[k] = t
    sd["logit_scale"] = torch.tensor(math.log(100.0))
    return sd


def test_vit_b32_layout_has_the_published_parameter_count():
    shapes = openai_layout_shapes(ClipShape())
    assert sum(math.prod(s) for s in shapes.values()) == 151_277_313  # OpenAI CLIP ViT-B/32
    assert set(openai_key_map(ClipShape())) == set(shapes)


def test_openai_vit_b32_state_dict_loads_key_for_key(tmp_path):
    """Full ViT-B/32 shapes: a random state dict saved in the OpenAI layout (fp16, as OpenAI ships it) loads
    into the transformers modules so that image and text embeddings equal OpenAI's forward pass."""
    shape = ClipShape()
    sd = random_openai_state(shape)
    path = tmp_path / "ViT-B-32.pt"
    torch.save({**{k: v.half() for k, v in sd.items()}, "input_resolution": 224, "context_length": 77,
                "vocab_size": 49408}, path)
    sd = {k: v.half().float() for k, v in sd.items()}
    torch.manual_seed(0)
    model = CLIP4IDCAdapt(text_vocab_size=49408, eos_id=49407, weights=str(path), n_intra=12,
                          joint_position=False, text_tokens="clip_bpe").eval()
    assert model.weights_identity.startswith("CLIP sha256:")
    own = dict(model.named_parameters())
    loaded = load_openai(model, sd, openai_key_map(shape), "test")
    clip_params = {k for k in own if not k.startswith(("encoder.before_", "encoder.after_"))}
    assert set(loaded) == clip_params  # every CLIP parameter, once; only e1/e2 are new
    assert len(loaded) == len(set(loaded))
    with torch.no_grad():
        model.encoder.before_embedding.zero_()
        x = pixels(2, 5)
        ref = _openai_visual(sd, x, shape)
        tokens = model.encoder(x, pixels(2, 6))
        torch.testing.assert_close(tokens[:, 0], ref, rtol=1e-4, atol=1e-4)
        ids = torch.tensor([[49406, 320, 1125, 539, 320, 2368, 49407, 0, 0], [49406, 320, 1929, 49407, 0, 0, 0, 0, 0]])
        got = model.text_proj(model.text(input_ids=ids).pooler_output)
        torch.testing.assert_close(got, _openai_text(sd, ids, shape), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logit_scale.detach(), sd["logit_scale"])


def test_openai_layout_errors_name_the_problem():
    shape = ClipShape(**SMALL, context_length=10, text_vocab=30)
    sd = random_openai_state(shape)
    model = CLIP4IDCAdapt(text_vocab_size=30, eos_id=29, clip=dict(SMALL, context_length=10, text_vocab=30),
                          n_intra=2)
    load_openai(model, sd, openai_key_map(shape), "ok")
    with pytest.raises(PipelineError, match="missing"):
        load_openai(model, {k: v for k, v in sd.items() if k != "visual.proj"}, openai_key_map(shape), "x")
    with pytest.raises(PipelineError, match="unexpected"):
        load_openai(model, {**sd, "visual.extra": torch.zeros(1)}, openai_key_map(shape), "x")
    with pytest.raises(PipelineError, match="shape"):
        load_openai(model, {**sd, "visual.ln_pre.bias": torch.zeros(7)}, openai_key_map(shape), "x")
    # The captioner has no text tower: the OpenAI text keys are present in the file but deliberately not loaded.
    cap = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, **CAP)
    names = load_openai(cap, sd, openai_key_map(shape, text=None, text_proj=None, logit_scale=None), "ok")
    assert all(n.startswith("encoder.") for n in names)


def test_missing_openai_weights_offline_is_one_clear_error(tmp_path):
    from pipeline.models.clip4idc import resolve_clip_weights

    with pytest.raises(PipelineError, match=r"downloads are disabled.*place it at .*ViT-B-32.pt"):
        resolve_clip_weights("openai", tmp_path / "none", download_ok=False)
    with pytest.raises(PipelineError, match=r"download from .* failed.*place it at .*weights: random"):
        resolve_clip_weights("openai", tmp_path / "none", url="http://127.0.0.1:9/ViT-B-32.pt")
    with pytest.raises(PipelineError, match="does not exist"):
        CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, weights=str(tmp_path / "nope.pt"), **CAP)
    with pytest.raises(PipelineError, match="clip_bpe"):
        CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, clip=SMALL, n_intra=2, weights=str(tmp_path / "x.pt"))


# ------------------------------------------------------------------------------------------ losses
def test_infonce_is_the_symmetric_sum_with_a_clamped_learned_temperature(monkeypatch):
    m = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, clip=SMALL, n_intra=2)
    v = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    monkeypatch.setattr(m, "pair_embedding", lambda b, a: v)
    monkeypatch.setattr(m, "text_embedding", lambda t: g)
    with torch.no_grad():
        m.logit_scale.fill_(math.log(10.0))
    loss, parts = m.training_loss({"before": None, "after": None, "text": None})
    s = 10 * (g @ v.T).numpy()  # [texts, pairs] = [[10, 6], [0, 8]]
    t2i = np.mean([-(s[i, i] - np.log(np.exp(s[i]).sum())) for i in range(2)])
    i2t = np.mean([-(s[i, i] - np.log(np.exp(s[:, i]).sum())) for i in range(2)])
    assert abs(parts["l_t2i"] - t2i) < 1e-5 and abs(parts["l_i2t"] - i2t) < 1e-5
    assert abs(loss.item() - (t2i + i2t)) < 1e-5
    with torch.no_grad():
        m.logit_scale.fill_(math.log(1000.0))  # clamped at 100, like CLIP
    assert abs(m.training_loss({"before": None, "after": None, "text": None})[1]["temperature"] - 0.01) < 1e-7


def test_adaptation_gradients_reach_both_encoders_embeddings_and_temperature():
    torch.manual_seed(0)
    m = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, clip=SMALL, n_intra=2)
    loss, _ = m.training_loss({"before": pixels(3, 0), "after": pixels(3, 1), "text": labels(3, 20, 0)})
    loss.backward()
    for name in ("encoder.vit.encoder.layers.0.mlp.fc1.weight", "encoder.vit.encoder.layers.3.mlp.fc1.weight",
                 "encoder.before_embedding", "encoder.after_embedding", "encoder.joint_position", "encoder.proj.weight",
                 "text.encoder.layers.1.self_attn.q_proj.weight", "text_proj.weight", "logit_scale"):
        p = dict(m.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_adaptation_with_frozen_intra_layers_trains_only_the_joint_layers_text_side_and_temperature():
    torch.manual_seed(0)
    m = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, clip=SMALL, n_intra=2, freeze_intra=True)
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in m.named_parameters()
                      if n.startswith(("encoder.vit.embeddings.", "encoder.vit.pre_layrnorm.",
                                       "encoder.vit.encoder.layers.0.", "encoder.vit.encoder.layers.1."))}
    assert sum(len(g["params"]) for g in m.param_groups(1e-3)) == len(list(m.parameters())) - len(frozen)
    m.training_loss({"before": pixels(3, 0), "after": pixels(3, 1), "text": labels(3, 20, 0)})[0].backward()
    for name in ("encoder.vit.encoder.layers.2.mlp.fc1.weight", "encoder.joint_position", "encoder.proj.weight",
                 "text_proj.weight", "logit_scale"):
        p = dict(m.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_caption_loss_is_the_official_sum_and_gradients_reach_encoder_and_captioner():
    torch.manual_seed(0)
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, **CAP).eval()  # eval: no dropout, to recompute
    batch = triplet_batch()
    loss, parts = m.training_loss(batch)
    vis = m.encoder(torch.cat([batch["before"], batch["before"]]), torch.cat([batch["after"], batch["distractor"]]))
    for lab, vis_i, key in ((batch["labels"], vis[:3], "ce_pos"), (batch["distractor_labels"], vis[3:], "ce_neg")):
        logits = m.captioner(vis_i, lab[:, :-1])
        mask = lab[:, 1:] > 0
        ce = F.cross_entropy(logits.reshape(-1, 20), lab[:, 1:].reshape(-1), reduction="none")[mask.reshape(-1)].mean()
        assert abs(ce.item() - parts[key]) < 1e-4
    assert abs(loss.item() - parts["ce_pos"] - parts["ce_neg"]) < 1e-5
    loss.backward()
    named = dict(m.named_parameters())
    for name in ("encoder.vit.embeddings.patch_embedding.weight", "encoder.joint_position", "encoder.before_embedding",
                 "captioner.encoder.0.ffn.0.weight", "captioner.decoder.layers.1.cross_attn.in_proj.weight",
                 "captioner.decoder.head.weight"):
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
    groups = m.param_groups(1e-4)
    assert [g["lr"] for g in groups] == [1e-4, pytest.approx(1e-7)]
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_frozen_encoder_gets_no_gradient_and_no_optimiser_group():
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_encoder=True, **CAP)
    m.training_loss(triplet_batch())[0].backward()
    assert all(p.grad is None for p in m.encoder.parameters())
    assert len(m.param_groups(1e-4)) == 1


def test_frozen_encoder_cache_runs_the_vit_once_per_image_and_changes_nothing(monkeypatch):
    torch.manual_seed(0)
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_encoder=True, encoder_cache_mb=1, **CAP).eval()
    batch = {k: (v.to(torch.uint8) if v.is_floating_point() else v) for k, v in triplet_batch().items()}
    calls = []
    intra = m.encoder.intra
    monkeypatch.setattr(m.encoder, "intra", lambda x: calls.append(len(x)) or intra(x))
    loss = m.training_loss(batch)[0]
    assert calls == [1] * 9  # each of the 3 before, 3 after, 3 distractor images alone
    assert torch.equal(m.training_loss(batch)[0], loss) and len(calls) == 9  # all hits: the ViT did not run
    # A model with an empty cache (a resumed run) gives the same loss exactly; the uncached batched pass the same
    # up to float rounding.
    torch.manual_seed(0)
    fresh = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_encoder=True, encoder_cache_mb=1, **CAP).eval()
    assert torch.equal(fresh.training_loss(batch)[0], loss)
    fresh.cache_limit = 0
    assert torch.allclose(fresh.training_loss(batch)[0], loss, atol=1e-5)
    # A changed image is a new key, not a stale hit.
    batch["after"][0, 0, 0, 0] ^= 1
    m.training_loss(batch)
    assert len(calls) == 10


def test_frozen_encoder_cache_keyed_by_feature_rows_gives_the_same_loss_without_hashing(monkeypatch):
    """A training batch's ``*_row`` keys the caches (no SHA-1 of the pixels); the loss equals the byte-keyed one."""
    import pipeline.models.clip4idc as mod

    batch = {k: (v.to(torch.uint8) if v.is_floating_point() else v) for k, v in triplet_batch().items()}
    batch["before"][2] = batch["before"][0]  # the third pair shares the first pair's before image (row 0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_encoder=True, encoder_cache_mb=1,
                               **CAP).eval())
    by_bytes = models[0].training_loss(batch)[0]
    m = models[1]
    rowed = dict(batch, before_row=torch.tensor([0, 1, 0]), after_row=torch.tensor([3, 4, 5]),
                 distractor_row=torch.tensor([6, 7, 8]))
    monkeypatch.setattr(mod.hashlib, "sha1", lambda *a: pytest.fail("hashed an image that has a row"))
    calls = []
    intra = m.encoder.intra
    monkeypatch.setattr(m.encoder, "intra", lambda x: calls.append(len(x)) or intra(x))
    assert torch.equal(m.training_loss(rowed)[0], by_bytes)
    assert calls == [1] * 8 and sorted(m._intra_cache) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert torch.equal(m.training_loss(rowed)[0], by_bytes) and len(calls) == 8  # all hits


def test_frozen_encoder_pair_cache_runs_the_joint_layers_once_per_pair(monkeypatch):
    """Frozen, each (before, after) pair's F' is computed once, alone, and reused: the same loss from a warm cache,
    from an empty one (a resumed run) exactly, and from the uncached batched pass up to float rounding; the
    captioner still learns from it and the encoder gets no gradient."""
    batch = {k: (v.to(torch.uint8) if v.is_floating_point() else v) for k, v in triplet_batch().items()}
    batch["before"][2] = batch["before"][0]
    rowed = dict(batch, before_row=torch.tensor([0, 1, 0]), after_row=torch.tensor([3, 4, 5]),
                 distractor_row=torch.tensor([6, 7, 8]))

    def model(cache_mb=1.0):
        torch.manual_seed(0)
        return CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=1, freeze_encoder=True, encoder_cache_mb=cache_mb,
                        **CAP).eval()

    m = model()
    calls = []
    inter = m.encoder.inter
    monkeypatch.setattr(m.encoder, "inter", lambda a, b: calls.append(len(a)) or inter(a, b))
    loss = m.training_loss(rowed)[0]
    assert calls == [1] * 6 and sorted(m._pair_cache) == [(0, 3), (0, 5), (0, 6), (0, 8), (1, 4), (1, 7)]
    assert torch.equal(m.training_loss(rowed)[0], loss) and len(calls) == 6  # all hits: no joint layer ran
    assert torch.equal(model().training_loss(rowed)[0], loss)
    uncached = model(0.0)
    uncached.cache_limit = 0
    assert torch.allclose(uncached.training_loss(rowed)[0], loss, atol=1e-5)
    m.train()
    m.training_loss(rowed)[0].backward()
    assert all(p.grad is None for p in m.encoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.captioner.parameters())
    # Another after image in a pair is another key; the budget counts both caches.
    m.training_loss(dict(rowed, after_row=torch.tensor([3, 4, 9])))
    assert len(calls) == 7 and (0, 9) in m._pair_cache
    assert m._cache_bytes == sum(t.nbytes for c in (m._intra_cache, m._pair_cache) for t in c.values())
    # A budget for a few entries: the rest are computed alone every time, with the same loss.
    small = model()
    small.cache_limit = 2 * next(iter(m._intra_cache.values())).nbytes + next(iter(m._pair_cache.values())).nbytes
    assert torch.equal(small.training_loss(rowed)[0], loss)
    assert len(small._intra_cache) == 2 and len(small._pair_cache) == 1 and small._cache_bytes <= small.cache_limit


def test_frozen_intra_layers_train_the_joint_layers_from_the_cache():
    torch.manual_seed(0)
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_intra=True, encoder_cache_mb=1, **CAP)
    batch = {k: (v.to(torch.uint8) if v.is_floating_point() else v) for k, v in triplet_batch().items()}
    m.training_loss(batch)[0].backward()
    grads = {n: p.grad for n, p in m.encoder.named_parameters()}
    assert all(grads[n] is None for n in grads if n.startswith(("vit.embeddings.", "vit.pre_layrnorm.",
                                                                   "vit.encoder.layers.0.", "vit.encoder.layers.1.")))
    for n in ("vit.encoder.layers.2.mlp.fc1.weight", "vit.encoder.layers.3.self_attn.q_proj.weight",
              "joint_position", "proj.weight"):
        assert grads[n] is not None and grads[n].abs().sum() > 0, n
    assert len(m._intra_cache) == 9 and [g["lr"] for g in m.param_groups(1.0)] == [1.0, 1e-3]


def test_frozen_encoder_cache_stays_under_its_limit_and_needs_a_frozen_encoder():
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, freeze_encoder=True, encoder_cache_mb=0.01, **CAP).eval()
    x = pixels(8, 0).to(torch.uint8)
    per_image = m.encoder.intra(x[:1])[0].nbytes  # 50 tokens x 32 channels x 4 bytes
    out = m.cached_intra(x)
    assert len(m._intra_cache) == int(0.01 * 2 ** 20) // per_image < 8
    assert torch.allclose(out, m.encoder.intra(x), atol=1e-5)
    assert torch.equal(m.cached_intra([x[:3], x[3:]]), out)  # batches in a list: the same images in order
    with pytest.raises(PipelineError, match="freeze_encoder"):
        CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, encoder_cache_mb=1, **CAP)


def test_init_from_adaptation_copies_the_encoder_and_checks_the_split():
    torch.manual_seed(0)
    adapt = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, clip=SMALL, n_intra=2)
    torch.manual_seed(1)
    cap = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, **CAP)
    names = cap.init_from(adapt.state_dict())
    assert len(names) == len(cap.encoder.state_dict())
    for k, v in adapt.encoder.state_dict().items():
        assert torch.equal(cap.encoder.state_dict()[k], v), k
    assert cap.weights_identity.endswith("adapted (retrieval)")
    with pytest.raises(ValueError, match="split"):
        CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=3, **CAP).init_from(adapt.state_dict())


# ------------------------------------------------------------------------------------------ decoding
def test_cached_greedy_decoding_equals_recomputing_the_whole_prefix():
    torch.manual_seed(0)
    cap = Captioner(vocab_size=15, dim=16, layers=2, heads=2, ffn=32, dropout=0.1).eval()
    with torch.no_grad():
        cap.decoder.head.bias[END] = -2.0  # long captions: exercise the cache over many steps
    visual = torch.randn(4, 10, 16)
    fast = cap.greedy(visual, 12)
    words = torch.full((4, 1), START)
    done = torch.zeros(4, dtype=torch.bool)
    slow = torch.zeros(4, 12, dtype=torch.long)
    with torch.no_grad():
        for t in range(12):
            logits = cap(visual, words)[:, -1]
            logits[:, UNK] = -math.inf  # the shared decoder never emits <UNK>
            nxt = logits.argmax(-1).masked_fill(done, 0)
            slow[:, t] = nxt
            done |= nxt == END
            words = torch.cat([words, nxt[:, None]], 1)
    assert torch.equal(fast, slow)
    assert (fast > 0).sum() > 8


def test_generate_zeroes_after_end_and_respects_max_len():
    torch.manual_seed(0)
    m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, **CAP).eval()
    out = m.generate(pixels(3, 0), pixels(3, 1), 7)
    assert out.shape == (3, 7)
    for row in out.tolist():
        if END in row:
            assert all(x == 0 for x in row[row.index(END) + 1:])


# ------------------------------------------------------------------------------------------ retrieval
def test_pair_text_retrieval_with_several_captions_and_ties():
    sim = np.array([      # [captions, pairs]
        [0.9, 0.1, 0.2],  # caption 0 of pair 0: best -> rank 1
        [0.5, 0.5, 0.1],  # caption 1 of pair 0: tied with pair 1 -> rank 2 (ties count against the model)
        [0.3, 0.3, 0.3],  # caption 2 of pair 1: tied with both -> rank 3
        [0.8, 0.2, 0.3],  # caption 3 of pair 2: behind pair 0 -> rank 2
    ])
    owner = np.array([0, 0, 1, 2])
    m = pair_text_metrics(sim, owner)
    t2p = m["text_to_pair"]
    assert (t2p["R@1"], t2p["R@5"], t2p["MedianR"], t2p["MeanR"], t2p["n"]) == (0.25, 1.0, 2.0, 2.0, 4)
    # pair -> caption sets, each set scored by its best caption:
    # pair 0: [0.9, 0.3, 0.8] -> 1; pair 1: [0.5, 0.3, 0.2] -> 2; pair 2: [0.2, 0.3, 0.3] -> tie -> 2
    p2t = m["pair_to_text"]
    assert (p2t["R@1"], p2t["MedianR"], p2t["n"]) == (1 / 3, 2.0, 3)
    assert abs(p2t["MeanR"] - 5 / 3) < 1e-12
    assert abs(rsum(m) - (1 / 3 + 1 + 1 + 0.25 + 1 + 1)) < 1e-12
    with pytest.raises(ValueError):
        pair_text_metrics(sim, np.array([0, 0, 1, 1]))  # pair 2 without a caption


# ------------------------------------------------------------------------------------------ determinism
def test_same_seed_twice_gives_identical_training_and_decoding(tmp_path):
    from pipeline.engine import TrainConfig, train

    def once(d):
        torch.manual_seed(7)
        m = CLIP4IDC(vocab_size=20, clip=SMALL, n_intra=2, **CAP)
        cfg = TrainConfig(iterations=2, lr=1e-3, batch_size=2, val_every=2)
        train(m, lambda s: triplet_batch(2, seed=10 * s), lambda mm: (0.0, None), cfg, d, n_train=4,
              device=torch.device("cpu"), identity={"t": 1}, log=lambda r: None)
        m.eval()
        return m.state_dict(), m.generate(pixels(2, 3), pixels(2, 4), 6)

    (s1, g1), (s2, g2) = once(tmp_path / "a"), once(tmp_path / "b")
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(g1, g2)


# ------------------------------------------------------------------------------------------ tokens, pixels
def _bpe_file():
    from pipeline.models.clip4idc import find_bpe_vocab

    try:
        return find_bpe_vocab(os.environ.get("CLIP_BPE_VOCAB"))
    except PipelineError:
        return None


@pytest.mark.skipif(_bpe_file() is None, reason="CLIP BPE vocabulary not present (set CLIP_BPE_VOCAB, see ClipBPE)")
def test_clip_bpe_gives_openai_token_ids():
    bpe = ClipBPE(_bpe_file())
    assert len(bpe) == 49408 and (bpe.sot, bpe.eot) == (49406, 49407)
    assert bpe.encode("a photo of a cat") == [320, 1125, 539, 320, 2368]
    assert bpe.encode("A  dog.") == [320, 1929, 269]
    ids = bpe(["a dog", "the small red rubber cube changed to blue"], 6)
    assert ids[0].tolist() == [49406, 320, 1929, 49407, 0, 0] and ids[1, -1] == 49407


def test_pixel_cache_is_exact_uint8_in_the_feature_contract(tmp_path):
    from PIL import Image

    from pipeline.features.pixels import cache_pixels
    from pipeline.features.store import FeatureStore

    rng = np.random.default_rng(0)
    keys = ["images/a.png", "images/b.png"]
    for k in keys:
        (tmp_path / "raw" / "images").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(tmp_path / "raw" / k)
    out = cache_pixels(keys, tmp_path / "raw", tmp_path / "clip_pixels224.h5", progress=False)
    with FeatureStore(out) as store:
        assert store.dtype == np.uint8 and store.shape == (3, 224, 224)
        assert store.attrs["backbone"] == "clip_pixels224" and store.attrs["weights"] == "none"
        assert store.attrs["complete"] is True
        for k in keys:
            want = np.asarray(Image.open(tmp_path / "raw" / k).convert("RGB").resize((224, 224), Image.BICUBIC))
            np.testing.assert_array_equal(store.get(k), want.transpose(2, 0, 1).astype(np.float32))


# ------------------------------------------------------------------------------------------ workflow
def _dry_run(tmp_path, config, *targets):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory", str(tmp_path),
                           "--configfile", str(config), "--cores", "2", "-n", *targets], capture_output=True, text=True)


def test_layer_sweep_is_a_named_target_outside_the_main_job(tmp_path):
    import re

    root = Path(__file__).resolve().parent.parent
    p = _dry_run(tmp_path, root / "config" / "config.yaml", "clip4idc_layer_sweep")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    trained = set(re.findall(r"--method (clip4idc_frozen_intra\d+_inter\d+)", out))
    # The default's small ViT has 6 layers: N_intra from half to all of them, as the paper's 6..12 of 12.
    assert trained == {f"clip4idc_frozen_intra{n}_inter{6 - n}" for n in range(3, 7)}
    adapted = set(re.findall(r"adapt-clip4idc --name (\S+)", out))
    assert adapted == {"clip4idc_adapt"} | {f"clip4idc_adapt_intra{n}_inter{6 - n}" for n in (3, 5, 6)}
    main = _dry_run(tmp_path, root / "config" / "config.yaml")
    assert main.returncode == 0 and "clip4idc_frozen" not in main.stdout + main.stderr
    assert "adapt-clip4idc --name clip4idc_adapt " in main.stdout + main.stderr


def test_a_sweep_block_that_contradicts_its_id_is_refused(tmp_path):
    import yaml

    root = Path(__file__).resolve().parent.parent
    cfg = yaml.safe_load((root / "config" / "config.yaml").read_text())
    cfg["methods"]["clip4idc_frozen_intra5_inter1"]["model"]["n_intra"] = 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    p = _dry_run(tmp_path, bad, "clip4idc_layer_sweep")
    assert p.returncode != 0 and "methods.clip4idc_frozen_intra5_inter1: needs model.n_intra: 5" in p.stdout + p.stderr


def test_default_config_trains_one_small_clip_that_the_captioners_start_from():
    """The embedded default's CLIP blocks share one small from-scratch shape (a random ViT-B/32 cannot learn in a
    CPU budget): the adaptation's encoder loads into clip4idc and into every sweep captioner of the same split."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    cfg = yaml.safe_load((root / "config" / "config.yaml").read_text())
    adapt_hp = dict(cfg["pretraining"]["clip4idc_adapt"]["model"])
    adapt_hp.pop("text_tokens")
    shape = ClipShape(**adapt_hp["clip"])
    assert shape != ClipShape() and shape.image_size == 224  # small, on the cached 224-px pixels
    torch.manual_seed(0)
    adapt = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, **adapt_hp)
    assert sum(p.numel() for p in adapt.encoder.parameters()) < 5e6
    for m in ("clip_ft", "clip4idc", "clip4idc_no_adapt"):
        assert cfg["methods"][m]["model"]["clip"] == adapt_hp["clip"], m
        assert cfg["methods"][m]["model"]["weights"] == "random" and cfg["methods"][m]["model"]["encoder_lr_mult"] == 1.0
    assert cfg["methods"]["clip_ft"]["model"]["n_intra"] == shape.vision_layers  # CLIP-FT: every layer intra
    cap = CLIP4IDC(vocab_size=20, **cfg["methods"]["clip4idc"]["model"])
    cap.init_from(adapt.state_dict())
    torch.testing.assert_close(cap.encoder.state_dict(), adapt.encoder.state_dict())


@pytest.mark.parametrize("tiny", [False, True], ids=["default", "tiny over default"])
def test_every_datasets_clip_captioners_load_the_adaptation_they_start_from(tiny):
    """Resolved per dataset (its overrides merged): an override that changes the adaptation's encoder (e.g. the
    cross-cell bias) without its captioners, or the reverse, would fail only after the adaptation has run. Also
    with the end-to-end test's tiny file merged over the default, as Snakemake merges it."""
    import yaml

    from pipeline.config import merge, run_config

    root = Path(__file__).resolve().parent.parent
    cfg = yaml.safe_load((root / "config" / "config.yaml").read_text())
    names = set(cfg["methods"])
    if tiny:  # the runs the tiny file defines (its tables'; the default's sweep blocks keep the default shape)
        small = yaml.safe_load((root / ".test" / "config" / "config.yaml").read_text())
        cfg, names = merge(cfg, small), set(small["methods"])
    checked = 0
    for dataset in cfg["datasets"]:
        for m, block in cfg["methods"].items():
            init = block.get("init_from") or ""
            if m not in names:
                continue
            if block.get("backbone") != "clip_pixels224" or not init.startswith("clip4idc_adapt"):
                continue
            adapt_hp = dict(run_config(cfg, dataset, init)["model"])
            adapt_hp.pop("text_tokens", None)
            cap_hp = run_config(cfg, dataset, m)["model"]
            torch.manual_seed(0)
            adapt = CLIP4IDCAdapt(text_vocab_size=20, eos_id=END, **adapt_hp)
            CLIP4IDC(vocab_size=20, **cap_hp).init_from(adapt.state_dict())
            checked += 1
    assert checked >= len(cfg["datasets"]) * (1 if tiny else 2)


def test_quick_gelu_is_clips_activation_with_its_gradient_and_replaces_it_everywhere():
    from transformers.activations import QuickGELUActivation

    from pipeline.models.clip4idc import CLIP4IDCAdapt, QuickGELU

    x = (torch.randn(4000, dtype=torch.float64) * 4).requires_grad_()
    y0 = QuickGELUActivation()(x)
    (g0,) = torch.autograd.grad(y0.sum(), x)
    y1 = QuickGELU()(x)
    (g1,) = torch.autograd.grad(y1.sum(), x)
    assert torch.allclose(y0, y1, atol=1e-12) and torch.allclose(g0, g1, atol=1e-12)
    m = CLIP4IDCAdapt(60, 3, clip=dict(vision_width=32, vision_layers=2, vision_heads=2, text_width=32,
                                       text_layers=1, text_heads=2, embed_dim=16), n_intra=1)
    kinds = [type(mod) for mod in m.modules()]
    assert QuickGELU in kinds and QuickGELUActivation not in kinds
