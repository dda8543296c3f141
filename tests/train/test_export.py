"""specdec-export: every (head type, format) pair exports or refuses clearly, the exported tensor
names / shapes / config fields are exactly those the engines' loaders read (written out below from
their source, file cited), and exports re-import to identical weights and outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.heads import get_head_class, head_types
from specdec.heads.export_common import ExportError
from specdec.train.export import ENGINE_FORMATS, check_format, formats_for
from specdec.train.export.cli import main

# The matrix: which engine formats each head type must be written in.
REQUIRED = {"eagle3": ["sglang", "speculators", "vllm"], "eagle": ["sglang", "vllm"],
            "medusa": ["tgi", "vllm"], "mlp_speculator": ["tgi", "vllm"], "redrafter": ["trtllm"],
            "draft_lm": ["sglang", "vllm"]}


def build(head_type: str, target, **fields):
    torch.manual_seed(0)
    head = get_head_class(head_type).from_target(target, **fields)
    with torch.no_grad():   # non-trivial values everywhere (norms, biases, zero-init blocks)
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return head


@pytest.fixture(scope="module")
def eagle3(tiny_target):
    head = build("eagle3", tiny_target, draft_vocab_size=64, aux_layers=[1, 2, 3])
    head.set_draft_vocab(torch.randperm(tiny_target.vocab_size))   # a scattered draft vocab
    return head


def weights(folder: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(folder / name))


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def shapes(tensors: dict) -> dict:
    return {k: tuple(v.shape) for k, v in tensors.items()}


# --------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("head_type", head_types())
def test_every_pair_exports_or_refuses(head_type, tiny_target, tmp_path):
    if head_type in REQUIRED:
        assert formats_for(head_type) == REQUIRED[head_type]
    # a configuration every format holds (TGI loads tied MLPSpeculators only)
    head = build(head_type, tiny_target, **({"tie_weights": True} if head_type == "mlp_speculator" else {}))
    for fmt in ENGINE_FORMATS:
        if fmt in formats_for(head_type):
            out = head.export(fmt, tmp_path / fmt, tiny_target)
            assert (out / "config.json").exists() and (out / "specdec.json").exists()
            assert list(out.glob("*.safetensors"))
            assert "## Use it" in (out / "README.md").read_text()
        else:
            with pytest.raises(ExportError) as err:
                check_format(head_type, fmt)
            msg = str(err.value)
            assert f"a {head_type} head cannot be written in the {fmt!r} format" in msg
            assert all(f in msg for f in formats_for(head_type))


# --------------------------------------------------------------------------- EAGLE-3
def eagle3_names(c) -> dict:
    """vLLM vllm/model_executor/models/llama_eagle3.py (LlamaModel / Eagle3LlamaForCausalLM
    .load_weights: d2t -> draft_id_to_target_id, t2d skipped, lm_head kept, everything else under
    model.: fc, layers.0.{hidden_norm,input_layernorm,self_attn.*,post_attention_layernorm,mlp.*},
    norm; qkv read 2H), identical in speculators src/speculators/models/eagle3/core.py."""
    H, I, V, Vd = c.hidden_size, c.intermediate_size, c.vocab_size, c.draft_vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = {"hidden_norm.weight": (H,), "input_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
             "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
             "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (I, H),
             "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    return {"fc.weight": (H, len(c.aux_layers) * H), "norm.weight": (H,), "lm_head.weight": (Vd, H),
            "d2t": (Vd,), "t2d": (V,), **{f"layers.0.{k}": v for k, v in layer.items()}}


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle3_speculators_layout(fmt, eagle3, tiny_target, tmp_path):
    out = eagle3.export(fmt, tmp_path / fmt, tiny_target)
    c, t = eagle3.config, weights(out)
    assert shapes(t) == eagle3_names(c)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    cfg = config(out)
    # vLLM transformers_utils/configs/speculators/base.py validate_speculators_config + algos.py
    assert cfg["speculators_model_type"] == "eagle3"
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1
    assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["verifier"]["name_or_path"] == str(Path(tiny_target.path).resolve())
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cfg["draft_vocab_size"] == 64 and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # the layer config builds the draft's LlamaConfig with the target's shapes and RoPE
    from transformers import LlamaConfig

    lc = LlamaConfig(**cfg["transformer_layer_config"])
    assert (lc.num_hidden_layers, lc.vocab_size, lc.hidden_size, lc.head_dim) == (1, 320, 64, 16)
    assert lc.rope_parameters["rope_theta"] == tiny_target.config.rope_parameters["rope_theta"]


def test_eagle3_sglang_layout(eagle3, tiny_target, tmp_path):
    """sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3 with model.midlayer.*, fc, norm,
    lm_head, d2t (hot tokens), t2d; unknown names are skipped silently there, so they must match."""
    out = eagle3.export("sglang", tmp_path / "sg", tiny_target)
    expect = {k.replace("layers.0.", "midlayer."): v for k, v in eagle3_names(eagle3.config).items()}
    assert shapes(weights(out)) == expect
    cfg = config(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 64 and cfg["num_hidden_layers"] == 1
    # SGLang adds 1 to each id (set_eagle3_layers_to_capture); vLLM reads the top-level ids as is.
    assert [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == [1, 2, 3]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_eagle3_refuses_what_an_engine_cannot_run(tiny_target, tmp_path):
    head = build("eagle3", tiny_target, norm_before_residual=True)
    with pytest.raises(ExportError, match="norm_before_residual"):   # SGLang: residual = raw g
        head.export("sglang", tmp_path / "x", tiny_target)
    assert config(head.export("vllm", tmp_path / "v", tiny_target))["norm_before_residual"] is True
    # vLLM's and SGLang's fc read exactly 3 x hidden; speculators sizes fc from the aux ids
    two = build("eagle3", tiny_target, aux_layers=[1, 3])
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="exactly 3 target layers"):
            two.export(fmt, tmp_path / fmt, tiny_target)
    out = two.export("speculators", tmp_path / "sp", tiny_target)
    assert config(out)["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert weights(out)["fc.weight"].shape == (64, 128)
    # vLLM / SGLang capture hidden_states + residual before a layer: None before layer 0
    embeds = build("eagle3", tiny_target, aux_layers=[0, 2, 3])
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="aux layer 0"):
            embeds.export(fmt, tmp_path / f"e{fmt}", tiny_target)


def read_eagle3(folder: Path):
    """A small reader: rebuild a specdec EAGLE-3 head from a foreign export using only its
    config.json and tensors (speculators/vLLM or SGLang layout)."""
    from specdec.heads.eagle3 import Eagle3Head

    cfg, t = config(folder), weights(folder)
    if "speculators_model_type" in cfg:
        layer, aux = cfg["transformer_layer_config"], cfg["eagle_aux_hidden_state_layer_ids"]
        nbr = cfg["norm_before_residual"]
    else:
        layer, nbr = cfg, False
        aux = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        t = {k.replace("midlayer.", "layers.0.", 1): v for k, v in t.items()}
    head = Eagle3Head(Eagle3Head.Config(
        hidden_size=layer["hidden_size"], vocab_size=layer["vocab_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=layer["rope_parameters"], aux_layers=aux, norm_before_residual=nbr,
        max_position_embeddings=layer["max_position_embeddings"],
        draft_vocab_size=cfg["draft_vocab_size"], num_target_layers=max(aux) + 3))
    missing, unexpected = head.load_state_dict(t, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "verifier_lm_head")) for k in missing)
    return head


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle3_round_trip(fmt, eagle3, tiny_target, tmp_path):
    back = read_eagle3(eagle3.export(fmt, tmp_path / fmt, tiny_target))
    back.attach_target(tiny_target)
    ours, theirs = eagle3.saved_state_dict(), back.saved_state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 320, (2, 9), generator=g),
             "aux": torch.randn(2, 9, 3 * 64, generator=g),
             "attention_mask": torch.ones(2, 9, dtype=torch.bool)}
    with torch.no_grad():
        for a, b in zip(eagle3.eval().unroll(batch, 3), back.eval().unroll(batch, 3)):
            assert torch.equal(eagle3.logit_input(a) @ eagle3.lm_head.weight.T,
                               back.logit_input(b) @ back.lm_head.weight.T)
    assert torch.equal(back.token_map, eagle3.token_map)


# --------------------------------------------------------------------------- EAGLE
def eagle_names(c) -> dict:
    """vLLM llama_eagle.py (EagleLlamaForCausalLM: fc without bias, layer 0 without
    input_layernorm) = sglang llama_eagle.py (LlamaForCausalLMEagle, whose fc has a bias)."""
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"fc.weight": (H, 2 * H), "layers.0.self_attn.q_proj.weight": (q, H),
            "layers.0.self_attn.k_proj.weight": (kv, H), "layers.0.self_attn.v_proj.weight": (kv, H),
            "layers.0.self_attn.o_proj.weight": (H, q), "layers.0.post_attention_layernorm.weight": (H,),
            "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
            "layers.0.mlp.down_proj.weight": (H, I)}


def test_eagle_layouts(tiny_target, tmp_path):
    head = build("eagle", tiny_target)
    vl = head.export("vllm", tmp_path / "v", tiny_target)
    assert shapes(weights(vl)) == eagle_names(head.config)
    assert config(vl)["architectures"] == ["LlamaForCausalLM"]   # -> EagleLlamaForCausalLM
    sg = head.export("sglang", tmp_path / "s", tiny_target)
    t = weights(sg)
    assert shapes(t) == {**eagle_names(head.config), "fc.bias": (64,)}
    assert not t["fc.bias"].any()                                  # no bias trained: zeros
    assert config(sg)["architectures"] == ["LlamaForCausalLMEagle"]
    for name, w in head.saved_state_dict().items():
        assert torch.equal(t[name], w)
    biased = build("eagle", tiny_target, fc_bias=True)
    with pytest.raises(ExportError, match="fc.bias"):
        biased.export("vllm", tmp_path / "b", tiny_target)
    assert torch.equal(weights(biased.export("sglang", tmp_path / "bs", tiny_target))["fc.bias"],
                       biased.fc.bias)


# --------------------------------------------------------------------------- Medusa
def test_medusa_layouts_round_trip(tiny_target, tmp_path):
    head = build("medusa", tiny_target, num_heads=3, num_layers=2)
    H, V = 64, 320
    vl = head.export("vllm", tmp_path / "v", tiny_target)
    # vLLM model_executor/models/medusa.py: blocks.{k}.layers.{j}.weight/bias (bias iff
    # medusa_fc_bias), lm_heads.{k}.weight; configs/medusa.py renames *num*heads* / *num*layers*.
    expect = {f"lm_heads.{k}.weight": (V, H) for k in range(3)}
    for k in range(3):
        for j in range(2):
            expect |= {f"blocks.{k}.layers.{j}.weight": (H, H), f"blocks.{k}.layers.{j}.bias": (H,)}
    t = weights(vl)
    assert shapes(t) == expect
    cfg = config(vl)
    assert (cfg["model_type"], cfg["architectures"], cfg["medusa_fc_bias"]) == ("medusa", ["MedusaModel"], True)
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, H, V)
    # TGI layers/medusa.py (MedusaHeadV1): {k}.{j}.linear.weight/bias, {k}.{L}.weight in
    # medusa_lm_head.safetensors; models/__init__.py needs medusa_num_heads + base_model_name_or_path
    # and layers/speculative.py takes the Medusa path only when config.json has no architectures.
    tg = head.export("tgi", tmp_path / "t", tiny_target)
    tt = weights(tg, "medusa_lm_head.safetensors")
    tgi = {f"{k}.2.weight": (V, H) for k in range(3)}
    for k in range(3):
        for j in range(2):
            tgi |= {f"{k}.{j}.linear.weight": (H, H), f"{k}.{j}.linear.bias": (H,)}
    assert shapes(tt) == tgi
    cfg = config(tg)
    assert "architectures" not in cfg and (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 2)
    assert cfg["base_model_name_or_path"] == str(Path(tiny_target.path).resolve())
    # round trip: the TGI names are Medusa's own, prefixed "medusa_head." in specdec
    back = get_head_class("medusa")(head.config)
    back.load_state_dict({f"medusa_head.{k}": v for k, v in tt.items()}, strict=False)
    x = torch.randn(5, H)
    with torch.no_grad():
        assert torch.equal(back.head_logits(x), head.head_logits(x))
        for k in range(3):
            assert torch.equal(t[f"blocks.{k}.layers.1.bias"], head.medusa_head[k][1].linear.bias)


# --------------------------------------------------------------------------- MLPSpeculator
@pytest.mark.parametrize("tie", [False, True])
def test_mlp_speculator_layout(tie, tiny_target, tmp_path):
    head = build("mlp_speculator", tiny_target, n_predict=3, inner_dim=32, tie_weights=tie)
    H, V, I = 64, 320, 32
    # vLLM model_executor/models/mlp_speculator.py (strips "speculator.") and TGI layers/mlp.py
    # (reads "speculator." + emb/proj/head/ln.{i}; tied: emb.0, proj.0, proj.1, head.0, ln.0).
    expect = {}
    for i in range(3):
        expect |= {f"speculator.emb.{i}.weight": (V, I), f"speculator.head.{i}.weight": (V, I),
                   f"speculator.proj.{i}.weight": (I, H if i == 0 else I),
                   f"speculator.ln.{i}.weight": (I,), f"speculator.ln.{i}.bias": (I,)}
    for fmt in ("vllm", "tgi") if tie else ("vllm",):
        out = head.export(fmt, tmp_path / fmt, tiny_target)
        t = weights(out)
        assert shapes(t) == expect
        sd = head.saved_state_dict()
        assert all(torch.equal(t[f"speculator.{k}"], v) for k, v in sd.items())   # round trip
        cfg = config(out)
        assert cfg["model_type"] == "mlp_speculator"
        assert cfg["architectures"] == ["MLPSpeculatorPreTrainedModel"]
        assert {k: cfg[k] for k in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "tie_weights",
                                    "scale_input")} == dict(vocab_size=V, emb_dim=H, inner_dim=I,
                                                            n_predict=3, tie_weights=tie, scale_input=False)
        assert len(cfg["top_k_tokens_per_head"]) == 3 and cfg["base_model_name_or_path"]
    if not tie:   # TGI >= 2.3 layers/mlp.py: `self.emb.weight *=` on a ModuleList, AttributeError
        with pytest.raises(ExportError, match="tie_weights=True"):
            head.export("tgi", tmp_path / "tgi", tiny_target)
        assert not (tmp_path / "tgi").exists()
    # TGI >= 2.3 applies scale_input (layers/mlp.py MLPSpeculatorHead.forward: simple_norm, x/rms/sqrt2)
    scaled = build("mlp_speculator", tiny_target, scale_input=True, tie_weights=True)
    out = scaled.export("tgi", tmp_path / "s", tiny_target)
    assert config(out)["scale_input"] is True
    assert "Needs TGI >= 2.3" in (out / "README.md").read_text()
    x = torch.randn(5, H)
    tgi_norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 2 ** -0.5
    assert torch.allclose(scaled.initial_state(x), tgi_norm, atol=1e-6)


@pytest.mark.parametrize("head_type", ["medusa", "mlp_speculator"])
def test_tgi_exports_carry_the_tokenizer(head_type, tiny_target, tmp_path):
    """TGI's router loads the tokenizer and the chat template from --model-id, the draft folder
    (router/src/server.rs: AutoTokenizer.from_pretrained(model_id), tokenizer_config.json's
    chat_template); its fallback to base_model_name_or_path needs a config without model_type, so
    an MLPSpeculator folder without them stops TGI at startup, a Medusa one serves no chat."""
    from transformers import AutoTokenizer

    head = build(head_type, tiny_target, **({"tie_weights": True} if head_type == "mlp_speculator" else {}))
    out = head.export("tgi", tmp_path / "t", tiny_target)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    # a class transformers 4 (TGI's) imports too, and the template inline, where TGI reads it
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == tiny_target.tokenizer.chat_template
    assert cfg["eos_token"] == tiny_target.tokenizer.eos_token
    assert not (out / "chat_template.jinja").exists()
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "Speculative decoding, verified: é!"
    assert tok(text)["input_ids"] == tiny_target.tokenizer(text)["input_ids"]
    assert "`tokenizer.json`" in (out / "README.md").read_text()
    vllm = head.export("vllm", tmp_path / "v", tiny_target)
    assert not (vllm / "tokenizer.json").exists()   # vLLM takes the verifier's


# --------------------------------------------------------------------------- draft LM
@pytest.mark.parametrize("fields", [{}, {"draft_hidden_size": 48, "num_layers": 1, "tie_word_embeddings": True}])
def test_draft_lm_is_an_hf_llama_both_engines_load(fields, tiny_target, tmp_path):
    """vLLM (method draft_model) and SGLang (STANDALONE) load a draft model as an ordinary HF causal
    LM folder: transformers must load ours and compute the head's own logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    head = build("draft_lm", tiny_target, **fields).eval()
    ids = torch.randint(0, tiny_target.vocab_size, (2, 11))
    with torch.no_grad():
        ours = head.draft_hidden({"input_ids": ids}) @ head.lm_weight().T
    for fmt in ("vllm", "sglang"):
        out = head.export(fmt, tmp_path / fmt, tiny_target)
        cfg = config(out)
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["hidden_size"] == head.config.draft_hidden_size
        assert cfg["num_hidden_layers"] == head.config.num_layers
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = model(ids).logits
        assert torch.allclose(theirs, ours, atol=1e-4), (theirs - ours).abs().max()
        assert AutoTokenizer.from_pretrained(str(out))("a b")["input_ids"] == tiny_target.tokenizer("a b")["input_ids"]
    assert '"method": "draft_model"' in (tmp_path / "vllm" / "README.md").read_text()
    assert "STANDALONE" in (tmp_path / "sglang" / "README.md").read_text()


