"""Feature extraction: torchvision key mapping, BatchNorm folding, HDF5 output (resume, atomicity, bad images),
FeatureStore, and the weights policy (download, resume, checksum, offline message)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import multiprocessing
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.errors import PipelineError
from pipeline.features import backbones, weights
from pipeline.features.extract import FeatureSettings, extract_to_hdf5, image_keys_from_manifest, load_image
from pipeline.features.store import FeatureStore

SHALLOW3 = (1, 1, 1)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ------------------------------------------------------------------------------------------ helpers
def torchvision_state_dict(depths, seed=0, fc=True) -> dict[str, torch.Tensor]:
    """A random state dict with torchvision's ResNet (bottleneck) key names and shapes, built by name."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def bn(prefix, c):
        sd[f"{prefix}.weight"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.bias"] = torch.randn(c, generator=g) * 0.1
        sd[f"{prefix}.running_mean"] = torch.randn(c, generator=g) * 0.1
        sd[f"{prefix}.running_var"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.num_batches_tracked"] = torch.tensor(7, dtype=torch.long)

    def conv(name, cout, cin, k):
        sd[name] = torch.randn(cout, cin, k, k, generator=g) * (2.0 / (cin * k * k)) ** 0.5

    conv("conv1.weight", 64, 3, 7)
    bn("bn1", 64)
    cin = 64
    for i, depth in enumerate(depths, 1):
        cout = backbones.RESNET101_WIDTHS[i - 1]
        mid = cout // 4
        for j in range(depth):
            p = f"layer{i}.{j}"
            conv(f"{p}.conv1.weight", mid, cin if j == 0 else cout, 1)
            bn(f"{p}.bn1", mid)
            conv(f"{p}.conv2.weight", mid, mid, 3)
            bn(f"{p}.bn2", mid)
            conv(f"{p}.conv3.weight", cout, mid, 1)
            bn(f"{p}.bn3", cout)
            if j == 0:
                conv(f"{p}.downsample.0.weight", cout, cin, 1)
                bn(f"{p}.downsample.1", cout)
        cin = cout
    if fc:
        sd["fc.weight"] = torch.randn(1000, cin, generator=g) * 0.01
        sd["fc.bias"] = torch.zeros(1000)
    return sd


def shallow_model(seed=0, backbone="resnet101_layer3", depths=SHALLOW3):
    model = backbones.build_backbone(backbone, depths=depths)
    backbones.load_torchvision_state_dict(model, torchvision_state_dict(depths, seed))
    return model


def write_pngs(root: Path, n: int, size=(40, 30), seed=0) -> list[str]:
    rng = np.random.default_rng(seed)
    keys = []
    for i in range(n):
        folder = "images" if i % 2 == 0 else "sc_images"
        (root / folder).mkdir(parents=True, exist_ok=True)
        key = f"{folder}/img_{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / key)
        keys.append(key)
    return sorted(keys)


def settings_for(model_backbone="resnet101_layer3", size=32, dtype="float32", **kw) -> FeatureSettings:
    spec = backbones.get_spec(model_backbone)
    base = dict(backbone=spec.id, layer=spec.layer, weights="random(seed=0)", input_size=size, mean=MEAN,
                std=STD, dtype=dtype, shape=spec.output_shape(size))
    base.update(kw)
    return FeatureSettings(**base)


class CountingExtractor:
    def __init__(self, inner):
        self.inner, self.images = inner, 0

    def __call__(self, x):
        self.images += x.shape[0]
        return self.inner(x)


@pytest.fixture(scope="module")
def extractor():
    torch.manual_seed(0)
    return backbones.Extractor.from_model(shallow_model(), "cpu", micro_batch=2)


# ---------------------------------------------------------------------------------- backbone / loader
def test_torchvision_state_dict_loads_key_for_key():
    sd = torchvision_state_dict(backbones.RESNET101_DEPTHS, seed=1)
    model = backbones.build_backbone("resnet101_layer4")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = backbones.forward_features(model, x)
    backbones.load_torchvision_state_dict(model, sd)
    target = model.state_dict()
    used = set()
    for key, value in sd.items():
        tkey = backbones.torchvision_to_transformers_key(key)
        if tkey is None:
            assert key.startswith("fc.")
            continue
        assert torch.equal(target[tkey], value), key
        used.add(tkey)
    assert used == set(target), set(target) ^ used  # every parameter and buffer came from the source
    with torch.inference_mode():
        after = backbones.forward_features(model, x)
    assert after.shape == (1, 2048, 2, 2)
    assert not torch.allclose(before, after)

    # layer3 trunk from the same file: layer4.* and fc.* are ignored, everything else consumed
    m3 = backbones.build_backbone("resnet101_layer3")
    backbones.load_torchvision_state_dict(m3, sd)
    assert torch.equal(m3.state_dict()["encoder.stages.2.layers.22.layer.2.convolution.weight"],
                       sd["layer3.22.conv3.weight"])


def test_loader_errors_name_the_keys():
    model = backbones.build_backbone("resnet101_layer3", depths=SHALLOW3)
    sd = torchvision_state_dict(SHALLOW3)
    bad = dict(sd, **{"layer1.0.attn.weight": torch.zeros(1)})
    with pytest.raises(PipelineError, match=r"unknown keys.*layer1\.0\.attn\.weight"):
        backbones.load_torchvision_state_dict(model, bad)
    missing = {k: v for k, v in sd.items() if k != "layer2.0.conv2.weight"}
    with pytest.raises(PipelineError, match=r"missing keys.*encoder\.stages\.1\.layers\.0\.layer\.1\.convolution"):
        backbones.load_torchvision_state_dict(model, missing)
    wrong = dict(sd, **{"conv1.weight": torch.zeros(64, 3, 3, 3)})
    with pytest.raises(PipelineError, match=r"shape mismatches: conv1\.weight"):
        backbones.load_torchvision_state_dict(model, wrong)
    deeper = torchvision_state_dict((2, 1, 1))
    with pytest.raises(PipelineError, match=r"no counterpart.*layer1\.1\.conv1\.weight"):
        backbones.load_torchvision_state_dict(model, deeper)
    old = {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}  # old checkpoints lack these
    backbones.load_torchvision_state_dict(model, old)


def test_bn_folding_matches_eval_model():
    model = shallow_model(seed=3)
    x = torch.randn(5, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = backbones.forward_features(model, x)
    folded = backbones.fold_batchnorm(model)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # the original is untouched
    with torch.inference_mode():
        out = backbones.forward_features(folded, x)
    scale = ref.abs().max()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * scale)
    fast = backbones.Extractor.from_model(model, "cpu", micro_batch=2)  # channels_last, chunks of 2
    torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-5 * scale)
    # the CUDA code path (bf16 autocast), exercised on the CPU: runs, float32 out, close to fp32
    bf16 = backbones.Extractor(fast.model, "cpu", autocast=True)(x)
    assert bf16.dtype == torch.float32 and bf16.shape == ref.shape
    assert ((bf16 - ref).norm() / ref.norm()) < 0.05


def test_bn_folding_stays_on_the_models_device():
    # A bias-free conv gets its folded bias on the weight's device: a model already on a GPU folds there (the CPU
    # zeros made `bench_features.py --device cuda` fail on an H200). The meta device stands in for the GPU here.
    conv = torch.nn.Conv2d(3, 4, 1, bias=False, device="meta")
    bn = torch.nn.BatchNorm2d(4, device="meta").eval()
    backbones._fold_conv_bn(conv, bn)
    assert conv.bias is not None and conv.bias.device.type == "meta" and conv.weight.device.type == "meta"


def test_zero_residual_branches_are_skipped_exactly():
    # weights: random starts every residual branch at zero (zero_init_residual): the prepared trunk skips them
    model = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=(2, 2, 3)), 4)
    last_bns = [b.layer[-1].normalization.weight for b in model.modules()
                if type(b).__name__ == "ResNetBottleNeckLayer"]
    assert len(last_bns) == 7 and all(not w.any() for w in last_bns)
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = backbones.forward_features(model, x)
    fast = backbones.Extractor.from_model(model)
    assert sum(isinstance(m, backbones.ShortcutOnly) for m in fast.model.modules()) == 7
    torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-5 * ref.abs().max())
    # a trained trunk (non-zero branches) keeps every block
    trained = backbones.fold_batchnorm(shallow_model(seed=1))
    assert backbones.drop_zero_residuals(trained) == 0


