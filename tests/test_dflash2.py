"""DFlash 2: checkpoint loading, conv and selector semantics, identity init, exactness, lossless
sampling with candidate sets."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dflash_mac.models.config import DraftConfig
from dflash_mac.models.dflash import DFlashDraftModel
from dflash_mac.models.dflash2 import DFlash2DraftModel, GroupedDynamicCausalConv
from helpers.oracle import with_drafter
from helpers.tiny import draft_config
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3
from test_greedy_exact import PROMPTS, baseline, run
from test_sampling import SMALL_TARGET, V, chi_square_p, dflash_samples, exact_joint

from dflash_mac.engine.verify import SamplingParams
from dflash_mac.loading.loader import LoadedPair, load_drafter
from dflash_mac.target.capture import FeatureCapture
from dflash_mac.target.structure import target_head

REFERENCE = Path(__file__).parent / "data" / "reference"


def d2_config(
    tcfg: dict, mask_id: int, layers: int = 1, group: int = 16, rank: int = 16, top_k: int = 4, **kw
) -> dict:
    cfg = draft_config(tcfg, mask_id, layers=layers, arch="DFlash2DraftModel", **kw)
    cfg["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=group, selector_rank=rank, selector_top_k=top_k
    )
    return cfg


def randomize(drafter: DFlash2DraftModel, seed: int, scale: float = 0.5) -> DFlash2DraftModel:
    """Move the DFlash 2 parts off their identity initialisation (convs, codebooks)."""
    mx.random.seed(seed)
    new = {}
    for k, v in tree_flatten(drafter.parameters()):
        if "conv" in k or "candidate_selector" in k:
            new[k] = v + mx.random.normal(v.shape) * scale
    drafter.load_weights(list(new.items()), strict=False)
    return drafter


def context_cache(pair, drafter, prompt: list[int]):
    cache = drafter.make_cache()
    with FeatureCapture(pair.target, drafter.config.target_layer_ids) as cap:
        pair.target(mx.array([prompt]))
        drafter.extend_context(cap.features(), cache)
    return cache


# -- checkpoint format ---------------------------------------------------------------------------


def scaled_checkpoint(folder: Path) -> tuple[dict, set[str]]:
    """A checkpoint with exactly the key structure of the real DFlash 2 (muse) tensor list, at
    scaled-down shapes; returns its config and key set."""
    import json

    real = json.loads((REFERENCE / "dflash2-muse-config.json").read_text())
    H, V, R, inter, hd, nq, nkv, L = 64, 320, 16, 96, 16, 4, 2, real["num_hidden_layers"]
    n_tgt = len(real["dflash_config"]["target_layer_ids"])
    cfg = dict(
        real,
        hidden_size=H,
        vocab_size=V,
        intermediate_size=inter,
        head_dim=hd,
        num_attention_heads=nq,
        num_key_value_heads=nkv,
        num_target_layers=12,
        max_position_embeddings=4096,
    )
    cfg["dflash_config"] = dict(
        real["dflash_config"],
        mask_token_id=V - 1,
        selector_rank=R,
        target_layer_ids=[1, 3, 5, 7, 9],
    )
    G = H // cfg["dflash_config"]["conv_group_size"]
    shapes = {
        "candidate_selector.hidden_projection.weight": (R, H),
        "candidate_selector.predecessor_codebook": (V, R),
        "candidate_selector.successor_codebook": (V, R),
        "fc.weight": (H, n_tgt * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "attention_conv.base_kernel": (2, 2, H),
        "attention_conv.kernel_projection.weight": (2 * 2 * G, H),
        "mlp_conv.base_kernel": (2, 2, H),
        "mlp_conv.kernel_projection.weight": (2 * 2 * G, H),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nq * hd, H),
        "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H),
        "self_attn.o_proj.weight": (H, nq * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }
    weights = {}
    for line in (REFERENCE / "dflash2-muse-tensors.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("\t")[0]
        if name.startswith("layers.0."):
            short = name.removeprefix("layers.0.")
            for i in range(L):
                weights[f"layers.{i}.{short}"] = mx.random.normal(shapes[short]).astype(mx.bfloat16)
        else:
            weights[name] = mx.random.normal(shapes[name]).astype(mx.bfloat16)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return cfg, set(weights)


def test_real_checkpoint_layout_loads(tmp_path):
    cfg, keys = scaled_checkpoint(tmp_path / "d2")
    assert "candidate_selector.predecessor_codebook" in keys  # stored without .weight
    dcfg = DraftConfig.from_file(tmp_path / "d2" / "config.json")
    model = load_drafter(tmp_path / "d2", dcfg)  # strict: no missing or extra key
    assert isinstance(model, DFlash2DraftModel)
    assert set(model.export_weights()) == keys
    w = mx.load(str(tmp_path / "d2" / "model.safetensors"))
    got = model.candidate_selector.predecessor_codebook.weight
    assert mx.array_equal(got, w["candidate_selector.predecessor_codebook"]).item()
    assert model.layers[4].mlp_conv.kernel_projection.weight.shape == (16, 64)


# -- conv semantics ------------------------------------------------------------------------------


def conv_numpy(x, base, dyn, group):
    """out_t = Σ_tap base[tap]·x_{t-tap} + Σ_tap dyn_t[tap]·x_{t-tap}, zero before the block,
    accumulated as out += base·x; out += dyn·x per tap (in x's dtype)."""
    B, L, H = x.shape
    dt = x.dtype.type
    dyn = np.repeat(dyn.astype(x.dtype), group, axis=-1)  # [B, L, K, H]
    out = np.zeros_like(x)
    for tap in range(base.shape[0]):
        xs = np.zeros_like(x)
        xs[:, tap:] = x[:, : L - tap]
        out = (out + base[tap].astype(dt) * xs).astype(dt)
        out = (out + dyn[:, :, tap] * xs).astype(dt)
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_conv_matches_numpy_definition(dtype):
    mx.random.seed(0)
    H, group, L = 64, 16, 6
    conv = GroupedDynamicCausalConv(H, 2, group)
    conv.base_kernel = mx.random.normal((2, 2, H))
    conv.kernel_projection.weight = mx.random.normal(conv.kernel_projection.weight.shape) * 0.3
    h = mx.random.normal((2, L, H)).astype(dtype)  # the normed sublayer input
    y = mx.random.normal((2, L, H)).astype(dtype)  # the sublayer output
    a_in, dyn = conv.prepare(h)
    out = conv.finish(y, dyn)
    np_dt = np.float32 if dtype == mx.float32 else np.float16
    dyn_np = np.array(conv.kernel_projection(h).astype(mx.float32)).reshape(2, L, 2, 2, H // group)
    base = np.array(conv.base_kernel)
    want_a = conv_numpy(
        np.array(h.astype(mx.float32)).astype(np_dt), base[0], dyn_np[:, :, 0], group
    )
    # finish: side 1 taps over y, coefficients from the INPUT h (not from y)
    want_o = conv_numpy(
        np.array(y.astype(mx.float32)).astype(np_dt), base[1], dyn_np[:, :, 1], group
    )
    np.testing.assert_array_equal(np.array(a_in.astype(mx.float32)), want_a.astype(np.float32))
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), want_o.astype(np.float32))
    # block position 0 has no left neighbour; position 1 reads position 0 only
    h2 = mx.concatenate([h[:, :1] * 0 + 7, h[:, 1:]], axis=1)
    diff = np.abs(np.array((conv.prepare(h2)[0] - a_in).astype(mx.float32))).max(axis=-1)
    assert (diff[:, 2:] == 0).all() and (diff[:, :2] > 0).all()