# --------------------------------------------------------------------------- ReDrafter
@pytest.mark.parametrize("exit_dim", [0, 48])
def test_redrafter_trtllm_layout_round_trip(exit_dim, tiny_target, tmp_path):
    head = build("redrafter", tiny_target, exit_dim=exit_dim, num_draft_layers=2)
    H, V = 64, 320
    E = exit_dim or 2 * H
    out = head.export("trtllm", tmp_path / "t", tiny_target)
    # TensorRT-LLM examples/redrafter/convert_checkpoint.py (hf_drafter): input_proj.weight/bias
    # iff hidden_size * 2 != exit_dim, lm_head.{j}.linear.weight/bias for j < num_draft_layers,
    # lm_head.{num_draft_layers}.weight, rnn_u.weight/bias + rnn_w.weight iff rnn; its config
    # reads hidden_size, exit_dim, num_draft_layers, rnn (Apple's DrafterConfig, model_type
    # recurrent_drafting_drafter).
    expect = {"lm_head.2.weight": (V, E), "rnn_u.weight": (H, H), "rnn_u.bias": (H,), "rnn_w.weight": (H, H)}
    for j in range(2):
        expect |= {f"lm_head.{j}.linear.weight": (E, E), f"lm_head.{j}.linear.bias": (E,)}
    if E != 2 * H:
        expect |= {"input_proj.weight": (E, 2 * H), "input_proj.bias": (E,)}
    t = weights(out)
    assert shapes(t) == expect
    cfg = config(out)
    assert {k: cfg[k] for k in ("model_type", "hidden_size", "vocab_size", "exit_dim", "num_draft_layers", "rnn")} \
        == {"model_type": "recurrent_drafting_drafter", "hidden_size": H, "vocab_size": V, "exit_dim": E,
            "num_draft_layers": 2, "rnn": True}
    assert "--drafter_model_dir" in (out / "README.md").read_text()
    back = get_head_class("redrafter")(head.config)  # the export's tensors drive the same head
    back.load_state_dict(t, strict=False)
    h, s = torch.randn(5, H), torch.randn(5, H)
    with torch.no_grad():
        assert torch.equal(back.exit_features(h, back.next_state(s, h)), head.exit_features(h, head.next_state(s, h)))