def test_layer3_output_is_1024x14x14_at_224():
    model = backbones.build_backbone("resnet101_layer3")  # full depth
    backbones.init_random_(model, 0, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    out = backbones.Extractor.from_model(model)(torch.zeros(1, 3, 224, 224))
    assert tuple(out.shape) == (1, 1024, 14, 14)
    assert backbones.get_spec("resnet101_layer3").output_shape(224) == (1024, 14, 14)
    assert backbones.get_spec("resnet101_layer4").output_shape(224) == (2048, 7, 7)
    m4 = backbones.build_backbone("resnet101_layer4", depths=(1, 1, 1, 1))
    with torch.inference_mode():
        assert tuple(backbones.forward_features(m4, torch.zeros(1, 3, 224, 224)).shape) == (1, 2048, 7, 7)
    with pytest.raises(PipelineError, match="unknown backbone 'resnet50'"):
        backbones.get_spec("resnet50")


def test_random_init_is_seeded_and_bounded():
    a = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=SHALLOW3), 5)
    b = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=SHALLOW3), 5)
    c = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=SHALLOW3), 6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embedder.embedder.convolution.weight"], sc["embedder.embedder.convolution.weight"])
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = backbones.forward_features(a, x)
    assert torch.isfinite(y).all() and y.abs().max() < 1e3  # calibrated: far inside float16


