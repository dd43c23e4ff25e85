"""Channel selectors (paper Sec. 3.4, App. C.7): registry, method tokens, planted answers, determinism."""

from __future__ import annotations

import re

import numpy as np
import pytest

from statereduce.selectors import (
    METHOD_REGEX,
    HeadData,
    MethodSpec,
    format_method,
    get_selector,
    n_keep_for,
    parse_method,
    select_heads,
    selector_names,
)

ALL = ["drrqr", "ghost", "grad", "l1", "rand", "swanda"]  # index selectors; pca, pca-adv: tests/test_transforms.py
TRANSFORMS = ["pca", "pca-adv"]
RNG = np.random.default_rng(0)


def call(name: str, data: HeadData, n_keep: int, variant: str = "kq", **options):
    return get_selector(name)(data, n_keep, variant=variant, rng=np.random.default_rng(0), **options)


# -- registry -------------------------------------------------------------------------------------------


def test_registry_names_needs_and_source_files():
    assert selector_names() == sorted(ALL + TRANSFORMS)
    for name in TRANSFORMS:  # one module for the pair
        assert get_selector(name).needs == {"activations"}
        assert get_selector(name).source_file.endswith("statereduce/selectors/pca.py")
    needs = {n: set(get_selector(n).needs) for n in ALL}
    assert needs == {
        "drrqr": {"activations"},
        "ghost": {"activations"},
        "grad": {"grad"},
        "l1": {"weights"},
        "rand": {"weights"},
        "swanda": {"weights", "xnorm"},
    }
    files = {n: get_selector(n).source_file for n in ALL}
    for name, path in files.items():
        assert path.endswith(f"statereduce/selectors/{name}.py"), path
    assert len(set(files.values())) == len(ALL)  # one module per selector
    assert get_selector("rand").variants == ("kq",)
    assert get_selector("drrqr").options == ("f", "reduction", "rtol")


def test_unknown_selector_lists_valid_names_and_close_matches():
    with pytest.raises(ValueError) as err:
        get_selector("drqr")
    msg = str(err.value)
    assert "\n" not in msg and "'drqr'" in msg and "did you mean 'drrqr'" in msg
    for name in ALL:
        assert name in msg


def test_bad_variant_option_and_n_keep():
    data = HeadData(W_q=RNG.standard_normal((8, 4)), W_k=RNG.standard_normal((8, 4)))
    with pytest.raises(ValueError, match="variant 'k'.*valid: \\['kq'\\]"):
        call("rand", data, 4, variant="k")
    with pytest.raises(ValueError, match="unknown option.*'alpha'.*valid: none"):
        call("l1", data, 4, alpha=1.0)
    with pytest.raises(ValueError, match="unknown option.*'ff'.*'f', 'reduction', 'rtol'"):
        call("drrqr", HeadData(K=np.eye(8), Q=np.eye(8)), 4, ff=2.0)
    for bad in (0, 9, 2.5):
        with pytest.raises(ValueError, match=f"n_keep={bad}"):
            call("l1", data, bad)
    with pytest.raises(ValueError, match="needs HeadData.W_q"):
        call("l1", HeadData(W_k=data.W_k), 4)  # "kq" needs both sides
    with pytest.raises(ValueError, match="W_k must be \\[d_k=8, hidden\\], got shape \\(4, 8\\)"):
        call("l1", HeadData(W_q=data.W_q, W_k=data.W_k.T), 4)
    with pytest.raises(ValueError, match="xnorm must be \\[hidden=4\\]"):
        call("swanda", HeadData(W_q=data.W_q, W_k=data.W_k, xnorm=np.ones(5)), 4)
    with pytest.raises(ValueError, match="non-finite channel scores"):
        call("grad", HeadData(grad_q=np.array([1.0, np.nan]), grad_k=np.ones(2)), 1)


# -- hand-built known answers ---------------------------------------------------------------------------