def test_taps_stay_inside_the_block(tiny_pair):
    """The anchor's block position 0 gets no tap from the context: changing the committed
    context only changes the block through attention, never through a conv."""
    mx.random.seed(1)
    cfg = DraftConfig.from_dict(d2_config(tiny_pair.target_config, 3))
    d = randomize(DFlash2DraftModel(cfg), 1)
    conv = d.layers[0].attention_conv
    x = mx.random.normal((1, 4, cfg.hidden_size))
    full = conv.prepare(mx.concatenate([mx.ones((1, 3, cfg.hidden_size)), x], axis=1))[0]
    alone = conv.prepare(x)[0]
    assert not mx.allclose(full[:, 3], alone[:, 0]).item()  # shows taps would matter ...
    ref = (
        conv.base_kernel[0, 0] * x[:, 0]
        + mx.repeat(conv.coefficients(x)[:, 0, 0, 0], 16, axis=-1) * x[:, 0]
    )
    assert mx.allclose(alone[:, 0], ref, atol=1e-5).item()  # ... but position 0 has no tap 1


# -- selector ------------------------------------------------------------------------------------


def test_greedy_walk_matches_python_loop(tiny_pair):
    cfg = DraftConfig.from_dict(d2_config(tiny_pair.target_config, 3, top_k=6))
    d = randomize(DFlash2DraftModel(cfg), 2)
    d.bind(target_head(tiny_pair.target))
    cache = context_cache(tiny_pair, d, [5, 9, 40, 41, 100])
    block = mx.array([[7] + [3] * 7])
    hidden = d.hidden(block, cache)[:, 1:]
    logits = d.logits(hidden)
    path, cand, _ = d.candidate_selector.walk(hidden, logits, block[:, 0])
    sel = d.candidate_selector
    lg = np.array(logits[0])
    g = np.array(sel.hidden_projection(hidden)[0])
    PC, SC = np.array(sel.predecessor_codebook.weight), np.array(sel.successor_codebook.weight)
    pred, want = 7, []
    for t in range(lg.shape[0]):
        top = np.argsort(-lg[t])[:6]
        s = [lg[t, b] + float((PC[pred] * g[t] * SC[b]).sum()) for b in top]
        pred = int(top[int(np.argmax(s))])
        want.append(pred)
    assert path[0].tolist() == want
    assert sorted(cand[0, 0].tolist()) == sorted(np.argsort(-lg[0])[:6].tolist())
    assert want != np.argmax(lg, axis=-1).tolist()  # the pair term changed the choice