# ------------------------------------------------------------------------------------- images / HDF5
def test_manifest_keys_and_image_loading(tmp_path):
    man = tmp_path / "manifest.jsonl"
    recs = [{"pair_id": "0", "before": "images/b.png", "after": "sc_images/a.png"},
            {"pair_id": "0_n", "before": "images/b.png", "after": "nsc_images/c.png"},
            {"pair_id": "x", "before": "images/d.png", "after": ""}]
    man.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert image_keys_from_manifest(man) == ["images/b.png", "images/d.png", "nsc_images/c.png", "sc_images/a.png"]
    img = np.zeros((10, 20, 3), dtype=np.uint8)
    img[..., 0] = 255
    Image.fromarray(img).save(tmp_path / "red.png")
    arr = load_image(tmp_path / "red.png", 16, MEAN, STD)
    assert arr.shape == (3, 16, 16) and arr.dtype == np.float32
    np.testing.assert_allclose(arr[0], (1 - MEAN[0]) / STD[0], rtol=1e-5)
    np.testing.assert_allclose(arr[2], (0 - MEAN[2]) / STD[2], rtol=1e-5)


def test_hdf5_round_trip_through_the_stage(tmp_path):
    from pipeline.__main__ import main

    raw = tmp_path / "data"
    keys = write_pngs(raw, 5)
    man = tmp_path / "manifest.jsonl"
    man.write_text("".join(json.dumps({"pair_id": str(i), "before": keys[i], "after": keys[i + 1]}) + "\n"
                           for i in range(0, 4, 2)) + json.dumps({"pair_id": "z", "before": keys[4]}) + "\n")
    out = tmp_path / "features" / "resnet101_layer3.h5"
    argv = ["extract-features", "--manifest", str(man), "--raw-dir", str(raw), "--weights", "random", "--seed", "3",
            "--out", str(out), "--batch-size", "2", "--image-size", "64", "--no-progress"]
    assert main(argv) == 0
    assert out.exists() and not Path(str(out) + ".partial").exists()
    with FeatureStore(out) as store:
        assert store.keys == keys and len(store) == 5 and keys[0] in store and "nope" not in store
        assert store.shape == (1024, 4, 4)
        a = store.attrs
        assert a["backbone"] == "resnet101_layer3" and a["layer"] == "layer3" and a["weights"] == (
            "random(seed=3, zero-init residuals, BN calibrated on 5 dataset images, mean scaled to 0.5)")
        assert a["input_size"] == 64 and a["dtype"] == "float16" and a["complete"] is True
        assert a["mean"] == pytest.approx(MEAN) and a["std"] == pytest.approx(STD) and a["code_version"]
        # values: the same trunk run directly on the same images
        model = backbones.build_backbone("resnet101_layer3")
        pix = torch.from_numpy(np.stack([load_image(raw / k, 64, MEAN, STD) for k in keys]))
        backbones.init_random_(model, 3, calibration=pix)  # 5 images: all of them are the calibration sample
        ref = backbones.Extractor.from_model(model)(pix).numpy()
        ref *= 0.5 / ref.mean()  # the random backbone's output scale: mean activation 0.5 on the sample
        got = store.get_many(keys)
        assert abs(got.mean() - 0.5) < 1e-3
        assert got.dtype == np.float32 and got.shape == (5, 1024, 4, 4)
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
        np.testing.assert_array_equal(store.get(keys[3]), got[3])
        # requested order (and duplicates) are honoured
        np.testing.assert_array_equal(store.get_many([keys[4], keys[0], keys[4]]), got[[4, 0, 4]])
    with h5py.File(out, "r") as f:
        assert f["features"].chunks == (1, 1024, 4, 4) and f["features"].dtype == np.float16
        stored = f["features"][()]
        assert "done" not in f
        assert h5py.check_string_dtype(f["keys"].dtype).encoding == "utf-8"
    with FeatureStore(out) as store:  # the float32 rows are the stored float16 values exactly (the cast is exact)
        np.testing.assert_array_equal(store.get_many(keys), stored.astype(np.float32))