# --------------------------------------------------------------------------- the CLI
@pytest.fixture
def head_dir(tmp_path, eagle3):
    d = tmp_path / "run" / "final"
    eagle3.save_pretrained(d)
    ev = {"step": 12, "depth": 3, "correct": [40, 20, 8], "count": [80, 80, 80],
          "reach": [0.5, 0.25, 0.1], "acceptance": [0.5, 0.5, 0.4], "tau": 1.85, "ece": 0.1,
          "num_sequences": 4}
    (d / "eval.json").write_text(json.dumps(ev))
    (d / "recipe.yaml").write_text("data: {files: [my.jsonl], max_length: 128}\noptim: {lr: 0.0003}\n")
    return d


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_cli_exports_with_records(head_dir, tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main([str(head_dir), "--format", "vllm", "--out", str(out),
                 "--target", str(tiny_target_dir), "--verifier", "acme/tiny", "--dtype", "bfloat16"]) == 0
    assert "wrote the vllm export" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "specdec.json",
                                               "README.md", "eval.json", "recipe.resolved.yaml"}
    t = weights(out)
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    cfg = config(out)
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "acme/tiny"
    card = (out / "README.md").read_text()
    assert "| 2 | 0.250 | 0.500 | 20 / 80 |" in card and "tau = 1.850" in card
    assert "my.jsonl" in card and "base_model: acme/tiny" in card and str(out.resolve()) in card
    assert leftovers(tmp_path) == []