def test_identity_init_equals_dflash1(tiny_pair):
    """Freshly initialised DFlash 2 (docs/design.md §10) = DFlash 1 with the same shared weights."""
    tcfg = tiny_pair.target_config
    d1 = DFlashDraftModel(DraftConfig.from_dict(draft_config(tcfg, 3, layers=2)))
    d1.update(tree_map(lambda p: p * 3, d1.parameters()))
    d2 = DFlash2DraftModel(DraftConfig.from_dict(d2_config(tcfg, 3, layers=2)))
    d2.load_weights(tree_flatten(d1.parameters()), strict=False)
    for d in (d1, d2):
        d.bind(target_head(tiny_pair.target))
    prompt, block = [1, 2, 3, 50, 60, 70], mx.array([[70] + [3] * 7])
    l1 = d1(block, context_cache(tiny_pair, d1, prompt))
    c2 = context_cache(tiny_pair, d2, prompt)
    l2 = d2(block, c2)
    assert mx.array_equal(l1, l2).item()
    drafts, q = d2.propose(block[0], c2, SamplingParams(), mx.random.key(0))
    assert q is None
    assert drafts.tolist() == mx.argmax(l1[0], axis=-1).tolist()


# -- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def d2_pair(tiny_pair):
    mask = tiny_pair.drafter.config.mask_token_id
    cfg = DraftConfig.from_dict(d2_config(tiny_pair.target_config, mask, layers=2, top_k=8))
    d = randomize(DFlash2DraftModel(cfg), 4, scale=1.0)
    d.bind(target_head(tiny_pair.target))
    mx.eval(d.parameters())  # materialised: used on worker threads
    return with_drafter(tiny_pair, d)


@pytest.mark.parametrize(
    "block_size",
    [pytest.param(2, marks=pytest.mark.slow), 5, pytest.param(8, marks=pytest.mark.slow)],
)
def test_greedy_matches_target(d2_pair, block_size):
    for p in PROMPTS[:6]:
        ids = d2_pair.tokenizer.encode(p)
        ref = baseline(d2_pair, ids, 40)
        tokens, acc, _ = run(d2_pair, ids, max_tokens=40, block_size=block_size, use_eos=False)
        assert tokens == ref
        assert all(1 <= a <= block_size for a in acc)


def test_sampling_proposal_lives_on_candidates(d2_pair):
    d = d2_pair.drafter
    cache = context_cache(d2_pair, d, [4, 5, 6, 7])
    block = mx.array([7] + [d.config.mask_token_id] * 5)
    sp = SamplingParams(temperature=0.8, top_k=5)
    drafts, q = d.propose(block, cache, sp, mx.random.key(1))
    assert q.shape == (5, 320)
    assert mx.allclose(q.sum(axis=-1), mx.ones(5), atol=1e-5).item()
    assert ((q > 0).sum(axis=-1) <= 5).all().item()  # top-k 5 of the 8 candidates
    assert (mx.take_along_axis(q, drafts[:, None], axis=-1) > 0).all().item()


@pytest.fixture(scope="module")
def small_d2_pair(tiny_pair):
    """The sampling test's 5-token target with a random DFlash 2 drafter (3 candidates)."""
    mx.random.seed(3)
    tcfg = SMALL_TARGET
    target = qwen3.Model(qwen3.ModelArgs.from_dict(tcfg))
    target.update({"model": {"embed_tokens": {"weight": mx.random.normal((V, 32)) * 0.12}}})
    cfg = DraftConfig.from_dict(d2_config(tcfg, V - 1, group=8, rank=8, top_k=3))
    drafter = randomize(DFlash2DraftModel(cfg), 5, scale=1.0)
    drafter.bind(target_head(target))
    mx.eval(target.parameters(), drafter.parameters())  # materialised: used on worker threads
    return LoadedPair(target, drafter, tiny_pair.tokenizer, "small", "small-d2", 4, tcfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sp",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
    ids=["t1", "t0.7-top_p0.9"],
)
def test_candidate_set_sampling_is_lossless(small_d2_pair, sp):
    joint = exact_joint(small_d2_pair, sp)
    samples = dflash_samples(small_d2_pair, sp, block_size=4, n=1200)
    assert chi_square_p(samples, joint) > 0.001