W_Q = np.array([[1.0, -1.0, 0.0], [0.0, 0.0, 0.5], [2.0, 0.0, 0.0], [0.0, -3.0, 0.0]])  # |row|_1 = 2, .5, 2, 3
W_K = np.array([[0.0, 0.0, 0.0], [4.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.1]])  # |row|_1 = 0, 4, 1, .1
XNORM = np.array([1.0, 0.01, 10.0])


@pytest.mark.parametrize(
    "variant,keep,scores",
    [("kq", [1, 3], [4.5, 3.1]), ("k", [1, 2], [4.0, 1.0]), ("q", [0, 3], [2.0, 3.0])],  # q: tie 0/2 -> lower index
)
def test_l1_known_answer(variant, keep, scores):
    sel = call("l1", HeadData(W_q=W_Q, W_k=W_K), 2, variant)
    assert sel.keep.dtype == np.int64 and sel.keep.tolist() == keep
    np.testing.assert_allclose(sel.scores, scores)


@pytest.mark.parametrize(
    "variant,keep,scores",
    # q: |W_Q| @ x = [1.01, 5, 2, .03]; k: |W_K| @ x = [0, 4, 1, 1] (tie 2/3 -> 2); kq: [1.01, 9, 3, 1.03]
    [("kq", [1, 2], [9.0, 3.0]), ("k", [1, 2], [4.0, 1.0]), ("q", [1, 2], [5.0, 2.0])],
)
def test_swanda_known_answer(variant, keep, scores):
    sel = call("swanda", HeadData(W_q=W_Q, W_k=W_K, xnorm=XNORM), 2, variant)
    assert sel.keep.tolist() == keep
    np.testing.assert_allclose(sel.scores, scores)
    # the input norms matter: with xnorm = 1 swanda is l1 (kq keeps [1, 3], not [1, 2])
    same = call("swanda", HeadData(W_q=W_Q, W_k=W_K, xnorm=np.ones(3)), 2, variant)
    assert same.keep.tolist() == call("l1", HeadData(W_q=W_Q, W_k=W_K), 2, variant).keep.tolist()


@pytest.mark.parametrize(
    "variant,n_keep,keep",
    [("kq", 2, [0, 3]), ("kq", 3, [0, 1, 3]), ("k", 2, [0, 2]), ("q", 2, [1, 3])],  # kq 3: tie 1/2 at .5
)
def test_grad_known_answer(variant, n_keep, keep):
    data = HeadData(grad_q=np.array([0.1, 0.5, 0.2, 0.9]), grad_k=np.array([0.8, 0.0, 0.3, 0.05]))
    assert call("grad", data, n_keep, variant).keep.tolist() == keep


def test_all_ties_keep_lowest_indices():
    data = HeadData(W_q=np.ones((6, 3)), W_k=np.ones((6, 3)), xnorm=np.ones(3), grad_q=np.ones(6), grad_k=np.ones(6))
    for name in ("l1", "swanda", "grad"):
        assert call(name, data, 3).keep.tolist() == [0, 1, 2]
    # many ties in a long vector (where an unstable sort would reorder them): lower index wins
    g = np.tile([1.0, 2.0], 64)
    sel = call("grad", HeadData(grad_q=g, grad_k=np.zeros(128)), 20)
    assert sel.keep.tolist() == list(range(1, 40, 2))


# -- planted structure ---------------------------------------------------------------------------------