def test_resume_equals_uninterrupted_run(tmp_path, extractor):
    raw = tmp_path / "data"
    keys = write_pngs(raw, 7)
    settings = settings_for()
    full = extract_to_hdf5(keys, raw, tmp_path / "full.h5", extractor, settings, batch_size=3, progress=False)

    out = tmp_path / "resumed.h5"
    partial = tmp_path / "resumed.h5.partial"

    def stop_after_first_batch(n_done):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract_to_hdf5(keys, raw, out, extractor, settings, batch_size=3, progress=False,
                        on_batch=stop_after_first_batch)
    assert partial.exists() and not out.exists()
    with pytest.raises(PipelineError, match="incomplete"):
        FeatureStore(partial)
    with h5py.File(partial, "r") as f:
        assert f["done"][()].tolist() == [1, 1, 1, 0, 0, 0, 0]

    counting = CountingExtractor(extractor)
    extract_to_hdf5(keys, raw, out, counting, settings, batch_size=3, progress=False)
    assert counting.images == 4  # only the rows not yet done
    assert out.exists() and not partial.exists()
    with FeatureStore(full) as a, FeatureStore(out) as b:
        assert a.keys == b.keys and a.attrs == b.attrs
        np.testing.assert_array_equal(a.get_many(a.keys), b.get_many(b.keys))

    # a partial written with other settings is not resumed
    with pytest.raises(KeyboardInterrupt):
        extract_to_hdf5(keys, raw, out, extractor, settings, batch_size=3, progress=False,
                        on_batch=stop_after_first_batch)
    counting = CountingExtractor(extractor)
    other = settings_for(std=(0.229, 0.224, 0.224))
    extract_to_hdf5(keys, raw, out, counting, other, batch_size=3, progress=False)
    assert counting.images == 7
    with FeatureStore(out) as s:
        assert s.attrs["std"] == pytest.approx([0.229, 0.224, 0.224])


def test_truncated_png_names_the_file_and_leaves_no_output(tmp_path, extractor):
    raw = tmp_path / "data"
    keys = write_pngs(raw, 4)
    bad = raw / keys[2]
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    out = tmp_path / "f.h5"
    with pytest.raises(PipelineError, match=str(bad)):
        extract_to_hdf5(keys, raw, out, extractor, settings_for(), batch_size=2, progress=False)
    assert not out.exists()
    assert not list(tmp_path.glob("f.h5*"))  # no partial file either: a failed extraction leaves nothing
    (raw / keys[0]).unlink()
    with pytest.raises(PipelineError, match=f"image file {raw / keys[0]} does not exist"):
        extract_to_hdf5(keys, raw, out, extractor, settings_for(), batch_size=2, progress=False)
    assert not out.exists()


def test_store_errors(tmp_path, extractor):
    raw = tmp_path / "data"
    keys = write_pngs(raw, 2)
    out = extract_to_hdf5(keys, raw, tmp_path / "f.h5", extractor, settings_for(), batch_size=2, progress=False)
    with FeatureStore(out) as store:
        with pytest.raises(PipelineError, match=f"image key 'images/missing.png' missing from feature file {out}"):
            store.get("images/missing.png")
        with pytest.raises(PipelineError, match="missing from feature file"):
            store.get_many([keys[0], "nope"])
    with pytest.raises(PipelineError, match="does not exist"):
        FeatureStore(tmp_path / "absent.h5")
    with h5py.File(tmp_path / "inc.h5", "w") as f:
        f["features"] = np.zeros((1, 2, 1, 1), np.float16)
        f["keys"] = np.array(["a"], dtype=object).astype(h5py.string_dtype())
    with pytest.raises(PipelineError, match=r"feature file .*inc\.h5 is incomplete"):
        FeatureStore(tmp_path / "inc.h5")


