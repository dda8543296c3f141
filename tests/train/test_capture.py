"""Feature computation and offline capture: exact reload, resume after a kill, named errors."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.train.capture import CaptureError, FeatureStore, capture, read_manifest, resolve_features
from specdec.train.data import tokenize_conversations, load_conversations
from specdec.train.features import check_aux_layers, compute_features, default_aux_layers

FEATURES = {"hidden": True, "aux_layers": [1, 2, 3], "topk_logits": 5}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_target):
    """12 tokenised conversations of varied length for the tiny byte-level target."""
    f = tmp_path_factory.mktemp("conv") / "c.jsonl"
    f.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} " * (1 + i % 4)},
        {"role": "assistant", "content": "reply " * (1 + (7 * i) % 9)}]}) + "\n" for i in range(12)))
    return tokenize_conversations(load_conversations([f]), tiny_target.tokenizer, max_length=96)


def single(target, ids, features=FEATURES) -> dict:
    """Fresh, unbatched features of one sequence."""
    ids = torch.tensor(ids)[None]
    out = compute_features(target, ids, torch.ones_like(ids), features["hidden"],
                           features["aux_layers"], features["topk_logits"])
    return {k: v[0] for k, v in out.items()}


def assert_item_equals_fresh(store, dataset, target, i):
    item = store[i]
    assert item["input_ids"].tolist() == dataset[i]["input_ids"]
    assert item["loss_mask"].tolist() == [bool(m) for m in dataset[i]["loss_mask"]]
    fresh = single(target, dataset[i]["input_ids"])
    for key in ("hidden", "aux", "topk_values"):
        torch.testing.assert_close(item[key], fresh[key], rtol=0, atol=1e-5)
    assert torch.equal(item["topk_indices"], fresh["topk_indices"])


# ----------------------------------------------------------------------------- features

def test_hidden_is_post_norm_and_features_match_the_target(tiny_target):
    model = tiny_target.model
    ids = torch.randint(0, 256, (2, 17))
    mask = torch.ones_like(ids)
    feats = compute_features(tiny_target, ids, mask, True, [0, 1, 3], 6)
    ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    # lm_head(hidden) is the target's logits: `hidden` is after the final norm.
    torch.testing.assert_close(model.get_output_embeddings()(feats["hidden"]), ref.logits)
    # aux = hidden_states[l] (HF indices: 0 = embeddings, l = output of layer l-1), in order.
    expect_aux = torch.cat([ref.hidden_states[l] for l in (0, 1, 3)], -1)
    torch.testing.assert_close(feats["aux"], expect_aux)
    assert feats["aux"].shape == (2, 17, 3 * tiny_target.hidden_size)
    values, indices = torch.log_softmax(ref.logits.float(), -1).topk(6, dim=-1)
    torch.testing.assert_close(feats["topk_values"], values)
    assert torch.equal(feats["topk_indices"], indices)


def test_right_padding_leaves_real_positions_unchanged(tiny_target):
    a, b = torch.randint(0, 256, (1, 11)), torch.randint(0, 256, (1, 5))
    ids = torch.zeros(2, 11, dtype=torch.long)
    ids[0], ids[1, :5] = a[0], b[0]
    attn = torch.tensor([[1] * 11, [1] * 5 + [0] * 6])
    batched = compute_features(tiny_target, ids, attn, True, [2], 3)
    alone = compute_features(tiny_target, b, torch.ones_like(b), True, [2], 3)
    for key in ("hidden", "aux", "topk_values"):
        torch.testing.assert_close(batched[key][1, :5], alone[key][0], rtol=0, atol=1e-5)


def test_default_aux_layers():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M, as vLLM picks them
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(4) == [2, 2, 1]     # tiny targets: the same formula
    with pytest.raises(ValueError, match="ids run 0..3"):
        check_aux_layers([1, 4], 4)


def test_resolve_features_explicit_flags(tiny_target):
    spec = resolve_features(tiny_target, hidden=False, aux_layers=[1, 3], topk_logits=0)
    assert spec == {"hidden": False, "aux_layers": [1, 3], "topk_logits": 0}
    with pytest.raises(CaptureError, match="nothing to capture"):
        resolve_features(tiny_target, hidden=False, aux_layers=[], topk_logits=0)


def test_head_type_asks_the_registry_for_its_feature_spec(tiny_target, monkeypatch):
    import specdec.heads
    from specdec.train.features import default_aux_layers as aux

    class FakeEagle3:
        @classmethod
        def from_target(cls, target):
            head = cls()
            head.spec = type("FeatureSpec", (), {"hidden": True, "topk_logits": 0,
                                                 "aux_layers": tuple(aux(target.num_layers))})
            return head

        def feature_spec(self):
            return self.spec

    monkeypatch.setattr(specdec.heads, "get_head_class",
                        lambda name: {"eagle3": FakeEagle3}[name], raising=False)
    assert resolve_features(tiny_target, "eagle3") == {"hidden": True, "aux_layers": [2, 2, 1],
                                                       "topk_logits": 0}
    # Explicit flags override the head's spec.
    assert resolve_features(tiny_target, "eagle3", topk_logits=8)["topk_logits"] == 8


# ----------------------------------------------------------------------------- capture

def test_capture_then_reload_equals_fresh_features(tmp_path, tiny_target, dataset):
    out = capture(tiny_target, dataset, tmp_path / "f", FEATURES, shard_tokens=300,
                  batch_tokens=300, progress=False)
    manifest = read_manifest(out)
    assert manifest["complete"] and len(manifest["shards"]) >= 3
    assert manifest["features"] == FEATURES and manifest["dtype"] == "float32"
    assert manifest["target"] == tiny_target.identity()
    assert sum(s["num_sequences"] for s in manifest["shards"]) == len(dataset)
    assert sum(s["num_tokens"] for s in manifest["shards"]) == sum(map(len, dataset["input_ids"]))
    store = FeatureStore(out, target=tiny_target, features=FEATURES)
    assert len(store) == len(dataset)
    assert store.lengths() == [len(x) for x in dataset["input_ids"]]
    for i in range(len(dataset)):
        assert_item_equals_fresh(store, dataset, tiny_target, i)
    store.verify()
    with pytest.raises(IndexError):
        store[len(dataset)]
    # Picklable for DataLoader workers (open shard handles are not carried over).
    import pickle

    again = pickle.loads(pickle.dumps(store))
    assert torch.equal(again[len(dataset) - 1]["hidden"], store[len(dataset) - 1]["hidden"])


def test_resume_after_a_kill_keeps_finished_shards(tmp_path, tiny_target, dataset):
    out = tmp_path / "f"

    def killed_after_second_shard(k):
        if k == 1:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        capture(tiny_target, dataset, out, FEATURES, shard_tokens=300, progress=False,
                on_shard=killed_after_second_shard)
    partial = read_manifest(out)
    assert not partial["complete"] and len(partial["shards"]) == 2
    with pytest.raises(CaptureError, match="incomplete"):
        FeatureStore(out)
    # A stale temporary file of the shard being written when the kill came.
    (out / "shard-00002.safetensors.tmp").write_bytes(b"half a shard")
    stamps = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in partial["shards"]}

    capture(tiny_target, dataset, out, FEATURES, shard_tokens=300, progress=False)
    manifest = read_manifest(out)
    assert manifest["complete"] and manifest["shards"][:2] == partial["shards"]
    assert {f: (out / f).stat().st_mtime_ns for f in stamps} == stamps  # not redone
    assert not list(out.glob("*.tmp"))
    # Identical to an uninterrupted capture, byte for byte (checksums equal).
    ref = capture(tiny_target, dataset, tmp_path / "ref", FEATURES, shard_tokens=300, progress=False)
    assert [s["sha256"] for s in read_manifest(ref)["shards"]] == [s["sha256"] for s in manifest["shards"]]
    store = FeatureStore(out)
    for i in (0, len(dataset) // 2, len(dataset) - 1):
        assert_item_equals_fresh(store, dataset, tiny_target, i)


def test_corrupt_or_missing_shard_is_named(tmp_path, tiny_target, dataset):
    out = capture(tiny_target, dataset, tmp_path / "f", FEATURES, shard_tokens=300, progress=False)
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the tensor data
    shard.write_bytes(bytes(data))
    store = FeatureStore(out)
    first_of_shard1 = read_manifest(out)["shards"][0]["num_sequences"]
    store[0]  # shard 0 is intact and still usable
    with pytest.raises(CaptureError, match="shard-00001.safetensors: checksum mismatch"):
        store[first_of_shard1]
    with pytest.raises(CaptureError, match="shard-00001"):
        FeatureStore(out).verify()
    # Resuming over it refuses too, rather than building on a corrupt shard.
    manifest = read_manifest(out)
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CaptureError, match="shard-00001"):
        capture(tiny_target, dataset, out, FEATURES, shard_tokens=300, progress=False)
    shard.unlink()
    with pytest.raises(CaptureError, match="shard-00001.safetensors: shard listed in the manifest is missing"):
        FeatureStore(out, allow_incomplete=True).verify()


def test_mismatched_target_or_features_are_refused(tmp_path, tiny_target, dataset):
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    other = load_target(str(build_tiny_target(tmp_path / "other", seed=1)))
    out = capture(tiny_target, dataset.select(range(4)), tmp_path / "f", FEATURES, progress=False)
    with pytest.raises(CaptureError, match="manifest.json: captured for target"):
        FeatureStore(out, target=other)
    with pytest.raises(CaptureError, match="captured features"):
        FeatureStore(out, features={"hidden": True, "aux_layers": [1], "topk_logits": 5})
    with pytest.raises(CaptureError, match="different features"):
        capture(tiny_target, dataset.select(range(4)), out, {**FEATURES, "topk_logits": 2}, progress=False)
    with pytest.raises(CaptureError, match="made with target"):
        capture(other, dataset.select(range(4)), out, FEATURES, progress=False)
    with pytest.raises(CaptureError, match="different data"):
        capture(tiny_target, dataset.select(range(5)), out, FEATURES, progress=False)
    # --overwrite starts over.
    capture(other, dataset.select(range(4)), out, FEATURES, overwrite=True, progress=False)
    assert len(FeatureStore(out, target=other)) == 4


def test_cli_capture_on_tiny_target(tmp_path, monkeypatch, tiny_target_dir, tiny_target):
    from specdec.train.data_cli import main

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "hello " * i}]}) + "\n"
        for i in range(1, 9)))
    out = tmp_path / "feat"
    argv = ["capture", "--target", str(tiny_target_dir), "--dtype", "float32", "--data", str(data),
            "--out", str(out), "--aux-layers", "default", "--topk-logits", "3", "--split", "all",
            "--shard-tokens", "200", "--max-length", "64"]
    assert main(argv) == 0
    store = FeatureStore(out, target=tiny_target)
    assert len(store) == 8
    assert store.features == {"hidden": True, "aux_layers": [2, 2, 1], "topk_logits": 3}
    assert store.manifest["source"]["split"] == "all"
    assert main(argv) == 0  # already complete: nothing to redo
    # A changed feature request on the same folder is an error (exit 2), not a silent mix.
    assert main(argv[:-6] + ["--topk-logits", "4", "--split", "all", "--max-length", "64"]) == 2


@pytest.mark.e2e
def test_smollm2_hidden_is_post_norm(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    feats = compute_features(smollm2, ids, torch.ones_like(ids), True, default_aux_layers(30), 4)
    logits = smollm2.model(input_ids=ids).logits
    torch.testing.assert_close(smollm2.model.get_output_embeddings()(feats["hidden"]), logits)
    assert feats["aux"].shape == (1, ids.shape[1], 3 * 576)
    assert torch.equal(feats["topk_indices"][..., 0], logits.argmax(-1))


def test_cli_evaluate_scores_heads_on_a_capture(tmp_path, monkeypatch, tiny_target_dir, tiny_target, capsys):
    """`specdec-data evaluate`: every captured sequence scored, as the trainer's eval scores them;
    a capture without the features a head reads is refused, naming them."""
    from specdec.heads import get_head_class
    from specdec.train.batches import pad_batch
    from specdec.train.data_cli import main
    from specdec.train.evaluate import evaluate

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": "ab " * (3 + i)}]}) + "\n"
        for i in range(6)))
    common = ["--target", str(tiny_target_dir), "--dtype", "float32", "--data", str(data), "--split", "all"]
    assert main(["capture", *common, "--head-type", "eagle3", "--out", str(tmp_path / "e3")]) == 0
    assert main(["capture", *common, "--head-type", "medusa", "--out", str(tmp_path / "medusa")]) == 0
    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target)
    head.save_pretrained(tmp_path / "head")

    report = tmp_path / "reports" / "r.json"  # its folder is made
    argv = ["evaluate", str(tmp_path / "head"), "--target", str(tiny_target_dir), "--depth", "3"]
    assert main([*argv, "--features", str(tmp_path / "e3"), "--json", str(report)]) == 0
    got = json.loads(report.read_text())[str(tmp_path / "head")]
    store = FeatureStore(tmp_path / "e3")
    expected = evaluate(head, [pad_batch([store[i]]) for i in range(len(store))], 3)
    assert got["num_sequences"] == len(store) == 6
    assert got["count"] == expected.count and got["correct"] == expected.correct and got["count"][0] > 0
    assert got["tau"] == pytest.approx(expected.tau)
    assert main([*argv, "--features", str(tmp_path / "medusa")]) == 2   # no aux layers captured
    # a head of other aux layers than its type's default: the advice names them
    get_head_class("eagle3").from_target(tiny_target, aux_layers=[1, 2, 3]).save_pretrained(tmp_path / "h123")
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "head"), str(tmp_path / "h123"), "--target", str(tiny_target_dir),
                 "--features", str(tmp_path / "e3")]) == 2
    out = capsys.readouterr()
    assert "--head-type eagle3 --aux-layers 1,2,3" in out.err and "==" not in out.out   # none scored
    # flags out of range are said before --overwrite discards the capture there
    assert main(["capture", *common, "--topk-logits", "-2", "--eval-fraction", "1.5", "--overwrite",
                 "--out", str(tmp_path / "e3")]) == 2
    err = capsys.readouterr().err
    assert "--topk-logits must be >= 0" in err and "--eval-fraction must be in [0, 1)" in err
    assert len(FeatureStore(tmp_path / "e3")) == 6


def test_cli_capture_out_that_is_a_file_is_a_line(tmp_path, capsys):
    from specdec.train.data_cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    out = tmp_path / "replies.jsonl"
    out.write_text("keep me\n")
    assert main(["capture", "--target", "no-such-target-is-loaded", "--data", str(data),
                 "--out", str(out)]) == 2  # said before the target loads, not a FileExistsError
    assert "is a file, not a capture directory" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"



def test_cli_evaluate_json_that_is_a_folder_is_said_before_scoring(tmp_path, capsys):
    from specdec.train.data_cli import main

    assert main(["evaluate", str(tmp_path / "head"), "--features", str(tmp_path / "nothing-captured"),
                 "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a folder" in capsys.readouterr().err