def planted_activations(rng: np.random.Generator, d: int, indep: np.ndarray, N: int = 300) -> np.ndarray:
    """[N, d] activations whose channels ``indep`` are independent (norms 1 .. 0.3) and all others exact
    duplicates / combinations of the strong ones, with larger norms than the weak independent channels."""
    k = indep.size
    X = np.linalg.qr(rng.standard_normal((N, k)))[0] * np.linspace(1.0, 0.3, k)
    dep = [c for c in range(d) if c not in set(indep.tolist())]
    out = np.empty((N, d))
    out[:, indep] = X
    for t, c in enumerate(dep):
        a, b = t % (k // 2), (t + 1) % (k // 2)
        out[:, c] = 0.8 * X[:, a] if t % 2 == 0 else 0.5 * X[:, a] + 0.45 * X[:, b]
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_drrqr_never_keeps_planted_dependent_channels(dtype):
    rng = np.random.default_rng(1)
    indep = np.sort(rng.permutation(16)[:8])
    M = planted_activations(rng, 16, indep, N=600).astype(dtype)
    K, Q = M[:300], M[300:]
    norms = np.linalg.norm(M, axis=0)
    assert not set(np.argsort(-norms)[:8].tolist()) <= set(indep.tolist())  # energy alone would fail
    sel = call("drrqr", HeadData(K=K, Q=Q), 8)
    assert sel.keep.tolist() == indep.tolist()
    assert sel.scores.shape == (8,) and np.all(sel.scores > 0.1)  # omega: distance to the other kept channels


@pytest.mark.parametrize("name", ["l1", "swanda", "grad", "drrqr"])
def test_variants_use_only_their_side(name):
    """Key-side data prefers channels A, query-side data prefers B: "k" keeps A, "q" keeps B, and replacing
    the other side's data (or dropping it) changes nothing."""
    rng = np.random.default_rng(2)
    d, hidden, n_keep = 12, 10, 4
    A = np.array([0, 3, 5, 9])
    B = np.array([1, 2, 7, 11])

    def side(prefer: np.ndarray, seed: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(seed)
        w = 0.1 * r.standard_normal((d, hidden))
        w[prefer] *= 30.0
        g = r.uniform(0.0, 0.1, d)
        g[prefer] += 1.0
        act = planted_activations(r, d, prefer, N=200)
        return {"W": w, "g": g, "act": act}

    def data(k_side, q_side, drop=None):
        fields = dict(
            W_k=k_side["W"], W_q=q_side["W"], grad_k=k_side["g"], grad_q=q_side["g"],
            K=k_side["act"], Q=q_side["act"], xnorm=rng.uniform(0.5, 2.0, hidden),
        )  # fmt: skip
        for f in drop or ():
            fields[f] = None
        return HeadData(**fields)

    kA, qB, junk = side(A, 10), side(B, 11), side(np.array([4, 6, 8, 10]), 12)
    assert call(name, data(kA, qB), n_keep, "k").keep.tolist() == A.tolist()
    assert call(name, data(kA, qB), n_keep, "q").keep.tolist() == B.tolist()
    assert call(name, data(kA, junk), n_keep, "k").keep.tolist() == A.tolist()
    assert call(name, data(junk, qB), n_keep, "q").keep.tolist() == B.tolist()
    assert call(name, data(kA, qB, drop=("W_q", "grad_q", "Q")), n_keep, "k").keep.tolist() == A.tolist()
    assert call(name, data(kA, qB, drop=("W_k", "grad_k", "K")), n_keep, "q").keep.tolist() == B.tolist()
    if name != "drrqr":  # magnitude scores add up: the joint winners come from A or B
        kq = call(name, data(kA, qB), n_keep, "kq").keep
        assert set(kq.tolist()) <= set(A.tolist()) | set(B.tolist())


def test_drrqr_kq_scores_the_joint_matrix():
    """M = [K; Q]: channels independent only jointly (K and Q each rank-deficient) are found with "kq"."""
    rng = np.random.default_rng(3)
    d = 6
    K = np.zeros((100, d))
    Q = np.zeros((100, d))
    K[:, :3] = rng.standard_normal((100, 3))
    K[:, 3:] = K[:, :3] * 1.5  # in K alone, channels 3..5 duplicate 0..2
    Q[:, 3:] = rng.standard_normal((100, 3)) * 0.1  # but Q separates them (small energy)
    assert call("drrqr", HeadData(K=K, Q=Q), 3, "k").keep.tolist() == [3, 4, 5]  # larger duplicates
    k_only = call("drrqr", HeadData(K=K, Q=Q), 6, "k")
    assert np.all(k_only.scores < 1e-6)  # in K alone every channel has its duplicate among the kept ones
    joint = call("drrqr", HeadData(K=K, Q=Q), 6, "kq")
    assert joint.keep.tolist() == list(range(6)) and np.all(joint.scores > 0.05)


# -- determinism, seeds, driver ------------------------------------------------------------------------


def make_heads(n_layers: int = 2, n_heads: int = 3, d: int = 16, hidden: int = 12):
    rng = np.random.default_rng(4)
    heads = []
    for layer in range(n_layers):
        for head in range(n_heads):
            heads.append(
                (
                    layer,
                    head,
                    HeadData(
                        W_q=rng.standard_normal((d, hidden)),
                        W_k=rng.standard_normal((d, hidden)),
                        K=rng.standard_normal((50, d)).astype(np.float32),
                        Q=rng.standard_normal((50, d)).astype(np.float32),
                        xnorm=rng.uniform(0.1, 3.0, hidden),
                        grad_q=rng.uniform(0, 1, d),
                        grad_k=rng.uniform(0, 1, d),
                    ),
                )
            )
    return heads


@pytest.mark.parametrize("name", ALL)
def test_select_heads_deterministic_and_well_formed(name):
    heads = make_heads()
    a = select_heads(name, heads, 6, seed=7, progress=False)
    b = select_heads(name, iter(heads[::-1]), 6, seed=7, progress=False)  # order and laziness do not matter
    assert [(layer, head) for layer, head, _ in a] == [(layer, head) for layer, head, _ in heads]
    by_head = {(layer, head): s for layer, head, s in b}
    for layer, head, s in a:
        assert s.keep.dtype == np.int64 and s.keep.shape == (6,) and np.all(np.diff(s.keep) > 0)
        assert s.keep.tolist() == by_head[(layer, head)].keep.tolist()
        if s.scores is not None:
            assert s.scores.dtype == np.float64 and s.scores.shape == (6,)
            np.testing.assert_array_equal(s.scores, by_head[(layer, head)].scores)
    assert (a[0][2].scores is None) == (name == "rand")
    c = select_heads(name, iter(heads), 6, seed=7, progress=False, workers=2)  # thread pool, lazy input
    assert [(layer, head, s.keep.tolist()) for layer, head, s in c] == [(x, y, s.keep.tolist()) for x, y, s in a]


def test_rand_depends_on_seed_layer_and_head():
    heads = make_heads(d=64)
    s1 = [s.keep.tolist() for _, _, s in select_heads("rand", heads, 32, seed=1, progress=False)]
    s2 = [s.keep.tolist() for _, _, s in select_heads("rand", heads, 32, seed=2, progress=False)]
    assert all(x != y for x, y in zip(s1, s2))
    assert len({tuple(x) for x in s1}) == len(s1)  # every head draws its own subset


def test_select_heads_errors_name_the_head(capsys):
    heads = make_heads(n_layers=1, n_heads=2)
    heads[1] = (0, 1, HeadData(W_q=np.ones((16, 12)), W_k=np.ones((15, 12))))
    with pytest.raises(ValueError, match="layer 0 head 1: W_k must be"):
        select_heads("l1", heads, 4, progress=True)
    with pytest.raises(ValueError, match="seed=-1"):
        select_heads("l1", heads, 4, seed=-1, progress=False)
    with pytest.raises(ValueError, match="variant 'q'"):
        select_heads("rand", heads, 4, variant="q", progress=False)
    with pytest.raises(ValueError, match="layer 0 head 1: W_k must be"):
        select_heads("l1", heads, 4, progress=False, workers=2)
    with pytest.raises(ValueError, match="workers=0"):
        select_heads("l1", heads, 4, progress=False, workers=0)


# -- method tokens ---------------------------------------------------------------------------------------

GOOD = {
    "drrqr": MethodSpec("drrqr", "kq", "default"),
    "l1-q": MethodSpec("l1", "q", "default"),
    "grad-k": MethodSpec("grad", "k", "default"),
    "rand": MethodSpec("rand", "kq", "default"),
    "swanda-k": MethodSpec("swanda", "k", "default"),
    "drrqr.prose": MethodSpec("drrqr", "kq", "prose"),
    "grad-q.prose": MethodSpec("grad", "q", "prose"),
    "rand.c4": MethodSpec("rand", "kq", "c4"),
    "l1.defaults": MethodSpec("l1", "kq", "defaults"),
}
BAD = [
    "", "drqr", "DRRQR", "drrqr-kq", "drrqr-x", "rand-k", "rand-q", "drrqr-k-q", "drrqr.", "drrqr.Prose",
    "drrqr.default", "grad-k.default", "drrqr.a_b", "drrqr.a.b", "l1_q", "-k", ".c4", "drrqr-",
]  # fmt: skip


@pytest.mark.parametrize("token", list(GOOD))
def test_parse_format_round_trip(token):
    spec = parse_method(token)
    assert spec == GOOD[token]
    assert format_method(spec) == token
    assert re.fullmatch(METHOD_REGEX, token)


@pytest.mark.parametrize("token", BAD)
def test_bad_tokens_rejected_by_parser_and_regex(token):
    with pytest.raises(ValueError) as err:
        parse_method(token)
    msg = str(err.value)
    assert repr(token) in msg or "'drqr'" in msg
    assert "drrqr" in msg and "\n" not in msg
    assert re.fullmatch(METHOD_REGEX, token) is None


def test_regex_in_a_snakemake_path():
    pattern = re.compile(rf"results/(?P<model>[^/]+)/(?P<method>{METHOD_REGEX})_(?P<pct>\d+)/eval\.json")
    m = pattern.fullmatch("results/gdn1.3b/grad-q.prose_50/eval.json")
    assert m and m["method"] == "grad-q.prose" and m["pct"] == "50"
    assert pattern.fullmatch("results/tiny/drrqr.default_50/eval.json") is None
    assert pattern.fullmatch("results/tiny/rand-k_50/eval.json") is None


def test_format_rejects_invalid_specs():
    for spec in (MethodSpec("rand", "k"), MethodSpec("nope"), MethodSpec("l1", "kq", "Bad!"), MethodSpec("l1", "x")):
        with pytest.raises(ValueError):
            format_method(spec)


# -- compression ratio ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d_k,pct,n_keep", [(128, 50, 64), (128, 75, 32), (128, 30, 90), (256, 50, 128), (4, 25, 3), (5, 50, 3),
                       (64, 1.6, 63)]
)
def test_n_keep_for(d_k, pct, n_keep):
    assert n_keep_for(d_k, pct) == n_keep


@pytest.mark.parametrize("d_k,pct", [(128, 0), (128, 100), (128, -5), (128, 150), (2, 75), (1, 60), (0, 50)])
def test_n_keep_for_rejects(d_k, pct):
    with pytest.raises(ValueError) as err:
        n_keep_for(d_k, pct)
    assert f"{d_k}" in str(err.value)
    if d_k > 0:
        assert f"pct={pct}" in str(err.value)


@pytest.mark.parametrize("d, pct, side", [(64, 0.5, "key"), (1, 10, "key"), (64, 0.78, "value")])
def test_n_keep_for_refuses_a_pct_that_removes_no_channel(d, pct, side):
    """A fraction written for a percent (0.5 meaning half) removes round(d * pct / 100) = 0 channels: one line that
    names the pct, the width and what pcts are, never a selection that keeps every channel."""
    name = "d_v" if side == "value" else "d_k"
    with pytest.raises(ValueError) as err:
        n_keep_for(d, pct, side)
    assert str(err.value) == (f"pct {pct:g} removes no {side} channel of {name}={d} (round({d}*{pct:g}/100) = 0); "
                              "pcts are percent of channels removed, e.g. drrqr_50 removes half")