def _read_in_child(store, key):
    return store.get(key).sum()


def test_store_is_safe_in_forked_workers(tmp_path, extractor):
    raw = tmp_path / "data"
    keys = write_pngs(raw, 3)
    out = extract_to_hdf5(keys, raw, tmp_path / "f.h5", extractor, settings_for(), batch_size=3, progress=False)
    with FeatureStore(out) as store:
        expected = [store.get(k).sum() for k in keys]  # the parent has an open handle now
        with multiprocessing.get_context("fork").Pool(2) as pool:
            got = pool.starmap(_read_in_child, [(store, k) for k in keys])
        np.testing.assert_allclose(got, expected)


def test_same_seed_same_features_on_cpu(tmp_path):
    raw = tmp_path / "data"
    keys = write_pngs(raw, 3)
    outs = []
    for i, seed in enumerate((0, 0, 1)):
        model = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=SHALLOW3), seed)
        ex = backbones.Extractor.from_model(model)
        outs.append(extract_to_hdf5(keys, raw, tmp_path / f"{i}.h5", ex, settings_for(weights=f"random(seed={seed})"),
                                    batch_size=2, progress=False))
    with FeatureStore(outs[0]) as a, FeatureStore(outs[1]) as b, FeatureStore(outs[2]) as c:
        np.testing.assert_array_equal(a.get_many(keys), b.get_many(keys))
        assert not np.array_equal(a.get_many(keys), c.get_many(keys))