def test_cli_refuses_a_format_naming_the_ones_that_work(tmp_path, tiny_target, tiny_target_dir, capsys):
    build("medusa", tiny_target).save_pretrained(tmp_path / "medusa")
    out = tmp_path / "exp"
    assert main([str(tmp_path / "medusa"), "--format", "sglang", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "a medusa head cannot be written in the 'sglang' format" in err
    assert "tgi, vllm" in err and "eagle, eagle3" in err and "Traceback" not in err
    assert not out.exists()


def test_cli_names_the_target_problem(head_dir, tmp_path, capsys):
    # the head records the tiny target by its folder name, which is not loadable by name
    assert main([str(head_dir), "--format", "vllm", "--out", str(tmp_path / "x")]) == 1
    assert "--target" in capsys.readouterr().err
    other = tmp_path / "other"
    from specdec.infer.tiny import build_tiny_target

    build_tiny_target(other, seed=0, hidden_size=32, intermediate_size=64)
    assert main([str(head_dir), "--format", "vllm", "--out", str(tmp_path / "x"),
                 "--target", str(other)]) == 1
    assert "hidden_size" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_names_the_head_folder_to_export(head_dir, tiny_target_dir, tmp_path, capsys):
    """A run's output.dir, one of its checkpoints or an export is not a head folder: the error names
    the folder to export instead of a bare 'no config.json' / 'no head_type'."""
    import shutil

    run = head_dir.parent   # <output.dir>/final, as specdec-train writes it
    ckpt = run / "checkpoints" / "step-00000040"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    export = tmp_path / "exp"
    assert main([str(head_dir), "--format", "vllm", "--out", str(export),
                 "--target", str(tiny_target_dir)]) == 0
    capsys.readouterr()
    cases = {run: f"export the trained head, {run / 'final'}",
             ckpt: f"checkpoint, not a head folder: export the trained head, {run / 'final'}",
             export: "already an engine export", tmp_path / "missing": "does not exist"}
    for src, says in cases.items():
        assert main([str(src), "--format", "vllm", "--out", str(tmp_path / "x")]) == 1
        assert says in capsys.readouterr().err
    shutil.rmtree(run / "final")   # interrupted: no final/ yet
    assert main([str(run), "--format", "vllm", "--out", str(tmp_path / "x")]) == 1
    assert "run the same specdec-train command again" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_is_atomic(head_dir, tiny_target_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "exp"
    args = [str(head_dir), "--format", "sglang", "--out", str(out), "--target", str(tiny_target_dir)]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(args) == 1 and "already exists" in capsys.readouterr().err

    from specdec.heads.eagle3 import Eagle3Head

    def broken(self, out_dir, target):   # dies half-way through writing
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise ExportError("disk full")

    monkeypatch.setattr(Eagle3Head, "_export_sglang", broken)
    assert main(args + ["--force"]) == 1
    assert "disk full" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before   # the old export survives
    assert leftovers(tmp_path) == []
    fresh = tmp_path / "fresh"
    assert main([*args[:4], str(fresh), *args[5:]]) == 1 and not fresh.exists()
    monkeypatch.undo()
    assert main(args + ["--force"]) == 0 and leftovers(tmp_path) == []


def test_an_embedded_quantised_target_says_so_in_the_card(smollm2, tmp_path):
    # the head learnt the dequantised GGUF's behaviour; the engine will load the hub original
    from specdec.train.export import export_head

    head = get_head_class("medusa").from_target(smollm2, num_heads=1)
    head.save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", "vllm", tmp_path / "exp", target=smollm2)
    notes = json.loads((out / "specdec.json").read_text())["notes"]
    assert any("SmolLM2-135M-Instruct.Q4_1.gguf, dequantised" in n for n in notes)
    assert "verifies with its full-precision weights" in (out / "README.md").read_text()