# ------------------------------------------------------------------------------------------- weights
class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves one in-memory file, honouring ``Range: bytes=N-``; records the Range headers it saw."""

    def do_GET(self):  # noqa: N802 - http.server API
        payload, seen = self.server.payload, self.server.ranges
        rng = self.headers.get("Range")
        seen.append(rng)
        start = 0
        if rng and self.server.honour_range:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(payload):
                self.send_response(416)
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(payload) - 1}/{len(payload)}")
        else:
            self.send_response(200)
        body = payload[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    srv.payload = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    srv.ranges = []
    srv.honour_range = True
    srv.timeout = 5
    thread = threading.Thread(target=functools.partial(srv.serve_forever, poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def _url(srv, name="w.pth"):
    return f"http://127.0.0.1:{srv.server_address[1]}/{name}"


def test_download_fresh_resume_and_checksum(tmp_path, server):
    payload = server.payload
    digest = hashlib.sha256(payload).hexdigest()
    dest = tmp_path / "w.pth"
    weights.download(_url(server), dest, sha256_prefix=digest[:8], progress=False)
    assert dest.read_bytes() == payload and not (tmp_path / "w.pth.part").exists()

    dest2 = tmp_path / "w2.pth"
    (tmp_path / "w2.pth.part").write_bytes(payload[:123_456])
    weights.download(_url(server), dest2, sha256_prefix=digest[:8], progress=False)
    assert server.ranges[-1] == "bytes=123456-"
    assert dest2.read_bytes() == payload

    # a server that ignores Range: the .part is restarted, not appended to
    server.honour_range = False
    dest3 = tmp_path / "w3.pth"
    (tmp_path / "w3.pth.part").write_bytes(payload[:1000])
    weights.download(_url(server), dest3, sha256_prefix=digest[:8], progress=False)
    assert dest3.read_bytes() == payload
    server.honour_range = True

    # the .part already complete: 416, then the checksum decides
    dest4 = tmp_path / "w4.pth"
    (tmp_path / "w4.pth.part").write_bytes(payload)
    weights.download(_url(server), dest4, sha256_prefix=digest[:8], progress=False)
    assert dest4.read_bytes() == payload

    dest5 = tmp_path / "w5.pth"
    with pytest.raises(PipelineError, match="checksum mismatch"):
        weights.download(_url(server), dest5, sha256_prefix="00000000" if digest[:8] != "00000000" else "11111111",
                         progress=False)
    assert not dest5.exists() and not (tmp_path / "w5.pth.part").exists()


def test_download_file_url_resumes(tmp_path):
    src = tmp_path / "src.bin"
    payload = bytes(range(256)) * 1000
    src.write_bytes(payload)
    dest = tmp_path / "out" / "dst.bin"
    dest.parent.mkdir()
    (dest.parent / "dst.bin.part").write_bytes(payload[:5000])
    weights.download(src.as_uri(), dest, sha256_prefix=hashlib.sha256(payload).hexdigest()[:8], progress=False)
    assert dest.read_bytes() == payload


def test_resolve_weights_policy(tmp_path, server, monkeypatch):
    r = weights.resolve_weights("random", tmp_path, seed=4)
    assert r.kind == "random" and r.identity == "random(seed=4)"

    f = tmp_path / "mine.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in torchvision_state_dict(SHALLOW3).items()}}, f)
    r = weights.resolve_weights(str(f), tmp_path)
    assert r.identity == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() and r.path == f
    model = backbones.build_backbone("resnet101_layer3", depths=SHALLOW3)
    weights.apply_weights(model, r)
    assert torch.equal(model.state_dict()["embedder.embedder.convolution.weight"],
                       torchvision_state_dict(SHALLOW3)["conv1.weight"])
    with pytest.raises(PipelineError, match="weights file .*nothere.pth does not exist"):
        weights.resolve_weights(str(tmp_path / "nothere.pth"), tmp_path)

    # imagenet, offline: one message naming the file, the place, and the explicit alternative
    wdir = tmp_path / "weights"
    with pytest.raises(PipelineError) as e:
        weights.resolve_weights("imagenet", wdir, url="http://127.0.0.1:9/resnet101-63fe2227.pth", timeout=5)
    msg = str(e.value)
    assert "resnet101-63fe2227.pth" in msg and str(wdir / "resnet101-63fe2227.pth") in msg
    assert "weights: random" in msg and "\n" not in msg
    with pytest.raises(PipelineError, match="downloads are disabled"):
        weights.resolve_weights("imagenet", wdir, download_ok=False)

    # imagenet, a hand-placed file that is not the published one
    wdir.mkdir(exist_ok=True)
    assert not list(wdir.glob("*.part"))
    (wdir / "resnet101-63fe2227.pth").write_bytes(b"not the weights")
    with pytest.raises(PipelineError, match="does not start with 63fe2227"):
        weights.resolve_weights("imagenet", wdir)

    # imagenet download path, with a stand-in published file served locally
    digest = hashlib.sha256(server.payload).hexdigest()
    fake = weights.PublishedWeights(name="fake.pth", url=_url(server, "fake.pth"), sha256_prefix=digest[:8],
                                    description="stand-in")
    monkeypatch.setattr(weights, "IMAGENET_RESNET101", fake)
    r = weights.resolve_weights("imagenet", tmp_path / "w2")
    assert r.identity == f"sha256:{digest}" and r.path == tmp_path / "w2" / "fake.pth"
    assert r.path.read_bytes() == server.payload


def test_batchnorm_calibration_normalises_the_calibration_batch():
    """After calibration every BatchNorm maps its input on that batch to zero mean and unit variance."""
    model = backbones.init_random_(backbones.build_backbone("resnet101_layer3", depths=SHALLOW3), 0)
    pixels = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(1)) * 4 - 2
    backbones.calibrate_batchnorm_(model, pixels)
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    seen = {}
    bn.register_forward_hook(lambda mod, inp, out: seen.setdefault("out", out))
    model.eval()
    with torch.no_grad():
        backbones.forward_features(model, pixels)
    out = seen["out"]
    torch.testing.assert_close(out.mean((0, 2, 3)), torch.zeros(out.shape[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.var((0, 2, 3), unbiased=False), torch.ones(out.shape[1]), atol=1e-3, rtol=0)


def _layer4_trunk(shortcut: str, seed: int = 0):
    model = backbones.build_backbone("resnet101_layer4", depths=(1, 1, 1, 1))
    if shortcut == "avg_down":
        assert backbones.avg_down_(model) == 3  # layer2-4's first blocks (layer1's shortcut has stride 1)
    cal = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    backbones.init_random_(model, seed, cal)
    return backbones.Extractor.from_model(model)


def test_avg_down_shortcuts_see_every_pixel_block_the_strided_trunk_skips():
    strided, avg = _layer4_trunk("strided"), _layer4_trunk("avg_down")
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    assert strided(x).shape == avg(x).shape == (1, 2048, 2, 2)
    # odd maps: the pooled shortcut keeps the residual branch's ceil(h/2) (the bottleneck adds the two)
    assert avg(torch.rand(1, 3, 72, 72)).shape == strided(torch.rand(1, 3, 72, 72)).shape == (1, 2048, 3, 3)
    # a strided layer4 cell reads one small patch every 32 pixels: a change in the pixels between is invisible
    # to it; the averaged trunk sees it (why config.yaml's layer4 uses avg_down)
    blind = 0
    for r0 in range(0, 64, 4):
        for c0 in range(0, 64, 4):
            y = x.clone()
            y[:, :, r0:r0 + 4, c0:c0 + 4] = 1.0 - y[:, :, r0:r0 + 4, c0:c0 + 4]
            if torch.equal(strided(y), strided(x)):
                blind += 1
                assert not torch.allclose(avg(y), avg(x))
    assert blind >= 64  # most of the 256 4x4 blocks


def test_avg_down_is_refused_with_trained_weights(tmp_path, capsys):
    from pipeline.__main__ import main

    raw = tmp_path / "data"
    keys = write_pngs(raw, 2)
    man = tmp_path / "manifest.jsonl"
    man.write_text(json.dumps({"pair_id": "0", "before": keys[0], "after": keys[1]}) + "\n")
    out = tmp_path / "f.h5"
    assert main(["extract-features", "--manifest", str(man), "--raw-dir", str(raw), "--weights", "imagenet",
                 "--shortcut", "avg_down", "--backbone", "resnet101_layer4", "--no-download", "--out", str(out)]) != 0
    assert "--shortcut avg_down needs --weights random" in capsys.readouterr().err
    assert not out.exists()
    assert main(["extract-features", "--manifest", str(man), "--raw-dir", str(raw), "--weights", "random",
                 "--shortcut", "avg_down", "--backbone", "resnet101_layer4", "--image-size", "64", "--no-progress",
                 "--out", str(out)]) == 0
    with FeatureStore(out) as store:
        assert "avg-down shortcuts" in store.attrs["weights"] and store.shape == (2048, 2, 2)


def test_pool_stores_the_grid_average_pooled(tmp_path, capsys):
    """``--pool 2`` on a 4x4 grid stores each 2x2 block's mean (what the models' own ``pool`` computed at every
    step), says so in the attributes, and is the unpooled file's features pooled, up to float16 rounding; a pool
    that does not divide the grid is one clear error and leaves no file."""
    from pipeline.__main__ import main

    raw = tmp_path / "data"
    keys = write_pngs(raw, 3)
    man = tmp_path / "manifest.jsonl"
    man.write_text(json.dumps({"pair_id": "0", "before": keys[0], "after": keys[1]}) + "\n"
                   + json.dumps({"pair_id": "1", "before": keys[2]}) + "\n")
    base = ["extract-features", "--manifest", str(man), "--raw-dir", str(raw), "--weights", "random", "--seed", "1",
            "--image-size", "64", "--no-progress"]
    full, pooled, bad = tmp_path / "full.h5", tmp_path / "pooled.h5", tmp_path / "bad.h5"
    assert main(base + ["--out", str(full)]) == 0
    assert main(base + ["--pool", "2", "--out", str(pooled)]) == 0
    with FeatureStore(full) as f, FeatureStore(pooled) as p:
        assert f.shape == (1024, 4, 4) and p.shape == (1024, 2, 2)
        assert "grid_pool" not in f.attrs and p.attrs["grid_pool"] == "average-pooled to 2x2"
        want = torch.nn.functional.avg_pool2d(torch.from_numpy(f.get_many(keys)), 2).numpy()
        got = p.get_many(keys)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
        assert np.abs(got - f.get_many(keys)[:, :, ::2, ::2]).max() > 10 * np.abs(got - want).max()  # not a subsample
    assert main(base + ["--pool", "4", "--out", str(tmp_path / "same.h5")]) == 0  # not smaller: stored as it is
    with FeatureStore(tmp_path / "same.h5") as s:
        assert s.shape == (1024, 4, 4) and "grid_pool" not in s.attrs
    assert main(base + ["--pool", "3", "--out", str(bad)]) != 0
    assert "--pool 3 does not divide the 4x4 grid" in capsys.readouterr().err
    assert not bad.exists() and not Path(str(bad) + ".partial").exists()
